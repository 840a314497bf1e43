"""Numba kernels for the cold FFN neurons of one batch-1 token (their torch twin: ops.ffn_rows_torch), and the CPU's
side of the flags it shares with the GPU's graphs (`cold_layer`).

Cold rows live in CPU RAM (`ColdRows`, runtime/cold_rows.py), one contiguous row per neuron and matrix: `gate` and `up`
rows (n_cold, d_model) and the down projection transposed, `down_t` (n_cold, d_model), so that every active neuron reads
three contiguous rows. They are stored as bfloat16 bit patterns (uint16: Numba has no 16-bit float type), or as int8
with a float32 scale per group of INT8_GROUP weights of a row (1.0625 bytes a weight, as llama.cpp's Q8_0). Each element
is widened to float32 inside the dot and axpy loops, each group's scale is applied once per group (bf16: one group of d
with scale 1), and all arithmetic is float32.

Work split: threads take CHUNK neurons of the active list at a time from a shared atomic counter (a fixed contiguous
share each left the call waiting for its slowest thread; docs/history.md), and the last TAIL per thread 4 at a time
(`_claim`, so that the threads end closer together); each thread
accumulates its neurons' `h_j * down_t[j]` into its own row of `part`; then every thread sums one slice of d across
those rows. Which thread sums which neuron varies from call to call, so results vary in the last float32 bits. The GIL
is released, so the GPU (or another Python thread) keeps working.

Several rows at once: a thread reads the gate and up rows of four neurons in one loop (`_dot8`: eight rows), then
their down rows (`_axpy4`); ungated FFNs read four up rows (`_dot4`), then four down rows. One core alone keeps too few
reads in flight over one 16 KiB row at a random place to fill its share of DRAM bandwidth, so four rows are read at
once, and the gate and up rows in one pass (docs/history.md). A neuron marked active whose
activation is zero (a wrong guess) skips its down row; under a ReLU gate it has read its up row for nothing.

One kernel, the activation passed as an integer code (ACT_CODE; gated from FIRST_GATED on):
  cold_ffn(x, idx, gate, up, b_up, down_t, scale, group, part, out, act)
    relu, gelu (ungated):                 h = act(up_j . x + b_j)
    reglu, drelu, swiglu, geglu (gated):  h = act(gate_j . x) * up_j . x   (drelu: relu(gate_j . x) * relu(up_j . x))
`gate` stands in for itself in ungated FFNs (any array of up's type: never read); `b_up` is read only by ungated ones.
`scale` (3, n, groups) float32 and `group` (weights per scale) come from ColdRows. `cold_layer` runs one decode
layer's CPU part in one call: the wait for the GPU's ready flag, the mask -> positions, the kernel, the release flag.
The cold mask reaches the host packed, one bit a cold neuron (bit b of byte i = neuron 8 i + b, zero padded to whole
uint64 words: `mask_bytes`, `pack_mask`), and `bit_indices` turns it into the ascending active positions serially,
one count-trailing-zeros per set bit.
`part` (threads, d_model) float32 scratch: its row count is the number of threads used (Numba's thread count: calling
numba.get_num_threads() inside would stop the kernels from caching). `out` (d_model,) float32 is overwritten with
sum_j h_j * down_t[j]; or, with `out` of shape (0,), that sum is left in `part` as its rows' sum (the rows of threads
that took no neurons zeroed), for the GPU to add up: reading a few more rows over PCIe costs the GPU less than the
CPU's sum costs the CPU (a second parallel region, each row in another core's cache; docs/history.md). The down
bias is added by the caller once.
"""

from __future__ import annotations

import numba
import numpy as np
from hotneurons.kernels.activations import _gated_value, _ungated_value
from hotneurons.kernels.intrinsics import _ctz, _fetch_add, _load_acquire, _store_release, _widen
from numba import njit, prange

GATED = ("reglu", "drelu", "swiglu", "geglu")
CHUNK = 8  # active neurons a thread takes at a time, read four at once (kernel_variants quad8)
TAIL = 8  # the last TAIL * threads active neurons are taken 4 at a time, so that the threads end closer together
INT8_GROUP = 64  # weights per int8 scale: the largest group that loses no more perplexity than 32 does
#                  (bench/cold_int8_quality.py)
UNGATED = ("relu", "gelu")


# ---------------------------------------------------------------------------------------------------------------
# Row helpers (inlined by LLVM)


