"""`Placement`: which FFN neurons of each layer live on the compute device (hot) and which in CPU RAM (cold)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Placement:
    """Per layer a (n_neurons,) bool array: True = the neuron's rows live on the compute device."""

    gpu: tuple[np.ndarray, ...]

    @classmethod
    def uniform(cls, n_layers: int, n_neurons: int, on_gpu: bool) -> Placement:
        return cls(tuple(np.full(n_neurons, on_gpu) for _ in range(n_layers)))

    @classmethod
    def from_run(cls, run_dir: str | Path, model_info: dict) -> Placement:
        """RUN/placement/placement.parquet (refuses a placement made for another model)."""
        from hotneurons.common.placement import read_placement

        masks = read_placement(Path(run_dir), model_info, model_info["n_layers"])  # {layer: (n_neurons,) bool}
        return cls(tuple(masks[i].numpy() for i in range(model_info["n_layers"])))

    def gpu_share(self) -> float:
        return float(np.mean([g.mean() for g in self.gpu]))


def solved_summary(run_dir: str | Path | None):
    """RUN/placement/summary.json as pi-solve wrote it (common.placement.PlacementSummary, its schema checked), or
    None where the run has none (a placement made by hand, or no run)."""
    from hotneurons.common.placement import PlacementSummary

    path = None if run_dir is None else Path(run_dir) / "placement" / "summary.json"
    return PlacementSummary.load(path) if path is not None and path.exists() else None


def plan_figures(rt, solved) -> None:
    """The runtime's record of what pi-solve planned (compared in generate's stats with what decode measures)."""
    rt.profile_gpu_share = None if solved is None else solved.gpu_activation_share
    rt.plan_bytes_gpu = None if solved is None else solved.bytes_per_device.get("gpu")
    rt.plan_dtype = None if solved is None else solved.flags.dtype
