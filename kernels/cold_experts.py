"""Numba kernels for a mixture of experts' cold experts (runtime/moe_ffn.py): a token's routed experts that live in CPU
RAM, read as the GGUF stores them, with no copy: each projection's experts stacked in one matrix of rows,

  gate, up  (E * n, row)  expert e's neuron j is row e * n + j  (rows of d weights)
  down      (E * d, row)  expert e's output i is row e * d + i  (rows of n weights: the file's (E, d, n) down)

so an expert is a range of rows. Row formats: llama.cpp's Q4_0 / Q4_1 / Q8_0 blocks and its K-quants Q4_K / Q5_K /
Q6_K (uint8 rows, read by cold_q's block dots, `cold_q_ir.rows_dot`, on its float route: float32 arithmetic on the
file's weights), or floats: float32, fp16 (as uint16 bits) and bf16 (as int16 bits), widened by `_f32`. gate and up
share a format; down may have its own (a Q4_K_M file's Q6_K). A K-quant is named by the caller (`fmts`): Q4_K's rows
are as wide as Q4_0's.

For tokens X (T, d) and pairs (token t, expert e, routing weight w) grouped per expert:

  Y[t] = sum over t's pairs of w * down_e(act(gate_e X[t]) * up_e X[t])       (ungated: act(up_e X[t]))

in two parallel passes, each reading an expert's rows once for all its tokens (prefill batches tokens per expert; a
decode step is the case T = 1):
  1. over (expert, group of 4 neurons): the 4 neurons' gate and up rows in one pass of 8 rows, for each of the
     expert's tokens in turn (the rows stay in L1 meanwhile) -> H[pair, neurons] (the activation codes of
     kernels/cold.py: ACT_CODE; ReLU family, SwiGLU, GeGLU)
  2. over groups of 8 output rows: for each expert, its 8 down rows' dots with each of its pairs' H, times the pair's
     weight, added into Y[t] -> each thread owns its 8 columns of Y, so no two threads write one element.
The next group's rows are prefetched while a group computes (pass 1). The int route of cold_q (x quantized) is not
used: results are the float route's, float32 sums (a float64 reference agrees to float32 rounding).

API:
  experts_ffn(X, tokens, experts, weights, gate, up, down, act, out=None, fmts=None) -> Y (T, d) float32
  expert_ffn(x, experts, weights, gate, up, down, act, out=None, fmts=None) -> y (d,) float32   (one token)
gate / up / down: 2-D C arrays as above (`gate` any array of up's for ungated FFNs, never read); act: ACT_CODE's name
or code. Pairs are grouped per expert here (a stable sort), and H is bounded by doing at most `MAX_H_BYTES` of pairs at
a time.

Numba's cache (cache=True) checks only this file, though the kernels are built from the helpers of others: its
folder is named by a hash of every kernel source (kernels/__init__.numba_cache_dir), so an edit anywhere starts anew.
"""

from __future__ import annotations

import numpy as np
from hotneurons.kernels.activations import _gated_value, _ungated_value
from hotneurons.kernels.cold import ACT_CODE, FIRST_GATED, SPINS, wait_ready
from hotneurons.kernels.cold_q import FORMAT_CODE, _format, _xq_buffers
from hotneurons.kernels.cold_q_ir import BLOCK, F16_TO_F32, Q4_0, Q4_1, Q4_K, Q5_K, Q8_0, XQ_OK, rows_dot
from hotneurons.kernels.intrinsics import _store_release
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

MAX_H_BYTES = 64 << 20  # pass 1's float32 neuron values held at a time (pairs x n): bounds a long prefill's scratch
FLOAT_ROWS = {"f32": np.float32, "f16": np.uint16, "bf16": np.int16}  # float formats as the kernels take their rows
_LUT = F16_TO_F32
__all__ = ["experts_ffn", "expert_ffn", "experts_layer_q", "CODE", "group_pairs", "row_format", "FLOAT_ROWS",
           "MAX_H_BYTES"]


