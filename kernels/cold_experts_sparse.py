"""A decode token's cold experts under a ReLU-family activation (relu, reglu, drelu: kernels/cold.py ACT_CODE 0, 2, 3),
computing only the neurons that fire (runtime/moe_ffn.py picks it for a layer whose cold experts have `down_t`); and,
with thresholds, a gated layer's cold neurons gate-first (swiglu, geglu too: runtime/hybrid_ffn.py's gate mask, one
"expert" of all the layer's cold rows; common/gating.py).

A neuron whose gate pre-activation is <= 0 (ungated relu: whose up pre-activation) outputs exactly 0, so its up row
and its down weights need not be read. With thresholds (tau_g, tau_h) a gated neuron is kept iff |act(g)| > tau_g
(its up row read only then) and |h| > tau_h (its down row read only then); (0, 0) is the exact rule above.

The file's down rows are output-major (expert e's output i: d rows of n weights, a block spanning 32 neurons), which
a skipped neuron cannot avoid reading, so the layer holds its cold experts' down projection neuron-major as well
(`down_t`, built at load by runtime/moe_down_t.py):

  gate, up  (E_rows * n, row)  as kernels/cold_experts reads them (cold_of: expert id -> its index in these rows)
  down_t    (n_cold * n, row)  cold expert c's neuron j is row c * n + j: the d weights neuron j writes
                               (dt_of: expert id -> c)

Rows: Q4_0 / Q4_1 / Q8_0 blocks (cold_q_ir's row dots and axpys, the float route) or floats (f32, fp16 bits as uint16,
bf16 bits as int16: cold_experts._f32); gate / up may be K-quants too (Q4_K / Q5_K / Q6_K: their dots, kernels/cold_k),
down_t not (runtime/moe_down_t.py and models/ffn_weights.py store it in one of the three). gate / up and down_t may
differ in format.

One call for the token (`sparse_layer`), so that no Python runs between the GPU's signal and the kernel (as
cold_experts.experts_layer_q): wait for ready[i], then
  A. parallel over chunks of NEURONS neurons of every routed cold expert: each group of four neurons' gate rows in one
     pass (the next group's prefetched), the up row only of a neuron whose gate is > 0, and each neuron with h != 0
     kept as (its down_t row, h * the expert's routing weight) in the chunk's own slots; the kept ones then moved to
     the front in order (serial: a few percent of the slots);
  B. over the kept neurons, claimed cold.CHUNK at a time from an atomic counter as cold_q.cold_ffn_q claims its
     active list: acc += h * down_t row, four rows at a time, into each thread's row of `part`; then every thread
     sums one slice of d across those rows into `out` (cold.py's reduction);
release[i] = 1 once `out` is written. With xq, pass A's dots take cold_q's int route (x quantized once to Q8_0, as
cold_experts.experts_layer_q's): the gate rows are read whole, so their dots, not DRAM, bound pass A. Otherwise the
result is the float route's, float32 sums: which thread sums which neuron varies from call to call, so results vary
in the last float32 bits.

Numba's cache (cache=True) checks only this file, though the kernels are built from the helpers of others: its
folder is named by a hash of every kernel source (kernels/__init__.numba_cache_dir), so an edit anywhere starts anew.
"""

from __future__ import annotations

import numpy as np
from hotneurons.kernels.activations import _gate_value, _times_up, _ungated_value
from hotneurons.kernels.cold import FIRST_GATED, SPINS, _claim, _head, _n_chunks, _sum_rows, wait_ready
from hotneurons.kernels.cold_q import _xq_buffers
from hotneurons.kernels.cold_q_ir import F16_TO_F32, Q4_0, Q4_1, Q4_K, Q5_K, Q8_0, XQ_OK
from hotneurons.kernels.intrinsics import _fetch_add, _store_release
from hotneurons.kernels.sparse_rows import _axpy1, _axpy4, _dot1, _dots4
from numba import njit, prange

SPARSE_ACTS = ("relu", "reglu", "drelu")  # activations whose zero neurons are exact zeros: what this kernel skips
NEURONS = 32  # neurons a pass-A work item covers (its slots in the scratch)
_LUT = F16_TO_F32
__all__ = ["sparse_layer", "sparse_layer_predicted", "scratch", "SPARSE_ACTS", "NEURONS"]


