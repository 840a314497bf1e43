"""Cost model and memory accounting for splitting FFN neurons between GPU and CPU (see docs/solver.md).

Within a layer, neurons are sorted by activation count (hottest first) and cut into groups of
`group_size`; the GPU takes a prefix of k groups. Everything the solvers need is a per-layer table over
k = 0..G: bytes on the GPU, expected activations served by the GPU, expected milliseconds per token.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from hotneurons.common.hardware import HardwareSpec
from hotneurons.common.kinds import FixableError
from hotneurons.common.model_info import ModelInfo
from hotneurons.weights.formats import FORMATS, TORCH_FLOATS, WeightFormat, kernel_format, weight_format

# bytes per weight, from weights.formats (the one table of sizes), under the names pi-solve has always taken (fp32 and
# fp16 for f32 and f16: placement meta.json files and the runtime's checks use them). The block formats are llama.cpp's
# (q4_0: 18 bytes per 32 weights); with them the KV cache and norms stay 16-bit (ACT_BYTES).
_SOLVER_NAMES = {WeightFormat.F32: "fp32", WeightFormat.F16: "fp16"}
_GGUF = {_SOLVER_NAMES.get(f, f.value): s for f, s in FORMATS.items() if s.ggml_type is not None}
DTYPE_BYTES: dict[str, float] = {name: s.bytes_per_weight for name, s in _GGUF.items()}
ACT_BYTES: dict[str, float] = {name: float(s.block_bytes) if s.block == 1 else 2.0  # KV cache, norms
                               for name, s in _GGUF.items()}


def model_dtype(weight_dtype: object) -> str:
    """pi-solve's name of the float format a model records as its weight_dtype, under any of weights/formats.py's
    spellings (float16, fp16, f16, ...); fp16 where none is recorded or it is no float format torch computes with."""
    try:
        fmt = weight_format(str(weight_dtype))
    except ValueError:
        return _SOLVER_NAMES[WeightFormat.F16]
    return _SOLVER_NAMES.get(fmt, fmt.value) if fmt in TORCH_FLOATS else _SOLVER_NAMES[WeightFormat.F16]


# bytes per weight of the cold rows in CPU RAM, in the formats the runtime's CPU kernels read (--cold-dtype): bf16,
# int8 with a float32 scale per 64 weights (runtime/cold_rows.ColdRows), q8_0 / q4_0 / q4_1 in llama.cpp's blocks
COLD_BYTES: dict[str, float] = {f.value: s.bytes_per_weight for f, s in FORMATS.items() if s.cpu_kernel}


def auto_formats(weight_dtype: object) -> tuple[str, str]:
    """pi-generate's `auto` formats for a model that records `weight_dtype` (a GGUF's FFN format as stored, or the
    float dtype a folder loads in), in pi-solve's names: (on the GPU, the cold rows in CPU RAM). A block format: the
    one each side's kernels read, itself where they read it (weights/formats.kernel_format: runtime/engine.auto_format's
    rule, so a Q4_0 file is sized at Q4_0's bytes, not fp16's); floats and the unknown: fp16 and bf16."""
    try:
        fmt = weight_format(str(weight_dtype))
    except ValueError:
        return "fp16", "bf16"
    if fmt in TORCH_FLOATS or FORMATS[fmt].block == 1:
        return "fp16", "bf16"
    hot, cold = kernel_format(fmt, "cuda"), kernel_format(fmt, "cpu")
    return _SOLVER_NAMES.get(hot, hot.value), cold.value


def gguf_path(model: ModelInfo) -> Path | None:
    """The GGUF file the profile read, where it names one that exists here."""
    src = model.source or {}
    if not src.get("gguf_file"):
        return None
    path = Path(src.get("path") or ".") / src["gguf_file"]
    return path if path.is_file() else None


def stored_ffn_format(model: ModelInfo) -> str | None:
    """The format the profiled GGUF stores its first FFN's up rows in (the profile's weight_dtype is the dtype it
    computed in); None without such a file."""
    path = gguf_path(model)
    if path is None:
        return None
    from hotneurons.weights.formats import from_ggml_type
    from hotneurons.weights.gguf_file import GGUFFile
    from hotneurons.weights.names import layer_name

    t = GGUFFile(path).tensors.get(layer_name(0, "ffn_up.weight"))
    return None if t is None else str(from_ggml_type(t.ggml_type))


def default_formats(model: ModelInfo) -> tuple[str, str]:
    """pi-solve's formats where --dtype / --cold-dtype are not given: auto_formats of the profiled GGUF's stored FFN
    format, else of the dtype the profile computed in."""
    return auto_formats(stored_ffn_format(model) or model.weight_dtype)


def cold_weight_bytes(cold_dtype: str, rows: int) -> float:
    """Bytes a weight of a cold neuron's `rows` rows (3 gated, 2 not) in CPU RAM, read as --cold-dtype keeps them:
    COLD_BYTES, but a K-quant's down rows are re-blocked neuron-major in a 32-weight format (Q4_K's as q4_1, Q5_K's
    and Q6_K's as q8_0: models/ffn_weights.cold_formats), which an active neuron reads with its gate and up rows."""
    fmt = weight_format(cold_dtype)
    from hotneurons.models.ffn_weights import K_FORMATS, cold_formats  # torch: imported where a K-quant asks

    if fmt not in K_FORMATS:
        return COLD_BYTES[cold_dtype]
    kept, down = cold_formats(fmt, fmt, fmt if rows == 3 else None, fmt)
    return ((rows - 1) * FORMATS[kept].bytes_per_weight + FORMATS[down].bytes_per_weight) / rows


