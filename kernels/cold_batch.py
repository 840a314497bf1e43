"""Numba kernels for the cold neurons of B decode tokens at once (runtime/batch.py): each cold row in the union of the
B masks is read from DRAM once, and used by every token whose own mask marks it. Their reference: the batch-1
kernels (kernels/cold.py cold_ffn, kernels/cold_q.py cold_ffn_q) run token by token over each token's own positions.

  cold_ffn_batch(xs, idx, member, gate, up, b_up, down_t, scale, group, part, out, act)   bf16 / int8 rows
  cold_ffn_batch_q(xs, idx, member, gate, up, b_up, down_t, part, out, act, fmt=-1)       block rows (float route)

xs (B, d) float32 the tokens' FFN inputs; idx (k,) int64 the union's positions, ascending; member (k,) uint64 bit b
set where token b's mask marks idx[q] (B <= 64); part (threads, B, d) float32 scratch; out (B, d) float32, overwritten
with each token's sum over its marked neurons of h_j(x_b) * down_t[j]. Threads claim QCHUNK union positions at a
time and take them token by token, the token's positions four at a time as the batch-1 kernels read them (more reads
in flight): a row, read from DRAM for the first token that marks it, is in the core's cache for the others.
"""

from __future__ import annotations

import numpy as np
from hotneurons.kernels.activations import _ungated_value
from hotneurons.kernels.cold import FIRST_GATED, _dot, _down1, _gated4, _gated_rest, _n_chunks, _sum_rows, _ungated4
from hotneurons.kernels.cold_q import _LUT, Q4_0, Q4_1, Q4_K, Q5_K, Q8_0, _check, _one
from hotneurons.kernels.cold_q import _gated4 as _gated4_q
from hotneurons.kernels.cold_q import _ungated4 as _ungated4_q
from hotneurons.kernels.intrinsics import _fetch_add
from numba import njit, prange

MAX_BATCH = 64  # tokens a member word holds
QCHUNK = 64  # union positions a thread claims at a time: ~900 KB of rows at d 8192 (Q4_0), a core's L2


@njit(nogil=True, cache=True)
def _sum_tokens(part, T, out):
    """out[b] = sum of part[:T, b] for every token b, the d columns split among the threads."""
    B, d = out.shape
    for b in range(B):
        _sum_rows(part[:, b], T, out[b], 0, d)