# ---------------------------------------------------------------------------------------------------------------
# Pass A: which neurons fire, and their values


@njit(nogil=True, cache=True, fastmath=True)
def _keep(h, tau_h, row, w, idx, hs, at):
    """Slot `at` = (row, h * w) when the neuron fires (|h| > tau_h; tau_h = 0: h != 0); returns the slots used."""
    if not abs(h) > tau_h:
        return 0
    idx[at], hs[at] = row, h * w
    return 1


@njit(nogil=True, cache=True, fastmath=True)
def _park(act, g, tau_g, j, idx, hs, at):
    """Slot `at` = (neuron j, act(g)) where |act(g)| > tau_g (ReLU gates with tau_g = 0: g > 0, the exact zeros): a
    neuron whose up row is to be read; returns the slots used (0 or 1)."""
    a = _gate_value(act, g)
    if not abs(a) > tau_g:
        return 0
    idx[at], hs[at] = j, a
    return 1


@njit(nogil=True, cache=True, fastmath=True)
def _gated_chunk(x, xs, gate, up, base, j0, j1, n, act, tg, th, tb, w, idx, hs, at, lut, fmt):
    """A gated expert's neurons j0..j1 - 1 (gate / up rows from `base`, down_t rows from tb) in two sweeps over the
    item's own slots: the gate rows four at a time (the next four prefetched), the neurons that pass tau_g parked as
    (j, act(g)); then `_up_parked`. Returns the kept count."""
    m = 0
    j = j0
    while j + 4 <= j1:
        r = base + j
        nr = base + min(j + 4, n - 4)  # the next group's rows (the next chunk's first: the same thread's next item)
        g0, g1, g2, g3 = _dots4(x, xs, gate[r], gate[r + 1], gate[r + 2], gate[r + 3], gate[nr], gate[nr + 1],
                                gate[nr + 2], gate[nr + 3], lut, fmt)
        m += _park(act, g0, tg, j, idx, hs, at + m)
        m += _park(act, g1, tg, j + 1, idx, hs, at + m)
        m += _park(act, g2, tg, j + 2, idx, hs, at + m)
        m += _park(act, g3, tg, j + 3, idx, hs, at + m)
        j += 4
    for j in range(j, j1):
        m += _park(act, _dot1(x, xs, gate[base + j], lut, fmt), tg, j, idx, hs, at + m)
    return _up_parked(x, xs, up, base, m, act, th, tb, w, idx, hs, at, lut, fmt)


@njit(nogil=True, cache=True, fastmath=True)
def _up_parked(x, xs, up, base, m, act, th, tb, w, idx, hs, at, lut, fmt):
    """The m parked neurons' (slots at.., (j, act(g))) up rows four at a time (the next four prefetched: one row at a
    time, a dot waits on DRAM's latency), the ones whose |h| passes tau_h kept as (down_t row, h * w), overwriting the
    parked slots from the front (kept <= read, so no unread slot is overwritten). Returns the kept count."""
    k = 0
    q = 0
    while q + 4 <= m:
        p = at + min(q + 4, m - 4)  # the next four parked neurons' slots
        i0, i1, i2, i3 = idx[at + q], idx[at + q + 1], idx[at + q + 2], idx[at + q + 3]
        a0, a1, a2, a3 = hs[at + q], hs[at + q + 1], hs[at + q + 2], hs[at + q + 3]
        u0, u1, u2, u3 = _dots4(x, xs, up[base + i0], up[base + i1], up[base + i2], up[base + i3],
                                up[base + idx[p]], up[base + idx[p + 1]], up[base + idx[p + 2]],
                                up[base + idx[p + 3]], lut, fmt)
        k += _keep(_times_up(act, a0, u0), th, tb + i0, w, idx, hs, at + k)
        k += _keep(_times_up(act, a1, u1), th, tb + i1, w, idx, hs, at + k)
        k += _keep(_times_up(act, a2, u2), th, tb + i2, w, idx, hs, at + k)
        k += _keep(_times_up(act, a3, u3), th, tb + i3, w, idx, hs, at + k)
        q += 4
    for q in range(q, m):
        i0, a0 = idx[at + q], hs[at + q]
        k += _keep(_times_up(act, a0, _dot1(x, xs, up[base + i0], lut, fmt)), th, tb + i0, w, idx, hs, at + k)
    return k


