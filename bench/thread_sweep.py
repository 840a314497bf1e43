"""How many cores fill DRAM: the row-gather ceiling and the cold kernel (ReGLU, bf16 rows, as decode runs it:
bench_ceilings.kernel_bench with 8 copies of the layer taken in turn) at several Numba thread counts, on one
LLaMA-2-70B-shaped layer (d 8192, 28672 neurons). If fewer threads than cores read as fast, decode can leave cores
to the CUDA driver and the main thread's launches.

Usage: python bench/thread_sweep.py OUT.json [--threads 8,12,14,15,16] [--densities 0.05,0.065,0.2]"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_ceilings as ceil  # noqa: E402
import numba  # noqa: E402
import pi_bench  # noqa: E402,F401  (imports powerinfer.* from this checkout)
from hotneurons.runtime.dram import row_gather_bw  # noqa: E402


def main(out: Path, threads: list[int], densities: tuple[float, ...], d: int = 8192, n: int = 28672) -> dict:
    import torch
    from hotneurons.runtime.cold_rows import ColdRows

    a = ceil._dram_array(2 * 2**30)
    g = torch.Generator().manual_seed(0)
    w = lambda: torch.randn(n, d, generator=g) * 0.02  # noqa: E731
    layer = ColdRows.from_weights(w(), w(), None, w(), "bf16")  # one layer's rows, shared by every kernel_bench
    rows = []
    for rnd in range(2):  # two passes over the thread counts: the VMs' bandwidth drifts within minutes
        for t in threads:
            numba.set_num_threads(t)
            gather = row_gather_bw(a, t, repeats=3)  # bytes/s
            k = ceil.kernel_bench(d, n, densities, reps=8, seed=rnd, rows=layer)
            rows.append({"pass": rnd, "threads": t, "row_gather_bytes_per_s": gather,
                         "kernel": [{key: r[key] for key in ("density", "active_rows", "bytes_per_s",
                                                             "median_bytes_per_s")} for r in k["rows"]]})
            print(t, round(gather / 1e9, 1), [round(r["bytes_per_s"] / 1e9, 1) for r in k["rows"]], flush=True)
    res = {"command": "python " + " ".join(sys.argv), "cores": os.cpu_count(),
           "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "d_model": d, "n_neurons": n, "rows": rows}
    out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--threads", default="8,12,14,15,16")
    ap.add_argument("--densities", default="0.05,0.065,0.2")
    args = ap.parse_args()
    main(args.out, [int(t) for t in args.threads.split(",")], tuple(float(x) for x in args.densities.split(",")))
