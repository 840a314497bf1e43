"""kernels/dequant.dequant_rows (one Triton pass over a GGUF file's blocks; without CUDA in Triton's interpreter)
against gguf-py's de-quantization in float64, on fresh random rows of each format, into float32, fp16 and bf16."""

import zlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from hotneurons.kernels.dequant import dequant_rows
from hotneurons.weights.quants import quantize

TYPES = {"q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _kernel_in_the_interpreter(monkeypatch):
    """Without CUDA the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1) on CPU tensors."""
    from hotneurons.kernels import dequant

    monkeypatch.setattr(dequant, "_on_kernels", lambda t: True)


@pytest.mark.parametrize("fmt", sorted(TYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dequant_rows_equals_gguf(fmt, dtype):
    g = torch.Generator().manual_seed(zlib.crc32(f"{fmt} {dtype}".encode()))
    rows, cols = 7, 96 if DEVICE == "cpu" else 4096
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 3
    data = quantize(w, fmt)  # (rows, row bytes) uint8, the file's blocks
    ref = gguf_dequantize(data.numpy(), TYPES[fmt]).astype(np.float64)  # (rows, cols)
    got = dequant_rows(data.to(DEVICE), fmt, cols, dtype).cpu()
    assert got.dtype == dtype and tuple(got.shape) == (rows, cols)
    want = torch.from_numpy(ref).float()  # gguf-py's float32 product, exact here: the products fit float32
    if dtype == torch.bfloat16 and DEVICE == "cpu":  # the interpreter truncates to bfloat16: within one unit
        torch.testing.assert_close(got.double(), want.double(), rtol=2 ** -7, atol=0)
    else:  # rounded once from the float32 product, as torch's cast of it
        assert torch.equal(got, want.to(dtype))


def test_dequant_rows_strided_rows_and_errors():
    w = torch.randn(6, 64)
    data = quantize(w, "q4_0")
    wide = torch.zeros(6, data.shape[1] + 8, dtype=torch.uint8)
    wide[:, :data.shape[1]] = data
    got = dequant_rows(wide[:, :data.shape[1]].to(DEVICE), "q4_0", 64, torch.float32).cpu()  # rows not contiguous
    assert torch.equal(got, torch.from_numpy(gguf_dequantize(data.numpy(), TYPES["q4_0"])))
    with pytest.raises(ValueError, match="whole rows of blocks"):
        dequant_rows(data[:, :10], "q4_0", 64)
    # formats without a kernel go through weights/quants.dequantize, as every format does off the kernels' devices
    f16 = w.half().view(torch.uint8)  # (6, 128) bytes
    assert torch.equal(dequant_rows(f16, "f16", 64, torch.float32), w.half().float())
