"""The row math of kernels/cold_q.py as LLVM vector IR (Numba intrinsics): dots of 1, 4 or 8 block rows with x in
one pass, and axpys (acc += h * row) of 1 or 4 rows, each prefetching other rows (the next neurons') in step.

Rows are llama.cpp blocks (cold_q's docstring): Q8_0 (fp16 scale d, 32 int8 q), Q4_0 (d, 16 bytes of nibbles:
weight j in byte j's low nibble, weight j + 16 in its high one; w = d (q - 8)) and Q4_1 (d, fp16 min m, Q4_0's 16
bytes; w = d q + m). A scale d (and a min m) is read through F16_TO_F32 (65536 float32: every fp16 pattern's value),
one load from memory that the multiply broadcasts, instead of a vcvtph2ps and a broadcast per block and row. The
K-quants' dots (Q4_K, Q5_K, Q6_K: format codes 3-5, float route only) are kernels/cold_k.py's IR, reached through
`rows_dot`; the axpys read the three 32-weight formats only (down_t rows are never K-quants).

Two routes for the dots (the axpys are float32 only):
  float (the file's weights, float32 sums): Q4_0 weights d (q - 8) as a 16-entry table d * (-8..7) (one multiply a
    block), Q4_1 weights d q + m as a table d * (0..15) + m (one FMA a block: d q is exact, so each entry is d q + m
    rounded once to float32, as gguf-py and weights/quants.py de-quantize it), looked up by the nibbles (vpermps: one
    instruction per 16 weights, no integer -> float conversion); Q8_0 weights converted (vpmovsxbd, vcvtdq2ps), their
    block sum scaled by d. Products with x fused (FMA), one vector of sums per row across blocks, reduced at the end.
  int (x quantized once per call, llama.cpp's Q8_0 of x: an int8 q_x and a float32 d_x per 32 weights; XQ_LAYOUT):
    a block's dot in integers, u8 x s8 -> s32 (AVX-512 VNNI vpdpbusd), 64 weights an instruction; then d_w * d_x *
    (dot + corr). Q4_0: four blocks (72 bytes) gathered into one register with one byte permute, the low nibbles and
    the high ones (unsigned 0..15) against x's matching bytes, corr = -8 * the sum of x's bytes in each lane (the
    weights' offset, a per-call constant that seeds the accumulator). Q8_0: two blocks; w + 128 (unsigned, an xor)
    against q_x, corr = -128 * that sum. About three instructions per 32 weights against the float route's seven.
    Only where the compile target has AVX-512 BW/VL/VBMI/VNNI (XQ_OK), and not for Q4_1 (its min would need a second
    per-block term; dot_typer refuses the pair, and cold_q runs Q4_1 rows on the float route whatever xq says).

Without AVX-512 (F and BW), the Q4 table lookups fall back to integer -> float conversions (slower, same values).
Loops step four Q4_0 blocks (two Q8_0 blocks in the int route) at a time with one or two prefetches per row and step;
the int route's last, partial step reads the row's last bytes from a zero-padded copy.
"""

from __future__ import annotations

import numpy as np
from hotneurons.kernels.cold_k import dot_k
from hotneurons.kernels.ir_util import (
    _I1,
    _I8,
    _V16B,
    _V16F,
    _V16I,
    _V64B,
    BLOCK_BYTES,
    BLOCK_WEIGHTS,
    HAS_512,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_0,
    XQ_OK,
    _c,
    _fma,
    _fn,
    _hsum,
    _ld,
    _prefetch,
    _ptr,
    _scale,
    _shuffle,
    _splat,
)
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

BLOCK = BLOCK_WEIGHTS[Q8_0]  # weights per block of Q8_0, Q4_0, Q4_1
STEP = (2, 4)  # blocks per step of the int route, by format code (64 / 128 weights: one register of x's bytes)
F16_TO_F32 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
_TABLE = {Q4_0: [float(v) for v in range(-8, 8)], Q4_1: [float(v) for v in range(16)]}  # q - 8 | q for q = 0..15


