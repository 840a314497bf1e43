"""kernels/gated.gated_ffn's torch reference, dense: every neuron's values computed, those that do not pass zeroed,
with the kernels' roundings (tests and bench/gated_gemv.py check the kernels against it)."""

from __future__ import annotations

import torch
from hotneurons.kernels.gated import DownRows, Weight
from hotneurons.kernels.qlinear import GpuQ


def as_float(w: Weight) -> torch.Tensor:
    """A weight de-quantized (or widened) to a float32 (n, d) tensor, on its device."""
    if isinstance(w, DownRows):
        w = w.rows(slice(None))
    return w.dequantize(torch.float32) if isinstance(w, GpuQ) else w.float()


def gate_up_values(activation: str, x: torch.Tensor, gate: Weight,
                   up: Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, h), (tokens, n) each in x's dtype, for x (tokens, d): a = act(g), h = a * u (drelu: a * relu(u)), weights
    de-quantized to float32 (whole-matrix temporaries), g, a, u and h each rounded to x's dtype as the kernels round
    them."""
    from hotneurons.kernels.ops import gate_act

    dt = x.dtype
    a = gate_act(activation, (x.float() @ as_float(gate).T).to(dt).float()).to(dt)
    u = (x.float() @ as_float(up).T).to(dt).float()
    return a, (a.float() * (torch.relu(u) if activation == "drelu" else u)).to(dt)


def pass_masks(a: torch.Tensor, h: torch.Tensor, tau_g: float | torch.Tensor,
               tau_h: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pass 1, pass 2) bool masks of gate_up_values's a and h: |a| > tau_g, and that and |h| > tau_h (float32)."""
    p1 = a.float().abs() > float(tau_g)
    return p1, p1 & (h.float().abs() > float(tau_h))


def gated_ffn_torch(activation: str, x: torch.Tensor, gate: Weight, up: Weight, down_t: Weight,
                    tau_g: float | torch.Tensor, tau_h: float | torch.Tensor) -> torch.Tensor:
    """gated_ffn's reference, dense: every a and h computed (gate_up_values), those that do not pass zeroed, times
    down_t in float32, rounded once to x's dtype. x (tokens, d) -> (tokens, d)."""
    a, h = gate_up_values(activation, x, gate, up)
    _, p2 = pass_masks(a, h, tau_g, tau_h)
    return ((h.float() * p2) @ as_float(down_t)).to(x.dtype)
