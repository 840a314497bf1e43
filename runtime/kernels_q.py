"""Numba kernels over cold rows stored in llama.cpp's 32-weight blocks, byte for byte as in a GGUF file
(ggml-common.h), so that a file's rows can be copied into the cold rows, or read in place, with no conversion:

  Q8_0: 34 bytes a block: fp16 scale d, then 32 int8 q; w = d * q                        (1.0625 bytes a weight)
  Q4_0: 18 bytes a block: fp16 scale d, then 16 bytes, byte j = weight j in its low nibble and weight j + 16 in its
        high nibble; w = d * (q - 8)                                                     (0.5625 bytes a weight)

A row of d weights (d a multiple of 32) is d / 32 blocks, (n, row_bytes) uint8 per matrix, one row per neuron: gate,
up and down_t (the down projection transposed). The kernels tell the format from the rows' width (row_bytes is
d / 32 * 34 or d / 32 * 18; no width is both for one d) and each thread runs the code compiled for that format.

The contract is kernels.cold_ffn's and kernels.cold_layer's without `scale` and `group` (runtime/kernels.py: work
claimed CHUNK neurons at a time from an atomic counter, four neurons' gate and up rows read in one pass of eight rows
(_dot8), then their down rows (_axpy4), per-thread partial sums in `part`, `out` of shape (0,) leaves the sum there;
the GIL released):
  cold_ffn_q(x, idx, gate, up, b_up, down_t, part, out, act)
  cold_layer_q(ready, release, i, words, idx, skip, x, gate, up, b_up, down_t, part, out, act, marks)
and a dense GEMV over all rows, parallel over groups of eight rows (CPU-only decode of 4-bit attention weights):
  gemv_q(x, rows, out, fmt)

All arithmetic is float32 on exact weights: a weight q (int8, or a nibble minus 8 in 8-bit integers) is converted to
float32 and multiplied by x; a block's products are summed, then multiplied by its scale d (fp16 -> float32 by LLVM's
fpext: one vcvtph2ps with F16C), so a block costs one scale multiply per row, not one per weight. Unlike bf16 rows,
the weights' conversions, not DRAM, bound a core (bench/kernel_q.py), so the row math is LLVM vector IR
(_rows_codegen), and each group of four neurons prefetches the next group's rows while it computes.

Numba's cache (cache=True) checks only this file: after editing kernels.py, activations.py or intrinsics.py, delete
runtime/__pycache__ (or touch this file), or the cached kernels keep the old code.
"""

from __future__ import annotations

import numpy as np
from hotneurons.runtime.activations import _gated_value, _ungated_value
from hotneurons.runtime.intrinsics import _fetch_add, _store_release
from hotneurons.runtime.kernels import (
    CHUNK,
    FIRST_GATED,
    SPINS,
    TAIL,
    _claim,
    _n_chunks,
    _sum_rows,
    bit_indices,
    wait_ready,
)
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

BLOCK = 32  # weights per block, both formats
Q8_0, Q4_0 = 0, 1  # format codes
BLOCK_BYTES = (34, 18)  # by format code
FORMAT_CODE = {"q8_0": Q8_0, "q4_0": Q4_0}
GEMV_ROWS = 8  # rows a thread reads at once in gemv_q
_F32, _I8, _I32 = ir.FloatType(), ir.IntType(8), ir.IntType(32)
_V16F, _V16B = ir.VectorType(_F32, 16), ir.VectorType(_I8, 16)


@njit(nogil=True, cache=True)
def _format(d, row_bytes):
    """The format code of rows of `row_bytes` bytes holding d weights, or -1."""
    if d % BLOCK == 0:
        for f in (Q8_0, Q4_0):
            if d // BLOCK * BLOCK_BYTES[f] == row_bytes:
                return f
    return -1


# ---------------------------------------------------------------------------------------------------------------
# Row math, written as LLVM vector IR: a block's 32 weights as two <16 x float> halves. Dots of one, four or eight rows
# in one pass over x keep each row's sum in a vector across its blocks (+= d_b * (x_lo * w_lo + x_hi * w_hi)) and
# reduce it once at the end: the loop vectoriser, given the same loops in Numba, reduced every block's sum to a
# scalar, which took about as long as the products. Axpys (acc += h * row) of one or four rows. Both may prefetch
# other rows (the next neurons') in step, one line a block, into the L2: a core's compute then overlaps its DRAM
# reads, which the hardware prefetchers do not start early enough on rows of a few KiB at random places.


