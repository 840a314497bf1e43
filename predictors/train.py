"""`train_predictors`: one small MLP per layer that predicts, from the FFN input, which neurons will fire.

Predictor of layer l: Linear(d_model -> h_l, no bias) -> ReLU -> Linear(h_l -> n_neurons, no bias); neuron j is
computed iff logit_j >= threshold_l. Training data: the profile's samples (FFN input x, active mask), split
train / val / test by a seeded permutation. Loss: BCE with a per-neuron positive weight (class balance).
Early stopping and the threshold use the val split; the reported recall / precision / sparsity come from
the test split, which nothing was tuned on. h_l is chosen by the skewness-driven search of `plan_sizes`
(docs/predictors.md states the rule).

Output `RUN/predictors/`: predictors.safetensors (`layers.{i}.fc1.weight` (h, d_model), `layers.{i}.fc2.weight`
(n_neurons, h), `layers.{i}.threshold` (1,)), summary.json, meta.json.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import torch
from hotneurons.common import artifacts
from hotneurons.common.artifacts import ArtifactError
from torch import nn
from tqdm.auto import tqdm

SHARE = 0.8  # skewness statistic: share of neurons (hottest first) that covers this share of activations
NEVER = float(torch.finfo(torch.float32).max)  # threshold of a layer with no active sample (JSON has no inf)
RECALL_GRID = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.97, 0.99)  # thresholds tabulated for pi-eval --recall


@dataclass(frozen=True)
class PredictorConfig:
    """Training and sizing settings. Named presets in PRESETS; CLI flags override single fields."""

    name: str = "default"
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
    if name not in PRESETS:
        raise ValueError(f"unknown predictor preset '{name}': choose one of {', '.join(PRESETS)}")
    cfg = replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})
    if not 0 < cfg.target_recall < 1:
        raise ValueError(f"--target-recall {cfg.target_recall} must be in (0, 1), e.g. 0.95")
    if not 0 < cfg.max_predictor_fraction <= 1:
        raise ValueError(f"--max-predictor-fraction {cfg.max_predictor_fraction} must be in (0, 1], e.g. 0.1")
    return cfg


class Predictor(nn.Module):
    """Linear(d -> h) -> ReLU -> Linear(h -> n), no biases; `threshold` is the per-layer decision logit."""

    def __init__(self, d_model: int, hidden: int, n_neurons: int, threshold: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, n_neurons, bias=False)
        self.register_buffer("threshold", torch.tensor([threshold], dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))  # (..., d) -> (..., n) logits

    def mask(self, x: torch.Tensor) -> torch.Tensor:
        return self(x) >= self.threshold.to(x.dtype)  # (..., n) bool


def n_params(d_model: int, hidden: int, n_neurons: int) -> int:
    return hidden * (d_model + n_neurons)


# ---------------------------------------------------------------------------------------------------------------
# Inputs


def profile_stats(neurons: pd.DataFrame, meta: dict) -> tuple[np.ndarray, np.ndarray]:
    """Per layer (sparsity, share80) from the profile counts: share80 = share of neurons covering 80% of firings."""
    n_layers, n = meta["model"]["n_layers"], meta["model"]["n_neurons"]
    counts = np.zeros((n_layers, n), dtype=np.float64)
    counts[neurons["layer"].to_numpy(), neurons["neuron"].to_numpy()] = neurons["count"].to_numpy()
    sparsity = 1.0 - counts.sum(1) / max(1, int(meta["tokens"]) * n)
    return sparsity, share_covering(counts, SHARE)


def share_covering(counts: np.ndarray, share: float = SHARE) -> np.ndarray:
    """(layers, neurons) counts -> per layer the fraction of neurons, hottest first, covering `share` of firings."""
    from hotneurons.profiler.profile import share_covering as covering

    return np.nan_to_num(covering(counts, share), nan=SHARE)  # a layer that never fires counts as flat


def samples_dir(run_dir: Path, meta: dict) -> Path:
    sdir = Path(run_dir) / "profile" / "samples"
    if int(meta.get("samples", {}).get("count", 0)) <= 0 or not (sdir / "layer_000.x.npy").exists():
        raise ArtifactError(f"the profile in {Path(run_dir) / 'profile'} has no training samples: re-run pi-profile "
                            f"with --samples-per-layer N (N > 0, default 16384)")
    return sdir


def load_samples(sdir: Path, layer: int, n_neurons: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x float32 (count, d_model), mask bool (count, n_neurons)) of one layer, read from the memory maps."""
    x = np.load(sdir / f"layer_{layer:03d}.x.npy", mmap_mode="r")
    packed = np.load(sdir / f"layer_{layer:03d}.mask.npy", mmap_mode="r")
    mask = np.unpackbits(packed, axis=1)[:, :n_neurons].astype(bool)  # (count, n)
    return torch.from_numpy(np.asarray(x, dtype=np.float32)), torch.from_numpy(mask)


