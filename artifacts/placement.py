"""The placement artifact (`RUN/placement/`), read by the evaluation, the export and the runtime, written by the
solver.

`placement.parquet`: layer:int32, neuron:int32, gpu:bool, count:int64, rank:int32 (hottest first within a layer);
`meta.json`: `PlacementMeta`; `summary.json`: `PlacementSummary` (docs/artifacts.md lists every key).
`read_placement` returns a `Placement`: per layer the (n_neurons,) numpy bool mask of GPU-resident neurons, the one
class for a solved placement, PowerInfer's gpuidx and the uniform or random ones of tests and benchmarks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from hotneurons.common.artifacts import ArtifactError, JsonFile, Section, StageMeta, check_same_model
from hotneurons.common.kinds import Kind
from hotneurons.common.schema import optional


class Objective(Kind):
    """What the placement ILP optimises."""

    LATENCY = "latency"  # minimise the expected ms/token of the cost model
    ACTIVATIONS = "activations"  # maximise the share of activations served by the GPU (the paper's objective)


@dataclass(kw_only=True)
class PlacementFlags(Section):
    """The settings a placement was solved for (the solver's arguments); the runtime sizes its KV cache by ctx."""

    vram_bytes: int
    dtype: str  # weight format on both devices: a key of solver.cost.DTYPE_BYTES
    cold_dtype: str  # how the runtime stores cold rows in CPU RAM: a key of solver.cost.COLD_BYTES
    ctx: int  # tokens the KV cache holds
    reserve_bytes: int
    group_size: int
    objective: Objective
    comm_constraint: bool
    time_limit: float
    mip_gap: float
    threads: int | None = None
    parallel: int = 1  # sequences decoded together (pi-serve --parallel): KV cache slots in the budget
    predictor_dtype: str = "auto"  # the predictors' storage on the GPU the budget counts (pi-generate's default)


@dataclass(kw_only=True)
class PlacementMeta(StageMeta):
    """placement/meta.json: the profile it was solved from (`inputs.profile`), the hardware and the flags."""

    STAGE: ClassVar[str] = "placement"
    WRITER: ClassVar[str] = "pi-solve"

    stage: str = "placement"
    model: dict[str, Any]
    hardware: dict[str, Any] | None = None  # common/hardware.HardwareSpec fields
    flags: PlacementFlags | None = None
    # a mixture of experts: the profile's `experts` section (n_experts, n_experts_used, n_ff_exp, n_ff_shexp,
    # norm_topk) and `mode` ("whole experts" | "neuron groups"); the placement is experts.parquet (artifacts/experts.py)
    experts: dict[str, Any] | None = optional()


@dataclass(kw_only=True)
class Budget(Section):
    vram_bytes: int
    vram: str  # the same, human-readable
    fixed_gpu_bytes: int  # what the GPU holds before any FFN neuron
    ffn_budget_bytes: int  # what is left for FFN neurons


@dataclass(kw_only=True)
class Memory(Section):
    gpu: dict[str, int]  # solver.cost.memory_items' items, ffn_neurons, total, free (empty without a GPU)
    cpu: dict[str, int]  # ffn_neurons (stored as cold_dtype), embedding when untied, the rest without a GPU
    predictors_source: str  # "measured from ..." or how they were estimated
    bytes_per_neuron: float
    rows_per_neuron: int


@dataclass(kw_only=True)
class SolverInfo(Section):
    backend: str
    objective: Objective
    status: str  # "optimal", "time limit (feasible)", "trivial (no GPU)"
    objective_value: float
    bound: float
    gap: float
    objective_units: str
    build_seconds: float
    solve_seconds: float
    variables: int
    constraints: int
    groups: int
    group_size: int


@dataclass(kw_only=True)
class LayerPlacement(Section):
    layer: int
    gpu_groups: int
    gpu_neurons: int
    neurons: int
    gpu_neuron_share: float
    gpu_activation_share: float
    gpu_bytes: int
    cpu_bytes: int
    active_per_token: float
    min_gpu_neurons: int
    expected_ms: float
    gpu_ms: float
    cpu_ms: float


@dataclass(kw_only=True)
class ExpertLayer(Section):
    """One layer of a mixture of experts' placement (cost-model figures per token)."""

    layer: int
    gpu_experts: int  # experts wholly on the GPU
    partial_experts: int  # experts with some (not all) neuron groups on the GPU
    gpu_neurons: int  # expert neurons on the GPU, whole experts included
    gpu_share_routed: float  # expected share of the layer's routed expert work done on the GPU
    gpu_bytes: int
    cpu_bytes: int
    expected_ms: float  # fixed + sync + max(gpu, cpu)
    gpu_ms: float
    cpu_ms: float
    sync_ms: float


@dataclass(kw_only=True)
class ExpertsSummary(Section):
    """summary.json `experts`: what pi-solve placed in a mixture of experts, and the baselines beside it."""

    n_experts: int
    n_experts_used: int
    n_ff_exp: int
    n_ff_shexp: int
    mode: str  # "whole experts" | "neuron groups" (prefixes of hottest neurons inside ReLU-family experts)
    expert_bytes: list[int]  # (layers,) bytes of one expert on the GPU, in its format
    cold_expert_bytes: list[int]  # (layers,) bytes of one expert as the CPU reads it
    weights_source: str  # where the bytes came from: the GGUF header, or the format assumed
    gpu_share_routed: float  # mean over layers of the expected share of routed expert work done on the GPU
    gpu_experts_per_layer: list[int]  # (layers,) experts wholly on the GPU
    pcie_bytes_per_token: int  # what crosses PCIe per token and layer with a cold routed expert (no weights)
    # n_cpu_moe: {n, gpu_share_routed, expected_latency_ms, gpu_expert_bytes, fits}; uniform: {gpu_experts_per_layer,
    # expected_share, gpu_share_routed, ...}: placements made without the solver, under the same cost model
    baselines: dict[str, dict[str, Any]]
    layers: list[ExpertLayer]


@dataclass(kw_only=True)
class PlacementSummary(JsonFile):
    """placement/summary.json: budget, bytes per device, the expected GPU share of activations, per layer GPU
    neurons, solver status, objective, gap and seconds. Figures of the cost model, not measurements."""

    WRITER: ClassVar[str] = "pi-solve"

    model: str  # the model's name
    budget: Budget
    memory: Memory
    bytes_per_device: dict[str, int]
    gpu_activation_share: float
    gpu_neuron_share: float
    expected_latency_ms: float
    expected_tokens_per_s: float
    reference_tokens_per_s: dict[str, float]  # ffn_all_on_cpu, all_on_gpu_dense
    solver: SolverInfo
    layers: list[LayerPlacement]
    hardware: dict[str, Any]  # HardwareSpec fields, effective_cpu_bw, notes
    flags: PlacementFlags
    seconds_total: float | None = None
    experts: ExpertsSummary | None = optional()  # a mixture of experts (then `layers` is empty)
    # batched decoding (solver/batching.py): per batch size the expected step, aggregate tokens/s, cold rows read a
    # token, the layer split's rate at the budget; the batch size from which the layer split's is the higher
    batching: dict[str, Any] | None = optional()


@dataclass(frozen=True)
class Placement:
    """Which neurons of each layer live on the GPU: `gpu[l]` is a (n_neurons,) bool array, True = the neuron's rows
    live on the compute device. Numpy, not torch: reading a placement loads no torch (~1 s), and the runtime lays
    out each layer's rows itself; the evaluation turns a mask into a tensor where it masks one. `meta` is
    RUN/placement/meta.json where the placement was read from a run."""

    gpu: tuple[np.ndarray, ...]
    meta: PlacementMeta | None = None

    @classmethod
    def uniform(cls, n_layers: int, n_neurons: int, on_gpu: bool) -> Placement:
        return cls(tuple(np.full(n_neurons, on_gpu) for _ in range(n_layers)))

    @classmethod
    def from_run(cls, run_dir: str | os.PathLike, model_info: dict) -> Placement:
        """RUN/placement/placement.parquet, one mask per layer of the model (refuses a placement made for another
        model)."""
        return read_placement(run_dir, model_info, model_info["n_layers"])

    def gpu_share(self) -> float:
        return float(np.mean([g.mean() for g in self.gpu]))

    def __getitem__(self, layer: int) -> np.ndarray:
        return self.gpu[layer]

    def __len__(self) -> int:
        return len(self.gpu)


def read_placement(run_dir: str | os.PathLike, model_info: dict, n_layers: int | None = None) -> Placement:
    """RUN/placement/ -> a Placement; refuses a placement made for another model than `model_info`'s."""
    pdir = Path(run_dir) / "placement"
    table = pdir / "placement.parquet"
    if not table.exists():
        raise ArtifactError(f"no placement in {pdir}: run pi-solve on {run_dir} first")
    meta = PlacementMeta.load(pdir / "meta.json")
    check_same_model(meta, {"model": model_info}, f"placement {pdir}", "the model")
    if meta.experts is not None:
        raise ArtifactError(f"{pdir} places a mixture of experts: read it with "
                            f"hotneurons.artifacts.experts.read_expert_placement")
    import pandas as pd

    df = pd.read_parquet(table, columns=["layer", "neuron", "gpu"])
    n = model_info["n_neurons"]
    layer = df["layer"].to_numpy(np.int64)
    neuron = df["neuron"].to_numpy(np.int64)
    gpu = np.zeros((n_layers if n_layers is not None else model_info["n_layers"], n), dtype=bool)  # (layers, n)
    if len(df) and (layer.max() >= gpu.shape[0] or neuron.max() >= n):
        raise ArtifactError(f"{table} names neurons outside {gpu.shape[0]} layers x {n}: re-run pi-solve")
    gpu[layer, neuron] = df["gpu"].to_numpy(bool)
    return Placement(tuple(gpu[i].copy() for i in range(gpu.shape[0])), meta)
