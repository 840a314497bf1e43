"""weights/quants.py against gguf-py's numpy reference (gguf.quants), bit for bit, on fresh random blocks and weights.

De-quantization is exact (assert_array_equal, no tolerance): both sides take the same float32 products and sums in
the same order. Quantization is byte-identical to gguf.quants.quantize, ties included."""

import numpy as np
import pytest
import torch
from hotneurons.weights import quants
from hotneurons.weights.formats import FORMATS, WeightFormat, row_bytes
from hotneurons.weights.qtensor import QTensor
from hotneurons.weights.quants import dequantize, fp16_bits_to_f32, quantize

F = WeightFormat
DEQUANT = [F.F32, F.F16, F.BF16, F.Q8_0, F.Q4_0, F.Q4_1, F.Q4_K, F.Q5_K, F.Q6_K]
QUANT = [F.F32, F.F16, F.BF16, F.Q8_0, F.Q4_0, F.Q4_1]
# byte offsets of the fp16 fields in a block (scales, mins), which random bytes could make inf or NaN
FP16_FIELDS = {F.Q8_0: (0,), F.Q4_0: (0,), F.Q4_1: (0, 2), F.Q4_K: (0, 2), F.Q5_K: (0, 2), F.Q6_K: (208,)}
# per float format: (bits dtype, exponent mask, lowest exponent bit): an all-ones exponent is inf or NaN
FLOAT_BITS = {F.F32: (np.uint32, 0x7F800000, 0x00800000), F.F16: (np.uint16, 0x7C00, 0x0400),
              F.BF16: (np.uint16, 0x7F80, 0x0080)}


def gguf_dequantize(b: np.ndarray, fmt: WeightFormat) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as ref

    return ref(b, GGMLQuantizationType(FORMATS[fmt].ggml_type)).astype(np.float32)


def gguf_quantize(w: np.ndarray, fmt: WeightFormat) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as ref

    return ref(w, GGMLQuantizationType(FORMATS[fmt].ggml_type)).view(np.uint8)  # f32/f16 come back as floats


def finite_bits(rng, fmt: WeightFormat, n: int) -> np.ndarray:
    """n random bit patterns of a float format, every one finite (subnormals, zeros and both signs included)."""
    dtype, exp, low = FLOAT_BITS[fmt]
    bits = rng.integers(0, np.iinfo(dtype).max, n, dtype=dtype, endpoint=True)
    return np.where(bits & exp == exp, bits ^ dtype(low), bits).astype(dtype)


