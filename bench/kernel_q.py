"""The cold-row kernel's effective bandwidth per cold-row dtype (bf16, int8, q8_0, q4_0) beside the DRAM row-gather
ceiling: bytes of the rows a call reads / its time, and that as a fraction of the ceiling.

One big layer's cold rows (default d 8192, 28672 neurons: LLaMA-2-70B's FFN) from random weights (std 0.02), stored
in each dtype by cold_rows.ColdRows.from_weights (q8_0 / q4_0: llama.cpp's rounding), then laid out as many times as
it takes to fill --total-gb (copies, as if of that many layers), so that the rows a call reads were last read
several calls ago and come from DRAM, not the L3. Each timed call takes the next layer copy and a fresh set of active
neurons, drawn among those whose gate is positive for x (what a predictor marks: each reads its gate, up and down
rows; the FFN is ReGLU). Beside it, one core's rate with its rows in the cache (what bounds a core that DRAM
feeds faster). Bytes per active neuron: its three rows with their scales (bf16 2, int8 1 + 4/64, q8_0
34/32, q4_0 18/32 bytes a weight). The ceiling (bench_ceilings.dram_read_bw: 16 KiB rows gathered in random order,
four at once per thread, the cold kernel's read pattern) is measured before and after the kernels and averaged.

  python bench/kernel_q.py --out results.json            # the full size (~8 GB of rows per dtype, 16 cores)
  python bench/kernel_q.py --small --out small.json      # a quick run (d 2048, ~1 GB per dtype)
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time

import numba
import numpy as np
import torch
from hotneurons.bench.bench_ceilings import dram_read_bw
from hotneurons.runtime.cold_rows import COLD_DTYPES, ColdRows, from_bf16_bits, from_int8_groups
from hotneurons.runtime.kernels import ffn_rows
from hotneurons.runtime.kernels_q import gemv_q


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


def layer_rows(d: int, n: int, dtype: str, seed: int) -> ColdRows:
    """One layer's gated cold rows (n, d) from random weights, stored as `dtype`."""
    g = torch.Generator().manual_seed(seed)
    w = [torch.randn(n, d, generator=g) * 0.02 for _ in range(3)]  # gate, up, down_t
    return ColdRows.from_weights(w[0], w[1], None, w[2], dtype)


def laid_out(rows: ColdRows, layers: int) -> ColdRows:
    """`layers` copies of a layer's rows, one after another: (layers * n, row) arrays."""
    tile = lambda a: np.tile(a, (layers,) + (1,) * (a.ndim - 1))  # noqa: E731
    return ColdRows(tile(rows.gate), tile(rows.up), tile(rows.down_t), tile(rows.b_up),
                    np.tile(rows.scale, (1, layers, 1)), rows.group, rows.fmt)


def neuron_bytes(rows: ColdRows) -> int:
    """Bytes a call reads per active neuron: its gate, up and down rows with their scales."""
    return 3 * (rows.up.shape[1] * rows.up.itemsize + rows.scale.shape[2] * 4)


def core_rate(one: ColdRows, x: np.ndarray, positive: np.ndarray, nbytes: float = 4e6, reps: int = 7) -> float:
    """Weights per second one core computes with its rows in the cache (~nbytes of a layer's first neurons, read over
    and over): what bounds a core where DRAM feeds it faster (a part of one row: only one thread takes work)."""
    m = max(8, int(nbytes / neuron_bytes(one)))
    rows = ColdRows(None if one.gate is None else one.gate[:m], one.up[:m], one.down_t[:m], one.b_up[:m],
                    one.scale[:, :m], one.group, one.fmt)
    idx = positive[positive < m].astype(np.int64)
    d = x.shape[0]
    out, part = np.empty(d, np.float32), np.empty((1, d), np.float32)
    ffn_rows("reglu", x, idx, rows, out, part)
    best = min(_timed(lambda: ffn_rows("reglu", x, idx, rows, out, part)) for _ in range(reps))
    return len(idx) * 3 * d / best


def _timed(fn) -> float:
    t = time.perf_counter()
    for _ in range(10):
        fn()
    return (time.perf_counter() - t) / 10


