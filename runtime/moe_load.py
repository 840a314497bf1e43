"""A mixture of experts read in place into our decoder (runtime/engine.py's path for MoE files): attention, norms,
embeddings and head as the dense engine loads them, and one `HybridMoE` per layer (runtime/moe_ffn.py) with the
experts that the placement puts on the device there and the others read by the CPU from the file's own rows.

The placement is a (layers, experts) bool mask (pi-solve's ExpertPlacement.gpu, or a plain array): True = the expert
lives on the compute device. Without one, every expert goes to the device, as the dense path's fallback puts every
neuron there; where `--vram` is given and that does not fit, each layer keeps the same number of experts on the
device (its first ones), as many as the budget holds after everything else. The router is an exact predictor of
which experts a token uses, so `hybrid` and `dense` modes run alike; `--oracle` and a run's neuron predictors do not
apply (refused in one line).
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
    """The Runtime of a mixture of experts (source opened by engine.open_model), `placement` its expert mask."""
    from hotneurons.kernels.cold import set_threads
    from hotneurons.models import build_model
    from hotneurons.runtime.engine import SourceModel, model_info
    from hotneurons.runtime.generate import CAPACITY, Runtime, device_and_dtype
    from hotneurons.runtime.memory import check_fits, check_vram, plan_moe_bytes, tensor_bytes
    from hotneurons.runtime.moe_ffn import HybridMoE
    from hotneurons.runtime.placement import plan_figures

    if cfg.mode == "hybrid" and cfg.oracle:
        raise ArtifactError("--oracle computes a dense FFN's true masks; a mixture of experts' router is exact "
                            "already: drop --oracle")
    if cfg.mode == "layer-split":
        raise ArtifactError("layer-split runs dense FFNs through transformers; a mixture of experts runs hybrid: "
                            "use --mode hybrid")
    if run is not None and (run / "placement" / "placement.parquet").exists() and placement is None:
        warnings.warn(f"{run / 'placement'} holds a neuron placement; expert placements are not read from runs yet: "
                      f"every expert that fits goes to the device", stacklevel=3)
    info = model_info(source, sid, act, "moe", True)
    info |= {"n_experts": mcfg.n_experts, "n_experts_used": mcfg.n_experts_used, "n_ff_exp": mcfg.n_ff_exp}
    device, dtype = device_and_dtype(cfg)
    L, E = mcfg.n_layers, mcfg.n_experts
    ctx = cfg.ctx or min(CAPACITY, mcfg.max_positions)
    gpu = expert_mask(placement, L, E)
    if gpu is None:
        gpu = default_mask(source, L, E, dtype, ctx, info, cfg.vram)
    check_fits(plan_moe_bytes(source, gpu, dtype, ctx, info), device, cfg.vram, ctx)
    threads = set_threads(cfg.threads)

    def weights(name: str):
        return source.get(name) if name in source.infos else None

    def release(name: str) -> int:
        return source.release(name) if name in source.infos else 0

    decoder = build_model(mcfg, weights, torch.device(device), dtype, ctx, release=release)
    ffns = [HybridMoE(i, mcfg, weights, gpu[i], device, dtype, release) for i in range(L)]
    stored = source.infos["blk.0.ffn_up_exps.weight"].fmt.value
    cfg = replace(cfg, cold_dtype=stored if all(f.in_place for f in ffns) else "q8_0", gpu_dtype=stored,
                  static_decode=False)  # decode runs eagerly through engine.forward (a host wait inside a layer)
    tok = source.tokenizer()
    eos = getattr(tok, "eos_token_id", None)
    lm = SourceModel(decoder, tok, act, sid, info, source.config, set() if eos is None else {int(eos)})
    host_embedding = 0 if mcfg.tied_embeddings else tensor_bytes(decoder.tok_embd)
    bytes_cpu = sum(f.cold_bytes() for f in ffns) + host_embedding
    bytes_gpu = (tensor_bytes(decoder, device=device) - (host_embedding if device == "cpu" else 0)
                 + sum(f.device_bytes() for f in ffns))
    check_vram(bytes_gpu, device, cfg.vram, ctx)
    rt = Runtime(lm, cfg, torch.device(device), dtype, ffns, [], bytes_gpu, bytes_cpu, L, threads, None)
    plan_figures(rt, None)
    return rt
