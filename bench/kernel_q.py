"""The cold-row kernel's effective bandwidth per cold-row dtype (bf16, int8, q8_0, q4_0, q4_1, q4_k, q5_k, q6_k)
beside the DRAM row-gather ceiling: bytes of the rows a call reads / its time, and that as a fraction of the ceiling.

One big layer's cold rows (default d 8192, 28672 neurons: LLaMA-2-70B's FFN) from random weights (std 0.02), stored
in each dtype by cold_rows.ColdRows.from_weights (q8_0 / q4_0 / q4_1: llama.cpp's rounding); a K-quant's gate and up
rows are random valid blocks (random bytes, fp16 d and dmin for weights of about 0.02: gguf-py writes no K-quant),
its down_t rows the runtime's choice for a down of the same type (models/ffn_weights.cold_formats: Q4_K -> q4_1,
Q5_K / Q6_K -> q8_0), quantized from random weights. Then laid out as many times as it takes to fill --total-gb
(copies, as if of that many layers), so that the rows a call reads were last read several calls ago and come from
DRAM, not the L3. Each timed call takes the next layer copy and a fresh set of active neurons, drawn among those whose
gate is positive for x (what a predictor marks: each reads its gate, up and down rows; the FFN is ReGLU). Beside it,
one core's rate with its rows in the cache (what bounds a core that DRAM feeds faster). Bytes per active neuron: its
three rows with their scales (bf16 2, int8 1 + 4/64, q8_0 34/32, q4_0 18/32, q4_1 20/32 bytes a weight; q4_k
144/256, q5_k 176/256, q6_k 210/256 for gate and up, down_t's own). The ceiling (bench_ceilings.dram_read_bw: 16 KiB
rows gathered in random order, four at once per thread, the cold kernel's read pattern) is measured before and after
the kernels and averaged.

Block dtypes run on cold_q.cold_ffn_q's float route; a dtype written with "+xq" (q4_0+xq, q8_0+xq) runs the int
route (x quantized once per call: cold_q's docstring). --ahead sets the prefetch distance (groups of four neurons).
--with-read times, in turn with the kernel's calls and on the same draws, a pure read of the same rows in the kernel's
pattern (read_rows: gate and up rows eight at once, then down rows four at once, eight neurons a claim, no arithmetic):
the rate that pattern itself gets from DRAM, which bounds the kernel's (`read_median_bytes_per_s`, `share_of_read`).
Row-gather ceiling and read_rows alike run under the OpenMP wait policy that importing hotneurons.kernels (or
hotneurons.runtime) sets (common.hardware.openmp_wait_policy: ACTIVE with a bounded spin on GPU hosts), recorded in
the JSON.

  python -m bench.kernel_q --out results.json            # the full size (~8 GB of rows per dtype, 16 cores)
  python -m bench.kernel_q --small --out small.json      # a quick run (d 2048, ~1 GB per dtype)
  python -m bench.kernel_q --out q.json --dtypes q4_0,q4_0+xq,q8_0,q8_0+xq,bf16,int8
  python -m bench.kernel_q --out k.json --dtypes q4_0,q4_k,q5_k,q6_k    # the K-quants, Q4_0 as the yardstick
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import time

import numba
import numpy as np
import torch
from hotneurons.kernels.cold_q import PREFETCH_AHEAD, XQ_OK, cold_ffn_q, gemv_q
from hotneurons.kernels.intrinsics import _fetch_add
from hotneurons.kernels.names import BLOCK_DTYPES, COLD_DTYPES, K_DTYPES
from hotneurons.runtime.cold_rows import ColdRows, ffn_rows, from_bf16_bits, from_int8_groups, to_blocks
from hotneurons.weights.formats import spec
from numba import njit, prange

from bench.bench_ceilings import dram_read_bw


def gate_values(rows: ColdRows, x: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """(n,) float32 gate pre-activations of every neuron (chunked: no float copy of the whole layer)."""
    n = rows.up.shape[0]
    if rows.fmt:
        return gemv_q(x, rows.gate, np.empty(n, np.float32), rows.fmt)
    out = np.empty(n, np.float32)
    xt = torch.from_numpy(x)
    for s in range(0, n, chunk):
        g = rows.gate[s:s + chunk]
        w = from_bf16_bits(g) if rows.dtype == "bf16" else from_int8_groups(g, rows.scale[0, s:s + chunk], rows.group)
        out[s:s + chunk] = (w @ xt).numpy()
    return out


K_DOWN_T = {"q4_k": "q4_1", "q5_k": "q8_0", "q6_k": "q8_0"}  # cold_formats' down_t for a down of the same type
# per K-quant: its fp16 fields' byte offsets in a block, the unit of their scale; the block's bytes are the table's
K_BLOCK = {"q4_k": ((0, 2), 1 / 500), "q5_k": ((0, 2), 1 / 1000), "q6_k": ((208,), 1 / 2000)}


def k_blocks(rng: np.random.Generator, fmt: str, n: int, d: int, scale: float = 0.02) -> np.ndarray:
    """(n, d / 256 * block bytes) uint8 rows of random `fmt` blocks: random bytes, the fp16 d (and dmin) uniform in
    +-scale * a unit that makes the weights about `scale` in size."""
    (fields, unit), bb = K_BLOCK[fmt], spec(fmt).block_bytes
    b = rng.integers(0, 256, (n, d // 256, bb), dtype=np.uint8)
    for at in fields:
        h = (rng.uniform(-1, 1, (n, d // 256)) * scale / 0.02 * unit).astype(np.float16)  # (n, blocks)
        b[..., at:at + 2] = h.view(np.uint8).reshape(n, d // 256, 2)
    return b.reshape(n, -1)


def layer_rows(d: int, n: int, dtype: str, seed: int) -> ColdRows:
    """One layer's gated cold rows (n, d) from random weights, stored as `dtype` (K-quants: random blocks)."""
    g = torch.Generator().manual_seed(seed)
    w = [torch.randn(n, d, generator=g) * 0.02 for _ in range(3)]  # gate, up, down_t
    if dtype not in K_DTYPES:
        return ColdRows.from_weights(w[0], w[1], None, w[2], dtype)
    rng = np.random.default_rng(seed)
    gate, up = k_blocks(rng, dtype, n, d), k_blocks(rng, dtype, n, d)
    return ColdRows(gate, up, to_blocks(w[2], K_DOWN_T[dtype]), np.zeros(n, np.float32), np.ones((3, n, 0), np.float32),
                    32, dtype, K_DOWN_T[dtype])


