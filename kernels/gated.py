"""Training-free activation sparsity for one token's gated FFN on the GPU, TEAL-style: only the weights of the neurons
that pass are read. common/gating.py's per-neuron test: neuron j passes iff |act(g_j)| > tau_g and |h_j| > tau_h, with
g = gate . x, u = up . x, h_j = act(g_j) * u_j (swiglu: silu; geglu: gelu tanh; reglu, drelu: relu, drelu relu(u)).

  y = gated_ffn(activation, x, gate, up, down_t, tau_g, tau_h, ws): five kernels, no host sync, no allocation (after a
  first call that compiles them, a CUDA graph captures them; new values in tau_g / tau_h serve the same graph):
    1 gate     g = gate . x, dense: qgemv's GEMV (cuBLAS for float rows), into ws.g
    2 compact  pass 1: a = act(g) rounded to x's dtype, kept where |a| > tau_g; the ids ascending into ws.ids, their a
               into ws.a, their number into ws.count (_compact_kernel: each program counts the passes before its chunk
               itself, a few thousand act()s from L2, rather than waiting on a scan kernel)
    3 up       u = up[ids] . x: qgemv's GEMV by index (MAP) with the device count (programs past it exit at once), or
               _gather_kernel for float rows; into ws.u at the ids' positions
    4 down     pass 2 and the column-sparse product (TEAL's): h = a * u rounded, kept where |h| > tau_h; split p of
               ws.splits takes its share of the count's positions and sums h_j down_t[ids_j] in float32 along a slice
               of d into ws.part[p]; rows that fail pass 2 are masked, so their bytes are not read (_down_q_kernel,
               _down_f_kernel: a thread's 16-byte units of a row side by side along d, coalesced)
    5 reduce   y = the splits' partial sums added, rounded once to x's dtype (_reduce_kernel): two stages, not atomics,
               so y is deterministic and nothing needs zeroing first
Bytes: gate + (pass-1 share) up + (pass-2 share) down, but for the block-major scales of the gathered rows: one 32-byte
sector holds a block's scales of 16 rows, so gathered rows touch most scale sectors until sparsity is high (scales are
1/9 of Q4_0's bytes, 1/17 of Q8_0's).

Roundings are the model's (kernels/gated_ref.gated_ffn_torch, the reference): g, a, u, h in x's dtype, the tests on
those values in float32, sums in float32 (down's over the passing neurons in whatever order the splits give, then
across splits).
down_t is the down projection's columns as rows, (n, d): models/ffn_weights.down_t_rows's, then qlinear.pack.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from hotneurons.kernels import qgemv
from hotneurons.kernels.cold import ACT_CODE, GATED
from hotneurons.kernels.qgemv import MAGIC, _piece, gemv
from hotneurons.kernels.qlinear import GpuQ
from hotneurons.weights.formats import WeightFormat

CHUNK = 1024  # neurons a compaction program places
# neurons a compaction program counts at a time (before its chunk), 8 warps: the count is a chain of loads and sums,
# so fewer, wider steps (4096 a step took 12 us of a 55 us gate stage at n 28,672 on an H200)
PREFIX = 16384
ROWS = 4  # down rows a program loads a step, the next step's ids in flight meanwhile (8: registers spill, 2.9x slower)
SPLITS_PER_SM = 2  # down product programs along the neurons (bench/gated_gemv.py --sweep on an H200)
GATHER_ROWS = 4  # float up rows a program of _gather_kernel reads
# 4-bit rows by index (qgemv's MAP: 64-bit row offsets) a GEMV program takes: at gemv_config's 8 (one token, fp16),
# ptxas (Triton 3.9, sm_90) runs out of registers (255 and 72 bytes of stack); at 4, 78 registers
MAP_Q4_ROWS = 4


@triton.jit
def _act(g, ACT: tl.constexpr):
    """act(g), float32 (cold.ACT_CODE), in torch's forms: silu g / (1 + exp(-g)); geglu 0.5 g (1 + tanh z), tanh z
    (none in Triton's interpreter) as sign(z) (1 - 2 e / (1 + e)), e = exp(-2 |z|): rounded near -1 as a float32 tanh
    is, so that 1 + tanh z becomes exactly 0 where torch's does (g below about -5.1: those neurons fail tau 0 here as
    in the model; g sigmoid(2 z), the same value, would not round so)."""
    if ACT == 4:
        return g / (1.0 + tl.exp(-g))
    elif ACT == 5:
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        e = tl.exp(-2.0 * tl.abs(z))
        t = 1.0 - 2.0 * e / (1.0 + e)  # |tanh z|
        return 0.5 * g * (1.0 + tl.where(z < 0, -t, t))
    else:
        return tl.maximum(g, 0.0)


@triton.jit
def _compact_kernel(g_ptr, tau_ptr, ids_ptr, a_ptr, cnt_ptr, N, ACT: tl.constexpr, CH: tl.constexpr,
                    PRE: tl.constexpr):
    """Program p: the neurons of [p CH, (p + 1) CH) with |act(g)| > tau (act rounded to a's dtype), ascending, into
    ids (and their act into a) after the passes before the chunk, which the program counts itself, PRE at a time; the
    last program writes the count."""
    p = tl.program_id(0)
    tau = tl.load(tau_ptr)
    dt = a_ptr.dtype.element_ty
    before = p * 0  # passes in [0, p CH)
    for s in range(0, p * CH, PRE):
        i = s + tl.arange(0, PRE)
        m = i < p * CH
        a = _act(tl.load(g_ptr + i, mask=m, other=0.0).to(tl.float32), ACT).to(dt).to(tl.float32)
        before += tl.sum((m & (tl.abs(a) > tau)).to(tl.int32), 0)
    i = p * CH + tl.arange(0, CH)
    m = i < N
    a = _act(tl.load(g_ptr + i, mask=m, other=0.0).to(tl.float32), ACT).to(dt)
    keep = m & (tl.abs(a.to(tl.float32)) > tau)
    k = keep.to(tl.int32)
    at = before + tl.cumsum(k, 0) - k  # exclusive: places in ascending order
    tl.store(ids_ptr + at, i, mask=keep)
    tl.store(a_ptr + at, a, mask=keep)
    if p == tl.num_programs(0) - 1:
        tl.store(cnt_ptr, before + tl.sum(k, 0))


@triton.jit
def _gather_kernel(x_ptr, w_ptr, ids_ptr, cnt_ptr, out_ptr, K, stride_w, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """Float rows: out[k] = w[ids[k]] . x for positions k in [p BLOCK_N, ...) below the count (programs past it exit
    at once), float32 sums rounded to out's dtype."""
    cnt = tl.load(cnt_ptr)
    if tl.program_id(0) * BLOCK_N >= cnt:
        return
    k = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) positions
    live = k < cnt
    row = tl.load(ids_ptr + k, mask=live, other=0).to(tl.int64)
    c = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for c0 in range(0, K, BLOCK_K):
        cm = c0 + c < K
        w = tl.load(w_ptr + row[:, None] * stride_w + (c0 + c)[None, :], mask=live[:, None] & cm[None, :], other=0.0)
        acc += w.to(tl.float32) * tl.load(x_ptr + c0 + c, mask=cm, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + k, tl.sum(acc, 1).to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def _share(cnt_ptr):
    """This split's positions [lo, hi) of the count: contiguous shares of ceil(count / splits)."""
    cnt = tl.load(cnt_ptr)
    per = tl.cdiv(cnt, tl.num_programs(0))
    lo = tl.program_id(0) * per
    return lo, tl.minimum(lo + per, cnt)


@triton.jit
def _pass2(k, hi, ids_ptr, a_ptr, u_ptr, tau, DRELU: tl.constexpr):
    """Positions k (R,): their rows, whether they pass |h| > tau and h (0 where not), h = a * u (drelu: a * relu(u))
    rounded to a's dtype, as the model rounds it."""
    live = k < hi
    row = tl.load(ids_ptr + k, mask=live, other=0).to(tl.int64)
    a = tl.load(a_ptr + k, mask=live, other=0.0)
    u = tl.load(u_ptr + k, mask=live, other=0.0).to(tl.float32)
    if DRELU:
        u = tl.maximum(u, 0.0)
    h = (a.to(tl.float32) * u).to(a.dtype).to(tl.float32)
    keep = live & (tl.abs(h) > tau)
    return row, keep, tl.where(keep, h, 0.0)


@triton.jit
def _down_q_kernel(ids_ptr, a_ptr, u_ptr, cnt_ptr, tau_ptr, q_ptr, s_ptr, m_ptr, part_ptr, NU, D, stride_q, stride_sr,
                   stride_sb, magic, Q4: tl.constexpr, MIN: tl.constexpr, DRELU: tl.constexpr, ASM: tl.constexpr,
                   EVEN: tl.constexpr, R: tl.constexpr, BLOCK_U: tl.constexpr):
    """Program (p, j): part[p, units [j BLOCK_U, ...) of d] = sum over split p's positions passing pass 2 of h times
    the row's weights, GpuQ rows (Q4_0, Q4_1, Q8_0; NU 16-byte units a row, 4 int32 words each: a Q4 block, half a
    Q8_0 block). R rows a step, a thread's unit of each; piece u of word i is weight 4 u + i of its unit (qgemv's
    kernel order), turned into q - 8 | q by qgemv._piece (one LOP3, one FADD) and summed times h * scale into acc_u,
    so the units stay in the kernel order until the one store at the end. MIN (Q4_1): + min * h a unit, summed apart."""
    lo, hi = _share(cnt_ptr)
    if lo >= hi:
        return
    tau = tl.load(tau_ptr)
    UPB: tl.constexpr = 1 if Q4 else 2  # units a block
    un = tl.program_id(1) * BLOCK_U + tl.arange(0, BLOCK_U)  # (BLOCK_U,) units of d
    wi = tl.arange(0, 4)  # words of a unit
    um = un < NU
    acc0 = tl.zeros((BLOCK_U, 4), tl.float32)  # acc_u (unit, word i): weight 4 u + i of the unit
    acc1 = tl.zeros((BLOCK_U, 4), tl.float32)
    acc2 = tl.zeros((BLOCK_U, 4), tl.float32)
    acc3 = tl.zeros((BLOCK_U, 4), tl.float32)
    acc4 = tl.zeros((BLOCK_U, 4), tl.float32)  # acc4..7: Q4's upper nibbles (Q8_0 has 4 bytes a word)
    acc5 = tl.zeros((BLOCK_U, 4), tl.float32)
    acc6 = tl.zeros((BLOCK_U, 4), tl.float32)
    acc7 = tl.zeros((BLOCK_U, 4), tl.float32)
    accm = tl.zeros((BLOCK_U,), tl.float32)
    row, keep, h = _pass2(lo + tl.arange(0, R), hi, ids_ptr, a_ptr, u_ptr, tau, DRELU)
    for k0 in range(lo, hi, R):
        ms = keep[:, None] if EVEN else keep[:, None] & um[None, :]  # (R, BLOCK_U): no bytes for rows that fail
        q = tl.load(q_ptr + row[:, None, None] * stride_q + (un * 4)[None, :, None] + wi[None, None, :],
                    mask=ms[:, :, None], other=0)  # (R, BLOCK_U, 4) int32
        s_at = s_ptr + (un // UPB)[None, :] * stride_sb + row[:, None] * stride_sr  # (R, BLOCK_U)
        c = (tl.load(s_at, mask=ms, other=0.0).to(tl.float32) * h[:, None])[:, :, None]  # (R, BLOCK_U, 1)
        if MIN:
            m_at = m_ptr + un[None, :] * stride_sb + row[:, None] * stride_sr  # mins: the scales' layout
            accm += tl.sum(tl.load(m_at, mask=ms, other=0.0).to(tl.float32) * h[:, None], 0)
        # the next step's rows and h, asked for while this step's weights are on their way: the row ids are a load
        # the weights' addresses wait on, so unpipelined each step would pay two memory latencies
        row, keep, h = _pass2(k0 + R + tl.arange(0, R), hi, ids_ptr, a_ptr, u_ptr, tau, DRELU)
        q2 = q >> 16
        acc0 += tl.sum(_piece(q, q2, magic, 0, Q4, MIN, False, ASM) * c, 0)
        acc1 += tl.sum(_piece(q, q2, magic, 1, Q4, MIN, False, ASM) * c, 0)
        acc2 += tl.sum(_piece(q, q2, magic, 2, Q4, MIN, False, ASM) * c, 0)
        acc3 += tl.sum(_piece(q, q2, magic, 3, Q4, MIN, False, ASM) * c, 0)
        if Q4:
            acc4 += tl.sum(_piece(q, q2, magic, 4, Q4, MIN, False, ASM) * c, 0)
            acc5 += tl.sum(_piece(q, q2, magic, 5, Q4, MIN, False, ASM) * c, 0)
            acc6 += tl.sum(_piece(q, q2, magic, 6, Q4, MIN, False, ASM) * c, 0)
            acc7 += tl.sum(_piece(q, q2, magic, 7, Q4, MIN, False, ASM) * c, 0)
    PW: tl.constexpr = 32 if Q4 else 16  # weights a unit
    at = part_ptr + tl.program_id(0) * D + (un * PW)[:, None] + wi[None, :]  # (BLOCK_U, 4): weight 4 u + i, u = 0
    om = um[:, None]
    mt = accm[:, None]  # (BLOCK_U, 1): 0 but for MIN
    tl.store(at, acc0 + mt, mask=om)
    tl.store(at + 4, acc1 + mt, mask=om)
    tl.store(at + 8, acc2 + mt, mask=om)
    tl.store(at + 12, acc3 + mt, mask=om)
    if Q4:
        tl.store(at + 16, acc4 + mt, mask=om)
        tl.store(at + 20, acc5 + mt, mask=om)
        tl.store(at + 24, acc6 + mt, mask=om)
        tl.store(at + 28, acc7 + mt, mask=om)


@triton.jit
def _down_f_kernel(ids_ptr, a_ptr, u_ptr, cnt_ptr, tau_ptr, w_ptr, part_ptr, D, stride_w, DRELU: tl.constexpr,
                   R: tl.constexpr, BLOCK_D: tl.constexpr):
    """_down_q_kernel for float rows: program (p, j), columns [j BLOCK_D, ...) of d."""
    lo, hi = _share(cnt_ptr)
    if lo >= hi:
        return
    tau = tl.load(tau_ptr)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,) columns
    cm = c < D
    acc = tl.zeros((BLOCK_D,), tl.float32)
    row, keep, h = _pass2(lo + tl.arange(0, R), hi, ids_ptr, a_ptr, u_ptr, tau, DRELU)
    for k0 in range(lo, hi, R):
        w = tl.load(w_ptr + row[:, None] * stride_w + c[None, :], mask=keep[:, None] & cm[None, :], other=0.0)
        hw = h
        row, keep, h = _pass2(k0 + R + tl.arange(0, R), hi, ids_ptr, a_ptr, u_ptr, tau, DRELU)  # next step's
        acc += tl.sum(w.to(tl.float32) * hw[:, None], 0)
    tl.store(part_ptr + tl.program_id(0) * D + c, acc, mask=cm)


@triton.jit
def _reduce_kernel(part_ptr, cnt_ptr, y_ptr, D, S, SP: tl.constexpr, BLOCK_D: tl.constexpr):
    """y[c] = the sum of part[p, c] over the splits p that had positions (_share's), rounded once to y's dtype."""
    cnt = tl.load(cnt_ptr)
    used = tl.cdiv(cnt, tl.maximum(tl.cdiv(cnt, S), 1))  # splits with lo < count (0 for count 0)
    c = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = c < D
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for p0 in range(0, used, SP):
        p = p0 + tl.arange(0, SP)
        acc += tl.sum(tl.load(part_ptr + p[:, None] * D + c[None, :], mask=(p < used)[:, None] & cm[None, :],
                              other=0.0), 0)
    tl.store(y_ptr + c, acc.to(y_ptr.dtype.element_ty), mask=cm)


# ---------------------------------------------------------------------------------------------------------------
# launches


@dataclass(frozen=True)
class GatedWorkspace:
    """gated_ffn's static buffers for an (n, d) FFN and one dtype, made once (graphs capture their addresses)."""

    g: torch.Tensor  # (1, n) x's dtype: gate . x
    ids: torch.Tensor  # (n,) int32: pass 1's neurons ascending, the first count[0] (past them: any valid id)
    a: torch.Tensor  # (n,) x's dtype: their act(g)
    u: torch.Tensor  # (1, n) x's dtype: their up . x
    count: torch.Tensor  # (1,) int32: how many passed pass 1
    part: torch.Tensor  # (splits, d) float32: the down product's partial sums, a row a split
    y: torch.Tensor  # (1, d) x's dtype: the output, overwritten by each call

    @classmethod
    def make(cls, n: int, d: int, device: torch.device | str, dtype: torch.dtype,
             splits: int | None = None) -> "GatedWorkspace":
        """splits: programs along the neurons of the down product (default: SPLITS_PER_SM an SM, 4 without CUDA):
        more spread the rows wider, but each adds a (d,) float32 partial sum to write and add."""
        device = torch.device(device)
        if splits is None:
            splits = (SPLITS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
                      if device.type == "cuda" else 4)
        if n < 1 or d < 1 or splits < 1:
            raise ValueError(f"GatedWorkspace.make: n {n}, d {d} and splits {splits} must be positive")
        z = dict(device=device, dtype=dtype)
        return cls(torch.zeros((1, n), **z), torch.zeros(n, dtype=torch.int32, device=device), torch.zeros(n, **z),
                   torch.zeros((1, n), **z), torch.zeros(1, dtype=torch.int32, device=device),
                   torch.zeros((splits, d), dtype=torch.float32, device=device), torch.zeros((1, d), **z))

    @property
    def shape(self) -> tuple[int, int]:
        return self.g.shape[1], self.y.shape[1]


@dataclass(frozen=True)
class DownRows:
    """down_t (n, d) block rows as the down product reads them: GpuQ's quants, but each row's scales (and Q4_1's
    mins) side by side, row-major (n, d/32). A warp takes a row's 16-byte units together, so its scales come in one
    coalesced piece; GpuQ's block-major scales, made for GEMVs over runs of rows, cost a sector a unit for gathered
    rows (the down product ran 5-10x below its bytes so). The same bytes as the GpuQ (`of` copies the scales)."""

    qs: torch.Tensor  # (n, d/2) uint8 | (n, d) int8: GpuQ's kernel order
    scales: torch.Tensor  # (n, d/32) float16, row-major
    mins: torch.Tensor | None  # (n, d/32) float16, row-major: Q4_1's; else None
    fmt: WeightFormat
    shape: tuple[int, int]  # (n, d)

    @classmethod
    def of(cls, q: GpuQ) -> "DownRows":
        return cls(q.qs, q.scales.contiguous(), None if q.mins is None else q.mins.contiguous(), q.fmt, q.shape)

    @property
    def device(self) -> torch.device:
        return self.qs.device

    @property
    def q4(self) -> bool:
        return self.fmt != WeightFormat.Q8_0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scales, self.mins) if t is not None)

    def rows(self, idx: slice) -> GpuQ:
        """Some rows as a GpuQ (their scales copied block-major: a chunk's, for prefill's widening)."""
        return GpuQ(self.qs[idx], self.scales[idx], self.fmt, (self.qs[idx].shape[0], self.shape[1]),
                    None if self.mins is None else self.mins[idx])


