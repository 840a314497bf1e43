"""The row math of K-quant rows for kernels/cold_q.py, as LLVM vector IR beside kernels/cold_q_ir.py's (whose
`rows_dot` calls `dot_k` for these formats): dots of 1, 4 or 8 rows with x in one pass, prefetching other rows (the
next neurons') in step.

Rows are llama.cpp's blocks of 256 weights byte for byte (ggml-common.h; gguf-py's gguf/quants.py de-quantizes them),
in 8 units of 32 weights:

  Q4_K 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc and mins m (ggml's get_scale_min_k4: bytes 0-3 sc 0-3,
       4-7 m 0-3, 8-11 the low 4 bits of sc 4-7 and of m 4-7, their top 2 bits in bytes 0-3 / 4-7's top bits), then
       128 bytes: byte 32 p + l holds unit 2 p's weight l (low nibble) and unit 2 p + 1's (high); w = d sc q - dmin m
  Q5_K 176 bytes: Q4_K's 16 head bytes, 32 bytes qh (bit u of byte l: unit u's weight l's fifth bit), Q4_K's 128
  Q6_K 210 bytes: 128 bytes ql (byte 64 h + l: weight 128 h + l in its low nibble, 128 h + 64 + l in its high), 64
       bytes qh (byte 32 h + l, bits 2 t: weight 128 h + 32 t + l's top two), 16 int8 scales (one a 16 weights), fp16
       d at the end; w = d sc (q - 32)

Float route only (cold_q's docstring): each weight as gguf-py computes it, in float32, then x . w summed in float32 as
Q4_1's rows are. Exact weights: d sc is exact (an fp16 times 6 bits, or times 8 for Q6_K), d sc q too (at most 11 +
6 + 5 = 22 bits; Q6_K's d sc (q - 32) 11 + 7 + 5 = 23 <= 24), dmin m too, so the one rounding is that of d sc q -
dmin m, which an FMA makes as gguf-py's subtraction does. No int route (xq asks for it in vain, as for Q4_1): the mins
would need a per-unit second term.

A block is decoded per row: its scales once (one vector of 8 d sc and one of 8 dmin m, or 16 d sc for Q6_K), then
each unit's 32 weights as two <16 x float> (nibbles widened, high bits merged as integers, one conversion and one
FMA a 16), FMA'd with x into the row's one vector of sums. One block a loop step, the rows in an inner loop, the lines
of that block of the rows `nxt` prefetched first. The same IR for every target, no AVX-512 intrinsic: per 16 weights
it compiles to ~9 (Q4_K) and ~10 (Q6_K) AVX-512 instructions, against ~5 for Q4_0's table route (cold_q_ir's
vpermps), which a Q4_K table of d sc (0..15) - dmin m a unit could share.
"""

from __future__ import annotations

from hotneurons.kernels.ir_util import (
    _I32,
    _V16F,
    _V16I,
    BLOCK_BYTES,
    BLOCK_WEIGHTS,
    HAS_512,
    Q4_K,
    Q5_K,
    Q6_K,
    _c,
    _fma,
    _fn,
    _hsum,
    _ld,
    _prefetch,
    _scale,
    _shuffle,
    _splat,
)
from llvmlite import ir
from numba.core import cgutils

QK_K = BLOCK_WEIGHTS[Q4_K]  # weights a block (256, every K-quant's)
UNITS = 8  # units of 32 weights a block
CHAINS = 4  # independent sums a row and block
_V8B, _V16B, _V8I, _V8F = (ir.VectorType(ir.IntType(8), 8), ir.VectorType(ir.IntType(8), 16),
                           ir.VectorType(_I32, 8), ir.VectorType(ir.FloatType(), 8))
_NIBBLES = {Q4_K: 16, Q5_K: 48}  # byte of the 128 nibble bytes in a Q4_K / Q5_K block


def _at(builder, o, k):
    return builder.add(o, _c(o.type, k))


def _bytes16(builder, data, o):
    """16 bytes at o as <16 x i32> (zero-extended)."""
    return builder.zext(_ld(builder, data, o, _V16B), _V16I)


