"""Stalls of the cold kernel: the spread of its decode-sized calls with every core's thread, with one core left, and
with another process waking beside it.

A parallel call joins all its threads: when another runnable process takes a core from one of them, the call waits
for that thread's next time slice (milliseconds), however the rows are shared out. A decode step makes one such call
a layer, so a few stalls a token cost more than the kernel's median suggests. This times kernels/dram.cold_call_times
(the rows of pi-solve's --measure: random neurons of a 1 GiB table, the host spinning between calls) for each
thread count and noise, and writes the per-call median, mean, p99 and max and the rates at the median and the mean.

    python -m bench.cold_stalls --threads 16,15 --noise none,nvidia-smi,spin --out results.json

Noise: `nvidia-smi` starts `nvidia-smi` every 0.25 s (as a memory sampler beside a benchmark did); `spin` a process
that busies a core 0.1 s of every 0.25 s (any other program of the user's).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import numpy as np

NOISE = {
    "nvidia-smi": "while true; do nvidia-smi --query-compute-apps=pid,used_memory --format=csv >/dev/null 2>&1; "
                  "sleep 0.25; done",
    "spin": f"{sys.executable} -c \"import time\nwhile True:\n t = time.perf_counter()\n"
            f" while time.perf_counter() - t < 0.1: pass\n time.sleep(0.15)\"",
}


def stats(times: np.ndarray, nbytes: float) -> dict:
    """The calls' spread (ms) and the rates (bytes/s) at the median and the mean call."""
    ms = np.sort(times) * 1e3
    return {"calls": int(ms.size), "median_ms": float(np.median(ms)), "mean_ms": float(ms.mean()),
            "p99_ms": float(ms[min(ms.size - 1, int(0.99 * ms.size))]), "max_ms": float(ms[-1]),
            "over_2x_median": int((ms > 2 * np.median(ms)).sum()),
            "rate_at_median": nbytes / (np.median(ms) * 1e-3), "rate_at_mean": nbytes / (ms.mean() * 1e-3)}


def measure(threads: list[int], noises: list[str], d: int, fmt: str, rows: int, calls: int,
            table_bytes: int) -> dict:
    import numba
    from hotneurons.kernels.dram import cold_call_times

    out = {}
    # one untimed pass first: the first configuration timed ran slower at every percentile than the next (the
    # threads' first start, the machine's clocks), which a comparison must not read as the thread count's doing
    numba.set_num_threads(threads[0])
    cold_call_times(d, fmt, True, rows, table_bytes=table_bytes, calls=max(20, calls // 10))
    for noise in noises:
        proc = None if noise == "none" else subprocess.Popen(NOISE[noise], shell=True, start_new_session=True,
                                                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(0.5 if proc else 0.0)
            for t in threads:
                numba.set_num_threads(t)
                times, nbytes = cold_call_times(d, fmt, True, rows, table_bytes=table_bytes, calls=calls)
                row = out.setdefault(noise, {})[str(t)] = stats(times, nbytes)
                print(f"noise {noise:10s} threads {t:3d}: median {row['median_ms']:.3f} ms, mean "
                      f"{row['mean_ms']:.3f}, p99 {row['p99_ms']:.3f}, max {row['max_ms']:.3f}; "
                      f"{row['rate_at_median'] / 1e9:.1f} GB/s at the median, {row['rate_at_mean'] / 1e9:.1f} at "
                      f"the mean", flush=True)
        finally:
            if proc is not None:
                import os
                import signal

                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()
    return out


def main(argv: list[str] | None = None) -> dict:
    import numba

    from bench.record import write_result

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    n = numba.config.NUMBA_NUM_THREADS
    ap.add_argument("--threads", default=f"{n},{max(1, n - 1)}", help="thread counts to time (default: every "
                    "core, and one fewer)")
    ap.add_argument("--noise", default="none,spin", help=f"none and/or {', '.join(NOISE)}")
    ap.add_argument("--d", type=int, default=8192, help="the rows' width (8192: the 70B shape)")
    ap.add_argument("--fmt", default="q4_0")
    ap.add_argument("--rows", type=int, default=541, help="neurons a call (541: a 70B layer's cold rows a token)")
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--table-bytes", type=int, default=2**30)
    ap.add_argument("--commit", default=None, help="the checkout's commit, where its .git is stale or missing")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    noises = a.noise.split(",")
    for x in noises:
        if x != "none" and x not in NOISE:
            raise SystemExit(f"--noise {x}: choose none or one of {', '.join(NOISE)}")
    figures = {"d": a.d, "fmt": a.fmt, "rows": a.rows,
               "runs": measure([int(t) for t in a.threads.split(",")], noises, a.d, a.fmt, a.rows, a.calls,
                               a.table_bytes)}
    if a.out:
        write_result(a.out, figures, commit=a.commit)
    return figures


if __name__ == "__main__":
    main()
