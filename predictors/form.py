"""The two predictor forms and what makes the powerinfer form: its training scale and the fold into one threshold.

- normed: the predictor reads the FFN input x_post (after the pre-FFN norm); a threshold per layer.
- powerinfer: what PowerInfer's runtime runs (its llama.cpp builds `idx = fc2 relu(fc1 ffn_inp)` and computes a
  neuron iff idx >= one threshold for the whole model, `powerinfer.sparse_threshold`): the predictor reads the
  residual x_pre before the pre-FFN RMSNorm, has no biases, and every layer's threshold is the same T.

Training the powerinfer form needs no stored x_pre: with x_post = gamma * x_pre / r (common/prenorm.py), a network N
trained on x_post with its logits multiplied per row by r / s (s: the layer's median r, for the optimiser's scale)
is the pre-norm predictor fc2 relu((fc1 * gamma / s) x_pre) exactly. The optimiser sees the same well-scaled x_post
as the normed form; only the logits carry r, as they do when the pre-norm predictor runs.

One threshold: with no biases the net is positively homogeneous, so multiplying layer l's fc2 by c_l > 0 moves its
threshold t_l to t_l c_l without changing a single decision. With T of the layers' common sign, c_l = T / t_l is
exact. Where the signs differ (or a t_l is 0), T is negative (a positive T would have to raise some layer's
threshold, losing recall), and a layer with t_l >= 0 is "moved": its threshold is first lowered to -delta (its
median |logit| on val / 256, so that its logits scaled by c_l stay within float16's range). It then computes every
neuron it did, and a few more: recall only rises. |T| is the geometric mean of the exactly folded layers' |t_l|, so
that fc2's weights keep their magnitude.

A tried alternative, a "bias unit" for moved layers (one more hidden unit relu(v . x_pre) ~ kappa r, v the direction
along which the normed input is nearly constant, with a negative fc2 column and the threshold re-tuned on val), kept
their test-split sparsity but computed less at the first token of each text, whose residual is 8-185 times the usual
scale on SmolLM2: perplexity +13% instead of +3% (docs/predictors.md). It is not used.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from hotneurons.artifacts.profile import ProfileMeta
from hotneurons.common import artifacts
from hotneurons.common.artifacts import ArtifactError
from hotneurons.predictors.fit import Fit


def rms_path(sdir: Path, layer: int) -> Path:
    return Path(sdir) / f"layer_{layer:03d}.rms.npy"


def check_rms(sdir: Path, meta: ProfileMeta) -> None:
    """Every layer's pre-norm divisors are stored (profiles of this version on models with a pre-FFN RMSNorm)."""
    run = Path(sdir).parent.parent
    for i in range(meta.model["n_layers"]):
        path = rms_path(sdir, i)
        if not path.exists():
            raise ArtifactError(f"the profile in {run / 'profile'} stores no pre-norm scales ({path.name}), which the "
                                f"powerinfer form trains on: re-run pi-profile --out {run} --force", params="form")
        artifacts.check_npy(path, f"pi-profile --out {run} --force", np.float32, (meta.sample_count,))


def load_rms(sdir: Path, layer: int) -> torch.Tensor:
    """(count,) float32 r of one layer's samples."""
    return torch.from_numpy(np.load(rms_path(sdir, layer)).astype(np.float32))  # (count,): small, read whole


def to_prenorm(fit: Fit, gamma: torch.Tensor, s: float) -> Fit:
    """A network trained on x_post with logits times r / s -> the same predictor on x_pre: fc1 * gamma / s."""
    fc1 = fit.state["fc1.weight"].double() * (gamma.double() / s)[None, :]  # (h, d)
    return replace(fit, state={**fit.state, "fc1.weight": fc1.float().contiguous()})


@dataclass(frozen=True)
class Fold:
    """One threshold for all layers: layer l's fc2 times scales[l]; moved[l]: its threshold was first lowered."""

    threshold: float  # T
    scales: tuple[float, ...]  # c_l > 0
    moved: tuple[bool, ...]
    effective: tuple[float, ...]  # the threshold each layer keeps before scaling: t_l, or -delta_l where moved


def single_threshold(thresholds: list[float], fallbacks: list[float]) -> Fold:
    """The fold of per-layer thresholds t_l into one T (module docstring); `fallbacks`: the negative threshold -delta_l
    each layer is lowered to if moved."""
    t = np.asarray(thresholds, dtype=np.float64)
    sign = 1.0 if (t > 0).all() else -1.0
    exact = t * sign > 0
    eff = np.where(exact, t, np.minimum(np.asarray(fallbacks, dtype=np.float64), -1e-30))
    usable = exact & (np.abs(t) < np.finfo(np.float32).max)  # a layer that never fires keeps NEVER: not typical
    mag = float(np.exp(np.log(np.abs(t[usable])).mean())) if usable.any() else 1.0
    T = float(np.float32(sign * mag))  # stored as float32 (safetensors, PowerInfer's GGUF key)
    return Fold(T, tuple(float(T / e) for e in eff), tuple(bool(m) for m in ~exact), tuple(float(e) for e in eff))


def fold_fit(fit: Fit, fold: Fold, layer_index: int, target_key: str) -> Fit:
    """A Fit with fc2 scaled, threshold T, its metrics after the fold (a moved layer's at -delta) and its recall table
    in the folded logit units (each entry t_l(R) c_l: the same decisions as before, per layer)."""
    c, moved = fold.scales[layer_index], fold.moved[layer_index]
    fc2 = (fit.state["fc2.weight"].double() * c).float().contiguous()  # (n, h)
    big = float(np.finfo(np.float32).max)  # JSON has no inf: a scaled NEVER stays finite
    table = {k: max(-big, min(big, v * c)) for k, v in fit.thresholds_by_recall.items()}
    table[target_key] = fold.threshold  # t_l c_l = T up to the last bit: stated exactly
    val, test = (fit.fallback["val"], fit.fallback["test"]) if moved else (fit.val, fit.test)
    return replace(fit, state={**fit.state, "fc2.weight": fc2}, threshold=fold.threshold, val=val, test=test,
                   thresholds_by_recall=table)


def describe(rows, fold: Fold, before: list[float]) -> None:
    """Per-layer summary rows (PredictorLayer) get the fold: scale, threshold before it, moved."""
    for row, c, moved, t in zip(rows, fold.scales, fold.moved, before):
        row.fold_scale, row.threshold_moved = c, moved
        row.threshold_before_fold = t if abs(t) < np.finfo(np.float32).max else None
