"""Q4_0 / Q8_0 rows <-> float32 on the CPU in Numba: weights/quants.py's torch functions, the same bytes and floats,
in one pass over the data; and the down projection's columns taken out of such a matrix, re-quantized.

Why: torch's vectorised form takes ten or more passes over a float32 temporary of the whole chunk (nibbles stacked,
widened, offset, scaled; |w|, argmax, gather, scale, round, clamp, narrow, pack), and a CPU load of a 4-bit GGUF
re-quantizes every down row that way (runtime/ffn_weights.down_t_rows: de-quantize, gather the columns, transpose,
quantize) and widens every cold row in prefill: most of its time to the first token (bench/first_token.py). Here each
block is read once and written once.

Exactness: every product and sum is the reference's float32 operation, each rounded to float32 on its own (Numba adds
no fused multiply-add without fastmath), so the results equal the torch functions' bit for bit
(tests/test_weights_quants.py, tests/test_ffn_weights_fast.py); the fp16 scales are converted by numpy (round to
nearest even, as torch's and gguf-py's). A block with an inf or NaN, or whose scale's inverse overflows (|w| below
~2.4e-38), is left to the torch path (the functions return False / None): torch's argmax, clamp and casts of NaN are
what the reference does there, and they are not worth copying.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

QK = 32  # weights per block (Q4_0, Q8_0)
HEAD = 2  # bytes of the block's fp16 scale, before its quants
BLOCK_BYTES = {"q4_0": 18, "q8_0": 34}
_CODE = {"f32": 0, "q4_0": 1, "q8_0": 2}  # a kernel's output format, as a number Numba branches on


@njit(nogil=True, cache=True, inline="always")
def _deq_block(b, at, d, q4, out, o):  # pragma: no cover (compiled)
    """The block at b[at:] (its quants; scale d, widened) -> out[o:o + 32] float32: d * (q - 8) or d * q, exact."""
    if q4:
        for j in range(16):
            v = np.int32(b[at + HEAD + j])
            out[o + j] = d * np.float32((v & 15) - 8)
            out[o + j + 16] = d * np.float32((v >> 4) - 8)
    else:
        for j in range(QK):
            v = np.int32(b[at + HEAD + j])
            out[o + j] = d * np.float32(v - 256 if v >= 128 else v)


@njit(nogil=True, cache=True, inline="always")
def _q_block(v, q4, out, at):  # pragma: no cover (compiled)
    """v (32,) float32 -> the block's quants at out[at + 2:]; returns (d unrounded, ok). Q4_0: d = the weight of
    largest magnitude (the first of ties, as argmax) / -8, q = trunc(w / d + 8.5) clipped to 0..15; Q8_0: d = max|w| /
    127, q = roundf(w / d), halves away from zero (weights/quants._round_half_away's arithmetic). ok False: inf or
    NaN in v, or 1 / d overflows (out untouched)."""
    imax, best = 0, np.float32(-1.0)
    for j in range(QK):
        a = abs(v[j])
        if not np.isfinite(a):
            return np.float32(0.0), False
        if a > best:  # strictly: the first of ties
            best, imax = a, j
    d = v[imax] / np.float32(-8.0) if q4 else np.float32(best / np.float32(127.0))
    inv = np.float32(0.0) if d == 0 else np.float32(np.float32(1.0) / d)
    if not np.isfinite(inv):
        return d, False
    if q4:
        for j in range(16):
            lo = np.trunc(np.float32(np.float32(v[j] * inv) + np.float32(8.5)))
            hi = np.trunc(np.float32(np.float32(v[j + 16] * inv) + np.float32(8.5)))
            lo = min(max(lo, np.float32(0.0)), np.float32(15.0))
            hi = min(max(hi, np.float32(0.0)), np.float32(15.0))
            out[at + HEAD + j] = np.uint8(np.int32(lo) | (np.int32(hi) << 4))
    else:
        for j in range(QK):
            x = np.float32(v[j] * inv)
            a = abs(x)
            fl = np.floor(a)
            q = np.int32(np.float32(fl + np.floor(np.float32(np.float32(2.0) * np.float32(a - fl)))))
            out[at + HEAD + j] = np.uint8((-q if x < 0 else q) & 255)
    return d, True


@njit(parallel=True, nogil=True, cache=True)
def _dequantize(b, s, q4, out):  # pragma: no cover (compiled)
    """b (nb, block bytes) uint8, s (nb,) their scales widened -> out (nb * 32,) float32."""
    for i in prange(b.shape[0]):
        _deq_block(b[i], 0, s[i], q4, out, i * QK)


@njit(parallel=True, nogil=True, cache=True)
def _quantize(x, q4, out, d_out):  # pragma: no cover (compiled)
    """x (nb, 32) float32 -> out (nb, block bytes) quants, d_out (nb,) unrounded scales; the blocks left to torch."""
    bad = 0
    for i in prange(x.shape[0]):
        d, ok = _q_block(x[i], q4, out[i], 0)
        d_out[i] = d
        bad += 0 if ok else 1
    return bad


@njit(parallel=True, nogil=True, cache=True)
def _columns_as_rows(src, s, q4, idx, dst, out, d_out):  # pragma: no cover (compiled)
    """src (d, nb * bb) uint8: a (d, n) matrix's rows of blocks, s (d, nb) their scales widened; idx (k,) columns.
    Column idx[j] becomes row j of out: (k, d) float32 (dst 0), or (k, d / 32 * block bytes) blocks of q4_0 (1) or
    q8_0 (2) with d_out (k, d / 32) their unrounded scales. d a multiple of 32. A tile of 32 source rows is widened
    at a time (one thread's), and each output block is one column of it. Returns the blocks left to torch."""
    d, nb = s.shape
    bb_in = src.shape[1] // nb
    bb_out = 18 if dst == 1 else 34
    bad = 0
    for t in prange(d // QK):
        tile = np.empty(QK * nb * QK, np.float32)  # (32 rows, n) float32, row-major
        for i in range(QK):
            r = t * QK + i
            for c in range(nb):
                _deq_block(src[r], c * bb_in, s[r, c], q4, tile, (i * nb + c) * QK)
        v = np.empty(QK, np.float32)
        n = nb * QK
        for j in range(idx.shape[0]):
            col = idx[j]
            for i in range(QK):
                v[i] = tile[i * n + col]
            if dst == 0:
                for i in range(QK):
                    out[j, t * QK + i] = v[i]
            else:
                dd, ok = _q_block(v, dst == 1, out[j], t * bb_out)
                d_out[j, t] = dd
                bad += 0 if ok else 1
    return bad


@njit(parallel=True, nogil=True, cache=True)
def _columns_reblocked(src, s, q4, idx, cols, dst, out, d_out):  # pragma: no cover (compiled)
    """As _columns_as_rows, but the columns stay columns: out (d, cols / 32 * block bytes) holds row r's columns idx,
    zero-padded to `cols` (a multiple of 32), re-blocked along them (dst 1 q4_0, 2 q8_0); d_out (d, cols / 32)."""
    d, nb = s.shape
    bb_in = src.shape[1] // nb
    bb_out = 18 if dst == 1 else 34
    bad = 0
    for r in prange(d):
        row = np.empty(nb * QK, np.float32)
        for c in range(nb):
            _deq_block(src[r], c * bb_in, s[r, c], q4, row, c * QK)
        v = np.empty(QK, np.float32)
        for b in range(cols // QK):
            for i in range(QK):
                j = b * QK + i
                v[i] = row[idx[j]] if j < idx.shape[0] else np.float32(0.0)
            dd, ok = _q_block(v, dst == 1, out[r], b * bb_out)
            d_out[r, b] = dd
            bad += 0 if ok else 1
    return bad


def _widened_scales(blocks: np.ndarray, bb: int) -> np.ndarray:
    """(..., nb * bb) uint8 rows of blocks -> (..., nb) float32 of each block's leading fp16 (exact)."""
    b = blocks.reshape(*blocks.shape[:-1], -1, bb)[..., :HEAD]
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _set_scales(out: np.ndarray, d: np.ndarray, bb: int) -> None:
    """Write the fp16 of each unrounded scale d (..., nb) into its block of out (..., nb * bb) (round to nearest
    even, as torch's .to(float16))."""
    blocks = out.reshape(*d.shape, bb)
    with np.errstate(over="ignore"):  # a scale past fp16's largest becomes inf, as torch's and gguf-py's
        blocks[..., :HEAD] = d.astype(np.float16).view(np.uint8).reshape(*d.shape, HEAD)


def dequantize_q(blocks: np.ndarray, fmt: str, out: np.ndarray) -> None:
    """blocks (nb, block bytes) uint8 of `fmt` (q4_0, q8_0) -> out (nb, 32) float32, C-contiguous both."""
    _dequantize(blocks, _widened_scales(blocks, BLOCK_BYTES[fmt]).reshape(-1), fmt == "q4_0", out.reshape(-1))


def quantize_q(x: np.ndarray, fmt: str, out: np.ndarray) -> bool:
    """x (nb, 32) float32 -> out (nb, block bytes) uint8 blocks of `fmt` (q4_0, q8_0), C-contiguous both. False: some
    block needs the torch path; out is then incomplete."""
    d = np.empty(x.shape[0], np.float32)
    if _quantize(x, fmt == "q4_0", out, d):
        return False
    _set_scales(out, d, BLOCK_BYTES[fmt])
    return True


def columns_as_rows(src: np.ndarray, fmt: str, idx: np.ndarray, dst: str) -> np.ndarray | None:
    """A (d, n) `fmt` matrix's rows of blocks src (d, row bytes) -> its columns idx as rows: (k, d) float32 (dst f32)
    or (k, row bytes) uint8 blocks of dst (q4_0, q8_0); d a multiple of 32. None: some block needs the torch path."""
    d, k = src.shape[0], len(idx)
    s = _widened_scales(src, BLOCK_BYTES[fmt])
    idx = np.ascontiguousarray(idx, dtype=np.int64)
    if dst == "f32":
        out, dd = np.empty((k, d), np.float32), np.empty((0, 0), np.float32)
    else:
        out, dd = np.empty((k, d // QK * BLOCK_BYTES[dst]), np.uint8), np.empty((k, d // QK), np.float32)
    if _columns_as_rows(src, s, fmt == "q4_0", idx, _CODE[dst], out, dd):
        return None
    if dst != "f32":
        _set_scales(out, dd, BLOCK_BYTES[dst])
    return out


def columns_reblocked(src: np.ndarray, fmt: str, idx: np.ndarray, cols: int, dst: str) -> np.ndarray | None:
    """A (d, n) `fmt` matrix's columns idx, zero-padded to `cols` (a multiple of 32), as (d, cols) rows of dst blocks
    (q4_0, q8_0): (d, row bytes) uint8. None: some block needs the torch path."""
    d = src.shape[0]
    s = _widened_scales(src, BLOCK_BYTES[fmt])
    out, dd = np.empty((d, cols // QK * BLOCK_BYTES[dst]), np.uint8), np.empty((d, cols // QK), np.float32)
    if _columns_reblocked(src, s, fmt == "q4_0", np.ascontiguousarray(idx, dtype=np.int64), cols, _CODE[dst], out,
                          dd):
        return None
    _set_scales(out, dd, BLOCK_BYTES[dst])
    return out