@njit(nogil=True, cache=True, fastmath=True, inline="always")
def _dot(x, row, sc, group):  # (d,) float32 . (d,) stored row (bf16 bits or int8) with (groups,) scales
    d = x.shape[0]
    s = np.float32(0.0)
    if group == INT8_GROUP and d % INT8_GROUP == 0:  # a constant trip count: vectorises better than the loop below
        for i in range(sc.shape[0]):
            lo = i * INT8_GROUP
            p = np.float32(0.0)
            for k in range(INT8_GROUP):
                p += x[lo + k] * _widen(row[lo + k])
            s += sc[i] * p
        return s
    for i in range(sc.shape[0]):
        lo = i * group
        xs, rs = x[lo:min(lo + group, d)], row[lo:min(lo + group, d)]  # slices: a loop from 0 vectorises, an offset one
        p = np.float32(0.0)                                             # range(lo, hi) did not
        for k in range(xs.shape[0]):
            p += xs[k] * _widen(rs[k])
        s += sc[i] * p
    return s


@njit(nogil=True, cache=True, fastmath=True, inline="always")
def _axpy(h, row, sc, group, acc):  # acc (d,) float32 += h * (d,) stored row with (groups,) scales
    d = acc.shape[0]
    if group == INT8_GROUP and d % INT8_GROUP == 0:
        for i in range(sc.shape[0]):
            lo, hs = i * INT8_GROUP, h * sc[i]
            for k in range(INT8_GROUP):
                acc[lo + k] += hs * _widen(row[lo + k])
        return
    for i in range(sc.shape[0]):
        lo = i * group
        a, rs = acc[lo:min(lo + group, d)], row[lo:min(lo + group, d)]
        hs = h * sc[i]
        for k in range(a.shape[0]):
            a[k] += hs * _widen(rs[k])


@njit(nogil=True, cache=True, fastmath=True)
def _dot4(x, r0, r1, r2, r3, c0, c1, c2, c3, group):  # four rows' dots in one pass over x (see _dot)
    d = x.shape[0]
    s0 = s1 = s2 = s3 = np.float32(0.0)
    if group == INT8_GROUP and d % INT8_GROUP == 0:
        for i in range(c0.shape[0]):
            lo = i * INT8_GROUP
            p0 = p1 = p2 = p3 = np.float32(0.0)
            for k in range(INT8_GROUP):
                xk = x[lo + k]
                p0 += xk * _widen(r0[lo + k])
                p1 += xk * _widen(r1[lo + k])
                p2 += xk * _widen(r2[lo + k])
                p3 += xk * _widen(r3[lo + k])
            s0, s1, s2, s3 = s0 + c0[i] * p0, s1 + c1[i] * p1, s2 + c2[i] * p2, s3 + c3[i] * p3
        return s0, s1, s2, s3
    for i in range(c0.shape[0]):
        lo, hi = i * group, min(i * group + group, d)
        xs, a0, a1, a2, a3 = x[lo:hi], r0[lo:hi], r1[lo:hi], r2[lo:hi], r3[lo:hi]
        p0 = p1 = p2 = p3 = np.float32(0.0)
        for k in range(xs.shape[0]):
            xk = xs[k]
            p0 += xk * _widen(a0[k])
            p1 += xk * _widen(a1[k])
            p2 += xk * _widen(a2[k])
            p3 += xk * _widen(a3[k])
        s0, s1, s2, s3 = s0 + c0[i] * p0, s1 + c1[i] * p1, s2 + c2[i] * p2, s3 + c3[i] * p3
    return s0, s1, s2, s3


