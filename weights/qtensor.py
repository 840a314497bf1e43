"""`QTensor`: a 2-D weight kept in its stored block format, on any device; `convert`: one in another format."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hotneurons.weights.formats import WeightFormat, row_bytes, weight_format
from hotneurons.weights.quants import _chunk_rows, dequantize, quantize

# the float formats as torch dtypes (their bytes can be viewed as these)
FLOAT_DTYPES = {WeightFormat.F32: torch.float32, WeightFormat.F16: torch.float16, WeightFormat.BF16: torch.bfloat16}


@dataclass(frozen=True)
class QTensor:
    """A (rows, cols) weight as rows of blocks: `data` (rows, row_bytes(fmt, cols)) uint8, on any device. Float
    formats may be QTensors too (their bytes), but a plain float torch tensor is the usual form of those."""

    data: torch.Tensor  # (rows, row bytes) uint8
    fmt: WeightFormat
    shape: tuple[int, int]  # (rows, cols): the logical weight's shape, as torch's Linear.weight

    def __post_init__(self):
        object.__setattr__(self, "fmt", weight_format(self.fmt))
        rows, cols = self.shape
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != (rows, row_bytes(self.fmt, cols)):
            raise ValueError(f"QTensor {self.fmt} {self.shape}: data is {tuple(self.data.shape)} {self.data.dtype}, "
                             f"expected ({rows}, {row_bytes(self.fmt, cols)}) uint8")

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def to(self, device: torch.device | str) -> "QTensor":
        return QTensor(self.data.to(device), self.fmt, self.shape)

    def rows(self, idx: torch.Tensor | slice) -> "QTensor":
        """A QTensor of some rows (a copy for an index tensor; a view for a slice)."""
        data = self.data[idx]
        return QTensor(data, self.fmt, (data.shape[0], self.shape[1]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(rows, cols) in `dtype`, on the data's device."""
        return dequantize(self.data, self.fmt, self.shape[1]).to(dtype)


def convert(w: QTensor, to: str | WeightFormat, device: torch.device | str | None = None) -> QTensor | torch.Tensor:
    """w's weights in format `to` on `device` (default: w's), a chunk of rows at a time: each chunk's stored bytes
    cross to the device, are de-quantized and quantized there, so the float temporaries stay a chunk's. A block `to`
    gives a QTensor, a float one a tensor of its dtype; w itself (moved) where it is in `to` already."""
    to = weight_format(to)
    device = w.data.device if device is None else torch.device(device)
    if w.fmt == to:
        return w.to(device)
    rows, cols = w.shape
    dtype = FLOAT_DTYPES.get(to)
    out = (torch.empty((rows, cols), dtype=dtype, device=device) if dtype is not None  # (rows, cols)
           else torch.empty((rows, row_bytes(to, cols)), dtype=torch.uint8, device=device))  # (rows, row bytes)
    step = _chunk_rows(cols)
    for r0 in range(0, rows, step):
        x = dequantize(w.data[r0:r0 + step].to(device), w.fmt, cols)  # (r, cols) float32
        out[r0:r0 + step] = x if dtype is not None else quantize(x, to)
    return out if dtype is not None else QTensor(out, to, (rows, cols))
