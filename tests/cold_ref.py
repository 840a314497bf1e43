"""The cold kernels' float64 reference (tests/test_kernels.py, test_kernels_q.py, test_kernels_k.py), on the float64
weights each test's stored rows stand for."""

from math import erf

import numpy as np


def gelu_tanh(v: np.ndarray) -> np.ndarray:
    return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))


def cold_ffn64(act: str, x: np.ndarray, idx: np.ndarray, gate: np.ndarray | None, up: np.ndarray,
               b_up: np.ndarray | None, down_t: np.ndarray) -> np.ndarray:
    """sum over j in idx of h_j(x) * down_t[j], float64; gate, up, down_t (n, d) float64 (gate None: ungated, with
    b_up)."""
    x = x.astype(np.float64)
    u = up[idx] @ x
    g = gate[idx] @ x if gate is not None else None
    if g is None:
        u = u + b_up[idx].astype(np.float64)
    erf64 = np.vectorize(erf, otypes=[np.float64])
    h = {"relu": lambda: np.maximum(u, 0), "gelu": lambda: 0.5 * u * (1 + erf64(u / np.sqrt(2))),
         "reglu": lambda: np.maximum(g, 0) * u, "drelu": lambda: np.maximum(g, 0) * np.maximum(u, 0),
         "swiglu": lambda: g / (1 + np.exp(-g)) * u, "geglu": lambda: gelu_tanh(g) * u}[act]()
    return h @ down_t[idx]


def check_ffn_rows(act: str, x: np.ndarray, idx: np.ndarray, rows, ref: np.ndarray, close) -> None:
    """runtime/cold_rows.ffn_rows on `rows` three ways, each held to `ref` by `close(out, ref)`: the sum in `out`
    (over NaN, so it must be written), the sum left in the threads' part rows (out of shape (0,); rows of threads
    without neurons zeroed over stale values), and the device's reads in place (ffn_rows_mapped, with padding rows
    that add nothing)."""
    import torch
    from hotneurons.runtime import cold_rows as C

    d = len(x)
    out = np.full(d, np.nan, np.float32)
    C.ffn_rows(act, x, idx, rows, out, np.full((3, d), np.nan, np.float32))
    close(out, ref)
    part = np.full((5, d), np.nan, np.float32)
    C.ffn_rows(act, x, idx, rows, np.empty(0, np.float32), part)
    close(part.sum(0), ref)
    ids = torch.from_numpy(np.concatenate([idx, np.zeros(3, np.int64)]))
    valid = torch.arange(len(ids)) < len(idx)
    y = C.ffn_rows_mapped(act, torch.from_numpy(x)[None], ids, valid, C.map_rows(rows, torch.device("cpu")))[0]
    close(y.numpy(), ref)


def lay_out_ffns(layers, adapter, ffns, placement) -> None:
    """Each HF layer's FFN weights replaced by what the runtime's FFNs compute with: hot rows de-quantized from the
    device's blocks, cold ones widened from the CPU rows (down's columns of hot neurons, down_t rows of cold ones)."""
    import torch

    with torch.no_grad():
        for i, (layer, f) in enumerate(zip(layers, ffns)):
            mods = adapter.layer_ffn(layer)
            hot = torch.from_numpy(np.flatnonzero(placement.gpu[i]))
            cold = torch.from_numpy(np.flatnonzero(~placement.gpu[i]))
            rows = f.cold.float32()
            for name in ("gate", "up"):
                mods[name].weight[cold] = rows[name]
                mods[name].weight[hot] = f.hot_q[name].dequantize().cpu()
            down = mods["down"].weight  # (d, n)
            down[:, cold] = rows["down_t"].T
            down[:, hot] = f.hot_q["down"].dequantize().cpu()[:, :len(hot)]
