"""Expert predictors: per cold expert of a ReLU-family mixture of experts (relu(gate) * up, relu(gate) * relu(up)), a
low-rank predictor of which of its neurons fire, so that the CPU reads the gate, up and down rows of the marked
neurons only (kernels/cold_experts_sparse.sparse_layer_predicted) instead of every gate row (sparse_layer: a third of
a dense expert's bytes before a firing neuron is found).

Neuron j of expert e is marked iff (B_e (A_e x))_j > t_e[j], x the experts' input (after the FFN norm). A marked
neuron is computed exactly; an unmarked one that would have fired is dropped (the predictor's recall decides the
output's quality, as a dense model's predictors do).

The file, RUN/predictors/expert_predictors.safetensors (safetensors, float32 unless said), per MoE layer i with
predictors:

    blk.{i}.expert_pred.ids  (P,) int64        the expert each predictor belongs to
    blk.{i}.expert_pred.a    (P, r, d)         A: the first layer
    blk.{i}.expert_pred.b    (P, n, r)         B: the second
    blk.{i}.expert_pred.t    (P, n)            t: the thresholds

metadata {"format": FORMAT}. The runtime uses them where present (RuntimeConfig.expert_predictors) for the layer's
cold experts that have one; the others read their gate rows whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

FILE = "expert_predictors.safetensors"
FORMAT = "hotneurons-expert-predictors-1"
KEYS = ("ids", "a", "b", "t")


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


def path_in(run: Path | str) -> Path:
    return Path(run) / "predictors" / FILE


def save(path: Path | str, layers: dict[int, dict[str, np.ndarray]]) -> Path:
    """layers: i -> {"ids", "a", "b", "t"} into `path` (a temp name, renamed when whole)."""
    from safetensors.numpy import save_file

    path = Path(path)
    tensors = {}
    for i, parts in layers.items():
        missing = set(KEYS) - set(parts)
        if missing:
            raise ValueError(f"layer {i}'s expert predictors lack {sorted(missing)}")
        for k in KEYS:
            tensors[f"blk.{i}.expert_pred.{k}"] = np.ascontiguousarray(parts[k], np.int64 if k == "ids" else np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    save_file(tensors, str(tmp), metadata={"format": FORMAT})
    tmp.replace(path)
    return path


def load(path: Path | str, n_experts: int, d: int, n: int, k: int) -> dict[int, LayerPredictors]:
    """The file's layers (i -> LayerPredictors), checked against the model's experts (E, d, n; k routed a token)."""
    from safetensors import safe_open

    path = Path(path)
    with safe_open(str(path), "numpy") as f:
        if (f.metadata() or {}).get("format") != FORMAT:
            raise ValueError(f"{path} is not an expert predictors file (metadata format {FORMAT!r} missing)")
        by_layer: dict[int, dict[str, np.ndarray]] = {}
        for name in f.keys():
            _, i, _, key = name.split(".")
            by_layer.setdefault(int(i), {})[key] = f.get_tensor(name)
    out = {}
    for i, p in sorted(by_layer.items()):
        ids, a, b, t = (p[key] for key in KEYS)
        P, r = a.shape[0], a.shape[1]
        if a.shape != (P, r, d) or b.shape != (P, n, r) or t.shape != (P, n) or ids.shape != (P,):
            raise ValueError(f"{path}: layer {i}'s expert predictors have shapes ids {ids.shape}, a {a.shape}, b "
                             f"{b.shape}, t {t.shape}; the model's experts need (P,), (P, r, {d}), (P, {n}, r), "
                             f"(P, {n})")
        if len(ids) and (ids.min() < 0 or ids.max() >= n_experts or len(set(ids.tolist())) != len(ids)):
            raise ValueError(f"{path}: layer {i}'s predictor expert ids {ids.tolist()} are not distinct ids of the "
                             f"model's {n_experts} experts")
        pid_of = np.full(n_experts, -1, np.int64)
        pid_of[ids] = np.arange(P)
        out[i] = LayerPredictors(np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32),
                                 np.ascontiguousarray(t, np.float32), pid_of, np.zeros((k, r), np.float32))
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
        if ffns[i].down_t is not None:  # a layer with every expert on the device reads no cold rows
            ffns[i].expert_predictors = lp
    return {"file": str(path), "layers": len(layers), "predictors": int(sum(len(lp.a) for lp in layers.values())),
            "rank": int(next(iter(layers.values())).a.shape[1]) if layers else 0,
            "bytes": int(sum(lp.nbytes for lp in layers.values()))}