def _vec_at(builder, base, offset, vt, align):
    return builder.load(builder.bitcast(builder.gep(base, [offset]), ir.PointerType(vt)), align=align)


def _splat(builder, v):  # a float32 in all 16 lanes
    one = builder.insert_element(ir.Constant(_V16F, ir.Undefined), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(_V16F, ir.Undefined), ir.Constant(ir.VectorType(_I32, 16), [0] * 16))


def _prefetch(builder, data, o):
    """Ask for the cache line of byte o of a row, into the L2 (LLVM's prefetch: read, locality 2, data)."""
    i8p = ir.PointerType(_I8)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]),
                                        "llvm.prefetch.p0i8")
    builder.call(fn, [builder.bitcast(builder.gep(data, [o]), i8p)] + [ir.Constant(_I32, v) for v in (0, 2, 1)])


def _block_weights(builder, data, o, q4, intp):
    """Block at byte o of a row: its fp16 scale as float32 and its weights as two <16 x float> halves (q - 8 for
    Q4_0, in 8-bit integers: the low nibbles, then the high ones; Q8_0: bytes 2-17, then 18-33)."""
    c = lambda v: ir.Constant(_V16B, [v] * 16)  # noqa: E731
    scale = builder.fpext(builder.load(builder.bitcast(builder.gep(data, [o]), ir.PointerType(ir.HalfType())),
                                       align=1), _F32)
    q = _vec_at(builder, data, builder.add(o, ir.Constant(intp, 2)), _V16B, 1)
    if q4:
        lo, hi = builder.sub(builder.and_(q, c(15)), c(8)), builder.sub(builder.lshr(q, c(4)), c(8))
    else:
        lo, hi = q, _vec_at(builder, data, builder.add(o, ir.Constant(intp, 18)), _V16B, 1)
    return scale, builder.sitofp(lo, _V16F), builder.sitofp(hi, _V16F)


def _rows_codegen(q4: bool, dot: bool, nh: int, nrows: int, nnext: int):
    """Codegen of a dot (args: x, rows, next rows, fmt) or an axpy (args: h's, rows, next rows, fmt, acc)."""
    def codegen(context, builder, signature, args):
        arrays = [context.make_array(t)(context, builder, a) if isinstance(t, types.Array) else a
                  for t, a in zip(signature.args, args)]
        vec = arrays[-1] if not dot else arrays[0]  # x, or acc: (d,) float32
        rows, nxt = arrays[nh:nh + nrows], arrays[nh + nrows:nh + nrows + nnext]
        d = cgutils.unpack_tuple(builder, vec.shape)[0]
        intp = d.type
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F] * 3),
                                             "llvm.fmuladd.v16f32")
        sums = [cgutils.alloca_once_value(builder, ir.Constant(_V16F, None)) for _ in rows] if dot else []
        with cgutils.for_range(builder, builder.sdiv(d, ir.Constant(intp, BLOCK)), intp=intp) as loop:
            xo = builder.mul(loop.index, ir.Constant(intp, BLOCK))
            xo2 = builder.add(xo, ir.Constant(intp, 16))
            vl, vh = _vec_at(builder, vec.data, xo, _V16F, 4), _vec_at(builder, vec.data, xo2, _V16F, 4)  # 2 x (16,)
            o = builder.mul(loop.index, ir.Constant(intp, BLOCK_BYTES[Q4_0 if q4 else Q8_0]))
            for r in nxt:
                _prefetch(builder, r.data, o)
            for i, r in enumerate(rows):
                scale, wl, wh = _block_weights(builder, r.data, o, q4, intp)
                if dot:  # sum += d * (x_lo . w_lo + x_hi . w_hi), lane by lane
                    t = builder.call(fma, [vh, wh, builder.fmul(vl, wl)])
                    builder.store(builder.call(fma, [t, _splat(builder, scale), builder.load(sums[i])]), sums[i])
                else:  # acc += (h d) w
                    a = _splat(builder, builder.fmul(arrays[i], scale))
                    vl, vh = builder.call(fma, [wl, a, vl]), builder.call(fma, [wh, a, vh])
            if not dot:
                for at, v in ((xo, vl), (xo2, vh)):
                    builder.store(v, builder.bitcast(builder.gep(vec.data, [at]), ir.PointerType(_V16F)), align=4)
        if not dot:
            return context.get_dummy_value()
        out = []
        for acc in sums:  # 16 lanes -> 1, halving
            v, n = builder.load(acc), 16
            while n > 1:
                n //= 2
                v = builder.fadd(*(builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n),
                                                                            list(range(k, k + n))))
                                   for k in (0, n)))
            out.append(builder.extract_element(v, ir.Constant(_I32, 0)))
        return out[0] if nrows == 1 else context.make_tuple(builder, signature.return_type, out)
    return codegen