@njit(nogil=True, cache=True, fastmath=True)
def _dot8(x, r0, r1, r2, r3, r4, r5, r6, r7, c0, c1, c2, c3, c4, c5, c6, c7, group):  # eight rows' dots, one pass
    d = x.shape[0]
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
    if group == INT8_GROUP and d % INT8_GROUP == 0:
        for i in range(c0.shape[0]):
            lo = i * INT8_GROUP
            p0 = p1 = p2 = p3 = p4 = p5 = p6 = p7 = np.float32(0.0)
            for k in range(INT8_GROUP):
                xk = x[lo + k]
                p0 += xk * _widen(r0[lo + k])
                p1 += xk * _widen(r1[lo + k])
                p2 += xk * _widen(r2[lo + k])
                p3 += xk * _widen(r3[lo + k])
                p4 += xk * _widen(r4[lo + k])
                p5 += xk * _widen(r5[lo + k])
                p6 += xk * _widen(r6[lo + k])
                p7 += xk * _widen(r7[lo + k])
            s0, s1, s2, s3 = s0 + c0[i] * p0, s1 + c1[i] * p1, s2 + c2[i] * p2, s3 + c3[i] * p3
            s4, s5, s6, s7 = s4 + c4[i] * p4, s5 + c5[i] * p5, s6 + c6[i] * p6, s7 + c7[i] * p7
        return s0, s1, s2, s3, s4, s5, s6, s7
    for i in range(c0.shape[0]):
        lo, hi = i * group, min(i * group + group, d)
        xs, a0, a1, a2, a3 = x[lo:hi], r0[lo:hi], r1[lo:hi], r2[lo:hi], r3[lo:hi]
        a4, a5, a6, a7 = r4[lo:hi], r5[lo:hi], r6[lo:hi], r7[lo:hi]
        p0 = p1 = p2 = p3 = p4 = p5 = p6 = p7 = np.float32(0.0)
        for k in range(xs.shape[0]):
            xk = xs[k]
            p0 += xk * _widen(a0[k])
            p1 += xk * _widen(a1[k])
            p2 += xk * _widen(a2[k])
            p3 += xk * _widen(a3[k])
            p4 += xk * _widen(a4[k])
            p5 += xk * _widen(a5[k])
            p6 += xk * _widen(a6[k])
            p7 += xk * _widen(a7[k])
        s0, s1, s2, s3 = s0 + c0[i] * p0, s1 + c1[i] * p1, s2 + c2[i] * p2, s3 + c3[i] * p3
        s4, s5, s6, s7 = s4 + c4[i] * p4, s5 + c5[i] * p5, s6 + c6[i] * p6, s7 + c7[i] * p7
    return s0, s1, s2, s3, s4, s5, s6, s7


@njit(nogil=True, cache=True, fastmath=True)
def _axpy4(h0, h1, h2, h3, r0, r1, r2, r3, c0, c1, c2, c3, group, acc):  # acc += four rows x h in one pass
    d = acc.shape[0]
    if group == INT8_GROUP and d % INT8_GROUP == 0:
        for i in range(c0.shape[0]):
            lo = i * INT8_GROUP
            a0, a1, a2, a3 = h0 * c0[i], h1 * c1[i], h2 * c2[i], h3 * c3[i]
            for k in range(INT8_GROUP):
                acc[lo + k] += (a0 * _widen(r0[lo + k]) + a1 * _widen(r1[lo + k]) + a2 * _widen(r2[lo + k])
                                + a3 * _widen(r3[lo + k]))
        return
    for i in range(c0.shape[0]):
        lo, hi = i * group, min(i * group + group, d)
        a, b0, b1, b2, b3 = acc[lo:hi], r0[lo:hi], r1[lo:hi], r2[lo:hi], r3[lo:hi]
        a0, a1, a2, a3 = h0 * c0[i], h1 * c1[i], h2 * c2[i], h3 * c3[i]
        for k in range(a.shape[0]):
            a[k] += a0 * _widen(b0[k]) + a1 * _widen(b1[k]) + a2 * _widen(b2[k]) + a3 * _widen(b3[k])


@njit(nogil=True, cache=True, fastmath=True)
def _sum_rows(part, T, out, lo, hi):  # out[lo:hi] = sum of part[:T, lo:hi] (t-outer, so the inner loop vectorises)
    for k in range(lo, hi):
        out[k] = part[0, k]
    for t in range(1, T):
        for k in range(lo, hi):
            out[k] += part[t, k]


@njit(nogil=True, cache=True, fastmath=True)
def _n_chunks(k, threads):
    return max(1, min(threads, k))


# ---------------------------------------------------------------------------------------------------------------
# The kernel, gated and ungated FFNs alike: the activation is a loop-invariant integer code, so the branches on it
# cost nothing next to the row reads.

ACT_CODE = {"relu": 0, "gelu": 1, "reglu": 2, "drelu": 3, "swiglu": 4, "geglu": 5}
FIRST_GATED = 2  # codes from here on are gated activations


@njit(nogil=True, cache=True, fastmath=True)
def _gated_rest(x, j, g, up, down_t, scale, group, acc, act):  # neuron j of a gated FFN, its gate value g known
    if act <= 3 and g <= 0:  # ReLU gates: a zero gate skips the up and down rows
        return
    _down1(_gated_value(act, g, _dot(x, up[j], scale[1, j], group)), j, down_t, scale, group, acc)


@njit(nogil=True, cache=True, fastmath=True)
def _down1(h, j, down_t, scale, group, acc):
    if h != 0:
        _axpy(h, down_t[j], scale[2, j], group, acc)