# ---------------------------------------------------------------------------------------------------------------
# The float route: one block's 32 weights as two <16 x float> halves


def _weights(builder, lut, data, o, fmt):
    """Block at byte o: (w_lo, w_hi, d). Q4_0 / Q4_1: the weights d (q - 8) / d q + m (d None); Q8_0: unscaled q (d
    the scale)."""
    d = _scale(builder, lut, data, o)
    if fmt == Q8_0:
        return tuple(builder.sitofp(_ld(builder, data, builder.add(o, _c(o.type, k)), _V16B), _V16F)
                     for k in (2, 18)) + (d,)
    m = _splat(builder, _scale(builder, lut, data, builder.add(o, _c(o.type, 2)))) if fmt == Q4_1 else None
    raw = builder.zext(_ld(builder, data, builder.add(o, _c(o.type, BLOCK_BYTES[fmt] - 16)), _V16B), _V16I)
    hi = builder.lshr(raw, _c(_V16I, [4] * 16))
    if HAS_512:  # the table of the 16 weights, looked up by the nibble (vpermps reads an index's low 4 bits: no mask)
        table = _c(_V16F, _TABLE[fmt])
        table = builder.fmul(_splat(builder, d), table) if m is None else _fma(builder, _splat(builder, d), table, m)
        perm = _fn(builder, "llvm.x86.avx512.permvar.sf.512", _V16F, [_V16F, _V16I])
        return builder.call(perm, [table, raw]), builder.call(perm, [table, hi]), None
    ds, lo = _splat(builder, d), builder.and_(raw, _c(_V16I, [15] * 16))
    if m is not None:  # d q + m, d q exact: one rounding, as the table's
        return tuple(_fma(builder, builder.sitofp(v, _V16F), ds, m) for v in (lo, hi)) + (None,)
    eight = _c(_V16I, [8] * 16)
    return tuple(builder.fmul(builder.sitofp(builder.sub(v, eight), _V16F), ds) for v in (lo, hi)) + (None,)


def _dot_float(builder, fmt, x, rows, nxt, lut, intp):
    """x . row for each row, x (d,) float32: the sums per row (float32)."""
    bb = BLOCK_BYTES[fmt]
    nb = builder.sdiv(cgutils.unpack_tuple(builder, x.shape)[0], _c(intp, BLOCK))
    sums = [[cgutils.alloca_once_value(builder, _c(_V16F, None)) for _ in range(2)] for _ in rows]

    def block(b):
        xo = builder.mul(b, _c(intp, BLOCK))
        xl, xh = _ld(builder, x.data, xo, _V16F, 4), _ld(builder, x.data, builder.add(xo, _c(intp, 16)), _V16F, 4)
        o = builder.mul(b, _c(intp, bb))
        for r, (sl, sh) in zip(rows, sums):
            wl, wh, d = _weights(builder, lut, r.data, o, fmt)
            if d is None:  # exact weights: one FMA a half, a sum a half
                builder.store(_fma(builder, xl, wl, builder.load(sl)), sl)
                builder.store(_fma(builder, xh, wh, builder.load(sh)), sh)
            else:  # the block's products summed, then scaled by d
                t = _fma(builder, xh, wh, builder.fmul(xl, wl))
                builder.store(_fma(builder, t, _splat(builder, d), builder.load(sl)), sl)

    _block_loops(builder, nb, bb, nxt, block, intp)
    return [_hsum(builder, builder.fadd(builder.load(sl), builder.load(sh))) for sl, sh in sums]


def _block_loops(builder, nb, bb, nxt, block, intp):
    """block(b) for b < nb: four at a time, prefetching the lines of those four blocks of the rows nxt (1 + 4 bb / 64
    lines: 2 for Q4_0 and Q4_1, 3 for Q8_0), then the rest one at a time."""
    four = builder.sdiv(nb, _c(intp, 4))
    with cgutils.for_range(builder, four, intp=intp) as loop:
        b = builder.mul(loop.index, _c(intp, 4))
        o = builder.mul(b, _c(intp, bb))
        for r in nxt:
            for k in range(0, 4 * bb, 64):
                _prefetch(builder, r.data, builder.add(o, _c(intp, k)))
        for k in range(4):
            block(builder.add(b, _c(intp, k)))
    with cgutils.for_range(builder, builder.sub(nb, builder.mul(four, _c(intp, 4))), intp=intp) as loop:
        b = builder.add(builder.mul(four, _c(intp, 4)), loop.index)
        for r in nxt:
            _prefetch(builder, r.data, builder.mul(b, _c(intp, bb)))
        block(b)


