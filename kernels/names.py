"""The names of the kernels' formats and op sets, without importing the kernels (command lines list them as choices
before any heavy import). The names are weights/formats.py's (plain strings, as command lines take them)."""

from hotneurons.weights.formats import WeightFormat as F

ROW_DTYPES = (F.BF16.value, F.INT8.value)  # cold rows of one stored type per weight, scales apart (cold.cold_ffn)
# cold rows of 32-weight blocks, scales (and mins) inside (cold_q.cold_ffn_q)
BLOCK_DTYPES = (F.Q8_0.value, F.Q4_0.value, F.Q4_1.value)
# cold rows of llama.cpp's K-quants (256-weight blocks: cold_q.cold_ffn_q's fmt), kept as a file stores them, never
# made here; their down_t rows in one of BLOCK_DTYPES (models/ffn_weights.cold_formats)
K_DTYPES = (F.Q4_K.value, F.Q5_K.value, F.Q6_K.value)
COLD_DTYPES = ROW_DTYPES + BLOCK_DTYPES + K_DTYPES  # the formats weights/formats.py marks cpu_kernel

# the GPU kernels' codes of the 32-weight block formats (kernels/dequant_gpu.py, kernels/grouped.py)
BLOCK_KIND = {F.Q4_0: 0, F.Q4_1: 1, F.Q8_0: 2}
