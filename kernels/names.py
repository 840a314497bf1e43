"""The names of the kernels' formats and op sets, without importing the kernels (command lines list them as choices
before any heavy import)."""

ROW_DTYPES = ("bf16", "int8")  # cold rows of one stored type per weight, scales apart (cold.cold_ffn)
BLOCK_DTYPES = ("q8_0", "q4_0", "q4_1")  # cold rows of 32-weight blocks, scales (and mins) inside (cold_q.cold_ffn_q)
# cold rows of llama.cpp's K-quants (256-weight blocks: cold_q.cold_ffn_q's fmt), kept as a file stores them, never
# made here; their down_t rows in one of BLOCK_DTYPES (models/ffn_weights.cold_formats)
K_DTYPES = ("q4_k", "q5_k", "q6_k")
COLD_DTYPES = ROW_DTYPES + BLOCK_DTYPES + K_DTYPES
