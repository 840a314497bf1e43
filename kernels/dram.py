"""The DRAM read ceiling as the cold kernels see it: a reduction over 16 KiB rows in random order, four at once per
thread, threads taking eight rows at a time from a shared counter (kernels/cold.py reads cold rows that way).
One core reading one sequential stream keeps fewer reads in flight, so sequential reductions under-read DRAM
(bench/NOTES.md). hotneurons.common.hardware and bench_ceilings use it."""

from __future__ import annotations

import functools
import time

import numpy as np
from hotneurons.kernels.intrinsics import _fetch_add
from numba import njit, prange


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _sum_gathered(rows, order, threads):
    """Sum of rows (n, w) float32 visited in `order` (n a multiple of 8), as the cold kernels read rows: threads take
    8 rows at a time from a shared counter and read 4 at once."""
    n, w = order.shape[0], rows.shape[1]
    counter = np.zeros(1, np.int64)
    out = np.zeros(threads, np.float32)
    for t in prange(threads):
        s0 = s1 = s2 = s3 = np.float32(0.0)
        while True:
            q0 = _fetch_add(counter, 8)
            if q0 >= n:
                break
            for q in range(q0, q0 + 8, 4):
                r0, r1, r2, r3 = rows[order[q]], rows[order[q + 1]], rows[order[q + 2]], rows[order[q + 3]]
                for k in range(w):
                    s0 += r0[k]
                    s1 += r1[k]
                    s2 += r2[k]
                    s3 += r3[k]
        out[t] = s0 + s1 + s2 + s3
    return out.sum()


def row_gather_bw(a: np.ndarray, threads: int, repeats: int = 1) -> float:
    """bytes/s of the best of `repeats` reads of a float32 array far larger than the caches, as the cold kernels read
    DRAM: 16 KiB rows in a fixed random order (the same each pass, so the L3 holds only the rows read last), 4 at
    once per thread. One core reading one sequential stream keeps fewer reads in flight, so sequential reductions read
    less (bench/NOTES.md)."""
    rows = a[:a.size // 32768 * 32768].reshape(-1, 4096)  # (rows, 4096) float32: 16 KiB rows, a multiple of 8
    order = _gather_order(rows.shape[0])
    _sum_gathered(rows, order[:8], threads)  # compiled (or loaded from the cache) on first use
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        _sum_gathered(rows, order, threads)
        best = min(best, time.perf_counter() - t0)
    return rows.nbytes / best


@functools.lru_cache(maxsize=1)
def _gather_order(n: int) -> np.ndarray:
    """The fixed random order of row_gather_bw's rows: drawn once, not before every timed pass (the zero-copy
    ceiling times passes back to back while the GPU reads)."""
    return np.random.default_rng(1).permutation(n).astype(np.int64)