def _rows_typer(fmt, vec, rows, nxt=(), hs=()):
    """Signature and codegen of a dot (no hs: x . rows) or an axpy (vec += sum of hs * rows) over rows (1-D C uint8
    arrays), vec (1-D C float32), a literal format code (the caller's source: see _work), prefetching the rows
    `nxt`; None (a typing error) for anything else."""
    if not (isinstance(fmt, types.IntegerLiteral) and fmt.literal_value in (Q8_0, Q4_0)):
        return None
    ok = lambda a, dt: isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype == dt  # noqa: E731
    if not ok(vec, types.float32) or not all(ok(r, types.uint8) for r in rows + nxt) or \
            any(h != types.float32 for h in hs):
        return None
    gen = _rows_codegen(fmt.literal_value == Q4_0, not hs, len(hs) or 1, len(rows), len(nxt))
    if hs:
        return types.none(*hs, *rows, *nxt, fmt, vec), gen
    ret = types.float32 if len(rows) == 1 else types.UniTuple(types.float32, len(rows))
    return ret(vec, *rows, *nxt, fmt), gen


@intrinsic
def _dot1(typingctx, x, r, fmt):  # (d,) float32 . one row of blocks -> float32
    return _rows_typer(fmt, x, (r,))


@intrinsic
def _dot4(typingctx, x, r0, r1, r2, r3, fmt):  # four rows' dots in one pass over x
    return _rows_typer(fmt, x, (r0, r1, r2, r3))


@intrinsic
def _dot8(typingctx, x, r0, r1, r2, r3, r4, r5, r6, r7, fmt):  # eight rows' dots in one pass over x
    return _rows_typer(fmt, x, (r0, r1, r2, r3, r4, r5, r6, r7))


@intrinsic
def _dot8p(typingctx, x, r0, r1, r2, r3, r4, r5, r6, r7, p0, p1, p2, p3, p4, p5, p6, p7, fmt):  # _dot8, p prefetched
    return _rows_typer(fmt, x, (r0, r1, r2, r3, r4, r5, r6, r7), (p0, p1, p2, p3, p4, p5, p6, p7))


@intrinsic
def _axpy1(typingctx, h, r, fmt, acc):  # acc (d,) float32 += h * one row of blocks
    return _rows_typer(fmt, acc, (r,), (), (h,))


@intrinsic
def _axpy4(typingctx, h0, h1, h2, h3, r0, r1, r2, r3, p0, p1, p2, p3, fmt, acc):  # acc += four rows x h, p prefetched
    return _rows_typer(fmt, acc, (r0, r1, r2, r3), (p0, p1, p2, p3), (h0, h1, h2, h3))


# ---------------------------------------------------------------------------------------------------------------
# Neurons (kernels.py's _gated4 / _ungated4 / _down4 over blocks)


@njit(nogil=True, cache=True, fastmath=True)
def _down1(h, j, down_t, fmt, acc):
    if h != 0:
        _axpy1(h, down_t[j], fmt, acc)


@njit(nogil=True, cache=True, fastmath=True)
def _down4(h0, h1, h2, h3, j0, j1, j2, j3, n0, n1, n2, n3, down_t, fmt, acc):
    """acc += four neurons' down rows x h, prefetching the next four neurons' (n0-n3)."""
    if h0 != 0 and h1 != 0 and h2 != 0 and h3 != 0:
        _axpy4(h0, h1, h2, h3, down_t[j0], down_t[j1], down_t[j2], down_t[j3], down_t[n0], down_t[n1], down_t[n2],
               down_t[n3], fmt, acc)
        return
    _down1(h0, j0, down_t, fmt, acc)  # an inactive neuron (a wrong guess) skips its down row
    _down1(h1, j1, down_t, fmt, acc)
    _down1(h2, j2, down_t, fmt, acc)
    _down1(h3, j3, down_t, fmt, acc)