def _splat_i(v):
    return _c(_V16I, [v] * 16)


def _shift(builder, v, k):
    """v << k (k >= 0) or v >> -k, <16 x i32>."""
    return builder.shl(v, _splat_i(k)) if k >= 0 else builder.lshr(v, _splat_i(-k))


def _scales(builder, lut, data, o, fmt):
    """A block's scales: Q4_K / Q5_K (d sc, dmin m) as <8 x float> each (get_scale_min_k4 on 8 lanes); Q6_K (d sc,
    None), <16 x float>."""
    if fmt == Q6_K:
        sc = builder.sitofp(builder.sext(_ld(builder, data, _at(builder, o, 192), _V16B), _V16I), _V16F)
        return builder.fmul(_splat(builder, _scale(builder, lut, data, _at(builder, o, 208))), sc), None
    s = _ld(builder, data, _at(builder, o, 4), _V16B)  # the 12 scale bytes (and 4 of the next field)

    def pick(idx):
        return _shuffle(builder, s, s, idx)

    low = _c(ir.VectorType(ir.IntType(1), 8), [j < 4 for j in range(8)])

    def b8(v):
        return _c(_V8B, [v] * 8)

    a, top_sc = pick([0, 1, 2, 3, 8, 9, 10, 11]), pick([0, 1, 2, 3, 0, 1, 2, 3])
    c, top_m = pick([4, 5, 6, 7, 8, 9, 10, 11]), pick([4, 5, 6, 7, 4, 5, 6, 7])
    sc = builder.select(low, builder.and_(a, b8(63)), builder.or_(
        builder.and_(a, b8(15)), builder.shl(builder.lshr(top_sc, b8(6)), b8(4))))
    m = builder.select(low, builder.and_(c, b8(63)), builder.or_(
        builder.lshr(c, b8(4)), builder.shl(builder.lshr(top_m, b8(6)), b8(4))))

    def times(field, v):
        f = builder.sitofp(builder.zext(v, _V8I), _V8F)
        one = builder.insert_element(ir.Constant(_V8F, ir.Undefined),
                                     _scale(builder, lut, data, _at(builder, o, field)), _c(_I32, 0))
        return builder.fmul(_shuffle(builder, one, one, [0] * 8), f)

    return times(0, sc), times(2, m)


def _unit(builder, data, o, fmt, scales, u):
    """Unit u's 32 weights of the block at o: (weights 0-15, weights 16-31), <16 x float> each, as gguf-py's."""
    if fmt == Q6_K:
        h, t = divmod(u, 4)
        out = []
        for half in range(2):
            raw = _bytes16(builder, data, _at(builder, o, 64 * h + 32 * (t % 2) + 16 * half))
            nib = builder.lshr(raw, _splat_i(4)) if t >= 2 else builder.and_(raw, _splat_i(15))
            qh = _bytes16(builder, data, _at(builder, o, 128 + 32 * h + 16 * half))  # bits 2 t, 2 t + 1 -> 4, 5
            top = builder.and_(_shift(builder, qh, 4 - 2 * t), _splat_i(0x30))
            ds = _splat(builder, builder.extract_element(scales[0], _c(_I32, 2 * u + half)))  # weights' 16 d sc
            # d sc (q - 32) = d sc q - 32 d sc, all three exact: one FMA
            out.append(_fma(builder, builder.sitofp(builder.or_(nib, top), _V16F), ds,
                            builder.fmul(ds, _c(_V16F, [-32.0] * 16))))
        return tuple(out)
    p, hi = divmod(u, 2)
    ds = _splat(builder, builder.extract_element(scales[0], _c(_I32, u)))
    dm = _splat(builder, builder.fneg(builder.extract_element(scales[1], _c(_I32, u))))
    if HAS_512:  # the unit's 16 (Q4_K) or 32 (Q5_K) weights d sc q - dmin m as a table, made once for 32 lookups
        tables = [_fma(builder, ds, _c(_V16F, [float(v) for v in range(k, k + 16)]), dm)
                  for k in ((0,) if fmt == Q4_K else (0, 16))]
    out = []
    for half in range(2):
        raw = _bytes16(builder, data, _at(builder, o, _NIBBLES[fmt] + 32 * p + 16 * half))
        if HAS_512 and fmt == Q4_K:  # vpermps reads an index's low 4 bits: the low nibble needs no mask
            out.append(builder.call(_fn(builder, "llvm.x86.avx512.permvar.sf.512", _V16F, [_V16F, _V16I]),
                                    [tables[0], builder.lshr(raw, _splat_i(4)) if hi else raw]))
            continue
        q = builder.lshr(raw, _splat_i(4)) if hi else builder.and_(raw, _splat_i(15))
        if fmt == Q5_K:
            qh = _bytes16(builder, data, _at(builder, o, 16 + 16 * half))  # bit u -> bit 4
            q = builder.or_(q, builder.and_(_shift(builder, qh, 4 - u), _splat_i(16)))
        if HAS_512:  # q 0..31 picks from the two tables (vpermt2ps)
            out.append(builder.call(_fn(builder, "llvm.x86.avx512.vpermi2var.ps.512", _V16F, [_V16F, _V16I, _V16F]),
                                    [tables[0], q, tables[1]]))
            continue
        out.append(_fma(builder, ds, builder.sitofp(q, _V16F), dm))  # d sc q exact: one rounding, gguf-py's
    return tuple(out)