def bench_dtype(dtype: str, d: int, n: int, total_bytes: float, densities: list[float], reps: int, seed: int,
                part_only: bool) -> dict:
    t0 = time.perf_counter()
    one = layer_rows(d, n, dtype, seed)
    layer_bytes = sum(a.nbytes for a in (one.gate, one.up, one.down_t))
    layers = max(2, math.ceil(total_bytes / layer_bytes))
    x = np.random.default_rng(seed).standard_normal(d).astype(np.float32)
    positive = np.flatnonzero(gate_values(one, x) > 0)
    in_cache = core_rate(one, x, positive)
    rows = laid_out(one, layers)
    del one
    built = time.perf_counter() - t0
    out = np.empty(0 if part_only else d, np.float32)
    part = np.empty((numba.get_num_threads(), d), np.float32)
    rng = np.random.default_rng(seed + 1)
    ffn_rows("reglu", x, positive[:8].astype(np.int64), rows, out, part)  # compiled (or loaded from the cache)
    per_neuron = neuron_bytes(rows)
    res = []
    for dens in densities:
        k = min(len(positive), max(1, int(dens * n)))
        draw = lambda w: np.sort(rng.choice(positive, k, replace=False)).astype(np.int64) + w * n  # noqa: E731
        for w in range(layers):  # one untimed pass, so each copy was last read `layers` calls ago
            ffn_rows("reglu", x, draw(w), rows, out, part)
        times = []
        for i in range(max(reps, layers)):
            s = draw(i % layers)
            t = time.perf_counter()
            ffn_rows("reglu", x, s, rows, out, part)
            times.append(time.perf_counter() - t)
        nbytes = k * per_neuron
        med = float(np.median(times))
        res.append({"density": dens, "active_neurons": k, "bytes_per_call": nbytes, "calls": len(times),
                    "median_s": med, "best_s": min(times), "median_bytes_per_s": nbytes / med,
                    "best_bytes_per_s": nbytes / min(times)})
    return {"dtype": dtype, "layers": layers, "row_bytes_total": int(layers * layer_bytes),
            "bytes_per_weight": per_neuron / (3 * d), "bytes_per_active_neuron": per_neuron,
            "build_s": built, "one_core_in_cache_weights_per_s": in_cache,
            "one_core_in_cache_bytes_per_s": in_cache * per_neuron / (3 * d), "rows": res}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="JSON results file")
    p.add_argument("--small", action="store_true", help="d 2048, 5632 neurons, ~1 GB of rows per dtype")
    p.add_argument("--d", type=int, default=8192, help="d_model (a multiple of 32)")
    p.add_argument("--n", type=int, default=28672, help="cold neurons per layer")
    p.add_argument("--total-gb", type=float, default=8.0, help="GB of rows per dtype (whole layer copies, >= 2)")
    p.add_argument("--dtypes", default=",".join(COLD_DTYPES), help="comma-separated cold-row dtypes")
    p.add_argument("--densities", default="0.05,0.10,0.20", help="shares of the layer's neurons active per call")
    p.add_argument("--reps", type=int, default=21, help="timed calls per density (at least one per layer copy)")
    p.add_argument("--threads", type=int, default=None, help="Numba threads (default: all)")
    p.add_argument("--part-only", action="store_true", help="leave the sum in the per-thread rows (the GPU path)")
    p.add_argument("--ceiling-gb", type=float, default=2.0, help="GB read by the DRAM ceiling measurement")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.small:
        a.d, a.n, a.total_gb, a.ceiling_gb = 2048, 5632, 1.0, 0.5
    if a.threads:
        numba.set_num_threads(a.threads)
    densities = [float(v) for v in a.densities.split(",")]
    ceiling_bytes = int(a.ceiling_gb * 1e9)
    before = dram_read_bw(ceiling_bytes)
    results = []
    for dtype in a.dtypes.split(","):
        r = bench_dtype(dtype, a.d, a.n, a.total_gb * 1e9, densities, a.reps, a.seed, a.part_only)
        results.append(r)
        print(dtype, " ".join(f"{x['density']:.0%}: {x['median_bytes_per_s'] / 1e9:.1f} GB/s" for x in r["rows"]),
              f"| one core in cache {r['one_core_in_cache_weights_per_s'] / 1e9:.1f} G weights/s", flush=True)
    after = dram_read_bw(ceiling_bytes)
    key = "numba_gather_16KiB_rows_4_at_once"
    gather = (before["variants_bytes_per_s"][key] + after["variants_bytes_per_s"][key]) / 2
    for r in results:
        for x in r["rows"]:
            x["share_of_gather_ceiling"] = x["median_bytes_per_s"] / gather
    doc = {"bench": "kernel_q", "d_model": a.d, "n_neurons": a.n, "activation": "reglu", "densities": densities,
           "threads": numba.get_num_threads(), "part_only": a.part_only, "small": a.small,
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
        print(r["dtype"], " ".join(f"{x['density']:.0%}: {x['share_of_gather_ceiling']:.2f}" for x in r["rows"]))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor()


if __name__ == "__main__":
    main()