@njit(nogil=True, cache=True, fastmath=True)
def _predicted(pb, pt, p, zs, j0, j1, idx, at):
    """Neurons j0..j1 - 1 that expert predictor p marks (pb[p, j] . zs > pt[p, j]) parked as j in slots at..;
    returns how many."""
    m = 0
    r = zs.shape[0]
    for j in range(j0, j1):
        row = pb[p, j]
        score = np.float32(0.0)
        for t in range(r):
            score += row[t] * zs[t]
        if score > pt[p, j]:
            idx[at + m] = j
            m += 1
    return m


@njit(nogil=True, cache=True, fastmath=True)
def _predicted_chunk(x, xs, gate, up, base, j0, j1, act, tg, th, tb, w, idx, hs, at, lut, fmt, pb, pt, p, zs):
    """A gated expert's neurons j0..j1 - 1 as _gated_chunk computes them, but only those its predictor marks: their
    gate rows four at a time (the next four prefetched), the passing ones parked as (j, act(g)) over the marked
    slots from the front; then `_up_parked`. An unmarked neuron's rows are not read."""
    mc = _predicted(pb, pt, p, zs, j0, j1, idx, at)
    m = 0
    q = 0
    while q + 4 <= mc:
        nx = at + min(q + 4, mc - 4)  # the next four marked neurons' slots
        i0, i1, i2, i3 = idx[at + q], idx[at + q + 1], idx[at + q + 2], idx[at + q + 3]
        g0, g1, g2, g3 = _dots4(x, xs, gate[base + i0], gate[base + i1], gate[base + i2], gate[base + i3],
                                gate[base + idx[nx]], gate[base + idx[nx + 1]], gate[base + idx[nx + 2]],
                                gate[base + idx[nx + 3]], lut, fmt)
        m += _park(act, g0, tg, i0, idx, hs, at + m)
        m += _park(act, g1, tg, i1, idx, hs, at + m)
        m += _park(act, g2, tg, i2, idx, hs, at + m)
        m += _park(act, g3, tg, i3, idx, hs, at + m)
        q += 4
    for q in range(q, mc):
        i0 = idx[at + q]
        m += _park(act, _dot1(x, xs, gate[base + i0], lut, fmt), tg, i0, idx, hs, at + m)
    return _up_parked(x, xs, up, base, m, act, th, tb, w, idx, hs, at, lut, fmt)


