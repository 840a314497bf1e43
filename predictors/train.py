"""`train_predictors`: one small MLP per layer that predicts, from the FFN input, which neurons will fire.

Training data: the profile's samples (FFN input x, active mask), split train / val / test by a seeded
permutation; one layer is fitted by predictors/fit.py. h_l is chosen by the skewness-driven search of
`plan_sizes` (docs/predictors.md states the rule).

Output `RUN/predictors/`: predictors.safetensors (`layers.{i}.fc1.weight` (h, d_model), `layers.{i}.fc2.weight`
(n_neurons, h), `layers.{i}.threshold` (1,)), summary.json (PredictorsSummary), meta.json (PredictorsMeta).
The powerinfer form (predictors/form.py) reads the residual before the pre-FFN norm and ends with one threshold for
all layers: `config.form` in both JSON files says which form a predictor set is.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import torch
from hotneurons.artifacts.predictor_file import check_model_family
from hotneurons.artifacts.predictors import (
    PredictorForm,
    PredictorLayer,
    PredictorsMeta,
    PredictorsSummary,
    PredictorTotals,
)
from hotneurons.artifacts.profile import ProfileMeta, read_profile
from hotneurons.common import artifacts
from hotneurons.common.artifacts import ArtifactError
from hotneurons.common.ffn import share_covering as _covering
from hotneurons.common.kinds import Rule
from hotneurons.predictors import form as pform
from hotneurons.predictors.fit import (  # noqa: F401 (names re-exported for scripts that import them from here)
    NEVER,
    PRESETS,
    RECALL_GRID,
    Fit,
    PredictorConfig,
    ffn_values,
    fit_layer,
    importance_weights,
    metrics,
    n_params,
    preset,
    threshold_for_recall,
)
from safetensors.torch import save_file
from tqdm.auto import tqdm

SHARE = 0.8  # skewness statistic: share of neurons (hottest first) that covers this share of activations
# samples per layer below which training is warned about: its val and test splits (10% each) then hold a few hundred
# rows, too few to set a layer's threshold at the target recall and to check it (pi-profile keeps 16,384 by default)
MIN_SAMPLES = 4096
RECALL_SHORTFALL = 0.05  # a layer whose held-out recall is this far under the target is warned about


# ---------------------------------------------------------------------------------------------------------------
# Inputs


def profile_stats(neurons: pd.DataFrame, meta: ProfileMeta) -> tuple[np.ndarray, np.ndarray]:
    """Per layer (sparsity, share80) from the profile counts: share80 = share of neurons covering 80% of firings."""
    n_layers, n = meta.model["n_layers"], meta.model["n_neurons"]
    counts = np.zeros((n_layers, n), dtype=np.float64)
    counts[neurons["layer"].to_numpy(), neurons["neuron"].to_numpy()] = neurons["count"].to_numpy()
    sparsity = 1.0 - counts.sum(1) / max(1, meta.tokens * n)
    return sparsity, share_covering(counts, SHARE)


def share_covering(counts: np.ndarray, share: float = SHARE) -> np.ndarray:
    """(layers, neurons) counts -> per layer the fraction of neurons, hottest first, covering `share` of firings."""
    return np.nan_to_num(_covering(counts, share), nan=SHARE)  # a layer that never fires counts as flat


def samples_dir(run_dir: Path, meta: ProfileMeta) -> Path:
    sdir = Path(run_dir) / "profile" / "samples"
    if meta.sample_count <= 0 or not (sdir / "layer_000.x.npy").exists():
        raise ArtifactError(f"the profile in {Path(run_dir) / 'profile'} has no training samples: re-run pi-profile "
                            f"with --samples-per-layer N (N > 0, default 16384)")
    return sdir


def check_samples(sdir: Path, meta: ProfileMeta) -> None:
    """Every layer's sample files are there, readable and of the profile's shapes: a broken one is refused in one
    line naming it, before any model loads or any training starts."""
    info, count = meta.model, meta.sample_count
    writer = f"pi-profile --out {sdir.parent.parent} --force"
    for i in range(info["n_layers"]):
        artifacts.check_npy(sdir / f"layer_{i:03d}.x.npy", writer, np.float16, (count, info["d_model"]))
        artifacts.check_npy(sdir / f"layer_{i:03d}.mask.npy", writer, np.uint8, (count, (info["n_neurons"] + 7) // 8))


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
               progress: Callable[[str], None] = lambda s: None,
               bound: Callable[[int], None] = lambda n: None) -> tuple[list[Fit], list[list[dict]], int]:
    """The skewness-driven search. `fit(layer, hidden)` trains one predictor. Returns (kept fits, tried, budget).

    1. base: h_l = base_hidden(...), capped so each layer stays within its share of the budget;
    2. skewed layers (share80 < skew_cut), most skewed first: shrink h by shrink_factor while val predicted
       sparsity (at the target recall) stays within shrink_tolerance of the kept size;
    3. flat layers, flattest first: grow h by grow_factor while the total stays within the budget and val
       predicted sparsity improves by at least grow_min_gain.
    At most max_steps changes per layer in phases 2 and 3. `bound(n)`: at most n fits in all, told whenever a
    layer's search ends early (a progress bar's total, for its ETA).
    """
    per_row = d_model + n_neurons
    budget = int(cfg.max_predictor_fraction * sum(ffn_params))
    caps = [max(cfg.min_hidden, int(cfg.max_predictor_fraction * fp) // per_row) for fp in ffn_params]
    kept: list[Fit] = []
    tried: list[list[dict]] = [[] for _ in range(n_layers)]
    most = n_layers * (1 + cfg.max_steps)  # base fits, then each layer shrinks or grows at most max_steps times
    bound(most)

    def ended(layer: int) -> None:
        nonlocal most
        most -= 1 + cfg.max_steps - len(tried[layer])
        bound(most)

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
        ended(i)
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
        ended(i)
    return kept, tried, budget


# ---------------------------------------------------------------------------------------------------------------
# The stage


def profile_hash(run_dir: Path) -> str:
    return artifacts.sha256_file(Path(run_dir) / "profile" / "meta.json")


def train_predictors(run_dir: str | Path, cfg: PredictorConfig = PRESETS["default"], *, device: str = "auto",
                     force: bool = False, progress: bool = True, layers: list[int] | None = None,
                     lm=None) -> PredictorsSummary:
    """Train RUN/predictors/ from RUN/profile/; returns summary.json. `layers` restricts training (tests).

    With cfg.magnitude_weight > 0 (the FFN's values) or the powerinfer form (its pre-FFN norm weights) the model is
    needed: `lm` (a LoadedModel or StreamedModel), else the profile's model: read from its file, a layer's FFN at a
    time, where it is a local safetensors folder or GGUF file; loaded whole through transformers otherwise.
    """
    from hotneurons.models.family import pick_device
    from hotneurons.models.streamed import StreamedModel

    run_dir = Path(run_dir)
    device = pick_device(device)
    neurons, pmeta = read_profile(run_dir)
    sdir = samples_dir(run_dir, pmeta)
    check_samples(sdir, pmeta)
    prenorm = PredictorForm.of({"form": cfg.form}) == PredictorForm.POWERINFER
    if prenorm:
        check_model_family(pmeta.model)
        pform.check_rms(sdir, pmeta)
    final = run_dir / "predictors"
    info = pmeta.model
    if (final / "meta.json").exists() and not force:
        old = artifacts.read_json(final / "meta.json")  # any version: only its model matters here
        if old.get("model", {}).get("fingerprint") != info["fingerprint"]:
            raise ArtifactError(f"{final} holds predictors of '{old.get('model', {}).get('name')}', not of "
                                f"'{info['name']}': force a replacement", params="force")
    L, d, n = info["n_layers"], info["d_model"], info["n_neurons"]
    sel = list(range(L)) if layers is None else layers
    sparsity, share80 = profile_stats(neurons, pmeta)
    ffn_params = [int(p) for p in info["params"]["ffn_per_layer"]]
    count = pmeta.sample_count
    splits = split_indices(count, cfg)
    torch.manual_seed(cfg.seed)
    agreement: dict[int, float] = {}
    if (cfg.magnitude_weight > 0 or prenorm) and lm is None:
        lm = _model(pmeta, device, count, cfg.magnitude_weight > 0)
    if lm is not None:
        artifacts.check_same_model(pmeta, {"model": lm.info}, f"profile {run_dir / 'profile'}", "the model")
    if prenorm:
        from hotneurons.common.prenorm import ffn_norms

        norms = lm.ffn_norms(required=True) if isinstance(lm, StreamedModel) else ffn_norms(lm)
        gammas = [n.gamma().cpu() for n in norms]  # (d,) float32 per layer
    taus = pmeta.layer_taus
    cache: dict[int, tuple] = {}

    def fit(j: int, h: int) -> Fit:
        layer = sel[j]
        if layer not in cache:
            cache.clear()  # one layer's samples in RAM at a time (phases revisit layers in another order)
            x, m = load_samples(sdir, layer, n)
            w = rows = None
            if prenorm:  # logits times r / s: s, the median r of train rows, keeps them near the normed form's
                r = pform.load_rms(sdir, layer)  # (count,)
                s = float(r[splits[0]].median())
                rows = (r / s, s)
            if cfg.magnitude_weight > 0:
                streamed = isinstance(lm, StreamedModel)
                hv = lm.ffn_values(layer, x) if streamed else ffn_values(lm, layer, x)  # (count, n)
                tau = None if taus is None else taus[layer]
                # the stored masks came from the same rule on the same x (up to fp16 storage of x); a gate rule's
                # (pi-profile --criterion gate/gate-h) reads act(gate x), which these values do not carry
                if pmeta.rule in (Rule.NONZERO, Rule.ABS_TAU):
                    agreement[layer] = float(((hv.abs() > tau if tau is not None else hv != 0) == m).float().mean())
                w = importance_weights(hv, m, tau, cfg)
            cache[layer] = (x, m, w, rows)
        x, m, w, rows = cache[layer]
        f = fit_layer(x, m, h, cfg, splits, device, seed=cfg.seed * 100_003 + layer, importance=w,
                      rowscale=None if rows is None else rows[0])
        return f if rows is None else pform.to_prenorm(f, gammas[layer], rows[1])

    bar = tqdm(desc="predictors", unit="fit", disable=not progress, dynamic_ncols=True)

    def note(msg: str) -> None:
        bar.update(1)
        bar.set_postfix_str(msg, refresh=False)

    def bound(total: int) -> None:  # the most fits left to run: the bar's total, so that it shows an ETA
        bar.total = total
        bar.refresh()

    t0 = time.perf_counter()
    kept, tried, budget = plan_sizes(fit, len(sel), d, n, sparsity[sel], share80[sel],
                                     [ffn_params[i] for i in sel], cfg, note, bound)
    seconds = time.perf_counter() - t0
    bar.close()
    fold = None
    if prenorm:  # one threshold for all layers (predictors/form.py); the summary's metrics are after the fold
        before = [f.threshold for f in kept]
        fold = pform.single_threshold(before, [f.fallback["threshold"] for f in kept])
        kept = [pform.fold_fit(f, fold, j, f"{cfg.target_recall:g}") for j, f in enumerate(kept)]
    summary = _summary(cfg, sel, kept, tried, sparsity, share80, ffn_params, budget, seconds, device, count, d, n)
    if fold is not None:
        pform.describe(summary.layers, fold, before)
        summary.totals.global_threshold, summary.totals.moved_layers = fold.threshold, sum(fold.moved)
    if agreement:
        summary.totals.recomputed_mask_agreement_min = min(agreement.values())
    meta = PredictorsMeta(inputs={"profile": {"meta_sha256": profile_hash(run_dir)}}, model=info, config=asdict(cfg))
    tensors: dict[str, torch.Tensor] = {}
    for layer, f in zip(sel, kept):
        tensors[f"layers.{layer}.fc1.weight"] = f.state["fc1.weight"]  # (h, d_model)
        tensors[f"layers.{layer}.fc2.weight"] = f.state["fc2.weight"]  # (n_neurons, h)
        tensors[f"layers.{layer}.threshold"] = torch.tensor([f.threshold], dtype=torch.float32)  # (1,)
    with artifacts.staged(final) as partial:
        save_file(tensors, str(partial / "predictors.safetensors"), metadata={"format_version": "1"})
        summary.save(partial / "summary.json")
        meta.save(partial / "meta.json")
    return summary


def _model(pmeta: ProfileMeta, device: str, count: int, magnitude: bool):
    """The profile's model, for its FFN weights and pre-FFN norms: a StreamedModel of its file (nothing loads until
    a layer is read) after checking that a layer's FFN and samples fit; a LoadedModel where it is a hub id or an
    architecture our definitions lack."""
    from hotneurons.common.model_source import ModelError
    from hotneurons.models.family import load_model_from_meta, pick_dtype
    from hotneurons.models.stream_memory import check_memory, train_need
    from hotneurons.models.streamed import meta_source, open_streamed, streams

    path, gguf, activation = meta_source(pmeta.model)
    dtype = (pmeta.config or {}).get("dtype", "auto")
    if streams(path, gguf):
        try:
            sm = open_streamed(path, gguf, activation=activation, device=device, dtype=pick_dtype(dtype, device),
                               ctx=1)
        except ValueError as e:
            if isinstance(e, ModelError):
                raise
        else:
            check_memory(train_need(sm, count, magnitude), device, "pi-train-predictors",
                         "free memory, or re-run pi-profile with a smaller --samples-per-layer", ())
            return sm
    return load_model_from_meta(pmeta.model, device=device, dtype=dtype)


def training_warning(summary: PredictorsSummary) -> str | None:
    """One line when the predictors will likely cost perplexity: a layer's held-out (test split) recall far under
    the target, or a profile of too few samples; it says what to run instead. None when neither."""
    target, count = summary.config["target_recall"], summary.samples_per_layer
    low = [r for r in summary.layers if r.recall < target - RECALL_SHORTFALL]
    if not low and count >= MIN_SAMPLES:
        return None
    said = []
    if low:
        worst = min(low, key=lambda r: r.recall)
        said.append(f"{len(low)} of {len(summary.layers)} layers catch under {target - RECALL_SHORTFALL:.2f} of the "
                    f"active neurons on held-out samples (layer {worst.layer}: {worst.recall:.3f}, target {target:g})")
    if count < MIN_SAMPLES:
        said.append(f"the profile holds {count:,} samples a layer, fewer than the {MIN_SAMPLES:,} training needs")
    fix = (f"re-run pi-profile with more --tokens and --samples-per-layer {MIN_SAMPLES} or more, then "
           f"pi-train-predictors --force" if count < MIN_SAMPLES else
           "train again with --preset thorough (more epochs and sizes), or profile more --tokens in pi-profile")
    return f"warning: {'; '.join(said)}: the sparse modes will lose perplexity; {fix}"


def _summary(cfg, sel, kept, tried, sparsity, share80, ffn_params, budget, seconds, device, count, d,
             n) -> PredictorsSummary:
    rows = []
    for j, (layer, f) in enumerate(zip(sel, kept)):
        rows.append(PredictorLayer(
            layer=layer, hidden=f.hidden, params=f.params,
            params_share_of_ffn=f.params / ffn_params[layer],
            share80=float(share80[layer]), profile_sparsity=float(sparsity[layer]),
            skewed=bool(share80[layer] < cfg.skew_cut),
            threshold=f.threshold, recall=f.test["recall"], precision=f.test["precision"],
            predicted_sparsity=f.test["predicted_sparsity"], true_sparsity=f.test["true_sparsity"],
            val=f.val, thresholds_by_recall=f.thresholds_by_recall, epochs=f.epochs,
            tried=tried[j],
        ))
    total_p = sum(f.params for f in kept)
    ffn_total = sum(ffn_params[i] for i in sel)
    mean = lambda k: float(np.mean([getattr(r, k) for r in rows]))  # noqa: E731
    return PredictorsSummary(
        config=asdict(cfg),
        skewness_statistic=f"share80: share of a layer's neurons (hottest first) covering {SHARE:.0%} of its "
                           "activations in the profile (0.8 = uniform; smaller = more skewed)",
        metrics_split="test (held out from training, early stopping and threshold choice)",
        samples_per_layer=count, d_model=d, n_neurons=n,
        totals=PredictorTotals(
            layers=len(rows), predictor_params=total_p, ffn_params=ffn_total,
            predictor_fraction_of_ffn=total_p / ffn_total, budget_params=budget,
            mean_recall=mean("recall"), min_recall=float(min(r.recall for r in rows)),
            mean_precision=mean("precision"), mean_predicted_sparsity=mean("predicted_sparsity"),
            mean_true_sparsity=mean("true_sparsity"), fits=sum(len(t) for t in tried),
            train_seconds=round(seconds, 2), device=device,
        ),
        layers=rows,
    )
