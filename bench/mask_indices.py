"""The cold mask -> active indices step of HybridFFN.cold_rows, alone: np.flatnonzero over a bool mask against
kernels.bit_indices over the same mask packed as bits (the host mask the GPU writes: one bit a cold neuron, a serial
count-trailing-zeros scan), each on a plain numpy buffer and on a pinned one (as decode's, which the GPU writes), with
Numba's OpenMP threads spinning (a parallel call just before, as in decode) or asleep. In decode on the H100 host
np.flatnonzero took ~70 us a layer, the same on a second call over the same (cached) mask; the byte-mask scans that
bit_indices replaced: serial (kernels.mask_indices, eight entries a test) ~40, one slice of the mask per thread
(mask_indices_sliced, a parallel region) 13-16 (bench_timeline, bench/NOTES.md).

Usage: python bench/mask_indices.py OUT.json [--n 27200] [--density 0.06]"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numba  # noqa: E402
import numpy as np  # noqa: E402
import pi_bench  # noqa: E402,F401  (powerinfer.* from this checkout; the OpenMP policy unless set)
import torch  # noqa: E402
from hotneurons.runtime.kernels import bit_indices, pack_mask  # noqa: E402
from numba import njit, prange  # noqa: E402


@njit(parallel=True, nogil=True)
def _touch(a):  # a parallel region, after which the OpenMP threads spin (ACTIVE) until the next one
    for t in prange(a.shape[0]):
        a[t] += 1.0


def main(out: Path, n: int, density: float, reps: int = 200) -> dict:
    rng = np.random.default_rng(0)
    pin = torch.cuda.is_available()
    plain = rng.random(n) < density  # (n,) bool
    bits = pack_mask(plain)  # (ceil(n / 64) * 8,) uint8, as the GPU writes the host mask

    def buffers(a: np.ndarray) -> dict[str, np.ndarray]:  # a plain copy and a pinned one (CUDA; else another plain)
        t = torch.from_numpy(a.copy())
        return {"plain": a, "pinned" if pin else "plain-again": (t.pin_memory() if pin else t).numpy()}

    masks, packed = buffers(plain), buffers(bits)
    idx = np.empty(n, np.int64)
    scratch = np.zeros(64, np.float64)
    _touch(scratch)
    ways = {"np.flatnonzero": lambda m, b: np.flatnonzero(m),
            "bit_indices": lambda m, b: bit_indices(b, n, idx)}  # the runtime's (kernels.cold_layer)
    res = {"command": "python " + " ".join(sys.argv), "cores": os.cpu_count(), "n": n, "density": density,
           "threads": numba.get_num_threads(), "numpy": np.__version__,
           "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "us": {}}
    for mname, m in masks.items():
        w = packed[mname].view(np.uint64)  # (ceil(n / 64),) bit_indices' words
        assert np.array_equal(idx[:bit_indices(w, n, idx)], np.flatnonzero(m))
        for wname, fn in ways.items():
            for threads in ("spinning", "asleep"):
                us = []
                for r in range(reps if threads == "spinning" else 5):
                    if threads == "spinning":
                        _touch(scratch)
                    else:
                        time.sleep(1.0)  # past GOMP_SPINCOUNT's spin: the threads sleep
                    t = time.perf_counter()
                    fn(m, w)
                    us.append(1e6 * (time.perf_counter() - t))
                key = f"{wname} {mname} threads {threads}"
                res["us"][key] = {"median": float(np.median(us)), "min": float(np.min(us))}
                print(key, round(float(np.median(us)), 1), flush=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1))
    tmp.replace(out)
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--n", type=int, default=27200, help="cold neurons (the 70B shape's ~28672 less the hot ones)")
    ap.add_argument("--density", type=float, default=0.06)
    a = ap.parse_args()
    main(a.out, a.n, a.density)
