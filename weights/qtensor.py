"""`QTensor`: a 2-D weight kept in its stored block format, on any device."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hotneurons.weights.formats import WeightFormat, row_bytes, weight_format

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
        from hotneurons.weights.quants import dequantize

        return dequantize(self.data, self.fmt, self.shape[1]).to(dtype)
