"""The names of the kernels' formats and op sets, without importing the kernels (command lines list them as choices
before any heavy import)."""

ROW_DTYPES = ("bf16", "int8")  # cold rows of one stored type per weight, scales apart (cold.cold_ffn)
BLOCK_DTYPES = ("q8_0", "q4_0", "q4_1")  # cold rows of 32-weight blocks, scales (and mins) inside (cold_q.cold_ffn_q)
COLD_DTYPES = ROW_DTYPES + BLOCK_DTYPES