def split_indices(count: int, cfg: PredictorConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded train / val / test row indices (the same for every layer and every size tried)."""
    perm = torch.randperm(count, generator=torch.Generator().manual_seed(cfg.seed))
    n_val = max(1, int(round(cfg.val_fraction * count)))
    n_test = max(1, int(round(cfg.test_fraction * count)))
    if count - n_val - n_test < 1:
        raise ArtifactError(f"only {count} samples per layer: re-run pi-profile with a larger --samples-per-layer")
    return perm[n_val + n_test:], perm[:n_val], perm[n_val:n_val + n_test]


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


def fit_layer(x: torch.Tensor, mask: torch.Tensor, hidden: int, cfg: PredictorConfig,
              splits: tuple[torch.Tensor, torch.Tensor, torch.Tensor], device: str = "cpu",
              seed: int = 0, importance: torch.Tensor | None = None) -> Fit:
    """Train one predictor of width `hidden`; early-stop on val predicted sparsity at the target recall.

    `importance` (count, n): loss weight of each active pair (inactive pairs weigh 1); None = all 1.
    """
    t0 = time.perf_counter()
    tr, va, te = splits
    d, n = x.shape[1], mask.shape[1]
    # Inputs are scaled to unit RMS for the optimiser; the scale is folded into fc1 afterwards.
    scale = float(x[tr].pow(2).mean().sqrt().clamp_min(1e-12))
    xs = (x / scale).to(device)  # (count, d)
    y = mask.to(device)  # (count, n) bool
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
    for epoch in range(cfg.epochs):
        net.train()
        order = tr[torch.randperm(len(tr), generator=gen)]
        for i in range(0, len(order), cfg.batch_size):
            b = order[i:i + cfg.batch_size].to(device)
            weight = None if importance is None else torch.where(y[b], importance[b].to(device), 1.0)  # (batch, n)
            loss = nn.functional.binary_cross_entropy_with_logits(net(xs[b]), y[b].float(), weight=weight,
                                                                  pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        epochs = epoch + 1
        net.eval()
        with torch.no_grad():
            lv = net(xva)  # (val, n)
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
        lv, lt = net(xr[va]), net(xr[te])
        thr = threshold_for_recall(lv, yva, cfg.target_recall)
        table = {f"{r:g}": threshold_for_recall(lv, yva, r) for r in sorted({*RECALL_GRID, cfg.target_recall})}
        val_m, test_m = metrics(lv, yva, thr), metrics(lt, y[te], thr)
    state = {"fc1.weight": net.fc1.weight.detach().cpu().contiguous(),
             "fc2.weight": net.fc2.weight.detach().cpu().contiguous()}
    return Fit(hidden, n_params(d, hidden, n), state, thr, val_m, test_m, table, epochs,
               time.perf_counter() - t0, history)


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


# ---------------------------------------------------------------------------------------------------------------
# Sizing


def round_hidden(h: float, cfg: PredictorConfig, cap: int) -> int:
    """Round to a multiple of cfg.hidden_multiple within [min_hidden, cap]."""
    m = cfg.hidden_multiple
    return int(max(cfg.min_hidden, min(cap, m * max(1, round(h / m)))))


def base_hidden(cfg: PredictorConfig, n_neurons: int, sparsity: float, share80: float, cap: int) -> int:
    """Base size: proportional to the expected number of active neurons, scaled by how flat the layer is."""
    active = max(0.0, 1.0 - sparsity)
    return round_hidden(cfg.base_scale * n_neurons * active * (share80 / SHARE), cfg, cap)


def plan_sizes(fit: Callable[[int, int], Fit], n_layers: int, d_model: int, n_neurons: int,
               sparsity: np.ndarray, share80: np.ndarray, ffn_params: list[int], cfg: PredictorConfig,
               progress: Callable[[str], None] = lambda s: None) -> tuple[list[Fit], list[list[dict]], int]:
    """The skewness-driven search. `fit(layer, hidden)` trains one predictor. Returns (kept fits, tried, budget).

    1. base: h_l = base_hidden(...), capped so each layer stays within its share of the budget;
    2. skewed layers (share80 < skew_cut), most skewed first: shrink h by shrink_factor while val predicted
       sparsity (at the target recall) stays within shrink_tolerance of the kept size;
    3. flat layers, flattest first: grow h by grow_factor while the total stays within the budget and val
       predicted sparsity improves by at least grow_min_gain.
    At most max_steps changes per layer in phases 2 and 3.
    """
    per_row = d_model + n_neurons
    budget = int(cfg.max_predictor_fraction * sum(ffn_params))
    caps = [max(cfg.min_hidden, int(cfg.max_predictor_fraction * fp) // per_row) for fp in ffn_params]
    kept: list[Fit] = []
    tried: list[list[dict]] = [[] for _ in range(n_layers)]

    def run(layer: int, h: int, phase: str) -> Fit:
        f = fit(layer, h)
        tried[layer].append({"hidden": h, "params": f.params, "phase": phase, "val": f.val, "test": f.test,
                             "epochs": f.epochs, "seconds": round(f.seconds, 3)})
        progress(f"layer {layer} h={h} ({phase}): val sparsity {f.val['predicted_sparsity']:.3f}")
        return f

    for i in range(n_layers):
        kept.append(run(i, base_hidden(cfg, n_neurons, float(sparsity[i]), float(share80[i]), caps[i]), "base"))
    for i in sorted(range(n_layers), key=lambda j: share80[j]):
        if share80[i] >= cfg.skew_cut:
            continue
        for _ in range(cfg.max_steps):
            h = round_hidden(kept[i].hidden * cfg.shrink_factor, cfg, kept[i].hidden)
            if h >= kept[i].hidden:
                break
            f = run(i, h, "shrink")
            if f.val["predicted_sparsity"] < kept[i].val["predicted_sparsity"] - cfg.shrink_tolerance:
                break
            kept[i] = f
    for i in sorted(range(n_layers), key=lambda j: -share80[j]):
        if share80[i] < cfg.skew_cut:
            continue
        for _ in range(cfg.max_steps):
            h = round_hidden(kept[i].hidden * cfg.grow_factor, cfg, n_neurons)
            used = sum(f.params for f in kept) - kept[i].params + h * per_row
            if h <= kept[i].hidden or used > budget:
                break
            f = run(i, h, "grow")
            if f.val["predicted_sparsity"] < kept[i].val["predicted_sparsity"] + cfg.grow_min_gain:
                break
            kept[i] = f
    return kept, tried, budget


# ---------------------------------------------------------------------------------------------------------------
# The stage


def profile_hash(run_dir: Path) -> str:
    return artifacts.sha256_file(Path(run_dir) / "profile" / "meta.json")


def train_predictors(run_dir: str | Path, cfg: PredictorConfig = PRESETS["default"], *, device: str = "auto",
                     force: bool = False, progress: bool = True, layers: list[int] | None = None,
                     lm=None) -> dict[str, Any]:
    """Train RUN/predictors/ from RUN/profile/; returns summary.json. `layers` restricts training (tests).

    With cfg.magnitude_weight > 0 the model is needed: `lm` (a LoadedModel), else the profile's model is loaded.
    """
    from hotneurons.common.models import pick_device

    run_dir = Path(run_dir)
    device = pick_device(device)
    neurons, pmeta = artifacts.read_profile(run_dir)
    sdir = samples_dir(run_dir, pmeta)
    final = run_dir / "predictors"
    if (final / "meta.json").exists() and not force:
        old = artifacts.read_json(final / "meta.json")
        if old.get("model", {}).get("fingerprint") != pmeta["model"]["fingerprint"]:
            raise ArtifactError(f"{final} holds predictors of '{old.get('model', {}).get('name')}', not of "
                                f"'{pmeta['model']['name']}': pass --force to replace them")
    info = pmeta["model"]
    L, d, n = info["n_layers"], info["d_model"], info["n_neurons"]
    sel = list(range(L)) if layers is None else layers
    sparsity, share80 = profile_stats(neurons, pmeta)
    ffn_params = [int(p) for p in info["params"]["ffn_per_layer"]]
    count = int(pmeta["samples"]["count"])
    splits = split_indices(count, cfg)
    torch.manual_seed(cfg.seed)
    agreement: dict[int, float] = {}
    if cfg.magnitude_weight > 0 and lm is None:
        from hotneurons.common.models import load_model_from_meta

        lm = load_model_from_meta(pmeta["model"], device=device, dtype=pmeta.get("config", {}).get("dtype", "auto"))
    if lm is not None:
        artifacts.check_same_model(pmeta, {"model": lm.info}, f"profile {run_dir / 'profile'}", "the model")
    taus = pmeta.get("taus") if pmeta.get("rule") == "abs>tau" else None
    cache: dict[int, tuple] = {}

    def fit(j: int, h: int) -> Fit:
        layer = sel[j]
        if layer not in cache:
            cache.clear()  # one layer's samples in RAM at a time (phases revisit layers in another order)
            x, m = load_samples(sdir, layer, n)
            w = None
            if cfg.magnitude_weight > 0:
                hv = ffn_values(lm, layer, x)  # (count, n)
                tau = None if taus is None else taus[layer]
                # the stored masks came from the same rule on the same x (up to fp16 storage of x)
                agreement[layer] = float(((hv.abs() > tau if tau is not None else hv != 0) == m).float().mean())
                w = importance_weights(hv, m, tau, cfg)
            cache[layer] = (x, m, w)
        x, m, w = cache[layer]
        return fit_layer(x, m, h, cfg, splits, device, seed=cfg.seed * 100_003 + layer, importance=w)

    bar = tqdm(desc="predictors", unit="fit", disable=not progress, dynamic_ncols=True)

    def note(msg: str) -> None:
        bar.update(1)
        bar.set_postfix_str(msg, refresh=False)

    t0 = time.perf_counter()
    kept, tried, budget = plan_sizes(fit, len(sel), d, n, sparsity[sel], share80[sel],
                                     [ffn_params[i] for i in sel], cfg, note)
    seconds = time.perf_counter() - t0
    bar.close()
    summary = _summary(cfg, sel, kept, tried, sparsity, share80, ffn_params, budget, seconds, device, count, d, n)
    if agreement:
        summary["totals"]["recomputed_mask_agreement_min"] = min(agreement.values())
    meta = artifacts.base_meta("predictors", inputs={"profile": {"meta_sha256": profile_hash(run_dir)}})
    meta["model"] = info
    meta["config"] = asdict(cfg)
    tensors: dict[str, torch.Tensor] = {}
    for layer, f in zip(sel, kept):
        tensors[f"layers.{layer}.fc1.weight"] = f.state["fc1.weight"]  # (h, d_model)
        tensors[f"layers.{layer}.fc2.weight"] = f.state["fc2.weight"]  # (n_neurons, h)
        tensors[f"layers.{layer}.threshold"] = torch.tensor([f.threshold], dtype=torch.float32)  # (1,)
    staging = run_dir / ".predictors.staging"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        from safetensors.torch import save_file

        staging.mkdir(parents=True)
        save_file(tensors, str(staging / "predictors.safetensors"), metadata={"format_version": "1"})
        artifacts.write_json(staging / "summary.json", summary)
        artifacts.write_json(staging / "meta.json", meta)
        artifacts.replace_dir(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return summary


def _summary(cfg, sel, kept, tried, sparsity, share80, ffn_params, budget, seconds, device, count, d, n) -> dict:
    rows = []
    for j, (layer, f) in enumerate(zip(sel, kept)):
        rows.append({
            "layer": layer, "hidden": f.hidden, "params": f.params,
            "params_share_of_ffn": f.params / ffn_params[layer],
            "share80": float(share80[layer]), "profile_sparsity": float(sparsity[layer]),
            "skewed": bool(share80[layer] < cfg.skew_cut),
            "threshold": f.threshold, "recall": f.test["recall"], "precision": f.test["precision"],
            "predicted_sparsity": f.test["predicted_sparsity"], "true_sparsity": f.test["true_sparsity"],
            "val": f.val, "thresholds_by_recall": f.thresholds_by_recall, "epochs": f.epochs,
            "tried": tried[j],
        })
    total_p = sum(f.params for f in kept)
    ffn_total = sum(ffn_params[i] for i in sel)
    mean = lambda k: float(np.mean([r[k] for r in rows]))  # noqa: E731
    return {
        "config": asdict(cfg),
        "skewness_statistic": f"share80: share of a layer's neurons (hottest first) covering {SHARE:.0%} of its "
                              "activations in the profile (0.8 = uniform; smaller = more skewed)",
        "metrics_split": "test (held out from training, early stopping and threshold choice)",
        "samples_per_layer": count, "d_model": d, "n_neurons": n,
        "totals": {
            "layers": len(rows), "predictor_params": total_p, "ffn_params": ffn_total,
            "predictor_fraction_of_ffn": total_p / ffn_total, "budget_params": budget,
            "mean_recall": mean("recall"), "min_recall": float(min(r["recall"] for r in rows)),
            "mean_precision": mean("precision"), "mean_predicted_sparsity": mean("predicted_sparsity"),
            "mean_true_sparsity": mean("true_sparsity"), "fits": sum(len(t) for t in tried),
            "train_seconds": round(seconds, 2), "device": device,
        },
        "layers": rows,
    }


# ---------------------------------------------------------------------------------------------------------------
# Loading


@dataclass
class Predictors:
    layers: dict[int, Predictor]
    summary: dict[str, Any]
    meta: dict[str, Any]

    def set_recall(self, recall: float) -> None:
        """Switch every layer to the threshold tabulated on val for `recall` (one of RECALL_GRID + target)."""
        key = f"{recall:g}"
        for row in self.summary["layers"]:
            table = row["thresholds_by_recall"]
            if key not in table:
                raise ValueError(f"recall {recall} has no tabulated threshold: choose one of {', '.join(table)}")
            self.layers[row["layer"]].threshold.fill_(table[key])


def load_predictors(run_dir: str | Path, model_info: dict | None = None, *, check_profile: bool = True,
                    device: str = "cpu", dtype: torch.dtype = torch.float32) -> Predictors:
    """Read RUN/predictors/; refuse predictors of another model (`model_info` = the loaded model's info) or of
    another profile than RUN/profile/ (when it exists and `check_profile`)."""
    from safetensors.torch import load_file

    pdir = Path(run_dir) / "predictors"
    if not (pdir / "meta.json").exists() or not (pdir / "predictors.safetensors").exists():
        raise ArtifactError(f"no predictors in {pdir}: run `pi-train-predictors --run {run_dir}` first")
    meta = artifacts.read_json(pdir / "meta.json")
    artifacts.check_meta(meta, "predictors", pdir)
    if model_info is not None:
        artifacts.check_same_model(meta, {"model": model_info}, f"predictors {pdir}", "the model")
    prof = Path(run_dir) / "profile" / "meta.json"
    if check_profile and prof.exists():
        want = meta["inputs"]["profile"]["meta_sha256"]
        if artifacts.sha256_file(prof) != want:
            raise ArtifactError(f"predictors {pdir} were trained on another profile than {prof.parent} "
                                f"(profile meta sha256 {want[:12]}): re-run pi-train-predictors --force")
    summary = artifacts.read_json(pdir / "summary.json")
    tensors = load_file(str(pdir / "predictors.safetensors"))
    layers: dict[int, Predictor] = {}
    for row in summary["layers"]:
        i = row["layer"]
        w1, w2 = tensors[f"layers.{i}.fc1.weight"], tensors[f"layers.{i}.fc2.weight"]
        p = Predictor(w1.shape[1], w1.shape[0], w2.shape[0], float(tensors[f"layers.{i}.threshold"][0]))
        p.fc1.weight.data.copy_(w1)
        p.fc2.weight.data.copy_(w2)
        layers[i] = p.to(device=device, dtype=dtype).eval()  # threshold buffer follows dtype; compare in x dtype
    return Predictors(layers, summary, meta)
