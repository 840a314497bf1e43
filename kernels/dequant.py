"""Rows of llama.cpp blocks as a GGUF file stores them (Q4_0, Q4_1, Q8_0: scale, [min,] quants interleaved) to a float
tensor in one pass, on the device where they are.

The prefill path streams a layer's cold rows to the GPU in chunks and multiplies them there in the model's dtype;
de-quantizing with torch (weights/quants.dequantize: unpack, widen, scale, each a pass over a float32 temporary) and
then casting to fp16 cost more than the copy itself on a 70B. One Triton program reads each block's bytes once and
writes the weights in the output's dtype, rounded once from the float32 product (so equal to torch's float32 result
cast to that dtype).

`dequant_rows(data, fmt, cols, dtype)`: the same function on every device; on the CPU (or a format without a kernel)
it is weights/quants.dequantize then a cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from hotneurons.weights.formats import WeightFormat, row_bytes, weight_format

KERNEL_FORMATS = {WeightFormat.Q4_0: (18, 2), WeightFormat.Q4_1: (20, 4), WeightFormat.Q8_0: (34, 2)}  # bytes, head


@triton.jit
def _f16_at(row_ptr, at, mask):
    """The little-endian fp16 at byte offsets `at` (any shape) as float32."""
    lo = tl.load(row_ptr + at, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(row_ptr + at + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_file_kernel(d_ptr, out_ptr, N, NB, stride_d, stride_o, KIND: tl.constexpr, BYTES: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    """Program (p, r): rows [p * BLOCK_N, ...), blocks [r * BLOCK_B, ...). KIND 0 Q4_0: w = d (q - 8), the low nibble
    of quant byte j weight j, its high nibble weight 16 + j; 1 Q4_1: w = d q + m, nibbles as Q4_0's; 2 Q8_0:
    w = d q, byte j weight j (int8)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    blk = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    m2 = (n < N)[:, None] & (blk < NB)[None, :]  # (BLOCK_N, BLOCK_B)
    base = d_ptr + n.to(tl.int64)[:, None] * stride_d + blk[None, :] * BYTES  # (BLOCK_N, BLOCK_B) block starts
    s = _f16_at(base, 0, m2)[:, :, None]  # (BLOCK_N, BLOCK_B, 1)
    o_at = out_ptr + n.to(tl.int64)[:, None, None] * stride_o + blk[None, :, None] * 32
    m3 = m2[:, :, None]
    dt = out_ptr.dtype.element_ty
    if KIND == 2:
        j = tl.arange(0, 32)[None, None, :]
        q = tl.load(base[:, :, None] + 2 + j, mask=m3, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        tl.store(o_at + j, (s * q).to(dt), mask=m3)
    else:
        HEAD: tl.constexpr = 4 if KIND == 1 else 2
        j = tl.arange(0, 16)[None, None, :]
        q = tl.load(base[:, :, None] + HEAD + j, mask=m3, other=0)  # (BLOCK_N, BLOCK_B, 16) uint8
        lo, hi = (q & 15).to(tl.float32), (q >> 4).to(tl.float32)
        if KIND == 1:
            mn = _f16_at(base, 2, m2)[:, :, None]
            tl.store(o_at + j, (s * lo + mn).to(dt), mask=m3)
            tl.store(o_at + j + 16, (s * hi + mn).to(dt), mask=m3)
        else:
            tl.store(o_at + j, (s * (lo - 8.0)).to(dt), mask=m3)
            tl.store(o_at + j + 16, (s * (hi - 8.0)).to(dt), mask=m3)


def dequant_rows(data: torch.Tensor, fmt: str | WeightFormat, cols: int, dtype: torch.dtype = torch.float32,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """(rows, row_bytes(fmt, cols)) uint8 file blocks -> (rows, cols) weights in `dtype` (or into `out`), where data
    is. CUDA and Q4_0 / Q4_1 / Q8_0: one kernel; otherwise weights/quants.dequantize."""
    fmt = weight_format(fmt)
    rows = data.shape[0]
    out = torch.empty((rows, cols), dtype=dtype, device=data.device) if out is None else out  # (rows, cols)
    rb = row_bytes(fmt, cols)
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != rb or tuple(out.shape) != (rows, cols):
        raise ValueError(f"dequant_rows {fmt.value}: expected ({rows}, {rb}) uint8 rows into ({rows}, {cols}), got "
                         f"{tuple(data.shape)} {data.dtype} into {tuple(out.shape)}: pass whole rows of blocks")
    if fmt not in KERNEL_FORMATS or not _on_kernels(data) or out.stride(1) != 1 or data.stride(1) != 1:
        from hotneurons.weights.quants import dequantize

        return out.copy_(dequantize(data, fmt, cols))
    if rows == 0 or cols == 0:
        return out
    nb = cols // 32
    bn, bb = 4, min(64, triton.next_power_of_2(nb))
    kind = {WeightFormat.Q4_0: 0, WeightFormat.Q4_1: 1, WeightFormat.Q8_0: 2}[fmt]
    _dequant_file_kernel[(triton.cdiv(rows, bn), triton.cdiv(nb, bb))](
        data, out, rows, nb, data.stride(0), out.stride(0), KIND=kind, BYTES=KERNEL_FORMATS[fmt][0],
        BLOCK_N=bn, BLOCK_B=bb, num_warps=4)
    return out


def _on_kernels(t: torch.Tensor) -> bool:
    """Whether t's device runs the kernel (the tests patch it to run it in Triton's interpreter on CPU tensors)."""
    return t.is_cuda
