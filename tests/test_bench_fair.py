"""pi-bench's fair baselines (bench/fair.py): the caller frozen while a baseline runs, the baseline's environment, and
the flag on a standalone figure that disagrees with the paired ones."""

import subprocess
import sys
from pathlib import Path

from bench import fair


def test_frozen_baseline_stops_the_caller_until_it_ends(tmp_path):
    """fair.run(freeze=True) in a child process: every thread of the caller is stopped (state T in /proc) while the
    command runs, and it runs on once the command has ended, also when the command overran its timeout."""
    code = """if True:
        import os, sys, time
        from bench import fair
        rc, out, _, _ = fair.run(["sh", "-c", f"cat /proc/{os.getpid()}/stat"], 30, freeze=True)
        state = out.rsplit(")", 1)[1].split()[0]
        t0 = time.perf_counter()
        rc2, _, _, s = fair.run(["sleep", "30"], 1, freeze=True)
        print(rc, state, rc2, round(s))
    """
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=Path(__file__).resolve().parents[1])  # the checkout's root, where bench imports
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["0", "T", "124", "1"]


def test_baseline_env_drops_our_openmp_settings(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000000")
    monkeypatch.setenv(fair.OURS_ENV, "OMP_WAIT_POLICY,GOMP_SPINCOUNT")
    env = fair.baseline_env()
    assert "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env and env[fair.BASELINE_PROCESS] == "1"
    monkeypatch.setenv(fair.OURS_ENV, "")  # the user's own settings stay
    assert fair.baseline_env()["OMP_WAIT_POLICY"] == "ACTIVE"
    assert fair.cpu_probe(procs=1, iters=1000) > 0


def test_compare_flags_a_disagreement_over_ten_percent():
    assert fair.compare(10.0, [9.5, 9.2, None, 9.8])["flag"] is False
    c = fair.compare(4.37, [0.79, 0.8, 0.78])
    assert c["flag"] and c["paired_median_tokens_per_s"] == 0.79 and c["paired_rounds"] == 3
    assert fair.compare(None, [1.0])["flag"] is None and fair.compare(1.0, [])["paired_median_tokens_per_s"] is None
