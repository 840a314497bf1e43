"""The cold experts' down projection neuron-major (`down_t`), built at load for kernels/cold_experts_sparse.py (a
ReLU-family mixture of experts' decode: runtime/moe_ffn.py).

A GGUF stores an expert's down as (d, n): output-major rows, a Q4_0 / Q8_0 block spanning 32 neurons, so skipping an
inactive neuron saves none of its down bytes. down_t holds cold expert c's neuron j at row c * n + j (the d weights
neuron j writes), in the format of the down rows the dense kernel reads:
  block formats (Q4_0, Q4_1, Q8_0; a K-quant down in its nearest, Q4_K -> q4_1, Q5_K / Q6_K -> q8_0, as
    models/ffn_weights.cold_formats says why): the file's down de-quantized, transposed and quantized again with
    llama.cpp's rounding (runtime/cold_rows.to_blocks). This is a second quantization of down: its weights differ
    from the file's by that rounding (PowerInfer's own export of TurboSparse models quantizes its neuron-major down the
    same way). Decode and prefill both compute with down_t (kernels/cold_experts_sparse.py token by token, or
    runtime/moe_prefill.py on the device), so the two agree.
  floats (f32, f16, bf16): the file's rows transposed, bit for bit.

Memory: one anonymous numpy array per layer, about a third of the cold experts' bytes; the file's down pages of those
experts are dropped once it is built (runtime/moe_rows.unread_rows) and never read again. Built expert by expert,
and for block formats COLS neurons at a time, so that the float32 temporary stays a (d, COLS) slice of one expert.
"""

from __future__ import annotations

import numpy as np
import torch
from hotneurons.kernels.cold_experts import FLOAT_ROWS, row_format
from hotneurons.kernels.cold_experts_sparse import SPARSE_ACTS
from hotneurons.runtime.cold_rows import to_blocks
from hotneurons.weights.formats import nearest, row_bytes, spec
from hotneurons.weights.qtensor import QTensor

COLS = 2048  # neurons de-quantized at a time: bounds the float32 temporary to (d, COLS)
BLOCK = 32  # weights per block of the formats down_t may take (its rows hold d weights)


def wants_down_t(activation: str, cold_down: np.ndarray | None, d: int, n: int, fmt: str | None = None) -> bool:
    """Whether a layer's cold experts get a down_t: a ReLU-family activation, down rows the kernels read (block rows
    need d, down_t's row width, a whole number of blocks). fmt: cold_down's (kernels/cold_experts.row_format's)."""
    if activation not in SPARSE_ACTS or cold_down is None:
        return False
    fmt = row_format(cold_down, n, fmt)
    return fmt in FLOAT_ROWS or d % BLOCK == 0


def _columns(down: QTensor | torch.Tensor, e: int, d: int, n: int, c0: int, c1: int) -> torch.Tensor:
    """(d, c1 - c0) float32: expert e's down weights of neurons c0..c1 - 1 (c0, c1 whole blocks of down's format)."""
    if not isinstance(down, QTensor):
        return down.reshape(-1, n)[e * d:(e + 1) * d, c0:c1].float()
    s = spec(down.fmt)
    rows = down.data[e * d:(e + 1) * d, c0 // s.block * s.block_bytes:c1 // s.block * s.block_bytes]  # (d, bytes)
    return QTensor(rows.contiguous(), down.fmt, (d, c1 - c0)).dequantize(torch.float32)


def build_down_t(down: QTensor | torch.Tensor, cold_down: np.ndarray, experts: np.ndarray, d: int, n: int,
                 fmt: str | None = None) -> np.ndarray:
    """(len(experts) * n, row) down_t of the cold experts `experts` (ids, in cold order) in cold_down's format (a
    K-quant's nearest). down: the file's stacked down (QTensor (E * d, n) rows, or a float (E, d, n) tensor);
    cold_down: the rows the dense kernel reads (kernels/cold_experts: the file's own for floats, so that expert e is
    rows e * d..); fmt: cold_down's (row_format's)."""
    fmt = row_format(cold_down, n, fmt)
    fmt = nearest(fmt).value if fmt in ("q4_k", "q5_k", "q6_k") else fmt
    m = len(experts)
    if fmt in FLOAT_ROWS:  # the file's bits, transposed
        out = np.empty((m * n, d), cold_down.dtype)  # (n_cold * n, d) float32 / fp16 bits / bf16 bits
        for c, e in enumerate(experts):
            out[c * n:(c + 1) * n] = cold_down[e * d:(e + 1) * d].T
        return out
    if d % BLOCK:
        raise ValueError(f"down_t: d {d} is not a whole number of {BLOCK}-weight blocks: keep the dense path for "
                         f"this layer (wants_down_t says so)")
    out = np.empty((m * n, row_bytes(fmt, d)), np.uint8)  # (n_cold * n, d / 32 * block bytes) uint8 `fmt` rows
    step = COLS
    if isinstance(down, QTensor):
        blk = spec(down.fmt).block
        step = max(blk, COLS // blk * blk)
    for c, e in enumerate(experts):
        for c0 in range(0, n, step):
            c1 = min(n, c0 + step)
            w = _columns(down, int(e), d, n, c0, c1).T.contiguous()  # (c1 - c0, d) float32
            out[c * n + c0:c * n + c1] = to_blocks(w, fmt)
    return out
