"""The cold kernels' activations (kernels/cold.py) as float32 Numba scalar functions, and a neuron's value h from
its activation code (cold.ACT_CODE: 0 relu, 1 gelu, 2 reglu, 3 drelu, 4 swiglu, 5 geglu): ungated
h = act(up_j . x + b_j), gated h = act(gate_j . x) * up_j . x (drelu: relu of both).

Numba's cache is named by a hash of every kernel source (kernels/__init__.numba_cache_dir): an edit here reaches
the kernels that call this module at their next start.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


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


@njit(nogil=True, cache=True, fastmath=True)
def _gated_value(act, g, u):
    if act == 2:  # reglu
        return _relu(g) * u
    if act == 3:  # drelu
        return _relu(g) * _relu(u)
    if act == 4:  # swiglu
        return _silu(g) * u
    return _gelu_tanh(g) * u  # geglu


@njit(nogil=True, cache=True, fastmath=True)
def _ungated_value(a, act):
    return _relu(a) if act == 0 else _gelu_erf(a)


@njit(nogil=True, cache=True, fastmath=True)
def _gate_value(act, g):
    """The gated activations' gate factor act(g) (reglu, drelu: relu; swiglu: silu; geglu: gelu tanh)."""
    if act == 2 or act == 3:
        return _relu(g)
    if act == 4:
        return _silu(g)
    return _gelu_tanh(g)


@njit(nogil=True, cache=True, fastmath=True)
def _times_up(act, a, u):
    """h from the gate factor a = _gate_value(act, g) and u = up . x (drelu: relu of u too)."""
    return a * _relu(u) if act == 3 else a * u