@intrinsic
def _f32(typingctx, v):
    """A stored float weight -> float32: fp16 bits (uint16: LLVM's fpext of the half they are), bf16 bits (int16: the
    top half of a float32) or a float32 as is."""
    if v == types.uint16:
        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    elif v == types.int16:
        def codegen(context, builder, signature, args):
            wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
            return builder.bitcast(wide, ir.FloatType())
    elif v == types.float32:
        def codegen(context, builder, signature, args):
            return args[0]
    else:
        return None
    return types.float32(v), codegen


# ---------------------------------------------------------------------------------------------------------------
# Block rows (fmt: a literal format code in the caller's source, as cold_q._work needs)


@njit(nogil=True, cache=True, fastmath=True)
def _neurons4_q(xs, gate, up, r, nr, h, j, act, gated, lut, fmt):
    """h[j:j + 4] = the values of neurons at rows r..r + 3 for xs ((x,), or the int route's quantized x: cold_q's
    _xq_buffers); rows nr..nr + 3 prefetched meanwhile."""
    if gated:
        g0, g1, g2, g3, u0, u1, u2, u3 = rows_dot(
            xs, (gate[r], gate[r + 1], gate[r + 2], gate[r + 3], up[r], up[r + 1], up[r + 2], up[r + 3]),
            (gate[nr], gate[nr + 1], gate[nr + 2], gate[nr + 3], up[nr], up[nr + 1], up[nr + 2], up[nr + 3]), lut, fmt)
        h[j], h[j + 1] = _gated_value(act, g0, u0), _gated_value(act, g1, u1)
        h[j + 2], h[j + 3] = _gated_value(act, g2, u2), _gated_value(act, g3, u3)
    else:
        u0, u1, u2, u3 = rows_dot(xs, (up[r], up[r + 1], up[r + 2], up[r + 3]),
                                  (up[nr], up[nr + 1], up[nr + 2], up[nr + 3]), lut, fmt)
        h[j], h[j + 1], h[j + 2], h[j + 3] = (_ungated_value(u0, act), _ungated_value(u1, act),
                                              _ungated_value(u2, act), _ungated_value(u3, act))


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _gate_up_q(X, tok, off, ids, gate, up, H, act, fmt):
    """Pass 1 over block rows: H[p] (n,) = the neuron values of pair p's token under its expert."""
    n = H.shape[1]
    ng = n // 4
    gated = act >= FIRST_GATED
    lut = _LUT
    for w in prange(ids.shape[0] * ng):
        j, g = w // ng, w % ng
        base = ids[j] * n
        r = base + 4 * g
        nr = base + 4 * min(g + 1, ng - 1)  # the next group of this expert (prange gives a thread consecutive w)
        for p in range(off[j], off[j + 1]):
            x = X[tok[p]]
            if fmt == Q4_0:
                _neurons4_q((x,), gate, up, r, nr, H[p], 4 * g, act, gated, lut, 1)
            elif fmt == Q4_1:
                _neurons4_q((x,), gate, up, r, nr, H[p], 4 * g, act, gated, lut, 2)
            elif fmt == Q8_0:
                _neurons4_q((x,), gate, up, r, nr, H[p], 4 * g, act, gated, lut, 0)
            elif fmt == Q4_K:
                _neurons4_q((x,), gate, up, r, nr, H[p], 4 * g, act, gated, lut, 3)
            elif fmt == Q5_K:
                _neurons4_q((x,), gate, up, r, nr, H[p], 4 * g, act, gated, lut, 4)
            else:
                _neurons4_q((x,), gate, up, r, nr, H[p], 4 * g, act, gated, lut, 5)


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _gate_up_xq(xs, ids, gate, up, H, act, fmt):
    """Pass 1 for one token on the int route (xs: its quantized x), Q4_0 or Q8_0 rows: H[j] for expert ids[j]."""
    n = H.shape[1]
    ng = n // 4
    gated = act >= FIRST_GATED
    lut = _LUT
    for w in prange(ids.shape[0] * ng):
        j, g = w // ng, w % ng
        base = ids[j] * n
        nr = base + 4 * min(g + 1, ng - 1)
        if fmt == Q4_0:
            _neurons4_q(xs, gate, up, base + 4 * g, nr, H[j], 4 * g, act, gated, lut, 1)
        else:
            _neurons4_q(xs, gate, up, base + 4 * g, nr, H[j], 4 * g, act, gated, lut, 0)


