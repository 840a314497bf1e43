"""What the runtime reads of RUN/placement/ besides the masks: pi-solve's plan, to compare with what decode measures.

The masks themselves are `hotneurons.artifacts.placement.Placement` (the placement's schema).
"""

from __future__ import annotations

from pathlib import Path


def solved_summary(run_dir: str | Path | None):
    """RUN/placement/summary.json as pi-solve wrote it (artifacts.placement.PlacementSummary, its schema checked),
    or None where the run has none (a placement made by hand, or no run)."""
    from hotneurons.artifacts.placement import PlacementSummary

    path = None if run_dir is None else Path(run_dir) / "placement" / "summary.json"
    return PlacementSummary.load(path) if path is not None and path.exists() else None


def plan_figures(rt, solved) -> None:
    """The runtime's record of what pi-solve planned (compared in generate's stats with what decode measures)."""
    rt.profile_gpu_share = None if solved is None else solved.gpu_activation_share
    rt.plan_bytes_gpu = None if solved is None else solved.bytes_per_device.get("gpu")
    rt.plan_dtype = None if solved is None else solved.flags.dtype
