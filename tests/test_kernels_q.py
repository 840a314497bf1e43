"""The cold kernels over llama.cpp's Q8_0 / Q4_0 / Q4_1 blocks (kernels/cold_q.py) and the block cold rows
(runtime/cold_rows.py) against float64 numpy over the weights that gguf-py's own de-quantizer reads from the same
bytes, on rows laid out as gguf-py writes them (the GGUF file's layout).

Tolerance: the kernels sum float32 products of the de-quantized weights gguf-py reads (every fp16 scale and every q * d
is exact in float32; a Q4_1 weight d * q + m is rounded once to float32, by gguf-py as by the kernels), so they differ
from float64 only by float32 rounding over d terms: |out - ref| <= 1e-4 |ref| + 2e-6 * max|ref| (d up to 4096 terms
of either sign).

The int route (xq=True: x quantized per 32 weights as llama.cpp's Q8_0, integer block dots) is checked twice: against
the float64 reference on the x it computes with (x~ = d_x * q_x, from cold_q.quantize_x), within the float
tolerance above; and each dot against float64 on the true x within the bound that x's rounding allows, sum over
blocks of d_x / 2 * sum |w| (|x - x~| <= d_x / 2 per weight), plus the float tolerance. Q4_1 rows have no int route:
xq=True runs the float route on them, bit for bit.
"""

import zlib

import gguf
import numpy as np
import pytest
import torch
from cold_ref import check_ffn_rows, cold_ffn64
from hotneurons.kernels import cold as K
from hotneurons.kernels import cold_q as KQ
from hotneurons.kernels.names import COLD_DTYPES
from hotneurons.runtime import cold_rows as C
from hotneurons.weights.qtensor import QTensor

FMTS = ("q8_0", "q4_0", "q4_1")
XQ_FMTS = ("q8_0", "q4_0")  # the formats the int route reads
QTYPE = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
         "q4_1": gguf.GGMLQuantizationType.Q4_1}
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}


XQ = pytest.mark.skipif(not KQ.XQ_OK, reason="the int route needs AVX-512 VNNI and VBMI (cold_q_ir.XQ_OK)")


def _close(out: np.ndarray, ref: np.ndarray) -> None:
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=2e-6 * max(1.0, float(np.abs(ref).max(initial=0))))


def _w64(rows: np.ndarray | None, fmt: str) -> np.ndarray | None:
    """Block rows -> the float64 weights gguf-py reads from them."""
    return None if rows is None else gguf.quants.dequantize(rows, QTYPE[fmt]).astype(np.float64)


def reference(act: str, x: np.ndarray, idx: np.ndarray, rows: C.ColdRows) -> np.ndarray:
    """float64: sum over j in idx of h_j(x) * down_t[j] (tests/cold_ref.py on gguf-py's weights)."""
    return cold_ffn64(act, x, idx, _w64(rows.gate, rows.fmt), _w64(rows.up, rows.fmt), rows.b_up,
                      _w64(rows.down_t, rows.fmt))


def gguf_rows(rng, act: str, d: int, n: int, fmt: str) -> C.ColdRows:
    """Random rows quantised by gguf-py (the bytes a GGUF file holds), taken as they are (ColdRows.from_blocks)."""
    def q() -> QTensor:
        w = rng.standard_normal((n, d)).astype(np.float32) / np.sqrt(d)
        return QTensor(torch.from_numpy(gguf.quants.quantize(w, QTYPE[fmt])), fmt, (n, d))

    gated = act in K.GATED
    b_up = None if gated else torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 0.1)
    return C.ColdRows.from_blocks(q() if gated else None, q(), b_up, q())


