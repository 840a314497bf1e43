"""Triton kernels over llama.cpp's K-quant weights (Q4_K, Q5_K, Q6_K) in GpuQ's K layout (kernels/qlayout_k.py).

The GEMV is kernels/qgemv.py's, a unit (32 weights: a Q4_K / Q5_K sub-block, two Q6_K sub-blocks of 16) in place of
a Q4_0 block: each program reads BLOCK_N rows, a step's units spread over its threads (one a thread) and its rows in
each thread's registers, the next step's fields loaded while it computes this one's, float32 sums per (token, row,
unit) rounded once at the end; the same x loads (qgemv's kernel order), the same pieces-to-floats without a
conversion instruction (qgemv._piece: a LOP3, and an FADD unless DENORM), the same MAP (rows by index), XSLOT and CNT
(a device count) modes. What a K unit adds:
  scales  a unit's scale and min from its block's d and dmin (fp16, one a block) and its own 6-bit sc, m (Q4_K,
          Q5_K: one funnel shift of two adjacent sub words, two masks; w = d sc q - dmin m sums as d sc (sum q x) -
          dmin m (sum x), qgemv's Q4_1 form) or two int8 scales (Q6_K: w = d sc (q - 32), two partial sums a unit)
  Q5_K, Q6_K  the high bits: word i's nibbles and the unit's high-bit word merge into two words of byte-wide
          fields (qlayout_k's B words: one LOP3 each, after a shift of each), whose bytes are then the pieces (5 or 6
          bits, masked in place as qgemv's Q8_0 bytes are), met by the same x as Q4_0's nibbles u = 2 c + h
about 10 instructions a (row, unit) for the scales and 18 for Q5_K's / Q6_K's merges, next to ~64 for its 32
weights. sm_90's code (Triton 3.6, compiled ahead of time and counted in cuobjdump's SASS of the loop; gemv_config's
8 rows, 2 warps, one token, fp16 x): 3.09 instructions a Q4_K weight (Q4_0's 2.74, Q4_1's 2.87), 3.89 a Q5_K one,
3.91 a Q6_K one, 167-168 registers; a byte of the file costs 5.5, 5.7 and 4.8 instructions against Q4_0's 4.9. The
bytes read are the file's: 4.5, 5.5 and 6.5625 bits a weight.

  gemv     y (m, n) = x (m, k) @ w.T (+ b), or h += that, m <= qgemv.GEMV_MAX_ROWS: qgemv.gemv's contract
(the prefill path's de-quantizer of these fields: kernels/dequant_gpu.py's dequant_k).

No host syncs, no allocations: capturable in CUDA graphs. Without CUDA the tests run them in Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from hotneurons.kernels.qgemv import DENORM_MAX_ROWS, GEMV_MAX_ROWS, MAGIC, XEXP, _piece, _split4, _store, _xscale
from hotneurons.kernels.qlayout_k import K_KIND, UNIT
from hotneurons.weights.formats import WeightFormat

KIND = K_KIND  # the kernels' FMT
HI8 = tl.constexpr(-0x0F0F0F10)  # 0xF0F0F0F0 as int32
UW = tl.constexpr(UNIT)  # weights a unit
NEG32 = tl.constexpr(-32.0 * 2.0 ** -XEXP.value)  # Q6_K's offset, DENORM: over the scales' 2^XEXP


@triton.jit
def _sel(a, b, ASM: tl.constexpr):
    """(a & 0x0F0F0F0F) | (b & 0xF0F0F0F0): one LOP3."""
    if ASM:
        v = tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, 0x0F0F0F0F, 0xE4;", "=r,r,r", [a, b], tl.int32, True, 1)
    else:
        v = (a & 0x0F0F0F0F) | (b & HI8)
    return v


@triton.jit
def _field(src, b, MASK: tl.constexpr, OFF: tl.constexpr):
    """((src & MASK) ^ b) as a float32, - OFF: a field of src as a float with no conversion instruction (qgemv._piece's
    way), b its exponent (and a sign flip for int8 fields): a LOP3 (ptxas takes b from a uniform register) and an
    FADD."""
    return ((src & MASK) ^ b).to(tl.float32, bitcast=True) - OFF


@triton.jit
def _piece_b(bw, b3, magic, c: tl.constexpr, BITS: tl.constexpr, OFF: tl.constexpr, DENORM: tl.constexpr,
             ASM: tl.constexpr):
    """Byte c's field (BITS bits) of B words bw (b3 = bw >> 16, for c = 3, whose field would pass the mantissa) as
    float32, as qgemv._piece: DENORM, the field alone as a denormal, Q 2^(sh - 149) (x scaled to meet it: _xscale_b);
    else Q - OFF, by one LOP3 (the exponent 150 - sh) and one FADD."""
    SH: tl.constexpr = 8 if c == 3 else 8 * c
    MASK: tl.constexpr = ((1 << BITS) - 1) << SH
    src = b3 if c == 3 else bw
    if DENORM:
        v = (src & MASK).to(tl.float32, bitcast=True)
    else:
        v = _field(src, magic - (SH << 23), MASK, float(2 ** (23 - SH) + OFF))
    return v


@triton.jit
def _xscale_b(x, c: tl.constexpr):
    """x * 2^(149 - sh - XEXP), sh: byte c's field's bit (_piece_b)."""
    SH: tl.constexpr = 8 if c == 3 else 8 * c
    return x * float(2 ** (149 - SH - XEXP))


@triton.jit
def _funnel(lo, hi, sh, ASM: tl.constexpr):
    """The 32 bits of (hi:lo) >> sh, sh in 0..28 (one SHF)."""
    if ASM:
        f = tl.inline_asm_elementwise("shf.r.clamp.b32 $0, $1, $2, $3;", "=r,r,r,r", [lo, hi, tl.zeros_like(lo) + sh],
                                      tl.int32, True, 1)
    else:
        s = (tl.zeros_like(lo) + sh).to(tl.uint32)
        f = ((lo.to(tl.uint32, bitcast=True) >> s) | ((hi.to(tl.uint32, bitcast=True) << 4) << (28 - s))).to(
            tl.int32, bitcast=True)
    return f


@triton.jit
def _b_words(q0, q1, q2, q3, g0, g1, FMT: tl.constexpr, ASM: tl.constexpr):
    """Q5_K (FMT 1) / Q6_K (2): a unit's B words (qlayout_k) from its 4 nibble words and high-bit words g0 (Q6_K:
    words 0, 1's; g1 words 2, 3's): b{i}{h}, byte c = weight 8 c + 4 h + i."""
    if FMT == 1:
        b = (_sel(q0, g0, ASM), _sel(q0 >> 4, g0 >> 1, ASM), _sel(q1, g0 >> 2, ASM), _sel(q1 >> 4, g0 >> 3, ASM),
             _sel(q2, g0 << 4, ASM), _sel(q2 >> 4, g0 << 3, ASM), _sel(q3, g0 << 2, ASM), _sel(q3 >> 4, g0 << 1, ASM))
    else:
        b = (_sel(q0, g0, ASM), _sel(q0 >> 4, g0 >> 2, ASM), _sel(q1, g0 << 4, ASM), _sel(q1 >> 4, g0 << 2, ASM),
             _sel(q2, g1, ASM), _sel(q2 >> 4, g1 >> 2, ASM), _sel(q3, g1 << 4, ASM), _sel(q3 >> 4, g1 << 2, ASM))
    return b


@triton.jit
def _scales(d, dm, lo, hi, sh, magic, FMT: tl.constexpr, DENORM: tl.constexpr, ASM: tl.constexpr):
    """A step's (BLOCK_N, BLOCK_U) fp16 d, dmin and sub words -> float32 (s, mn): Q4_K / Q5_K s = d sc, mn = dmin m
    (sc, m: the unit's 12-bit field of the sub words lo, hi at bit sh); Q6_K s = d sc of the unit's first sub-block,
    mn = d sc of its second (lo: the unit's int16 of two int8 scales). DENORM: the scales times 2^XEXP (the pieces'
    sums carry 2^-XEXP: qgemv._step), folded into the exponents of the fields' floats (_field), not multiplied."""
    X: tl.constexpr = XEXP if DENORM else 0
    d = d.to(tl.float32)
    if FMT == 2:
        t = lo.to(tl.int32)  # two int8s, sign-extended (masked off below)
        s = d * _field(t, magic + (X << 23) + 0x80, 0xFF, float((2 ** 23 + 128) * 2 ** X))
        mn = d * _field(t, magic + ((X - 8) << 23) + 0x8000, 0xFF00, float((2 ** 15 + 128) * 2 ** X))
    else:
        f = _funnel(lo, hi, sh[None, :], ASM)
        s = d * _field(f, magic + (X << 23), 0x3F, float(2 ** (23 + X)))
        mn = dm.to(tl.float32) * _field(f, magic - (6 << 23), 0xFC0, float(2 ** 17))
    return s, mn


@triton.jit
def _step(acc, q, g0, g1, s, mn, x_at, xm, magic, FMT: tl.constexpr, DENORM: tl.constexpr, ASM: tl.constexpr):
    """acc (BLOCK_M, BLOCK_N, BLOCK_U) += each unit's weights times x: q (BLOCK_N, BLOCK_U * 4) nibble words, g0, g1
    (BLOCK_N, BLOCK_U) high-bit words (Q5_K: g0; Q6_K: both; Q4_K: unused), s, mn (_scales), x_at (BLOCK_M,
    BLOCK_U * 4) the x of each word's first piece, masked by xm (None: no mask). qgemv._step's loop: piece u of word
    i meets x[4 u + i] (Q4_K: nibble u; Q5_K, Q6_K: byte u // 2 of B word (i, u % 2)), one FFMA a piece and token.
    DENORM: pieces as denormals and x scaled to meet them (qgemv._step's bounds); Q6_K's offset 32 then comes off per
    sub-block with its sum of x."""
    BM: tl.constexpr = acc.shape[0]
    BN: tl.constexpr = acc.shape[1]
    BU: tl.constexpr = acc.shape[2]
    q0, q1, q2, q3 = _split4(q, 1, BN, BU)  # (1, BLOCK_N, BLOCK_U) each
    if FMT == 0:
        h0 = q0 >> 16  # qgemv._piece's pieces past the mantissa
        h1 = q1 >> 16
        h2 = q2 >> 16
        h3 = q3 >> 16
    else:
        b00, b01, b10, b11, b20, b21, b30, b31 = _b_words(q0, q1, q2, q3, g0[None, :, :], g1[None, :, :], FMT, ASM)
    BITS: tl.constexpr = 5 if FMT == 1 else 6
    OFF: tl.constexpr = 32 if FMT == 2 else 0
    p = tl.zeros((BM, BN, BU), tl.float32)
    p2 = tl.zeros((BM, BN, BU), tl.float32)  # Q6_K: the unit's second sub-block
    xs = tl.zeros((BM, 1, BU), tl.float32)
    xs2 = tl.zeros((BM, 1, BU), tl.float32)
    for u in tl.static_range(8):
        if xm is None:
            xl = tl.load(x_at + 4 * u)
        else:
            xl = tl.load(x_at + 4 * u, mask=xm, other=0.0)
        x0, x1, x2, x3 = _split4(xl.to(tl.float32), BM, 1, BU)  # (BLOCK_M, 1, BLOCK_U) each
        if FMT != 2 or DENORM:
            if FMT == 2 and u >= 4:
                xs2 += (x0 + x1) + (x2 + x3)
            else:
                xs += (x0 + x1) + (x2 + x3)
        if FMT == 0:
            if DENORM:
                x0 = _xscale(x0, u, True)
                x1 = _xscale(x1, u, True)
                x2 = _xscale(x2, u, True)
                x3 = _xscale(x3, u, True)
            a0 = _piece(q0, h0, magic, u, True, True, DENORM, ASM)
            a1 = _piece(q1, h1, magic, u, True, True, DENORM, ASM)
            a2 = _piece(q2, h2, magic, u, True, True, DENORM, ASM)
            a3 = _piece(q3, h3, magic, u, True, True, DENORM, ASM)
        else:
            if DENORM:
                x0 = _xscale_b(x0, u // 2)
                x1 = _xscale_b(x1, u // 2)
                x2 = _xscale_b(x2, u // 2)
                x3 = _xscale_b(x3, u // 2)
            if u % 2 == 0:
                w0, w1, w2, w3 = b00, b10, b20, b30
            else:
                w0, w1, w2, w3 = b01, b11, b21, b31
            a0 = _piece_b(w0, w0 >> 16, magic, u // 2, BITS, OFF, DENORM, ASM)
            a1 = _piece_b(w1, w1 >> 16, magic, u // 2, BITS, OFF, DENORM, ASM)
            a2 = _piece_b(w2, w2 >> 16, magic, u // 2, BITS, OFF, DENORM, ASM)
            a3 = _piece_b(w3, w3 >> 16, magic, u // 2, BITS, OFF, DENORM, ASM)
        if FMT == 2 and u >= 4:  # one FFMA a piece and token, into the sub-block's sum
            p2 += a0 * x0
            p2 += a1 * x1
            p2 += a2 * x2
            p2 += a3 * x3
        else:
            p += a0 * x0
            p += a1 * x1
            p += a2 * x2
            p += a3 * x3
    # s (and Q6_K's mn) carry DENORM's 2^XEXP (_scales); one FFMA a term and (token, row, unit)
    acc = acc + p * s[None, :, :]
    if FMT == 2:
        acc = acc + p2 * mn[None, :, :]
        if DENORM:  # the offset 32, per sub-block: - 32 (sum x) d sc, s and mn carrying 2^XEXP
            acc = acc + (xs * NEG32) * s[None, :, :]
            acc = acc + (xs2 * NEG32) * mn[None, :, :]
    else:
        acc = acc - xs * mn[None, :, :]
    return acc


@triton.jit
def _ld(at, mask, other):
    if mask is None:
        v = tl.load(at)
    else:
        v = tl.load(at, mask=mask, other=other)
    return v


@triton.jit
def _fields(q_at, h_at, s_at, m_at, t_at, th_at, u0, NU, nm, w, un, stride_hu, stride_he, stride_sb, stride_tb,
            FMT: tl.constexpr, EVEN: tl.constexpr):
    """The fields of the step from unit u0 (a multiple of 8): nibble words (BLOCK_N, BLOCK_W), high-bit words g0, g1,
    d, dmin, sub words lo, hi (BLOCK_N, BLOCK_U) each (a format's unused ones: another's tensor, never read)."""
    if EVEN:
        qm = None
        um = None
    else:
        qm = nm[:, None] & (u0 + w // 4 < NU)[None, :]
        um = nm[:, None] & (u0 + un < NU)[None, :]
    q = _ld(q_at + u0 * 4, qm, 0)
    d = _ld(s_at + (u0 // 8) * stride_sb, um, 0.0)
    if FMT == 2:
        lo = _ld(t_at + u0 * stride_tb, um, 0)
        hi = lo
        dm = d
    else:
        lo = _ld(t_at + (u0 // 8) * stride_tb, um, 0)
        hi = _ld(th_at + (u0 // 8) * stride_tb, um, 0)
        dm = _ld(m_at + (u0 // 8) * stride_sb, um, 0.0)
    if FMT == 0:
        g0 = lo
        g1 = lo
    elif FMT == 1:
        g0 = _ld(h_at + u0 * stride_hu, um, 0)
        g1 = g0
    else:
        g0 = _ld(h_at + u0 * stride_hu, um, 0)
        g1 = _ld(h_at + u0 * stride_hu + stride_he, um, 0)
    return q, g0, g1, d, dm, lo, hi


@triton.jit
def _gemv_kernel(x_ptr, q_ptr, h_ptr, s_ptr, m_ptr, t_ptr, b_ptr, out_ptr, r_ptr, c_ptr, M, N, NU, OUT, stride_x,
                 stride_q, stride_hu, stride_he, stride_sb, stride_tb, stride_tw, stride_o, magic, FMT: tl.constexpr,
                 BIAS: tl.constexpr, ADD: tl.constexpr, EVEN: tl.constexpr, DENORM: tl.constexpr, ASM: tl.constexpr,
                 MAP: tl.constexpr, XSLOT: tl.constexpr, CNT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    """Program p: rows [p * BLOCK_N, ...) of the weight times each of the M (<= BLOCK_M) rows of x, over NU units,
    BLOCK_U a step (qgemv._gemv_kernel's plan and modes; EVEN: N % BLOCK_N == 0, NU % BLOCK_U == 0, M == BLOCK_M).
    Fields (qlayout_k): q (n, 4 NU) int32 words, row-major; the rest row-innermost: h (high-bit words: stride_hu a
    unit, stride_he a word), s / m (d / dmin: stride_sb a block), t (Q4_K, Q5_K sub words: stride_tb a block,
    stride_tw a word; Q6_K int16 scales: stride_tb a unit)."""
    if CNT:
        if tl.program_id(0) * BLOCK_N >= tl.load(c_ptr):
            return
    BLOCK_W: tl.constexpr = BLOCK_U * 4
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) output rows
    un = tl.arange(0, BLOCK_U)  # (BLOCK_U,) units of a step (8 a block: a step holds whole blocks)
    w = tl.arange(0, BLOCK_W)  # (BLOCK_W,) words of a step: unit w // 4, word w % 4
    mi = tl.arange(0, BLOCK_M)  # (BLOCK_M,) tokens
    nm = n < N
    if MAP:  # (BLOCK_N,) the weight rows output rows n read
        row = tl.load(r_ptr + n // OUT, mask=nm, other=0).to(tl.int64) * OUT + n % OUT
    else:
        row = n
    j = un % 8  # a thread's unit within its block: which 12-bit field of the sub words (Q4_K, Q5_K)
    sh = (12 * j) % 32
    wl = (12 * j) // 32
    q_at = q_ptr + row.to(tl.int64)[:, None] * stride_q + w[None, :]  # (BLOCK_N, BLOCK_W)
    h_at = h_ptr + un[None, :] * stride_hu + row[:, None]  # (BLOCK_N, BLOCK_U)
    s_at = s_ptr + (un // 8)[None, :] * stride_sb + row[:, None]  # (BLOCK_N, BLOCK_U): a thread's rows side by side
    m_at = m_ptr + (un // 8)[None, :] * stride_sb + row[:, None]
    if FMT == 2:
        t_at = t_ptr + un[None, :] * stride_tb + row[:, None]  # (BLOCK_N, BLOCK_U) int16 scale pairs
    else:
        t_at = t_ptr + (un // 8)[None, :] * stride_tb + wl[None, :] * stride_tw + row[:, None]  # the field's word
    th_at = t_at + tl.where(wl < 2, stride_tw, 0)[None, :]  # the next word (the last word: itself)
    x_at = x_ptr + mi[:, None] * stride_x + ((w // 4) * UW + w % 4)[None, :]  # (BLOCK_M, BLOCK_W)
    if XSLOT:
        x_at += (tl.program_id(0) * BLOCK_N // OUT) * stride_x
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_U), tl.float32)
    steps = tl.cdiv(NU, BLOCK_U)
    # a step's fields are loaded before the previous step is computed (registers double-buffered, as qgemv's)
    q, g0, g1, d, dm, lo, hi = _fields(q_at, h_at, s_at, m_at, t_at, th_at, 0, NU, nm, w, un, stride_hu, stride_he,
                                       stride_sb, stride_tb, FMT, EVEN)
    for k in range(1, steps):
        u0 = k * BLOCK_U  # first unit of step k
        qn, g0n, g1n, dn, dmn, lon, hin = _fields(q_at, h_at, s_at, m_at, t_at, th_at, u0, NU, nm, w, un, stride_hu,
                                                  stride_he, stride_sb, stride_tb, FMT, EVEN)
        s, mn = _scales(d, dm, lo, hi, sh, magic, FMT, DENORM, ASM)
        xm = None if EVEN else (mi < M)[:, None] & (u0 - BLOCK_U + w // 4 < NU)[None, :]
        acc = _step(acc, q, g0, g1, s, mn, x_at + (u0 - BLOCK_U) * UW, xm, magic, FMT, DENORM, ASM)
        q, g0, g1, d, dm, lo, hi = qn, g0n, g1n, dn, dmn, lon, hin
    u0 = (steps - 1) * BLOCK_U
    s, mn = _scales(d, dm, lo, hi, sh, magic, FMT, DENORM, ASM)
    xm = None if EVEN else (mi < M)[:, None] & (u0 + w // 4 < NU)[None, :]
    acc = _step(acc, q, g0, g1, s, mn, x_at + u0 * UW, xm, magic, FMT, DENORM, ASM)
    _store(acc, b_ptr, out_ptr, n, nm, mi, M, stride_o, BIAS, ADD)


def strides(w) -> dict[str, int]:
    """The kernels' strides of a K GpuQ's row-innermost fields (qlayout_k; GpuQ stores them so)."""
    six = w.fmt == WeightFormat.Q6_K
    qh = w.qh if w.qh is not None else w.sub
    return {"stride_hu": qh.stride(1), "stride_he": qh.stride(2) if qh.dim() == 3 else 0,
            "stride_sb": w.scales.stride(1), "stride_tb": w.sub.stride(1), "stride_tw": 0 if six else w.sub.stride(2)}


def gemv_config(n: int, k: int, fmt: WeightFormat, m: int = 1, by_index: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_U, num_warps) for a GEMV of an (n, k) K-quant weight by m tokens (by_index: rows picked by
    index): qgemv.gemv_config's plan (a step's units one a thread, BLOCK_U = 32 * num_warps, 2 warps; 8 rows up to 2
    tokens, 4 past that; fewer rows for short n so that every SM gets programs; one warp for short k, and at 1 token
    under 2,048 programs). Where ptxas (sm_90, Triton 3.6) spills the 4-row code (rows by index, 64-bit offsets, past 4
    tokens or masked: 150-340 bytes), 2 rows; rows by index take at most 4 (8: 300 bytes of spills at 1 token, 2
    tokens)."""
    nu = max(8, k // UNIT)
    nw = 2 if nu >= 64 else 1
    bn = 8 if m <= 2 else 4
    if by_index:
        bn = min(bn, 4)
    while bn > 1 and triton.cdiv(n, bn) < 512:
        bn //= 2
    if m == 1 and not by_index and triton.cdiv(n, bn) < 2048:
        nw = 1  # few programs (n 8,192): one warp's programs beat two's at 1 token (bench/qgemv.py --sweep)
    masked = nu % (32 * nw) or n % bn or m & (m - 1)
    if m > 4 and (masked or by_index):
        bn = min(bn, 2)
    return bn, 32 * nw, nw


def gemv(x: torch.Tensor, w, b: torch.Tensor | None, out: torch.Tensor, add: bool = False,
         config: tuple[int, int, int] | None = None, denorm: bool | None = None, rows: torch.Tensor | None = None,
         out_rows: int = 0, x_slot: bool = False, count: torch.Tensor | None = None) -> torch.Tensor:
    """out (m, n) = x (m, k) @ w.T (+ b), or out += that (add), w a Q4_K / Q5_K / Q6_K GpuQ; qgemv.gemv's contract
    otherwise (m <= GEMV_MAX_ROWS, unit last strides; config (BLOCK_N, BLOCK_U, num_warps), BLOCK_U a power of two
    >= 8; denorm; rows / out_rows / x_slot: slices of out_rows rows picked by index; count: a device count of the
    wanted output columns)."""
    m, k = x.shape
    n = w.shape[0]
    if count is not None and rows is None:
        raise ValueError("K-quant GEMV: count= counts rows picked by index: pass rows= (and out_rows=) with it")
    if rows is not None:
        n = len(rows) * out_rows
        if x_slot:
            if m != len(rows) or tuple(out.shape) != (1, n):
                raise ValueError(f"K-quant GEMV by slices: x ({len(rows)}, {k}) and out (1, {n}) expected, got "
                                 f"{tuple(x.shape)} and {tuple(out.shape)}")
            m = 1
    if (m > GEMV_MAX_ROWS or k != w.shape[1] or tuple(out.shape) != (m, n) or x.stride(1) != 1
            or out.stride(1) != 1):
        raise ValueError(f"K-quant GEMV: expected x (<= {GEMV_MAX_ROWS}, {w.shape[1]}) and out ({m}, {n}) with unit "
                         f"last strides, got {tuple(x.shape)} and {tuple(out.shape)}")
    if m == 0 or n == 0:
        return out
    bn, bu, nw = config or gemv_config(n, k, w.fmt, m, by_index=rows is not None)
    while x_slot and out_rows % bn:  # a program's rows within one slice: one x row
        bn //= 2
    bm = triton.next_power_of_2(m)
    denorm = x.dtype != torch.float32 and m <= DENORM_MAX_ROWS if denorm is None else denorm
    nu = k // UNIT
    even = n % bn == 0 and nu % bu == 0 and m == bm
    words = w.qs.view(torch.int32)  # (n, k/8): 4 bytes a word, little-endian
    qh = w.qh if w.qh is not None else w.sub  # never read without high bits
    mins = w.mins if w.mins is not None else w.scales  # never read for Q6_K
    _gemv_kernel[(triton.cdiv(n, bn),)](x, words, qh, w.scales, mins, w.sub, words if b is None else b, out,
                                        words if rows is None else rows, words if count is None else count, m, n, nu,
                                        max(out_rows, 1), x.stride(0), words.stride(0), **strides(w),
                                        stride_o=out.stride(0), magic=MAGIC, FMT=KIND[w.fmt], BIAS=b is not None,
                                        ADD=add, EVEN=even, DENORM=denorm, ASM=x.is_cuda, MAP=rows is not None,
                                        XSLOT=x_slot, CNT=count is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_U=bu,
                                        num_warps=nw)
    return out
