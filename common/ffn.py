"""What every stage needs to observe an FFN: the activation rule, forward hooks on the FFN, and the skew statistic.

The rule (profile/meta.json `rule`, `taus`) is decided once by the profiler and applied again, identically, by
the predictors' evaluation and the runtime: a ReLU-family neuron is active iff its value is nonzero; any other
iff |value| > tau_l, with tau_l rounded to float32 so that fp16, fp32 and fp64 give one answer.
"""

from __future__ import annotations

import numpy as np
import torch
from hotneurons.common.kinds import Rule


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
