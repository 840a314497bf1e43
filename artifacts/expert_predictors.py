"""RUN/predictors/expert_predictors.safetensors: a mixture of sparse experts' expert predictors
(predictors/experts_fit.py fits them, bench/moe_gguf.py writes exact ones, runtime/expert_predictors.py runs them).
Per MoE layer i with predictors (safetensors, float32 unless said):

    blk.{i}.expert_pred.ids  (P,) int64        the expert each predictor belongs to
    blk.{i}.expert_pred.a    (P, r, d)         A: the first layer
    blk.{i}.expert_pred.b    (P, n, r)         B: the second
    blk.{i}.expert_pred.t    (P, n)            t: the thresholds

metadata {"format": FORMAT}. Neuron j of expert e is marked iff (B_e (A_e x))_j > t_e[j], x the experts' input.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

FILE = "expert_predictors.safetensors"
FORMAT = "hotneurons-expert-predictors-1"
KEYS = ("ids", "a", "b", "t")


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


def read(path: Path | str, n_experts: int, d: int, n: int) -> dict[int, dict[str, np.ndarray]]:
    """The file's layers (i -> {"ids", "a", "b", "t"}), checked against the model's experts (E of n neurons, d)."""
    from safetensors import safe_open

    path = Path(path)
    with safe_open(str(path), "numpy") as f:
        if (f.metadata() or {}).get("format") != FORMAT:
            raise ValueError(f"{path} is not an expert predictors file (metadata format {FORMAT!r} missing)")
        by_layer: dict[int, dict[str, np.ndarray]] = {}
        for name in f.keys():
            _, i, _, key = name.split(".")
            by_layer.setdefault(int(i), {})[key] = f.get_tensor(name)
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
    return dict(sorted(by_layer.items()))