def _axpy(builder, fmt, hs, rows, nxt, lut, acc, intp):
    """acc (d,) float32 += sum of h * row (float32, the float route's weights)."""
    bb = BLOCK_BYTES[fmt]
    nb = builder.sdiv(cgutils.unpack_tuple(builder, acc.shape)[0], _c(intp, BLOCK))
    hv = [_splat(builder, h) for h in hs]

    def block(b):
        xo = builder.mul(b, _c(intp, BLOCK))
        xo2 = builder.add(xo, _c(intp, 16))
        vl, vh = _ld(builder, acc.data, xo, _V16F, 4), _ld(builder, acc.data, xo2, _V16F, 4)
        o = builder.mul(b, _c(intp, bb))
        for r, h, hvec in zip(rows, hs, hv):
            wl, wh, d = _weights(builder, lut, r.data, o, fmt)
            a = hvec if d is None else _splat(builder, builder.fmul(h, d))
            vl, vh = _fma(builder, wl, a, vl), _fma(builder, wh, a, vh)
        for at, v in ((xo, vl), (xo2, vh)):
            builder.store(v, _ptr(builder, acc.data, at, _V16F), align=4)

    _block_loops(builder, nb, bb, nxt, block, intp)


# ---------------------------------------------------------------------------------------------------------------
# The int route. XQ_LAYOUT: x's int8 bytes xb, per step s (STEP[fmt] blocks, 16 lanes of 4 bytes):
#   Q4_0: xb[128 s:128 s + 64] = the low halves (weights 0-15) of the step's four blocks, 16 bytes each,
#         xb[128 s + 64:128 s + 128] their high halves (16-31); corr[16 s + l] = -8 * (sum of the 4 bytes of lane l
#         in both); dxv[16 s + l] = d_x of block 4 s + l // 4.
#   Q8_0: xb[64 s:64 s + 64] = weights 64 s.. in order; corr[16 s + l] = -128 * (sum of lane l's 4 bytes);
#         dxv[16 s + l] = d_x of block 2 s + l // 8.
# Arrays padded with zeros to whole steps: a missing block adds 0.