def _prefetch_block(builder, nxt, o, bb):
    """The lines of the block at o (bb bytes) of each row in nxt."""
    for r in nxt:
        for k in [*range(0, bb, 64), bb - 1]:
            _prefetch(builder, r.data, _at(builder, o, k))


def dot_k(builder, fmt, x, rows, nxt, lut, intp):
    """x . row for each row of K blocks, x (d,) float32 (d a multiple of 256): the sums per row (float32). Per block,
    the rows in a loop (not unrolled: a row's scales, its unit weights and its one vector of sums stay in registers,
    x's vectors are read from the L1 by the FMAs; unrolled over 8 rows they spilled to the stack)."""
    bb, m = BLOCK_BYTES[fmt], len(rows)
    nb = builder.sdiv(cgutils.unpack_tuple(builder, x.shape)[0], _c(intp, QK_K))
    i8p = ir.PointerType(ir.IntType(8))
    ptrs = cgutils.alloca_once(builder, i8p, size=m)  # the rows' bytes
    sums = cgutils.alloca_once(builder, _V16F, size=m)  # a vector of sums a row
    for i, r in enumerate(rows):
        builder.store(builder.bitcast(r.data, i8p), builder.gep(ptrs, [_c(intp, i)]))
        builder.store(_c(_V16F, None), builder.gep(sums, [_c(intp, i)]))
    with cgutils.for_range(builder, nb, intp=intp) as blk:
        o = builder.mul(blk.index, _c(intp, bb))
        _prefetch_block(builder, nxt, o, bb)
        x0 = builder.mul(blk.index, _c(intp, QK_K))
        with cgutils.for_range(builder, _c(intp, m), intp=intp) as row:
            data = builder.load(builder.gep(ptrs, [row.index]))
            slot = builder.gep(sums, [row.index])
            sc = _scales(builder, lut, data, o, fmt)
            # four chains of FMAs, not one: a block's 16 in one chain waited on the FMA's latency (4 cycles each)
            acc = [builder.load(slot)] + [_c(_V16F, None)] * (CHAINS - 1)
            for u in range(UNITS):
                xo = _at(builder, x0, 32 * u)
                for half, w in enumerate(_unit(builder, data, o, fmt, sc, u)):
                    c = (2 * u + half) % CHAINS
                    acc[c] = _fma(builder, _ld(builder, x.data, _at(builder, xo, 16 * half), _V16F, 4), w, acc[c])
            builder.store(builder.fadd(builder.fadd(acc[0], acc[1]), builder.fadd(acc[2], acc[3])), slot)
    return [_hsum(builder, builder.load(builder.gep(sums, [_c(intp, i)]))) for i in range(m)]
