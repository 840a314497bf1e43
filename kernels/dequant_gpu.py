"""The Triton kernels of kernels/dequant.py: a GGUF file's block rows (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) to a
float tensor in one pass (`file_rows`, dequant_rows' device branch), and a GpuQ's rows likewise (`dequant_k` for the
K-quants' layout, kernels/qlayout_k.py; `dequant_q` for Q4_0 / Q4_1 / Q8_0's, kernels/qgemv.py): the prefill path's
chunks. dequant.py says why and how they round; it imports this module only where a kernel runs, so that a CPU
run never loads Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from hotneurons.kernels.names import BLOCK_KIND as KERNEL_FORMATS
from hotneurons.kernels.qgemv import QBLOCK, _mins_ok
from hotneurons.kernels.qgemv_k import KIND, UW, _funnel, strides
from hotneurons.kernels.qlayout_k import K_KIND as K_FORMATS
from hotneurons.weights.formats import WeightFormat, spec


@triton.jit
def _f16_at(row_ptr, at, mask):
    """The little-endian fp16 at byte offsets `at` (any shape) as float32."""
    lo = tl.load(row_ptr + at, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(row_ptr + at + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_file_kernel(d_ptr, out_ptr, N, NB, stride_d, stride_o, KIND: tl.constexpr, BYTES: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    """Program (p, r): rows [p * BLOCK_N, ...), blocks [r * BLOCK_B, ...). KIND 0 Q4_0: w = d (q - 8), the low nibble
    of quant byte j weight j, its high nibble weight 16 + j; 1 Q4_1: w = d q + m, nibbles as Q4_0's; 2 Q8_0:
    w = d q, byte j weight j (int8)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    blk = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    m2 = (n < N)[:, None] & (blk < NB)[None, :]  # (BLOCK_N, BLOCK_B)
    base = d_ptr + n.to(tl.int64)[:, None] * stride_d + blk[None, :] * BYTES  # (BLOCK_N, BLOCK_B) block starts
    s = _f16_at(base, 0, m2)[:, :, None]  # (BLOCK_N, BLOCK_B, 1)
    o_at = out_ptr + n.to(tl.int64)[:, None, None] * stride_o + blk[None, :, None] * 32
    m3 = m2[:, :, None]
    dt = out_ptr.dtype.element_ty
    if KIND == 2:
        j = tl.arange(0, 32)[None, None, :]
        q = tl.load(base[:, :, None] + 2 + j, mask=m3, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        tl.store(o_at + j, (s * q).to(dt), mask=m3)
    else:
        HEAD: tl.constexpr = 4 if KIND == 1 else 2
        j = tl.arange(0, 16)[None, None, :]
        q = tl.load(base[:, :, None] + HEAD + j, mask=m3, other=0)  # (BLOCK_N, BLOCK_B, 16) uint8
        lo, hi = (q & 15).to(tl.float32), (q >> 4).to(tl.float32)
        if KIND == 1:
            mn = _f16_at(base, 2, m2)[:, :, None]
            tl.store(o_at + j, (s * lo + mn).to(dt), mask=m3)
            tl.store(o_at + j + 16, (s * hi + mn).to(dt), mask=m3)
        else:
            tl.store(o_at + j, (s * (lo - 8.0)).to(dt), mask=m3)
            tl.store(o_at + j + 16, (s * (hi - 8.0)).to(dt), mask=m3)


@triton.jit
def _dequant_k_kernel(d_ptr, out_ptr, N, NB, stride_d, stride_o, KIND: tl.constexpr, BYTES: tl.constexpr,
                      BLOCK_R: tl.constexpr):
    """Program p: the (row, block) pairs [p * BLOCK_R, ...) of the N x NB blocks (row-major) to out's dtype. KIND 0
    Q4_K, 1 Q5_K: fp16 d, dmin, 12 bytes of 6-bit scales and mins (ggml's get_scale_min_k4), (Q5_K: 32 bytes, bit j
    of byte l the fifth bit of sub-block j's weight l), 128 bytes: byte 32 p + l holds sub-block 2 p's weight l (low
    nibble) and 2 p + 1's (high); w = d sc q - dmin m. 2 Q6_K: 128 bytes ql (byte 64 h + b: weight 128 h + b low,
    128 h + 64 + b high), 64 bytes qh (byte 32 h + l, bits 2 t: weight 128 h + 32 t + l's top two), 16 int8 scales
    (one a 16 weights), fp16 d; w = d sc (q - 32)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,) (row, block) pairs
    rm = r < N * NB
    row = (r // NB).to(tl.int64)
    blk = r % NB
    base = d_ptr + row * stride_d + blk * BYTES  # (BLOCK_R,) block starts
    o_at = out_ptr + row * stride_o + blk * 256  # (BLOCK_R,) their first weights
    dt = out_ptr.dtype.element_ty
    if KIND == 2:
        e = tl.arange(0, 128)[None, :]  # ql byte: half h = e // 64, b = e % 64
        h, b = e // 64, e % 64
        m2 = rm[:, None]
        ql = tl.load(base[:, None] + e, mask=m2, other=0).to(tl.int32)  # (BLOCK_R, 128)
        qh = tl.load(base[:, None] + 128 + 32 * h + b % 32, mask=m2, other=0).to(tl.int32)
        d = _f16_at(base, 208, rm)[:, None]
        s_lo = tl.load(base[:, None] + 192 + 8 * h + b // 16, mask=m2, other=0).to(tl.int8, bitcast=True)
        s_hi = tl.load(base[:, None] + 196 + 8 * h + b // 16, mask=m2, other=0).to(tl.int8, bitcast=True)
        v_lo = (ql & 15) | (((qh >> (2 * (b // 32))) & 3) << 4)  # weight 128 h + b
        v_hi = (ql >> 4) | (((qh >> (4 + 2 * (b // 32))) & 3) << 4)  # weight 128 h + 64 + b
        at = o_at[:, None] + 128 * h + b
        tl.store(at, ((d * s_lo.to(tl.float32)) * (v_lo - 32).to(tl.float32)).to(dt), mask=m2)
        tl.store(at + 64, ((d * s_hi.to(tl.float32)) * (v_hi - 32).to(tl.float32)).to(dt), mask=m2)
    else:
        j = tl.arange(0, 8)[None, :]  # sub-blocks
        m2 = rm[:, None]
        a = tl.load(base[:, None] + 4 + j, mask=m2, other=0).to(tl.int32)  # (BLOCK_R, 8): scale byte j
        bj = tl.load(base[:, None] + 8 + j, mask=m2, other=0).to(tl.int32)  # byte j + 4
        c = tl.load(base[:, None] + 4 + j % 4, mask=m2, other=0).to(tl.int32)  # byte j - 4 (j >= 4)
        sc = tl.where(j < 4, a & 63, (bj & 15) | ((c >> 6) << 4)).to(tl.float32)
        mn = tl.where(j < 4, bj & 63, (bj >> 4) | ((a >> 6) << 4)).to(tl.float32)
        ds = _f16_at(base, 0, rm)[:, None] * sc  # (BLOCK_R, 8): d sc, exact
        dm = _f16_at(base, 2, rm)[:, None] * mn  # dmin m, exact
        ds0, ds1 = tl.split(tl.reshape(ds, (BLOCK_R, 4, 2)))  # (BLOCK_R, 4): sub-blocks 2 p, 2 p + 1
        dm0, dm1 = tl.split(tl.reshape(dm, (BLOCK_R, 4, 2)))
        pp = tl.arange(0, 4)[None, :, None]
        ll = tl.arange(0, 32)[None, None, :]
        m3 = rm[:, None, None]
        HEAD: tl.constexpr = 48 if KIND == 1 else 16
        q = tl.load(base[:, None, None] + HEAD + 32 * pp + ll, mask=m3, other=0).to(tl.int32)  # (BLOCK_R, 4, 32)
        v0 = q & 15
        v1 = q >> 4
        if KIND == 1:
            qh = tl.load(base[:, None, None] + 16 + ll, mask=m3, other=0).to(tl.int32)  # (BLOCK_R, 1, 32)
            v0 |= ((qh >> (2 * pp)) & 1) << 4
            v1 |= ((qh >> (2 * pp + 1)) & 1) << 4
        at = o_at[:, None, None] + 64 * pp + ll
        tl.store(at, (ds0[:, :, None] * v0.to(tl.float32) - dm0[:, :, None]).to(dt), mask=m3)
        tl.store(at + 32, (ds1[:, :, None] * v1.to(tl.float32) - dm1[:, :, None]).to(dt), mask=m3)


@triton.jit
def _gpuq_k_kernel(q_ptr, h_ptr, s_ptr, m_ptr, t_ptr, out_ptr, N, NU, stride_q, stride_hu, stride_he, stride_sb,
                    stride_tb, stride_tw, stride_o, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    """Program (p, r): rows [p * BLOCK_N, ...), units [r * BLOCK_U, ...) of a K-quant GpuQ (kernels/qlayout_k.py) to
    out's dtype: byte 4 i + c of a unit's nibble words holds weights 8 c + i (low nibble) and 8 c + 4 + i (high),
    their high bits where qlayout_k puts them; each weight's float32 value as gguf-py's (Q4_K, Q5_K: d sc q - dmin m,
    rounded once; Q6_K: d sc (q - 32), exact), rounded to out's dtype."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    un = tl.program_id(1) * BLOCK_U + tl.arange(0, BLOCK_U)
    pb = tl.arange(0, 16)  # byte of a unit's nibble words
    i = (pb // 4)[None, None, :]
    c = (pb % 4)[None, None, :]
    m2 = (n < N)[:, None] & (un < NU)[None, :]  # (BLOCK_N, BLOCK_U)
    m3 = m2[:, :, None]
    n64 = n.to(tl.int64)
    q = tl.load(q_ptr + n64[:, None, None] * stride_q + un[None, :, None] * 16 + pb[None, None, :], mask=m3,
                other=0).to(tl.int32)  # (BLOCK_N, BLOCK_U, 16)
    v0 = q & 15  # weight 8 c + i
    v1 = q >> 4  # weight 8 c + 4 + i
    d = tl.load(s_ptr + (un // 8)[None, :] * stride_sb + n[:, None], mask=m2, other=0.0).to(tl.float32)[:, :, None]
    if FMT == 2:
        g = tl.load(h_ptr + un[None, :, None] * stride_hu + (i // 2) * stride_he + n[:, None, None], mask=m3, other=0)
        at = 8 * c + tl.where(i % 2 == 0, 4, 0)
        v0 |= ((g >> at) & 3) << 4
        v1 |= ((g >> (at + 2)) & 3) << 4
        t = tl.load(t_ptr + un[None, :] * stride_tb + n[:, None], mask=m2, other=0).to(tl.int32)[:, :, None]
        s = d * tl.where(c < 2, (t << 24) >> 24, t >> 8).to(tl.float32)  # (BLOCK_N, BLOCK_U, 16)
        w0 = s * (v0 - 32).to(tl.float32)
        w1 = s * (v1 - 32).to(tl.float32)
    else:
        j = un % 8
        wl = (12 * j) // 32
        t_at = t_ptr + (un // 8)[None, :] * stride_tb + wl[None, :] * stride_tw + n[:, None]
        lo = tl.load(t_at, mask=m2, other=0)
        hi = tl.load(t_at + tl.where(wl < 2, stride_tw, 0)[None, :], mask=m2, other=0)
        f = _funnel(lo, hi, ((12 * j) % 32)[None, :], False)[:, :, None]
        dm = tl.load(m_ptr + (un // 8)[None, :] * stride_sb + n[:, None], mask=m2, other=0.0).to(tl.float32)
        s = d * (f & 0x3F).to(tl.float32)
        mn = dm[:, :, None] * ((f >> 6) & 0x3F).to(tl.float32)
        if FMT == 1:
            g = tl.load(h_ptr + un[None, :] * stride_hu + n[:, None], mask=m2, other=0)[:, :, None]
            k0 = 2 * i  # qlayout_k: the fifth bit of weight 8 c + 4 h + i, k = 2 i + h
            v0 |= ((g >> (8 * c + tl.where(k0 < 4, 4 + k0, k0 - 4))) & 1) << 4
            v1 |= ((g >> (8 * c + tl.where(k0 + 1 < 4, 5 + k0, k0 - 3))) & 1) << 4
        w0 = s * v0.to(tl.float32) - mn
        w1 = s * v1.to(tl.float32) - mn
    o_at = out_ptr + n64[:, None, None] * stride_o + un[None, :, None] * UW + (8 * c + i)
    dt = out_ptr.dtype.element_ty
    tl.store(o_at, w0.to(dt), mask=m3)
    tl.store(o_at + 4, w1.to(dt), mask=m3)


def dequant_k(w, out: torch.Tensor) -> torch.Tensor:
    """out (n, k) (any float dtype, unit last stride) = the weight of a K-quant GpuQ w (the prefill path's chunks of
    rows, kernels/qlinear.py), where w is."""
    n, k = w.shape
    if tuple(out.shape) != (n, k) or out.stride(1) != 1:
        raise ValueError(f"dequant_k: expected out ({n}, {k}) with a unit last stride, got {tuple(out.shape)}")
    nu = k // 32
    if n == 0 or nu == 0:
        return out
    bn, bu = 4, min(32, triton.next_power_of_2(nu))
    qh = w.qh if w.qh is not None else w.sub  # never read without high bits
    mins = w.mins if w.mins is not None else w.scales  # never read for Q6_K
    _gpuq_k_kernel[(triton.cdiv(n, bn), triton.cdiv(nu, bu))](w.qs, qh, w.scales, mins, w.sub, out, n, nu,
                                                               w.qs.stride(0), **strides(w), stride_o=out.stride(0),
                                                               FMT=KIND[w.fmt], BLOCK_N=bn, BLOCK_U=bu, num_warps=4)
    return out


def file_rows(data: torch.Tensor, fmt: WeightFormat, cols: int, out: torch.Tensor) -> torch.Tensor:
    """dequant.dequant_rows' kernels: (rows, row_bytes) uint8 blocks of a kernel format, checked there, into out."""
    rows = data.shape[0]
    if rows == 0 or cols == 0:
        return out
    if fmt in K_FORMATS:
        nbk, nbytes, kind = cols // spec(fmt).block, spec(fmt).block_bytes, K_FORMATS[fmt]
        br = 16 if kind == 2 else 32  # (row, block) pairs a program: 4096 | 8192 weights
        _dequant_k_kernel[(triton.cdiv(rows * nbk, br),)](data, out, rows, nbk, data.stride(0), out.stride(0),
                                                          KIND=kind, BYTES=nbytes, BLOCK_R=br, num_warps=4)
        return out
    nb = cols // spec(fmt).block
    bn, bb = 4, min(64, triton.next_power_of_2(nb))
    _dequant_file_kernel[(triton.cdiv(rows, bn), triton.cdiv(nb, bb))](
        data, out, rows, nb, data.stride(0), out.stride(0), KIND=KERNEL_FORMATS[fmt], BYTES=spec(fmt).block_bytes,
        BLOCK_N=bn, BLOCK_B=bb, num_warps=4)
    return out


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, m_ptr, out_ptr, N, NB, stride_q, stride_sb, stride_mb, stride_o,
                    Q4: tl.constexpr, MIN: tl.constexpr, BB: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_B: tl.constexpr):
    """Program (p, r): rows [p * BLOCK_N, ...), blocks [r * BLOCK_B, ...) of the weight to out's dtype (scale * (q - 8)
    | scale * q + min (MIN, Q4_1) | scale * q in float32, rounded to out's dtype), from the kernel order back to the
    weights' order."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    blk = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    p = tl.arange(0, BB)  # (BB,) byte p of a block: byte t of word i, p = 4 i + t
    m3 = (n < N)[:, None, None] & (blk < NB)[None, :, None]  # (BLOCK_N, BLOCK_B, 1): broadcast over a block
    n64 = n.to(tl.int64)[:, None, None]
    q = tl.load(q_ptr + n64 * stride_q + blk[None, :, None] * BB + p[None, None, :], mask=m3, other=0)
    s = tl.load(s_ptr + blk[None, :, None] * stride_sb + n64, mask=m3, other=0.0).to(tl.float32)  # (.., 1)
    o_at = out_ptr + n64 * stride_o + blk[None, :, None] * 32
    dt = out_ptr.dtype.element_ty
    if Q4 and MIN:  # Q4_1's nibbles, placed as Q4_0's below; s q exact, + min rounded once (as gguf-py's float32)
        mn = tl.load(m_ptr + blk[None, :, None] * stride_mb + n64, mask=m3, other=0.0).to(tl.float32)  # (.., 1)
        wi = 8 * (p % 4) + p // 4
        tl.store(o_at + wi[None, None, :], (s * (q & 15).to(tl.float32) + mn).to(dt), mask=m3)
        tl.store(o_at + wi[None, None, :] + 4, (s * (q >> 4).to(tl.float32) + mn).to(dt), mask=m3)
    elif Q4:  # nibbles 2t, 2t + 1 of word i: weights 8 t + i, 8 t + 4 + i
        wi = 8 * (p % 4) + p // 4
        tl.store(o_at + wi[None, None, :], (s * ((q & 15).to(tl.float32) - 8.0)).to(dt), mask=m3)
        tl.store(o_at + wi[None, None, :] + 4, (s * ((q >> 4).to(tl.float32) - 8.0)).to(dt), mask=m3)
    else:  # byte t of word i: weight 16 (i // 4) + 4 t + i % 4
        wi = 16 * (p // 16) + 4 * (p % 4) + (p // 4) % 4
        tl.store(o_at + wi[None, None, :], (s * q.to(tl.float32)).to(dt), mask=m3)


def dequant_q(qs: torch.Tensor, scales: torch.Tensor, q4: bool, out: torch.Tensor,
            mins: torch.Tensor | None = None) -> torch.Tensor:
    """out (n, k) (any float dtype, unit last stride) = the weight of (qs, scales[, mins]) (block-major scales; mins:
    Q4_1's, as gemv's)."""
    n, nb = scales.shape
    if (tuple(out.shape) != (n, nb * QBLOCK) or out.stride(1) != 1 or scales.stride(0) != 1
            or not _mins_ok(mins, scales, q4)):
        raise ValueError(f"dequant_q: expected out ({n}, {nb * QBLOCK}) with a unit last stride, block-major scales "
                         f"(and 4-bit mins of their shape), got {tuple(out.shape)}")
    if n == 0 or nb == 0:
        return out
    bn, bb = 8, min(32, triton.next_power_of_2(max(1, nb)))
    ms = scales if mins is None else mins  # (n, nb) block-major; without MIN never read
    _dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(nb, bb))](qs, scales, ms, out, n, nb, qs.stride(0),
                                                                scales.stride(1), ms.stride(1), out.stride(0), Q4=q4,
                                                                MIN=mins is not None, BB=16 if q4 else 32,
                                                                BLOCK_N=bn, BLOCK_B=bb, num_warps=4)
    return out
