"""A mixture of experts' prefill product in one launch: the routed (token, expert) pairs, sorted by expert, each
times its expert's rows of a stacked weight, as llama.cpp's grouped GEMM (its mul_mat_id) does.

    grouped_linear(x_rows, w_stack, out_rows, expert_ids, starts, tokens) -> y (P, out_rows)
    y[p] = x_rows[tokens[p]] @ W_e.T  for the pairs p in [starts[g], starts[g + 1]) of group g, e = expert_ids[g]

where W_e is rows [e * out_rows, (e + 1) * out_rows) of w_stack (a GpuQ of Q4_0 / Q4_1 / Q8_0 rows, or a float
tensor (E * out_rows, k)) and P = starts[-1]. `tokens` None reads x_rows[p] itself (the down projection's values are
already in pair order).

The kernel: a tile table made on the host from the groups' counts (`tile_table`: cheap numpy, one small copy) lists
(stack index, first pair, end pair) for every BLOCK_M pairs of a group; program (tile, r) computes that tile's
(BLOCK_M, BLOCK_N) outputs of output rows [r * BLOCK_N, ...): its tokens' x rows gathered, the expert's rows
de-quantized BLOCK_K weights at a time in registers (each weight's float32 value, as dequant.py's, rounded once to x's
dtype), tl.dot with float32 sums. No Python loop over experts, no float copy of a weight, one launch a projection.

GpuQ's quants are reordered within each 32-weight block (kernels/qgemv.py's KERNEL ORDER), so the weight tile is
loaded as stored (contiguous bytes) and x is loaded at the columns those bytes hold: Q4 byte p of a block (word
p // 4, byte p % 4) holds weights 8 (p % 4) + p // 4 (low nibble) and that + 4 (high): two half-width tiles, two
dots; Q8_0 byte p holds weight 16 (p // 16) + 4 (p % 4) + (p // 4) % 4. x's tile is BLOCK_M rows against the weight
tile's BLOCK_N, so permuting x's columns costs fewer loads than permuting the weights.

Elsewhere (the CPU, K-quants) `grouped_linear` runs the torch reference: each group's rows de-quantized to float32
and multiplied (obviously correct, a loop over groups: the tests' yardstick).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from hotneurons.kernels.names import BLOCK_KIND
from hotneurons.kernels.qlinear import GpuQ

FLOAT = 3  # KIND of a float weight stack; the block formats' are names.BLOCK_KIND's
KIND = BLOCK_KIND
FLOAT_STACKS = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Tiles:
    """The programs' work list: table (n_tiles, 3) int32 on the device, rows (stack index, first pair, end pair), each
    at most block_m pairs of one group."""

    table: torch.Tensor
    block_m: int


def block_m_for(starts: np.ndarray) -> int:
    """BLOCK_M for groups of these sizes: 16 up to a mean group of 32 pairs (two tiles of 16 beat one of 32: more
    programs, each with fewer masked rows; bench/moe_prefill_kernel.py --sweep), else 64 up to 96 (a bigger tile's
    masked rows would cost more than a second tile), else 128."""
    counts = np.diff(starts)
    mean = counts[counts > 0].mean() if (counts > 0).any() else 1.0
    return 16 if mean <= 32 else 64 if mean <= 96 else 128


def tile_table(expert_ids: np.ndarray, starts: np.ndarray, block_m: int, device: torch.device | str) -> Tiles:
    """The (stack index, first pair, end pair) of every block_m pairs of each group (empty groups: none)."""
    counts = np.diff(starts)  # (G,)
    per = -(-counts // block_m)  # (G,) tiles of each group
    g = np.repeat(np.arange(len(counts)), per)  # (n_tiles,) group of each tile
    first = np.cumsum(per) - per  # (G,) each group's first tile
    r0 = starts[:-1][g] + block_m * (np.arange(len(g)) - first[g])
    r1 = np.minimum(r0 + block_m, starts[1:][g])
    table = np.stack([np.asarray(expert_ids)[g], r0, r1], axis=1).astype(np.int32)  # (n_tiles, 3)
    return Tiles(torch.from_numpy(table).to(device), block_m)


@triton.jit
def _grouped_kernel(x_ptr, tok_ptr, tile_ptr, w_ptr, s_ptr, m_ptr, y_ptr, K, OUT, stride_x, stride_w, stride_sb,
                    stride_y, KIND: tl.constexpr, GATHER: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (t, r): tile t's pairs (tile_ptr: stack index, first pair, end pair) times output rows
    [r * BLOCK_N, ...) of that expert. KIND 0 Q4_0 (w = s (q - 8)), 1 Q4_1 (s q + m), 2 Q8_0 (s q), 3 float rows."""
    e = tl.load(tile_ptr + 3 * tl.program_id(0)).to(tl.int64)
    r0 = tl.load(tile_ptr + 3 * tl.program_id(0) + 1)
    r1 = tl.load(tile_ptr + 3 * tl.program_id(0) + 2)
    pr = r0 + tl.arange(0, BLOCK_M)  # (BLOCK_M,) pairs
    pm = pr < r1
    if GATHER:
        tok = tl.load(tok_ptr + pr, mask=pm, other=0)
    else:
        tok = pr
    x_row = x_ptr + tok.to(tl.int64)[:, None] * stride_x  # (BLOCK_M, 1)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) the expert's output rows
    nm = (n < OUT)[None, :]
    row = e * OUT + n  # (BLOCK_N,) rows of the stack
    w_col = w_ptr + row.to(tl.int64)[None, :] * stride_w  # (1, BLOCK_N): a weight row is a tile's column
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    NBK: tl.constexpr = BLOCK_K // 32  # blocks of 32 weights a step
    for k0 in range(0, K, BLOCK_K):
        if KIND == 3:
            c = k0 + tl.arange(0, BLOCK_K)  # (BLOCK_K,) columns
            xt = tl.load(x_row + c[None, :], mask=pm[:, None] & (c < K)[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
            wt = tl.load(w_col + c[:, None], mask=(c < K)[:, None] & nm, other=0.0).to(dt)  # (BLOCK_K, BLOCK_N)
            acc = tl.dot(xt, wt, acc, input_precision=PREC)
        else:
            blk = k0 // 32 + tl.arange(0, NBK)  # (NBK,) blocks of this step
            bm = (blk < K // 32)[:, None] & nm  # (NBK, BLOCK_N)
            s = tl.load(s_ptr + blk[:, None] * stride_sb + row[None, :], mask=bm, other=0.0).to(tl.float32)
            if KIND == 1:
                mn = tl.load(m_ptr + blk[:, None] * stride_sb + row[None, :], mask=bm, other=0.0).to(tl.float32)
            if KIND == 2:
                p = tl.arange(0, BLOCK_K)  # byte p of the step's quants: block p // 32, byte j = p % 32 of it
                j = p % 32
                c = k0 + 32 * (p // 32) + 16 * (j // 16) + 4 * (j % 4) + (j // 4) % 4  # (BLOCK_K,) its weight
                cm = (k0 + p < K)[:, None]
                q = tl.load(w_col + (k0 + p)[:, None], mask=cm & nm, other=0).to(tl.float32)  # (BLOCK_K, BLOCK_N)
                w = tl.reshape(tl.reshape(q, (NBK, 32, BLOCK_N)) * s[:, None, :], (BLOCK_K, BLOCK_N)).to(dt)
                xt = tl.load(x_row + c[None, :], mask=pm[:, None] & (c < K)[None, :], other=0.0)
                acc = tl.dot(xt, w, acc, input_precision=PREC)
            else:
                HALF: tl.constexpr = BLOCK_K // 2
                p = tl.arange(0, HALF)  # byte p: block p // 16, byte j = p % 16 (word j // 4, byte j % 4)
                j = p % 16
                c = k0 + 32 * (p // 16) + 8 * (j % 4) + j // 4  # (HALF,) the low nibble's weight; the high's c + 4
                cm = (k0 // 2 + p < K // 2)[:, None]
                q = tl.load(w_col + (k0 // 2 + p)[:, None], mask=cm & nm, other=0)  # (HALF, BLOCK_N) uint8
                lo = tl.reshape((q & 15).to(tl.float32), (NBK, 16, BLOCK_N))
                hi = tl.reshape((q >> 4).to(tl.float32), (NBK, 16, BLOCK_N))
                if KIND == 1:
                    wl = lo * s[:, None, :] + mn[:, None, :]
                    wh = hi * s[:, None, :] + mn[:, None, :]
                else:
                    wl = (lo - 8.0) * s[:, None, :]
                    wh = (hi - 8.0) * s[:, None, :]
                xm = pm[:, None] & (c < K)[None, :]
                xl = tl.load(x_row + c[None, :], mask=xm, other=0.0)  # (BLOCK_M, HALF)
                xh = tl.load(x_row + c[None, :] + 4, mask=xm, other=0.0)
                acc = tl.dot(xl, tl.reshape(wl, (HALF, BLOCK_N)).to(dt), acc, input_precision=PREC)
                acc = tl.dot(xh, tl.reshape(wh, (HALF, BLOCK_N)).to(dt), acc, input_precision=PREC)
    ym = pm[:, None] & nm
    tl.store(y_ptr + pr.to(tl.int64)[:, None] * stride_y + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=ym)


def _on_kernels(t: torch.Tensor) -> bool:
    """Whether t's device runs the kernel (the tests patch it to run it in Triton's interpreter on CPU tensors)."""
    return t.is_cuda


def kernel_reads(w: object) -> bool:
    """Whether the kernel reads this weight stack: a Q4_0 / Q4_1 / Q8_0 GpuQ or a float tensor."""
    if isinstance(w, GpuQ):
        return w.fmt in KIND
    return isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype in FLOAT_STACKS


def applies(w: object, x: torch.Tensor) -> bool:
    """Whether grouped_linear runs the kernel for x's device and this stack (else it runs the torch reference)."""
    return _on_kernels(x) and kernel_reads(w) and x.dtype in FLOAT_STACKS


def _check(x_rows, w_stack, out_rows: int, expert_ids: np.ndarray, starts: np.ndarray, tokens) -> int:
    """P, the pairs, after a one-line error for any argument that does not fit the others."""
    n, k = tuple(w_stack.shape)
    P = int(starts[-1]) if len(starts) else -1
    bad = (x_rows.dim() != 2 or x_rows.shape[1] != k or out_rows <= 0 or n % out_rows
           or len(starts) != len(expert_ids) + 1 or P < 0 or starts[0] != 0 or (np.diff(starts) < 0).any()
           or (len(expert_ids) and (min(expert_ids) < 0 or max(expert_ids) >= n // out_rows))
           or (x_rows.shape[0] != P if tokens is None else tuple(tokens.shape) != (P,)))
    if bad:
        raise ValueError(f"grouped_linear: x_rows {tuple(x_rows.shape)}, a stack of {n // max(out_rows, 1)} experts x "
                         f"{out_rows} rows of ({n}, {k}), {len(expert_ids)} expert ids, starts of {len(starts)} "
                         f"(from 0, non-decreasing) and tokens {None if tokens is None else tuple(tokens.shape)} do "
                         f"not fit: expected x_rows (R, {k}), G + 1 starts for G ids in [0, {n // max(out_rows, 1)}), "
                         f"tokens (starts[-1],) or x_rows of starts[-1] rows")
    return P


def _reference(x_rows, w_stack, out_rows: int, expert_ids: np.ndarray, starts: np.ndarray, tokens) -> torch.Tensor:
    """The torch path: each group's rows de-quantized to float32, times its pairs' x in float32, cast to x's dtype."""
    y = x_rows.new_empty((int(starts[-1]), out_rows))  # (P, out)
    for e, a, b in zip(expert_ids, starts[:-1], starts[1:]):
        if b == a:
            continue
        rows = slice(int(e) * out_rows, (int(e) + 1) * out_rows)
        w = w_stack.rows(rows).dequantize(torch.float32) if isinstance(w_stack, GpuQ) else w_stack[rows].float()
        xe = x_rows[a:b] if tokens is None else x_rows.index_select(0, tokens[a:b])  # (m, k)
        y[a:b] = (xe.float() @ w.to(xe.device).T).to(y.dtype)
    return y


def grouped_linear(x_rows: torch.Tensor, w_stack: GpuQ | torch.Tensor, out_rows: int, expert_ids: np.ndarray,
                   starts: np.ndarray, tokens: torch.Tensor | None = None, tiles: Tiles | None = None,
                   config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """y (P, out_rows) in x's dtype: pair p (of group g: starts[g] <= p < starts[g + 1]) is x_rows[tokens[p]] (or
    x_rows[p]) times rows [e * out_rows, ...) of w_stack, e = expert_ids[g]. expert_ids (G,), starts (G + 1,) numpy
    (the tile table is made from them on the host); tiles: a tile_table made once for several calls over the same
    groups; config: (BLOCK_N, BLOCK_K, num_warps) (else the defaults)."""
    expert_ids, starts = np.asarray(expert_ids, np.int64), np.asarray(starts, np.int64)
    P = _check(x_rows, w_stack, out_rows, expert_ids, starts, tokens)
    if not applies(w_stack, x_rows):
        return _reference(x_rows, w_stack, out_rows, expert_ids, starts, tokens)
    k = w_stack.shape[1]
    y = x_rows.new_empty((P, out_rows))  # (P, out)
    if P == 0 or k == 0:
        return y.zero_()
    if tiles is None:
        tiles = tile_table(expert_ids, starts, block_m_for(starts), x_rows.device)
    # BLOCK_N 128: each de-quantized weight tile serves more of the tile's tokens (the sweep's best at the Qwen3 shape)
    bn, bk, warps = config or (128, 128 if isinstance(w_stack, GpuQ) else 64, 4)
    bk = max(32, min(bk, triton.next_power_of_2(k)))
    xc = x_rows if x_rows.stride(1) == 1 else x_rows.contiguous()
    tok = tokens if tokens is not None else tiles.table  # never read without GATHER
    prec = "ieee" if x_rows.dtype == torch.float32 else "tf32"  # float32 x: exact float32 products, not TF32's
    grid = (tiles.table.shape[0], triton.cdiv(out_rows, bn))
    if isinstance(w_stack, GpuQ):
        mins = w_stack.mins if w_stack.mins is not None else w_stack.scales  # never read but for Q4_1
        _grouped_kernel[grid](xc, tok, tiles.table, w_stack.qs, w_stack.scales, mins, y, k, out_rows, xc.stride(0),
                              w_stack.qs.stride(0), w_stack.scales.stride(1), y.stride(0), KIND=KIND[w_stack.fmt],
                              GATHER=tokens is not None, PREC=prec, BLOCK_M=tiles.block_m, BLOCK_N=bn, BLOCK_K=bk,
                              num_warps=warps)
    else:
        w = w_stack if w_stack.stride(1) == 1 else w_stack.contiguous()
        _grouped_kernel[grid](xc, tok, tiles.table, w, w, w, y, k, out_rows, xc.stride(0), w.stride(0), 0,
                              y.stride(0), KIND=FLOAT, GATHER=tokens is not None, PREC=prec, BLOCK_M=tiles.block_m,
                              BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return y
