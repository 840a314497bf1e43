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
one buffer a projection (a copy for each run of consecutive stored experts), packed on the device as the GPU experts
are (kernels/qlinear.pack), and the pairs computed by `grouped_ffn`, as HybridMoE's GPU experts: gate, up and down one
launch each of kernels/grouped.py over all the cold pairs, no loop over experts. Otherwise (K-quants, floats, down_t)
each cold expert's rows are de-quantized by kernels/dequant.py and multiplied in turn.
"""

from __future__ import annotations

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


def cold_on_device(ffn: Any, x: torch.Tensor, ids: np.ndarray, w: torch.Tensor, cold: np.ndarray) -> torch.Tensor:
    """x (T, d) on the device, ids (T, k) the routed experts, w (T, k) their weights on the device, cold (T, k) bool
    the pairs whose expert is cold -> (T, d) in x's dtype: those pairs' weighted sum, each cold expert's rows copied
    and de-quantized once for all of its tokens."""
    from hotneurons.kernels.dequant import dequant_rows  # Triton: imported where a prefill uses it

    T, k = ids.shape
    n, d, dev = ffn.n_ff, ffn.d_model, x.device
    fgu = weight_format(row_format(ffn.cold[1], d, ffn.cold_fmts[1]))
    fdn = weight_format(row_format(ffn.cold[2], n, ffn.cold_fmts[2]) if ffn.down_t is None
                        else row_format(ffn.down_t, d))
    pairs = np.flatnonzero(cold)  # (P,) positions t * k + slot
    pairs = pairs[np.argsort(ids.ravel()[pairs], kind="stable")]  # grouped per expert
    experts = ids.ravel()[pairs]
    bounds = np.flatnonzero(np.diff(experts)) + 1
    if ffn.down_t is None and fgu in GROUPED and fdn in GROUPED:
        starts = np.array([0, *bounds, len(pairs)], np.int64)  # (G + 1,)
        c = ffn.cold_map[experts[starts[:-1]]]  # (G,) the routed cold experts' places in the cold rows, ascending
        stacks = [_packed(ffn.cold[i], c, per, cols, f, dev)
                  for i, (per, cols, f) in enumerate(((n, d, fgu), (n, d, fgu), (d, n, fdn)))]
        return grouped_ffn(ffn, x, stacks, np.arange(len(c)), starts, pairs, w.reshape(-1), torch.zeros_like(x))
    pd = torch.from_numpy(pairs).to(dev)  # (P,)
    wflat = w.reshape(-1)  # (T k,)
    y = torch.zeros_like(x)  # (T, d)
    for a, b in zip([0, *bounds], [*bounds, len(pairs)]):
        e = experts[a]

        def rows(m: np.ndarray, c: int, per: int, cols: int, fmt) -> torch.Tensor:
            return dequant_rows(torch.from_numpy(m[c * per:(c + 1) * per]).to(dev), fmt, cols, x.dtype)

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


def _packed(rows: np.ndarray, c: np.ndarray, per: int, cols: int, fmt: WeightFormat, dev: torch.device):
    """The GpuQ (on dev) of the experts c (ascending) of stored rows (E_c * per, row bytes): a copy for each run of
    consecutive experts into one buffer, then packed on the device (kernels/qlinear.pack)."""
    from hotneurons.kernels.qlinear import pack

    buf = torch.empty((len(c) * per, row_bytes(fmt, cols)), dtype=torch.uint8, device=dev)  # (G per, row bytes)
    cuts = np.flatnonzero(np.diff(c) != 1) + 1  # where a run of consecutive experts ends
    for a, b in zip([0, *cuts], [*cuts, len(c)]):
        buf[a * per:b * per].copy_(torch.from_numpy(rows[c[a] * per:(c[b - 1] + 1) * per]))
    return pack(QTensor(buf, fmt, (len(c) * per, cols)), dev)


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