@njit(nogil=True, cache=True, fastmath=True)
def _gated4(x, j0, j1, j2, j3, n0, n1, n2, n3, gate, up, down_t, fmt, acc, act):
    """Four neurons: their gate and up rows in one pass (eight rows), then their down rows; the next four neurons'
    (n0-n3) rows prefetched meanwhile."""
    g0, g1, g2, g3, u0, u1, u2, u3 = _dot8p(x, gate[j0], gate[j1], gate[j2], gate[j3], up[j0], up[j1], up[j2],
                                            up[j3], gate[n0], gate[n1], gate[n2], gate[n3], up[n0], up[n1], up[n2],
                                            up[n3], fmt)
    _down4(_gated_value(act, g0, u0), _gated_value(act, g1, u1), _gated_value(act, g2, u2),
           _gated_value(act, g3, u3), j0, j1, j2, j3, n0, n1, n2, n3, down_t, fmt, acc)


@njit(nogil=True, cache=True, fastmath=True)
def _ungated4(x, j0, j1, j2, j3, n0, n1, n2, n3, up, b_up, down_t, fmt, acc, act):
    a0, a1, a2, a3 = _dot4(x, up[j0], up[j1], up[j2], up[j3], fmt)
    _down4(_ungated_value(a0 + b_up[j0], act), _ungated_value(a1 + b_up[j1], act), _ungated_value(a2 + b_up[j2], act),
           _ungated_value(a3 + b_up[j3], act), j0, j1, j2, j3, n0, n1, n2, n3, down_t, fmt, acc)


@njit(nogil=True, cache=True, fastmath=True)
def _one(x, j, gate, up, b_up, down_t, fmt, acc, act, gated):  # one neuron, its rows one at a time
    if not gated:
        _down1(_ungated_value(_dot1(x, up[j], fmt) + b_up[j], act), j, down_t, fmt, acc)
        return
    g = _dot1(x, gate[j], fmt)
    if act <= 3 and g <= 0:  # ReLU gates: a zero gate skips the up and down rows
        return
    _down1(_gated_value(act, g, _dot1(x, up[j], fmt)), j, down_t, fmt, acc)


@njit(nogil=True, cache=True)
def _check(x, gate, up, down_t, part, out, gated):
    """The format code of the rows, or an error when their shapes do not fit x (d,)."""
    d = x.shape[0]
    fmt = _format(d, up.shape[1])
    if fmt < 0:
        raise ValueError("cold_ffn_q: rows are neither Q8_0 nor Q4_0 blocks of x's d weights (d a multiple of 32, "
                         "row bytes d / 32 * 34 or * 18): store them with ColdRows(..., dtype='q8_0' or 'q4_0')")
    if down_t.shape[1] != up.shape[1] or (gated and gate.shape[1] != up.shape[1]):
        raise ValueError("cold_ffn_q: gate, up and down_t rows differ in width: store all three in one format")
    if part.shape[1] != d or (out.shape[0] != 0 and out.shape[0] != d):
        raise ValueError("cold_ffn_q: part must be (threads, d) and out (d,) or (0,) float32: size them by x")
    return fmt


