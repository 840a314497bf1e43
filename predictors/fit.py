"""Fitting one layer's predictor: the network, its threshold for a target recall, the metrics, the training loop.

Predictor of layer l: Linear(d_model -> h_l, no bias) -> ReLU -> Linear(h_l -> n_neurons, no bias); neuron j is
computed iff logit_j >= threshold_l. Loss: BCE with a per-neuron positive weight (class balance), optionally with
active pairs weighted by their magnitude. Early stopping and the threshold use the val split; the reported
metrics come from the test split, which nothing was tuned on. The powerinfer form (predictors/form.py) is fitted
the same way with each row's logits multiplied by its pre-norm scale.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from hotneurons.artifacts.predictor_file import Predictor
from hotneurons.artifacts.predictors import PredictorForm
from hotneurons.common.kinds import choose
from torch import nn

NEVER = float(torch.finfo(torch.float32).max)  # threshold of a layer with no active sample (JSON has no inf)
RECALL_GRID = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.97, 0.99)  # thresholds tabulated for pi-eval --recall
MOVE_DIVISOR = 256.0  # powerinfer form: a moved layer's threshold, -(median |logit| on val) / this


@dataclass(frozen=True)
class PredictorConfig:
    """Training and sizing settings. Named presets in PRESETS; CLI flags override single fields."""

    name: str = "default"
    # what the predictor reads and how thresholds are shared (predictors/form.py): "normed" (the FFN input, a
    # threshold per layer) or "powerinfer" (the residual before the pre-FFN RMSNorm, one threshold for all layers)
    form: str = "normed"
    target_recall: float = 0.95  # the threshold is set on the val split so that this share of actives is caught
    max_predictor_fraction: float = 0.10  # total predictor params / total FFN params
    # sizing (docs/predictors.md): h_base = base_scale * n_neurons * active_share * (share80 / 0.8)
    base_scale: float = 0.125
    min_hidden: int = 16
    hidden_multiple: int = 16  # sizes are rounded to this (GEMM-friendly)
    skew_cut: float = 0.5  # share80 below this: a skewed layer, searched downwards; else upwards
    shrink_factor: float = 0.5
    grow_factor: float = 1.5
    shrink_tolerance: float = 0.01  # keep a smaller h if val predicted sparsity drops by at most this
    grow_min_gain: float = 0.01  # keep a larger h only if val predicted sparsity rises by at least this
    max_steps: int = 2  # size changes tried per layer
    # optimisation
    epochs: int = 8
    patience: int = 2  # epochs without val improvement before stopping
    batch_size: int = 1024
    lr: float = 5e-3
    weight_decay: float = 0.01
    max_pos_weight: float = 50.0
    # importance of an active pair in the loss: (|h| / scale) ** magnitude_weight, capped at magnitude_cap, where
    # scale is tau_l (thresholded models) or the layer's median active |h| (ReLU); 0 = plain class balance.
    # Needs the model (h is recomputed from the stored x). Missing a large activation costs more perplexity.
    magnitude_weight: float = 1.0
    magnitude_cap: float = 10.0
    val_fraction: float = 0.1
    test_fraction: float = 0.1
    seed: int = 0


PRESETS: dict[str, PredictorConfig] = {
    "default": PredictorConfig(),
    "fast": PredictorConfig(name="fast", epochs=4, patience=1, max_steps=1),
    "thorough": PredictorConfig(name="thorough", epochs=20, patience=4, max_steps=3, base_scale=0.25),
    "plain": PredictorConfig(name="plain", magnitude_weight=0.0),  # class balance only; needs no model
}


def preset(name: str, **overrides: Any) -> PredictorConfig:
    """A named preset with some fields replaced (None values are ignored)."""
    cfg = replace(PRESETS[choose(name, PRESETS, "predictor preset", param="preset")],
                  **{k: v for k, v in overrides.items() if v is not None})
    cfg = replace(cfg, form=choose(cfg.form, PredictorForm, "predictor form", param="form").value)
    if not 0 < cfg.target_recall < 1:
        raise _bad(f"the target recall {cfg.target_recall} must be in (0, 1), e.g. 0.95", "target_recall")
    if not 0 < cfg.max_predictor_fraction <= 1:
        raise _bad(f"the maximum predictor fraction {cfg.max_predictor_fraction} must be in (0, 1], e.g. 0.1",
                   "max_predictor_fraction")
    return cfg


def _bad(message: str, param: str) -> ValueError:
    e = ValueError(message)
    e.params = (param,)  # the CLI names the flag (common/cli.py)
    return e


def n_params(d_model: int, hidden: int, n_neurons: int) -> int:
    return hidden * (d_model + n_neurons)


# ---------------------------------------------------------------------------------------------------------------
# Thresholds and metrics


def threshold_for_recall(logits: torch.Tensor, mask: torch.Tensor, recall: float) -> float:
    """The largest logit threshold t with recall(logit >= t) >= `recall` (over all (row, neuron) pairs).

    With P positives sorted ascending, keeping those >= the k-th smallest (k = P - ceil(recall * P) + 1) keeps at
    least ceil(recall * P) of them, and any larger threshold keeps fewer.
    """
    pos = logits[mask]  # (P,)
    if pos.dtype in (torch.float16, torch.bfloat16):
        pos = pos.float()
    if pos.numel() == 0:
        return NEVER  # nothing fires here: predict nothing
    keep = math.ceil(recall * pos.numel() - 1e-9)
    k = pos.numel() - keep + 1
    return float(torch.kthvalue(pos, max(1, k)).values)


def metrics(logits: torch.Tensor, mask: torch.Tensor, threshold: float) -> dict[str, float]:
    """recall, precision, predicted sparsity (share of pairs not predicted), true sparsity."""
    pred = logits >= threshold
    tp = int((pred & mask).sum())
    n_pred, n_true = int(pred.sum()), int(mask.sum())
    return {"recall": tp / n_true if n_true else 1.0, "precision": tp / n_pred if n_pred else 1.0,
            "predicted_sparsity": 1.0 - n_pred / mask.numel(), "true_sparsity": 1.0 - n_true / mask.numel()}


# ---------------------------------------------------------------------------------------------------------------
# One layer, one size


@dataclass
class Fit:
    hidden: int
    params: int
    state: dict[str, torch.Tensor]  # fc1.weight (h, d), fc2.weight (n, h), already scaled for raw inputs
    threshold: float
    val: dict[str, float]  # metrics on val at the threshold (the sizing search compares val predicted sparsity)
    test: dict[str, float]
    thresholds_by_recall: dict[str, float]
    epochs: int
    seconds: float
    history: list[float] = field(default_factory=list)  # val predicted sparsity at the target recall per epoch
    # powerinfer form: the negative threshold -delta a fold into one negative threshold lowers a threshold >= 0 to,
    # and the val and test metrics there (predictors/form.py)
    fallback: dict[str, Any] | None = None


def fit_layer(x: torch.Tensor, mask: torch.Tensor, hidden: int, cfg: PredictorConfig,
              splits: tuple[torch.Tensor, torch.Tensor, torch.Tensor], device: str = "cpu",
              seed: int = 0, importance: torch.Tensor | None = None, rowscale: torch.Tensor | None = None) -> Fit:
    """Train one predictor of width `hidden`; early-stop on val predicted sparsity at the target recall.

    `importance` (count, n): loss weight of each active pair (inactive pairs weigh 1); None = all 1.
    `rowscale` (count,) > 0: each row's logits are the network's times this (the powerinfer form's r / s); the
    thresholds, metrics and `fallback` are of those logits.
    """
    t0 = time.perf_counter()
    tr, va, te = splits
    d, n = x.shape[1], mask.shape[1]
    # Inputs are scaled to unit RMS for the optimiser; the scale is folded into fc1 afterwards.
    scale = float(x[tr].pow(2).mean().sqrt().clamp_min(1e-12))
    xs = (x / scale).to(device)  # (count, d)
    y = mask.to(device)  # (count, n) bool
    rs = None if rowscale is None else rowscale.to(device, torch.float32)[:, None]  # (count, 1)

    def logits(xb: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:  # (rows, d) -> (rows, n)
        out = net(xb)
        return out if rs is None else out * rs[rows]
    ytr = y[tr].float()
    rate = ytr.mean(0)  # (n,) firing rate per neuron on train
    # class balance: positives weigh neg/pos, never below 1 (recall is the goal) and capped
    pos_weight = ((1 - rate) / rate.clamp_min(1e-6)).clamp(1.0, cfg.max_pos_weight)  # (n,)
    torch.manual_seed(seed)
    net = Predictor(d, hidden, n).to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(seed)
    best, best_state, bad, history, epochs = -1.0, None, 0, [], 0
    xva, yva = xs[va], y[va]
    imp = None if importance is None else importance.to(device)  # (count, n); indexed by device-side batch rows
    for epoch in range(cfg.epochs):
        net.train()
        order = tr[torch.randperm(len(tr), generator=gen)]
        for i in range(0, len(order), cfg.batch_size):
            b = order[i:i + cfg.batch_size].to(device)
            weight = None if imp is None else torch.where(y[b], imp[b], 1.0)  # (batch, n)
            loss = nn.functional.binary_cross_entropy_with_logits(logits(xs[b], b), y[b].float(), weight=weight,
                                                                  pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        epochs = epoch + 1
        net.eval()
        with torch.no_grad():
            lv = logits(xva, va)  # (val, n)
            q = metrics(lv, yva, threshold_for_recall(lv, yva, cfg.target_recall))["predicted_sparsity"]
        history.append(q)
        if q > best + 1e-6:
            best, bad = q, 0
            best_state = {k: v.detach().clone() for k, v in net.state_dict().items()}
        else:
            bad += 1
            if bad > cfg.patience:
                break
    net.load_state_dict(best_state)
    with torch.no_grad():
        net.fc1.weight.div_(scale)  # now takes raw FFN inputs
        xr = x.to(device)
        lv, lt = logits(xr[va], va), logits(xr[te], te)
        thr = threshold_for_recall(lv, yva, cfg.target_recall)
        table = {f"{r:g}": threshold_for_recall(lv, yva, r) for r in _grid(cfg.target_recall)}
        val_m, test_m = metrics(lv, yva, thr), metrics(lt, y[te], thr)
        fallback = None
        if rs is not None:  # -delta: its median |logit| / 256 keeps the logits a fold scales within float16's range
            low = -float(lv.abs().median()) / MOVE_DIVISOR
            fallback = {"threshold": low, "val": metrics(lv, yva, low), "test": metrics(lt, y[te], low)}
    state = {"fc1.weight": net.fc1.weight.detach().cpu().contiguous(),
             "fc2.weight": net.fc2.weight.detach().cpu().contiguous()}
    return Fit(hidden, n_params(d, hidden, n), state, thr, val_m, test_m, table, epochs,
               time.perf_counter() - t0, history, fallback)


def _grid(recall: float) -> list[float]:
    return sorted({*RECALL_GRID, recall})


@torch.no_grad()
def ffn_values(lm, layer: int, x: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """(count, d_model) FFN inputs -> (count, n_neurons) activation values h (the down projection's input)."""
    mods = lm.adapter.layer_ffn(lm.layers[layer])
    ffn = lm.adapter.ffn_module(lm.layers[layer])
    dtype = mods["up"].weight.dtype
    out = []

    class _Stop(Exception):
        pass

    def grab(_mod, args):
        out.append(args[0].float().cpu())
        raise _Stop  # the down projection itself is not needed

    handle = mods["down"].register_forward_pre_hook(grab)
    try:
        for i in range(0, len(x), chunk):
            xb = x[i:i + chunk].to(device=mods["up"].weight.device, dtype=dtype)
            try:
                if ffn is not None:
                    ffn(xb)
                else:  # OPT: fc1 -> activation -> fc2 live on the decoder layer itself
                    mods["down"](lm.layers[layer].activation_fn(mods["up"](xb)))
            except _Stop:
                pass
    finally:
        handle.remove()
    return torch.cat(out)


def importance_weights(h: torch.Tensor, mask: torch.Tensor, tau: float | None, cfg: PredictorConfig) -> torch.Tensor:
    """(count, n) loss weights of active pairs: (|h| / scale) ** magnitude_weight, capped."""
    a = h.abs()
    scale = tau if tau else float(a[mask].median()) if mask.any() else 1.0
    return (a / max(scale, 1e-12)).clamp(max=cfg.magnitude_cap) ** cfg.magnitude_weight


