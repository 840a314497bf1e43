"""x quantized once per call for kernels/cold_q.py's int route (its docstring; cold_q_ir's XQ_LAYOUT): llama.cpp's Q8_0
of an activation row (`quantize_x`), and that in the layout each row format's integer dots read (`_xq_buffers`).

Numba's cache is named by a hash of every kernel source (kernels/__init__.numba_cache_dir): an edit here reaches
the kernels that call this module at their next start.
"""

from __future__ import annotations

import numpy as np
from hotneurons.kernels.cold_q_ir import BLOCK, Q4_0
from numba import njit

__all__ = ["quantize_x"]


@njit(nogil=True, cache=True, fastmath=True)
def _block_scale(x, base):
    """d_x and 1 / d_x of x[base:base + 32] (0 and 0 for an all-zero block)."""
    amax = np.float32(0.0)
    for i in range(base, base + BLOCK):
        amax = max(amax, abs(x[i]))
    return amax / np.float32(127.0), (np.float32(127.0) / amax if amax > 0 else np.float32(0.0))


@njit(nogil=True, cache=True, fastmath=True)
def _q(v, inv):  # one weight of x -> int8, rounded to nearest
    return np.int8(min(np.float32(127.0), max(np.float32(-127.0), np.rint(v * inv))))


@njit(nogil=True, cache=True)
def quantize_x(x, q, dx):
    """x (d,) float32 -> q (d,) int8 and dx (d / 32,) float32 with x ~ dx[i // 32] * q[i]: llama.cpp's Q8_0 of an
    activation row (dx = max|x| / 127 of the block, q = x / dx rounded to nearest; an all-zero block: dx = 0, q = 0),
    as the int route computes it."""
    for b in range(x.shape[0] // BLOCK):
        dx[b], inv = _block_scale(x, b * BLOCK)
        for i in range(b * BLOCK, b * BLOCK + BLOCK):
            q[i] = _q(x[i], inv)


@njit(nogil=True, cache=True)
def _xq_buffers(x, fmt, use):
    """The int route's (xb, corr, dxv) for x in `fmt`'s layout (cold_q_ir XQ_LAYOUT); empty when not `use`."""
    nb = x.shape[0] // BLOCK
    n = (nb + 3) // 4 * 4 * BLOCK if use else 0  # weights in whole steps (4 blocks; 2 for Q8_0 fit too)
    xb, corr, dxv = np.zeros(n, np.int8), np.zeros(n // 4, np.int32), np.zeros(n // 4, np.float32)
    for b in range(nb if use else 0):
        dx, inv = _block_scale(x, b * BLOCK)
        if fmt == Q4_0:  # step b // 4, slot b % 4: its low half at lo, its high half 64 bytes on; lanes of 4 bytes
            lo, lane = 128 * (b // 4) + 16 * (b % 4), 16 * (b // 4) + 4 * (b % 4)
            for j in range(16):
                xb[lo + j], xb[lo + 64 + j] = _q(x[b * BLOCK + j], inv), _q(x[b * BLOCK + 16 + j], inv)
            for m in range(4):
                c = 0
                for j in range(4 * m, 4 * m + 4):
                    c += np.int32(xb[lo + j]) + np.int32(xb[lo + 64 + j])
                corr[lane + m], dxv[lane + m] = -8 * c, dx
        else:  # in order; lanes of 4 weights
            for i in range(b * BLOCK, b * BLOCK + BLOCK):
                xb[i] = _q(x[i], inv)
            for m in range(b * 8, b * 8 + 8):
                c = np.int32(xb[4 * m]) + np.int32(xb[4 * m + 1]) + np.int32(xb[4 * m + 2]) + np.int32(xb[4 * m + 3])
                corr[m], dxv[m] = -128 * c, dx
    return xb, corr, dxv
