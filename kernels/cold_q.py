"""Numba kernels over cold rows stored in llama.cpp's blocks, byte for byte as in a GGUF file (ggml-common.h), so that
a file's rows can be copied into the cold rows, or read in place, with no conversion:

  Q8_0: 34 bytes a block: fp16 scale d, then 32 int8 q; w = d * q                        (1.0625 bytes a weight)
  Q4_0: 18 bytes a block: fp16 scale d, then 16 bytes, byte j = weight j in its low nibble and weight j + 16 in its
        high nibble; w = d * (q - 8)                                                     (0.5625 bytes a weight)
  Q4_1: 20 bytes a block: fp16 scale d, fp16 min m, then Q4_0's 16 bytes; w = d * q + m  (0.625 bytes a weight)
  Q4_K, Q5_K, Q6_K: 256 weights in 144 / 176 / 210 bytes (kernels/cold_k.py)   (0.5625 / 0.6875 / 0.8203 bytes)

A row of d weights is d / 32 (d / 256) blocks, (n, row_bytes) uint8 per matrix, one row per neuron: gate, up and
down_t (the down projection transposed). Q8_0, Q4_0 and Q4_1 are told from the rows' width (row_bytes d / 32 * 34,
* 18 or * 20: no width is two of them for one d); a K-quant is named (`fmt`: FORMAT_CODE), since Q4_K's width is Q4_0's
(d / 256 * 144 = d / 32 * 18). Beside K-quant gate and up rows, down_t is Q8_0, Q4_0 or Q4_1 (told by its width:
models/ffn_weights.cold_formats says why); each thread runs the code compiled for the gate and up rows' format.

The contract is cold.cold_ffn's and cold.cold_layer's without `scale` and `group` (kernels/cold.py: work
claimed CHUNK neurons at a time from an atomic counter, four neurons' gate and up rows read in one pass of eight rows,
then their down rows, per-thread partial sums in `part`, `out` of shape (0,) leaves the sum there; the GIL released):
  cold_ffn_q(x, idx, gate, up, b_up, down_t, part, out, act, xq=XQ, ahead=PREFETCH_AHEAD, fmt=-1)
  cold_layer_q(ready, release, i, words, idx, skip, x, gate, up, b_up, down_t, part, out, act, marks, xq=XQ, fmt=-1)
and a dense GEMV over all rows, parallel over groups of eight rows (CPU-only decode of 4-bit attention weights):
  gemv_q(x, rows, out, fmt, xq=False)

Two routes for the gate and up dots (kernels/cold_q_ir.py has the row math):
  xq=False (float): float32 arithmetic on the file's weights (every d * (q - 8) and d * q is exact in float32; a
    Q4_1 weight d * q + m is rounded once, to the float32 that gguf-py's de-quantizer gives), as the float64
    reference up to float32 sums: the route that exactness tests (tests/test_engine.py) rely on.
  xq=True (int): x quantized once per call as llama.cpp quantizes activations for its own CPU dots (Q8_0 of x: an int8
    per weight and a float32 scale per 32, `quantize_x`), the block dots in integers (AVX-512 VNNI). It adds x's
    rounding error: a dot differs from the float route's by at most sum over blocks of d_x / 2 * sum |w| (d_x =
    max|x| / 127 of the block; tests/test_kernels_q.py checks that bound). Only where the compile target has the
    instructions (cold_q_ir.XQ_OK), and for Q4_0 and Q8_0 rows only; elsewhere (Q4_1 and K-quant rows: their mins
    would need a second per-block term) xq=True runs the float route (`_int_route`).
XQ, the default of a dense model's cold neurons, is the float route unless HOTNEURONS_COLD_XQ=1 in the environment at
import (and XQ_OK): the int route changes results, and on a few active rows read from DRAM it buys nothing (below).
XQ_EXPERTS, the default of a mixture of experts' cold experts (kernels/cold_experts.experts_layer_q, whole experts'
rows, where the dots and not DRAM bound the kernel), is the int route unless HOTNEURONS_COLD_XQ=0 (and XQ_OK): the
same rounding llama.cpp gives the same dots on its CPU. The down rows (axpys) are float32 on both routes.

Prefetch: each group of four neurons asks for the rows of the thread's own next group (PREFETCH_AHEAD groups later)
while it computes, its gate and up rows during the dots, its down rows during the axpys. A thread claims its next
chunk of the active list before it starts on the last group of its current one, so that the prefetched rows are the
ones it reads next (the positions after a chunk in idx belong to another thread's chunk).

Measured (bench/kernel_q.py, bench/results/2026-11-26-nvidia-h200-kernel-q*.json; 16 Emerald Rapids cores, d 8192):
the float route reads Q4_0 rows 1.37-1.49x and Q8_0 rows 1.22-1.26x as fast as the kernel before this one
(interleaved in one run), and 0.79-0.92 (Q4_0) / 0.85-0.95 (Q8_0) as fast as a pure read of the same rows in the
same pattern (bench read_rows: no arithmetic), which is what bounds it now: 4.6 KiB Q4_0 rows at random places,
20-80 MB a call, read at 0.71-0.82 of the 16 KiB row-gather ceiling. The int route (3 instructions per 32 weights
against the float route's 7) computes 1.1-1.5x as fast with rows in the cache, but in DRAM it matches the float route
at 10-20% of rows active and trails it at 5% (the per-call quantization of x).

Numba's cache (cache=True) checks only this file, though the kernels are built from the helpers of others: its
folder is named by a hash of every kernel source (kernels/__init__.numba_cache_dir), so an edit anywhere starts anew.
"""