@njit(nogil=True, cache=True, fastmath=True)
def _down4(h0, h1, h2, h3, j0, j1, j2, j3, down_t, scale, group, acc):  # acc += four neurons' down rows x h
    if h0 != 0 and h1 != 0 and h2 != 0 and h3 != 0:
        _axpy4(h0, h1, h2, h3, down_t[j0], down_t[j1], down_t[j2], down_t[j3], scale[2, j0], scale[2, j1],
               scale[2, j2], scale[2, j3], group, acc)
        return
    _down1(h0, j0, down_t, scale, group, acc)  # an inactive neuron (a wrong guess): each on its own, skipping its
    _down1(h1, j1, down_t, scale, group, acc)  # down row
    _down1(h2, j2, down_t, scale, group, acc)
    _down1(h3, j3, down_t, scale, group, acc)


@njit(nogil=True, cache=True, fastmath=True)
def _gated4(x, j0, j1, j2, j3, gate, up, down_t, scale, group, acc, act):  # four neurons, their rows read at once
    """The gate and up rows of four neurons in one pass (8 rows at once), then their down rows: fewer passes over x
    keep more reads in flight than gate, up and down in three passes of four rows (docs/history.md). A neuron marked
    active whose ReLU gate is zero (a wrong guess) has read its up row for nothing (one row more than reading the
    gates first: worth it while the predictor's precision is high)."""
    g0, g1, g2, g3, u0, u1, u2, u3 = _dot8(x, gate[j0], gate[j1], gate[j2], gate[j3], up[j0], up[j1], up[j2], up[j3],
                                           scale[0, j0], scale[0, j1], scale[0, j2], scale[0, j3], scale[1, j0],
                                           scale[1, j1], scale[1, j2], scale[1, j3], group)
    _down4(_gated_value(act, g0, u0), _gated_value(act, g1, u1), _gated_value(act, g2, u2),
           _gated_value(act, g3, u3), j0, j1, j2, j3, down_t, scale, group, acc)


@njit(nogil=True, cache=True, fastmath=True)
def _ungated4(x, j0, j1, j2, j3, up, b_up, down_t, scale, group, acc, act):  # four neurons, their rows read at once
    a0, a1, a2, a3 = _dot4(x, up[j0], up[j1], up[j2], up[j3], scale[1, j0], scale[1, j1], scale[1, j2], scale[1, j3],
                           group)
    _down4(_ungated_value(a0 + b_up[j0], act), _ungated_value(a1 + b_up[j1], act), _ungated_value(a2 + b_up[j2], act),
           _ungated_value(a3 + b_up[j3], act), j0, j1, j2, j3, down_t, scale, group, acc)


@njit(nogil=True, cache=True)
def _head(k, threads):  # positions of idx claimed CHUNK at a time (_claim); the last TAIL * threads 4 at a time, so
    return max(0, k - TAIL * threads) // CHUNK * CHUNK  # that the threads end closer together


