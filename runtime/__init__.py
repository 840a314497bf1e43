"""pi-generate: the hybrid runtime (hot FFN neurons by torch on the device, active cold ones by Numba on the CPU)."""

from hotneurons.common.hardware import openmp_wait_policy

openmp_wait_policy()  # before torch loads: sleeping or spinning OpenMP threads (see its docstring)