def laid_out(rows: ColdRows, layers: int) -> ColdRows:
    """`layers` copies of a layer's rows, one after another: (layers * n, row) arrays."""
    tile = lambda a: np.tile(a, (layers,) + (1,) * (a.ndim - 1))  # noqa: E731
    return dataclasses.replace(rows, gate=tile(rows.gate), up=tile(rows.up), down_t=tile(rows.down_t),
                               b_up=tile(rows.b_up), scale=np.tile(rows.scale, (1, layers, 1)))


def row_bytes(rows: ColdRows) -> int:
    """Bytes of a neuron's gate, up and down rows (scales kept apart not counted)."""
    return sum(a.shape[1] * a.itemsize for a in (rows.gate, rows.up, rows.down_t))


def neuron_bytes(rows: ColdRows) -> int:
    """Bytes a call reads per active neuron: its gate, up and down rows with their scales."""
    return row_bytes(rows) + 3 * rows.scale.shape[2] * 4


def kernel(rows: ColdRows, xq: bool = False, ahead: int = PREFETCH_AHEAD):
    """call(x, idx, out, part): the cold kernel for the rows' dtype (ReGLU), block rows on the float or int route."""
    if not rows.fmt:
        return lambda x, idx, out, part: ffn_rows("reglu", x, idx, rows, out, part)
    return lambda x, idx, out, part: cold_ffn_q(x, idx, rows.gate, rows.up, rows.b_up, rows.down_t, part, out, 2, xq,
                                                ahead, rows.code)