def random_rows(rng, fmt: WeightFormat, rows: int, cols: int) -> np.ndarray:
    """(rows, row_bytes) uint8: random bytes, the fp16 fields set to random finite fp16 values."""
    rb = row_bytes(fmt, cols)
    if fmt in FLOAT_BITS:
        return finite_bits(rng, fmt, rows * rb // FLOAT_BITS[fmt][0]().itemsize).view(np.uint8).reshape(rows, rb)
    s = FORMATS[fmt]
    b = rng.integers(0, 256, (rows * cols // s.block, s.block_bytes), dtype=np.uint8)  # (blocks, block bytes)
    for at in FP16_FIELDS[fmt]:
        b[:, at:at + 2] = finite_bits(rng, F.F16, len(b)).view(np.uint8).reshape(-1, 2)
    return b.reshape(rows, rb)


def random_weights(rng, rows: int, cols: int) -> np.ndarray:
    """(rows, cols) float32 over many magnitudes, with the corners of the reference rounding: an all-zero block, a
    block whose largest |w| comes as -m before +m (Q4_0 takes the first), and exact halves for Q8_0's roundf."""
    w = (rng.standard_normal((rows, cols)) * 10.0 ** rng.uniform(-4, 4, (rows, 1))).astype(np.float32)
    w[0, :32] = 0
    if rows > 1:
        w[1, :32] = rng.uniform(-1, 1, 32)
        w[1, 3], w[1, 9] = -1.5, 1.5
    if rows > 2:  # |max| 127: Q8_0's scale is 1 and k + 0.5 lands exactly between two steps
        w[2, :32] = rng.integers(-126, 126, 32) + 0.5
        w[2, 0] = 127
    return w


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["cpu-kernels", "torch"])
@pytest.mark.parametrize("fmt", DEQUANT, ids=str)
def test_dequantize_equals_gguf_exactly(fmt, cpu_kernels, monkeypatch):
    """Odd rows, two blocks a row, and chunks of 2 rows (so the last chunk is partial), against gguf.quants; Q4_0 and
    Q8_0 through the CPU's Numba kernels (weights/quants_cpu.py) and torch's."""
    monkeypatch.setattr(quants, "CPU_KERNELS", cpu_kernels)
    rng = np.random.default_rng(list(F).index(fmt))
    cols = 2 * FORMATS[fmt].block if FORMATS[fmt].block > 1 else 96
    b = random_rows(rng, fmt, 7, cols)  # (7, row bytes)
    ref = gguf_dequantize(b, fmt)  # (7, cols)
    assert np.isfinite(ref).all()
    monkeypatch.setattr(quants, "_CHUNK_FLOATS", 2 * cols + 1)
    ours = dequantize(torch.from_numpy(b), fmt, cols)
    assert ours.dtype == torch.float32 and ours.shape == (7, cols)
    np.testing.assert_array_equal(ours.numpy(), ref)
    np.testing.assert_array_equal(dequantize(torch.from_numpy(b[3]), fmt.value, cols).numpy(), ref[3])  # one 1-D row
    np.testing.assert_array_equal(QTensor(torch.from_numpy(b), fmt, (7, cols)).dequantize().numpy(), ref)


@pytest.mark.parametrize("fmt", [F.F32, F.Q6_K], ids=str)
def test_dequantize_strided_and_misaligned_bytes(fmt):
    """Every other row of a tensor, and rows starting at an odd byte address: copied where a view cannot be taken."""
    rng = np.random.default_rng(5)
    cols = FORMATS[fmt].block * 2 if FORMATS[fmt].block > 1 else 8
    b = random_rows(rng, fmt, 6, cols)
    ref = gguf_dequantize(b, fmt)
    t = torch.from_numpy(b)
    np.testing.assert_array_equal(dequantize(t[::2], fmt, cols).numpy(), ref[::2])
    flat = torch.zeros(b.size + 1, dtype=torch.uint8)
    flat[1:] = t.reshape(-1)
    odd = flat[1:].view(6, -1)  # contiguous, at an odd address
    np.testing.assert_array_equal(dequantize(odd, fmt, cols).numpy(), ref)


def test_fp16_bits_match_numpy():
    bits = finite_bits(np.random.default_rng(2), F.F16, 4096)  # (4096,) uint16
    ours = fp16_bits_to_f32(torch.from_numpy(bits.view(np.uint8).reshape(-1, 2)))
    np.testing.assert_array_equal(ours.numpy(), bits.view(np.float16).astype(np.float32))


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["cpu-kernels", "torch"])
@pytest.mark.parametrize("fmt", QUANT, ids=str)
def test_quantize_equals_gguf_bytes(fmt, cpu_kernels, monkeypatch):
    monkeypatch.setattr(quants, "CPU_KERNELS", cpu_kernels)
    rng = np.random.default_rng(100 + list(F).index(fmt))
    w = random_weights(rng, 9, 96)  # (9, 96) float32
    ref = gguf_quantize(w, fmt).reshape(9, -1)  # (9, row bytes)
    monkeypatch.setattr(quants, "_CHUNK_FLOATS", 4 * 96 + 7)
    ours = quantize(torch.from_numpy(w), fmt)
    assert ours.dtype == torch.uint8 and ours.shape == (9, row_bytes(fmt, 96))
    np.testing.assert_array_equal(ours.numpy(), ref)
    np.testing.assert_array_equal(quantize(torch.from_numpy(w[4]), fmt.value).numpy(), ref[4])  # one 1-D row
    # other input dtypes are taken as float32, as gguf-py does
    wb = torch.from_numpy(w).bfloat16()
    np.testing.assert_array_equal(quantize(wb, fmt).numpy(), gguf_quantize(wb.float().numpy(), fmt).reshape(9, -1))


def test_quantize_ties_and_halves():
    """The corners of the reference rounding, spelled out: Q4_0 takes the first of -m, +m; Q8_0 rounds k + 0.5 away
    from zero (torch.round would go to even)."""
    w = torch.zeros(2, 32)
    w[0, 3], w[0, 9] = -2.0, 2.0  # d = -2 / -8 = 0.25: -2 -> q 0, +2 -> q 16, clipped to 15
    q = quantize(w, "q4_0")
    assert fp16_bits_to_f32(q[0, :2]).item() == 0.25
    assert dequantize(q, "q4_0", 32)[0, 3] == -2.0 and dequantize(q, "q4_0", 32)[0, 9] == 1.75
    w[1, 0], w[1, 1], w[1, 2] = 127.0, 2.5, -3.5  # d = 1
    q8 = quantize(w, "q8_0")[1, 2:].view(torch.int8)
    assert q8[:3].tolist() == [127, 3, -4]


@pytest.mark.parametrize("fmt", QUANT, ids=str)
def test_round_trip_error_is_within_a_step(fmt):
    """dequantize(quantize(w)) is w to within the format's step: exact for f32, torch's own rounding for f16/bf16,
    half a step (a whole one on Q4_0's clipped side) plus the fp16 rounding of the scales for the blocks (relative, or
    half the subnormal spacing 2^-25 for scales below fp16's smallest normal, times |q| <= 128)."""
    rng = np.random.default_rng(11)
    w = torch.from_numpy(random_weights(rng, 5, 64))  # (5, 64)
    back = dequantize(quantize(w, fmt), fmt, 64)
    if fmt is F.F32:
        assert torch.equal(back, w)
        return
    if fmt in (F.F16, F.BF16):
        assert torch.equal(back, w.to(torch.float16 if fmt is F.F16 else torch.bfloat16).float())
        return
    blocks, err = w.reshape(-1, 32).double(), (back - w).reshape(-1, 32).abs().double()  # (blocks, 32)
    amax = blocks.abs().amax(1, keepdim=True)
    lo, hi = blocks.amin(1, keepdim=True), blocks.amax(1, keepdim=True)
    step = {F.Q8_0: amax / 127 * 0.5, F.Q4_0: amax / 8, F.Q4_1: (hi - lo) / 15 * 0.5}[fmt]
    assert (err <= step * (1 + 2**-9) + amax * 2**-9 + 128 * 2**-25).all()


def test_errors_are_one_line_and_name_the_fix():
    b = torch.zeros(3, 17, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"dequantize q4_0: data is \(3, 17\), expected \(rows, 18\) uint8") as e:
        dequantize(b, "q4_0", 32)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="data is torch.int8, expected torch.uint8"):
        dequantize(b.view(torch.int8), "q4_0", 32)
    with pytest.raises(ValueError, match="expected \\(rows, 18\\)"):
        dequantize(torch.zeros(2, 3, 18, dtype=torch.uint8), "q4_0", 32)
    with pytest.raises(ValueError, match="not a whole number of q4_0 blocks of 32"):
        dequantize(b, "q4_0", 33)
    with pytest.raises(ValueError, match="cannot dequantize int8 .*cold_rows.*: choose one of f32, f16"):
        dequantize(b, "int8", 64)
    with pytest.raises(ValueError, match="cannot quantize to q4_k: choose one of f32, f16, bf16, q8_0, q4_0, q4_1"):
        quantize(torch.zeros(2, 256), "q4_k")
    with pytest.raises(ValueError, match=r"w is \(2, 32\) torch.int64, expected a float"):
        quantize(torch.zeros(2, 32, dtype=torch.int64), "q8_0")
    with pytest.raises(ValueError, match="unknown weight format 'q3_x'"):
        quantize(torch.zeros(2, 32), "q3_x")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", DEQUANT, ids=str)
