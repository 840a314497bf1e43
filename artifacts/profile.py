"""The profile artifact (`RUN/profile/`), written by pi-profile (or solver/synthetic.py), read by every later stage.

`neurons.parquet`: layer, neuron, count (how many of `meta.tokens` tokens activated the neuron); `meta.json`:
`ProfileMeta`; `samples/layer_XXX.{x,mask,rms}.npy`: the predictors' training rows (`ProfileSamples` says what
each holds). docs/artifacts.md lists every key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from hotneurons.common.artifacts import ArtifactError, Section, StageMeta, check_table, read_table
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

    @property
    def layer_taus(self) -> list[float] | None:
        """Per-layer thresholds of the activation rule; None for the nonzero rule."""
        return self.taus if self.rule == Rule.ABS_TAU else None

    @property
    def sample_count(self) -> int:
        return self.samples.count if self.samples is not None else 0


def read_profile(run_dir: str | os.PathLike) -> tuple[pd.DataFrame, ProfileMeta]:
    """Load `RUN/profile/neurons.parquet` (layer, neuron, count) and `RUN/profile/meta.json`."""
    pdir = Path(run_dir) / "profile"
    meta_path, table = pdir / "meta.json", pdir / "neurons.parquet"
    if not meta_path.exists() or not table.exists():
        raise ArtifactError(f"no profile in {pdir}: run `pi-profile --out {run_dir}` first")
    meta = ProfileMeta.load(meta_path)
    return read_table(table, ("layer", "neuron", "count"), f"pi-profile --out {run_dir}"), meta


def check_profile(run_dir: str | os.PathLike) -> ProfileMeta:
    """RUN/profile/meta.json, after checking that neurons.parquet is a readable table (its footer only)."""
    pdir = Path(run_dir) / "profile"
    meta_path, table = pdir / "meta.json", pdir / "neurons.parquet"
    if not meta_path.exists() or not table.exists():
        raise ArtifactError(f"no profile in {pdir}: run `pi-profile --out {run_dir}` first")
    meta = ProfileMeta.load(meta_path)
    check_table(table, ("layer", "neuron", "count"), f"pi-profile --out {run_dir}")
    return meta
