"""llama.cpp's blocks <-> float32 on the CPU in Numba: weights/quants.py's torch functions, the same bytes and floats,
in one pass over the data; and the down projection's columns taken out of such a matrix, re-quantized.

Read (de-quantized): Q8_0, Q4_0, Q4_1 and the K-quants Q4_K, Q5_K, Q6_K (256 weights a block: kernels/cold_k.py's
docstring has their layouts). Written (quantized): Q8_0, Q4_0, Q4_1.

Why: torch's vectorised form takes ten or more passes over a float32 temporary of the whole chunk (nibbles stacked,
widened, offset, scaled; |w|, argmax, gather, scale, round, clamp, narrow, pack), and a CPU load of a 4-bit GGUF
re-quantizes every down row that way (models/ffn_weights.down_t_rows: de-quantize, gather the columns, transpose,
quantize) and widens every cold row in prefill: most of its time to the first token (bench/first_token.py). Here each
block is read once and written once.

Exactness: every product and sum is the reference's float32 operation, each rounded to float32 on its own (Numba adds
no fused multiply-add without fastmath), so the results equal the torch functions' bit for bit
(tests/test_weights_quants.py, tests/test_ffn_weights_fast.py, tests/test_kernels_k.py); fp16 fields are read through
a table of every fp16's float32 value (exact) and written by numpy (round to nearest even, as torch's and gguf-py's). A
block with an inf or NaN, or whose scale's inverse overflows (|w| below ~2.4e-38), is left to the torch path (the
functions return False / None): torch's argmax, clamp and casts of NaN are what the reference does there, and they are
not worth copying.
"""

from __future__ import annotations

import numpy as np
from hotneurons.weights.formats import FORMATS, WeightFormat
from numba import njit, prange

READS = ("q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k")  # the formats de-quantized here, in _SRC's order
WRITES = ("q4_0", "q8_0", "q4_1")  # the formats quantized here, in _DST's order
BLOCKS = {f: (FORMATS[WeightFormat(f)].block, FORMATS[WeightFormat(f)].block_bytes)
          for f in READS}  # format -> (weights, bytes) a block, weights/formats.py's
QK = FORMATS[WeightFormat.Q4_0].block  # weights per block of the formats written (32)
BLOCK_BYTES = {f: BLOCKS[f][1] for f in BLOCKS}
_SRC = {f: code for code, f in enumerate(READS)}  # a source format, as a number for Numba
_DST = {"f32": 0, **{f: code for code, f in enumerate(WRITES, 1)}}  # an output format, likewise
# block bytes by _DST code (0: f32, no blocks), a tuple so that the jitted functions take it as a constant
_DST_BYTES = (0, *(BLOCK_BYTES[f] for f in WRITES))
_F16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)  # fp16 bits -> value


@njit(nogil=True, cache=True, inline="always")
def _f16(lut, b, at):  # pragma: no cover (compiled)
    return lut[np.int32(b[at]) | (np.int32(b[at + 1]) << 8)]


@njit(nogil=True, cache=True, inline="always")
def _scale_min(b, at, j):  # pragma: no cover (compiled)
    """Sub-block j's 6-bit scale and min from the 12 bytes at b[at:] (ggml's get_scale_min_k4)."""
    if j < 4:
        return np.int32(b[at + j]) & 63, np.int32(b[at + j + 4]) & 63
    c = np.int32(b[at + j + 4])
    return (c & 15) | ((np.int32(b[at + j - 4]) >> 6) << 4), (c >> 4) | ((np.int32(b[at + j]) >> 6) << 4)