Weight = GpuQ | torch.Tensor


def _check(activation: str, x: torch.Tensor, ws: GatedWorkspace, weights: dict[str, Weight],
           taus: dict[str, torch.Tensor]) -> None:
    if activation not in GATED:
        raise ValueError(f"gated_ffn: activation {activation!r} has no gate: choose one of {', '.join(GATED)}")
    n, d = ws.shape
    if tuple(x.shape) != (1, d) or x.stride(1) != 1 or x.dtype != ws.y.dtype or x.device != ws.y.device:
        raise ValueError(f"gated_ffn: x {tuple(x.shape)} {x.dtype} on {x.device} does not fit the workspace: expected "
                         f"(1, {d}) {ws.y.dtype} on {ws.y.device}, unit last stride (GatedWorkspace.make for x)")
    for name, w in weights.items():
        if not isinstance(w, (GpuQ, torch.Tensor, DownRows)) or (isinstance(w, DownRows) and name != "down_t"):
            raise ValueError(f"gated_ffn: {name} is a {type(w).__name__}: qlinear.pack it to a GpuQ or float tensor "
                             f"(down_t: also DownRows.of that GpuQ, the fast layout)")
        if tuple(w.shape) != (n, d) or w.device != x.device:
            raise ValueError(f"gated_ffn: {name} {tuple(w.shape)} on {w.device}, expected ({n}, {d}) on {x.device} "
                             f"(down as down_t: its columns as rows)")
        if isinstance(w, torch.Tensor) and (w.dtype != x.dtype or w.stride(1) != 1):
            raise ValueError(f"gated_ffn: float {name} is {w.dtype}: cast it once to x's {x.dtype}, unit last stride")
    for name, t in taus.items():
        if t.numel() != 1 or t.dtype != torch.float32 or t.device != x.device:
            raise ValueError(f"gated_ffn: {name} must be a one-element float32 tensor on {x.device} (a new value then "
                             f"serves a captured graph), got {tuple(t.shape)} {t.dtype} on {t.device}")


