"""What every stage needs to observe an FFN: the activation rule, forward hooks on the FFN, and the skew statistic.

The rule (profile/meta.json `rule`, `taus`) is decided once by the profiler and applied again, identically, by
the predictors' evaluation and the runtime: a ReLU-family neuron is active iff its value is nonzero; any other
iff |value| > tau_l, with tau_l rounded to float32 so that fp16, fp32 and fp64 give one answer.
"""

from __future__ import annotations

import numpy as np
import torch
from hotneurons.common.kinds import Rule
from hotneurons.common.models import LoadedModel


def activation_rule(activation: str) -> Rule:
    """ReLU-family: a neuron is active iff its value is nonzero (exact). Others: iff |h| > tau_l."""
    return Rule.for_activation(activation)


def as_tau(tau: float | None) -> float:
    """Thresholds are float32 values (rounded once): then |h| > tau has one answer in fp16, fp32 and fp64."""
    return 0.0 if tau is None else float(np.float32(tau))


def active_mask(h: torch.Tensor, tau: float | None) -> torch.Tensor:
    """(tokens, neurons) activation values -> bool mask of active neurons (half types compared in float32)."""
    if tau is None:
        return h != 0
    a = h.abs()
    return (a.float() if a.dtype in (torch.float16, torch.bfloat16) else a) > as_tau(tau)


def share_covering(counts: np.ndarray, share: float = 0.8) -> np.ndarray:
    """Per layer, the fraction of neurons (hottest first) that covers `share` of the layer's activations.

    (layers, neurons) counts -> (layers,); NaN for a layer that never fired.
    """
    c = -np.sort(-counts, axis=1).astype(np.float64)  # (layers, neurons), hottest first
    total = c.sum(1, keepdims=True)
    cum = np.cumsum(c, axis=1) / np.where(total > 0, total, 1)
    k = (cum < share - 1e-12).sum(1) + 1  # neurons needed
    return np.where(total[:, 0] > 0, k / counts.shape[1], np.nan)


class FFNHooks:
    """Context manager: per decoder layer, forward pre-hooks on the FFN's up projection (input x) and down
    projection (activation values h). Subclasses implement `on_ffn(layer, h, x)`; a tensor returned replaces
    h (masking), None leaves it. x is captured only while `wants_x()` says so (it costs memory).

    No model code is edited: the down projection's input is exactly the per-neuron values h, whatever the family.
    """

    def __init__(self, lm: LoadedModel):
        self.lm = lm
        self._x: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def wants_x(self) -> bool:
        return False

    def on_ffn(self, layer: int, h: torch.Tensor, x: torch.Tensor | None) -> torch.Tensor | None:
        raise NotImplementedError

    def __enter__(self):
        for i, layer in enumerate(self.lm.layers):
            ffn = self.lm.adapter.layer_ffn(layer)
            self._handles.append(ffn["up"].register_forward_pre_hook(self._up_hook(i)))
            self._handles.append(ffn["down"].register_forward_pre_hook(self._down_hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._x.clear()

    def _up_hook(self, i: int):
        def hook(_mod, args):
            if self.wants_x():
                self._x[i] = args[0]  # (..., d_model)
        return hook

    def _down_hook(self, i: int):
        def hook(_mod, args):
            out = self.on_ffn(i, args[0], self._x.pop(i, None))  # args[0]: (..., n_neurons)
            return None if out is None else (out,)
        return hook
