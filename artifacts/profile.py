"""The profile artifact (`RUN/profile/`), written by pi-profile (or solver/synthetic.py), read by every later stage.

`neurons.parquet`: layer, neuron, count (how many of `meta.tokens` tokens activated the neuron); `meta.json`:
`ProfileMeta`; `samples/layer_XXX.{x,mask,rms}.npy`: the predictors' training rows (`ProfileSamples` says what
each holds). A mixture of experts (`meta.experts` set) adds `experts.parquet` (layer, expert, count, weight_sum: how
often the router picked each expert) and an `expert` column to neurons.parquet (counts among the tokens routed to
that expert; -1: the shared expert), and has no samples. docs/artifacts.md lists every key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from hotneurons.common.artifacts import ArtifactError, Section, StageMeta, check_table, read_table
from hotneurons.common.gating import LayerTaus, as_f32
from hotneurons.common.kinds import Rule
from hotneurons.common.schema import optional

if TYPE_CHECKING:  # pandas loads in ~0.3 s: only where the table is read (the CLIs' --help stays quick)
    import pandas as pd


@dataclass(kw_only=True)
class ProfileSamples(Section):
    count: int  # rows per layer in samples/
    x: str = ""  # what samples/layer_XXX.x.npy holds
    mask: str = ""  # what samples/layer_XXX.mask.npy holds
    rms: str | None = optional()  # what samples/layer_XXX.rms.npy holds (models with a pre-FFN RMSNorm)


@dataclass(kw_only=True)
class ExpertsMeta(Section):
    """A mixture of experts' shape, as profiled (models/config.ModelConfig's fields of the same names)."""

    n_experts: int  # routed experts per layer
    n_experts_used: int  # top-k: experts each token runs
    n_ff_exp: int  # neurons per routed expert
    n_ff_shexp: int = 0  # neurons of the shared expert every token also runs (Qwen2-MoE; expert -1); 0: none
    norm_topk: bool = False  # the top-k routing weights renormalised to sum 1


@dataclass(kw_only=True)
class ProfileMeta(StageMeta):
    """profile/meta.json. A synthetic profile (solver/synthetic.py) fills only model, tokens and rule."""

    STAGE: ClassVar[str] = "profile"
    WRITER: ClassVar[str] = "pi-profile"

    stage: str = "profile"
    model: dict[str, Any]  # required here: every later stage sizes and checks against it
    config: dict[str, Any] | None = None  # profiler.profile.ProfileConfig fields, less the model's location
    dataset: str | None = None
    tokens: int  # tokens counted: count / tokens = activation probability
    tokens_requested: int | None = None
    corpus_exhausted: bool = False
    rule: Rule
    taus: list[float] | None = None  # per layer, rule abs>tau only
    target_sparsity: float | None = None
    sparsity_per_layer: list[float] | None = None
    mean_sparsity: float | None = None
    share_covering_80pct_per_layer: list[float] | None = None
    samples: ProfileSamples | None = None
    seconds: float | None = None
    tokens_per_second: float | None = None
    world_size: int = 1
    device: str | None = None
    experts: ExpertsMeta | None = optional()  # mixtures of experts only (experts.parquet, neurons' expert column)
    gate_taus: list[float] | None = optional()  # rule gate>tau,abs>tau only: per layer tau_g (taus holds tau_h)
    # gated models without exact zeros (SwiGLU, GeGLU): every sparsity criterion's thresholds, pass shares and skew at
    # every tabulated sparsity (profiler/gated.section; common/gating.profile_taus reads it); passes.safetensors beside
    gated: dict[str, Any] | None = optional()

    @property
    def layer_taus(self) -> list[float] | None:
        """Per-layer thresholds of the activation rule abs>tau; None for the others."""
        return self.taus if self.rule == Rule.ABS_TAU else None

    @property
    def neuron_taus(self) -> list[LayerTaus] | None:
        """Per layer the (tau_g, tau_h) pass test of a thresholded rule (abs>tau, gate>tau, gate>tau,abs>tau: a neuron
        is active iff |act(g)| > gate and |h| > h, 0 disabling a test); None for the nonzero rule."""
        if self.rule == Rule.NONZERO or self.taus is None:
            return None
        if self.rule == Rule.GATE_TAU:
            return [LayerTaus(gate=as_f32(t)) for t in self.taus]
        gate = self.gate_taus if self.rule == Rule.GATE_H_TAU else [0.0] * len(self.taus)
        return [LayerTaus(gate=as_f32(g), h=as_f32(t)) for g, t in zip(gate, self.taus)]

    @property
    def sample_count(self) -> int:
        return self.samples.count if self.samples is not None else 0


NEURONS = ("layer", "neuron", "count")
EXPERT_NEURONS = ("layer", "expert", "neuron", "count")  # a mixture of experts' neurons.parquet
EXPERTS = ("layer", "expert", "count", "weight_sum")


def _paths(run_dir: str | os.PathLike) -> tuple[Path, Path, ProfileMeta]:
    """(neurons.parquet, experts.parquet, meta) of RUN/profile, refusing a missing one in one line."""
    pdir = Path(run_dir) / "profile"
    meta_path, table = pdir / "meta.json", pdir / "neurons.parquet"
    if not meta_path.exists() or not table.exists():
        raise ArtifactError(f"no profile in {pdir}: run `pi-profile --out {run_dir}` first")
    meta = ProfileMeta.load(meta_path)
    experts = pdir / "experts.parquet"
    if meta.experts is not None and not experts.exists():
        raise ArtifactError(f"{pdir} profiles a mixture of experts but lacks experts.parquet: re-run "
                            f"pi-profile --out {run_dir}")
    return table, experts, meta


def read_profile(run_dir: str | os.PathLike) -> tuple[pd.DataFrame, ProfileMeta]:
    """Load `RUN/profile/neurons.parquet` (layer, neuron, count) and `RUN/profile/meta.json`. A mixture of experts'
    table comes with its `expert` column (several rows per (layer, neuron)): callers that assume one row each check
    `meta.experts`, or read it with read_expert_profile."""
    table, _, meta = _paths(run_dir)
    columns = NEURONS if meta.experts is None else EXPERT_NEURONS
    return read_table(table, columns, f"pi-profile --out {run_dir}"), meta


def read_expert_profile(run_dir: str | os.PathLike) -> tuple[pd.DataFrame, pd.DataFrame, ProfileMeta]:
    """A mixture of experts' profile: (experts.parquet (layer, expert, count, weight_sum), neurons.parquet (layer,
    expert, neuron, count), meta.json); a dense model's is refused in one line."""
    table, experts, meta = _paths(run_dir)
    if meta.experts is None:
        raise ArtifactError(f"{Path(run_dir) / 'profile'} profiles {meta.model.get('name')}, a dense model (no "
                            f"experts): read it with read_profile, or profile a mixture of experts")
    fix = f"pi-profile --out {run_dir}"
    return (read_table(experts, EXPERTS, fix), read_table(table, EXPERT_NEURONS, fix), meta)


def check_profile(run_dir: str | os.PathLike) -> ProfileMeta:
    """RUN/profile/meta.json, after checking that neurons.parquet (and a mixture of experts' experts.parquet) is a
    readable table (its footer only)."""
    table, experts, meta = _paths(run_dir)
    fix = f"pi-profile --out {run_dir}"
    check_table(table, NEURONS if meta.experts is None else EXPERT_NEURONS, fix)
    if meta.experts is not None:
        check_table(experts, EXPERTS, fix)
    return meta