def core_rate(one: ColdRows, x: np.ndarray, positive: np.ndarray, call=None, nbytes: float = 4e6,
              reps: int = 7) -> float:
    """Weights per second one core computes with its rows in the cache (~nbytes of a layer's first neurons, read over
    and over): what bounds a core where DRAM feeds it faster (a part of one row: only one thread takes work)."""
    m = max(8, int(nbytes / neuron_bytes(one)))
    rows = dataclasses.replace(one, gate=None if one.gate is None else one.gate[:m], up=one.up[:m],
                               down_t=one.down_t[:m], b_up=one.b_up[:m], scale=one.scale[:, :m])
    idx = positive[positive < m].astype(np.int64)
    d = x.shape[0]
    out, part = np.empty(d, np.float32), np.empty((1, d), np.float32)
    call = (call or kernel)(rows)
    call(x, idx, out, part)
    best = min(_timed(lambda: call(x, idx, out, part)) for _ in range(reps))
    return len(idx) * 3 * d / best


@njit(nogil=True, fastmath=True, inline="always")
def _xor_rows(rows):  # one uint64 word summed over rows (a tuple of (w,) uint64 rows), read in one pass
    s = np.uint64(0)
    for i in range(rows[0].shape[0]):
        v = rows[0][i]
        for r in rows[1:]:
            v ^= r[i]
        s += v
    return s


@njit(parallel=True, nogil=True, fastmath=True)
def read_rows(gate, up, down, idx, threads):
    """The cold kernel's reads with no arithmetic: per group of four positions of idx, its gate and up rows in one
    pass (eight rows), then its down rows (four), threads claiming eight positions at a time; rows (n, w) uint64."""
    k = idx.shape[0]
    counter = np.zeros(1, np.int64)
    out = np.zeros(threads, np.uint64)
    for t in prange(threads):
        s = np.uint64(0)
        while True:
            q0 = _fetch_add(counter, 8)
            if q0 >= k:
                break
            for q in range(q0, min(q0 + 8, k - 3), 4):
                j0, j1, j2, j3 = idx[q], idx[q + 1], idx[q + 2], idx[q + 3]
                s += _xor_rows((gate[j0], gate[j1], gate[j2], gate[j3], up[j0], up[j1], up[j2], up[j3]))
                s += _xor_rows((down[j0], down[j1], down[j2], down[j3]))
        out[t] = s
    return out.sum()


def reader(rows: ColdRows):
    """call(x, idx, out, part) reading the rows as read_rows does (the access pattern's own DRAM rate)."""
    g, u, dn = (a.view(np.uint64) for a in (rows.gate, rows.up, rows.down_t))
    return lambda x, idx, out, part: read_rows(g, u, dn, idx, part.shape[0])


def _timed(fn) -> float:
    t = time.perf_counter()
    for _ in range(10):
        fn()
    return (time.perf_counter() - t) / 10


def build(dtype: str, d: int, n: int, total_bytes: float, seed: int) -> dict:
    """One layer's rows in `dtype`, laid out over total_bytes; x, the positive-gate neurons, the in-cache rate."""
    t0 = time.perf_counter()
    one = layer_rows(d, n, dtype, seed)
    layer_bytes = sum(a.nbytes for a in (one.gate, one.up, one.down_t))
    layers = max(2, math.ceil(total_bytes / layer_bytes))
    x = np.random.default_rng(seed).standard_normal(d).astype(np.float32)
    positive = np.flatnonzero(gate_values(one, x) > 0)
    return {"one": one, "rows": laid_out(one, layers), "layers": layers, "layer_bytes": layer_bytes, "x": x,
            "positive": positive, "build_s": time.perf_counter() - t0}