class SolverError(FixableError):
    """A bad input or an impossible request; the message is one line naming the value and the fix, and `params`
    names the arguments to change (the CLI shows them as flags)."""


def predictor_hidden(d_model: int) -> int:
    """Sizing rule for a predictor not trained yet: PowerInfer uses hidden ~1024 for a 4096-wide layer;
    scale with the width (d/4), rounded up to a multiple of 64."""
    return max(64, 64 * math.ceil(d_model / 4 / 64))


def estimate_predictor_params(shape: ModelInfo) -> int:
    """Per layer Linear(d->h) + Linear(h->n), no biases."""
    h = predictor_hidden(shape.d_model)
    return shape.n_layers * (shape.d_model * h + h * shape.n_neurons)


def safetensors_bytes(path: Path) -> int:
    """Bytes of tensor data in a safetensors file, from its header alone."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")


def workspace_bytes(shape: ModelInfo, ctx: int) -> int:
    """fp32 buffers of one decode step (logits, hidden states, FFN intermediates, attention scores over
    ctx, predictor hidden and logits), doubled for allocator slack. cuBLAS and the CUDA context are in
    the reserve."""
    floats = (shape.vocab_size + 4 * shape.d_model + 3 * shape.n_neurons + shape.num_attention_heads * ctx
              + predictor_hidden(shape.d_model))
    return int(2 * 4 * floats)


def embedding_on_cpu(shape: ModelInfo) -> bool:
    """An untied model's input embedding stays in CPU RAM (runtime/offload.py OnCPUEmbedding: a token reads one row of
    it); a tied one is the LM head too and is on the GPU."""
    return shape.params.lm_head > 0


def memory_items(shape: ModelInfo, dtype_bytes: float, ctx: int, reserve: int, predictor_bytes: int,
                 kv_bytes: float | None = None) -> dict[str, int]:
    """What the GPU must hold before any FFN neuron, in bytes, in the order the runtime allocates it.
    dtype_bytes: per weight; kv_bytes: per KV-cache entry (default: dtype_bytes)."""
    L = shape.n_layers
    kv_bytes = dtype_bytes if kv_bytes is None else kv_bytes
    return {
        "attention": int(sum(shape.params.attention_per_layer) * dtype_bytes),  # incl. each layer's norms
        "ffn_fixed": int(sum(shape.ffn_fixed_params(l) for l in range(L)) * dtype_bytes),
        "final_norm_and_other": int(shape.params.other * kv_bytes),
        "embedding": 0 if embedding_on_cpu(shape) else int(shape.params.embedding * dtype_bytes),
        "lm_head": int(shape.params.lm_head * dtype_bytes),
        "predictors": int(predictor_bytes),
        "kv_cache": int(2 * L * shape.num_key_value_heads * shape.head_dim * kv_bytes * ctx),
        "workspace": workspace_bytes(shape, ctx),
        "reserve": int(reserve),
    }


@dataclass(frozen=True)
class PlacementProblem:
    """One instance: per layer sorted groups, their costs, and the FFN byte budget on the GPU."""

    group_size: int
    tokens: int  # tokens profiled; count / tokens = activation probability
    group_neurons: np.ndarray  # (layers, groups) neurons per group, 0 past a layer's last group
    group_counts: np.ndarray  # (layers, groups) activation counts per group, float64
    bytes_per_neuron: np.ndarray  # (layers,) bytes
    gpu_ms_per_neuron: np.ndarray  # (layers,) ms to read one neuron's rows from GPU memory
    cpu_ms_per_activation: np.ndarray  # (layers,) ms to read one active neuron's rows from DRAM
    sync_ms: np.ndarray  # (layers,) ms per layer whose FFN is not entirely on the GPU
    fixed_ms: np.ndarray  # (layers,) ms of the layer's attention, norms, predictor (placement-independent)
    global_ms: float  # ms per token outside the layers (LM head, final norm)
    budget_bytes: float  # bytes of GPU memory left for FFN neurons
    min_groups: np.ndarray  # (layers,) K_l: a layer using the GPU puts >= K_l groups there (0: no constraint)
    min_neurons: np.ndarray = field(default=None)  # (layers,) C_l in neurons, for the report
    # (layers,) ms a cold neuron costs every token, active or not: the rows a gate-first kernel reads to decide
    # (common/gating.py: the gate row for the gate criteria, gate and up for |h|); zeros where a predictor decides
    cpu_ms_per_cold_neuron: np.ndarray = field(default=None)

    @property
    def n_layers(self) -> int:
        return self.group_neurons.shape[0]

    @property
    def n_groups(self) -> np.ndarray:
        return (self.group_neurons > 0).sum(axis=1)  # (layers,)


def build_problem(counts: list[np.ndarray], tokens: int, shape: ModelInfo, hw: HardwareSpec, dtype_bytes: float,
                  budget_bytes: float, predictor_params_per_layer: float, group_size: int, comm: bool,
                  cold_bytes: float | None = None, always_rows: int = 0,
                  act_bytes: float | None = None) -> PlacementProblem:
    """counts: per layer the neurons' activation counts sorted descending; cold_bytes: per weight of a cold row in
    CPU RAM (COLD_BYTES; default dtype_bytes); act_bytes: per value of the activations crossing PCIe (ACT_BYTES: 16-bit
    beside block weights; default dtype_bytes); always_rows: rows of each cold neuron read every token whether it passes
    or not (a gated model's gate-first kernel: 1 for the gate criteria, 2 for |h|), the rest only when it does."""
    if group_size < 1:
        raise SolverError(f"the group size must be >= 1 neuron, got {group_size}", params="group_size")
    L = len(counts)
    G = max(math.ceil(len(c) / group_size) for c in counts)
    group_neurons = np.zeros((L, G), dtype=np.int64)  # (layers, groups)
    group_counts = np.zeros((L, G), dtype=np.float64)  # (layers, groups)
    for l, c in enumerate(counts):
        g = np.arange(len(c)) // group_size  # (neurons,) group of each sorted neuron
        group_neurons[l, : g[-1] + 1] = np.bincount(g)
        group_counts[l, : g[-1] + 1] = np.bincount(g, weights=c.astype(np.float64))

    bpn = np.full(L, shape.neuron_params * dtype_bytes)  # (layers,) bytes
    # Without a GPU everything runs on the CPU: "GPU-side" fixed work is read at DRAM speed, no sync.
    fixed_bw = hw.gpu_bw if hw.has_gpu else hw.effective_cpu_bw  # bytes/s
    gpu_ms = bpn / hw.gpu_bw * 1e3 if hw.has_gpu else np.full(L, np.inf)  # (layers,) ms
    cpu_row_ms = shape.d_model * (cold_bytes or dtype_bytes) / hw.effective_cpu_bw * 1e3  # ms: one cold row read
    cpu_ms = np.full(L, shape.neuron_params * (cold_bytes or dtype_bytes) / hw.effective_cpu_bw * 1e3
                     - always_rows * cpu_row_ms)  # (layers,) ms an active cold neuron costs past its always-read rows
    cold_ms = np.full(L, always_rows * cpu_row_ms)  # (layers,) ms every cold neuron costs
    # Per layer round trip: latency + the FFN input to the CPU (+ the predictor's mask, 1 byte/neuron)
    # and the CPU's partial sum back.
    xfer = 2 * shape.d_model * (act_bytes or dtype_bytes) + shape.n_neurons  # bytes
    sync = (hw.sync_latency_s + xfer / hw.pcie_bw) * 1e3 if hw.has_gpu else 0.0
    sync_ms = np.full(L, sync)  # (layers,) ms
    fixed_ms = np.array([(shape.params.attention_per_layer[l] + shape.ffn_fixed_params(l) + predictor_params_per_layer)
                         * dtype_bytes / fixed_bw * 1e3 for l in range(L)])  # (layers,) ms
    head = shape.params.lm_head or shape.params.embedding  # tied models read the embedding as LM head
    global_ms = (head + shape.params.other) * dtype_bytes / fixed_bw * 1e3

    min_neurons = np.zeros(L, dtype=np.int64)
    min_groups = np.zeros(L, dtype=np.int64)
    if comm and hw.has_gpu:
        for l, c in enumerate(counts):
            min_neurons[l] = comm_min_neurons(c / tokens, cpu_ms[l], gpu_ms[l] - cold_ms[l], sync_ms[l])
            min_groups[l] = min(math.ceil(min_neurons[l] / group_size), (group_neurons[l] > 0).sum())
    return PlacementProblem(group_size, int(tokens), group_neurons, group_counts, bpn, gpu_ms, cpu_ms, sync_ms,
                            fixed_ms, float(global_ms), float(budget_bytes), min_groups, min_neurons, cold_ms)


def comm_min_neurons(freq: np.ndarray, cpu_ms_per_activation: float, gpu_ms_per_neuron: float, sync_ms: float) -> int:
    """C_l: the fewest hottest neurons whose move to the GPU saves at least one sync.

    Neuron j costs freq_j * cpu_ms_per_activation on the CPU (computed only when active) and
    gpu_ms_per_neuron on the GPU (read every token). The paper's C*T_gpu + T_sync <= C*T_cpu, with
    per-neuron times, becomes sum_{j<C} (f_j*T_cpu - T_gpu) >= T_sync. If no prefix reaches it, only the
    whole layer qualifies (a layer entirely on the GPU needs no sync at all).
    """
    saving = np.cumsum(freq * cpu_ms_per_activation - gpu_ms_per_neuron)  # (neurons,) ms
    hit = np.nonzero(saving >= sync_ms)[0]
    return int(hit[0] + 1) if len(hit) else len(freq)


@dataclass(frozen=True)
class LayerTables:
    """Per layer and per k = number of groups on the GPU (k = 0..G; padded past a layer's G)."""

    neurons: np.ndarray  # (layers, G+1) neurons on the GPU
    bytes: np.ndarray  # (layers, G+1) bytes on the GPU
    counts: np.ndarray  # (layers, G+1) activation counts served by the GPU
    gpu_ms: np.ndarray  # (layers, G+1) ms, GPU side of the FFN
    cpu_ms: np.ndarray  # (layers, G+1) ms, CPU side of the FFN (expected active cold neurons)
    layer_ms: np.ndarray  # (layers, G+1) ms, fixed + sync + max(GPU, CPU)
    allowed: np.ndarray  # (layers, G+1) bool: k = 0 or K_l <= k <= G_l


def layer_tables(p: PlacementProblem) -> LayerTables:
    L, G = p.group_neurons.shape
    zero = np.zeros((L, 1))
    neurons = np.hstack([zero, np.cumsum(p.group_neurons, axis=1)])  # (layers, G+1)
    counts = np.hstack([zero, np.cumsum(p.group_counts, axis=1)])  # (layers, G+1)
    k = np.arange(G + 1)[None, :]  # (1, G+1)
    G_l = p.n_groups[:, None]  # (layers, 1)
    with np.errstate(invalid="ignore"):
        gpu = neurons * p.gpu_ms_per_neuron[:, None]
        gpu = np.where(neurons == 0, 0.0, gpu)  # no GPU: inf * 0
    cpu = (counts[:, -1:] - counts) / p.tokens * p.cpu_ms_per_activation[:, None]
    if p.cpu_ms_per_cold_neuron is not None:  # gate-first: every cold neuron's always-read rows
        cpu = cpu + (neurons[:, -1:] - neurons) * p.cpu_ms_per_cold_neuron[:, None]
    sync = np.where(k < G_l, p.sync_ms[:, None], 0.0)
    layer_ms = p.fixed_ms[:, None] + sync + np.maximum(gpu, cpu)
    allowed = (k <= G_l) & ((k == 0) | (k >= p.min_groups[:, None]))
    return LayerTables(neurons, neurons * p.bytes_per_neuron[:, None], counts, gpu, cpu, layer_ms, allowed)


def evaluate(p: PlacementProblem, k: np.ndarray, tables: LayerTables | None = None) -> dict:
    """Both objectives' quantities and feasibility for a choice of k (groups on the GPU per layer)."""
    t = tables or layer_tables(p)
    rows = np.arange(p.n_layers)
    k = np.asarray(k, dtype=np.int64)  # (layers,)
    gpu_bytes = float(t.bytes[rows, k].sum())
    latency = float(t.layer_ms[rows, k].sum() + p.global_ms)
    return {
        "gpu_ffn_bytes": gpu_bytes,
        "gpu_activation_share": float(t.counts[rows, k].sum() / max(t.counts[:, -1].sum(), 1e-300)),
        "latency_ms": latency,
        "tokens_per_s": 1e3 / latency,
        "feasible": bool(gpu_bytes <= p.budget_bytes * (1 + 1e-12) and t.allowed[rows, k].all()),
    }
