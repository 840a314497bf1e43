"""Random valid blocks of every GGML type gguf-py knows (weights/formats.py's table): scale fields finite, or set so
that the weights are about a given size, the affine formats' levels centred on zero. The de-quantizers' tests
(tests/test_gguf_types.py, as `blocks`) and rates (bench/dequant_types.py, as `tests.blocks`) draw their inputs here:
a test fixture first, which the benchmark, like tests/ only in a checkout, borrows."""

from __future__ import annotations

import numpy as np
from hotneurons.weights.formats import FORMATS, WeightFormat, row_bytes

F = WeightFormat
# byte offsets of each block's fp16 scale fields, which random bytes could make inf or NaN
F16_FIELDS = {F.Q4_0: (0,), F.Q4_1: (0, 2), F.Q5_0: (0,), F.Q5_1: (0, 2), F.Q8_0: (0,), F.Q2_K: (80, 82),
              F.Q3_K: (108,), F.Q4_K: (0, 2), F.Q5_K: (0, 2), F.Q6_K: (208,), F.IQ2_XXS: (0,), F.IQ2_XS: (0,),
              F.IQ2_S: (0,), F.IQ3_XXS: (0,), F.IQ3_S: (0,), F.IQ1_S: (0,), F.IQ4_NL: (0,), F.IQ4_XS: (0,),
              F.TQ1_0: (52,), F.TQ2_0: (64,)}
# per format, the scale that makes its weights about 1 in size (the largest index times scale bits), for the models
UNIT = {F.Q4_0: 1 / 4, F.Q4_1: 1 / 4, F.Q5_0: 1 / 8, F.Q5_1: 1 / 8, F.Q8_0: 1 / 64, F.Q2_K: 1 / 12, F.Q3_K: 1 / 64,
        F.Q4_K: 1 / 40, F.Q5_K: 1 / 80, F.Q6_K: 1 / 2000, F.Q8_K: 1 / 64, F.IQ2_XXS: 1 / 20, F.IQ2_XS: 1 / 20,
        F.IQ2_S: 1 / 20, F.IQ3_XXS: 1 / 120, F.IQ3_S: 1 / 200, F.IQ1_S: 1 / 8, F.IQ1_M: 1 / 8, F.IQ4_NL: 1 / 64,
        F.IQ4_XS: 1 / 1000, F.TQ1_0: 1.0, F.TQ2_0: 1.0, F.MXFP4: 1 / 6, F.NVFP4: 1 / 6}
# the affine formats' min fields, per scale: the levels then straddle zero (w = d q - m)
CENTER = {F.Q4_1: -7.5, F.Q5_1: -15.5, F.Q2_K: 1.5, F.Q4_K: 7.5, F.Q5_K: 15.5}


def finite_f16(rng, n: int) -> np.ndarray:
    """n random finite fp16 bit patterns (subnormals, zeros and both signs included), as (n, 2) bytes."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    return np.where(bits & 0x7C00 == 0x7C00, bits ^ 0x0400, bits).astype(np.uint16).view(np.uint8).reshape(n, 2)


def f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float16).reshape(-1).view(np.uint8).reshape(-1, 2)


def valid_blocks(rng, fmt: WeightFormat, n: int, scale: float | None = None) -> np.ndarray:
    """(n, block bytes) uint8 of `fmt`: random bytes whose scale fields hold random finite values (scale None), or
    (a model's weights) scales for weights of about `scale` in size, the affine formats' levels centred on zero."""
    s = FORMATS[fmt]
    b = rng.integers(0, 256, (n, s.block_bytes), dtype=np.uint8)
    d = None if scale is None else scale * UNIT[fmt] * rng.uniform(0.5, 1.5, n).astype(np.float32)  # (n,)
    if fmt in CENTER and d is not None:
        v = rng.integers(1, 16, (n, 1), dtype=np.uint8)  # one 4-bit scale and min for every sub-block
        if fmt == F.Q2_K:
            b[:, :16] = v | (v << 4)
        elif fmt in (F.Q4_K, F.Q5_K):
            b[:, 4:12], b[:, 12:16] = v, v | (v << 4)
    for i, at in enumerate(F16_FIELDS.get(fmt, ())):
        if d is None:
            b[:, at:at + 2] = finite_f16(rng, n)
        else:
            b[:, at:at + 2] = f16_bytes(d if i == 0 else (-d if fmt in (F.Q4_1, F.Q5_1) else d) * CENTER[fmt])
    if fmt == F.Q8_K:  # a float32 scale
        b[:, :4] = (rng.standard_normal(n).astype(np.float32) if d is None else d).view(np.uint8).reshape(n, 4)
    elif fmt == F.IQ1_M:  # the fp16 scale's 4 nibbles are the top nibbles of the 4 uint16 at bytes 48-55
        bits = (finite_f16(rng, n) if d is None else f16_bytes(d)).view(np.uint16)[:, 0]  # (n,)
        sc = b[:, 48:56].copy().view(np.uint16)  # (n, 4)
        for k in range(4):
            sc[:, k] = (sc[:, k] & 0x0FFF) | (((bits >> (4 * k)) & 0xF) << 12)
        b[:, 48:56] = sc.view(np.uint8)
    elif fmt == F.MXFP4 and d is not None:  # e8m0: the scale is 2^(e - 128)
        b[:, 0] = np.clip(np.round(np.log2(d)) + 128, 1, 254).astype(np.uint8)
    elif fmt == F.NVFP4 and d is not None:  # ue4m3 bytes 0x38 (0.5) give weights of up to 3
        b[:, :4] = 0x38
    return b


def random_rows(rng, fmt: WeightFormat, rows: int, cols: int, scale: float | None = None) -> np.ndarray:
    """(rows, row_bytes) uint8 rows of `fmt` (valid_blocks), or a float format's finite values."""
    if FORMATS[fmt].block == 1:
        dt = {F.F32: np.float32, F.F16: np.float16, F.F64: np.float64}.get(fmt)
        x = rng.standard_normal((rows, cols)) * (1.0 if scale is None else scale)
        if dt is None:  # bf16: float32's top half
            return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
        return x.astype(dt).view(np.uint8).reshape(rows, -1)
    return valid_blocks(rng, fmt, rows * cols // FORMATS[fmt].block, scale).reshape(rows, row_bytes(fmt, cols))