@njit(nogil=True, cache=True, fastmath=True)
def _chunk(x, xs, gate, up, base, j0, j1, n, act, gated, tg, th, tb, w, idx, hs, at, lut, fmt, pb, pt, p, zs):
    """Neurons j0..j1 - 1 of the expert whose gate / up rows start at `base` (down_t rows at tb): the firing ones into
    slots at.. (idx, hs); returns how many. xs: what block rows' dots read ((x,), or the int route's quantized x);
    fmt: a literal code (cold_q._work says why). p >= 0: only the neurons expert predictor p marks (zs its first
    layer's output; gated experts)."""
    if p >= 0:
        return _predicted_chunk(x, xs, gate, up, base, j0, j1, act, tg, th, tb, w, idx, hs, at, lut, fmt, pb, pt, p,
                                zs)
    if gated:
        return _gated_chunk(x, xs, gate, up, base, j0, j1, n, act, tg, th, tb, w, idx, hs, at, lut, fmt)
    k = 0
    j = j0
    while j + 4 <= j1:
        r = base + j
        nr = base + min(j + 4, n - 4)
        u0, u1, u2, u3 = _dots4(x, xs, up[r], up[r + 1], up[r + 2], up[r + 3], up[nr], up[nr + 1], up[nr + 2],
                                up[nr + 3], lut, fmt)
        k += _keep(_ungated_value(u0, act), th, tb + j, w, idx, hs, at + k)
        k += _keep(_ungated_value(u1, act), th, tb + j + 1, w, idx, hs, at + k)
        k += _keep(_ungated_value(u2, act), th, tb + j + 2, w, idx, hs, at + k)
        k += _keep(_ungated_value(u3, act), th, tb + j + 3, w, idx, hs, at + k)
        j += 4
    for j in range(j, j1):
        k += _keep(_ungated_value(_dot1(x, xs, up[base + j], lut, fmt), act), th, tb + j, w, idx, hs, at + k)
    return k


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _fire(x, xq, use_xq, cid, cw, cdt, gate, up, n, act, tg, th, idx, hs, cnt, fmt, pb, pt, cp, z):
    """Pass A over the m routed cold experts: work item (s, c) = neurons c * NEURONS.. of expert slot s, its firing
    neurons in slots item * NEURONS.. of idx / hs, their count in cnt[item]. use_xq: the gate and up dots on the int
    route, from xq (cold_q._xq_buffers of x; Q4_0 / Q8_0 rows); literal codes and XQ_OK as in cold_q.cold_ffn_q.
    cp (m,): each slot's expert predictor (-1: none; z[s] its first layer's output)."""
    nc = -(-n // NEURONS)
    gated = act >= FIRST_GATED
    lut = _LUT
    for item in prange(cid.shape[0] * nc):
        s, c = item // nc, item % nc
        j0, j1 = c * NEURONS, min(n, c * NEURONS + NEURONS)
        base, tb, w, at = cid[s] * n, cdt[s] * n, cw[s], item * NEURONS
        p, zs = cp[s], z[s]
        if XQ_OK and use_xq and fmt == Q4_0:
            cnt[item] = _chunk(x, xq, gate, up, base, j0, j1, n, act, gated, tg, th, tb, w, idx, hs, at, lut,
                               1, pb, pt, p, zs)
        elif XQ_OK and use_xq:  # Q8_0
            cnt[item] = _chunk(x, xq, gate, up, base, j0, j1, n, act, gated, tg, th, tb, w, idx, hs, at, lut,
                               0, pb, pt, p, zs)
        elif fmt == Q4_0:
            cnt[item] = _chunk(x, (x,), gate, up, base, j0, j1, n, act, gated, tg, th, tb, w, idx, hs, at, lut,
                               1, pb, pt, p, zs)
        elif fmt == Q4_1:
            cnt[item] = _chunk(x, (x,), gate, up, base, j0, j1, n, act, gated, tg, th, tb, w, idx, hs, at, lut,
                               2, pb, pt, p, zs)
        elif fmt == Q4_K:
            cnt[item] = _chunk(x, (x,), gate, up, base, j0, j1, n, act, gated, tg, th, tb, w, idx, hs, at, lut,
                               3, pb, pt, p, zs)
        elif fmt == Q5_K:
            cnt[item] = _chunk(x, (x,), gate, up, base, j0, j1, n, act, gated, tg, th, tb, w, idx, hs, at, lut,
                               4, pb, pt, p, zs)
        elif fmt > Q5_K:  # Q6_K
            cnt[item] = _chunk(x, (x,), gate, up, base, j0, j1, n, act, gated, tg, th, tb, w, idx, hs, at, lut,
                               5, pb, pt, p, zs)
        else:  # Q8_0, or float rows (their overloads take no format)
            cnt[item] = _chunk(x, (x,), gate, up, base, j0, j1, n, act, gated, tg, th, tb, w, idx, hs, at, lut,
                               0, pb, pt, p, zs)


@njit(nogil=True, cache=True)
def _compact(idx, hs, cnt, items):
    """The kept slots of the first `items` work items moved to the front, in order; returns their count."""
    k = 0
    for item in range(items):
        at = item * NEURONS
        for q in range(at, at + cnt[item]):
            idx[k], hs[k] = idx[q], hs[q]
            k += 1
    return k


# ---------------------------------------------------------------------------------------------------------------
# Pass B: the firing neurons' down_t rows


@njit(nogil=True, cache=True, fastmath=True)
def _down(idx, hs, q0, q1, down_t, acc, lut, fmt):
    """acc += hs[q] * down_t[idx[q]] for q in q0..q1 - 1, four rows at a time, the next four prefetched."""
    q = q0
    while q + 4 <= q1:
        p = min(q + 4, q1 - 4)
        _axpy4(hs[q], hs[q + 1], hs[q + 2], hs[q + 3], down_t[idx[q]], down_t[idx[q + 1]], down_t[idx[q + 2]],
               down_t[idx[q + 3]], down_t[idx[p]], down_t[idx[p + 1]], down_t[idx[p + 2]], down_t[idx[p + 3]], lut,
               fmt, acc)
        q += 4
    for q in range(q, q1):
        _axpy1(hs[q], down_t[idx[q]], lut, fmt, acc)


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _spread(idx, hs, k, down_t, part, out, fmt):
    """Pass B: out (d,) = sum over q < k of hs[q] * down_t[idx[q]], per-thread partial sums in part's rows (out of
    shape (0,): part's rows hold the sum)."""
    d = out.shape[0]
    T = _n_chunks(k, part.shape[0])
    head = _head(k, T)
    counter = np.zeros(1, np.int64)  # claims taken
    lut = _LUT
    for t in prange(T):
        acc = part[t]  # (d,) this thread's partial sum
        acc[:] = 0.0
        while True:
            q0, q1 = _claim(_fetch_add(counter, 1), k, head)
            if q0 >= k:
                break
            if fmt == Q4_0:
                _down(idx, hs, q0, q1, down_t, acc, lut, 1)
            elif fmt == Q4_1:
                _down(idx, hs, q0, q1, down_t, acc, lut, 2)
            else:
                _down(idx, hs, q0, q1, down_t, acc, lut, 0)
    if out.shape[0] == 0:  # the caller sums part's rows (a dense layer's HostIO on CUDA); those past T are zero
        part[T:] = 0.0
        return
    for c in prange(T):  # the partial rows summed by all threads, one slice of d each
        _sum_rows(part, T, out, c * d // T, (c + 1) * d // T)


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _project(pa, cp, x, z):
    """z[s] = pa[cp[s]] @ x for the slots with an expert predictor (cp[s] >= 0): its first layer, (r, d) float32."""
    m, r = z.shape
    for q in prange(m * r):
        s, t = q // r, q % r
        if cp[s] < 0:
            continue
        row = pa[cp[s], t]
        acc = np.float32(0.0)
        for i in range(x.shape[0]):
            acc += row[i] * x[i]
        z[s, t] = acc


@njit(nogil=True, cache=True)
def _layer(ready, release, i, x, ids, wts, cold_of, dt_of, gate, up, down_t, idx, hs, cnt, part, out, act, fgu, fdn,
           xq, tau_g, tau_h, pa, pb, pt, pid_of, z):
    """sparse_layer's and sparse_layer_predicted's body (pid_of of length 0: no predictors)."""
    if fdn >= Q4_K:
        raise ValueError("sparse_layer: down_t rows in a K-quant: store them in Q8_0, Q4_0 or Q4_1")
    if pid_of.shape[0] and act < FIRST_GATED:
        raise ValueError("sparse_layer_predicted: expert predictors need a gated activation (reglu, drelu)")
    if i >= 0 and not wait_ready(ready, i, SPINS):
        return -1
    m = 0
    for s in range(ids.shape[0]):
        if dt_of[ids[s]] >= 0:
            m += 1
    cid = np.empty(m, np.int64)  # (m,) the cold experts' gate / up row blocks
    cdt = np.empty(m, np.int64)  # (m,) their down_t row blocks
    cw = np.empty(m, np.float32)  # (m,) their routing weights
    cp = np.full(m, -1, np.int64)  # (m,) their expert predictors (-1: none)
    j = 0
    for s in range(ids.shape[0]):
        e = ids[s]
        if dt_of[e] >= 0:
            cid[j], cdt[j], cw[j] = cold_of[e], dt_of[e], wts[s]
            if pid_of.shape[0]:
                cp[j] = pid_of[e]
            j += 1
    k = 0
    if m:
        n = down_t.shape[0] // (dt_of.max() + 1)  # neurons an expert: down_t holds every cold expert's, dt_of maps all
        use = xq and XQ_OK and (fgu == Q4_0 or fgu == Q8_0)
        tg, th = np.float32(tau_g), np.float32(tau_h)
        if pid_of.shape[0]:
            _project(pa, cp, x, z[:m])
        _fire(x, _xq_buffers(x, fgu, use), use, cid, cw, cdt, gate, up, n, act, tg, th, idx, hs, cnt, fgu, pb, pt,
              cp, z)
        k = _compact(idx, hs, cnt, m * (-(-n // NEURONS)))
    _spread(idx, hs, k, down_t, part, out, fdn)
    if i >= 0:
        _store_release(release, i, np.int32(1))
    return k


_NO_PA = np.zeros((1, 1, 1), np.float32)  # no expert predictors: sparse_layer's stand-ins (pid_of of length 0; z,
# which _project writes, made per call)
_NO_PT = np.zeros((1, 1), np.float32)
_NO_PID = np.zeros(0, np.int64)


@njit(nogil=True, cache=True)
def sparse_layer(ready, release, i, x, ids, wts, cold_of, dt_of, gate, up, down_t, idx, hs, cnt, part, out, act,
                 fgu, fdn, xq=False, tau_g=0.0, tau_h=0.0):
    """One decode token's routed cold experts, only their firing neurons (module docstring), in one call: wait for
    ready[i] (i >= 0); out (d,) float32 = sum over the routed slots s whose expert is cold (dt_of[ids[s]] >= 0) of
    wts[s] * that expert's FFN of x; release[i] = 1 once out is written.

    x (d,) float32, ids (k,) int64, wts (k,) float32; cold_of / dt_of (E,) int64: expert id -> its index in gate / up's
    rows, in down_t's rows (-1: on the device); gate / up (E_rows * n, row), down_t (n_cold * n, row) as the module
    docstring; idx, hs, cnt: `scratch(k, n)`'s; part (threads, d) float32; act: ACT_CODE (0, 2 or 3); fgu / fdn:
    cold_q_ir's format code of gate / up and of down_t (-1: float rows; down_t: not a K-quant); xq: the gate and up
    dots on cold_q's int route (x quantized once; Q4_0 / Q8_0 rows where cold_q_ir.XQ_OK, else the float route).
    Returns the firing neurons' count, or -1 (nothing done) when no signal came within SPINS reads."""
    return _layer(ready, release, i, x, ids, wts, cold_of, dt_of, gate, up, down_t, idx, hs, cnt, part, out, act, fgu,
                  fdn, xq, tau_g, tau_h, _NO_PA, _NO_PA, _NO_PT, _NO_PID, np.empty((ids.shape[0], 1), np.float32))


@njit(nogil=True, cache=True)
def sparse_layer_predicted(ready, release, i, x, ids, wts, cold_of, dt_of, gate, up, down_t, idx, hs, cnt, part, out,
                           act, fgu, fdn, pa, pb, pt, pid_of, z, xq=False, tau_g=0.0, tau_h=0.0):
    """sparse_layer where each cold expert e with pid_of[e] = p >= 0 computes only the neurons its predictor marks
    (a gated activation): neuron j iff (pb[p] @ (pa[p] @ x))_j > pt[p, j], and of those the ones that fire. The
    unmarked neurons' gate, up and down rows are not read: a marked firing neuron is computed exactly, an unmarked
    one is dropped (the predictor's recall). pa (P, r, d), pb (P, n, r), pt (P, n) float32; pid_of (E,) int64 (-1:
    whole gate rows read, as sparse_layer); z (k, r) float32 scratch."""
    return _layer(ready, release, i, x, ids, wts, cold_of, dt_of, gate, up, down_t, idx, hs, cnt, part, out, act, fgu,
                  fdn, xq, tau_g, tau_h, pa, pb, pt, pid_of, z)


def scratch(k: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """sparse_layer's (idx, hs, cnt) for k routed experts of n neurons: a slot per neuron (whole chunks)."""
    items = k * -(-n // NEURONS)
    return np.empty(items * NEURONS, np.int64), np.empty(items * NEURONS, np.float32), np.empty(items, np.int64)