def test_cuda_equals_cpu(fmt):
    """On the GPU the same bytes come out (no fused multiply-adds, same roundings); checked against the CPU path,
    which the tests above hold to gguf-py."""
    rng = np.random.default_rng(3)
    cols = 2 * FORMATS[fmt].block if FORMATS[fmt].block > 1 else 96
    b = torch.from_numpy(random_rows(rng, fmt, 5, cols))
    assert torch.equal(dequantize(b.cuda(), fmt, cols).cpu(), dequantize(b, fmt, cols))
    if fmt in QUANT:
        w = torch.from_numpy(random_weights(rng, 5, cols))
        assert torch.equal(quantize(w.cuda(), fmt).cpu(), quantize(w, fmt))


def hard_weights(rng, rows: int, cols: int) -> np.ndarray:
    """random_weights' corners over a wider range of magnitudes: blocks from ~1e-34 (scales fp16 flushes to zero or
    keeps subnormal) to ~1e10 (scales past fp16's largest), zeros of both signs, exact ties of -m and +m."""
    w = random_weights(rng, rows, cols)
    w *= (10.0 ** rng.uniform(-30, 6, (rows, cols // 32, 1))).astype(np.float32).repeat(32, axis=2).reshape(rows, -1)
    w[3, 32:64] = -0.0
    w[4, 64:96] = np.where(rng.random(32) < 0.5, 0.0, -0.0).astype(np.float32)
    w[5, 32:64] = rng.choice(np.array([-3.0, 3.0, 1.0], np.float32), 32)
    return w


@pytest.mark.parametrize("fmt", [F.Q4_0, F.Q8_0], ids=str)
def test_cpu_kernels_equal_torch_kernels(fmt, monkeypatch):
    """weights/quants_cpu.py's Numba kernels give torch's kernels' bytes and floats, over many magnitudes and the
    rounding's corners; blocks with inf or NaN they leave to torch's (the same bytes either way)."""
    from hotneurons.weights import quants_cpu

    rng = np.random.default_rng(21)
    w = torch.from_numpy(hard_weights(rng, 16, 256))  # (16, 256)
    out = np.empty((16 * 256 // 32, FORMATS[fmt].block_bytes), np.uint8)
    assert quants_cpu.quantize_q(w.numpy().reshape(-1, 32), fmt.value, out)  # every block on the Numba path
    bad = w.clone()
    bad[6, 5], bad[7, 40], bad[8, 100] = float("inf"), float("nan"), float("-inf")
    assert not quants_cpu.quantize_q(bad.numpy().reshape(-1, 32), fmt.value, out.copy())
    fast_q, fast_bad = quantize(w, fmt), quantize(bad, fmt)
    b = torch.from_numpy(random_rows(rng, fmt, 16, 256))  # (16, row bytes): every scale an fp16
    fast_d = dequantize(b, fmt, 256)
    fast_back = dequantize(fast_q, fmt, 256)
    monkeypatch.setattr(quants, "CPU_KERNELS", False)
    np.testing.assert_array_equal(fast_q.numpy(), quantize(w, fmt).numpy())
    np.testing.assert_array_equal(fast_q.numpy(), out.reshape(16, -1))
    np.testing.assert_array_equal(fast_bad.numpy(), quantize(bad, fmt).numpy())
    np.testing.assert_array_equal(fast_d.numpy(), dequantize(b, fmt, 256).numpy())
    np.testing.assert_array_equal(fast_back.numpy(), dequantize(fast_q, fmt, 256).numpy())
