"""pi-bench's OpenMP wait policy, chosen when this module is imported: pi_bench.py imports it before torch loads
(common/hardware.py openmp_wait_policy says why); in a baseline's own process, the user's settings (fair.py)."""

from __future__ import annotations

import os

from hotneurons.common.hardware import openmp_wait_policy

from bench import fair

_SET_BEFORE = {k for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
if os.environ.get(fair.BASELINE_PROCESS):  # a baseline's own process: the user's OpenMP settings, not ours
    OMP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY", "unset")
else:
    OMP_WAIT_POLICY = openmp_wait_policy()  # before torch loads (common/hardware.py says why)
    fair.note_env(_SET_BEFORE)
