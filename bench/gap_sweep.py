"""Does the host's wait between two cold-kernel calls make the next call slower, and does an OpenMP or Numba setting
undo it? In decode the cold part took ~1.3-1.4x its replay back to back, and a replay with the main thread spinning
before each call (as it waits for `pre`) took most of that (bench/NOTES.md, run 14). Here the cold kernel as decode
runs it (bench_ceilings.kernel_bench: ReGLU, bf16 rows, 8 copies of one LLaMA-2-70B-shaped layer taken in turn) is
timed back to back and with the main thread spinning `--gap-ms` before each call, once per setting, each setting in
its own process (libgomp reads its environment once, when it loads).

Usage: python bench/gap_sweep.py OUT.json [--gap-ms 0.27] [--densities 0.05,0.2] [--configs default,passive,...]"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# name -> environment on top of the caller's (libgomp's and Numba's own variables)
CONFIGS = {
    "default": {},  # the runtime's choice on a GPU host: ACTIVE, GOMP_SPINCOUNT=1e7 (hotneurons.common.hardware)
    "spin-unbounded": {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "INFINITE"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "bind-close": {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"},
    "bind-spread": {"OMP_PROC_BIND": "spread", "OMP_PLACES": "cores"},
    "workqueue": {"NUMBA_THREADING_LAYER": "workqueue"},
    "tbb": {"NUMBA_THREADING_LAYER": "tbb"},
}


def child(out: Path, gap_ms: float, densities: tuple[float, ...], rounds: int, reps: int,
          d: int = 8192, n: int = 28672) -> None:
    """One setting (the environment this process started with): kernel_bench without and with the gap, `rounds`
    times in turn, on one layer's rows."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_ceilings as ceil
    import numba
    import pi_bench  # noqa: F401  (powerinfer.* from this checkout; the OpenMP policy unless set)
    import torch
    from hotneurons.runtime.cold_rows import ColdRows

    g = torch.Generator().manual_seed(0)
    w = lambda: torch.randn(n, d, generator=g) * 0.02  # noqa: E731
    layer = ColdRows.from_weights(w(), w(), None, w(), "bf16")
    runs = []
    for rnd in range(rounds):
        for gap in (0.0, gap_ms):
            k = ceil.kernel_bench(d, n, densities, reps=reps, seed=rnd, rows=layer, gap_ms=gap)
            runs.append({"round": rnd, "gap_ms": gap,
                         "rows": [{key: r[key] for key in ("density", "active_rows", "best_s", "median_s",
                                                           "median_bytes_per_s")} for r in k["rows"]]})
            print(rnd, gap, [round(r["median_bytes_per_s"] / 1e9, 1) for r in k["rows"]], flush=True)
    env = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_PROC_BIND", "OMP_PLACES",
                                          "NUMBA_THREADING_LAYER")}
    out.write_text(json.dumps({"threading_layer": numba.threading_layer(), "threads": numba.get_num_threads(),
                               "env": env, "runs": runs}))


def summary(runs: list[dict]) -> dict:
    """Per density: the median over rounds of each run's median ms a call, without and with the gap, and their ratio."""
    import numpy as np

    out = {}
    for j, r0 in enumerate(runs[0]["rows"]):
        ms = {gap: float(np.median([1e3 * r["rows"][j]["median_s"] for r in runs if (r["gap_ms"] > 0) == gap]))
              for gap in (False, True)}
        out[str(r0["density"])] = {"ms_back_to_back": ms[False], "ms_after_gap": ms[True],
                                   "gap_over_back_to_back": ms[True] / ms[False]}
    return out


def main(out: Path, configs: list[str], gap_ms: float, densities: str, rounds: int, reps: int) -> dict:
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown config(s) {unknown}: known ones are {sorted(CONFIGS)}")
    res = {"command": "python " + " ".join(sys.argv), "cores": os.cpu_count(), "gap_ms": gap_ms,
           "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "lscpu": _lscpu(), "configs": {}}
    for name in configs:
        with tempfile.TemporaryDirectory() as tmp:
            f = Path(tmp) / "child.json"
            cmd = [sys.executable, __file__, str(f), "--child", "--gap-ms", str(gap_ms), "--densities", densities,
                   "--rounds", str(rounds), "--reps", str(reps)]
            p = subprocess.run(cmd, env={**os.environ, **CONFIGS[name]}, capture_output=True, text=True)
            if p.returncode != 0 or not f.exists():  # e.g. tbb not installed: recorded, the others go on
                res["configs"][name] = {"error": (p.stderr or p.stdout).strip().splitlines()[-1:]}
                print(name, "failed:", res["configs"][name]["error"], flush=True)
                continue
            r = json.loads(f.read_text())
        r["summary"] = summary(r["runs"])
        res["configs"][name] = r
        print(name, r["threading_layer"], json.dumps(r["summary"]), flush=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1))
    tmp.replace(out)
    return res


def _lscpu() -> dict:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return {}
    keep = ("Model name", "Thread(s) per core", "Core(s) per socket", "Socket(s)", "NUMA node(s)", "L3 cache",
            "CPU(s)", "Hypervisor vendor")
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in text.splitlines() if ":" in line)
            if k.strip() in keep}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--gap-ms", type=float, default=0.27, help="ms the main thread spins before each call")
    ap.add_argument("--densities", default="0.05,0.2")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=40, help="timed calls per density and run")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.out, a.gap_ms, tuple(float(x) for x in a.densities.split(",")), a.rounds, a.reps)
    else:
        main(a.out, a.configs.split(","), a.gap_ms, a.densities, a.rounds, a.reps)