@njit(nogil=True, cache=True, fastmath=True)
def _work(x, idx, gate, up, b_up, down_t, acc, act, gated, counter, head, fmt):
    """One thread's share of cold_ffn_q: claims from `counter` until idx runs out, sums into acc (d,). `fmt` must be
    a literal number in the caller's source (Numba types it Literal[int], a global's value int64): the row intrinsics
    pick their code from it when they compile, so each format gets code of its own."""
    k = idx.shape[0]
    while True:
        q0, q1 = _claim(_fetch_add(counter, 1), k, head)
        if q0 >= k:
            return
        q = q0
        while q + 4 <= q1:
            e = k - 1  # the next four positions' rows are prefetched (past the end: the last one's)
            n0, n1, n2, n3 = idx[min(q + 4, e)], idx[min(q + 5, e)], idx[min(q + 6, e)], idx[min(q + 7, e)]
            if gated:
                _gated4(x, idx[q], idx[q + 1], idx[q + 2], idx[q + 3], n0, n1, n2, n3, gate, up, down_t, fmt, acc, act)
            else:
                _ungated4(x, idx[q], idx[q + 1], idx[q + 2], idx[q + 3], n0, n1, n2, n3, up, b_up, down_t, fmt, acc,
                          act)
            q += 4
        for q in range(q, q1):
            _one(x, idx[q], gate, up, b_up, down_t, fmt, acc, act, gated)


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def cold_ffn_q(x, idx, gate, up, b_up, down_t, part, out, act):
    """kernels.cold_ffn over block rows: out (d,) = sum over j in idx of h_j(x) * down_t[j] (or, with out of shape
    (0,), part's rows hold that sum). x (d,) float32, idx (k,) int64, gate / up / down_t (n, row_bytes) uint8
    (gate: any such array for ungated FFNs, never read), b_up (n,) float32, part (threads, d) float32 scratch,
    act: kernels.ACT_CODE."""
    d, k = x.shape[0], idx.shape[0]
    gated = act >= FIRST_GATED
    fmt = _check(x, gate, up, down_t, part, out, gated)
    T = _n_chunks(k, part.shape[0])
    head = max(0, k - TAIL * T) // CHUNK * CHUNK  # positions taken CHUNK at a time; the rest 4 at a time
    counter = np.zeros(1, np.int64)  # claims taken
    for t in prange(T):
        acc = part[t]  # (d,) this thread's partial sum
        acc[:] = 0.0
        if fmt == Q4_0:  # the code as a literal in the source (1: Q4_0, 0: Q8_0), not a global: see _work
            _work(x, idx, gate, up, b_up, down_t, acc, act, gated, counter, head, 1)
        else:
            _work(x, idx, gate, up, b_up, down_t, acc, act, gated, counter, head, 0)
    if out.shape[0] == 0:  # the caller sums part's rows; those past T are zero
        part[T:] = 0.0
        return
    for c in prange(T):  # the partial rows summed by all threads, one slice of d each
        _sum_rows(part, T, out, c * d // T, (c + 1) * d // T)


@njit(nogil=True, cache=True)
def cold_layer_q(ready, release, i, words, idx, skip, x, gate, up, b_up, down_t, part, out, act, marks):
    """kernels.cold_layer over block rows (its arguments less `scale` and `group`): wait for ready[i] (i >= 0), the
    packed mask -> idx[:k], cold_ffn_q over idx[skip:k], marks += (1, k), release[i] = 1. Returns k, or -1 when no
    signal came within SPINS reads."""
    if i >= 0 and not wait_ready(ready, i, SPINS):
        return -1
    k = bit_indices(words, idx.shape[0], idx)
    marks[0] += 1
    marks[1] += k
    cold_ffn_q(x, idx[min(skip, k):k], gate, up, b_up, down_t, part, out, act)
    if i >= 0:
        _store_release(release, i, np.int32(1))
    return k


# ---------------------------------------------------------------------------------------------------------------
# Dense GEMV over all rows


@njit(nogil=True, cache=True, fastmath=True)
def _gemv8(x, rows, out, i, fmt):  # out[i:i + 8] (fmt a literal, as in _work)
    (out[i], out[i + 1], out[i + 2], out[i + 3], out[i + 4], out[i + 5], out[i + 6],
     out[i + 7]) = _dot8(x, rows[i], rows[i + 1], rows[i + 2], rows[i + 3], rows[i + 4], rows[i + 5], rows[i + 6],
                         rows[i + 7], fmt)


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _gemv(x, rows, out, fmt):
    n = rows.shape[0]
    for g in prange(n // GEMV_ROWS):
        if fmt == Q4_0:  # literal codes, as in cold_ffn_q
            _gemv8(x, rows, out, g * GEMV_ROWS, 1)
        else:
            _gemv8(x, rows, out, g * GEMV_ROWS, 0)
    for i in range(n // GEMV_ROWS * GEMV_ROWS, n):
        out[i] = _dot1(x, rows[i], 1) if fmt == Q4_0 else _dot1(x, rows[i], 0)


def gemv_q(x: np.ndarray, rows: np.ndarray, out: np.ndarray, fmt: str) -> np.ndarray:
    """out (n,) float32 = rows @ x: rows (n, row_bytes) uint8 of `fmt` blocks ("q8_0" or "q4_0"; a GGUF tensor's
    bytes), x (d,) float32, parallel over groups of eight rows. Returns out."""
    code = FORMAT_CODE.get(str(getattr(fmt, "value", fmt)).lower())
    if code is None:
        raise ValueError(f"gemv_q: format {fmt!r} has no CPU kernel: choose one of {', '.join(FORMAT_CODE)}")
    d = x.shape[0]
    if _format(d, rows.shape[1]) != code or out.shape != (rows.shape[0],):
        raise ValueError(f"gemv_q: rows {rows.shape} are not {fmt} rows of x's {d} weights, or out {out.shape} is "
                         f"not ({rows.shape[0]},): pass rows (n, {d} / 32 * {BLOCK_BYTES[code]}) uint8 and out (n,)")
    _gemv(x, rows, out, code)
    return out
