"""Gated-FFN activations that transformers' LLaMA-family modules do not have: dReLU and FATReLU.

pi-relufy writes them into config.json as `hidden_act` ("drelu", "fatrelu" with `fat_threshold`). Plain
transformers then refuses to build the model (no such activation in its table) instead of silently computing
another function; our loader builds it with `hidden_act="relu"` and then patches each FFN in place:
- dReLU (TurboSparse): relu(gate(x)) * relu(up(x)) — a forward hook on up_proj applies the second ReLU;
- FATReLU (ProSparse): gate(x) if gate(x) > t else 0, times up(x) — act_fn becomes `FATReLU(t)`.
Both leave exact zeros, so every stage treats them as ReLU-family. The weights and their names are unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

PATCHED = ("drelu", "fatrelu")  # hidden_act values that need patch_ffn after loading


class FATReLU(nn.Module):
    """x where x > threshold, else 0 (threshold 0: ReLU). The gradient is 1 where x passes, as ReLU's."""

    def __init__(self, threshold: float):
        super().__init__()
        self.threshold = float(threshold)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > self.threshold, x, torch.zeros((), dtype=x.dtype, device=x.device))

    def extra_repr(self) -> str:
        return f"threshold={self.threshold:g}"


def _relu_output(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
    return torch.relu(output)


def patch_ffn(mlps: list[nn.Module], kind: str, threshold: float = 0.0) -> None:
    """Make each LLaMA-style MLP (gate_proj, up_proj, down_proj, act_fn) compute `kind` (relu, drelu, fatrelu)."""
    for mlp in mlps:
        if kind == "relu":
            mlp.act_fn = nn.ReLU()
        elif kind == "drelu":
            mlp.act_fn = nn.ReLU()
            mlp.up_proj.register_forward_hook(_relu_output)
        elif kind == "fatrelu":
            mlp.act_fn = FATReLU(threshold)
        else:
            raise ValueError(f"unknown sparse activation '{kind}': choose relu, drelu or fatrelu")


def config_activation(config: Any) -> tuple[str | None, float]:
    """(kind, threshold) when config.json names an activation that needs patch_ffn, else (None, 0)."""
    act = str(getattr(config, "hidden_act", "") or "").lower()
    if act in PATCHED:
        return act, float(getattr(config, "fat_threshold", 0.0) or 0.0)
    return None, 0.0


def mark_config(config: Any, kind: str, threshold: float = 0.0) -> None:
    """Write the activation into a config about to be saved (relu stays transformers' own "relu")."""
    config.hidden_act = kind
    if kind == "fatrelu":
        config.fat_threshold = float(threshold)