def measure(b: dict, call, n: int, densities: list[float], reps: int, seed: int, part_only: bool,
            read=None) -> list[dict]:
    """Timed calls over the laid-out rows, per density: a fresh set of active neurons and the next layer copy each.
    read: a second call (reader) timed in turn with the first, each on its own layer copies, on the same draws."""
    rows, layers, x, positive = b["rows"], b["layers"], b["x"], b["positive"]
    d = x.shape[0]
    out = np.empty(0 if part_only else d, np.float32)
    part = np.empty((numba.get_num_threads(), d), np.float32)
    rng = np.random.default_rng(seed + 1)
    calls = [call] if read is None else [call, read]
    for c in calls:
        c(x, positive[:8].astype(np.int64), out, part)  # compiled (or loaded from the cache)
    per_neuron = neuron_bytes(rows)
    m = len(calls)
    res = []
    for dens in densities:
        k = min(len(positive), max(1, int(dens * n)))
        draw = lambda w: np.sort(rng.choice(positive, k, replace=False)).astype(np.int64) + w * n  # noqa: E731
        for w in range(layers):  # one untimed pass, so each copy was last read `layers` calls ago
            calls[w % m](x, draw(w), out, part)
        times = [[] for _ in calls]
        for i in range(max(reps, layers // m)):
            for j, c in enumerate(calls):  # call j on copies j, j + m, ... in turn
                s = draw((i * m + j) % layers)
                t = time.perf_counter()
                c(x, s, out, part)
                times[j].append(time.perf_counter() - t)
        nbytes = k * per_neuron
        med = float(np.median(times[0]))
        res.append({"density": dens, "active_neurons": k, "bytes_per_call": nbytes, "calls": len(times[0]),
                    "median_s": med, "best_s": min(times[0]), "median_bytes_per_s": nbytes / med,
                    "best_bytes_per_s": nbytes / min(times[0])})
        if read is not None:  # the rows' bytes (no int8 scales) over the pure read's median time
            rb = k * row_bytes(rows)
            res[-1]["read_median_bytes_per_s"] = rb / float(np.median(times[1]))
    return res


def bench_dtype(dtype: str, d: int, n: int, total_bytes: float, densities: list[float], reps: int, seed: int,
                part_only: bool, ahead: int = PREFETCH_AHEAD, b: dict | None = None, with_read: bool = False) -> dict:
    """dtype: a cold-row dtype, "+xq" for the int route of a block dtype; b: build()'s rows of it to reuse."""
    base, xq = dtype.split("+")[0], dtype.endswith("+xq")
    if xq and not XQ_OK:
        raise SystemExit(f"{dtype}: this CPU lacks the int route's instructions (cold_q_ir.XQ_OK)")
    b = b or build(base, d, n, total_bytes, seed)
    call = lambda rows: kernel(rows, xq, ahead)  # noqa: E731
    in_cache = core_rate(b["one"], b["x"], b["positive"], call)
    rows = measure(b, call(b["rows"]), n, densities, reps, seed, part_only, reader(b["rows"]) if with_read else None)
    per_neuron = neuron_bytes(b["rows"])
    return {"dtype": dtype, "route": ("int" if xq else "float") if b["rows"].fmt else None,
            "prefetch_ahead": ahead if b["rows"].fmt else None, "layers": b["layers"],
            "row_bytes_total": int(b["layers"] * b["layer_bytes"]), "bytes_per_weight": per_neuron / (3 * d),
            "bytes_per_active_neuron": per_neuron, "build_s": b["build_s"],
            "one_core_in_cache_weights_per_s": in_cache,
            "one_core_in_cache_bytes_per_s": in_cache * per_neuron / (3 * d), "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="JSON results file")
    p.add_argument("--small", action="store_true", help="d 2048, 5632 neurons, ~1 GB of rows per dtype")
    p.add_argument("--d", type=int, default=8192, help="d_model (a multiple of 32)")
    p.add_argument("--n", type=int, default=28672, help="cold neurons per layer")
    p.add_argument("--total-gb", type=float, default=8.0, help="GB of rows per dtype (whole layer copies, >= 2)")
    p.add_argument("--dtypes", default=",".join(COLD_DTYPES + tuple(f"{t}+xq" for t in BLOCK_DTYPES if XQ_OK)),
                   help="comma-separated cold-row dtypes (block dtypes +xq: the int route)")
    p.add_argument("--ahead", type=int, default=PREFETCH_AHEAD, help="prefetch distance, groups of four neurons")
    p.add_argument("--densities", default="0.05,0.10,0.20", help="shares of the layer's neurons active per call")
    p.add_argument("--reps", type=int, default=21, help="timed calls per density (at least one per layer copy)")
    p.add_argument("--threads", type=int, default=None, help="Numba threads (default: all)")
    p.add_argument("--part-only", action="store_true", help="leave the sum in the per-thread rows (the GPU path)")
    p.add_argument("--ceiling-gb", type=float, default=2.0, help="GB read by the DRAM ceiling measurement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--with-read", action="store_true", help="time a pure read of the same rows in the kernel's pattern "
                   "(read_rows) in turn with the kernel: the pattern's own DRAM rate")
    a = p.parse_args()
    if a.small:
        a.d, a.n, a.total_gb, a.ceiling_gb = 2048, 5632, 1.0, 0.5
    if a.threads:
        numba.set_num_threads(a.threads)
    densities = [float(v) for v in a.densities.split(",")]
    ceiling_bytes = int(a.ceiling_gb * 1e9)
    before = dram_read_bw(ceiling_bytes)
    results, last = [], (None, None)
    for dtype in a.dtypes.split(","):
        base = dtype.split("+")[0]
        if last[0] != base:  # a block dtype's two routes read one build of its rows
            last = (base, build(base, a.d, a.n, a.total_gb * 1e9, a.seed))
        r = bench_dtype(dtype, a.d, a.n, a.total_gb * 1e9, densities, a.reps, a.seed, a.part_only, a.ahead, last[1],
                        a.with_read)
        results.append(r)
        print(dtype, " ".join(f"{x['density']:.0%}: {x['median_bytes_per_s'] / 1e9:.1f} GB/s" for x in r["rows"]),
              f"| one core in cache {r['one_core_in_cache_weights_per_s'] / 1e9:.1f} G weights/s", flush=True)
    after = dram_read_bw(ceiling_bytes)
    key = "numba_gather_16KiB_rows_4_at_once"
    gather = (before["variants_bytes_per_s"][key] + after["variants_bytes_per_s"][key]) / 2
    for r in results:
        for x in r["rows"]:
            x["share_of_gather_ceiling"] = x["median_bytes_per_s"] / gather
            if "read_median_bytes_per_s" in x:
                x["read_share_of_gather_ceiling"] = x["read_median_bytes_per_s"] / gather
                x["share_of_read"] = x["median_bytes_per_s"] / x["read_median_bytes_per_s"]
    doc = {"bench": "kernel_q", "d_model": a.d, "n_neurons": a.n, "activation": "reglu", "densities": densities,
           "threads": numba.get_num_threads(), "part_only": a.part_only, "small": a.small,
           "threading_layer": numba.threading_layer(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
           "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
           "cpu": _cpu_name(), "machine": platform.node(), "numba": numba.__version__,
           "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "ceiling": {"row_gather_bytes_per_s": gather, "before": before, "after": after},
           "results": results,
           "note": "random weights (std 0.02); active neurons drawn among those with a positive gate; median of the "
                   "timed calls; share = median rate / the row-gather ceiling (mean of before and after); "
                   "one_core_in_cache: one thread over ~4 MB of rows read again and again (the compute bound)"}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"row-gather ceiling {gather / 1e9:.1f} GB/s, {numba.get_num_threads()} threads")
    for r in results:
        print(r["dtype"], " ".join(f"{x['density']:.0%}: {x['share_of_gather_ceiling']:.2f}" for x in r["rows"]),
              *([f"| pure read {' '.join(str(round(x['read_share_of_gather_ceiling'], 2)) for x in r['rows'])}"]
                if "read_share_of_gather_ceiling" in r["rows"][0] else []))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor()


if __name__ == "__main__":
    main()
