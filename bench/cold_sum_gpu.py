"""Who should add the cold kernel's per-thread partial rows: the CPU (kernels.cold_ffn's second parallel region, its
result then read by the GPU over PCIe, 32 KiB at d 8192) or the GPU (reading all T partial rows over PCIe and summing
them in the graph that needs them)? Each repetition first has T Numba threads rewrite their own partial row, as the
kernel leaves them (dirty in each core's caches), then times (medians, us):

  cpu_sum      the CPU's sum of the T rows into one pinned row (a parallel region: fork, sum, join; host clock)
  gpu_one      a captured graph that adds the one pinned row to a device row (what `pre` reads now; CUDA events)
  gpu_rows     a captured graph that sums the T pinned rows and adds them to a device row (torch: a reduction kernel)

So the CPU saves cpu_sum a layer and the GPU pays gpu_rows - gpu_one. Writes OUT.json.

--cpu-load also times the two graphs (rows left clean) with the CPU idle and then with threads-1 Numba threads
streaming DRAM (one load per 64-byte line of 2 GiB, `_stream`, from a background thread) meanwhile, and a graph that
writes one row to the host (gpu_write_row, as `pre` ends by writing x): how much the GPU's PCIe reads and writes of
host memory slow down while the CPU reads DRAM, as it would if it read rows ahead during `pre` (bench/NOTES.md).
Usage: python bench/cold_sum_gpu.py OUT.json [--d 8192] [--reps 400] [--cpu-load]"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import numba
import numpy as np
import torch
from numba import njit, prange

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hotneurons.runtime import kernels as K  # noqa: E402
from hotneurons.runtime.cold_rows import host_mapped  # noqa: E402


@njit(parallel=True, nogil=True, fastmath=True)
def _dirty(part, v):  # each thread rewrites its own row, as the kernel's claims leave them
    for t in prange(part.shape[0]):
        row = part[t]
        for k in range(row.shape[0]):
            row[k] = row[k] * np.float32(0.5) + v


@njit(parallel=True, nogil=True, fastmath=True)
def _cpu_sum(part, out):  # kernels.cold_ffn's second region
    T, d = part.shape
    for c in prange(T):
        K._sum_rows(part, T, out, c * d // T, (c + 1) * d // T)


@njit(parallel=True, nogil=True)
def _stream(buf, stop, sink):  # each of buf's rows on its own thread: one load a 64-byte line, again, until stop[0]
    for t in prange(buf.shape[0]):
        s = 0
        while K._load_acquire(stop, 0) == 0:
            for e in range(0, buf.shape[1], 32):
                s += buf[t, e]
        sink[t] = s


def _timed(graph, reps: int) -> list[float]:
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps):
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        out.append(1e3 * e0.elapsed_time(e1))
    return out


def under_load(graphs: dict, reps: int, T: int) -> dict:
    """Median us of each graph with the CPU idle, then with T - 1 threads streaming 2 GiB of DRAM meanwhile."""
    buf = np.ones((max(1, T - 1), (1 << 30) // max(1, T - 1)), np.uint16)  # 2 GiB, a row a thread
    stop, sink = np.zeros(1, np.int32), np.zeros(buf.shape[0], np.int64)
    _stream(buf[:, :64], np.ones(1, np.int32), sink)  # compiled before the timings
    res = {"idle": {k: float(np.median(_timed(g, reps))) for k, g in graphs.items()}}
    th = threading.Thread(target=_stream, args=(buf, stop, sink))
    th.start()
    time.sleep(0.2)  # the threads are streaming
    try:
        res["cpu_streaming"] = {k: float(np.median(_timed(g, reps))) for k, g in graphs.items()}
    finally:
        stop[0] = 1
        th.join()
    res["stream_threads"] = buf.shape[0]
    return res


def main(out: Path, d: int = 8192, reps: int = 400, cpu_load: bool = False) -> dict:
    dev = torch.device("cuda")
    T = numba.get_num_threads()
    part_t = torch.zeros((T, d), dtype=torch.float32, pin_memory=True)  # (T, d) partial rows, page-locked
    one_t = torch.zeros(d, dtype=torch.float32, pin_memory=True)  # (d,) their sum
    part, one = part_t.numpy(), one_t.numpy()
    part_m, one_m = host_mapped(part, part, dev, register=False), host_mapped(one, one, dev, register=False)
    h = torch.randn(d, device=dev, dtype=torch.float16)
    dst = torch.empty(d, device=dev, dtype=torch.float16)
    graphs = {}
    for name, fn in (("gpu_one", lambda: torch.add(h, one_m, out=dst)),
                     ("gpu_rows", lambda: torch.add(h, part_m.sum(0), out=dst))):
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        graphs[name] = g
    times: dict[str, list[float]] = {"cpu_sum": [], "gpu_one": [], "gpu_rows": []}
    _dirty(part, np.float32(1.0))
    _cpu_sum(part, one)
    for r in range(reps):
        for name in times:  # in turn, each after a fresh rewrite of the rows
            _dirty(part, np.float32(r % 7))
            if name == "cpu_sum":
                t0 = time.perf_counter()
                _cpu_sum(part, one)
                times[name].append(1e6 * (time.perf_counter() - t0))
                continue
            times[name] += _timed(graphs[name], 1)
    ref = part.astype(np.float64).sum(0) + h.double().cpu().numpy()
    graphs["gpu_rows"].replay()
    err = float(np.abs(dst.double().cpu().numpy() - ref).max() / np.abs(ref).max())
    med = {k: float(np.median(v)) for k, v in times.items()}
    res = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(), "threads": T, "d": d,
           "reps": reps, "median_us": med, "p10_us": {k: float(np.percentile(v, 10)) for k, v in times.items()},
           "p90_us": {k: float(np.percentile(v, 90)) for k, v in times.items()},
           "gpu_rows_rel_err_vs_float64": err,
           "saved_us_a_layer": med["cpu_sum"] - (med["gpu_rows"] - med["gpu_one"])}
    if cpu_load:  # and a graph writing a row to the host, as `pre` ends by writing x there
        g = torch.cuda.CUDAGraph()
        one_m.copy_(h)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            one_m.copy_(h)
        res["under_cpu_load_median_us"] = under_load({**graphs, "gpu_write_row": g}, reps, T)
    print(json.dumps(res, indent=1))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--d", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--cpu-load", action="store_true", help="also time the graphs while the CPU streams DRAM")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cold_sum_gpu.py: needs CUDA (it times a GPU reading host rows)")
    main(a.out, a.d, a.reps, a.cpu_load)
