"""Rows of llama.cpp blocks as a GGUF file stores them (Q4_0, Q4_1, Q8_0: scale, [min,] quants interleaved; Q4_K,
Q5_K, Q6_K: 256-weight blocks of sub-block scales and quants) to a float tensor in one pass, on the device where they
are.

The prefill path streams a layer's cold rows to the GPU in chunks and multiplies them there in the model's dtype;
de-quantizing with torch (weights/quants.dequantize: unpack, widen, scale, each a pass over a float32 temporary) and
then casting to fp16 cost more than the copy itself on a 70B. One Triton program reads each block's bytes once and
writes the weights in the output's dtype, rounded once from the float32 value (gguf-py's arithmetic: K-quants' d sc q -
dmin m with d sc, the product and dmin m exact, the difference rounded once; so equal to torch's float32 result cast
to that dtype).

`dequant_rows(data, fmt, cols, dtype)`: the same function on every device; on the CPU (or a format without a kernel)
it is weights/quants.dequantize then a cast. The kernels live in kernels/dequant_gpu.py, imported only where one runs
(a CPU run never loads Triton), with `dequant_k(w, out)` and `dequant_q(qs, scales, q4, out)`: a K-quant's or a Q4_0 /
Q4_1 / Q8_0 GpuQ's rows likewise, for the prefill path's chunks of hot rows (kernels/qlinear.py).
"""

from __future__ import annotations

import torch
from hotneurons.kernels.names import BLOCK_KIND
from hotneurons.kernels.qlayout_k import K_KIND
from hotneurons.weights.formats import WeightFormat, row_bytes, weight_format

# the formats the kernels read, -> the kernel's KIND (the 32-weight blocks' and the K-quants'); a block's bytes are
# weights/formats.py's
KERNEL_FORMATS = BLOCK_KIND
K_FORMATS = K_KIND


def dequant_rows(data: torch.Tensor, fmt: str | WeightFormat, cols: int, dtype: torch.dtype = torch.float32,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """(rows, row_bytes(fmt, cols)) uint8 file blocks -> (rows, cols) weights in `dtype` (or into `out`), where data
    is. CUDA and Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K: one kernel; otherwise weights/quants.dequantize."""
    fmt = weight_format(fmt)
    rows = data.shape[0]
    out = torch.empty((rows, cols), dtype=dtype, device=data.device) if out is None else out  # (rows, cols)
    rb = row_bytes(fmt, cols)
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != rb or tuple(out.shape) != (rows, cols):
        raise ValueError(f"dequant_rows {fmt.value}: expected ({rows}, {rb}) uint8 rows into ({rows}, {cols}), got "
                         f"{tuple(data.shape)} {data.dtype} into {tuple(out.shape)}: pass whole rows of blocks")
    kernel = fmt in KERNEL_FORMATS or fmt in K_FORMATS
    if not kernel or not _on_kernels(data) or out.stride(1) != 1 or data.stride(1) != 1:
        from hotneurons.weights.quants import dequantize

        return out.copy_(dequantize(data, fmt, cols))
    from hotneurons.kernels import dequant_gpu  # Triton: imported where a kernel runs

    return dequant_gpu.file_rows(data, fmt, cols, out)


def _on_kernels(t: torch.Tensor) -> bool:
    """Whether t's device runs the kernel (the tests patch it to run it in Triton's interpreter on CPU tensors)."""
    return t.is_cuda
