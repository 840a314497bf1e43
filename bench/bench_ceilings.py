"""Ceilings measured in the pi_bench run (DRAM read, PCIe both ways, HBM, small sync round trip), the CPU cold-row
kernel against DRAM bandwidth, and the per-token cost floor built from them."""

from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import torch
from hotneurons.kernels.dram import row_gather_bw
from hotneurons.kernels.intrinsics import _fetch_add
from numba import njit, prange

from bench import bench_model as bm


@njit(nogil=True, cache=True, fastmath=True, inline="always")
def _strip_sum(a, lo, hi):
    """Sum of a[lo:hi] with 8 independent accumulators (vectorised loads)."""
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
    k = lo
    while k + 8 <= hi:
        s0 += a[k]
        s1 += a[k + 1]
        s2 += a[k + 2]
        s3 += a[k + 3]
        s4 += a[k + 4]
        s5 += a[k + 5]
        s6 += a[k + 6]
        s7 += a[k + 7]
        k += 8
    while k < hi:
        s0 += a[k]
        k += 1
    return s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _sum_rows(a, chunks):
    """Sum of a (n,) float32 array: `chunks` parallel strips, one fixed strip per iteration."""
    n = a.shape[0]
    out = np.zeros(chunks, np.float32)
    for c in prange(chunks):
        out[c] = _strip_sum(a, c * n // chunks, (c + 1) * n // chunks)
    return out.sum()


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _sum_blocks(a, block, threads):
    """Sum of a (n,) float32 array, threads taking `block` elements at a time from an atomic counter (the cold
    kernel's work sharing: a fixed share per thread waits for the slowest one)."""
    n = a.shape[0]
    counter = np.zeros(1, np.int64)
    out = np.zeros(threads, np.float32)
    for t in prange(threads):
        s = np.float32(0.0)
        while True:
            lo = _fetch_add(counter, block)
            if lo >= n:
                break
            s += _strip_sum(a, lo, min(lo + block, n))
        out[t] = s
    return out.sum()


def _blocks_bw(a: np.ndarray, threads: int) -> float:
    """bytes/s of one `_sum_blocks` pass over `a` (256 KiB blocks)."""
    return a.nbytes / _timed(lambda: _sum_blocks(a, 65536, threads))


@functools.lru_cache(maxsize=1)
def _dram_array(nbytes: int) -> np.ndarray:
    return np.random.default_rng(0).random(nbytes // 4, dtype=np.float32)  # touches every page


def dram_read_bw(nbytes: int, repeats: int = 5) -> dict:
    """Best of: Numba parallel reductions (8 accumulators, vectorised; fixed strips per thread, 256 KiB blocks from a
    shared counter, or 16 KiB rows in random order 4 at once) and numpy sums, one thread per core. The array is kept
    for later calls."""
    threads = numba.get_num_threads()
    a = _dram_array(nbytes)
    _sum_rows(a[:1024], threads)  # compile
    _sum_blocks(a[:1024], 64, threads)
    res = {}
    for chunks in (threads, 4 * threads):
        best = min(_timed(lambda: _sum_rows(a, chunks)) for _ in range(repeats))
        res[f"numba_reduction_{chunks}_strips"] = a.nbytes / best
    # the cold kernel's pattern; strips of one thread each read less than it (a per-core ceiling: docs/history.md)
    res["numba_gather_16KiB_rows_4_at_once"] = row_gather_bw(a, threads, repeats)
    res["numba_reduction_256KiB_blocks_shared"] = max(_blocks_bw(a, threads) for _ in range(repeats))
    parts = np.array_split(a, threads)
    with ThreadPoolExecutor(threads) as pool:
        best = min(_timed(lambda: list(pool.map(np.sum, parts))) for _ in range(repeats))
    res["numpy_sum_per_thread"] = a.nbytes / best
    return {"bytes": int(a.nbytes), "threads": threads, "variants_bytes_per_s": res,
            "best_bytes_per_s": max(res.values()),
            "best": max(res, key=res.get)}


def dram_now(nbytes: int) -> float:
    """The DRAM read ceiling in bytes/s, read quickly (3 repeats) between timed runs: it drifts within minutes."""
    return dram_read_bw(nbytes, repeats=3)["best_bytes_per_s"]


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cuda_ceilings(nbytes: int = 256 * 2**20) -> dict:
    """PCIe H2D (hotneurons.common.hardware's measurement) and D2H, pinned; HBM device copy;
    small D2H+H2D round trip."""
    from hotneurons.kernels.measure import _measure_cuda

    m = _measure_cuda()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return {"pcie_h2d_bytes_per_s": m["pcie_bw"], "pcie_d2h_bytes_per_s": nbytes / best, "hbm_bytes_per_s": m["gpu_bw"],
            "sync_round_trip_s": m["sync_latency_s"], "vram_bytes": m["vram_bytes"]}


def zero_copy_read(dram_bytes: int, nbytes: int = 2**30, row_bytes: int = 16384, rows: int = 4096,
                   seconds: float = 0.5) -> dict:
    """The GPU reading page-locked host rows in place (the runtime's --pcie-share path: torch index_select of
    random `row_bytes` rows over PCIe, cold_rows.host_mapped), alone and while the CPU reads its own array as the cold
    kernel reads rows (`dram.row_gather_bw`, the fastest CPU pattern). `extra_bytes_per_s`: what the two read at
    once beyond the CPU alone, the bandwidth the PCIe path adds to the cold rows' floor."""
    from hotneurons.runtime.cold_rows import host_mapped

    a = np.random.default_rng(1).integers(0, 2**62, nbytes // 8, dtype=np.int64)  # touches every page
    t = host_mapped(a, a.reshape(-1, row_bytes // 8), torch.device("cuda"))  # (n_rows, row / 8) int64
    gen = torch.Generator(device="cuda").manual_seed(0)
    sets = [torch.randperm(t.shape[0], device="cuda", generator=gen)[:rows] for _ in range(8)]

    def gathers(reps: int):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for r in range(reps):
            t.index_select(0, sets[r % len(sets)])
        e1.record()
        return e0, e1

    gathers(8)[1].synchronize()  # the first reads of a mapping are slower (about half the rate)
    e0, e1 = gathers(8)
    e1.synchronize()
    alone = 8 * rows * row_bytes / (e0.elapsed_time(e1) / 1e3)
    reps = max(4, int(seconds * alone / (rows * row_bytes)))
    threads = numba.get_num_threads()
    d = _dram_array(dram_bytes)
    dram_alone = row_gather_bw(d, threads, 3)
    e0, e1 = gathers(reps)  # queued; the reductions run meanwhile
    during = []
    while not e1.query():
        during.append(row_gather_bw(d, threads))
    e1.synchronize()
    zc_during = reps * rows * row_bytes / (e0.elapsed_time(e1) / 1e3)
    dram_during = float(np.median(during)) if during else float("nan")
    return {"row_bytes": row_bytes, "rows_per_call": rows, "cpu_pattern": "row_gather",
            "zero_copy_alone_bytes_per_s": alone, "dram_alone_bytes_per_s": dram_alone,
            "zero_copy_during_dram_bytes_per_s": zc_during,
            "dram_during_zero_copy_bytes_per_s": dram_during, "reductions_during": len(during),
            "extra_bytes_per_s": max(0.0, zc_during + dram_during - dram_alone)}


def kernel_bench(d: int, n: int, densities=(0.05, 0.10, 0.20), reps: int = 5, seed: int = 0,
                 rows=None, activation: str = "reglu", dtype: str = "bf16", windows: int = 8,
                 gap_ms: float = 0.0) -> dict:
    """hotneurons.runtime.cold_rows.ffn_rows (a gated FFN) on one layer's cold rows at several row densities.

    rows: a layer's cold_rows.ColdRows (n, d); default fresh random ones stored as `dtype`. The active rows are drawn
    among neurons whose gate is positive for x (what a predictor marks active), so each reads its gate, up and down
    rows: bytes = 3 * (d * itemsize + 4 * groups) per active neuron (a row and its scales).

    As in decode, where the other layers' calls run between two calls of one layer, the rows are laid out `windows`
    times over (copies, as if of that many layers) and the timed calls take the windows in turn, each with a new set:
    between two calls on one window, windows - 1 calls read other rows (7 x 70 MB at 5% of a 70B layer, more than a
    large L3 holds), while the kernel's code and small buffers stay cached as they do in decode. (Reading 2 GiB of
    other memory before each call instead also evicts those, which decode does not.)

    gap_ms: the main thread spins this long before each timed call (untimed), as it waits for `pre` in decode."""
    from hotneurons.runtime.cold_rows import ColdRows, ffn_rows

    g = torch.Generator().manual_seed(seed)
    if rows is None:
        w = lambda: torch.randn(n, d, generator=g) * 0.02  # noqa: E731
        rows = ColdRows.from_weights(w(), w(), None, w(), dtype)
    x = torch.randn(d, generator=g).numpy().astype(np.float32)
    positive = np.flatnonzero(rows.float32()["gate"].numpy() @ x > 0)
    n = rows.up.shape[0]
    tile = lambda a: None if a is None else np.tile(a, (windows,) + (1,) * (a.ndim - 1))  # noqa: E731
    laid = ColdRows(tile(rows.gate), tile(rows.up), tile(rows.down_t), tile(rows.b_up),
                    np.tile(rows.scale, (1, windows, 1)), rows.group)  # (windows * n, d) rows
    out = np.zeros(d, np.float32)
    part = np.empty((numba.get_num_threads(), d), np.float32)
    rng = np.random.default_rng(seed)
    res = []
    for dens in densities:
        k = min(len(positive), max(1, int(dens * n)))
        call = lambda s: ffn_rows(activation, x, s, laid, out, part)  # noqa: E731
        s0 = np.sort(rng.choice(positive, k, replace=False)).astype(np.int64)
        call(s0)
        first = out.copy()
        for w in range(windows):  # one pass over the windows before the timed ones; the last the first set again
            call(s0 + w * n if w == windows - 1 else np.sort(rng.choice(positive, k, replace=False)) + w * n)
        if not np.allclose(out, first, rtol=1e-4, atol=1e-4 * np.abs(first).max()):  # copies: the same sum
            raise AssertionError(f"kernel_bench: window {windows - 1} gave another sum than window 0")
        times = []
        for i in range(max(reps, windows)):
            s = np.sort(rng.choice(positive, k, replace=False)).astype(np.int64) + (i % windows) * n
            _spin(gap_ms / 1e3)
            times.append(_timed(functools.partial(call, s)))
        nbytes = k * 3 * (d * rows.up.itemsize + rows.scale.shape[2] * 4)
        res.append({"density": dens, "active_rows": k, "bytes": nbytes, "best_s": min(times),
                    "median_s": float(np.median(times)), "bytes_per_s": nbytes / min(times),
                    "median_bytes_per_s": nbytes / float(np.median(times))})
    return {"d_model": d, "n_neurons": n, "threads": numba.get_num_threads(), "activation": activation,
            "dtype": rows.dtype, "windows": windows, "gap_ms": gap_ms, "rows": res}


def floor(layers: list[dict], hbm_bw: float, dram_bw: float, sync_s: float, outside_gpu_bytes: int = 0) -> dict:
    """Per token: sum over layers of max(gpu_bytes / HBM bw, active cold bytes / DRAM bw) + a sync for each layer with
    active cold bytes, plus the GPU reads outside the layers (LM head, final norm).

    The serial floor keeps the order a decoder layer imposes: its FFN input needs its attention (and the predictor
    its mask), so those `serial_gpu_bytes` are read before the CPU can start; only the rest of the GPU's bytes (the
    hot rows) overlap the cold ones: serial_gpu_bytes / HBM + max(rest / HBM, cold / DRAM) + sync.

    layers: [{"gpu_bytes": bytes read on the GPU per token, "cold_bytes": active cold bytes read per token,
              "serial_gpu_bytes" (optional, default 0): the part of gpu_bytes read before the FFN}]"""
    per, serial = [], []
    for row in layers:
        g, c = row["gpu_bytes"] / hbm_bw, row["cold_bytes"] / dram_bw
        s = row.get("serial_gpu_bytes", 0) / hbm_bw
        sync = sync_s if row["cold_bytes"] > 0 else 0.0
        per.append(max(g, c) + sync)
        serial.append(s + max(g - s, c) + sync)
    total = sum(per) + outside_gpu_bytes / hbm_bw
    total_serial = sum(serial) + outside_gpu_bytes / hbm_bw
    return {"seconds_per_token": total, "tokens_per_s": 1 / total if total > 0 else float("inf"),
            "per_layer_s": per, "gpu_bound_layers": sum(r["gpu_bytes"] / hbm_bw >= r["cold_bytes"] / dram_bw
                                                        for r in layers),
            "serial_seconds_per_token": total_serial,
            "serial_tokens_per_s": 1 / total_serial if total_serial > 0 else float("inf")}


def floor_from_hybrid(hybrid: dict, c: dict, shape: str, layers: int, pred_bytes: int,
                      dram: float | None = None, pcie: bool = True) -> dict:
    """The floor for the hybrid run's configuration, from its actual per-layer active cold neurons and the bytes its
    cold rows take (pi-solve's COLD_BYTES: bf16, or int8 + a float32 scale per 64 weights); `dram` replaces the run's
    DRAM ceiling. Where the run had the GPU read some cold rows over PCIe (pcie_share > 0) and `pcie`, the cold rows
    are read at the DRAM ceiling plus what PCIe adds to it (ceilings' zero_copy extra_bytes_per_s)."""
    from hotneurons.solver.cost import COLD_BYTES

    d, n, heads, kv, vocab = bm.SHAPES[shape]
    mb = bm.model_bytes(shape, layers)
    per_neuron = 3 * d * 2  # gate, up, down rows in fp16 on the GPU
    per_cold = 3 * d * COLD_BYTES[hybrid.get("cold_dtype", "bf16")]  # bytes per active cold neuron
    rows = []
    for r in hybrid["per_layer_counts"]:
        tok = max(r["tokens"], 1)
        before_ffn = mb["attention_per_layer"] + 4 * d + pred_bytes / layers  # attention, norms, predictor
        rows.append({"gpu_bytes": before_ffn + r["n_hot"] * per_neuron, "serial_gpu_bytes": before_ffn,
                     "cold_bytes": r["active_cold"] / tok * per_cold})
    hbm = c.get("hbm_bytes_per_s", c["dram"]["best_bytes_per_s"])
    sync = c.get("sync_round_trip_s", 0.0)
    dram = dram or c["dram"]["best_bytes_per_s"]
    extra = (c.get("zero_copy") or {}).get("extra_bytes_per_s", 0.0) if pcie and hybrid.get("pcie_share") else 0.0
    f = floor(rows, hbm, dram + extra, sync, outside_gpu_bytes=vocab * d * 2 + d * 2)
    return {**f, "inputs": {"hbm_bytes_per_s": hbm, "dram_bytes_per_s": dram, "pcie_extra_bytes_per_s": extra,
                            "sync_s": sync,
                            "layers": rows, "lm_head_bytes": vocab * d * 2,
                            "note": "GPU bytes: attention + norms + hot FFN rows + predictor per layer "
                             "(serial: all but the hot rows); "
                                    "LM head once"}}


def floor_bound(hybrid: dict, c: dict, shape: str, layers: int, pred_bytes: int, kernel_rows: list[dict],
                floor_tps: float, goal: float = 0.70) -> dict:
    """What the floor's goal asks of the cold kernel, and where a runtime with the measured one stands at best.

    `serial_tokens_per_s`: the serial floor (each layer's attention and predictor before its FFN, as the layer order
    requires) with the cold rows read at the cold kernel's own rate at its sparsest measured density (plus what PCIe
    adds where the run used it), the GPU at the HBM ceiling and one sync round trip a layer, nothing else lost: each
    part at the best rate measured for it in the run. The kernel's rate is its benchmark's, whole calls (its threads'
    start and the partial rows' sum included, as in decode). Decode marks fewer rows than that density (~4% of a 70B
    layer's cold neurons against 5%), where the kernel is slower, so the bound is generous. `kernel_share_needed`:
    the cold rows' read rate, as a share of the DRAM ceiling, at which the serial floor alone (nothing else lost)
    reaches `goal` of the floor; above 1 no runtime that keeps the layer order can."""
    sparsest = min(kernel_rows, key=lambda r: r["density"])
    dram = c["dram"]["best_bytes_per_s"]

    def serial_at(rate: float) -> float:
        return floor_from_hybrid(hybrid, c, shape, layers, pred_bytes, rate)["serial_tokens_per_s"]

    lo, hi = 1e6, 8 * dram  # serial_at rises with the rate: bisect for goal * floor
    if serial_at(hi) < goal * floor_tps:
        needed = float("inf")
    else:
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if serial_at(mid) < goal * floor_tps else (lo, mid)
        needed = hi / dram
    bound = serial_at(sparsest["bytes_per_s"])
    return {"kernel_density": sparsest["density"], "kernel_bytes_per_s": sparsest["bytes_per_s"],
            "kernel_share_of_dram": sparsest["bytes_per_s"] / dram, "serial_tokens_per_s": bound,
            "share_of_floor": bound / floor_tps, "goal": goal, "kernel_share_needed": needed,
            "note": "serial floor with the cold rows at the cold kernel's rate at its sparsest measured density (+ "
                    "what PCIe adds), the GPU at the HBM ceiling, nothing else lost; kernel_share_needed: the cold "
                    "rows' rate (share of the DRAM ceiling) at which the serial floor reaches goal x the floor"}


def add_floors(res: dict, c: dict, shape: str, layers: int, pred_bytes: int) -> None:
    """The kernel rows' shares of the DRAM ceiling and the floors of hybrid and hybrid-int8 (res["systems"]), into res.

    A ceiling below what the cold kernel itself read in the same run is no ceiling (the row gather can read less than
    the kernel on some machines): the DRAM ceiling is then the kernel's best rate, here and in the floors from the
    ceiling measured around each generation, so that a low reading of the gather cannot lift a share over a goal."""
    systems = res["systems"]
    kernel_best = max((r["bytes_per_s"] for key in ("kernel", "kernel_int8") for r in res.get(key, {}).get("rows", [])),
                      default=0.0)
    gather = c["dram"]["best_bytes_per_s"]
    if kernel_best > gather:
        c["dram"].update(best_bytes_per_s=kernel_best, read_kernels_best_bytes_per_s=gather,
                         best=f"the cold kernel's best rate; the read kernels' best was {gather / 1e9:.1f} GB/s")
    for key in ("kernel", "kernel_int8"):
        for r in res.get(key, {}).get("rows", []):
            r["share_of_dram_bw"] = r["bytes_per_s"] / c["dram"]["best_bytes_per_s"]
    for key, name in (("floor", "hybrid"), ("floor_int8", "hybrid-int8")):
        if name in systems and "error" not in systems[name]:
            res[key] = floor_from_hybrid(systems[name], c, shape, layers, pred_bytes)
            res[key + "_dram_only"] = floor_from_hybrid(systems[name], c, shape, layers, pred_bytes, pcie=False)
            kern = res.get("kernel" if name == "hybrid" else "kernel_int8", {}).get("rows")
            if kern:
                res[key + "_bound"] = floor_bound(systems[name], c, shape, layers, pred_bytes, kern,
                                                  res[key]["tokens_per_s"])
            around = systems[name].get("dram_around_bytes_per_s")
            if around:  # the same floor with the DRAM ceiling measured around this system's timed generations
                res[key + "_around_run"] = floor_from_hybrid(systems[name], c, shape, layers, pred_bytes,
                                                             max(kernel_best, (around["before"] + around["after"]) / 2))
                floors = [floor_from_hybrid(systems[name], c, shape, layers, pred_bytes, max(kernel_best, d))
                          ["tokens_per_s"] for d in around.get("per_rep", [])]
                shares = [r / f for r, f in zip(systems[name]["decode_tokens_per_s_reps"], floors)]
                if shares:
                    res[key + "_per_rep"] = {"dram_bytes_per_s": around["per_rep"], "floor_tokens_per_s": floors,
                                             "share": shares, "median_share": float(np.median(shares)),
                                             "note": "each timed generation against the floor from the DRAM ceiling "
                                                     "measured just before and after it (mean of the two; at least "
                                                     "the cold kernel's best rate), plus what PCIe adds where the run "
                                                     "used it"}
