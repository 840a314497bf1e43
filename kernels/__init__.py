"""The compute kernels, CPU and GPU: Numba kernels over the cold FFN rows (cold.py: bf16 / int8 rows; cold_q.py and
cold_q_ir.py: llama.cpp's Q8_0 / Q4_0 / Q4_1 blocks), their Numba helpers (intrinsics.py, activations.py), the DRAM
read ceiling (dram.py), Triton kernels (qgemv.py: GEMVs over block weights; fused.py: a decode step's fused ops), the
linear layer over float or block weights that the models call (qlinear.py) and the torch reference ops of a decode
step with their one dispatch (ops.py)."""

from hotneurons.common.hardware import openmp_wait_policy

openmp_wait_policy()  # before torch loads: sleeping or spinning OpenMP threads (see its docstring)
