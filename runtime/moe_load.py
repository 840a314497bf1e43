"""A mixture of experts' expert placement and figures: the rules that runtime/load.load_moe_runtime (the MoE files'
path into our decoder, one `HybridMoE` per layer from runtime/moe_ffn.py) reads its placement by, the run's checks,
generate's expert stats, and the cold experts' rows locked for a long prefill's copies.

The placement is a (layers, experts) bool mask (pi-solve's ExpertPlacement.gpu, or a plain array): True = the expert
lives on the compute device. A run's is read from RUN/placement/ (experts.parquet, checked to be this model's; its
KV-cache ctx from the solver's flags); one with neuron groups inside experts is refused (the runtime computes whole
experts). Without one, every expert goes to the device, as the dense path's fallback puts every neuron there; where
`--vram` is given and that does not fit, each layer keeps the same number of experts on the device (its first ones),
as many as the budget holds after everything else. The router is an exact predictor of which experts a token uses,
so `hybrid` and `dense` modes run alike and no predictors are read; `--oracle` does not apply (refused in one line).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hotneurons.common.artifacts import ArtifactError
from hotneurons.weights.source import shared_view


def expert_mask(placement: Any, L: int, E: int) -> np.ndarray | None:
    """(L, E) bool from a mask, an ExpertPlacement (its .gpu) or None; a one-line error on another shape."""
    if placement is None:
        return None
    gpu = np.asarray(getattr(placement, "gpu", placement))
    if gpu.dtype != bool or gpu.shape != (L, E):
        raise ArtifactError(f"the expert placement is {gpu.shape} {gpu.dtype}, the model has {L} layers of {E} "
                            f"experts: pass a ({L}, {E}) bool mask (True: the expert on the GPU)")
    return gpu


def is_moe_run(meta: dict | None) -> bool:
    """Whether a run's meta.json (profile's or placement's) describes a mixture of experts."""
    return meta is not None and (meta.get("experts") is not None or meta.get("model", {}).get("family") == "moe")


def check_moe_run(run: Path) -> None:
    """A mixture of experts' RUN/placement/, checked before the model loads: whole experts (a neuron-group placement
    is refused in one line), experts.parquet a readable table. No predictors: the router picks the experts."""
    from hotneurons.artifacts.placement import PlacementMeta
    from hotneurons.common import artifacts

    pdir = run / "placement"
    if not (pdir / "meta.json").exists():
        return  # no placement: every expert that fits goes to the device
    meta = PlacementMeta.load(pdir / "meta.json")
    if meta.experts is None:
        raise ArtifactError(f"{pdir} places a dense FFN's neurons, not experts: re-run `pi-solve --run {run}` on "
                            f"the mixture of experts' profile")
    if meta.experts.get("mode") == "neuron groups":
        raise ArtifactError(f"{pdir} places neuron groups inside experts; the runtime computes whole experts: re-run "
                            f"`pi-solve --run {run} --expert-neurons off`")
    artifacts.check_table(pdir / "experts.parquet", ("layer", "expert", "gpu"), f"pi-solve --run {run}")


def run_placement(run: Path, info: dict, L: int, E: int) -> np.ndarray:
    """RUN/placement/'s (L, E) mask of GPU experts (artifacts/experts.read_expert_placement: made for this model)."""
    from hotneurons.artifacts.experts import read_expert_placement

    check_moe_run(run)
    ep = read_expert_placement(run, info)
    if ep.neurons is not None:  # check_moe_run reads the mode; a table written by hand may still hold them
        raise ArtifactError(f"{run / 'placement'} places neuron groups inside experts; the runtime computes whole "
                            f"experts: re-run `pi-solve --run {run} --expert-neurons off`")
    return expert_mask(ep, L, E)


def expert_stats(rt: Any) -> dict[str, Any] | None:
    """generate's stats["experts"] (None for a dense model): decode's measured GPU share of routed expert work (the
    (token, expert) pairs whose expert is on the device, HybridMoE.read_counts pooled over layers: each layer routes k
    a token, so it is the mean of the layers' shares) beside the placement's expected share (pi-solve's summary,
    experts.gpu_share_routed), and where cold experts compute only their firing neurons (down_t layers) the share of
    their routed neurons that fired."""
    from hotneurons.runtime.moe_ffn import HybridMoE

    ffns = [f for f in rt.ffns if isinstance(f, HybridMoE)]
    if not ffns:
        return None
    routed, on_gpu = sum(f.read_counts()[1:3] / f.n_ff for f in ffns)  # decode's pairs: all, on GPU experts
    gpu = np.stack([f.gpu for f in ffns])  # (layers, experts)
    sparse = [f for f in ffns if f.down_t is not None]  # ReLU-family layers: only firing cold neurons computed
    cold_neurons = sum(f.read_counts()[3] for f in sparse)  # decode's routed cold pairs, in neurons
    return {"gpu_share_routed": float(on_gpu / routed) if routed else None,
            "cold_firing_share": float(sum(f.cold_active for f in sparse) / cold_neurons) if cold_neurons else None,
            "plan_gpu_share_routed": rt.plan_expert_share, "routed_pairs": int(round(routed)),
            "gpu_experts": int(gpu.sum()), "experts": int(gpu.size),
            "placement": rt.expert_placement, "expert_predictors": rt.expert_predictors}


def default_mask(source: Any, L: int, E: int, dtype: torch.dtype, ctx: int, info: dict,
                 vram: int | None) -> np.ndarray:
    """Every expert on the device; under a `vram` that this overflows, the same count per layer, as many as fit."""
    from hotneurons.runtime.memory import plan_moe_bytes

    gpu = np.ones((L, E), bool)
    if vram is None:
        return gpu
    full = plan_moe_bytes(source, gpu, dtype, ctx, info).gpu
    none = plan_moe_bytes(source, ~gpu, dtype, ctx, info).gpu
    per = (full - none) / E  # bytes of one expert in every layer
    keep = int(np.clip((vram - none) // per if per else E, 0, E))
    gpu[:, keep:] = False
    return gpu


def share_cold_rows(ffns: list) -> None:
    """Each layer's cold experts' rows in place (the file's) read through a read-only shared mapping of the file
    from now on (weights/source.shared_view), decode and prefill alike: pages CUDA can lock without copying them."""
    for f in ffns:
        if f.cold is not None and f.in_place:
            f.cold = tuple(shared_view(a) for a in f.cold)


def lock_cold_experts(ffns: list, device: torch.device) -> Any:
    """On CUDA, the cold experts' rows a long prefill copies, page-locked (runtime/cuda.LockedHost; the file's rows
    through share_cold_rows' mapping); None elsewhere, or with a warning where the driver refuses: those copies then
    run pageable, several times slower. HOTNEURONS_LOCK_EXPERTS=0 in the environment leaves them pageable: locked
    pages stay resident, which a host short of RAM for the cold experts may not want."""
    if device.type != "cuda" or os.environ.get("HOTNEURONS_LOCK_EXPERTS", "1") == "0":
        return None
    from hotneurons.runtime.cuda import LockedHost
    from hotneurons.runtime.moe_prefill import lock_views

    share_cold_rows(ffns)
    try:
        return LockedHost([v for f in ffns for v in lock_views(f)])
    except (OSError, RuntimeError) as e:
        warnings.warn(str(e), stacklevel=3)
        return None
