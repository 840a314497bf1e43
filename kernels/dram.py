"""The DRAM read ceiling as the cold kernels see it: a reduction over 16 KiB rows in random order, four at once per
thread, threads taking eight rows at a time from a shared counter (kernels/cold.py reads cold rows that way).
One core reading one sequential stream keeps fewer reads in flight, so sequential reductions under-read DRAM
(docs/history.md). kernels/measure.py and bench_ceilings use it."""

from __future__ import annotations

import functools
import time

import numba
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
    less (docs/history.md)."""
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


def random_blocks(rng: np.random.Generator, rows: int, width: int, fmt: str) -> np.ndarray:
    """(rows, row bytes) uint8: random `fmt` blocks of `width` weights a row whose fp16 fields (scale, q4_1's min, the
    K-quants' d and dmin) are 0.01, a normal number: the kernels' timing must not meet subnormals."""
    from hotneurons.weights.formats import spec

    s = spec(fmt)
    a = rng.integers(0, 256, (rows, width // s.block * s.block_bytes), dtype=np.uint8)
    at, n16 = {"q4_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208, 1)}.get(fmt, (0, 1))  # the fp16 fields
    a.reshape(rows, -1, s.block_bytes)[:, :, at:at + 2 * n16] = np.frombuffer(np.full(n16, 0.01, np.float16).tobytes(),
                                                                              np.uint8)
    return a


def cold_call_bw(d: int, fmt: str, gated: bool, rows_per_call: int, table_bytes: int = 2**30, calls: int = 200,
                 gap_s: float = 2e-4, seed: int = 0) -> float:
    """bytes/s over all calls (cold_call_times' bytes a call over its mean call): the rate the solver prices an active
    cold neuron at."""
    times, nbytes = cold_call_times(d, fmt, gated, rows_per_call, table_bytes, calls, gap_s, seed)
    return nbytes / float(times.mean())


def cold_call_times(d: int, fmt: str, gated: bool, rows_per_call: int, table_bytes: int = 2**30, calls: int = 200,
                    gap_s: float = 2e-4, seed: int = 0) -> tuple[np.ndarray, float]:
    """The cold kernels themselves as a decode step calls them: `calls` calls, each over `rows_per_call`
    random neurons (ascending, as the runtime passes them) of a table of about `table_bytes` of `fmt` rows
    (kernels/names.COLD_DTYPES) of d weights, every row of each neuron read (an activation that never skips), the
    host spinning `gap_s` between calls as it waits for the GPU's part of the next layer. Small calls on threads that
    start and stop at every layer read several times slower than row_gather_bw's one long pass (the rate the
    solver's cost model needs for an active cold neuron, cold_call_bw). Returns each call's seconds (calls,) and the
    bytes a call reads: their spread shows stalls, a call held by one late thread (bench/cold_stalls.py)."""
    from hotneurons.kernels.cold import ACT_CODE, cold_ffn
    from hotneurons.kernels.cold_q import FORMAT_CODE, cold_ffn_q
    from hotneurons.kernels.names import BLOCK_DTYPES, COLD_DTYPES, K_DTYPES
    from hotneurons.weights.formats import nearest, spec

    if fmt not in COLD_DTYPES:
        raise ValueError(f"unknown cold-row format '{fmt}': choose one of {', '.join(COLD_DTYPES)}")
    rng = np.random.default_rng(seed)
    n_mats = 3 if gated else 2
    dfmt = nearest(fmt).value if fmt in K_DTYPES else fmt  # down_t beside K-quant rows (ffn_weights.cold_formats)

    def width(f: str) -> int:  # bytes of a row of d weights
        if f in BLOCK_DTYPES + K_DTYPES:
            return d // spec(f).block * spec(f).block_bytes
        return d * (2 if f == "bf16" else 1)

    row_bytes = ((n_mats - 1) * width(fmt) + width(dfmt)) / n_mats  # a neuron's rows' mean
    n = max(rows_per_call * 4, int(table_bytes // (n_mats * row_bytes)))  # neurons: far more than the caches hold

    def table(f: str = fmt) -> np.ndarray:
        if f in BLOCK_DTYPES + K_DTYPES:
            return random_blocks(rng, n, d, f)
        if f == "bf16":  # normal numbers about 0.01, never subnormal
            return rng.integers(0x3C00, 0x3D00, (n, d), dtype=np.uint16)
        return rng.integers(-127, 128, (n, d), dtype=np.int8)

    up, down_t = table(), table(dfmt)
    gate = table() if gated else up
    b_up = np.zeros(n, np.float32)
    x = rng.standard_normal(d).astype(np.float32)
    part = np.empty((numba.get_num_threads(), d), np.float32)
    out = np.empty(d, np.float32)
    act = ACT_CODE["swiglu" if gated else "gelu"]  # smooth: every row of every neuron is read
    scale, group = np.ones((3, n, 1), np.float32), d

    def call(idx: np.ndarray) -> None:
        if fmt in BLOCK_DTYPES + K_DTYPES:
            cold_ffn_q(x, idx, gate, up, b_up, down_t, part, out, act, fmt=FORMAT_CODE[fmt])
        else:
            cold_ffn(x, idx, gate, up, b_up, down_t, scale, group, part, out, act)

    ids = [np.sort(rng.choice(n, rows_per_call, replace=False)).astype(np.int64) for _ in range(calls)]
    call(ids[0])  # compiled (or loaded from the cache)
    times = np.empty(calls)  # s
    for i, idx in enumerate(ids):
        t_end = time.perf_counter() + gap_s
        while time.perf_counter() < t_end:  # the host waits for the GPU: a spin, as the runtime's
            pass
        t0 = time.perf_counter()
        call(idx)
        times[i] = time.perf_counter() - t0
    return times, rows_per_call * n_mats * row_bytes


def expert_call_bw(d: int, n: int, fmt: str, experts_per_call: int, table_bytes: int = 2**30, calls: int = 100,
                   gap_s: float = 2e-4, seed: int = 0) -> float:
    """bytes/s of the cold experts' kernel (kernels/cold_experts.expert_ffn) as a decode step calls it: `calls` calls,
    each over `experts_per_call` random experts (gate, up: n rows of d; down: d rows of n, in `fmt` blocks) of a table
    of about `table_bytes`, the host spinning `gap_s` between calls as cold_call_bw's does. The rate pi-solve prices a
    routed cold expert at."""
    from hotneurons.kernels.cold_experts import expert_ffn
    from hotneurons.weights.formats import spec

    s = spec(fmt)
    rng = np.random.default_rng(seed)
    expert_bytes = (2 * n * (d // s.block) + d * (n // s.block)) * s.block_bytes
    E = max(4 * experts_per_call, table_bytes // expert_bytes)
    gate, up, down = (random_blocks(rng, E * n, d, fmt), random_blocks(rng, E * n, d, fmt),
                      random_blocks(rng, E * d, n, fmt))
    x = rng.standard_normal(d).astype(np.float32)
    w = np.full(experts_per_call, 1.0 / experts_per_call, np.float32)
    out = np.empty(d, np.float32)
    picks = [rng.choice(E, experts_per_call, replace=False).astype(np.int64) for _ in range(calls)]
    expert_ffn(x, picks[0], w, gate, up, down, "swiglu", out)  # compiled (or loaded from the cache)
    spent = 0.0
    for ids in picks:
        t_end = time.perf_counter() + gap_s
        while time.perf_counter() < t_end:
            pass
        t0 = time.perf_counter()
        expert_ffn(x, ids, w, gate, up, down, "swiglu", out)
        spent += time.perf_counter() - t0
    return calls * experts_per_call * expert_bytes / spent