from __future__ import annotations

import os

import numpy as np
from hotneurons.kernels.activations import _gated_value, _ungated_value
from hotneurons.kernels.cold import (
    FIRST_GATED,
    SPINS,
    _claim,
    _head,
    _n_chunks,
    _sum_rows,
    bit_indices,
    wait_ready,
)
from hotneurons.kernels.cold_q_ir import BLOCK, F16_TO_F32, rows_axpy, rows_dot
from hotneurons.kernels.cold_xq import _xq_buffers, quantize_x
from hotneurons.kernels.intrinsics import _fetch_add, _store_release
from hotneurons.kernels.ir_util import (
    BLOCK_BYTES,
    BLOCK_WEIGHTS,
    CODE_FORMATS,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_0,
    XQ_OK,
)
from numba import njit, prange

FORMAT_CODE = {f.value: code for code, f in enumerate(CODE_FORMATS)}  # q8_0: Q8_0, ... q6_k: Q6_K
GEMV_ROWS = 8  # rows a thread reads at once in gemv_q
XQ = XQ_OK and os.environ.get("HOTNEURONS_COLD_XQ", "0") == "1"  # cold_ffn_q's default route (module docstring)
XQ_EXPERTS = XQ_OK and os.environ.get("HOTNEURONS_COLD_XQ", "") != "0"  # cold experts' default route (docstring)
PREFETCH_AHEAD = 1  # groups of four neurons between the one computed and the one whose rows are prefetched
_LUT = F16_TO_F32  # fp16 pattern -> float32 (a constant in the compiled code)
__all__ = ["cold_ffn_q", "cold_layer_q", "gemv_q", "quantize_x", "FORMAT_CODE", "XQ", "XQ_EXPERTS", "XQ_OK", "BLOCK",
           "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "BLOCK_BYTES"]


@njit(nogil=True, cache=True)
def _format(d, row_bytes, code=-1):
    """The format code of rows of `row_bytes` bytes holding d weights, or -1: `code` where they fit it, else (code -1)
    the one of Q8_0, Q4_0 and Q4_1 whose width they have (a K-quant must be named: Q4_K's rows are as wide as
    Q4_0's)."""
    if code >= 0:
        b = BLOCK_WEIGHTS[code]
        return code if d % b == 0 and d // b * BLOCK_BYTES[code] == row_bytes else -1
    if d % BLOCK == 0:
        for f in (Q8_0, Q4_0, Q4_1):
            if d // BLOCK * BLOCK_BYTES[f] == row_bytes:
                return f
    return -1


@njit(nogil=True, cache=True)
def _int_route(xq, fmt):
    """Whether rows of `fmt` run the int route when xq asks for it (module docstring): Q4_0 and Q8_0, where the
    compile target has the instructions."""
    return xq and XQ_OK and (fmt == Q4_0 or fmt == Q8_0)


# ---------------------------------------------------------------------------------------------------------------
# Neurons (cold.py's _gated4 / _ungated4 / _down4 over blocks). xs: (x,) or the int route's (xb, corr, dxv).


@njit(nogil=True, cache=True, fastmath=True)
def _axpy(hs, rows, nxt, lut, fd, acc):
    """rows_axpy of down rows in format fd (Q8_0, Q4_0 or Q4_1), a value at run time: one branch a call, so that a
    neuron function compiles once per gate and up format, not once per pair of formats."""
    if fd == Q4_0:
        rows_axpy(hs, rows, nxt, lut, 1, acc)
    elif fd == Q4_1:
        rows_axpy(hs, rows, nxt, lut, 2, acc)
    else:
        rows_axpy(hs, rows, nxt, lut, 0, acc)


@njit(nogil=True, cache=True, fastmath=True)
def _down1(h, j, down_t, lut, fd, acc):
    if h != 0:
        _axpy((h,), (down_t[j],), (), lut, fd, acc)


@njit(nogil=True, cache=True, fastmath=True)
def _down4(h0, h1, h2, h3, j0, j1, j2, j3, n0, n1, n2, n3, down_t, lut, fd, acc):
    """acc += four neurons' down rows x h, prefetching the next four neurons' (n0-n3)."""
    if h0 != 0 and h1 != 0 and h2 != 0 and h3 != 0:
        _axpy((h0, h1, h2, h3), (down_t[j0], down_t[j1], down_t[j2], down_t[j3]),
              (down_t[n0], down_t[n1], down_t[n2], down_t[n3]), lut, fd, acc)
        return
    _down1(h0, j0, down_t, lut, fd, acc)  # an inactive neuron (a wrong guess) skips its down row
    _down1(h1, j1, down_t, lut, fd, acc)
    _down1(h2, j2, down_t, lut, fd, acc)
    _down1(h3, j3, down_t, lut, fd, acc)


@njit(nogil=True, cache=True, fastmath=True)
def _gated4(xs, j0, j1, j2, j3, n0, n1, n2, n3, gate, up, down_t, lut, fg, fd, acc, act):
    """Four neurons: their gate and up rows (format fg) in one pass (eight rows), then their down rows (fd); the next
    four neurons' (n0-n3) rows prefetched meanwhile."""
    g0, g1, g2, g3, u0, u1, u2, u3 = rows_dot(
        xs, (gate[j0], gate[j1], gate[j2], gate[j3], up[j0], up[j1], up[j2], up[j3]),
        (gate[n0], gate[n1], gate[n2], gate[n3], up[n0], up[n1], up[n2], up[n3]), lut, fg)
    _down4(_gated_value(act, g0, u0), _gated_value(act, g1, u1), _gated_value(act, g2, u2),
           _gated_value(act, g3, u3), j0, j1, j2, j3, n0, n1, n2, n3, down_t, lut, fd, acc)


@njit(nogil=True, cache=True, fastmath=True)
def _ungated4(xs, j0, j1, j2, j3, n0, n1, n2, n3, up, b_up, down_t, lut, fg, fd, acc, act):
    a0, a1, a2, a3 = rows_dot(xs, (up[j0], up[j1], up[j2], up[j3]), (up[n0], up[n1], up[n2], up[n3]), lut, fg)
    _down4(_ungated_value(a0 + b_up[j0], act), _ungated_value(a1 + b_up[j1], act), _ungated_value(a2 + b_up[j2], act),
           _ungated_value(a3 + b_up[j3], act), j0, j1, j2, j3, n0, n1, n2, n3, down_t, lut, fd, acc)


@njit(nogil=True, cache=True, fastmath=True)
def _one(xs, j, gate, up, b_up, down_t, lut, fg, fd, acc, act, gated):  # one neuron, its rows one at a time
    if not gated:
        _down1(_ungated_value(rows_dot(xs, (up[j],), (), lut, fg) + b_up[j], act), j, down_t, lut, fd, acc)
        return
    g = rows_dot(xs, (gate[j],), (), lut, fg)
    if act <= 3 and g <= 0:  # ReLU gates: a zero gate skips the up and down rows
        return
    _down1(_gated_value(act, g, rows_dot(xs, (up[j],), (), lut, fg)), j, down_t, lut, fd, acc)


@njit(nogil=True, cache=True)
def _check(x, gate, up, down_t, part, out, gated, code):
    """The format codes of the gate / up rows and of the down_t rows, or an error when their shapes do not fit x (d,).
    code: the gate and up rows' (-1: told by their width)."""
    d = x.shape[0]
    fg, fd = _format(d, up.shape[1], code), _format(d, down_t.shape[1])
    if fg < 0:
        raise ValueError("cold_ffn_q: gate and up rows are not Q8_0, Q4_0 or Q4_1 blocks of x's d weights (d a "
                         "multiple of 32, row bytes d / 32 * 34, * 18 or * 20), nor the K-quant named (d a multiple "
                         "of 256, row bytes d / 256 * 144, 176 or 210): store them with ColdRows(..., dtype='q8_0', "
                         "'q4_0' or 'q4_1'), or name the K-quant")
    if fd < 0 or (fg < Q4_K and fd != fg) or (gated and gate.shape[1] != up.shape[1]):
        raise ValueError("cold_ffn_q: gate, up and down_t rows differ in format: store all three in one, or down_t in "
                         "Q8_0, Q4_0 or Q4_1 beside K-quant gate and up rows")
    if part.shape[1] != d or (out.shape[0] != 0 and out.shape[0] != d):
        raise ValueError("cold_ffn_q: part must be (threads, d) and out (d,) or (0,) float32: size them by x")
    return fg, fd


@njit(nogil=True, cache=True, fastmath=True)
def _work(xs, idx, gate, up, b_up, down_t, lut, acc, act, gated, counter, head, ahead, fg, fd):
    """One thread's share of cold_ffn_q: claims from `counter` until idx runs out, sums into acc (d,). Its groups (up
    to four positions of idx) in order in a ring: the one computed and up to `ahead` more, claimed ahead, the last of
    which has its rows prefetched. `fg`, the gate and up rows' format, must be a literal number in the caller's source
    (Numba types it Literal[int], a global's value int64): the row intrinsics pick their code from it when they
    compile. fd: the down rows' (_axpy)."""
    k = idx.shape[0]
    ring = np.empty((4, 2), np.int64)  # (start, end) of the queued groups
    first, n = 0, 0
    c0, c1 = 0, 0  # what is left of the last chunk claimed
    done = False
    while True:
        while n <= ahead and not done:
            if c0 >= c1:
                c0, c1 = _claim(_fetch_add(counter, 1), k, head)
                if c0 >= k:
                    done = True
                    break
            e = min(c0 + 4, c1)
            ring[(first + n) % 4, 0], ring[(first + n) % 4, 1] = c0, e
            n += 1
            c0 = e
        if n == 0:
            return
        q, q1 = ring[first, 0], ring[first, 1]
        t = (first + min(ahead, n - 1)) % 4  # the group prefetched (the last queued; itself when none)
        t0, tl = ring[t, 0], ring[t, 1] - 1
        first, n = (first + 1) % 4, n - 1
        if q1 - q == 4:
            n0, n1, n2, n3 = idx[t0], idx[min(t0 + 1, tl)], idx[min(t0 + 2, tl)], idx[min(t0 + 3, tl)]
            if gated:
                _gated4(xs, idx[q], idx[q + 1], idx[q + 2], idx[q + 3], n0, n1, n2, n3, gate, up, down_t, lut, fg, fd,
                        acc, act)
            else:
                _ungated4(xs, idx[q], idx[q + 1], idx[q + 2], idx[q + 3], n0, n1, n2, n3, up, b_up, down_t, lut, fg,
                          fd, acc, act)
        else:
            for p in range(q, q1):
                _one(xs, idx[p], gate, up, b_up, down_t, lut, fg, fd, acc, act, gated)


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def cold_ffn_q(x, idx, gate, up, b_up, down_t, part, out, act, xq=XQ, ahead=PREFETCH_AHEAD, fmt=-1):
    """cold.cold_ffn over block rows: out (d,) = sum over j in idx of h_j(x) * down_t[j] (or, with out of shape
    (0,), part's rows hold that sum). x (d,) float32, idx (k,) int64, gate / up / down_t (n, row_bytes) uint8
    (gate: any such array for ungated FFNs, never read), b_up (n,) float32, part (threads, d) float32 scratch,
    act: cold.ACT_CODE, xq: the int route (module docstring), ahead: PREFETCH_AHEAD (0 to 3), fmt: FORMAT_CODE of the
    gate and up rows (-1: told by their width, Q8_0, Q4_0 or Q4_1, as down_t's then; K-quant rows must be named, and
    their down_t rows are Q8_0, Q4_0 or Q4_1, told by their width)."""
    d, k = x.shape[0], idx.shape[0]
    gated = act >= FIRST_GATED
    fg, fd = _check(x, gate, up, down_t, part, out, gated, fmt)
    use = _int_route(xq, fg)
    xb, corr, dxv = _xq_buffers(x, fg, use)
    lut = _LUT
    ahead = min(max(ahead, 0), 3)
    T = _n_chunks(k, part.shape[0])
    head = _head(k, T)
    counter = np.zeros(1, np.int64)  # claims taken
    for t in prange(T):
        acc = part[t]  # (d,) this thread's partial sum
        acc[:] = 0.0
        # formats as literals in the source (0: Q8_0, 1: Q4_0, 2: Q4_1, 3-5: Q4_K, Q5_K, Q6_K), not globals: see
        # _work. XQ_OK, a global constant, prunes the int route's calls where it cannot compile (rows_dot types them
        # only with XQ_OK)
        if XQ_OK and use and fg == Q4_0:
            _work((xb, corr, dxv), idx, gate, up, b_up, down_t, lut, acc, act, gated, counter, head, ahead, 1, fd)
        elif XQ_OK and use:
            _work((xb, corr, dxv), idx, gate, up, b_up, down_t, lut, acc, act, gated, counter, head, ahead, 0, fd)
        elif fg == Q4_0:
            _work((x,), idx, gate, up, b_up, down_t, lut, acc, act, gated, counter, head, ahead, 1, fd)
        elif fg == Q4_1:
            _work((x,), idx, gate, up, b_up, down_t, lut, acc, act, gated, counter, head, ahead, 2, fd)
        elif fg == Q8_0:
            _work((x,), idx, gate, up, b_up, down_t, lut, acc, act, gated, counter, head, ahead, 0, fd)
        elif fg == Q4_K:
            _work((x,), idx, gate, up, b_up, down_t, lut, acc, act, gated, counter, head, ahead, 3, fd)
        elif fg == Q5_K:
            _work((x,), idx, gate, up, b_up, down_t, lut, acc, act, gated, counter, head, ahead, 4, fd)
        else:
            _work((x,), idx, gate, up, b_up, down_t, lut, acc, act, gated, counter, head, ahead, 5, fd)
    if out.shape[0] == 0:  # the caller sums part's rows; those past T are zero
        part[T:] = 0.0
        return
    for c in prange(T):  # the partial rows summed by all threads, one slice of d each
        _sum_rows(part, T, out, c * d // T, (c + 1) * d // T)


@njit(nogil=True, cache=True)
def cold_layer_q(ready, release, i, words, idx, skip, x, gate, up, b_up, down_t, part, out, act, marks, xq=XQ,
                 fmt=-1):
    """cold.cold_layer over block rows (its arguments less `scale` and `group`; fmt: cold_ffn_q's): wait for ready[i]
    (i >= 0), the packed mask -> idx[:k], cold_ffn_q over idx[skip:k], marks += (1, k), release[i] = 1. Returns k, or
    -1 when no signal came within SPINS reads."""
    if i >= 0 and not wait_ready(ready, i, SPINS):
        return -1
    k = bit_indices(words, idx.shape[0], idx)
    marks[0] += 1
    marks[1] += k
    cold_ffn_q(x, idx[min(skip, k):k], gate, up, b_up, down_t, part, out, act, xq, PREFETCH_AHEAD, fmt)
    if i >= 0:
        _store_release(release, i, np.int32(1))
    return k


# ---------------------------------------------------------------------------------------------------------------
# Dense GEMV over all rows


@njit(nogil=True, cache=True, fastmath=True)
def _gemv8(xs, rows, out, i, lut, fmt):
    """out[i:i + 8], or out[i:] one row at a time where fewer than 8 rows are left (fmt a literal, as in _work)."""
    if i + GEMV_ROWS > rows.shape[0]:
        for r in range(i, rows.shape[0]):
            out[r] = rows_dot(xs, (rows[r],), (), lut, fmt)
        return
    (out[i], out[i + 1], out[i + 2], out[i + 3], out[i + 4], out[i + 5], out[i + 6],
     out[i + 7]) = rows_dot(xs, (rows[i], rows[i + 1], rows[i + 2], rows[i + 3], rows[i + 4], rows[i + 5],
                                 rows[i + 6], rows[i + 7]), (), lut, fmt)


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _gemv(x, rows, out, fmt, use):
    xb, corr, dxv = _xq_buffers(x, fmt, use)
    lut = _LUT
    for g in prange(-(-rows.shape[0] // GEMV_ROWS)):  # groups of 8 rows, the last maybe short
        if XQ_OK and use and fmt == Q4_0:  # literal codes and XQ_OK, as in cold_ffn_q
            _gemv8((xb, corr, dxv), rows, out, g * GEMV_ROWS, lut, 1)
        elif XQ_OK and use:
            _gemv8((xb, corr, dxv), rows, out, g * GEMV_ROWS, lut, 0)
        elif fmt == Q4_0:
            _gemv8((x,), rows, out, g * GEMV_ROWS, lut, 1)
        elif fmt == Q4_1:
            _gemv8((x,), rows, out, g * GEMV_ROWS, lut, 2)
        elif fmt == Q8_0:
            _gemv8((x,), rows, out, g * GEMV_ROWS, lut, 0)
        elif fmt == Q4_K:
            _gemv8((x,), rows, out, g * GEMV_ROWS, lut, 3)
        elif fmt == Q5_K:
            _gemv8((x,), rows, out, g * GEMV_ROWS, lut, 4)
        else:
            _gemv8((x,), rows, out, g * GEMV_ROWS, lut, 5)


def gemv_q(x: np.ndarray, rows: np.ndarray, out: np.ndarray, fmt: str, xq: bool = False) -> np.ndarray:
    """out (n,) float32 = rows @ x: rows (n, row_bytes) uint8 of `fmt` blocks (FORMAT_CODE's names: a GGUF tensor's
    bytes), x (d,) float32, parallel over groups of eight rows; xq: the int route (module docstring; Q4_1 and K-quant
    rows take the float route). Returns out."""
    code = FORMAT_CODE.get(str(getattr(fmt, "value", fmt)).lower())
    if code is None:
        raise ValueError(f"gemv_q: format {fmt!r} has no CPU kernel: choose one of {', '.join(FORMAT_CODE)}")
    d = x.shape[0]
    if _format(d, rows.shape[1], code) != code or out.shape != (rows.shape[0],):
        b = BLOCK_WEIGHTS[code]
        raise ValueError(f"gemv_q: rows {rows.shape} are not {fmt} rows of x's {d} weights, or out {out.shape} is "
                         f"not ({rows.shape[0]},): pass rows (n, {d} / {b} * {BLOCK_BYTES[code]}) uint8 ({d} a "
                         f"multiple of {b}) and out (n,)")
    _gemv(x, rows, out, code, _int_route(bool(xq), code))
    return out
