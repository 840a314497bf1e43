"""Who should add the cold kernel's per-thread partial rows: the CPU (kernels.cold_ffn's second parallel region, its
result then read by the GPU over PCIe, 32 KiB at d 8192) or the GPU (reading all T partial rows over PCIe and summing
them in the graph that needs them)? Each repetition first has T Numba threads rewrite their own partial row, as the
kernel leaves them (dirty in each core's caches), then times (medians, us):

  cpu_sum      the CPU's sum of the T rows into one pinned row (a parallel region: fork, sum, join; host clock)
  gpu_one      a captured graph that adds the one pinned row to a device row (what `pre` reads now; CUDA events)
  gpu_rows     a captured graph that sums the T pinned rows and adds them to a device row (torch: a reduction kernel)

So the CPU saves cpu_sum a layer and the GPU pays gpu_rows - gpu_one. Writes OUT.json.
Usage: python bench/cold_sum_gpu.py OUT.json [--d 8192] [--reps 400]"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numba
import numpy as np
import torch
from numba import njit, prange

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from powerinfer.runtime import kernels as K  # noqa: E402
from powerinfer.runtime.cold_rows import host_mapped  # noqa: E402


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


def main(out: Path, d: int = 8192, reps: int = 400) -> dict:
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
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
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
            e0.record()
            graphs[name].replay()
            e1.record()
            e1.synchronize()
            times[name].append(1e3 * e0.elapsed_time(e1))
    ref = part.astype(np.float64).sum(0) + h.double().cpu().numpy()
    graphs["gpu_rows"].replay()
    err = float(np.abs(dst.double().cpu().numpy() - ref).max() / np.abs(ref).max())
    med = {k: float(np.median(v)) for k, v in times.items()}
    res = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(), "threads": T, "d": d,
           "reps": reps, "median_us": med, "p10_us": {k: float(np.percentile(v, 10)) for k, v in times.items()},
           "p90_us": {k: float(np.percentile(v, 90)) for k, v in times.items()},
           "gpu_rows_rel_err_vs_float64": err,
           "saved_us_a_layer": med["cpu_sum"] - (med["gpu_rows"] - med["gpu_one"])}
    print(json.dumps(res, indent=1))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--d", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=400)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cold_sum_gpu.py: needs CUDA (it times a GPU reading host rows)")
    main(a.out, a.d, a.reps)
