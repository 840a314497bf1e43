"""Fair baselines: a baseline (llama-bench, accelerate) must not share the CPU with our process's threads.

Our runtime keeps its OpenMP/Numba threads spinning between layers (OMP_WAIT_POLICY=ACTIVE on a GPU machine:
common/hardware.py openmp_wait_policy), and a process that just decoded keeps them spinning for a while after.
A CPU-bound baseline run beside it (llama.cpp with layers on the CPU) then loses most of its cores. So:

- pi-bench measures our systems in a child process; a baseline run in rounds beside them (--interleave) runs
  through `frozen`: a shell stops that child (SIGSTOP: every one of its threads, spinning or not) before the
  baseline starts and resumes it (SIGCONT) when the baseline ends, whatever the way it ends;
- every baseline also runs standalone, from the parent after the child has exited, and the report puts the two
  side by side and flags a disagreement over `TOLERANCE`;
- `cpu_probe` times a fixed CPU-bound job on every core, so a run can show that the freeze gives the cores back:
  alone, beside our threads just after a generation, and frozen.

Baselines run with the environment the user gave (OMP_WAIT_POLICY and GOMP_SPINCOUNT only if the user set them)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

TOLERANCE = 0.10  # a paired baseline more than 10% off its standalone run is flagged
OURS_ENV = "PI_BENCH_SET_ENV"  # the variables openmp_wait_policy set for us (not by the user): dropped for baselines
BASELINE_PROCESS = "PI_BENCH_BASELINE"  # set in a baseline's environment: pi-bench run there keeps the user's settings

# sh -c FREEZE freeze TIMEOUT CMD...: stop the calling process, run CMD under `timeout`, resume the caller on any exit.
# SIGSTOP takes effect when the kernel next schedules the caller, so on a loaded machine the command could start
# beside it: the shell first waits (up to ~1 s) until /proc shows the caller stopped (state T; no /proc: no wait).
FREEZE = ('trap \'kill -CONT "$PPID" 2>/dev/null\' EXIT; trap \'exit 143\' HUP INT TERM; '
          'kill -STOP "$PPID"; i=0; while [ $i -lt 1000 ] && [ -r /proc/$PPID/stat ]; do '
          's=$(cat /proc/$PPID/stat); s=${s##*") "}; [ "${s%% *}" = T ] && break; i=$((i+1)); sleep 0.001; done; '
          't=$1; shift; timeout "$t" "$@"')


def note_env(before: set[str]) -> None:
    """Call after openmp_wait_policy with the names of OMP_WAIT_POLICY/GOMP_SPINCOUNT set before it: records the ones it
    set, for baseline_env (children inherit the record)."""
    if OURS_ENV not in os.environ:
        os.environ[OURS_ENV] = ",".join(k for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
                                        if k in os.environ and k not in before)


def baseline_env() -> dict:
    """The environment for a baseline: ours without the OpenMP settings we chose for our own runtime."""
    env = dict(os.environ)
    for k in filter(None, env.get(OURS_ENV, "").split(",")):
        env.pop(k, None)
    env.pop(OURS_ENV, None)
    env[BASELINE_PROCESS] = "1"
    return env


def run(cmd: list[str], timeout: float, freeze: bool = False) -> tuple[int, str, str, float]:
    """Run a baseline command; returns (returncode, stdout, stderr, seconds). Output goes through files, never pipes,
    so a frozen caller cannot block the command. freeze: this process is stopped while the command runs (the caller
    must be the child of a process that waits for it without job control, as pi-bench's parent does); a timeout
    gives returncode 124."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        if freeze:
            rc = subprocess.run(["sh", "-c", FREEZE, "freeze", str(max(1, int(timeout))), *cmd], stdout=out,
                                stderr=err, env=baseline_env()).returncode
        else:
            try:
                rc = subprocess.run(cmd, stdout=out, stderr=err, env=baseline_env(), timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        seconds = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        return rc, out.read(), err.read(), seconds


PROBE = """import os, sys, time
n, k = int(sys.argv[1]), int(sys.argv[2])
t0 = time.perf_counter()
pids = []
for _ in range(n):
    pid = os.fork()
    if pid == 0:
        x = 0
        for i in range(k):
            x += i
        os._exit(0)
    pids.append(pid)
for p in pids:
    os.waitpid(p, 0)
print(time.perf_counter() - t0)
"""


def cpu_probe(freeze: bool = False, procs: int | None = None, iters: int = 3_000_000) -> float | None:
    """Seconds for `procs` (default: every CPU) processes each counting to `iters` in Python: a CPU-bound baseline
    in miniature. None if it failed."""
    procs = procs or os.cpu_count() or 1
    rc, out, _, _ = run([sys.executable, "-c", PROBE, str(procs), str(iters)], timeout=120, freeze=freeze)
    try:
        return float(out.strip().splitlines()[-1]) if rc == 0 else None
    except (ValueError, IndexError):
        return None


def compare(standalone: float | None, paired: list[float | None]) -> dict:
    """A paired baseline's median tok/s against its standalone run; `flag` when they disagree by more than TOLERANCE."""
    vals = sorted(v for v in paired if v)
    med = (vals[len(vals) // 2] if len(vals) % 2 else (vals[len(vals) // 2 - 1] + vals[len(vals) // 2]) / 2) \
        if vals else None
    ratio = med / standalone if med and standalone else None
    return {"standalone_tokens_per_s": standalone, "paired_median_tokens_per_s": med, "paired_rounds": len(vals),
            "paired_over_standalone": ratio,
            "flag": None if ratio is None else abs(ratio - 1) > TOLERANCE}