def gated_ffn(activation: str, x: torch.Tensor, gate: Weight, up: Weight, down_t: Weight, tau_g: torch.Tensor,
              tau_h: torch.Tensor, ws: GatedWorkspace) -> torch.Tensor:
    """One token's gated FFN over the neurons that pass (module docstring): x (1, d) -> ws.y (1, d) in x's dtype.
    gate, up, down_t (n, d): GpuQ (Q4_0, Q4_1, Q8_0; down_t best as DownRows) or float tensors in x's dtype;
    tau_g, tau_h: float32 one-element tensors on x's device. On CUDA (or in Triton's interpreter, CPU tensors);
    capturable."""
    _check(activation, x, ws, {"gate": gate, "up": up, "down_t": down_t}, {"tau_g": tau_g, "tau_h": tau_h})
    for stage in STAGES:
        stage(activation, x, gate, up, down_t, tau_g, tau_h, ws)
    return ws.y


def _gate_stage(activation, x, gate, up, down_t, tau_g, tau_h, ws) -> None:
    """1 and 2: the dense gate GEMV as qlinear.linear runs it for a token, then pass 1's compaction."""
    n, d = ws.shape
    if isinstance(gate, GpuQ):
        gemv(x, gate.qs, gate.scales, gate.q4, None, ws.g, mins=gate.mins)
    else:
        torch.mm(x, gate.t(), out=ws.g)
    ch = min(CHUNK, triton.next_power_of_2(n))
    _compact_kernel[(triton.cdiv(n, ch),)](ws.g, tau_g, ws.ids, ws.a, ws.count, n, ACT=ACT_CODE[activation], CH=ch,
                                           PRE=min(PREFIX, triton.next_power_of_2(n)), num_warps=8)


