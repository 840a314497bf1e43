"""Expert predictors at run time: per cold expert of a ReLU-family mixture of experts (relu(gate) * up, relu(gate) *
relu(up)), a low-rank predictor of which of its neurons fire, so that the CPU reads the gate, up and down rows of the
marked neurons only (kernels/cold_experts_sparse.sparse_layer_predicted) instead of every gate row (sparse_layer: a
third of a dense expert's bytes before a firing neuron is found).

A marked neuron is computed exactly; an unmarked one that would have fired is dropped (the predictor's recall decides
the output's quality, as a dense model's predictors do). The file: artifacts/expert_predictors.py. The runtime uses
them where present (RuntimeConfig.expert_predictors) for the layer's cold experts that have one; the others read
their gate rows whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from hotneurons.artifacts.expert_predictors import read
from hotneurons.kernels.cold import ACT_CODE, FIRST_GATED


@dataclass(frozen=True)
class LayerPredictors:
    """One layer's expert predictors as sparse_layer_predicted reads them."""

    a: np.ndarray  # (P, r, d) float32
    b: np.ndarray  # (P, n, r) float32
    t: np.ndarray  # (P, n) float32
    pid_of: np.ndarray  # (E,) int64: expert id -> its predictor, -1: none
    z: np.ndarray  # (k, r) float32 scratch: the routed experts' first layer outputs

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes + self.t.nbytes


def load(path: Path | str, n_experts: int, d: int, n: int, k: int) -> dict[int, LayerPredictors]:
    """The file's layers (i -> LayerPredictors), checked against the model's experts (E, d, n; k routed a token)."""
    out = {}
    for i, p in read(path, n_experts, d, n).items():
        pid_of = np.full(n_experts, -1, np.int64)
        pid_of[p["ids"]] = np.arange(len(p["ids"]))
        out[i] = LayerPredictors(*(np.ascontiguousarray(p[key], np.float32) for key in ("a", "b", "t")), pid_of,
                                 np.zeros((k, p["a"].shape[1]), np.float32))
    return out


def attach(ffns: list, path: Path | str) -> dict:
    """Give each sparse HybridMoE layer (one with down_t) its predictors from `path`; returns a summary (layers,
    predictors, rank, bytes). A layer whose cold experts have no down_t (an activation whose zeros are not exact)
    cannot use them; one without cold experts has no use for them."""
    f0 = ffns[0]
    layers = load(path, f0.cfg.n_experts, f0.d_model, f0.n_ff, f0.cfg.n_experts_used)
    for i, lp in layers.items():
        if i >= len(ffns) or (ffns[i].down_t is None and ffns[i].cold is not None):
            raise ValueError(f"{path}: layer {i} has expert predictors, but the model's layer {i} computes no sparse "
                             f"experts (a ReLU-family activation's cold experts with down_t)")
        if ffns[i].down_t is None:  # a layer with every expert on the device reads no cold rows
            continue
        if ACT_CODE[ffns[i].activation] < FIRST_GATED:
            raise ValueError(f"{path}: expert predictors mark neurons by their gate; the model's experts use "
                             f"{ffns[i].activation}, which has none: drop the file or run --no-predictor")
        ffns[i].expert_predictors = lp
    return {"file": str(path), "layers": len(layers), "predictors": int(sum(len(lp.a) for lp in layers.values())),
            "rank": int(next(iter(layers.values())).a.shape[1]) if layers else 0,
            "bytes": int(sum(lp.nbytes for lp in layers.values()))}
