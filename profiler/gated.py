"""pi-profile on gated models without exact zeros (SwiGLU, GeGLU): thresholds and pass counts of every sparsity
criterion of common/gating.py, at every tabulated sparsity.

The calibration pass (hooks.MagnitudeCollector with `gated`) samples |h| and |act(g)| at the same (token, neuron)
pairs and |x_i| (and the WINA score |x_i| * ||W_gate[:, i]||) at random (token, channel) pairs; `calibrate` turns them
into per-layer thresholds for each criterion and sparsity. The counting pass (hooks.ActivationCounter with a
GatedCounting) counts, per neuron (input criteria: per channel), the tokens passing each criterion at each sparsity,
and what `--criterion` makes the profile's own count (neurons.parquet, the samples' masks). Written as
`profile/passes.safetensors` and the `gated` section of meta.json (docs/artifacts.md). ReLU-family models and mixtures
of experts have neither: their zeros are exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from hotneurons.common import artifacts
from hotneurons.common.gate_masks import channel_scores, neuron_pass
from hotneurons.common.gating import GATE_H_GATE_SHARE, SPARSITIES, Criterion, LayerTaus, as_f32, criterion, key
from hotneurons.common.kinds import Activation, FixableError, Rule
from hotneurons.models.ffn_hooks import gate_column_norms
from hotneurons.profiler.hooks import count_active, quantile_tau

PASSES = "passes.safetensors"
TOP_SHARE = 0.2  # top20_share: the share of passes held by this share of neurons (channels), most passing first
PROFILE_CRITERIA = (Criterion.H, Criterion.GATE, Criterion.GATE_H)  # what neurons.parquet can count (--criterion)
RULES = {Criterion.H: Rule.ABS_TAU, Criterion.GATE: Rule.GATE_TAU, Criterion.GATE_H: Rule.GATE_H_TAU}


def is_gated(lm) -> bool:
    """A dense gated FFN whose values have no exact zeros (SwiGLU, GeGLU): where the criteria apply."""
    info = lm.info
    return bool(info.get("gated")) and info.get("family") != "moe" and \
        lm.activation in (Activation.SWIGLU, Activation.GEGLU)


def check_criterion(crit: str, lm) -> Criterion:
    """The profile's --criterion: h anywhere (today's rule); gate and gate-h on SwiGLU / GeGLU models only."""
    c = criterion(crit)
    if c not in PROFILE_CRITERIA:
        raise FixableError(f"pi-profile counts neurons; criterion {c.value!r} masks input channels (pi-eval measures "
                           f"it): choose one of {', '.join(x.value for x in PROFILE_CRITERIA)}", params="criterion")
    if c != Criterion.H and not is_gated(lm):
        raise FixableError(f"criterion {c.value!r} reads the gate of a SwiGLU or GeGLU FFN; {lm.info['name']} is "
                           f"{lm.activation}: leave the criterion at h", params="criterion")
    return c


def tabulated(target: float, sparsities=SPARSITIES) -> list[float]:
    """The sparsities a profile tabulates: `sparsities`, plus the target where it is not among them."""
    out = [float(s) for s in sparsities]
    return out if key(target) in {key(s) for s in out} else [*out, float(target)]


def _sorted(vals: list[torch.Tensor]) -> torch.Tensor:
    return torch.sort(torch.cat(vals)).values if vals else torch.zeros(0)


def gate_h_taus(ag: torch.Tensor, ah: torch.Tensor, sparsity: float, sg: torch.Tensor | None = None) -> LayerTaus:
    """gate-h at `sparsity` on a joint sample (|act(g)|, |h|): tau_g skips GATE_H_GATE_SHARE * sparsity of the pairs,
    then tau_h among the pairs passing the gate, so that (1 - sparsity) of all pairs pass both. sg: ag sorted, where
    the caller has it (one sort a layer serves every sparsity)."""
    tg = quantile_tau(torch.sort(ag).values if sg is None else sg, GATE_H_GATE_SHARE * sparsity)
    hp = ah[ag > tg]  # |h| of the gate-passing pairs
    keep = int(round((1 - sparsity) * len(ah)))
    # the (len - keep)-th smallest: a selection, not a sort (four sparsities a layer)
    th = 0.0 if keep >= len(hp) else as_f32(float(torch.kthvalue(hp, len(hp) - keep).values))
    return LayerTaus(gate=tg, h=th)


def calibrate(col, sparsities: list[float]) -> dict:
    """The `taus` table of the gated section from a gated MagnitudeCollector: {crit: {key(s): {"gate"|"h"|"x": per
    layer}}} for every criterion and sparsity."""
    table: dict = {c.value: {} for c in Criterion}
    for i in range(len(col.values)):
        ah, ag = torch.cat(col.values[i]), torch.cat(col.gate_values[i])  # same (token, neuron) pairs
        sh, sg, sx, sw = torch.sort(ah).values, torch.sort(ag).values, _sorted(col.x_values[i]), \
            _sorted(col.wina_values[i])
        for s in sparsities:
            k, gh = key(s), gate_h_taus(ag, ah, s, sg)
            for c, entry in ((Criterion.H, {"h": quantile_tau(sh, s)}), (Criterion.GATE, {"gate": quantile_tau(sg, s)}),
                             (Criterion.GATE_H, {"gate": gh.gate, "h": gh.h}),
                             (Criterion.INPUT, {"x": quantile_tau(sx, s)}),
                             (Criterion.WINA, {"x": quantile_tau(sw, s)})):
                row = table[c.value].setdefault(k, {name: [] for name in entry})
                for name, v in entry.items():
                    row[name].append(v)
    return table


def rule_taus(table: dict, crit: Criterion, target: float) -> tuple[Rule, list[float], list[float] | None]:
    """(rule, taus, gate_taus) of meta.json for the profile's criterion at its target: h -> abs>tau with tau_h; gate ->
    gate>tau with tau_g; gate-h -> gate>tau,abs>tau with tau_h as taus and tau_g as gate_taus."""
    t = table[crit.value][key(target)]
    if crit == Criterion.H:
        return Rule.ABS_TAU, t["h"], None
    if crit == Criterion.GATE:
        return Rule.GATE_TAU, t["gate"], None
    return Rule.GATE_H_TAU, t["h"], t["gate"]


def layer_taus(table: dict, crit: Criterion, s: float) -> list[LayerTaus]:
    t = table[crit.value][key(s)]
    n = len(next(iter(t.values())))
    return [LayerTaus(gate=as_f32(t.get("gate", [0.0] * n)[i]), h=as_f32(t.get("h", [0.0] * n)[i])) for i in range(n)]


@dataclass
class GatedCounting:
    """The counting pass's gated part: `crit`'s pass test at the target (what neurons.parquet counts) and the pass
    counts of every criterion at every sparsity of `table`, (layers, neurons) or (layers, d_model) int64 tensors on the
    device named "{crit}@{key(s)}" (passes.safetensors)."""

    crit: Criterion
    own: list[LayerTaus]  # per layer, the profile's criterion at its target
    table: dict
    norms: list[torch.Tensor]  # (d,) per layer, WINA's
    passes: dict[str, torch.Tensor]
    wants_x: bool = True  # the input criteria read x on every batch

    @classmethod
    def build(cls, lm, crit: Criterion, target: float, table: dict, device: torch.device) -> GatedCounting:
        L, n, d = lm.info["n_layers"], lm.info["n_neurons"], lm.info["d_model"]
        passes = {f"{c.value}@{k}": torch.zeros(L, n if c.per_neuron else d, dtype=torch.int64, device=device)
                  for c in Criterion for k in table[c.value]}
        return cls(crit, layer_taus(table, crit, target), table, [t.to(device) for t in gate_column_norms(lm)],
                   passes)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f"pass:{k}": t for k, t in self.passes.items()}  # prefixed: apart from the counter's own

    def active(self, i: int, a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """(tokens, n) bool: the profile's criterion at its target."""
        return neuron_pass(self.crit, a, h, self.own[i])

    def active_counts(self, i: int, a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        t = self.own[i]
        if self.crit == Criterion.H:
            return count_active(h, t.h)
        if self.crit == Criterion.GATE:
            return count_active(a, t.gate)
        return self.active(i, a, h).sum(0)

    def count(self, i: int, a: torch.Tensor, h: torch.Tensor, x: torch.Tensor | None) -> None:
        """One batch of layer i: a, h (tokens, n); x (tokens, d)."""
        for name, t in self.passes.items():
            c, k = name.split("@")
            entry = self.table[c][k]
            if c == Criterion.H:
                t[i] += count_active(h, entry["h"][i])  # one pass on the CPU (Numba), fused on CUDA
            elif c == Criterion.GATE:
                t[i] += count_active(a, entry["gate"][i])
            elif c == Criterion.GATE_H:
                t[i] += neuron_pass(c, a, h, LayerTaus(gate=entry["gate"][i], h=entry["h"][i])).sum(0)
            else:
                t[i] += count_active(channel_scores(c, x, self.norms[i]), entry["x"][i])


def top_share(counts: np.ndarray, share: float = TOP_SHARE) -> np.ndarray:
    """(layers, units) pass counts -> (layers,) the share of a layer's passes held by its `share` of units that pass
    most often (NaN for a layer with none)."""
    c = -np.sort(-counts.astype(np.float64), axis=1)
    top = c[:, :max(1, math.ceil(share * counts.shape[1]))].sum(1)
    total = c.sum(1)
    return np.where(total > 0, top / np.where(total > 0, total, 1), np.nan)


def section(table: dict, passes: dict[str, np.ndarray], tokens: int, crit: Criterion, target: float,
            sparsities: list[float], calibration_tokens: int) -> dict:
    """meta.json's `gated` section (docs/artifacts.md) from the thresholds and the pass counts (numpy, by name)."""
    share: dict = {c.value: {} for c in Criterion}
    top: dict = {c.value: {} for c in Criterion}
    for name, counts in passes.items():
        c, k = name.split("@")
        share[c][k] = np.round(counts.sum(1) / max(1, tokens * counts.shape[1]), 6).tolist()
        top[c][k] = np.round(top_share(counts), 6).tolist()
    return {"criterion": crit.value, "sparsity": float(target), "sparsities": list(sparsities), "taus": table,
            "pass_share": share, "top20_share": top, "calibration_tokens": int(calibration_tokens)}


def finalize(folder: Path, tables: dict[str, np.ndarray], tokens: int, table: dict,
             cfg) -> tuple[Rule, list[float] | None, dict]:
    """Writes passes.safetensors from the counter's tensors (numpy, "pass:"-prefixed); returns meta.json's (rule,
    gate_taus, gated section) for `cfg` (profile.ProfileConfig)."""
    crit = criterion(cfg.criterion)
    passes = {k.removeprefix("pass:"): v for k, v in tables.items() if k.startswith("pass:")}
    write_passes(folder, passes, tokens)
    rule, _, gate_taus = rule_taus(table, crit, cfg.target_sparsity)
    return rule, gate_taus, section(table, passes, tokens, crit, cfg.target_sparsity,
                                    tabulated(cfg.target_sparsity, cfg.sparsities), cfg.calibration_tokens)


def write_passes(folder: Path, passes: dict[str, np.ndarray], tokens: int) -> None:
    """profile/passes.safetensors, written to a temporary name and renamed: int32 (int64 past 2^31 - 1 tokens)."""
    from safetensors.numpy import save

    dtype = np.int32 if tokens < 2**31 else np.int64
    artifacts.atomic_write_bytes(folder / PASSES, save({k: np.ascontiguousarray(v.astype(dtype))
                                                        for k, v in passes.items()}))


def read_passes(run_dir: str | Path) -> dict[str, np.ndarray]:
    """RUN/profile/passes.safetensors: "{crit}@{key(s)}" -> (layers, neurons | d_model) pass counts."""
    from safetensors.numpy import load_file

    path = Path(run_dir) / "profile" / PASSES
    if not path.exists():
        raise artifacts.ArtifactError(f"no {PASSES} in {path.parent} (a ReLU-family model, or a profile written "
                                      f"before it): re-run pi-profile --out {run_dir}")
    return load_file(str(path))


def skew_lines(gated: dict) -> list[str]:
    """The summary's lines: per criterion and sparsity, mean measured pass share and top-20% share of passes."""
    ks = gated["pass_share"][gated["criterion"]].keys()
    lines = [f"gated criteria (thresholds on {gated['calibration_tokens']:,} calibration tokens; profile counts "
             f"{gated['criterion']} at {key(gated['sparsity'])}): mean share passing / share of passes held by the "
             f"20% of neurons (input, wina: channels) passing most",
             f"{'criterion':9} " + " ".join(f"{'s=' + k:>15}" for k in ks)]
    for c, rows in gated["pass_share"].items():
        cells = [f"{np.mean(rows[k]):.3f} / {np.nanmean(gated['top20_share'][c][k]):.3f}" for k in ks]
        lines.append(f"{c:9} " + " ".join(f"{x:>15}" for x in cells))
    return lines