def _up_stage(activation, x, gate, up, down_t, tau_g, tau_h, ws) -> None:
    """3: up rows by index, as many programs as the count needs."""
    n, d = ws.shape
    if isinstance(up, GpuQ):
        bn, bb, nw = qgemv.gemv_config(n, d, up.q4)
        gemv(x, up.qs, up.scales, up.q4, None, ws.u, config=(min(bn, MAP_Q4_ROWS) if up.q4 else bn, bb, nw),
             mins=up.mins, rows=ws.ids, out_rows=1, count=ws.count)
    else:
        _gather_kernel[(triton.cdiv(n, GATHER_ROWS),)](x, up, ws.ids, ws.count, ws.u, d, up.stride(0),
                                                       BLOCK_N=GATHER_ROWS,
                                                       BLOCK_K=min(512, triton.next_power_of_2(d)), num_warps=4)


def _down_stage(activation, x, gate, up, down_t, tau_g, tau_h, ws) -> None:
    """4: pass 2 and the down rows of the neurons that pass it, into ws.part."""
    n, d = ws.shape
    splits = ws.part.shape[0]
    drelu = activation == "drelu"
    if isinstance(down_t, (GpuQ, DownRows)):  # a thread's 16-byte unit of each of R rows, 32 threads a warp along d
        nu = down_t.qs.shape[1] // 16
        bu, nw = min(32, triton.next_power_of_2(nu)), 1
        words = down_t.qs.view(torch.int32)  # (n, 4 nu)
        ms = down_t.scales if down_t.mins is None else down_t.mins
        _down_q_kernel[(splits, triton.cdiv(nu, bu))](ws.ids, ws.a, ws.u, ws.count, tau_h, words, down_t.scales, ms,
                                                      ws.part, nu, d, words.stride(0), *down_t.scales.stride(),
                                                      MAGIC, Q4=down_t.q4, MIN=down_t.mins is not None,
                                                      DRELU=drelu, ASM=x.is_cuda, EVEN=nu % bu == 0, R=ROWS,
                                                      BLOCK_U=bu, num_warps=nw)
    else:
        bd = min(512 // down_t.element_size(), triton.next_power_of_2(d))  # 16 bytes a thread, 32 threads
        _down_f_kernel[(splits, triton.cdiv(d, bd))](ws.ids, ws.a, ws.u, ws.count, tau_h, down_t, ws.part, d,
                                                     down_t.stride(0), DRELU=drelu, R=ROWS, BLOCK_D=bd, num_warps=1)


def _reduce_stage(activation, x, gate, up, down_t, tau_g, tau_h, ws) -> None:
    """5: the splits' partial sums added into ws.y."""
    n, d = ws.shape
    splits = ws.part.shape[0]
    bd = min(32, triton.next_power_of_2(d))  # many programs: each sums a column strip over the splits, a chain
    _reduce_kernel[(triton.cdiv(d, bd),)](ws.part, ws.count, ws.y, d, splits,
                                          SP=min(64, triton.next_power_of_2(splits)), BLOCK_D=bd, num_warps=1)


STAGES = (_gate_stage, _up_stage, _down_stage, _reduce_stage)  # in order; bench/gated_gemv.py times each
