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
