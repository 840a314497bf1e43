"""Numba kernels for the cold FFN neurons of one batch-1 token, and their torch twin for the hot ones.

Cold rows live in CPU RAM as bfloat16 bit patterns (uint16: Numba has no 16-bit float type): `gate` and `up`
rows (n_cold, d_model) and the down projection transposed, `down_t` (n_cold, d_model), so that every active
neuron reads three contiguous rows. Each element is widened to float32 inside the dot and axpy loops (a bf16
pattern is the top half of a float32) and all arithmetic is float32.

Work split: the active list is cut into one contiguous chunk per thread; each thread accumulates its neurons'
`h_j * down_t[j]` into its own partial row; the partial rows are summed at the end (no atomics, deterministic
for a fixed thread count). The GIL is released, so the GPU (or another Python thread) keeps working.

Two kernels, the activation passed as an integer code (ACT_CODE):
  ungated_ffn(x, idx, up, b_up, down_t, out, threads, act)   relu, gelu:  h = act(up_j . x + b_j)
  gated_ffn(x, idx, gate, up, down_t, out, threads, act)     reglu, drelu, swiglu, geglu: h = act(gate_j . x) * up_j . x
                                                             (drelu: relu(gate_j . x) * relu(up_j . x))
`threads` = chunks of work (Numba's thread count: numba.get_num_threads() would stop the kernels from caching).
`out` (d_model,) float32 is overwritten with sum_j h_j * down_t[j]. The down bias is added by the caller once.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

GATED = ("reglu", "drelu", "swiglu", "geglu")
UNGATED = ("relu", "gelu")
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


# ---------------------------------------------------------------------------------------------------------------
# Row helpers (inlined by LLVM)


@intrinsic
def _bf16(typingctx, bits):
    """uint16 bf16 pattern -> float32 (zero-extend, shift into the top half, reinterpret): a scalar bitcast, which
    Numba cannot write, so that the widening fuses into the dot and axpy loops and vectorises (no scratch row)."""
    def codegen(context, builder, signature, args):
        wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())

    return types.float32(types.uint16), codegen


@njit(nogil=True, cache=True, fastmath=True, inline="always")
def _dot(x, row):  # (d,) float32 . (d,) bf16 bits
    s = np.float32(0.0)
    for k in range(x.shape[0]):
        s += x[k] * _bf16(row[k])
    return s


@njit(nogil=True, cache=True, fastmath=True, inline="always")
def _axpy(h, row, acc):  # acc (d,) float32 += h * (d,) bf16 bits
    for k in range(acc.shape[0]):
        acc[k] += h * _bf16(row[k])


@njit(nogil=True, cache=True, fastmath=True)
def _reduce(part, out):
    out[:] = 0.0
    for t in range(part.shape[0]):
        for k in range(out.shape[0]):
            out[k] += part[t, k]


@njit(nogil=True, cache=True, fastmath=True)
def _n_chunks(k, threads):
    return max(1, min(threads, k))


@njit(nogil=True, cache=True, fastmath=True)
def _relu(v):
    return v if v > 0 else np.float32(0.0)


@njit(nogil=True, cache=True, fastmath=True)
def _silu(v):
    return v / (np.float32(1.0) + np.exp(-v))


@njit(nogil=True, cache=True, fastmath=True)
def _gelu_erf(v):  # exact GELU (Falcon's nn.GELU)
    return np.float32(0.5) * v * (np.float32(1.0) + np.float32(math.erf(v / math.sqrt(2.0))))


@njit(nogil=True, cache=True, fastmath=True)
def _gelu_tanh(v):  # tanh approximation (Gemma's gelu_pytorch_tanh)
    return np.float32(0.5) * v * (np.float32(1.0) + np.float32(math.tanh(_SQRT_2_OVER_PI * (v + 0.044715 * v * v * v))))


# ---------------------------------------------------------------------------------------------------------------
# Kernels: one for gated FFNs, one for ungated ones; the activation is a loop-invariant integer code, so the branch
# on it costs nothing next to the row reads.

ACT_CODE = {"relu": 0, "gelu": 1, "reglu": 2, "drelu": 3, "swiglu": 4, "geglu": 5}


@njit(nogil=True, cache=True, fastmath=True)
def _gated_value(act, g, u):
    if act == 2:  # reglu
        return _relu(g) * u
    if act == 3:  # drelu
        return _relu(g) * _relu(u)
    if act == 4:  # swiglu
        return _silu(g) * u
    return _gelu_tanh(g) * u  # geglu


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def gated_ffn(x, idx, gate, up, down_t, out, threads, act):
    d, k = x.shape[0], idx.shape[0]
    T = _n_chunks(k, threads)
    part = np.zeros((T, d), np.float32)  # (threads, d_model) partial sums
    for t in prange(T):
        for q in range(t * k // T, (t + 1) * k // T):
            j = idx[q]
            g = _dot(x, gate[j])
            if act <= 3 and g <= 0:  # ReLU gates: a zero gate skips the up and down rows
                continue
            h = _gated_value(act, g, _dot(x, up[j]))
            if h != 0:
                _axpy(h, down_t[j], part[t])
    _reduce(part, out)


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def ungated_ffn(x, idx, up, b_up, down_t, out, threads, act):
    d, k = x.shape[0], idx.shape[0]
    T = _n_chunks(k, threads)
    part = np.zeros((T, d), np.float32)
    for t in prange(T):
        for q in range(t * k // T, (t + 1) * k // T):
            j = idx[q]
            a = _dot(x, up[j]) + b_up[j]
            h = _relu(a) if act == 0 else _gelu_erf(a)
            if h != 0:
                _axpy(h, down_t[j], part[t])
    _reduce(part, out)


def ffn_rows(activation: str, x: np.ndarray, idx: np.ndarray, gate: np.ndarray | None, up: np.ndarray,
             b_up: np.ndarray | None, down_t: np.ndarray, out: np.ndarray) -> np.ndarray:
    """CPU backend: out (d,) float32 = sum over neurons j in idx of h_j(x) * down_t[j] (rows bf16 as uint16)."""
    if activation in GATED:
        gated_ffn(x, idx, gate, up, down_t, out, numba.get_num_threads(), ACT_CODE[activation])
    else:
        ungated_ffn(x, idx, up, b_up, down_t, out, numba.get_num_threads(), ACT_CODE[activation])
    return out


# ---------------------------------------------------------------------------------------------------------------
# The same computation in torch (hot neurons on the compute device; dense prefill; oracle masks)


def act_torch(activation: str, a: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
    """Neuron values h from pre-activations: ungated a = up.x + b; gated a = gate.x, u = up.x."""
    f = torch.nn.functional
    if activation == "relu":
        return torch.relu(a)
    if activation == "gelu":
        return f.gelu(a)
    if activation == "reglu":
        return torch.relu(a) * u
    if activation == "drelu":
        return torch.relu(a) * torch.relu(u)
    if activation == "swiglu":
        return f.silu(a) * u
    if activation == "geglu":
        return f.gelu(a, approximate="tanh") * u
    raise ValueError(f"unknown activation '{activation}': choose one of {', '.join(ACT_CODE)}")


def neuron_values(activation: str, x: torch.Tensor, gate: torch.Tensor | None, up: torch.Tensor,
                  b_up: torch.Tensor | None) -> torch.Tensor:
    """(tokens, d) x and (n, d) rows -> (tokens, n) neuron values h."""
    f = torch.nn.functional
    if activation in GATED:
        return act_torch(activation, f.linear(x, gate), f.linear(x, up))
    return act_torch(activation, f.linear(x, up, b_up))


def ffn_rows_torch(activation: str, x: torch.Tensor, gate: torch.Tensor | None, up: torch.Tensor,
                   b_up: torch.Tensor | None, down_t: torch.Tensor) -> torch.Tensor:
    """Torch backend of `ffn_rows` over all given rows: (tokens, d) -> (tokens, d), in x's dtype and device."""
    return neuron_values(activation, x, gate, up, b_up) @ down_t  # (tokens, n) @ (n, d)


# ---------------------------------------------------------------------------------------------------------------
# bf16 storage


def to_bf16_bits(w: torch.Tensor) -> np.ndarray:
    """Any float tensor -> C-contiguous uint16 numpy array of its bfloat16 bit patterns (round to nearest even).

    The array is numpy's own: numpy asks the kernel for 2 MiB pages for large arrays (madvise), torch does not.
    Cold rows are read at random row offsets across many GB, where 4 KiB pages cost a page walk per 4 KiB read."""
    out = np.empty(tuple(w.shape), np.uint16)
    torch.from_numpy(out.view(np.int16)).view(torch.bfloat16).copy_(w.detach())  # converts and moves in one copy
    return out


def from_bf16_bits(bits: np.ndarray) -> torch.Tensor:
    """uint16 bf16 patterns -> float32 torch tensor (a copy)."""
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float()


def set_threads(n: int | None) -> int:
    """Numba CPU threads for the cold kernels (None: all of Numba's default); returns the number in use."""
    if n:
        numba.set_num_threads(max(1, min(int(n), numba.config.NUMBA_NUM_THREADS)))
    return numba.get_num_threads()
