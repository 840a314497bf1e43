"""The load's shortcuts in models/ffn_weights.py give the bytes of the long way: a dense layout's down projection
packed as the file stores it (hot_blocks, every_column) equals the one re-quantized from its de-quantized columns, for
files written with llama.cpp's reference rounding; the down columns as rows (down_t_rows) through the CPU's Numba
kernels (weights/quants_cpu.py) equal them through torch's."""

import numpy as np
import pytest
import torch
from hotneurons.models import ffn_weights
from hotneurons.models.ffn_weights import FFNWeights, down_t_rows, hot_blocks
from hotneurons.weights import quants
from hotneurons.weights.formats import WeightFormat
from hotneurons.weights.qtensor import QTensor
from hotneurons.weights.quants import dequantize, quantize


def reference_blocks(rows: int, cols: int, fmt: str, seed: int, zeros: bool = True) -> QTensor:
    """A (rows, cols) weight as a GGUF writer stores it: random normal weights, several magnitudes, quantized with
    the reference rounding (weights.quants: gguf-py's bytes), an all-zero block among them (`zeros`)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 10.0 ** rng.uniform(-3, 1, (rows, 1)).astype(np.float32)
    if zeros:
        w[0, :32] = 0
    return QTensor(quantize(torch.from_numpy(w), fmt), WeightFormat(fmt), (rows, cols))


def layer(fmt: str, n: int = 96, d: int = 64) -> FFNWeights:
    return FFNWeights(up=reference_blocks(n, d, fmt, 1), down=reference_blocks(d, n, fmt, 2),
                      gate=reference_blocks(n, d, fmt, 3))


def same_blocks(a, b) -> None:
    """The same weights, packed (GpuQ) or not (an all-zero block's scale may be -0 on one side and +0 on the other:
    torch.equal takes them as equal, as the products do)."""
    assert a.shape == b.shape and a.fmt == b.fmt and type(a) is type(b)
    assert torch.equal(a.dequantize(), b.dequantize())


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_requantizing_reference_blocks_gives_them_back(fmt):
    """every_column's premise: a block written with the reference rounding, de-quantized and quantized again (along
    the same axis), is the same bytes; an all-zero block's scale may come back +0 for the file's -0 (Q4_0's scale is
    w / -8), the same weights."""
    q = reference_blocks(200, 256, fmt, 7, zeros=False)
    assert torch.equal(quantize(dequantize(q.data, fmt, 256), fmt), q.data)
    q = reference_blocks(200, 256, fmt, 7)
    again = quantize(dequantize(q.data, fmt, 256), fmt)
    assert torch.equal(again[:, 2:], q.data[:, 2:]) and torch.equal(again[1:], q.data[1:])
    assert torch.equal(dequantize(again, fmt, 256), dequantize(q.data, fmt, 256))


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_dense_hot_rows_are_the_files_blocks(fmt, device, monkeypatch):
    """On the CPU the hot rows stay QTensors (the file's blocks: fast[...] is w's own), on CUDA qlinear packs them."""
    w = layer(fmt)
    hot = torch.arange(w.shape[0])
    assert ffn_weights.every_column(w, hot, WeightFormat(fmt))
    fast = hot_blocks(w, hot, WeightFormat(fmt), device, gated=True)
    monkeypatch.setattr(ffn_weights, "every_column", lambda *a: False)
    slow = hot_blocks(w, hot, WeightFormat(fmt), device, gated=True)
    for k in ("up", "gate", "down"):
        same_blocks(fast[k], slow[k])
    assert fast["down_cols"] == slow["down_cols"] == w.shape[0]
    if device == "cpu":
        assert fast["down"] is w.down or torch.equal(fast["down"].data, w.down.data)


def test_partial_hot_rows_take_the_long_way():
    w = layer("q4_0")
    assert not ffn_weights.every_column(w, torch.arange(0, 96, 2), WeightFormat.Q4_0)
    assert not ffn_weights.every_column(w, torch.arange(96), WeightFormat.Q8_0)  # another format: converted


@pytest.mark.parametrize("dst", ["f32", "q4_0", "q8_0"])
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_down_rows_cpu_kernels_equal_torch(fmt, dst, monkeypatch):
    """Columns as rows (the cold rows' down_t), from either block format into either, or float32."""
    w = layer(fmt)
    idx = torch.from_numpy(np.sort(np.random.default_rng(4).choice(96, 40, replace=False)))
    fast = down_t_rows(w, idx, dst)
    monkeypatch.setattr(quants, "CPU_KERNELS", False)
    slow = down_t_rows(w, idx, dst)
    assert type(fast) is type(slow)
    assert torch.equal(fast, slow) if dst == "f32" else torch.equal(fast.data, slow.data)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_partial_hot_rows_cpu_kernels_equal_torch(fmt, monkeypatch):
    """Hybrid: the hot columns of down re-blocked along the neurons, padded to whole blocks (41 hot: 64 columns)."""
    w = layer(fmt)
    hot = torch.from_numpy(np.sort(np.random.default_rng(5).choice(96, 41, replace=False)))
    fast = hot_blocks(w, hot, WeightFormat(fmt), "cpu", gated=True)
    monkeypatch.setattr(quants, "CPU_KERNELS", False)
    slow = hot_blocks(w, hot, WeightFormat(fmt), "cpu", gated=True)
    assert fast["down_cols"] == slow["down_cols"] == 64
    for k in ("up", "gate", "down"):
        assert torch.equal(fast[k].data, slow[k].data)


def test_blocks_with_inf_are_left_to_torch(monkeypatch):
    """A non-finite weight: the Numba kernels decline and torch's path gives its bytes."""
    w = layer("q8_0")
    data = w.down.data.clone()
    data[3, 0:2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # an fp16 inf scale: its block widens to inf / nan
    w = FFNWeights(up=w.up, down=QTensor(data, WeightFormat.Q8_0, w.down.shape), gate=w.gate)
    idx = torch.arange(0, 96, 3)
    fast = down_t_rows(w, idx, "q4_0")
    monkeypatch.setattr(quants, "CPU_KERNELS", False)
    assert torch.equal(fast.data, down_t_rows(w, idx, "q4_0").data)