@njit(nogil=True, cache=True, fastmath=True)
def _down8_q(h, down, r, y, w, lut, fmt):
    """y[0:8] += w * (down rows r..r + 7 . h)."""
    v0, v1, v2, v3, v4, v5, v6, v7 = rows_dot(
        (h,), (down[r], down[r + 1], down[r + 2], down[r + 3], down[r + 4], down[r + 5], down[r + 6], down[r + 7]),
        (), lut, fmt)
    y[0] += w * v0
    y[1] += w * v1
    y[2] += w * v2
    y[3] += w * v3
    y[4] += w * v4
    y[5] += w * v5
    y[6] += w * v6
    y[7] += w * v7


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _down_q(H, tok, off, ids, wts, down, Y, fmt):
    """Pass 2 over block rows: Y (T, d) = sum over pairs p of wts[p] * down_{expert of p} . H[p], into Y[tok[p]]."""
    T, d = Y.shape
    lut = _LUT
    for g in prange(d // 8):
        c = 8 * g
        for t in range(T):
            Y[t, c:c + 8] = 0.0
        for j in range(ids.shape[0]):
            r = ids[j] * d + c
            for p in range(off[j], off[j + 1]):
                y = Y[tok[p], c:c + 8]
                if fmt == Q4_0:
                    _down8_q(H[p], down, r, y, wts[p], lut, 1)
                elif fmt == Q4_1:
                    _down8_q(H[p], down, r, y, wts[p], lut, 2)
                elif fmt == Q8_0:
                    _down8_q(H[p], down, r, y, wts[p], lut, 0)
                elif fmt == Q4_K:
                    _down8_q(H[p], down, r, y, wts[p], lut, 3)
                elif fmt == Q5_K:
                    _down8_q(H[p], down, r, y, wts[p], lut, 4)
                else:
                    _down8_q(H[p], down, r, y, wts[p], lut, 5)


# ---------------------------------------------------------------------------------------------------------------
# Float rows (f32, fp16 bits, bf16 bits): the same passes, plain loops that LLVM vectorises


@njit(nogil=True, cache=True, fastmath=True, inline="always")
def _fdot(x, row):
    s = np.float32(0.0)
    for i in range(x.shape[0]):
        s += x[i] * _f32(row[i])
    return s


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _gate_up_f(X, tok, off, ids, gate, up, H, act):
    n = H.shape[1]
    gated = act >= FIRST_GATED
    for w in prange(ids.shape[0] * n):
        j, i = w // n, w % n
        r = ids[j] * n + i
        for p in range(off[j], off[j + 1]):
            x = X[tok[p]]
            u = _fdot(x, up[r])
            H[p, i] = _gated_value(act, _fdot(x, gate[r]), u) if gated else _ungated_value(u, act)


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _down_f(H, tok, off, ids, wts, down, Y):
    T, d = Y.shape
    for c in prange(d):
        for t in range(T):
            Y[t, c] = 0.0
        for j in range(ids.shape[0]):
            row = down[ids[j] * d + c]
            for p in range(off[j], off[j + 1]):
                Y[tok[p], c] += wts[p] * _fdot(H[p], row)


@njit(nogil=True, cache=True)
def experts_layer_q(ready, release, i, X, ids, wts, cold_of, gate, up, down, H, Y, act, fgu, fdn, xq=False):
    """One decode token's cold experts over block rows in one call, so that no Python runs between the GPU's signal
    and the kernel (as cold_q.cold_layer_q): wait for ready[i] (i >= 0); the routed slots whose expert is cold
    (cold_of[ids[s]] >= 0: its index in the rows), both passes into Y (1, d); release[i] = 1 once Y is written.
    X (1, d) float32, ids (k,) int64, wts (k,) float32, H (k, n) scratch; fgu / fdn: cold_q_ir's format codes.
    xq: the gate and up dots on cold_q's int route (x quantized once, as llama.cpp's CPU dots; Q4_0 / Q8_0 rows where
    cold_q_ir.XQ_OK, else the float route; it adds x's rounding error: cold_q's docstring). Returns the cold slots'
    count, or -1 when no signal came within SPINS reads."""
    if i >= 0 and not wait_ready(ready, i, SPINS):
        return -1
    m = 0
    for s in range(ids.shape[0]):
        if cold_of[ids[s]] >= 0:
            m += 1
    cid = np.empty(m, np.int64)  # (m,) the cold experts' indices in the rows (a token's top-k: distinct)
    cw = np.empty(m, np.float32)  # (m,) their routing weights
    j = 0
    for s in range(ids.shape[0]):
        c = cold_of[ids[s]]
        if c >= 0:
            cid[j], cw[j] = c, wts[s]
            j += 1
    if m == 0:
        Y[0, :] = 0.0
    else:
        tok = np.zeros(m, np.int64)  # (m,) every pair is the one token's
        off = np.arange(m + 1)  # (m + 1,) one pair an expert
        if xq and XQ_OK and (fgu == Q4_0 or fgu == Q8_0):
            _gate_up_xq(_xq_buffers(X[0], fgu, True), cid, gate, up, H[:m], act, fgu)
        else:
            _gate_up_q(X, tok, off, cid, gate, up, H[:m], act, fgu)
        _down_q(H[:m], tok, off, cid, cw, down, Y, fdn)
    if i >= 0:
        _store_release(release, i, np.int32(1))
    return m


# ---------------------------------------------------------------------------------------------------------------
# Python side


def row_format(rows: np.ndarray, width: int, fmt: str | None = None) -> str:
    """The format of a 2-D C array of rows holding `width` weights each: q8_0 / q4_0 / q4_1 / q4_k / q5_k / q6_k
    (uint8 blocks), f32, f16 (uint16 bits) or bf16 (int16 bits); a one-line error otherwise. fmt: the block format
    the rows are stored in, checked against their width (None: told by it among q8_0, q4_0 and q4_1; a K-quant must
    be named, Q4_K's rows being as wide as Q4_0's)."""
    if rows.ndim == 2 and rows.flags.c_contiguous:
        if rows.dtype == np.uint8 and (fmt is None or fmt in CODE):
            code = _format(width, rows.shape[1], -1 if fmt is None else CODE[fmt])
            if code >= 0:
                return NAME[code]
        for name, dt in FLOAT_ROWS.items():
            if rows.dtype == dt and rows.shape[1] == width and fmt in (None, name):
                return name
    raise ValueError(f"cold experts: rows {rows.shape} {rows.dtype} are not {width}-weight rows of "
                     f"{fmt or 'Q4_0 / Q4_1 / Q8_0'} blocks (uint8, {width} a multiple of {BLOCK}; 256 for K-quants) "
                     f"nor float32 / fp16 (uint16) / bf16 (int16), C-contiguous: store the experts in one of those "
                     f"formats")


def group_pairs(tokens: np.ndarray, experts: np.ndarray, weights: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Pairs (P,) each -> (ids (m,) the distinct experts ascending, off (m + 1,) each one's range of the sorted pairs,
    tok (P,) int64 and wts (P,) float32 in that order): each expert's tokens together (a stable sort)."""
    order = np.argsort(experts, kind="stable")  # (P,)
    e = np.asarray(experts, np.int64)[order]
    ids, start = np.unique(e, return_index=True)  # (m,) each
    off = np.append(start, len(e)).astype(np.int64)  # (m + 1,)
    return (ids.astype(np.int64), off, np.ascontiguousarray(np.asarray(tokens, np.int64)[order]),
            np.ascontiguousarray(np.asarray(weights, np.float32)[order]))


def experts_ffn(X: np.ndarray, tokens: np.ndarray, experts: np.ndarray, weights: np.ndarray, gate: np.ndarray,
                up: np.ndarray, down: np.ndarray, act: str | int, out: np.ndarray | None = None,
                fmts: tuple[str | None, str | None] | None = None) -> np.ndarray:
    """out (T, d) float32 = for each token the sum over its pairs (tokens[p] == t) of weights[p] * expert
    experts[p]'s FFN of X[t] (the module docstring); tokens with no pair get zeros. X (T, d) float32, tokens /
    experts (P,) int, weights (P,) float; gate, up (E * n, row), down (E * d, row) as stored; fmts: the formats of
    gate / up and of down (row_format's `fmt`; None: told by the rows)."""
    X = np.ascontiguousarray(X, dtype=np.float32)
    T, d = X.shape
    code = ACT_CODE[act] if isinstance(act, str) else int(act)
    n = up.shape[0] // max(1, down.shape[0] // d)  # neurons an expert
    if down.shape[0] % d or (code >= FIRST_GATED and up.shape[0] != gate.shape[0]):
        raise ValueError(f"cold experts: down has {down.shape[0]} rows, not experts x d = {d}, or gate "
                         f"{gate.shape} and up {up.shape} differ")
    fgu, fdn = (row_format(up, d, fmts and fmts[0]), row_format(down, n, fmts and fmts[1]))
    if (fgu not in FLOAT_ROWS and n % 4) or (fdn not in FLOAT_ROWS and d % 8):
        raise ValueError(f"cold experts: block rows need n ({n}) a multiple of 4 and d ({d}) of 8")
    if code >= FIRST_GATED and row_format(gate, d, fmts and fmts[0]) != fgu:
        raise ValueError("cold experts: gate and up rows differ in format: store them in one")
    E = down.shape[0] // d
    experts = np.asarray(experts, np.int64)
    if len(experts) and (experts.min() < 0 or experts.max() >= E):
        raise ValueError(f"cold experts: expert ids {experts.min()}..{experts.max()} outside the {E} experts stored")
    out = np.empty((T, d), np.float32) if out is None else out
    if out.shape != (T, d) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"cold experts: out must be ({T}, {d}) float32, C-contiguous")
    if T == 0:
        return out
    out[:] = 0.0
    tokens, weights = np.asarray(tokens, np.int64), np.asarray(weights, np.float32)
    # H of at most MAX_H_BYTES: whole tokens at a time, so that each token's sum is one pass-2 call's
    per = max(1, MAX_H_BYTES // max(1, 4 * n * max(1, -(-len(experts) // T))))  # tokens a chunk
    y = np.empty((min(T, per), d), np.float32)
    for t0 in range(0, T, per):
        t1 = min(T, t0 + per)
        sel = (tokens >= t0) & (tokens < t1)
        ids, off, tok, wts = group_pairs(tokens[sel] - t0, experts[sel], weights[sel])
        if not len(ids):
            continue
        H = np.empty((len(tok), n), np.float32)  # (P, n) the neuron values of each pair
        Xc, yc = X[t0:t1], y[:t1 - t0]
        if fgu in FLOAT_ROWS:
            _gate_up_f(Xc, tok, off, ids, gate if code >= FIRST_GATED else up, up, H, code)
        else:
            _gate_up_q(Xc, tok, off, ids, gate if code >= FIRST_GATED else up, up, H, code, CODE[fgu])
        if fdn in FLOAT_ROWS:
            _down_f(H, tok, off, ids, wts, down, yc)
        else:
            _down_q(H, tok, off, ids, wts, down, yc, CODE[fdn])
        out[t0:t1] = yc
    return out


CODE = FORMAT_CODE  # format name -> cold_q_ir's codes
NAME = {c: f for f, c in CODE.items()}


def expert_ffn(x: np.ndarray, experts: np.ndarray, weights: np.ndarray, gate: np.ndarray, up: np.ndarray,
               down: np.ndarray, act: str | int, out: np.ndarray | None = None,
               fmts: tuple[str | None, str | None] | None = None) -> np.ndarray:
    """One token (a decode step): out (d,) float32 = sum over i of weights[i] * expert experts[i]'s FFN of x (d,)."""
    k = len(experts)
    y = experts_ffn(np.asarray(x, np.float32)[None], np.zeros(k, np.int64), experts, weights, gate, up, down, act,
                    None if out is None else out[None], fmts)
    return y[0]