@njit(nogil=True, cache=True)
def _deq_block(b, at, lut, src, out, o):  # pragma: no cover (compiled)
    """The block of format `src` (_SRC) at b[at:] -> out[o:o + its weights] float32, as weights/quants.py's torch
    functions (and gguf-py) compute them: Q8_0 d q, Q4_0 d (q - 8), Q4_1 d q + m, Q4_K / Q5_K (d sc) q - dmin m,
    Q6_K (d sc) (q - 32)."""
    if src <= 2:
        d = _f16(lut, b, at)
        if src == 0:
            for j in range(QK):
                v = np.int32(b[at + 2 + j])
                out[o + j] = d * np.float32(v - 256 if v >= 128 else v)
        elif src == 1:
            for j in range(16):
                v = np.int32(b[at + 2 + j])
                out[o + j] = d * np.float32((v & 15) - 8)
                out[o + j + 16] = d * np.float32((v >> 4) - 8)
        else:
            m = _f16(lut, b, at + 2)
            for j in range(16):
                v = np.int32(b[at + 4 + j])
                out[o + j] = d * np.float32(v & 15) + m
                out[o + j + 16] = d * np.float32(v >> 4) + m
    elif src <= 4:  # Q4_K, Q5_K: unit u = 2 p + h is the low (h 0) or high nibbles of bytes 32 p.. of the quants
        d, dmin = _f16(lut, b, at), _f16(lut, b, at + 2)
        qs = at + (16 if src == 3 else 48)
        for u in range(8):
            sc, mn = _scale_min(b, at + 4, u)
            ds, dm = d * np.float32(sc), dmin * np.float32(mn)
            p, h = u // 2, 4 * (u % 2)
            for j in range(32):
                q = (np.int32(b[qs + 32 * p + j]) >> h) & 15
                if src == 4:
                    q |= ((np.int32(b[at + 16 + j]) >> u) & 1) << 4
                out[o + 32 * u + j] = ds * np.float32(q) - dm
    else:  # Q6_K: unit u = 4 hh + t of half hh
        d = _f16(lut, b, at + 208)
        for u in range(8):
            hh, t = u // 4, u % 4
            for j in range(32):
                ql = np.int32(b[at + 64 * hh + 32 * (t % 2) + j])
                q = ((ql >> 4) if t >= 2 else (ql & 15)) | (((np.int32(b[at + 128 + 32 * hh + j]) >> (2 * t)) & 3) << 4)
                s = np.int32(b[at + 192 + 2 * u + j // 16])
                out[o + 32 * u + j] = (d * np.float32(s - 256 if s >= 128 else s)) * np.float32(q - 32)


@njit(nogil=True, cache=True, inline="always")
def _q_block(v, dst, out, at):  # pragma: no cover (compiled)
    """v (32,) float32 -> the block's quants at out[at + head:] (dst _DST: q4_0, q8_0, q4_1); returns (d, m unrounded,
    ok). Q4_0: d = the weight of largest magnitude (the first of ties, as argmax) / -8, q = trunc(w / d + 8.5) clipped
    to 0..15; Q8_0: d = max|w| / 127, q = roundf(w / d), halves away from zero (weights/quants._round_half_away's
    arithmetic); Q4_1: m = min w, d = (max w - m) / 15, q = trunc((w - m) / d + 0.5) clipped. ok False: inf or NaN in
    v, or 1 / d overflows (out untouched)."""
    imax, best, lo, hi = 0, np.float32(-1.0), v[0], v[0]
    for j in range(QK):
        a = abs(v[j])
        if not np.isfinite(a):
            return np.float32(0.0), np.float32(0.0), False
        if a > best:  # strictly: the first of ties
            best, imax = a, j
        lo, hi = min(lo, v[j]), max(hi, v[j])
    if dst == 3:
        d = np.float32(np.float32(hi - lo) / np.float32(15.0))
    else:
        d = v[imax] / np.float32(-8.0) if dst == 1 else np.float32(best / np.float32(127.0))
    inv = np.float32(0.0) if d == 0 else np.float32(np.float32(1.0) / d)
    if not np.isfinite(inv) or not np.isfinite(d):
        return d, lo, False
    if dst != 2:
        head = 2 if dst == 1 else 4
        off, m = (np.float32(8.5), np.float32(0.0)) if dst == 1 else (np.float32(0.5), lo)
        for j in range(16):
            a = np.trunc(np.float32(np.float32(np.float32(v[j] - m) * inv) + off))
            b = np.trunc(np.float32(np.float32(np.float32(v[j + 16] - m) * inv) + off))
            a = min(max(a, np.float32(0.0)), np.float32(15.0))
            b = min(max(b, np.float32(0.0)), np.float32(15.0))
            out[at + head + j] = np.uint8(np.int32(a) | (np.int32(b) << 4))
    else:
        for j in range(QK):
            x = np.float32(v[j] * inv)
            a = abs(x)
            fl = np.floor(a)
            q = np.int32(np.float32(fl + np.floor(np.float32(np.float32(2.0) * np.float32(a - fl)))))
            out[at + 2 + j] = np.uint8((-q if x < 0 else q) & 255)
    return d, lo, True


@njit(parallel=True, nogil=True, cache=True)
def _dequantize(b, lut, src, bw, out):  # pragma: no cover (compiled)
    """b (nb, block bytes) uint8 of format src (bw weights a block) -> out (nb * bw,) float32."""
    for i in prange(b.shape[0]):
        _deq_block(b[i], 0, lut, src, out, i * bw)


@njit(parallel=True, nogil=True, cache=True)
def _quantize(x, dst, out, dm_out):  # pragma: no cover (compiled)
    """x (nb, 32) float32 -> out (nb, block bytes) quants, dm_out (nb, 2) unrounded scales and mins; returns the blocks
    left to torch."""
    bad = 0
    for i in prange(x.shape[0]):
        d, m, ok = _q_block(x[i], dst, out[i], 0)
        dm_out[i, 0], dm_out[i, 1] = d, m
        bad += 0 if ok else 1
    return bad


@njit(nogil=True, cache=True)
def _row(src, r, lut, code, bw, bb, out, o):  # pragma: no cover (compiled)
    """Row r of src, all its blocks -> out[o:o + row weights]."""
    for c in range(src.shape[1] // bb):
        _deq_block(src[r], c * bb, lut, code, out, o + c * bw)


@njit(parallel=True, nogil=True, cache=True)
def _columns_as_rows(src, lut, code, bw, bb, idx, dst, out, dm_out):  # pragma: no cover (compiled)
    """src (d, nb * bb) uint8: a (d, n) matrix's rows of blocks of format `code` (bw weights, bb bytes a block); idx
    (k,) columns. Column idx[j] becomes row j of out: (k, d) float32 (dst 0), or (k, d / 32 * block bytes) blocks of dst
    (_DST) with dm_out (k, d / 32, 2) their unrounded scales and mins. d a multiple of 32. A tile of 32 source rows is
    widened at a time (one thread's), and each output block is one column of it. Returns the blocks left to torch."""
    d = src.shape[0]
    n = src.shape[1] // bb * bw
    bb_out = _DST_BYTES[dst]
    bad = 0
    for t in prange(d // QK):
        tile = np.empty(QK * n, np.float32)  # (32 rows, n) float32, row-major
        for i in range(QK):
            _row(src, t * QK + i, lut, code, bw, bb, tile, i * n)
        v = np.empty(QK, np.float32)
        for j in range(idx.shape[0]):
            col = idx[j]
            for i in range(QK):
                v[i] = tile[i * n + col]
            if dst == 0:
                for i in range(QK):
                    out[j, t * QK + i] = v[i]
            else:
                dd, mm, ok = _q_block(v, dst, out[j], t * bb_out)
                dm_out[j, t, 0], dm_out[j, t, 1] = dd, mm
                bad += 0 if ok else 1
    return bad


@njit(parallel=True, nogil=True, cache=True)
def _columns_reblocked(src, lut, code, bw, bb, idx, cols, dst, out, dm_out):  # pragma: no cover (compiled)
    """As _columns_as_rows, but the columns stay columns: out (d, cols / 32 * block bytes) holds row r's columns idx,
    zero-padded to `cols` (a multiple of 32), re-blocked along them in dst; dm_out (d, cols / 32, 2)."""
    d = src.shape[0]
    bb_out = _DST_BYTES[dst]
    bad = 0
    for r in prange(d):
        row = np.empty(src.shape[1] // bb * bw, np.float32)
        _row(src, r, lut, code, bw, bb, row, 0)
        v = np.empty(QK, np.float32)
        for b in range(cols // QK):
            for i in range(QK):
                j = b * QK + i
                v[i] = row[idx[j]] if j < idx.shape[0] else np.float32(0.0)
            dd, mm, ok = _q_block(v, dst, out[r], b * bb_out)
            dm_out[r, b, 0], dm_out[r, b, 1] = dd, mm
            bad += 0 if ok else 1
    return bad


def _set_scales(out: np.ndarray, dm: np.ndarray, fmt: str) -> None:
    """Write the fp16 of each unrounded scale dm[..., 0] (and q4_1's min dm[..., 1]) into its block of out (..., nb *
    block bytes) (round to nearest even, as torch's .to(float16))."""
    blocks = out.reshape(*dm.shape[:-1], BLOCK_BYTES[fmt])
    fields = 2 if fmt == "q4_1" else 1
    with np.errstate(over="ignore"):  # a scale past fp16's largest becomes inf, as torch's and gguf-py's
        half = dm[..., :fields].astype(np.float16).view(np.uint8)  # (..., 2 * fields)
    blocks[..., :2 * fields] = half.reshape(*dm.shape[:-1], 2 * fields)


def _source(fmt: str) -> tuple[int, int, int]:
    if fmt not in _SRC:
        raise ValueError(f"quants_cpu: {fmt} is not de-quantized here: one of {', '.join(READS)}")
    return _SRC[fmt], *BLOCKS[fmt]


def dequantize_q(blocks: np.ndarray, fmt: str, out: np.ndarray) -> None:
    """blocks (nb, block bytes) uint8 of `fmt` (READS) -> out (nb, block weights) float32, C-contiguous both."""
    code, bw, _ = _source(fmt)
    _dequantize(blocks, _F16, code, bw, out.reshape(-1))


def quantize_q(x: np.ndarray, fmt: str, out: np.ndarray) -> bool:
    """x (nb, 32) float32 -> out (nb, block bytes) uint8 blocks of `fmt` (WRITES), C-contiguous both. False: some block
    needs the torch path; out is then incomplete."""
    dm = np.empty((x.shape[0], 2), np.float32)
    if _quantize(x, _DST[fmt], out, dm):
        return False
    _set_scales(out, dm, fmt)
    return True


def columns_as_rows(src: np.ndarray, fmt: str, idx: np.ndarray, dst: str) -> np.ndarray | None:
    """A (d, n) `fmt` (READS) matrix's rows of blocks src (d, row bytes) -> its columns idx as rows: (k, d) float32 (dst
    f32) or (k, row bytes) uint8 blocks of dst (WRITES); d a multiple of 32. None: some block needs the torch path."""
    d, k = src.shape[0], len(idx)
    code, bw, bb = _source(fmt)
    idx = np.ascontiguousarray(idx, dtype=np.int64)
    if dst == "f32":
        out, dm = np.empty((k, d), np.float32), np.empty((0, 0, 2), np.float32)
    else:
        out, dm = np.empty((k, d // QK * BLOCK_BYTES[dst]), np.uint8), np.empty((k, d // QK, 2), np.float32)
    if _columns_as_rows(src, _F16, code, bw, bb, idx, _DST[dst], out, dm):
        return None
    if dst != "f32":
        _set_scales(out, dm, dst)
    return out


def columns_reblocked(src: np.ndarray, fmt: str, idx: np.ndarray, cols: int, dst: str) -> np.ndarray | None:
    """A (d, n) `fmt` (READS) matrix's columns idx, zero-padded to `cols` (a multiple of 32), as (d, cols) rows of dst
    (WRITES) blocks: (d, row bytes) uint8. None: some block needs the torch path."""
    d = src.shape[0]
    code, bw, bb = _source(fmt)
    out, dm = np.empty((d, cols // QK * BLOCK_BYTES[dst]), np.uint8), np.empty((d, cols // QK, 2), np.float32)
    if _columns_reblocked(src, _F16, code, bw, bb, np.ascontiguousarray(idx, dtype=np.int64), cols, _DST[dst], out,
                          dm):
        return None
    _set_scales(out, dm, dst)
    return out
