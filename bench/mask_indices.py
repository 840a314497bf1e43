"""The cold mask -> active indices step of HybridFFN.cold_rows, alone: np.flatnonzero against kernels.mask_indices,
on a plain numpy mask and on a pinned one (as decode's, which the GPU writes), with Numba's OpenMP threads spinning
(a parallel call just before, as in decode) or asleep; mask_indices serial and with the words in slices, one per
thread (mask_indices_sliced, the runtime's on CUDA). In decode on the H100 host np.flatnonzero took ~70 us a layer, the same on a
second call over the same (cached) mask; the serial mask_indices ~40 (bench_timeline's
decode_mask_indices_ms_per_step, before the scan moved into kernels.cold_layer).

Usage: python bench/mask_indices.py OUT.json [--n 27200] [--density 0.06]"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pi_bench  # noqa: E402,F401  (powerinfer.* from this checkout; the OpenMP policy unless set)

import numba  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from numba import njit, prange  # noqa: E402

from powerinfer.runtime.kernels import mask_indices, mask_indices_sliced, mask_words  # noqa: E402


@njit(parallel=True, nogil=True)
def _touch(a):  # a parallel region, after which the OpenMP threads spin (ACTIVE) until the next one
    for t in prange(a.shape[0]):
        a[t] += 1.0


def main(out: Path, n: int, density: float, reps: int = 200) -> dict:
    rng = np.random.default_rng(0)
    pin = torch.cuda.is_available()
    plain = rng.random(n) < density
    pinned = torch.from_numpy(plain.copy()).pin_memory() if pin else torch.from_numpy(plain.copy())
    masks = {"plain": plain, "pinned" if pin else "plain-again": pinned.numpy()}
    idx = np.empty(n, np.int64)
    scratch = np.zeros(64, np.float64)
    _touch(scratch)
    slices = np.empty(numba.get_num_threads(), np.int64)
    ways = {"np.flatnonzero": lambda m, w: np.flatnonzero(m),
            "mask_indices": lambda m, w: mask_indices(m, w, idx),
            "mask_indices_sliced": lambda m, w: mask_indices_sliced(m, w, idx, slices)}  # the runtime's on CUDA
    res = {"command": "python " + " ".join(sys.argv), "cores": os.cpu_count(), "n": n, "density": density,
           "numpy": np.__version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "us": {}}
    for mname, m in masks.items():
        w = mask_words(m)
        assert np.array_equal(idx[:mask_indices(m, w, idx)], np.flatnonzero(m))
        assert np.array_equal(idx[:mask_indices_sliced(m, w, idx, slices)], np.flatnonzero(m))
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
