"""A mixture of experts' placement (`RUN/placement/` written by pi-solve from an MoE profile), for the runtime.

`experts.parquet`: layer:int32, expert:int32, gpu:bool, count:int64, rank:int32 (hottest first within a layer; `gpu`
= the whole expert lives on the GPU). In neuron-group mode also `placement.parquet`: layer:int32, expert:int32,
neuron:int32, gpu:bool, count:int64, rank:int32 (hottest first within its expert). `meta.json` is a `PlacementMeta`
whose `experts` section is set; `summary.json` a `PlacementSummary` with an `experts` section. docs/artifacts.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from hotneurons.common.artifacts import ArtifactError, check_same_model

from .placement import PlacementMeta


@dataclass(frozen=True)
class ExpertPlacement:
    """Which experts (and, in ReLU-family experts, which neurons) live on the GPU. Numpy, not torch (reading loads no
    torch). `gpu[l, e]`: expert e of layer l wholly on the GPU. `neurons[l, e]`: (n_ff_exp,) its GPU-resident neurons
    (all True where gpu[l, e]); None when whole experts only are placed. `meta`: RUN/placement/meta.json when read."""

    gpu: np.ndarray  # (layers, experts) bool
    neurons: np.ndarray | None = None  # (layers, experts, n_ff_exp) bool
    meta: PlacementMeta | None = None

    def __post_init__(self) -> None:
        if self.gpu.ndim != 2 or self.gpu.dtype != bool:
            raise ValueError(f"ExpertPlacement.gpu must be a (layers, experts) bool array, got {self.gpu.dtype} "
                             f"{self.gpu.shape}")
        if self.neurons is not None and (self.neurons.shape[:2] != self.gpu.shape
                                         or not self.neurons[self.gpu].all()):
            raise ValueError("ExpertPlacement.neurons must be (layers, experts, n_ff_exp) and all True on GPU experts")

    @property
    def n_layers(self) -> int:
        return self.gpu.shape[0]

    @property
    def n_experts(self) -> int:
        return self.gpu.shape[1]

    @classmethod
    def uniform(cls, n_layers: int, n_experts: int, per_layer: int | list[int]) -> ExpertPlacement:
        """Experts 0..m-1 of each layer on the GPU (m = per_layer, or per_layer[l]): a placement made without a
        profile."""
        m = np.broadcast_to(np.asarray(per_layer), (n_layers,))  # (layers,)
        return cls(np.arange(n_experts)[None, :] < m[:, None])

    @classmethod
    def n_cpu_moe(cls, n_layers: int, n_experts: int, n: int) -> ExpertPlacement:
        """llama.cpp's `-ngl 99 --n-cpu-moe n`: the experts of the first n layers on the CPU, all others on the GPU."""
        gpu = np.zeros((n_layers, n_experts), bool)  # (layers, experts)
        gpu[n:] = True
        return cls(gpu)

    def gpu_share(self, counts: np.ndarray | None = None) -> float:
        """Share of experts on the GPU, or, given (layers, experts) routing counts, the mean over layers of the
        share of routed tokens whose expert is on the GPU (whole experts only)."""
        if counts is None:
            return float(self.gpu.mean())
        c = np.asarray(counts, dtype=np.float64)
        return float(((c * self.gpu).sum(1) / np.maximum(c.sum(1), 1e-300)).mean())


def read_expert_placement(run_dir: str | os.PathLike, info: dict[str, Any]) -> ExpertPlacement:
    """RUN/placement/ -> an ExpertPlacement; refuses a dense placement, one made for another model than `info`'s (the
    model info dict of a meta.json) and tables that do not cover every expert."""
    pdir = Path(run_dir) / "placement"
    table, neurons_table = pdir / "experts.parquet", pdir / "placement.parquet"
    if not (pdir / "meta.json").exists():
        raise ArtifactError(f"no placement in {pdir}: run pi-solve on {run_dir} first")
    meta = PlacementMeta.load(pdir / "meta.json")
    check_same_model(meta, {"model": info}, f"placement {pdir}", "the model")
    if meta.experts is None or not table.exists():
        raise ArtifactError(f"{pdir} places a dense FFN, not experts: read it with "
                            f"hotneurons.artifacts.placement.read_placement")
    import pandas as pd

    L, E, n = int(info["n_layers"]), int(meta.experts["n_experts"]), int(meta.experts["n_ff_exp"])
    df = pd.read_parquet(table, columns=["layer", "expert", "gpu"])
    layer, expert = df["layer"].to_numpy(np.int64), df["expert"].to_numpy(np.int64)
    if len(df) != L * E or layer.min() < 0 or layer.max() >= L or expert.min() < 0 or expert.max() >= E:
        raise ArtifactError(f"{table} does not hold one row per expert for {L} layers x {E} experts: re-run pi-solve")
    gpu = np.zeros((L, E), bool)  # (layers, experts)
    gpu[layer, expert] = df["gpu"].to_numpy(bool)
    neurons = None
    if meta.experts.get("mode") == "neuron groups":
        if not neurons_table.exists():
            raise ArtifactError(f"{pdir} lacks placement.parquet (neuron groups): re-run pi-solve")
        nd = pd.read_parquet(neurons_table, columns=["layer", "expert", "neuron", "gpu"])
        ix = [nd[c].to_numpy(np.int64) for c in ("layer", "expert", "neuron")]
        if len(nd) != L * E * n or min(a.min() for a in ix) < 0 or ix[1].max() >= E or ix[2].max() >= n:
            raise ArtifactError(f"{neurons_table} does not hold one row per neuron of {L} x {E} experts x {n}: "
                                f"re-run pi-solve")
        neurons = np.zeros((L, E, n), bool)  # (layers, experts, n_ff_exp)
        neurons[ix[0], ix[1], ix[2]] = nd["gpu"].to_numpy(bool)
    return ExpertPlacement(gpu, neurons, meta)
