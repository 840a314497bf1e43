"""A mixture of experts' prefill with its cold experts computed on the device: their rows cross PCIe as stored (the
file's blocks), are de-quantized there (kernels/dequant.py) and multiplied by the expert's tokens, as the dense path's
prefill streams its cold rows (runtime/cold_rows.chunks).

Why: at prefill the CPU's experts are bound by arithmetic (every routed token runs every neuron of its experts), so a
512-token prompt spent most of its time in them, while an expert's rows cross PCIe once for all of its tokens. Below
OFFLOAD_TOKENS tokens an expert has too few tokens for the copy to pay, and the CPU's kernel keeps them. Layers whose
cold experts compute only firing neurons at decode (ReLU family, `down_t`: docs/runtime.md, "Sparse experts") copy
down_t's rows in place of the file's down rows, which their load dropped: prefill and decode then compute with the
same down weights (down_t's), and the file's down pages stay unread.

Where the cold rows are Q4_0 / Q4_1 / Q8_0 and the layer has no down_t, the routed cold experts' rows are copied into
one buffer a projection (a copy for each run of consecutive stored experts: `fetch`, on a side stream while the GPU
experts compute), packed on the device as the GPU experts are (kernels/qlinear.pack), and the pairs computed by
`grouped_ffn`, as HybridMoE's GPU experts: gate, up and down one launch each of kernels/grouped.py over all the cold
pairs, no loop over experts. On CUDA the runtime page-locks the rows these copies read at load (`lock_views`,
runtime/cuda.LockedHost): from the file's pageable mapping the driver stages them at a fraction of PCIe's rate
(bench/h2d_rates.py). Otherwise (K-quants, floats, down_t) each cold expert's rows are de-quantized by
kernels/dequant.py and multiplied in turn.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from hotneurons.kernels.cold_experts import row_format
from hotneurons.kernels.names import BLOCK_KIND
from hotneurons.models.common import ffn_values
from hotneurons.weights.formats import WeightFormat, row_bytes, weight_format
from hotneurons.weights.qtensor import QTensor

OFFLOAD_TOKENS = 64  # prefill tokens from which a layer's cold experts run on the device
DEVICE_TYPES = ("cuda",)  # devices that take them (the tests add "cpu", where dequant_rows de-quantizes by torch)
FORMATS = ("q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k")  # block rows kernels/dequant.py de-quantizes on the device
GROUPED = tuple(BLOCK_KIND)  # cold rows the grouped product reads once packed (kernels/grouped.py's block formats)


def offloads(ffn: Any, T: int) -> bool:
    """Whether HybridMoE `ffn` computes the cold experts of a T-token call on its device."""
    if T < OFFLOAD_TOKENS or ffn.device.type not in DEVICE_TYPES or ffn.cold is None:
        return False
    fmts = (row_format(ffn.cold[1], ffn.d_model, ffn.cold_fmts[1]), row_format(ffn.cold[2], ffn.n_ff, ffn.cold_fmts[2])
            if ffn.down_t is None else row_format(ffn.down_t, ffn.d_model))
    return all(f in FORMATS for f in fmts)


def _formats(ffn: Any) -> tuple[WeightFormat, WeightFormat]:
    """The cold rows' formats: gate and up's, down's (down_t's where the layer has one)."""
    d, n = ffn.d_model, ffn.n_ff
    fgu = weight_format(row_format(ffn.cold[1], d, ffn.cold_fmts[1]))
    fdn = weight_format(row_format(ffn.cold[2], n, ffn.cold_fmts[2]) if ffn.down_t is None
                        else row_format(ffn.down_t, d))
    return fgu, fdn


def _sorted_pairs(ids: np.ndarray, cold: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The cold pairs (positions t * k + slot) grouped per expert, their experts, and where the expert changes."""
    pairs = np.flatnonzero(cold)  # (P,)
    pairs = pairs[np.argsort(ids.ravel()[pairs], kind="stable")]
    experts = ids.ravel()[pairs]
    return pairs, experts, np.flatnonzero(np.diff(experts)) + 1


