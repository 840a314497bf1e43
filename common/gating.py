"""Training-free activation sparsity for gated FFNs (SwiGLU, GeGLU): which neurons a token skips, by which criterion.

A gated neuron's value is h_j = act(g_j) * u_j with g = gate . x, u = up . x. No value is exactly zero, so a neuron is
skipped when a score falls at or below a per-layer threshold calibrated on the profile to a target sparsity:

  h       |h_j| > tau_h                         the oracle's rule (pi-profile's `abs>tau`): gate and up rows always
                                                read, down rows only for passing neurons
  gate    |act(g_j)| > tau_g                    CATS: the gate is its own exact predictor; up and down rows only for the
                                                neurons that pass
  gate-h  |act(g_j)| > tau_g and |h_j| > tau_h  both: a looser gate filter decides which up rows are read, then |h|
                                                which down rows (tau_g = 0: `h`; tau_h = 0: `gate`)
  input   |x_i| > tau_x                         TEAL on the FFN input: whole columns of gate and up skipped
  wina    |x_i| * ||W_gate[:, i]|| > tau_x      WINA: the input weighted by the column's norm

The first three are per-neuron criteria (NEURON_CRITERIA): the runtime applies them as two thresholds per layer,
(tau_g, tau_h), in every kernel (kernels/gated.py, the cold kernel's gate-first pass). The input criteria mask
channels of x, not neurons.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hotneurons.common.kinds import Kind, choose


class Criterion(Kind):
    """What a gated neuron's pass test reads (module docstring)."""

    H = "h"
    GATE = "gate"
    GATE_H = "gate-h"
    INPUT = "input"
    WINA = "wina"

    @property
    def per_neuron(self) -> bool:
        return self in NEURON_CRITERIA


NEURON_CRITERIA = frozenset({Criterion.H, Criterion.GATE, Criterion.GATE_H})
SPARSITIES = (0.25, 0.4, 0.5, 0.65)  # target FFN sparsities the profile tabulates thresholds for
# gate-h: the gate filter alone skips this share of the target sparsity; |h| skips the rest among the neurons it passed
GATE_H_GATE_SHARE = 0.6


def criterion(value: str) -> Criterion:
    return choose(value, Criterion, "sparsity criterion", param="criterion")


@dataclass(frozen=True)
class LayerTaus:
    """A layer's pass test for the per-neuron criteria, float32 values: a neuron passes iff |act(g)| > gate and
    |h| > h. 0 disables a test (|act(g)| > 0 passes every neuron whose gate is not exactly 0)."""

    gate: float = 0.0
    h: float = 0.0


def as_f32(v: float) -> float:
    """Thresholds are float32 values (as common/ffn.as_tau): one answer in fp16, fp32 and fp64."""
    return float(np.float32(v))


def bytes_read_share(crit: Criterion | str, pass_share: float, gate_pass_share: float | None = None) -> float:
    """The share of a gated FFN's row bytes (gate, up, down: a third each) a token reads under `crit` when
    `pass_share` of the neurons (or, for the input criteria, of the input channels) pass; `gate_pass_share`: gate-h's
    share passing the gate filter."""
    c = criterion(crit)
    p = float(pass_share)
    if c == Criterion.H:
        return (2 + p) / 3
    if c == Criterion.GATE:
        return (1 + 2 * p) / 3
    if c == Criterion.GATE_H:
        return (1 + (p if gate_pass_share is None else gate_pass_share) + p) / 3
    return (2 * p + 1) / 3  # input, wina: gate and up columns of the passing channels, down dense


def key(sparsity: float) -> str:
    """A sparsity as the profile's tables key it ("0.5")."""
    return f"{float(sparsity):g}"


def profile_taus(gated: dict | None, crit: Criterion | str | None = None, sparsity: float | None = None,
                 where: str = "the profile") -> tuple[Criterion, float, list[LayerTaus]]:
    """(criterion, sparsity, per-layer LayerTaus) from a profile's `gated` section (profile/meta.json, docs/
    artifacts.md), for `crit` (None: the one the profile counted) at `sparsity` (None: the profile's target). A
    missing section, an input criterion or an untabulated sparsity is refused in one line naming what exists."""
    from hotneurons.common.kinds import FixableError

    if not gated:
        raise FixableError(f"{where} has no thresholds for gated sparsity (a ReLU-family model, or a profile written "
                           f"before them): re-run pi-profile", params="sparsity")
    c = criterion(crit if crit is not None else gated["criterion"])
    if not c.per_neuron:
        raise FixableError(f"criterion {c.value!r} masks input channels; the runtime computes the per-neuron "
                           f"criteria {', '.join(sorted(x.value for x in NEURON_CRITERIA))}", params="criterion")
    s = float(gated["sparsity"] if sparsity is None else sparsity)
    table = gated["taus"].get(c.value, {})
    if key(s) not in table:
        have = ", ".join(sorted(table)) or "none"
        raise FixableError(f"{where} tabulates {c.value} thresholds at sparsities {have}, not {key(s)}: pick one of "
                           f"them, or re-run pi-profile with --sparsities including it", params="sparsity")
    t = table[key(s)]
    n = len(next(iter(t.values())))
    return c, s, [LayerTaus(gate=as_f32(t.get("gate", [0.0] * n)[i]), h=as_f32(t.get("h", [0.0] * n)[i]))
                  for i in range(n)]