@njit(nogil=True, cache=True)
def _marked(idx, member, q0, q1, b, mine):
    """mine[:n] = the neurons of union positions [q0, q1) that token b marks; returns n."""
    bit = np.uint64(1) << np.uint64(b)
    n = 0
    for q in range(q0, q1):
        if member[q] & bit:
            mine[n] = idx[q]
            n += 1
    return n


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def cold_ffn_batch(xs, idx, member, gate, up, b_up, down_t, scale, group, part, out, act):
    B, k = xs.shape[0], idx.shape[0]
    gated = act >= FIRST_GATED
    T = _n_chunks((k + QCHUNK - 1) // QCHUNK, part.shape[0])
    counter = np.zeros(1, np.int64)  # claims taken
    for t in prange(T):
        acc = part[t]  # (B, d) this thread's partial sums
        acc[:] = 0.0
        mine = np.empty(QCHUNK, np.int64)
        while True:  # as _work_q: a claim's positions token by token, four neurons at once
            q0 = _fetch_add(counter, 1) * QCHUNK
            if q0 >= k:
                break
            for b in range(B):
                n = _marked(idx, member, q0, min(q0 + QCHUNK, k), b, mine)
                x, i = xs[b], 0
                while i + 4 <= n:
                    if gated:
                        _gated4(x, mine[i], mine[i + 1], mine[i + 2], mine[i + 3], gate, up, down_t, scale, group,
                                acc[b], act)
                    else:
                        _ungated4(x, mine[i], mine[i + 1], mine[i + 2], mine[i + 3], up, b_up, down_t, scale, group,
                                  acc[b], act)
                    i += 4
                for p in range(i, n):
                    j = mine[p]
                    if gated:
                        _gated_rest(x, j, _dot(x, gate[j], scale[0, j], group), up, down_t, scale, group, acc[b], act)
                    else:
                        _down1(_ungated_value(_dot(x, up[j], scale[1, j], group) + b_up[j], act), j, down_t, scale,
                               group, acc[b])
    _sum_tokens(part, T, out)


@njit(nogil=True, cache=True, fastmath=True)
def _work_q(xs, idx, member, gate, up, b_up, down_t, acc, act, gated, counter, fg, fd):
    """One thread's share of cold_ffn_batch_q. `fg` must be a literal number in the caller's source (cold_q._work).
    A claim is QCHUNK union positions; within it, token by token, the positions the token marks four at a time as
    the batch-1 kernel reads them (eight gate and up rows in one pass, the next four prefetched): the first token to
    need a row brings it from DRAM, the others find it in the core's cache (a claim's rows: ~900 KB at d 8192)."""
    k = idx.shape[0]
    mine = np.empty(QCHUNK, np.int64)  # the positions of the claim one token marks
    while True:
        q0 = _fetch_add(counter, 1) * QCHUNK
        if q0 >= k:
            return
        for b in range(xs.shape[0]):
            n = _marked(idx, member, q0, min(q0 + QCHUNK, k), b, mine)
            x = (xs[b],)
            i = 0
            while i + 4 <= n:
                last = n - 1  # the next group's rows to prefetch (this group's own at the end)
                n0, n1, n2, n3 = (mine[min(i + 4, last)], mine[min(i + 5, last)], mine[min(i + 6, last)],
                                  mine[min(i + 7, last)])
                if gated:
                    _gated4_q(x, mine[i], mine[i + 1], mine[i + 2], mine[i + 3], n0, n1, n2, n3, gate, up, down_t,
                              _LUT, fg, fd, acc[b], act)
                else:
                    _ungated4_q(x, mine[i], mine[i + 1], mine[i + 2], mine[i + 3], n0, n1, n2, n3, up, b_up, down_t,
                                _LUT, fg, fd, acc[b], act)
                i += 4
            for p in range(i, n):
                _one(x, mine[p], gate, up, b_up, down_t, _LUT, fg, fd, acc[b], act, gated)


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def cold_ffn_batch_q(xs, idx, member, gate, up, b_up, down_t, part, out, act, fmt=-1):
    k = idx.shape[0]
    gated = act >= FIRST_GATED
    fg, fd = _check(xs[0], gate, up, down_t, part[:, 0], out[0], gated, fmt)
    T = _n_chunks((k + QCHUNK - 1) // QCHUNK, part.shape[0])
    counter = np.zeros(1, np.int64)
    for t in prange(T):
        acc = part[t]  # (B, d)
        acc[:] = 0.0
        if fg == Q4_0:  # formats as literals (cold_q.cold_ffn_q)
            _work_q(xs, idx, member, gate, up, b_up, down_t, acc, act, gated, counter, 1, fd)
        elif fg == Q4_1:
            _work_q(xs, idx, member, gate, up, b_up, down_t, acc, act, gated, counter, 2, fd)
        elif fg == Q8_0:
            _work_q(xs, idx, member, gate, up, b_up, down_t, acc, act, gated, counter, 0, fd)
        elif fg == Q4_K:
            _work_q(xs, idx, member, gate, up, b_up, down_t, acc, act, gated, counter, 3, fd)
        elif fg == Q5_K:
            _work_q(xs, idx, member, gate, up, b_up, down_t, acc, act, gated, counter, 4, fd)
        else:
            _work_q(xs, idx, member, gate, up, b_up, down_t, acc, act, gated, counter, 5, fd)
    _sum_tokens(part, T, out)


def union(masks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """masks (B, n) bool -> (idx (k,) int64 the positions any token marks, ascending; member (k,) uint64 which
    tokens mark each: bit b for token b)."""
    B = masks.shape[0]
    if B > MAX_BATCH:
        raise ValueError(f"a batch of {B} tokens: the cold kernels take at most {MAX_BATCH}")
    idx = np.flatnonzero(masks.any(0))
    weights = np.left_shift(np.uint64(1), np.arange(B, dtype=np.uint64))  # (B,) bit b
    member = (masks[:, idx].astype(np.uint64) * weights[:, None]).sum(0, dtype=np.uint64)
    return idx.astype(np.int64), member
