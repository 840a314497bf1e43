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