def fetch(ffn: Any, ids: np.ndarray, cold: np.ndarray, dev: torch.device) -> dict | None:
    """Queue the copies of the routed cold experts' rows (ids (T, k), cold (T, k) bool) into one device buffer a
    projection, for the grouped path; None where it does not apply (down_t, formats the grouped kernel does not read:
    cold_on_device copies those expert by expert). On CUDA the copies run on a side stream, so that the rows cross
    PCIe while the device computes the GPU experts (HybridMoE.forward fetches before launching those), at the
    page-locked rate where lock_views' rows are locked."""
    fgu, fdn = _formats(ffn)
    if ffn.down_t is not None or fgu not in GROUPED or fdn not in GROUPED:
        return None
    pairs, experts, bounds = _sorted_pairs(ids, cold)
    starts = np.array([0, *bounds, len(pairs)], np.int64)  # (G + 1,)
    c = ffn.cold_map[experts[starts[:-1]]]  # (G,) the routed cold experts' places in the cold rows, ascending
    n, d = ffn.n_ff, ffn.d_model
    shapes = [(n, d, fgu), (n, d, fgu), (d, n, fdn)]  # rows an expert, columns, format: gate, up, down
    bufs = [torch.empty((len(c) * per, row_bytes(f, cols)), dtype=torch.uint8, device=dev) for per, cols, f in shapes]
    runs = _runs(c)  # one copy a run of consecutive experts
    side = None
    if dev.type == "cuda":
        from hotneurons.runtime.cuda import side_stream

        side = side_stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))  # the buffers' memory is the main stream's
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for rows, buf, (per, _, _) in zip(ffn.cold, bufs, shapes):
            for a, b in runs:
                buf[a * per:b * per].copy_(_host(rows[c[a] * per:(c[b - 1] + 1) * per]), non_blocking=True)
    done = None
    if side is not None:
        done = torch.cuda.Event()
        done.record(side)
    return {"pairs": pairs, "starts": starts, "bufs": bufs, "shapes": shapes, "done": done}


def cold_on_device(ffn: Any, x: torch.Tensor, ids: np.ndarray, w: torch.Tensor, cold: np.ndarray,
                   fetched: dict | None = None) -> torch.Tensor:
    """x (T, d) on the device, ids (T, k) the routed experts, w (T, k) their weights on the device, cold (T, k) bool
    the pairs whose expert is cold -> (T, d) in x's dtype: those pairs' weighted sum, each cold expert's rows copied
    and de-quantized once for all of its tokens. `fetched`: `fetch`'s copies of the same call, queued earlier."""
    from hotneurons.kernels.dequant import dequant_rows  # Triton: imported where a prefill uses it
    from hotneurons.kernels.qlinear import pack

    T, k = ids.shape
    n, d, dev = ffn.n_ff, ffn.d_model, x.device
    fetched = fetched or fetch(ffn, ids, cold, dev)
    if fetched is not None:
        if fetched["done"] is not None:
            torch.cuda.current_stream(dev).wait_event(fetched["done"])
        stacks = [pack(QTensor(buf, f, (buf.shape[0], cols)), dev)
                  for buf, (_, cols, f) in zip(fetched["bufs"], fetched["shapes"])]
        starts = fetched["starts"]
        return grouped_ffn(ffn, x, stacks, np.arange(len(starts) - 1), starts, fetched["pairs"], w.reshape(-1),
                           torch.zeros_like(x))
    fgu, fdn = _formats(ffn)
    pairs, experts, bounds = _sorted_pairs(ids, cold)
    pd = torch.from_numpy(pairs).to(dev)  # (P,)
    wflat = w.reshape(-1)  # (T k,)
    y = torch.zeros_like(x)  # (T, d)
    for a, b in zip([0, *bounds], [*bounds, len(pairs)]):
        e = experts[a]

        def rows(m: np.ndarray, c: int, per: int, cols: int, fmt) -> torch.Tensor:
            return dequant_rows(_host(m[c * per:(c + 1) * per]).to(dev), fmt, cols, x.dtype)

        c = int(ffn.cold_map[e])  # the expert's place in the cold rows
        g, u = rows(ffn.cold[0], c, n, d, fgu), rows(ffn.cold[1], c, n, d, fgu)  # (n, d) each
        tok = pd[a:b] // k  # (m,) this expert's tokens
        xe = x.index_select(0, tok)  # (m, d)
        h = ffn_values(ffn.cfg, F.linear(xe, u), F.linear(xe, g))  # (m, n)
        if ffn.down_t is None:
            ye = F.linear(h, rows(ffn.cold[2], c, d, n, fdn))  # (m, d): down (d, n)
        else:
            ye = h @ rows(ffn.down_t, int(ffn.dt_of[e]), n, d, fdn)  # (m, d): down_t (n, d), neuron-major
        y.index_add_(0, tok, (ye * wflat[pd[a:b], None]).to(y.dtype))
    return y


