"""A mixture of experts read in place into our decoder (runtime/engine.py's path for MoE files): attention, norms,
embeddings and head as the dense engine loads them, and one `HybridMoE` per layer (runtime/moe_ffn.py) with the
experts that the placement puts on the device there and the others read by the CPU from the file's own rows.

The placement is a (layers, experts) bool mask (pi-solve's ExpertPlacement.gpu, or a plain array): True = the expert
lives on the compute device. A run's is read from RUN/placement/ (experts.parquet, checked to be this model's; its
KV-cache ctx from the solver's flags); one with neuron groups inside experts is refused (the runtime computes whole
experts). Without one, every expert goes to the device, as the dense path's fallback puts every neuron there; where
`--vram` is given and that does not fit, each layer keeps the same number of experts on the device (its first ones),
as many as the budget holds after everything else. The router is an exact predictor of which experts a token uses,
so `hybrid` and `dense` modes run alike and no predictors are read; `--oracle` does not apply (refused in one line).
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hotneurons.common.artifacts import ArtifactError


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
            "placement": rt.expert_placement}


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


def load_moe_runtime(run: Path | None, cfg: Any, source: Any, sid: Any, mcfg: Any, act: str,
                     placement: Any = None) -> Any:
    """The Runtime of a mixture of experts (source opened by models/open.open_model), `placement` its expert mask."""
    from hotneurons.kernels.cold import set_threads
    from hotneurons.kernels.ops import default_ops
    from hotneurons.models import build_model
    from hotneurons.models.open import model_info
    from hotneurons.runtime.engine import SourceModel
    from hotneurons.runtime.generate import CAPACITY, Runtime, device_and_dtype
    from hotneurons.runtime.memory import check_fits, check_vram, plan_moe_bytes, tensor_bytes
    from hotneurons.runtime.moe_ffn import HybridMoE
    from hotneurons.runtime.placement import plan_figures, solved_summary
    from hotneurons.runtime.source_steps import SourceSteps

    if cfg.mode == "hybrid" and cfg.oracle:
        raise ArtifactError("--oracle computes a dense FFN's true masks; a mixture of experts' router is exact "
                            "already: drop --oracle")
    if cfg.mode == "layer-split":
        raise ArtifactError("layer-split runs dense FFNs through transformers; a mixture of experts runs hybrid: "
                            "use --mode hybrid")
    info = model_info(source, sid, act, "moe", True)
    info |= {"n_experts": mcfg.n_experts, "n_experts_used": mcfg.n_experts_used, "n_ff_exp": mcfg.n_ff_exp}
    device, dtype = device_and_dtype(cfg)
    L, E = mcfg.n_layers, mcfg.n_experts
    gpu, solved, where = expert_mask(placement, L, E), None, "given"
    if gpu is None and run is not None and (run / "placement" / "meta.json").exists():
        gpu, solved, where = run_placement(run, info, L, E), solved_summary(run), str(run / "placement")
    # the KV cache the solver reserved room for, as the dense path sizes it
    ctx = cfg.ctx or min(solved.flags.ctx if solved is not None else CAPACITY, mcfg.max_positions)
    if gpu is None:
        gpu, where = default_mask(source, L, E, dtype, ctx, info, cfg.vram), "default"
        if run is not None:
            warnings.warn(f"{run / 'placement'} holds no expert placement: every expert that fits goes to the "
                          f"device (run `pi-solve --run {run}` to place them)", stacklevel=3)
    check_fits(plan_moe_bytes(source, gpu, dtype, ctx, info), device, cfg.vram, ctx)
    threads = set_threads(cfg.threads)

    def weights(name: str):
        return source.get(name) if name in source.infos else None

    def release(name: str) -> int:
        return source.release(name) if name in source.infos else 0

    decoder = build_model(mcfg, weights, torch.device(device), dtype, ctx, release=release)
    ffns = [HybridMoE(i, mcfg, weights, gpu[i], device, dtype, release, source.release_view) for i in range(L)]
    stored = source.infos["blk.0.ffn_up_exps.weight"].fmt.value
    # ctx as the decoder's cache holds
    cfg = replace(cfg, cold_dtype=stored if all(f.in_place for f in ffns) else "q8_0", gpu_dtype=stored, ctx=ctx)
    tok = source.tokenizer()
    eos = getattr(tok, "eos_token_id", None)
    lm = SourceModel(decoder, tok, act, sid, info, source.config, set() if eos is None else {int(eos)})
    host_embedding = 0 if mcfg.tied_embeddings else tensor_bytes(decoder.tok_embd)
    bytes_cpu = sum(f.cold_bytes() for f in ffns) + host_embedding
    bytes_gpu = (tensor_bytes(decoder, device=device) - (host_embedding if device == "cpu" else 0)
                 + sum(f.device_bytes() for f in ffns))
    check_vram(bytes_gpu, device, cfg.vram, ctx)
    # decode steps as the dense path's (runtime/source_steps.py: CUDA graphs, the CPU's experts between them; eager
    # pieces on a CPU); prefill runs through engine.forward, HybridMoE.forward batching tokens per expert
    ops = default_ops(torch.device(device)) if cfg.ops == "auto" else cfg.ops
    fast = (SourceSteps(decoder, ffns, torch.device(device), dtype, cfg.cuda_graphs, ops, cfg.prelaunch)
            if cfg.static_decode else None)
    rt = Runtime(lm, cfg, torch.device(device), dtype, ffns, [], bytes_gpu, bytes_cpu, L, threads, fast)
    plan_figures(rt, solved)
    rt.plan_expert_share = None if solved is None or solved.experts is None else solved.experts.gpu_share_routed
    rt.expert_placement = where
    return rt
