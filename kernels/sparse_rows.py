"""Row math by the rows' type for kernels/cold_experts_sparse.py: block rows (uint8) through cold_q_ir's intrinsics (fmt
a literal code), float rows (float32, fp16 bits as uint16, bf16 bits as int16) through plain loops. Python stubs,
compiled per type by their overloads (a call typed for the other kind would not compile)."""

from __future__ import annotations

from hotneurons.kernels.cold_experts import _f32, _fdot
from hotneurons.kernels.cold_q_ir import rows_axpy, rows_dot
from numba import types
from numba.extending import overload

__all__ = ["_dot1", "_dots4", "_axpy1", "_axpy4"]


def _dot1(x, xs, row, lut, fmt):  # pragma: no cover - stub
    raise NotImplementedError


def _dots4(x, xs, r0, r1, r2, r3, n0, n1, n2, n3, lut, fmt):  # pragma: no cover - stub
    raise NotImplementedError


def _axpy1(h, row, lut, fmt, acc):  # pragma: no cover - stub
    raise NotImplementedError


def _axpy4(h0, h1, h2, h3, r0, r1, r2, r3, n0, n1, n2, n3, lut, fmt, acc):  # pragma: no cover - stub
    raise NotImplementedError


def _blocks(row) -> bool:
    return isinstance(row, types.Array) and row.dtype == types.uint8


_OPTS = {"fastmath": True, "nogil": True}


@overload(_dot1, jit_options=_OPTS, prefer_literal=True)
def _dot1_ov(x, xs, row, lut, fmt):
    if _blocks(row):  # xs: (x,) on the float route, the quantized x on the int route (cold_q._xq_buffers)
        return lambda x, xs, row, lut, fmt: rows_dot(xs, (row,), (), lut, fmt)
    return lambda x, xs, row, lut, fmt: _fdot(x, row)


@overload(_dots4, jit_options=_OPTS, prefer_literal=True)
def _dots4_ov(x, xs, r0, r1, r2, r3, n0, n1, n2, n3, lut, fmt):
    if _blocks(r0):
        return lambda x, xs, r0, r1, r2, r3, n0, n1, n2, n3, lut, fmt: rows_dot(xs, (r0, r1, r2, r3),
                                                                                 (n0, n1, n2, n3), lut, fmt)
    return lambda x, xs, r0, r1, r2, r3, n0, n1, n2, n3, lut, fmt: (_fdot(x, r0), _fdot(x, r1), _fdot(x, r2),
                                                                     _fdot(x, r3))


@overload(_axpy1, jit_options=_OPTS, prefer_literal=True)
def _axpy1_ov(h, row, lut, fmt, acc):
    if _blocks(row):
        return lambda h, row, lut, fmt, acc: rows_axpy((h,), (row,), (), lut, fmt, acc)

    def impl(h, row, lut, fmt, acc):
        for i in range(acc.shape[0]):
            acc[i] += h * _f32(row[i])
    return impl


@overload(_axpy4, jit_options=_OPTS, prefer_literal=True)
def _axpy4_ov(h0, h1, h2, h3, r0, r1, r2, r3, n0, n1, n2, n3, lut, fmt, acc):
    if _blocks(r0):
        return lambda h0, h1, h2, h3, r0, r1, r2, r3, n0, n1, n2, n3, lut, fmt, acc: rows_axpy(
            (h0, h1, h2, h3), (r0, r1, r2, r3), (n0, n1, n2, n3), lut, fmt, acc)

    def impl(h0, h1, h2, h3, r0, r1, r2, r3, n0, n1, n2, n3, lut, fmt, acc):
        for i in range(acc.shape[0]):
            acc[i] += h0 * _f32(r0[i]) + h1 * _f32(r1[i]) + h2 * _f32(r2[i]) + h3 * _f32(r3[i])
    return impl
