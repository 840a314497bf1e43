"""Triton kernels for a decode step's ops on the GPU (runtime/static_decoder.py), one kernel where torch runs several.

The same functions as ops.py's torch ops (`ops.Ops`), with the same arguments and the same roundings where
torch rounds (each torch kernel's output is rounded to the model dtype; the kernels here round at the same
points), so that a step through them gives the plain step's outputs up to the order of float32 sums:

  residual_norm  h = h2_prev + hot (+ the CPU's float32 cold sum, read over PCIe), then RMSNorm: 1 kernel, not 4
  weighted_rms   RMSNorm with its weight: 1 kernel, not 2
  rope_cache     RoPE on the q and k heads, k and v written into the caches at the step's position: 1, not 5
  attend         a decode query's attention over the cache slots up to its position (split over the slots, then
                 the splits combined): 2 kernels, not 4, reading only the filled slots where the plain op reads
                 the whole static cache behind a mask
  predict        the predictor's two GEMVs, its ReLU and its decision, counted into the firings and written into the
                 cold masks on the device (bytes) and the host (bits) (ops.predict): 2 kernels, not 8
  linear         one token's GEMV (+ bias), rounded once as cuBLAS rounds: the q/k/v projection, the LM head
  add_linear     the same added into the residual, as addmm_ (o_proj)

Used inside CUDA graphs (RuntimeConfig.ops == "triton"); on machines without CUDA the tests run the same kernels in
Triton's interpreter (TRITON_INTERPRET=1) against the plain ops.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

SPLITS = 16  # attention: slot ranges per kv head, so that kv heads x splits fill the GPU on a long cache
MIN_SLOTS = 64  # attention: slots per range at least (and per loop step), so that short caches take few programs
# Triton's interpreter (3.9) multiplies half-precision tl.dot operands as their raw bits: there they are widened to
# float32 first (the products are exact either way; the sums are float32 in both)
WIDEN_DOT = os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(n))


@triton.jit
def _rms_kernel(a_ptr, b_ptr, c_ptr, w_ptr, h_ptr, r_ptr, d, eps,
                RESIDUAL: tl.constexpr, COLD: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row of d. RESIDUAL: h = a + b (+ c, float32), rounded as torch's add and add_ round, stored
    into h_ptr; else h = a. Then r = w * rms_norm(h), rounded after the norm and after the weight."""
    row = tl.program_id(0).to(tl.int64) * d
    o = tl.arange(0, BLOCK)
    m = o < d
    dt = r_ptr.dtype.element_ty
    h = tl.load(a_ptr + row + o, mask=m, other=0.0).to(tl.float32)
    if RESIDUAL:
        h = (h + tl.load(b_ptr + row + o, mask=m, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
        if COLD:
            h = (h + tl.load(c_ptr + row + o, mask=m, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
        tl.store(h_ptr + row + o, h.to(dt), mask=m)
    n = (h * tl.math.rsqrt(tl.sum(h * h, axis=0) / d + eps)).to(dt).to(tl.float32)  # torch's fused rms_norm
    w = tl.load(w_ptr + o, mask=m, other=0.0).to(tl.float32)
    tl.store(r_ptr + row + o, (w * n).to(dt), mask=m)


def _rows(t: torch.Tensor, d: int) -> int:
    if not t.is_contiguous() or t.numel() % d:
        raise ValueError(f"expected a contiguous tensor of rows of {d}, got shape {tuple(t.shape)}")
    return t.numel() // d


def _rms(a, b, c, w, eps, h, r) -> torch.Tensor:
    d = w.numel()
    n = _rows(a, d)
    _rms_kernel[(n,)](a, a if b is None else b, a if c is None else c, w, a if h is None else h, r, d, eps,
                      RESIDUAL=b is not None, COLD=c is not None, BLOCK=_pow2(d), num_warps=8 if d >= 4096 else 4)
    return r


def residual_norm(h2_prev: torch.Tensor, hot_prev: torch.Tensor, cold: torch.Tensor | None, w: torch.Tensor,
                  eps: float, out: torch.Tensor) -> torch.Tensor:
    """ops.residual_norm in one kernel: out = h2_prev + hot_prev (+ cold), returns w * rms_norm(out)."""
    return _rms(h2_prev, hot_prev, cold, w, eps, out, torch.empty_like(out))


def weighted_rms(h: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """ops.weighted_rms in one kernel: w * rms_norm(h), into out if given."""
    return _rms(h, None, None, w, eps, None, torch.empty_like(h) if out is None else out)


@triton.jit
def _rope_cache_kernel(qk_ptr, v_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr, pos_ptr, H, K, cap, hd,
                       BLOCK: tl.constexpr):
    """One program per head of q, k, then v: q and k rotated (t * cos + roll(t, hd / 2) * sin_signed, rounded as
    torch's mul and addcmul round), q into q_ptr, k and v into slot `pos` of their caches."""
    p = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    m = j < hd
    pos = tl.load(pos_ptr)
    dt = q_ptr.dtype.element_ty
    if p < H + K:
        t = tl.load(qk_ptr + p * hd + j, mask=m, other=0.0).to(tl.float32)
        rolled = tl.load(qk_ptr + p * hd + (j + hd // 2) % hd, mask=m, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + p * hd + j, mask=m, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + p * hd + j, mask=m, other=0.0).to(tl.float32)
        y = ((t * c).to(dt).to(tl.float32) + rolled * s).to(dt)
        if p < H:
            tl.store(q_ptr + p * hd + j, y, mask=m)
        else:
            tl.store(kc_ptr + ((p - H) * cap + pos) * hd + j, y, mask=m)
    else:
        kv = p - H - K
        tl.store(vc_ptr + (kv * cap + pos) * hd + j, tl.load(v_ptr + kv * hd + j, mask=m, other=0.0), mask=m)


def rope_cache(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """ops.rope_cache in one kernel: qk (1, heads + kv, 1, hd), v (1, kv, 1, hd), caches (1, kv, slots, hd), pos
    (1,) on the device -> q (1, heads, 1, hd), rotated (and scaled where cos and sin are)."""
    _, K, cap, hd = k_cache.shape
    H = qk.shape[1] - K
    for t in (qk, v, cos, sin_signed, k_cache, v_cache):
        _rows(t, hd)
    q = qk.new_empty((1, H, 1, hd))
    _rope_cache_kernel[(H + 2 * K,)](qk, v, cos, sin_signed, q, k_cache, v_cache, pos, H, K, cap, hd,
                                     BLOCK=_pow2(hd), num_warps=1)
    return q


@triton.jit
def _attend_split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr, G, cap, hd, slots,
                         BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
                         WIDEN: tl.constexpr):
    """Program (kv head, split): the G query heads of one kv head over the split's slots up to pos (online softmax,
    float32): the running max m, the sum l of exp(s - m) and acc = sum exp(s - m) v, unnormalised."""
    kv, split = tl.program_id(0), tl.program_id(1)
    n_splits = tl.num_programs(1)
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_D)
    jm = j < hd
    q = tl.load(q_ptr + (kv * G + g[:, None]) * hd + j[None, :], mask=(g[:, None] < G) & jm[None, :], other=0.0)
    dt = q.dtype
    if WIDEN:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    start = split * slots
    end = tl.minimum(start + slots, tl.load(pos_ptr).to(tl.int32) + 1)
    base = kv.to(tl.int64) * cap * hd
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nm = n < end
        kt = tl.load(k_ptr + base + n[None, :] * hd + j[:, None], mask=nm[None, :] & jm[:, None], other=0.0)
        if WIDEN:
            kt = kt.to(tl.float32)
        s = tl.dot(q, kt, input_precision="ieee" if IEEE else "tf32")  # (G, N) float32
        s = tl.where(nm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_ptr + base + n[:, None] * hd + j[None, :], mask=nm[:, None] & jm[None, :], other=0.0)
        pv = p.to(dt)  # the probabilities in the model dtype, as the plain op's softmax output
        if WIDEN:
            vt, pv = vt.to(tl.float32), pv.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(pv, vt, input_precision="ieee" if IEEE else "tf32")
        m_i = m_new
    at = (kv * n_splits + split) * BLOCK_G + g
    tl.store(m_ptr + at, m_i)
    tl.store(l_ptr + at, l_i)
    tl.store(acc_ptr + at[:, None] * BLOCK_D + j[None, :], acc)


@triton.jit
def _attend_combine_kernel(m_ptr, l_ptr, acc_ptr, o_ptr, G, hd, n_splits,
                           BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program kv head: its splits' partial softmaxes combined, o = acc / l at a common max, rounded once."""
    kv = tl.program_id(0)
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_D)
    m_run = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_run = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for split in range(n_splits):
        at = (kv * n_splits + split) * BLOCK_G + g
        m = tl.load(m_ptr + at)
        m_new = tl.maximum(m_run, m)
        # a split past the position holds m = -inf: its weight is 0 (split 0 always holds slot 0, so m_new is finite)
        keep, take = tl.exp(m_run - m_new), tl.exp(m - m_new)
        l_run = l_run * keep + tl.load(l_ptr + at) * take
        acc = acc * keep[:, None] + tl.load(acc_ptr + at[:, None] * BLOCK_D + j[None, :]) * take[:, None]
        m_run = m_new
    o = acc / l_run[:, None]
    tl.store(o_ptr + (kv * G + g[:, None]) * hd + j[None, :], o.to(o_ptr.dtype.element_ty),
             mask=(g[:, None] < G) & (j[None, :] < hd))


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
           pos: torch.Tensor) -> torch.Tensor:
    """ops.attend over the slots up to pos (1,) (the slots `mask` leaves open; the mask itself is not read):
    q (1, kv, G, hd), already scaled; keys, values (1, kv, slots, hd) -> (1, kv, G, hd)."""
    _, K, G, hd = q.shape
    cap = keys.shape[2]
    for t in (q, keys, values):
        _rows(t, hd)
    slots = max(MIN_SLOTS, triton.cdiv(cap, SPLITS))
    n_splits = triton.cdiv(cap, slots)
    bg, bd = _pow2(G, 16), _pow2(hd, 16)  # tl.dot takes blocks of 16 and more
    m = torch.empty((K, n_splits, bg), dtype=torch.float32, device=q.device)
    l_ = torch.empty_like(m)
    acc = torch.empty((K, n_splits, bg, bd), dtype=torch.float32, device=q.device)
    _attend_split_kernel[(K, n_splits)](q, keys, values, pos, m, l_, acc, G, cap, hd, slots, BLOCK_G=bg,
                                        BLOCK_N=MIN_SLOTS, BLOCK_D=bd, IEEE=q.dtype == torch.float32,
                                        WIDEN=WIDEN_DOT)
    o = torch.empty_like(q)
    _attend_combine_kernel[(K,)](m, l_, acc, o, G, hd, n_splits, BLOCK_G=bg, BLOCK_D=bd)
    return o


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, thr_ptr, fired_ptr, mdev_ptr, mhost_ptr, rows, cols, n_cold,
                 BIAS: tl.constexpr, ADD: tl.constexpr, RELU: tl.constexpr, DECIDE: tl.constexpr, DEV: tl.constexpr,
                 HOST: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program p: rows [p * BLOCK_R, ...) of w (rows, cols) times x (cols,), summed in float32 (+ b), rounded to w's
    dtype once, as nn.Linear rounds. ADD: out += it, rounded once as torch's addmm_ rounds (with b: the linear's
    output rounded first, as out.add_(linear(x)) rounds). RELU: its relu. DECIDE: no output; fired += it >= threshold
    (rounded to the same dtype, as Predictor.mask compares), and rows under n_cold their decision into the masks:
    DEV a byte a row, HOST a bit a row (bit b of byte i = row 8 i + b; BLOCK_R a multiple of 8, so that a program
    owns whole bytes); else it into out."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = r < rows
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_R, BLOCK_K), tl.float32)
    at = w_ptr + r[:, None].to(tl.int64) * cols + k[None, :]
    for k0 in range(0, cols, BLOCK_K):
        km = k0 + k < cols
        w = tl.load(at + k0, mask=rm[:, None] & km[None, :], other=0.0)
        acc += w.to(tl.float32) * tl.load(x_ptr + k0 + k, mask=km, other=0.0).to(tl.float32)[None, :]
    dt = w_ptr.dtype.element_ty
    y = tl.sum(acc, axis=1)  # (BLOCK_R,) float32
    if BIAS:
        y += tl.load(b_ptr + r, mask=rm, other=0.0).to(tl.float32)
    if ADD:
        if BIAS:
            y = y.to(dt).to(tl.float32)
        y += tl.load(out_ptr + r, mask=rm, other=0.0).to(tl.float32)
    # rounded; then max and compare in float32: Triton's interpreter takes the max of bfloat16 values by their raw bits
    y = y.to(dt).to(tl.float32)
    if RELU:
        y = tl.maximum(y, 0.0)
    if DECIDE:
        fire = y >= tl.load(thr_ptr).to(dt).to(tl.float32)
        tl.store(fired_ptr + r, tl.load(fired_ptr + r, mask=rm, other=0) + fire.to(tl.int32), mask=rm)
        mc = r < n_cold
        if DEV:
            tl.store(mdev_ptr + r, fire.to(tl.int8), mask=mc)
        if HOST:  # the rows' bits, 8 to a byte; rows at n_cold and past (hot neurons) give 0 bits
            bits = tl.reshape((fire & mc).to(tl.int32), (BLOCK_R // 8, 8)) << tl.arange(0, 8)[None, :]
            i = tl.program_id(0) * (BLOCK_R // 8) + tl.arange(0, BLOCK_R // 8)  # (BLOCK_R // 8,) byte indices
            # bytes past ceil(n_cold / 8) are not written: the host's zero padding up to whole uint64 words stays
            tl.store(mhost_ptr + i, tl.sum(bits, axis=1).to(tl.uint8), mask=8 * i < n_cold)
    else:
        tl.store(out_ptr + r, y.to(out_ptr.dtype.element_ty), mask=rm)


def gemv_config(rows: int, cols: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_K, num_warps) of a GEMV of w (rows, cols), from a sweep of block sizes at
    the 70B shape: rows of 8192 columns (q/k/v and o projections, the predictor's fc1), 2 rows a program, within 1% of
    the best of each; the predictor's fc2 (1024 columns), 16 rows (the best)."""
    return (2, min(2048, _pow2(cols)), 8) if cols >= 2048 else (16, min(256, _pow2(cols, 16)), 4)


def _gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor, add: bool = False,
          relu: bool = False, decide: tuple | None = None, config: tuple[int, int, int] | None = None) -> None:
    """_gemv_kernel's launch: x (cols,) or (1, .., cols), w (rows, cols), out (rows,) or any of rows elements.
    decide: (threshold, fired, m_dev, m_host, n_cold): m_dev (n_cold,) bool, m_host (>= ceil(n_cold / 8),) uint8
    bits. config: (BLOCK_R, BLOCK_K, num_warps), else gemv_config's (a sweep gives others);
    with m_host, BLOCK_R below 8 is raised to 8 (BLOCK_K lowered as much: the same tile)."""
    rows, cols = w.shape
    if not (x.is_contiguous() and w.is_contiguous() and out.is_contiguous()) or x.numel() != cols or \
            out.numel() != rows:
        raise ValueError(f"a GEMV of one token: expected contiguous x of {cols} and out of {rows} elements, got "
                         f"{tuple(x.shape)} and {tuple(out.shape)}")
    br, bk, nw = config or gemv_config(rows, cols)
    thr, fired, m_dev, m_host, n_cold = decide or (out, out, None, None, 0)
    if m_host is not None and br < 8:  # the host mask's bits: each program writes whole bytes
        br, bk = 8, max(16, bk * br // 8)

    def as_bytes(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:  # absent: any pointer, never written
        return fired if t is None else t.view(dtype)

    _gemv_kernel[(triton.cdiv(rows, br),)](x, w, w if b is None else b, out, thr, fired,
                                           as_bytes(m_dev, torch.int8), as_bytes(m_host, torch.uint8), rows, cols,
                                           n_cold, BIAS=b is not None, ADD=add, RELU=relu, DECIDE=decide is not None,
                                           DEV=m_dev is not None, HOST=m_host is not None, BLOCK_R=br, BLOCK_K=bk,
                                           num_warps=nw)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """F.linear of one token in one kernel: x (..., cols) -> (..., rows)."""
    out = x.new_empty((*x.shape[:-1], w.shape[0]))
    _gemv(x, w, b, out)
    return out


def add_linear(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """ops.add_linear in one kernel: h += linear(x, w, b), one token."""
    _gemv(x, w, b, h, add=True)


def predict(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, threshold: torch.Tensor, fired: torch.Tensor,
            m_dev: torch.Tensor | None, m_host: torch.Tensor | None, n_cold: int) -> None:
    """ops.predict in two kernels: fc1 with its ReLU, then fc2 with the decision (the device's bool mask written
    as bytes of 0 and 1, the host's as bits). Float weights only: blocks (--predictor-dtype q8_0) take ops.predict."""
    h = x.new_empty(fc1.shape[0])  # (hidden,)
    _gemv(x, fc1, None, h, relu=True)
    _gemv(h, fc2, None, fired, decide=(threshold, fired, m_dev, m_host, n_cold))