def _runs(c: np.ndarray) -> list[tuple[int, int]]:
    """[a, b) of each run of consecutive values in the ascending places c: where fetch copies and lock_views locks
    one range each."""
    cuts = np.flatnonzero(np.diff(c) != 1) + 1
    return list(zip([0, *cuts], [*cuts, len(c)]))


def _host(a: np.ndarray) -> torch.Tensor:
    """`a` as a CPU tensor, no copy (the file's rows through a read-only mapping, moe_load.share_cold_rows, which
    torch warns of: they are only read)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def lock_views(ffn: Any) -> list[np.ndarray]:
    """The host rows a long prefill copies from (views): each run of consecutive cold experts of each projection's
    stored rows (the file's pages in place, or the compact re-quantized stack), and down_t. Locking them
    (runtime/cuda.LockedHost) lets those copies run at PCIe's page-locked rate."""
    if ffn.cold is None:
        return []
    E = ffn.cfg.n_experts
    c = np.sort(ffn.cold_map[ffn.cold_ids])  # places in the cold rows
    views = []
    for rows in ffn.cold[:2] + ((ffn.cold[2],) if ffn.down_t is None else ()):
        per = rows.shape[0] // (E if ffn.in_place else ffn.n_cold)  # rows an expert
        views += [rows[c[a] * per:(c[b - 1] + 1) * per] for a, b in _runs(c)]
    return views + ([ffn.down_t] if ffn.down_t is not None else [])


def grouped_ffn(ffn: Any, x: torch.Tensor, stacks: list, ids: np.ndarray, starts: np.ndarray, pairs: np.ndarray,
                wflat: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y (T, d) plus the weighted expert outputs of the pairs (P,) (positions t * k + slot, sorted by expert; group g
    is pairs [starts[g], starts[g + 1]) of the expert at ids[g] in the stacks), gate / up / down (E_s * out, in)
    stacks: one kernels/grouped.py launch a projection over all the pairs, the weighted rows added by one index_add."""
    from hotneurons.kernels.grouped import block_m_for, grouped_linear, tile_table

    g, u, dn = stacks
    tiles = tile_table(ids, starts, block_m_for(starts), x.device)  # the three launches' one work list
    pd = torch.from_numpy(pairs).to(x.device)  # (P,)
    tok = pd // ffn.cfg.n_experts_used  # (P,) each pair's token
    h = ffn_values(ffn.cfg, grouped_linear(x, u, ffn.n_ff, ids, starts, tok, tiles),
                   grouped_linear(x, g, ffn.n_ff, ids, starts, tok, tiles))  # (P, n)
    ye = grouped_linear(h, dn, ffn.d_model, ids, starts, tiles=tiles)  # (P, d)
    return y.index_add(0, tok, (ye * wflat[pd, None]).to(y.dtype))