@njit(nogil=True, cache=True, fastmath=True)
def _claim(c, k, head, chunk=CHUNK):  # claim number c -> positions [q0, q1) of idx: chunk at a time below `head`,
    if c < head // chunk:               # then 4
        return c * chunk, c * chunk + chunk
    q0 = head + (c - head // chunk) * 4
    return q0, min(q0 + 4, k)


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def cold_ffn(x, idx, gate, up, b_up, down_t, scale, group, part, out, act):
    d, k = x.shape[0], idx.shape[0]
    gated = act >= FIRST_GATED
    T = _n_chunks(k, part.shape[0])
    head = _head(k, T)
    counter = np.zeros(1, np.int64)  # claims taken
    for t in prange(T):
        acc = part[t]  # (d,) this thread's partial sum
        acc[:] = 0.0
        while True:
            q0, q1 = _claim(_fetch_add(counter, 1), k, head)
            if q0 >= k:
                break
            q = q0
            while q + 4 <= q1:
                if gated:
                    _gated4(x, idx[q], idx[q + 1], idx[q + 2], idx[q + 3], gate, up, down_t, scale, group, acc, act)
                else:
                    _ungated4(x, idx[q], idx[q + 1], idx[q + 2], idx[q + 3], up, b_up, down_t, scale, group, acc, act)
                q += 4
            for q in range(q, q1):
                j = idx[q]
                if gated:
                    _gated_rest(x, j, _dot(x, gate[j], scale[0, j], group), up, down_t, scale, group, acc, act)
                else:
                    _down1(_ungated_value(_dot(x, up[j], scale[1, j], group) + b_up[j], act), j, down_t, scale,
                           group, acc)
    if out.shape[0] == 0:  # the caller sums part's rows (the GPU, reading them over PCIe); those past T are zero
        part[T:] = 0.0
        return
    for c in prange(T):  # the partial rows summed by all threads, one slice of d each
        _sum_rows(part, T, out, c * d // T, (c + 1) * d // T)


@njit(nogil=True, cache=True)
def bit_indices(words, n, out):
    """out[:k] = the positions of the set bits of a packed mask of n entries, ascending (np.flatnonzero's of the
    unpacked mask); returns k. words: (ceil(n / 64),) uint64, bit j of word w = entry 64 w + j (the host mask's
    bytes, bit b of byte i = entry 8 i + b, viewed as little-endian uint64); bits at n and past are left out. out:
    (n,) int64. Serial, one count-trailing-zeros per set bit: a few percent of a layer's cold neurons are set, and
    the byte mask this replaced took a parallel region's fork and join to scan (docs/history.md)."""
    k = 0
    for w in range(min(words.shape[0], (n + 63) // 64)):
        b = words[w]
        if 64 * w + 64 > n:  # the last word: only its first n - 64 w bits are entries
            b &= (np.uint64(1) << np.uint64(n - 64 * w)) - np.uint64(1)
        while b != 0:
            out[k] = 64 * w + _ctz(b)
            k += 1
            b &= b - np.uint64(1)  # the lowest set bit cleared
    return k


SPINS = 1 << 33  # reads of a ready flag before giving up (seconds; a layer's GPU part takes well under 1 ms)


@njit(nogil=True, cache=True)
def wait_ready(ready, i, spins):
    """Spin until ready[i] is 1 (written by the GPU after the host-visible writes before it), then reset it to 0 and
    return True; False after `spins` reads of 0 (a GPU that failed would otherwise hang the host)."""
    for _ in range(spins):
        if _load_acquire(ready, i) != 0:
            ready[i] = 0
            return True
    return False


@njit(nogil=True, cache=True)
def cold_layer(ready, release, i, words, idx, skip, x, gate, up, b_up, down_t, scale, group, part, out, act, marks):
    """One decode layer's CPU part in one call, so that no Python runs between the GPU's signal and the kernel (in
    decode the main thread runs Python slower than alone, its caches flushed by the rows just read; docs/history.md):

      i >= 0: wait until ready[i] is 1 (the GPU wrote x and the cold mask to the host, then ready[i]), then reset it;
      the set bits of the packed cold mask `words` (ceil(n_cold / 64),) uint64 -> idx[:k] ascending (bit_indices;
      idx: (n_cold,) int64, its length the mask's); the first `skip` are the device's (its PCIe share);
      out (d,) float32 = the rows' sum (cold_ffn over idx[skip:k]), or with out of shape (0,) part's rows (the
      threads' partial sums, which the GPU adds up);
      marks += (1, k); i >= 0: release[i] = 1 (the GPU's next graph waits for it; out or part is written first).

    Returns k, or -1 (nothing done) when no signal came within SPINS reads."""
    if i >= 0 and not wait_ready(ready, i, SPINS):
        return -1
    k = bit_indices(words, idx.shape[0], idx)
    marks[0] += 1
    marks[1] += k
    cold_ffn(x, idx[min(skip, k):k], gate, up, b_up, down_t, scale, group, part, out, act)
    if i >= 0:
        _store_release(release, i, np.int32(1))
    return k


NO_FLAGS = np.zeros(0, np.int32)  # cold_layer's ready / release when there is nothing to wait for or release


def mask_bytes(n: int) -> int:
    """Bytes of the packed host mask of n cold neurons: whole uint64 words (bit_indices' view), the bits past n zero."""
    return -(-n // 64) * 8


def pack_mask(mask: np.ndarray) -> np.ndarray:
    """(n,) bool -> (mask_bytes(n),) uint8, bit b of byte i = mask[8 i + b]: the host mask as the GPU writes it
    (ops.predict, fused.predict), for tests and benches."""
    out = np.zeros(mask_bytes(mask.shape[0]), np.uint8)
    packed = np.packbits(mask, bitorder="little")  # (ceil(n / 8),)
    out[:packed.shape[0]] = packed
    return out


def default_threads() -> int:
    """Numba's cores (its NUMBA_NUM_THREADS), all of them. Leaving one to the rest of the machine cuts the tail of a
    call beside a waking process (bench/cold_stalls.py), but in the 70B decode on the same 16-core host every core
    ran the layer's CPU part faster at the median (docs/benchmarks.md, the threads table); `--threads` sets fewer."""
    return numba.config.NUMBA_NUM_THREADS


def set_threads(n: int | None) -> int:
    """Numba CPU threads for the cold kernels (None: default_threads()); returns the number in use."""
    numba.set_num_threads(max(1, min(int(n or default_threads()), numba.config.NUMBA_NUM_THREADS)))
    return numba.get_num_threads()
