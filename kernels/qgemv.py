"""Triton kernels over 4- and 8-bit block weights in kernels/qlinear.py's GPU layout (`GpuQ`).

The layout: an (n, k) Q4_0, Q4_1 or Q8_0 weight split, once at load, into two tensors (three for Q4_1) with the GGUF
file's bytes:
  qs      (n, k/2) uint8 (Q4_0, Q4_1) or (n, k) int8 (Q8_0), row-major: each 32-weight block's 16 or 32 bytes, as 4
          or 8 little-endian int32 words, their quants reordered within the block (KERNEL ORDER below) so that the
          kernel's pieces of a word meet contiguous x
  scales  (n, k/32) fp16 stored block-major (stride (1, n)): a block's scales for consecutive rows side by side
  mins    Q4_1 only: (n, k/32) fp16, block-major as the scales
so a row's quants are contiguous and 16-byte aligned (wide loads), which llama.cpp's interleaved 18-, 20- and 34-byte
blocks are not. Total bytes are the file's: 18/32 (Q4_0), 20/32 (Q4_1) and 34/32 (Q8_0) bytes a weight.

KERNEL ORDER, within a block (w = scale * (q - 8) for Q4_0, scale * q + min for Q4_1, scale * q for Q8_0, as in the
file):
  Q4_0, Q4_1  word i (0..3), nibble u (bits 4u..4u+3, 0..7) = q of weight 4 u + i
  Q8_0  word i (0..7), byte t (bits 8t..8t+7, 0..3) = q of weight 16 (i // 4) + 4 t + i % 4
so piece u (t) of the block's words meets x[4 u + (0..3)] (x[4 t + (0..3)] and x[16 + 4 t + (0..3)]): contiguous
runs of 4, loaded in the quants' own register layout (Triton then moves nothing through shared memory in
the loop).

  gemv     y (m, n) = x (m, k) @ w.T (+ b), or h += that, for m <= GEMV_MAX_ROWS tokens: each program reads
           BLOCK_N rows of quants and scales once and multiplies them into every token's x (float32 sums), so the
           weight's bytes are read once whatever m is. One token is bound by issued instructions as much as by
           bytes (H200: 4.1 TB/s / 0.5625 bytes = 7.4e12 Q4_0 weights a second, against 3.3e13 instructions
           issued at best), so a weight takes as few as possible: a thread loads 16 bytes of each of its rows at
           once, the next step's quants while it computes this one's (registers double-buffered), and turns each
           piece into a float with no conversion instruction: for fp16 / bf16 x and up to DENORM_MAX_ROWS tokens, one
           LOP3 (the piece as a denormal float; x scaled per piece, the offset 8 | 128 taken off per unit with the
           sum of x), else one LOP3 and one FADD (2^23 offset); then one FFMA a token into one register per (token,
           row, unit) (_gemv_kernel, _step, _piece say how). sm_90's code (Triton 3.6): 2.7 instructions a Q4_0
           weight, 3.4 a Q8_0 one, at one token; 1.65-1.9 a weight and token at 8 (gemv_config's notes). Q4_1 runs
           Q4_0's code with no offset (pieces are q, 0..15) and adds min * (the unit's sum of x) once a unit and row
           (MIN): one more load of fp16 mins a block and one FFMA a unit, next to Q4_0's 32 weights' work.
           More tokens cost an FMA each a weight: past GEMV_MAX_ROWS, the tensor cores of the prefill path win.
(kernels/dequant_gpu.py's `dequant_q` turns rows of a GpuQ into a float tensor for the prefill path.)

No host syncs, no allocations: capturable in CUDA graphs (after a first call outside the capture compiles them).
Without CUDA the tests run them in Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from hotneurons.weights.formats import WeightFormat, spec

GEMV_MAX_ROWS = 8  # tokens the GEMV takes in one pass; more go through dequant + matmul
DENORM_MAX_ROWS = 2  # tokens up to which the GEMV takes pieces as denormals (_piece), for fp16 / bf16 x
QBLOCK = spec(WeightFormat.Q4_0).block  # weights per Q4_0 / Q4_1 / Q8_0 block (32)


# float32 exponent field of 2^23 (150 << 23), a runtime argument: the pieces' LOP3 takes its per-piece variant from a
# register (derived once a program), with the piece's mask as its one immediate (as constants, ptxas re-materializes
# them inside the loop: a MOV a piece). Denormal pieces (_piece, DENORM) need the GPU's denormals kept: Triton's
# float32 arithmetic is not flush-to-zero (no .ftz in its PTX), nor is the interpreter's numpy.
MAGIC = 150 << 23
FLIP4 = tl.constexpr(-0x7F7F7F80)  # 0x80808080 as int32: XOR-ed into 4 int8s, each becomes q + 128 (unsigned)
XEXP = tl.constexpr(100)  # DENORM: products carry 2^-XEXP (see _step)


@triton.jit
def _lop(src, b, MASK: tl.constexpr, ASM: tl.constexpr):
    """(src & MASK) ^ b, one LOP3 (compiled: inline PTX, as ptxas, short of registers, sometimes splits it in two;
    Triton's interpreter: plain operators)."""
    if ASM:
        bb = tl.zeros_like(src) + b
        if MASK == 0xF:
            return tl.inline_asm_elementwise("lop3.b32 $0, $1, 0xF, $2, 0x6A;", "=r,r,r", [src, bb], tl.int32, True, 1)
        elif MASK == 0xF0:
            return tl.inline_asm_elementwise("lop3.b32 $0, $1, 0xF0, $2, 0x6A;", "=r,r,r", [src, bb], tl.int32, True, 1)
        elif MASK == 0xF00:
            return tl.inline_asm_elementwise("lop3.b32 $0, $1, 0xF00, $2, 0x6A;", "=r,r,r", [src, bb], tl.int32, True,
                                             1)
        elif MASK == 0xF000:
            return tl.inline_asm_elementwise("lop3.b32 $0, $1, 0xF000, $2, 0x6A;", "=r,r,r", [src, bb], tl.int32, True,
                                             1)
        elif MASK == 0xF0000:
            return tl.inline_asm_elementwise("lop3.b32 $0, $1, 0xF0000, $2, 0x6A;", "=r,r,r", [src, bb], tl.int32,
                                             True, 1)
        elif MASK == 0xFF:
            return tl.inline_asm_elementwise("lop3.b32 $0, $1, 0xFF, $2, 0x6A;", "=r,r,r", [src, bb], tl.int32, True, 1)
        elif MASK == 0xFF00:
            return tl.inline_asm_elementwise("lop3.b32 $0, $1, 0xFF00, $2, 0x6A;", "=r,r,r", [src, bb], tl.int32, True,
                                             1)
        else:
            tl.static_assert(MASK == 0xFF0000)
            return tl.inline_asm_elementwise("lop3.b32 $0, $1, 0xFF0000, $2, 0x6A;", "=r,r,r", [src, bb], tl.int32,
                                             True, 1)
    else:
        return (src & MASK) ^ b


@triton.jit
def _piece(q, q2, magic, u: tl.constexpr, Q4: tl.constexpr, MIN: tl.constexpr, DENORM: tl.constexpr,
           ASM: tl.constexpr):
    """Piece u (nibble | byte) of int32 words q (q2 = q >> 16; Q8_0 with DENORM: both with their bytes' sign bits
    flipped) as float32, with no conversion instruction: the piece, masked in place at bit sh (pieces past bit 23
    from q2), becomes a float's mantissa.
    DENORM: alone, a denormal: exactly Q 2^(sh - 149), Q = q (Q4_0, Q4_1) | q + 128 (Q8_0), one LOP3 (x is scaled by
    2^(149 - sh - XEXP) to meet it, and Q4_0's / Q8_0's offset 8 | 128 is taken off per unit with the sum of x: _step).
    Else: OR-ed into a float whose exponent (150 - sh) puts the piece's lowest bit at 1, 2^(23 - sh) + Q (Q8_0's sign
    bit flipped by the same LOP3), and one FADD takes 2^(23 - sh) + 8 | 0 | 128 off: exactly q - 8 (Q4_0) | q (Q4_1,
    MIN) | q (Q8_0)."""
    W: tl.constexpr = 4 if Q4 else 8
    SH0: tl.constexpr = W * u
    HI: tl.constexpr = SH0 + W > 23
    SH: tl.constexpr = SH0 - 16 if HI else SH0
    MASK: tl.constexpr = ((1 << W) - 1) << SH
    src = q2 if HI else q
    if DENORM:
        return (src & MASK).to(tl.float32, bitcast=True)
    FLIP: tl.constexpr = 0 if Q4 else 128 << SH
    OFF: tl.constexpr = float(2 ** (23 - SH) + (0 if MIN else 8 if Q4 else 128))
    b = magic - (SH << 23) + FLIP  # exponent 150 - sh (and the sign flip), outside | inside the mask
    return _lop(src, b, MASK, ASM).to(tl.float32, bitcast=True) - OFF


@triton.jit
def _xscale(x, u: tl.constexpr, Q4: tl.constexpr):
    """x * 2^(149 - sh - XEXP), sh: piece u's bit in its word (_piece)."""
    W: tl.constexpr = 4 if Q4 else 8
    SH: tl.constexpr = W * u - 16 if W * u + W > 23 else W * u
    return x * float(2 ** (149 - SH - XEXP))


@triton.jit
def _split4(t, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    """(A, B, C * 4) -> its 4 elements of each group of 4 along the last axis, (A, B, C) each (in-thread: free)."""
    e, o = tl.split(tl.reshape(t, (A, B, C, 2, 2)))  # elements 0, 2 | 1, 3
    t0, t2 = tl.split(e)
    t1, t3 = tl.split(o)
    return t0, t1, t2, t3


@triton.jit
def _step(acc, q, s, mn, x_at, xm, magic, Q4: tl.constexpr, MIN: tl.constexpr, DENORM: tl.constexpr,
          ASM: tl.constexpr):
    """acc (BLOCK_M, BLOCK_N, BLOCK_U) += each unit's sum of weights times x, scaled: q (BLOCK_N, BLOCK_U * 4) words
    (unit w // 4, word w % 4), s (BLOCK_N, BLOCK_U) their scales as float32, mn (MIN, Q4_1: BLOCK_N, BLOCK_U) their
    mins as float32, which add mn * (the unit's sum of x) (else None), x_at (BLOCK_M, BLOCK_U * 4) the x of
    each word's piece 0 (piece u: + 4 u), masked by xm (None: no mask). Loads are 2-D, contiguous along their last
    axis (so that Triton's coalescing gives a thread a unit's 4 words, whatever its version); a unit's 4 words
    (and their x) are split apart in registers, so that each (token, row, unit) sums into one register, a chain of
    FFMAs. DENORM: pieces as denormals (_piece), x scaled by 2^(149 - sh - XEXP): products Q x 2^-XEXP, normal
    for |x| >= 2^(XEXP - 126) (smaller ones lose bits, < 2^-(149 - XEXP) each, absolute), finite for
    |x| < 2^(XEXP - 21); a unit's sum is 2^XEXP (sum Q x) - (8 | 0 | 128) sum x."""
    BM: tl.constexpr = acc.shape[0]
    BN: tl.constexpr = acc.shape[1]
    BU: tl.constexpr = acc.shape[2]
    if DENORM and not Q4:
        q = q ^ FLIP4  # 4 x (q + 128): unsigned bytes
    q0, q1, q2, q3 = _split4(q, 1, BN, BU)  # (1, BLOCK_N, BLOCK_U) each
    h0 = q0 >> 16  # the top half's pieces moved down, below the mantissa's 23 bits (the sign bits are masked off)
    h1 = q1 >> 16
    h2 = q2 >> 16
    h3 = q3 >> 16
    p = tl.zeros((BM, BN, BU), tl.float32)
    xs = tl.zeros((BM, 1, BU), tl.float32)
    for u in tl.static_range(8 if Q4 else 4):  # pieces of a word: nibbles at bit 4 u | bytes at bit 8 u
        if xm is None:
            xl = tl.load(x_at + 4 * u)
        else:
            xl = tl.load(x_at + 4 * u, mask=xm, other=0.0)
        x0, x1, x2, x3 = _split4(xl.to(tl.float32), BM, 1, BU)  # (BLOCK_M, 1, BLOCK_U) each
        if DENORM or MIN:
            xs += (x0 + x1) + (x2 + x3)
        if DENORM:
            x0 = _xscale(x0, u, Q4)
            x1 = _xscale(x1, u, Q4)
            x2 = _xscale(x2, u, Q4)
            x3 = _xscale(x3, u, Q4)
        p += _piece(q0, h0, magic, u, Q4, MIN, DENORM, ASM) * x0
        p += _piece(q1, h1, magic, u, Q4, MIN, DENORM, ASM) * x1
        p += _piece(q2, h2, magic, u, Q4, MIN, DENORM, ASM) * x2
        p += _piece(q3, h3, magic, u, Q4, MIN, DENORM, ASM) * x3
    if DENORM and MIN:
        p = p * float(2 ** XEXP)
    elif DENORM:
        p = p * float(2 ** XEXP) - xs * (8.0 if Q4 else 128.0)
    if MIN:  # Q4_1: the unit's sum of (s q + m) x = s (sum q x) + m (sum x)
        return acc + p * s[None, :, :] + xs * mn[None, :, :]
    return acc + p * s[None, :, :]


@triton.jit
def _gemv_kernel(x_ptr, q_ptr, s_ptr, m_ptr, b_ptr, out_ptr, r_ptr, c_ptr, M, N, NB, OUT, stride_x, stride_q,
                 stride_sb, stride_mb, stride_o, magic, Q4: tl.constexpr, MIN: tl.constexpr, BIAS: tl.constexpr,
                 ADD: tl.constexpr, EVEN: tl.constexpr, DENORM: tl.constexpr, ASM: tl.constexpr, MAP: tl.constexpr,
                 XSLOT: tl.constexpr, CNT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_B: tl.constexpr):
    """Program p: rows [p * BLOCK_N, ...) of the weight times each of the M (<= BLOCK_M) rows of x, over NB blocks
    of 32 weights, BLOCK_B blocks a step. The quants are read as 16-byte units of 4 int32 words (a Q4_0 block, half
    a Q8_0 block: 32 | 16 weights), in the module's kernel order, a step's units across the program's threads (one
    or more a thread) and its BLOCK_N rows in each thread's registers, so that a thread's x values (loaded and
    widened once a step) serve all its rows; scales block-major (stride_sb between blocks, 1 between rows); MIN
    (Q4_1): mins as the scales (stride_mb), loaded with them. Each piece of a word becomes q - 8 (q) as a float by
    one LOP3 and one FADD (_piece), then one FFMA a token. Sums are
    float32: per (token, row, unit) over a step's pieces and words, scaled, added across steps, summed across
    units at the end; + b in float32, rounded once to out's dtype (ADD: out + that, rounded once; with BIAS the
    linear is rounded first, as fused.add_linear rounds). A step's quants and scales are loaded before the previous
    step is computed (registers double-buffered: the loads of one step in flight during the other's arithmetic).
    EVEN: N % BLOCK_N == 0, NB % BLOCK_B == 0 and M == BLOCK_M (no masks). ASM: inline PTX (compiled, not
    interpreted). MAP: output row n reads weight row r[n // OUT] * OUT + n % OUT (slices of OUT rows picked by
    index: a mixture's routed experts in their stack); XSLOT: the program's x is row (its first row) // OUT of x
    (each slice its own input; OUT a multiple of BLOCK_N, M 1). CNT: only the first c[0] output rows are wanted (a
    count on the device: kernels/gated.py's passing neurons), programs past them exit at once, so that the bytes read
    follow the count, not N; the last program's rows past it are computed from whatever r holds there."""
    if CNT:
        if tl.program_id(0) * BLOCK_N >= tl.load(c_ptr):
            return
    UPB: tl.constexpr = 1 if Q4 else 2  # 16-byte units a block
    UW: tl.constexpr = 32 // UPB  # weights a unit
    BLOCK_U: tl.constexpr = BLOCK_B * UPB
    BLOCK_W: tl.constexpr = BLOCK_U * 4
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) weight rows
    un = tl.arange(0, BLOCK_U)  # (BLOCK_U,) units of a step
    w = tl.arange(0, BLOCK_W)  # (BLOCK_W,) words of a step: unit w // 4, word w % 4
    mi = tl.arange(0, BLOCK_M)  # (BLOCK_M,) tokens
    nm = n < N
    if MAP:  # (BLOCK_N,) the weight rows output rows n read
        nw = tl.load(r_ptr + n // OUT, mask=nm, other=0).to(tl.int64) * OUT + n % OUT
        q_at = q_ptr + nw[:, None] * stride_q + w[None, :]  # (BLOCK_N, BLOCK_W)
        s_at = s_ptr + (un // UPB)[None, :] * stride_sb + nw[:, None]  # (BLOCK_N, BLOCK_U)
        m_at = m_ptr + (un // UPB)[None, :] * stride_mb + nw[:, None]  # (BLOCK_N, BLOCK_U)
    else:  # the dense path's code as tuned (32-bit row offsets for the scales)
        q_at = q_ptr + n.to(tl.int64)[:, None] * stride_q + w[None, :]  # (BLOCK_N, BLOCK_W)
        s_at = s_ptr + (un // UPB)[None, :] * stride_sb + n[:, None]  # (BLOCK_N, BLOCK_U): a thread's rows side by side
        m_at = m_ptr + (un // UPB)[None, :] * stride_mb + n[:, None]  # (BLOCK_N, BLOCK_U): MIN's mins, as s_at
    x_at = x_ptr + mi[:, None] * stride_x + ((w // 4) * UW + w % 4)[None, :]  # (BLOCK_M, BLOCK_W)
    if XSLOT:
        x_at += (tl.program_id(0) * BLOCK_N // OUT) * stride_x
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_U), tl.float32)
    steps = tl.cdiv(NB, BLOCK_B)
    # MIN: the step's mins mn (BLOCK_N, BLOCK_U) float32, loaded, double-buffered and passed on as the scales; without
    # MIN the names are never made (constexpr branches), so Q4_0's and Q8_0's code is as before
    if EVEN:
        q = tl.load(q_at)  # (BLOCK_N, BLOCK_W) int32
        s = tl.load(s_at).to(tl.float32)  # (BLOCK_N, BLOCK_U)
        if MIN:
            mn = tl.load(m_at).to(tl.float32)  # (BLOCK_N, BLOCK_U)
    else:
        q = tl.load(q_at, mask=nm[:, None] & (w // (4 * UPB) < NB)[None, :], other=0)
        s = tl.load(s_at, mask=nm[:, None] & (un // UPB < NB)[None, :], other=0.0).to(tl.float32)
        if MIN:
            mn = tl.load(m_at, mask=nm[:, None] & (un // UPB < NB)[None, :], other=0.0).to(tl.float32)
    for j in range(1, steps):
        b0 = j * BLOCK_B  # first block of step j
        if EVEN:
            qn = tl.load(q_at + b0 * (UPB * 4))
            sn = tl.load(s_at + b0 * stride_sb).to(tl.float32)
            if MIN:
                mnn = tl.load(m_at + b0 * stride_mb).to(tl.float32)
            acc = _step(acc, q, s, mn if MIN else None, x_at + (b0 - BLOCK_B) * 32, None, magic, Q4, MIN, DENORM,
                        ASM)
        else:
            qn = tl.load(q_at + b0 * (UPB * 4), mask=nm[:, None] & (b0 + w // (4 * UPB) < NB)[None, :], other=0)
            sn = tl.load(s_at + b0 * stride_sb, mask=nm[:, None] & (b0 + un // UPB < NB)[None, :],
                         other=0.0).to(tl.float32)
            if MIN:
                mnn = tl.load(m_at + b0 * stride_mb, mask=nm[:, None] & (b0 + un // UPB < NB)[None, :],
                              other=0.0).to(tl.float32)
            xm = (mi < M)[:, None] & (b0 - BLOCK_B + w // (4 * UPB) < NB)[None, :]
            acc = _step(acc, q, s, mn if MIN else None, x_at + (b0 - BLOCK_B) * 32, xm, magic, Q4, MIN, DENORM, ASM)
        q = qn
        s = sn
        if MIN:
            mn = mnn
    b0 = (steps - 1) * BLOCK_B
    if EVEN:
        acc = _step(acc, q, s, mn if MIN else None, x_at + b0 * 32, None, magic, Q4, MIN, DENORM, ASM)
    else:
        acc = _step(acc, q, s, mn if MIN else None, x_at + b0 * 32,
                    (mi < M)[:, None] & (b0 + w // (4 * UPB) < NB)[None, :], magic, Q4, MIN, DENORM, ASM)
    _store(acc, b_ptr, out_ptr, n, nm, mi, M, stride_o, BIAS, ADD)


@triton.jit
def _store(acc, b_ptr, out_ptr, n, nm, mi, M, stride_o, BIAS: tl.constexpr, ADD: tl.constexpr):
    """A GEMV program's end: the (BLOCK_M, BLOCK_N, lanes) float32 sums added up, + bias, rounded to out's dtype and
    stored, or added to what out holds (the biased sum rounded first, as y = x W^T + b then out += y would)."""
    y = tl.sum(acc, axis=2)  # (BLOCK_M, BLOCK_N) float32
    if BIAS:
        y += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    o_at = out_ptr + mi[:, None] * stride_o + n[None, :]
    om = (mi < M)[:, None] & nm[None, :]
    dt = out_ptr.dtype.element_ty
    if ADD:
        if BIAS:
            y = y.to(dt).to(tl.float32)
        y += tl.load(o_at, mask=om, other=0.0).to(tl.float32)
    tl.store(o_at, y.to(dt), mask=om)


def _pow2(v: int) -> int:
    return triton.next_power_of_2(max(1, v))


def gemv_config(n: int, k: int, q4: bool, m: int = 1) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_B, num_warps) for a GEMV of an (n, k) weight by m tokens. A step's 16-byte units span the
    program's threads, one a thread (BLOCK_B * units a block = 32 * num_warps: Triton then lays the warps along the
    units and a program's rows in each thread's registers, so that a thread's x values, loaded and widened once a step,
    serve all its rows). From bench/qgemv.py --sweep on an H200 (Triton 3.6) at the 70B shapes (docs/history.md,
    2026-11-26-nvidia-h200-qgemv): 2 warps; Q4_0 8 rows up to 2 tokens, 4 past that (sums of each token and row are
    registers: 8 rows by 8 tokens spill); Q8_0 8 rows up to 2 tokens, then 4. sm_90's code (ptxas, Triton 3.6): Q4_0 2.7
    instructions a weight (denormal pieces, 1 token, 127 registers), Q8_0 3.4 (8 rows); 8 tokens: 1.65 a weight and
    token (4 rows, 168 registers). Fewer rows for short n, so that every SM gets programs; one warp for short k. Q4_1
    (q4, with mins) takes Q4_0's configuration, not swept on its own."""
    nb = max(1, k // QBLOCK)
    upb = 1 if q4 else 2  # 16-byte units a block
    nw = 2 if nb * upb >= 64 else 1
    bb = 32 * nw // upb
    bn = 8 if m <= 2 else 4
    while bn > 1 and triton.cdiv(n, bn) < 512:
        bn //= 2
    return bn, bb, nw


def _mins_ok(mins: torch.Tensor | None, scales: torch.Tensor, q4: bool) -> bool:
    """Q4_1's mins, where given: 4-bit quants, the scales' shape, block-major."""
    return mins is None or (q4 and tuple(mins.shape) == tuple(scales.shape) and mins.stride(0) == 1)


def gemv(x: torch.Tensor, qs: torch.Tensor, scales: torch.Tensor, q4: bool, b: torch.Tensor | None,
         out: torch.Tensor, add: bool = False, config: tuple[int, int, int] | None = None,
         denorm: bool | None = None, mins: torch.Tensor | None = None, rows: torch.Tensor | None = None,
         out_rows: int = 0, x_slot: bool = False, count: torch.Tensor | None = None) -> torch.Tensor:
    """out (m, n) = x (m, k) @ w.T (+ b), or out += that (add), w = (qs, scales[, mins]) in the GpuQ layout (mins:
    Q4_1's, with q4; None for Q4_0 and Q8_0); m <= GEMV_MAX_ROWS, x and out with unit stride along their last
    dimension. config: (BLOCK_N, BLOCK_B, num_warps), else gemv_config's. denorm: pieces as denormals (_piece; |x|
    must stay under 2^79, see _step), else with the 2^23 offset; None: denormals for fp16 / bf16 x and up to
    DENORM_MAX_ROWS tokens (fewer instructions a weight; past that, x's per-token scaling costs more than the FADD
    it saves). rows (r,) int64 with out_rows: w's slices of out_rows rows [rows[i] * out_rows, ...) stacked, n = r *
    out_rows (a mixture's routed experts read in place from their stack); x_slot: slice i times x's row i (m is then
    1 for the product, x (r, k), out (1, n)). count (1,) int32 on the device, with rows: only out's first count[0]
    columns are wanted (rows[:count[0]] valid, the rest any valid row index); the rest of out is left undefined."""
    m, k = x.shape
    n, nb = scales.shape
    if count is not None and rows is None:
        raise ValueError("quantized GEMV: count= counts rows picked by index: pass rows= (and out_rows=) with it")
    if rows is not None:
        n = len(rows) * out_rows
        if x_slot:
            if m != len(rows) or tuple(out.shape) != (1, n):
                raise ValueError(f"quantized GEMV by slices: x ({len(rows)}, {k}) and out (1, {n}) expected, got "
                                 f"{tuple(x.shape)} and {tuple(out.shape)}")
            m = 1
    if (m > GEMV_MAX_ROWS or k != nb * QBLOCK or tuple(out.shape) != (m, n) or x.stride(1) != 1 or out.stride(1) != 1
            or scales.stride(0) != 1 or not _mins_ok(mins, scales, q4)):
        raise ValueError(f"quantized GEMV: expected x (<= {GEMV_MAX_ROWS}, {nb * QBLOCK}) and out ({m}, {n}) with "
                         f"unit last strides and block-major scales (and 4-bit mins of their shape), got "
                         f"{tuple(x.shape)} and {tuple(out.shape)}")
    if m == 0 or n == 0:  # nothing to compute (e.g. a layer with no hot rows): no launch of an empty grid
        return out
    bn, bb, nw = config or gemv_config(n, k, q4, m)
    while x_slot and out_rows % bn:  # a program's rows within one slice: one x row
        bn //= 2
    bm = _pow2(m)
    denorm = x.dtype != torch.float32 and m <= DENORM_MAX_ROWS if denorm is None else denorm
    even = n % bn == 0 and nb % bb == 0 and m == bm
    words = qs.view(torch.int32)  # (n, k/8 | k/4): 4 bytes a word, little-endian
    ms = scales if mins is None else mins  # (n, nb) block-major; without MIN never read
    _gemv_kernel[(triton.cdiv(n, bn),)](x, words, scales, ms, words if b is None else b, out,
                                        words if rows is None else rows, words if count is None else count, m, n,
                                        nb, max(out_rows, 1), x.stride(0), words.stride(0), scales.stride(1),
                                        ms.stride(1), out.stride(0), MAGIC, Q4=q4,
                                        MIN=mins is not None, BIAS=b is not None, ADD=add, EVEN=even, DENORM=denorm,
                                        ASM=x.is_cuda, MAP=rows is not None, XSLOT=x_slot, CNT=count is not None,
                                        BLOCK_M=bm, BLOCK_N=bn, BLOCK_B=bb, num_warps=nw)
    return out
