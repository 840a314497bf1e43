"""Whether a run decodes with mask 'gate' (gated models, no predictor: common/gating.py), and its thresholds.

A hybrid run of a gated model (SwiGLU, GeGLU) uses the gate mask when `--sparsity S` asks for it: the gate of each
neuron is its own exact predictor, so profile -> solve -> generate needs no training. Without the flag a run with no
predictors whose profile tabulates gated thresholds decodes dense (`default_sparsity`): on the 70B-class shape the
gate mask at the criterion that keeps SmolLM2's perplexity within 1.08x (`h` at 0.5) decoded slower than the dense
mask (docs/gated.md), so skipping neurons is the user's choice, not the default. `--sparsity 0` is the dense mask.
Both runtime builders (generate.build_runtime, engine.load_source_runtime) and check_run ask here, so they agree.
"""

from __future__ import annotations

from pathlib import Path

from hotneurons.common import artifacts
from hotneurons.common.artifacts import ArtifactError
from hotneurons.common.gating import profile_taus
from hotneurons.common.kinds import FixableError
from hotneurons.runtime.config import RuntimeConfig

GATE_FIRST = ("reglu", "drelu", "swiglu", "geglu")  # activations with a gate the kernels test first


def profile_gated(run: Path | None) -> dict | None:
    """The `gated` section of RUN/profile/meta.json (thresholds per criterion and sparsity), or None."""
    p = None if run is None else run / "profile" / "meta.json"
    if p is None or not p.exists():
        return None
    meta = artifacts.read_json(p)
    return meta.get("gated") if isinstance(meta, dict) else None


def uses_gate(cfg: RuntimeConfig) -> bool:
    """Mask 'gate' for this run: hybrid (not oracle) with --sparsity > 0."""
    return cfg.mode == "hybrid" and not cfg.oracle and bool(cfg.sparsity)


def default_sparsity(run: Path | None, cfg: RuntimeConfig) -> RuntimeConfig:
    """cfg with sparsity 0 (dense) where a hybrid run without --sparsity has no predictors and its profile tabulates
    gated thresholds (a gated model's run: the module docstring says why dense); else cfg as it is."""
    if (cfg.mode != "hybrid" or cfg.oracle or cfg.sparsity is not None or run is None
            or (run / "predictors" / "predictors.safetensors").exists() or profile_gated(run) is None):
        return cfg
    from dataclasses import replace

    return replace(cfg, sparsity=0.0)


def gate_taus(run: Path | None, cfg: RuntimeConfig, activation: str, n_layers: int) -> list[tuple[float, float]]:
    """Per layer (tau_g, tau_h) of the run's profile for cfg.criterion (None: the profile's) at cfg.sparsity (None:
    the profile's target); refused in one line where the model has no gate or the profile no such table."""
    if activation not in GATE_FIRST:
        raise ArtifactError(f"--sparsity: a {activation} FFN has no gate to test first (gated sparsity needs SwiGLU, "
                            f"GeGLU, ReGLU or dReLU); leave --sparsity out")
    if run is None:
        raise ArtifactError("--sparsity needs a run's profile for its thresholds: pass --run RUN (pi-profile, "
                            "pi-solve)")
    try:
        _, _, taus = profile_taus(profile_gated(run), cfg.criterion, cfg.sparsity, where=str(run / "profile"))
    except FixableError as e:
        raise ArtifactError(str(e)) from None
    if len(taus) != n_layers:
        raise ArtifactError(f"{run / 'profile'} has gated thresholds for {len(taus)} layers, the model {n_layers}: "
                            f"re-run pi-profile for this model")
    return [(t.gate, t.h) for t in taus]