def _idx(which: str, rng, n: int, pre: np.ndarray) -> np.ndarray:
    """Active positions: none, one, all, a random odd count, or those with a positive gate (a predictor's marks)."""
    if which == "random":
        idx = np.flatnonzero(rng.random(n) < 0.4)
        idx = idx[:len(idx) - 1 + len(idx) % 2] if len(idx) else np.array([n // 2])  # an odd count
    else:
        idx = {"empty": np.zeros(0), "one": np.array([n - 1]), "all": np.arange(n),
               "active": np.flatnonzero(pre > 0)}[which]
    return idx.astype(np.int64)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("act", list(K.ACT_CODE))
@pytest.mark.parametrize("d,n", [(64, 129), (96, 23), (4096, 41)])
@pytest.mark.parametrize("which", ["empty", "one", "random", "active", "all"])
def test_kernel_matches_float64_reference(fmt, act, d, n, which):
    rng = np.random.default_rng(zlib.crc32(repr((fmt, act, d, n, which)).encode()))
    x = rng.standard_normal(d).astype(np.float32)
    rows = gguf_rows(rng, act, d, n, fmt)
    assert rows.dtype == fmt and rows.d == d
    pre = _w64(rows.gate, fmt) @ x if act in K.GATED else _w64(rows.up, fmt) @ x + rows.b_up
    idx = _idx(which, rng, n, pre)
    # ffn_rows dispatches on rows.dtype; the device's reads in place are views on the CPU, de-quantised by torch
    check_ffn_rows(act, x, idx, rows, reference(act, x, idx, rows), _close)


@pytest.mark.parametrize("fmt", FMTS)
def test_kernel_threads_do_not_change_the_result(fmt):
    rng = np.random.default_rng(1)
    d, n = 64, 203
    x = rng.standard_normal(d).astype(np.float32)
    rows = gguf_rows(rng, "swiglu", d, n, fmt)
    idx = np.arange(n, dtype=np.int64)
    outs = [C.ffn_rows("swiglu", x, idx, rows, np.empty(d, np.float32), np.empty((t, d), np.float32))
            for t in (1, 3, 7)]
    for o in outs[1:]:
        np.testing.assert_allclose(o, outs[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("act", ["reglu", "relu"])
def test_cold_layer_q_equals_float64_reference(fmt, act):
    """One layer's CPU part in one call over block rows: packed mask -> positions, the first `skip` left out."""
    rng = np.random.default_rng(zlib.crc32(repr((fmt, act)).encode()))
    d, n = 96, 203
    rows = gguf_rows(rng, act, d, n, fmt)
    x = rng.standard_normal(d).astype(np.float32)
    marks = np.zeros(2)
    for p in (0.0, 0.1, 0.6):
        m = rng.random(n) < p
        for skip in (0, 5, n + 1):
            out, part = np.full(d, np.nan, np.float32), np.full((3, d), np.nan, np.float32)
            k = KQ.cold_layer_q(K.NO_FLAGS, K.NO_FLAGS, -1, K.pack_mask(m).view(np.uint64), np.full(n, -1, np.int64),
                                skip, x, rows.gate_arg, rows.up, rows.b_up, rows.down_t, part, out, K.ACT_CODE[act],
                                marks)
            assert k == m.sum()
            _close(out, reference(act, x, np.flatnonzero(m)[skip:], rows))
    assert marks[0] == 9
    # with a layer index: the GPU's ready flag (set already) is taken and reset, the release flag set after the sum
    ready, release = np.array([0, 1, 0], np.int32), np.zeros(3, np.int32)
    out, part = np.full(d, np.nan, np.float32), np.full((3, d), np.nan, np.float32)
    k = KQ.cold_layer_q(ready, release, 1, K.pack_mask(m).view(np.uint64), np.full(n, -1, np.int64), 0, x,
                        rows.gate_arg, rows.up, rows.b_up, rows.down_t, part, out, K.ACT_CODE[act], marks)
    assert k == m.sum() and ready.tolist() == [0, 0, 0] and release.tolist() == [0, 1, 0]
    _close(out, reference(act, x, np.flatnonzero(m), rows))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("d,n", [(32, 1), (96, 203), (4096, 37)])
def test_gemv_q_matches_float64(fmt, d, n):
    rng = np.random.default_rng(zlib.crc32(repr((fmt, d, n)).encode()))
    w = rng.standard_normal((n, d)).astype(np.float32)
    rows = gguf.quants.quantize(w, QTYPE[fmt])
    x = rng.standard_normal(d).astype(np.float32)
    out = np.full(n, np.nan, np.float32)
    assert KQ.gemv_q(x, rows, out, fmt) is out
    _close(out, _w64(rows, fmt) @ x.astype(np.float64))
    for other in set(FMTS) - {fmt}:
        with pytest.raises(ValueError, match=f"not {other} rows"):
            KQ.gemv_q(x, rows, out, other)  # another format's width
    with pytest.raises(ValueError, match="format 'bf16' has no CPU kernel"):
        KQ.gemv_q(x, rows, out, "bf16")


def test_block_layout_read_by_hand():
    """One Q4_0, one Q4_1 and one Q8_0 row written byte by byte from ggml-common.h's layout (not by any quantizer):
    fp16 scale d, then Q4_0's byte j = weight j (low nibble) | weight j + 16 (high nibble), w = d (q - 8); Q4_1's fp16
    min m, then Q4_0's nibbles, w = d q + m; Q8_0's int8 q, w = d q."""
    d = 64
    q4 = np.arange(d) % 16  # the nibbles 0..15, repeated
    row4, row41, row8 = np.zeros((1, 36), np.uint8), np.zeros((1, 40), np.uint8), np.zeros((1, 68), np.uint8)
    scales = np.array([0.5, -0.25], np.float16)
    mins = np.array([-3.0, 1.25], np.float16)  # with these scales every d q + m is exact in float32
    q8 = (np.arange(d) * 7 % 255 - 127).astype(np.int8)
    for b in range(2):
        blk = q4[32 * b:32 * b + 32]
        row4[0, 18 * b:18 * b + 2] = scales[b:b + 1].view(np.uint8)
        row4[0, 18 * b + 2:18 * b + 18] = blk[:16] | (blk[16:] << 4)
        row41[0, 20 * b:20 * b + 2] = scales[b:b + 1].view(np.uint8)
        row41[0, 20 * b + 2:20 * b + 4] = mins[b:b + 1].view(np.uint8)
        row41[0, 20 * b + 4:20 * b + 20] = blk[:16] | (blk[16:] << 4)
        row8[0, 34 * b:34 * b + 2] = scales[b:b + 1].view(np.uint8)
        row8[0, 34 * b + 2:34 * b + 34] = q8[32 * b:32 * b + 32].view(np.uint8)
    per_weight = np.repeat(scales.astype(np.float64), 32)  # (d,)
    min_per_weight = np.repeat(mins.astype(np.float64), 32)  # (d,)
    x = np.random.default_rng(3).standard_normal(d).astype(np.float32)
    for fmt, rows, w in (("q4_0", row4, per_weight * (q4 - 8)), ("q4_1", row41, per_weight * q4 + min_per_weight),
                         ("q8_0", row8, per_weight * q8)):
        np.testing.assert_array_equal(_w64(rows, fmt)[0], w)  # gguf-py reads the same weights
        _close(KQ.gemv_q(x, rows, np.empty(1, np.float32), fmt), np.array([w @ x]))


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")  # torch's, on the read-only map
@pytest.mark.parametrize("fmt", FMTS)
def test_rows_from_a_gguf_file_are_read_in_place(tmp_path, fmt):
    """Rows written into a GGUF file by gguf-py's writer, memory-mapped back by its reader and taken in place
    (from_blocks(copy=False)): the kernel reads the file's bytes right."""
    rng = np.random.default_rng(7)
    d, n = 128, 40
    names = ("blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down_t.weight")
    w = {k: rng.standard_normal((n, d)).astype(np.float32) / np.sqrt(d) for k in names}
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "llama")
    for k in names:
        writer.add_tensor(k, gguf.quants.quantize(w[k], QTYPE[fmt]), raw_dtype=QTYPE[fmt])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = {t.name: t.data for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}  # (n, row bytes) uint8 memmaps
    gate, up, down_t = (QTensor(torch.from_numpy(np.asarray(data[k])), fmt, (n, d)) for k in names)
    rows = C.ColdRows.from_blocks(gate, up, None, down_t, copy=False)
    assert np.shares_memory(rows.up, data[names[1]])  # in place: no copy
    x = rng.standard_normal(d).astype(np.float32)
    idx = np.flatnonzero(_w64(rows.gate, fmt) @ x > 0).astype(np.int64)
    out = C.ffn_rows("reglu", x, idx, rows, np.empty(d, np.float32))
    _close(out, reference("reglu", x, idx, rows))
    np.testing.assert_array_equal(rows.up, gguf.quants.quantize(w[names[1]], QTYPE[fmt]))


@pytest.mark.parametrize("fmt", FMTS)
def test_from_blocks_copies_bytes_exactly(fmt):
    g = torch.Generator().manual_seed(0)
    n, d = 45, 96
    ws = [torch.randn(n, d, generator=g) for _ in range(3)]
    qs = [QTensor(torch.from_numpy(gguf.quants.quantize(w.numpy(), QTYPE[fmt])), fmt, (n, d)) for w in ws]
    rows = C.ColdRows.from_blocks(*qs[:2], torch.arange(n, dtype=torch.float32), qs[2])
    for a, q in zip((rows.gate, rows.up, rows.down_t), qs):
        assert a.dtype == np.uint8 and a.flags.c_contiguous and a.base is None  # numpy-owned copies
        np.testing.assert_array_equal(a, q.data.numpy())
    np.testing.assert_array_equal(rows.b_up, np.arange(n, dtype=np.float32))
    assert rows.dtype == fmt and rows.d == d and rows.scale.shape == (3, n, 0)
    assert rows.nbytes() == 3 * n * d // 32 * BLOCK_BYTES[fmt] + 4 * n
    f = rows.float32()
    for k, q in zip(("gate", "up", "down_t"), qs):
        assert torch.equal(f[k], torch.from_numpy(gguf.quants.dequantize(q.data.numpy(), QTYPE[fmt])))
    # from float weights: quantised to the same bytes as gguf-py writes
    same = C.ColdRows.from_weights(ws[0], ws[1], None, ws[2], fmt)
    for a, q in zip((same.gate, same.up, same.down_t), qs):
        np.testing.assert_array_equal(a, q.data.numpy())
    assert same.dtype == fmt and same.fmt == fmt


def test_block_rows_refuse_bad_inputs():
    g = torch.Generator().manual_seed(0)
    q4 = QTensor(torch.from_numpy(gguf.quants.quantize(torch.randn(8, 64, generator=g).numpy(), QTYPE["q4_0"])),
                 "q4_0", (8, 64))
    q8 = QTensor(torch.from_numpy(gguf.quants.quantize(torch.randn(8, 64, generator=g).numpy(), QTYPE["q8_0"])),
                 "q8_0", (8, 64))
    with pytest.raises(ValueError, match="down_t is q8_0 .* store gate, up and down_t in one format"):
        C.ColdRows.from_blocks(None, q4, None, q8)
    bf = QTensor(torch.zeros(8, 128, dtype=torch.uint8), "bf16", (8, 64))
    with pytest.raises(ValueError, match="up is bf16, which the cold kernels do not read"):
        C.ColdRows.from_blocks(None, bf, None, bf)
    with pytest.raises(ValueError, match="not a whole number of q4_0 blocks"):
        C.ColdRows.from_weights(None, torch.randn(4, 40), None, torch.randn(4, 40), "q4_0")
    rows = C.ColdRows.from_blocks(None, q4, None, q4)
    x = np.zeros(96, np.float32)  # another d than the rows'
    with pytest.raises(ValueError, match="not Q8_0, Q4_0 or Q4_1 blocks of x's d weights"):
        C.ffn_rows("relu", x, np.arange(8, dtype=np.int64), rows, np.empty(96, np.float32))
    assert set(COLD_DTYPES) == {"bf16", "int8", "q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k"}


def _x_quantized(x: np.ndarray) -> np.ndarray:
    """The x the int route computes with: d_x * q_x per 32 weights (float64)."""
    q, dx = np.empty(x.shape[0], np.int8), np.empty(x.shape[0] // 32, np.float32)
    KQ.quantize_x(x, q, dx)
    return q.astype(np.float64) * np.repeat(dx.astype(np.float64), 32)


def test_quantize_x_is_llamas_q8_0_of_x():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(256) * np.repeat(10.0 ** rng.uniform(-3, 3, 8), 32)).astype(np.float32)
    x[64:96] = 0  # an all-zero block: d_x = 0, q = 0
    q, dx = np.empty(256, np.int8), np.empty(8, np.float32)
    KQ.quantize_x(x, q, dx)
    blocks = x.reshape(8, 32)
    np.testing.assert_allclose(dx, np.abs(blocks).max(1) / 127, rtol=1e-6)
    want = np.rint(blocks * np.where(dx > 0, 127 / np.maximum(np.abs(blocks).max(1), 1e-30), 0)[:, None])
    assert np.abs(q.reshape(8, 32) - want).max() <= 1  # rounding ties of x * (127 / max) in float32
    assert np.all(np.abs(_x_quantized(x) - x) <= np.repeat(dx, 32) / 2 * (1 + 1e-5))


@XQ
@pytest.mark.parametrize("fmt", XQ_FMTS)
@pytest.mark.parametrize("act", ["reglu", "swiglu", "relu", "gelu"])
@pytest.mark.parametrize("d,n", [(32, 9), (96, 23), (4192, 41)])
@pytest.mark.parametrize("which", ["one", "random", "all"])
def test_int_route_equals_float64_on_the_quantized_x(fmt, act, d, n, which):
    """d 32, 96, 4192: steps of 4 (Q4_0) / 2 (Q8_0) blocks with partial last steps of every length."""
    rng = np.random.default_rng(zlib.crc32(repr(("xq", fmt, act, d, n, which)).encode()))
    x = rng.standard_normal(d).astype(np.float32)
    rows = gguf_rows(rng, act, d, n, fmt)
    xt = _x_quantized(x)
    pre = _w64(rows.gate, fmt) @ xt if act in K.GATED else _w64(rows.up, fmt) @ xt + rows.b_up
    idx = _idx(which, rng, n, pre)
    ref = reference(act, xt, idx, rows)
    for out, part in ((np.full(d, np.nan, np.float32), np.full((3, d), np.nan, np.float32)),
                      (np.full(d, np.nan, np.float32), np.full((16, d), np.nan, np.float32)),
                      (np.empty(0, np.float32), np.full((5, d), np.nan, np.float32))):
        KQ.cold_ffn_q(x, idx, rows.gate_arg, rows.up, rows.b_up, rows.down_t, part, out, K.ACT_CODE[act], True)
        _close(out if out.size else part.sum(0), ref)


@XQ
@pytest.mark.parametrize("fmt", XQ_FMTS)
@pytest.mark.parametrize("d,n", [(32, 3), (96, 203), (4192, 37)])
def test_int_route_dots_within_the_bound_of_x_rounding(fmt, d, n):
    """gemv_q(xq=True) against float64 on the true x: |dot - ref| <= sum_b d_x,b / 2 * sum_{j in b} |w_j| + the
    float tolerance; x with blocks of very different magnitudes (an outlier block sets no other block's scale)."""
    rng = np.random.default_rng(zlib.crc32(repr(("bound", fmt, d, n)).encode()))
    x = (rng.standard_normal(d) * np.repeat(10.0 ** rng.uniform(-2, 2, d // 32), 32)).astype(np.float32)
    rows = gguf.quants.quantize(rng.standard_normal((n, d)).astype(np.float32), QTYPE[fmt])
    w = _w64(rows, fmt)
    ref = w @ x.astype(np.float64)
    out = KQ.gemv_q(x, rows, np.full(n, np.nan, np.float32), fmt, xq=True)
    q, dx = np.empty(d, np.int8), np.empty(d // 32, np.float32)
    KQ.quantize_x(x, q, dx)
    bound = (np.abs(w).reshape(n, -1, 32).sum(2) * dx.astype(np.float64) / 2).sum(1)  # (n,)
    slack = 1e-4 * np.abs(w) @ np.abs(x.astype(np.float64)) + 1e-30
    assert np.all(np.abs(out - ref) <= bound + slack), np.max((np.abs(out - ref) - bound) / slack)
    assert np.abs(out - ref).max() > 0  # x's rounding shows: this is the int route
    _close(out, w @ _x_quantized(x))  # and it is exactly the dots on the quantized x


@pytest.mark.parametrize("act", ["swiglu", "relu"])
def test_q4_1_rows_take_the_float_route_when_xq_asks_for_the_int_one(act):
    """Q4_1 has no int route (cold_q._int_route): cold_ffn_q and gemv_q with xq=True give the float route's result
    bit for bit (one thread, so that both sum in one order), which equals float64 on the true x (not on x
    quantized)."""
    rng = np.random.default_rng(zlib.crc32(repr(("q4_1 xq", act)).encode()))
    d, n = 4192, 41  # 131 blocks: steps of every kind on the routes that have them
    x = rng.standard_normal(d).astype(np.float32)
    rows = gguf_rows(rng, act, d, n, "q4_1")
    idx = np.arange(n, dtype=np.int64)
    outs = []
    for xq in (False, True):
        out = np.full(d, np.nan, np.float32)
        KQ.cold_ffn_q(x, idx, rows.gate_arg, rows.up, rows.b_up, rows.down_t, np.full((1, d), np.nan, np.float32),
                      out, K.ACT_CODE[act], xq)
        outs.append(out)
    np.testing.assert_array_equal(outs[1], outs[0])
    _close(outs[0], reference(act, x, idx, rows))
    g = [KQ.gemv_q(x, rows.up, np.full(n, np.nan, np.float32), "q4_1", xq=xq) for xq in (False, True)]
    np.testing.assert_array_equal(g[1], g[0])
    _close(g[0], _w64(rows.up, "q4_1") @ x.astype(np.float64))


def test_float_route_is_the_default():
    """The int route changes results, so it is asked for (xq=True, or HOTNEURONS_COLD_XQ=1 at import): by default
    ffn_rows / cold_layer_q run the float route, which equals float64 up to float32 sums."""
    import os

    assert KQ.XQ == (KQ.XQ_OK and os.environ.get("HOTNEURONS_COLD_XQ", "0") == "1")
    if KQ.XQ:
        pytest.skip("HOTNEURONS_COLD_XQ=1: the int route is the default")
    rng = np.random.default_rng(11)
    d, n = 96, 40
    x = rng.standard_normal(d).astype(np.float32)
    rows = gguf_rows(rng, "reglu", d, n, "q4_0")
    idx = np.arange(n, dtype=np.int64)
    out = C.ffn_rows("reglu", x, idx, rows, np.empty(d, np.float32), np.empty((3, d), np.float32))
    np.testing.assert_allclose(out, reference("reglu", x, idx, rows), rtol=1e-5, atol=1e-6)


_NO_AVX512 = """
import numpy as np, gguf, torch
from hotneurons.kernels import cold_q as KQ, cold_q_ir as I
from hotneurons.runtime.cold_rows import ColdRows, ffn_rows
from hotneurons.weights.qtensor import QTensor
assert not I.HAS_512 and not I.XQ_OK
rng = np.random.default_rng(0)
for fmt in ("q8_0", "q4_0", "q4_1"):
    t = gguf.GGMLQuantizationType[fmt.upper()]
    n, d = 37, 4192
    q = [gguf.quants.quantize(rng.standard_normal((n, d)).astype(np.float32) / 64, t) for _ in range(3)]
    g, u, dn = (gguf.quants.dequantize(a, t).astype(np.float64) for a in q)
    x = rng.standard_normal(d).astype(np.float32)
    for xq in (False, True):  # no int route without the instructions: both the float route
        out = KQ.gemv_q(x, q[0], np.full(n, np.nan, np.float32), fmt, xq=xq)
        ref = g @ x.astype(np.float64)
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=2e-6 * np.abs(ref).max())
    rows = ColdRows.from_blocks(*(QTensor(torch.from_numpy(a), fmt, (n, d)) for a in q[:2]), None,
                                QTensor(torch.from_numpy(q[2]), fmt, (n, d)))
    idx = np.flatnonzero(rng.random(n) < 0.6).astype(np.int64)
    out = ffn_rows("reglu", x, idx, rows, np.empty(d, np.float32), np.empty((3, d), np.float32))
    ref = (np.maximum(g[idx] @ x, 0) * (u[idx] @ x)) @ dn[idx]
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=2e-6 * np.abs(ref).max())
print("ok")
"""


@pytest.mark.slow
def test_kernels_compiled_without_avx512(tmp_path):
    """The kernels compiled for a CPU without AVX-512 (NUMBA_CPU_NAME=haswell, in a subprocess with its own Numba
    cache): the table lookups' fallback (integer -> float conversions; Q4_1's d q + m by one FMA) and the int route
    left out (xq=True runs the float route), against float64 as above, for each format."""
    import os
    import subprocess
    import sys

    feats = "+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,+fxsr,+lzcnt,+mmx,+movbe,+popcnt,+sse,+sse2,+sse3," \
            "+sse4.1,+sse4.2,+ssse3,+xsave"
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=feats, NUMBA_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", _NO_AVX512], env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
