"""The gated sparsity criteria (common/gating.py) as masks on tensors: what pi-profile counts, pi-eval masks and the
answer-agreement check generates with.

Every test is strict (`>`): a score equal to its threshold does not pass, as common/ffn.active_mask. Half types are
compared in float32 and thresholds are float32 values (gating.as_f32), so fp16, fp32 and fp64 give one answer.
"""

from __future__ import annotations

import torch
from hotneurons.common.gating import Criterion, LayerTaus, as_f32, criterion, key, profile_taus
from hotneurons.common.kinds import FixableError


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def neuron_pass(crit: Criterion | str, a: torch.Tensor | None, h: torch.Tensor, t: LayerTaus) -> torch.Tensor:
    """(..., n) bool: the neurons passing a per-neuron criterion, from act(g) `a` and the values h = act(g) * u.
    `h` reads |h| > t.h; `gate` |a| > t.gate (h unread: CATS decides before up is computed); `gate-h` both."""
    c = criterion(crit)
    if c == Criterion.H:
        return _wide(h.abs()) > as_f32(t.h)
    if a is None:
        raise ValueError(f"criterion {c.value!r} needs act(gate x): the FFN is not gated")
    g = _wide(a.abs()) > as_f32(t.gate)
    return g if c == Criterion.GATE else g & (_wide(h.abs()) > as_f32(t.h))


def channel_scores(crit: Criterion | str, x: torch.Tensor, norms: torch.Tensor | None = None) -> torch.Tensor:
    """(..., d) the input criteria's per-channel score: |x_i| (`input`, TEAL) or |x_i| * ||W_gate[:, i]|| (`wina`)."""
    c = criterion(crit)
    s = _wide(x.abs())
    if c == Criterion.WINA:
        if norms is None:
            raise ValueError("criterion 'wina' needs the gate's column norms")
        return s * norms.to(s.dtype)
    if c != Criterion.INPUT:
        raise ValueError(f"criterion {c.value!r} masks neurons, not input channels")
    return s


def channel_pass(crit: Criterion | str, x: torch.Tensor, tau: float, norms: torch.Tensor | None = None) -> torch.Tensor:
    """(..., d) bool: the FFN input channels an input criterion keeps (the others are zeroed for gate and up)."""
    return channel_scores(crit, x, norms) > as_f32(tau)


def column_norms(gate_weight: torch.Tensor) -> torch.Tensor:
    """(n, d) gate weight (torch Linear orientation) -> (d,) ||W_gate[:, i]||_2, WINA's channel weights; half types
    widened to float32 first."""
    return torch.linalg.vector_norm(_wide(gate_weight.detach()), dim=0)


def criterion_taus(gated: dict | None, crit: Criterion | str, sparsity: float,
                   where: str = "the profile") -> list[LayerTaus] | list[float]:
    """A criterion's per-layer thresholds at `sparsity` from a profile's `gated` section: LayerTaus for the per-neuron
    criteria (gating.profile_taus), the channel thresholds tau_x for the input ones; refused in one line naming the
    sparsities tabulated."""
    c = criterion(crit)
    if c.per_neuron:
        return profile_taus(gated, c, sparsity, where)[2]
    if not gated:
        profile_taus(gated, Criterion.H, sparsity, where)  # the same refusal: no section
    table = gated["taus"].get(c.value, {})
    if key(sparsity) not in table:
        have = ", ".join(sorted(table)) or "none"
        raise FixableError(f"{where} tabulates {c.value} thresholds at sparsities {have}, not {key(sparsity)}: pick "
                           f"one of them, or re-run pi-profile with --sparsities including it", params="sparsity")
    return [as_f32(v) for v in table[key(sparsity)]["x"]]
