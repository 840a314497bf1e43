"""An interrupted profile's folder (RUN/.profile.partial): whether it can be resumed, the checks before a run
replaces or continues it, and the checkpoint a rank writes (samples, then counts, then state, so that a state file
names only what is already on disk)."""

from __future__ import annotations

from pathlib import Path

from hotneurons.common import artifacts
from hotneurons.common.artifacts import ArtifactError, deferred_interrupt
from hotneurons.profiler.hooks import ActivationCounter, SampleReservoir
from safetensors.torch import save


def resumable(partial: Path) -> bool:
    """A partial folder that a resumed run can continue: the shared state and at least one rank's checkpoint."""
    return (partial / "state.json").exists() and any(partial.glob("state.rank*.json"))


def check_partial(partial: Path, resume: bool, force: bool) -> None:
    """Before the model loads: a resumable interrupted run is neither overwritten nor ignored without being told;
    a partial folder without a checkpoint (stopped before its first) is debris that a fresh run removes."""
    if resumable(partial) and not resume and not force:
        raise ArtifactError(f"an interrupted profile is in {partial}: resume it, or force a fresh start",
                            params=("resume", "force"))
    if resume and not resumable(partial):
        raise ArtifactError(f"no interrupted profile to resume in {partial} (no checkpoint was written): start a new "
                            f"one without resume", params="resume")


def check_existing(final: Path, info: dict, force: bool) -> None:
    """After the model loads: a finished profile of another model is not replaced unless forced."""
    if (final / "meta.json").exists() and not force:
        try:
            old = artifacts.read_json(final / "meta.json")  # any version: only its model matters here
        except (OSError, ValueError):
            old = {}
        if old.get("model", {}).get("fingerprint") != info["fingerprint"]:
            raise ArtifactError(f"{final} holds a profile of '{old.get('model', {}).get('name')}', not of "
                                f"'{info['name']}': force a replacement, or write to another run directory",
                                params=("force", "out"))


def check_resume_key(saved: dict, now: dict, partial: Path) -> None:
    diff = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    if diff:
        k = diff[0]
        raise ArtifactError(f"cannot resume: the run in {partial} used {k}={saved.get(k)!r}, now {now.get(k)!r}: "
                            f"use the same settings, or force a fresh start", params=(k, "force"))


def checkpoint(ckpt: Path, rank_state: Path, counter: ActivationCounter, reservoir: SampleReservoir | None,
                state: dict) -> None:
    """Samples first, then counts, then state: a state file names only what is already on disk."""
    with deferred_interrupt():  # Ctrl-C waits: counts newer than the state file would be counted twice on resume
        if reservoir is not None:
            reservoir.flush()
        artifacts.atomic_write_bytes(ckpt, save({k: t.cpu().contiguous() for k, t in counter.tensors().items()}))
        artifacts.write_json(rank_state, state)