def _step_q4(builder, a, b, xs, s, acc):
    """Four Q4_0 blocks: a = bytes 0-63 of the step, b = bytes 8-71. Returns acc + that step's scaled dots."""
    src = [18 * (k // 16) + 2 + k % 16 for k in range(64)]  # the step's 64 nibble bytes, block after block
    q = _shuffle(builder, a, b, [p if p < 64 else 64 + p - 8 for p in src])
    lo, hi = builder.and_(q, _c(_V64B, [15] * 64)), builder.lshr(q, _c(_V64B, [4] * 64))
    scales = _shuffle(builder, a, a, [18 * (k // 8) + k % 2 for k in range(32)])  # <32 x i8>: d of block l // 4
    d = builder.fpext(builder.bitcast(scales, ir.VectorType(ir.HalfType(), 16)), _V16F)
    return _finish(builder, [(lo, 0), (hi, 64)], d, xs, s, 128, acc)


def _step_q8(builder, a2, a4, p, data, lut, xs, s, acc):
    """Two Q8_0 blocks: a2 = bytes 2-65 of the step, a4 = bytes 4-67; their scales at p and p + 34 of data."""
    w = builder.select(_c(ir.VectorType(_I1, 64), [k < 32 for k in range(64)]), a2, a4)  # the 64 q's
    w = builder.xor(w, _c(_V64B, [-128] * 64))  # q + 128: unsigned
    d0, d1 = _scale(builder, lut, data, p), _scale(builder, lut, data, builder.add(p, _c(p.type, 34)))
    d = builder.select(_c(ir.VectorType(_I1, 16), [k < 8 for k in range(16)]), _splat(builder, d0),
                       _splat(builder, d1))
    return _finish(builder, [(w, 0)], d, xs, s, 64, acc)


def _finish(builder, parts, d, xs, s, stride, acc):
    """acc + d * d_x * (corr + sum of parts . x's bytes), integer dots by vpdpbusd (u8 weights x s8 x)."""
    xb, corr, dxv = xs
    dp = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", _V16I, [_V16I] * 3)
    s16 = builder.mul(s, _c(s.type, 16))
    dot = _ld(builder, corr.data, s16, _V16I, 4)
    for v, k in parts:
        xv = _ld(builder, xb.data, builder.add(builder.mul(s, _c(s.type, stride)), _c(s.type, k)), _V16I, 4)
        dot = builder.call(dp, [dot, builder.bitcast(v, _V16I), xv])
    f = builder.fmul(builder.sitofp(dot, _V16F), _ld(builder, dxv.data, s16, _V16F, 4))
    return _fma(builder, f, d, acc)


def _dot_int(builder, fmt, xs, rows, nxt, lut, intp):
    """Each row's dot with x quantized (XQ_LAYOUT): the sums per row (float32). Q4_0 or Q8_0."""
    q4 = fmt == Q4_0
    bb, step = BLOCK_BYTES[fmt], STEP[fmt]
    sb = step * bb  # bytes a step
    nb = builder.sdiv(cgutils.unpack_tuple(builder, rows[0].shape)[0], _c(intp, bb))
    full = builder.sdiv(nb, _c(intp, step))
    sums = [cgutils.alloca_once_value(builder, _c(_V16F, None)) for _ in rows]
    pad = cgutils.alloca_once(builder, ir.ArrayType(_I8, 128))  # a row's last, partial step, zero-padded
    pad = builder.bitcast(pad, ir.PointerType(_I8))

    def step_at(data, p, s, acc):
        if q4:
            return _step_q4(builder, _ld(builder, data, p, _V64B), _ld(builder, data, builder.add(p, _c(intp, 8)),
                                                                         _V64B), xs, s, acc)
        return _step_q8(builder, _ld(builder, data, builder.add(p, _c(intp, 2)), _V64B),
                        _ld(builder, data, builder.add(p, _c(intp, 4)), _V64B), p, data, lut, xs, s, acc)

    with cgutils.for_range(builder, full, intp=intp) as loop:
        p = builder.mul(loop.index, _c(intp, sb))
        for r in nxt:
            for k in range(0, sb, 64):
                _prefetch(builder, r.data, builder.add(p, _c(intp, k)))
        for r, sm in zip(rows, sums):
            builder.store(step_at(r.data, p, loop.index, builder.load(sm)), sm)
    rest = builder.mul(builder.sub(nb, builder.mul(full, _c(intp, step))), _c(intp, bb))  # bytes
    with builder.if_then(builder.icmp_signed(">", rest, _c(intp, 0))):
        p = builder.mul(full, _c(intp, sb))
        zero = _c(intp, 0)
        for r, sm in zip(rows, sums):
            builder.store(_c(ir.ArrayType(_I8, 128), bytearray(128)), builder.bitcast(pad, ir.PointerType(
                ir.ArrayType(_I8, 128))))
            cgutils.raw_memcpy(builder, pad, builder.gep(r.data, [p]), rest, 1)
            builder.store(step_at(pad, zero, full, builder.load(sm)), sm)
    return [_hsum(builder, builder.load(sm)) for sm in sums]


# ---------------------------------------------------------------------------------------------------------------
# Typing


def _ok(a, dt, ndim=1):
    return isinstance(a, types.Array) and a.ndim == ndim and a.layout == "C" and a.dtype == dt


def _arrays(context, builder, tup_type, tup):
    if len(tup_type) == 0:
        return []
    return [context.make_array(t)(context, builder, v) for t, v in zip(tup_type, cgutils.unpack_tuple(builder, tup))]


def _rows_ok(rows, nxt, lut, fmt, codes=(Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K)):
    return (isinstance(fmt, types.IntegerLiteral) and fmt.literal_value in codes
            and isinstance(rows, types.BaseTuple) and isinstance(nxt, types.BaseTuple) and len(rows) >= 1
            and all(_ok(r, types.uint8) for r in tuple(rows) + tuple(nxt)) and _ok(lut, types.float32))


def dot_typer(xs, rows, nxt, lut, fmt):
    """Signature and codegen of dots of the rows (a tuple of 1-D C uint8 arrays) with xs: (x,) (d,) float32 (the
    float route) or (xb int8, corr int32, dxv float32) in XQ_LAYOUT (the int route); prefetching the rows nxt (a
    tuple, maybe empty); lut = F16_TO_F32; fmt a literal format code (the int route: Q4_0 or Q8_0; the K-quants:
    the float route, by kernels/cold_k.dot_k). Returns float32, or a tuple per row."""
    if not _rows_ok(rows, nxt, lut, fmt) or not isinstance(xs, types.BaseTuple):
        return None
    if len(xs) == 1 and _ok(xs[0], types.float32):
        route = dot_k if fmt.literal_value >= Q4_K else _dot_float
    elif len(xs) == 3 and XQ_OK and fmt.literal_value in (Q8_0, Q4_0) and \
            all(_ok(a, t) for a, t in zip(xs, (types.int8, types.int32, types.float32))):
        route = _dot_int
    else:
        return None
    code = fmt.literal_value

    def codegen(context, builder, signature, args):
        xa = _arrays(context, builder, signature.args[0], args[0])
        ra, na = _arrays(context, builder, signature.args[1], args[1]), _arrays(context, builder, signature.args[2],
                                                                                   args[2])
        lut_ptr = context.make_array(signature.args[3])(context, builder, args[3]).data
        intp = context.get_value_type(types.intp)
        out = route(builder, code, xa if route is _dot_int else xa[0], ra, na, lut_ptr, intp)
        return out[0] if len(out) == 1 else context.make_tuple(builder, signature.return_type, out)

    ret = types.float32 if len(rows) == 1 else types.UniTuple(types.float32, len(rows))
    return ret(xs, rows, nxt, lut, fmt), codegen


def axpy_typer(hs, rows, nxt, lut, fmt, acc):
    """Signature and codegen of acc (d,) float32 += sum of hs (a tuple of float32) * rows, prefetching nxt; rows of
    Q8_0, Q4_0 or Q4_1 (a neuron's down row: models/ffn_weights.py keeps down_t in those formats)."""
    if not _rows_ok(rows, nxt, lut, fmt, (Q8_0, Q4_0, Q4_1)) or not _ok(acc, types.float32) \
            or not isinstance(hs, types.BaseTuple) or len(hs) != len(rows) or any(h != types.float32 for h in hs):
        return None
    code = fmt.literal_value

    def codegen(context, builder, signature, args):
        h = cgutils.unpack_tuple(builder, args[0])
        ra, na = _arrays(context, builder, signature.args[1], args[1]), _arrays(context, builder, signature.args[2],
                                                                                   args[2])
        lut_ptr = context.make_array(signature.args[3])(context, builder, args[3]).data
        acc_a = context.make_array(signature.args[5])(context, builder, args[5])
        _axpy(builder, code, h, ra, na, lut_ptr, acc_a, context.get_value_type(types.intp))
        return context.get_dummy_value()

    return types.none(hs, rows, nxt, lut, fmt, acc), codegen


@intrinsic
def rows_dot(typingctx, xs, rows, nxt, lut, fmt):  # dot_typer
    return dot_typer(xs, rows, nxt, lut, fmt)


@intrinsic
def rows_axpy(typingctx, hs, rows, nxt, lut, fmt, acc):  # axpy_typer
    return axpy_typer(hs, rows, nxt, lut, fmt, acc)
