"""pi-generate: the hybrid runtime (hot FFN neurons by torch on the device, active cold ones by Numba on the CPU)."""

import os

# torch and Numba each bring an OpenMP runtime; with the default (active) wait policy the idle threads of one spin
# on the cores the other needs, and batch-1 decode on the CPU ran 30x slower here. Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
