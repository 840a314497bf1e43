"""A mixture of experts' stacked rows as runtime/moe_ffn.py's HybridMoE holds them: views of the file's rows as the
Numba kernels read them, the re-quantized copies of formats they do not read, and the rows a layer never reads again
once loaded (dropped from the process as each layer loads, so that neither resident nor peak memory holds them)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from hotneurons.kernels.cold_experts import FLOAT_ROWS
from hotneurons.kernels.qlinear import GpuQ
from hotneurons.weights.formats import WeightFormat, nearest, spec
from hotneurons.weights.qtensor import QTensor

PROJ = ("gate", "up", "down")
# what the kernel reads as stored; other formats' cold experts are re-quantized, each into its nearest format
# (weights/formats.py: Q2_K, Q3_K, IQ2 ... to q4_0, Q5_0, IQ4_XS ... to q8_0)
KERNEL_FMTS = {"q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k", "f32", "f16", "bf16"}


def fmt_name(w: QTensor | torch.Tensor) -> str:
    if isinstance(w, QTensor):
        return str(WeightFormat(w.fmt).value)
    return {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}.get(w.dtype, str(w.dtype))


def rows2d(w: QTensor | torch.Tensor, out: int) -> QTensor | torch.Tensor:
    """A stacked experts tensor as (E * out, in) rows: a QTensor as it comes, a float (E, out, in) one viewed."""
    return w if isinstance(w, QTensor) else w.reshape(-1, w.shape[-1])


def host_rows(w: QTensor | torch.Tensor) -> np.ndarray:
    """(E * out, row) numpy view of CPU stacked rows as kernels/cold_experts reads them (no copy)."""
    if isinstance(w, QTensor):
        if spec(w.fmt).block == 1:  # a float format carried as bytes
            return host_rows(w.data.view({"f32": torch.float32, "f16": torch.float16,
                                          "bf16": torch.bfloat16}[fmt_name(w)]))
        return w.data.numpy()
    t = w.reshape(-1, w.shape[-1])
    if t.dtype == torch.float32:
        return t.numpy()
    return t.view(torch.int16).numpy().view(FLOAT_ROWS[fmt_name(t)])  # fp16 as uint16, bf16 as int16 bits


def requantized(w: QTensor | torch.Tensor, experts: np.ndarray, out: int) -> np.ndarray:
    """The rows of `experts` only, in the kernel's nearest format (q4_0, q4_1 or q8_0; floats: q8_0), one expert at
    a time."""
    from hotneurons.runtime.cold_rows import to_blocks

    fmt = nearest(w.fmt) if isinstance(w, QTensor) else WeightFormat.Q8_0
    fmt = str(fmt if spec(fmt).block > 1 else WeightFormat.Q8_0)
    parts = []
    for e in experts:
        rows = expert_rows(w, int(e), out)
        parts.append(to_blocks(rows.dequantize(torch.float32) if isinstance(rows, QTensor) else rows.float(), fmt))
    return np.ascontiguousarray(np.concatenate(parts)) if parts else np.zeros((0, 0), np.uint8)


def nbytes(w: Any) -> int:
    if w is None:
        return 0
    if isinstance(w, GpuQ):
        return w.nbytes
    if isinstance(w, QTensor):
        return w.data.numel()
    if isinstance(w, np.ndarray):
        return w.nbytes
    return w.numel() * w.element_size()


def expert_rows(w: QTensor | torch.Tensor, e: int, out: int) -> QTensor | torch.Tensor:
    """Expert e's `out` rows of a stacked tensor (a view)."""
    return w.rows(slice(e * out, (e + 1) * out)) if isinstance(w, QTensor) else rows2d(w, out)[e * out:(e + 1) * out]


def unread_rows(stacked: dict[str, Any], outs: dict[str, int], gpu_ids: np.ndarray, cold_ids: np.ndarray,
                on_device: bool, in_place: bool, down_t: bool) -> list:
    """The file's expert rows a loaded layer never reads again (views): the device experts' where they were copied to
    a device; the cold experts' where they were re-quantized (all three projections) or have a down_t (down: decode
    and prefill read down_t, kernels/cold_experts_sparse.py)."""
    views = [expert_rows(stacked[k], int(e), outs[k]) for k in PROJ for e in gpu_ids] if on_device else []
    cold_proj = () if in_place and not down_t else ("down",) if in_place else PROJ
    return views + [expert_rows(stacked[k], int(e), outs[k]) for k in cold_proj for e in cold_ids]
