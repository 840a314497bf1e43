"""The runtime's builders, and `load_runtime`, their one entry from a run directory (its files checked before the
model loads by load_checks.check_run): the model the run was made for, its placement, predictors and profile
thresholds, laid out by the model's kind: a transformers model by `build_runtime` (layer-split, --hf-decode, hub ids),
a dense model read in place into our decoder by `load_source_runtime`, a mixture of experts by `load_moe_runtime`. The
checks they share are runtime/load_checks.py's; the decode loop over what they build is runtime/generate.py's.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from hotneurons.artifacts.placement import Placement
from hotneurons.artifacts.predictors import PredictorForm
from hotneurons.common.artifacts import ArtifactError
from hotneurons.common.kinds import GpuOps, RuntimeMode, choose
from hotneurons.common.prenorm import ffn_norms
from hotneurons.kernels.cold import set_threads
from hotneurons.kernels.names import COLD_DTYPES
from hotneurons.models.family import LoadedModel, adapter_for, check_model, load_model, load_model_from_meta
from hotneurons.runtime.balance import pcie_share
from hotneurons.runtime.config import PRESETS, RuntimeConfig
from hotneurons.runtime.engine import (
    conversions,
    file_placement,
    file_predictors,
    formats_for,
    requantized,
)
from hotneurons.runtime.ffn_setup import FFNLayout
from hotneurons.runtime.gated import default_sparsity, gate_taus, uses_gate
from hotneurons.runtime.generate import Runtime
from hotneurons.runtime.hybrid_ffn import HybridFFN
from hotneurons.runtime.load_checks import (
    check_ctx,
    check_run,
    check_sparsity,
    device_and_dtype,
    first_meta,
    gpu_ops,
    host_embedding_bytes,
    mask_kind,
    need_oracle_taus,
    need_placement,
    profile_taus,
    resolved_mode,
    run_predictors,
    solved_placement,
    source_model,
    source_steps,
    static_ctx,
)
from hotneurons.runtime.moe_load import (
    default_mask,
    expert_mask,
    is_moe_run,
    lock_cold_experts,
    run_placement,
)
from hotneurons.runtime.offload import OnCPULayer, count_bytes, embedding_to_cpu, install
from hotneurons.runtime.placement import plan_figures
from hotneurons.runtime.static_decoder import CAPACITY, StaticDecoder, cache_bytes, supported


def reads_in_place(meta: dict | None, model: str | None, cfg: RuntimeConfig) -> bool:
    """Whether the model loads in place into our decoder (runtime/engine.py): a local folder of safetensors or a GGUF
    file, in hybrid or dense mode. Layer-split (the baseline), --hf-decode and hub ids go through transformers."""
    if model is None and is_moe_run(meta):  # experts run in our decoder only (moe_load refuses layer-split)
        return True
    if cfg.mode == "layer-split" or not cfg.static_decode:
        return False
    if model is None:
        kind = (meta or {}).get("model", {}).get("source", {}).get("kind")
        return kind in ("gguf", "folder")
    from hotneurons.common.model_source import resolve_source

    return resolve_source(model, None).kind in ("gguf", "folder")


def load_runtime(run_dir: str | Path | None, cfg: RuntimeConfig = PRESETS["hybrid"], *, model: str | None = None,
                 gguf_file: str | None = None, use_predictor: bool = True, trust_remote_code: bool = False,
                 recall: float | None = None) -> Runtime:
    """Load the model the run was made for (or `model`), its placement and predictors, and build the runtime.

    `use_predictor=False` turns hybrid into dense (no predictors needed). A mixture of experts reads its expert
    placement and no predictors (`load_moe_runtime`)."""
    check_sparsity(cfg)
    run = Path(run_dir) if run_dir is not None else None
    cfg = default_sparsity(run, cfg)
    if (mode := resolved_mode(cfg, use_predictor)) != cfg.mode:
        cfg = RuntimeConfig(**{**cfg.__dict__, "mode": mode})
    device, dtype = device_and_dtype(cfg)
    dname = str(dtype).removeprefix("torch.")
    meta = first_meta(run) if run is not None else None
    if meta is None and model is None:
        raise ArtifactError(f"no profile, placement or predictors in {run_dir}: run pi-profile first, or pass --model")
    if run is not None:
        check_run(run, cfg, recall, moe=is_moe_run(meta))
    if model is not None:
        check_model(model, gguf_file, trust_remote_code=trust_remote_code, experts=True)  # MoE: engine.py reads them
    if reads_in_place(meta, model, cfg):
        return load_source_runtime(run, meta, cfg, model=model, gguf_file=gguf_file, use_predictor=use_predictor,
                                   recall=recall)
    lm = (load_model_from_meta(meta["model"], model, gguf_file, device="cpu", dtype=dname,
                               trust_remote_code=trust_remote_code) if meta is not None
          else load_model(model, gguf_file, device="cpu", dtype=dname, trust_remote_code=trust_remote_code))
    predictors = None
    # pi-solve's placement and summary, where the placement came from pi-solve
    placement, solved = solved_placement(run, lm.info) if cfg.mode != "layer-split" else (None, None)
    if cfg.ctx is None and solved is not None:  # the KV cache the solver reserved room for
        cfg = replace(cfg, ctx=solved.flags.ctx)
    gate = uses_gate(cfg)
    if run is not None and cfg.mode == "hybrid" and not cfg.oracle and not gate:
        if not (run / "predictors" / "predictors.safetensors").exists():
            raise ArtifactError(f"no predictors in {run / 'predictors'}: run `pi-train-predictors --run {run}`, or "
                                f"pass --no-predictor (dense) or --oracle (true masks)")
        predictors = run_predictors(run, lm.info, dtype, recall)
    taus = profile_taus(run, lm.info)
    gtaus = gate_taus(run, cfg, lm.activation, len(lm.layers)) if gate else None
    rt = build_runtime(lm, cfg, placement, predictors, taus, gtaus)
    plan_figures(rt, solved)
    return rt


def layer_split_count(lm: LoadedModel, vram: int | None, gpu_layers: int | None, dtype: torch.dtype) -> int:
    """Decoder layers that fit on the device: (vram - everything outside the layers) // bytes per layer."""
    n_layers = len(lm.layers)
    if gpu_layers is not None:
        if not 0 <= gpu_layers <= n_layers:
            raise ValueError(f"--gpu-layers {gpu_layers} is out of range: the model has {n_layers} layers")
        return gpu_layers
    if vram is None:
        raise ValueError("layer-split needs a budget: pass --vram (e.g. 8GB) or --gpu-layers N")
    size = torch.tensor([], dtype=dtype).element_size()
    per_layer = [sum(p.numel() for p in layer.parameters()) * size for layer in lm.layers]
    params = lm.info["params"]  # as loaded, whether the embedding has left the module tree yet or not
    on_cpu = params["embedding"] if params["lm_head"] else 0  # an untied input embedding (offload.embedding_to_cpu)
    fixed = (params["total"] - on_cpu) * size - sum(per_layer)
    if vram < fixed:
        raise ValueError(f"--vram {vram:,} B is below the {fixed:,} B the LM head, norms (and a tied embedding) need "
                         f"on the device: raise --vram")
    k, used = 0, fixed
    while k < n_layers and used + per_layer[k] <= vram:
        used += per_layer[k]
        k += 1
    return k


def build_runtime(lm: LoadedModel, cfg: RuntimeConfig, placement: Placement | None = None,
                  predictors: Any = None, taus: list[float] | None = None,
                  gate_taus: list[tuple[float, float]] | None = None) -> Runtime:
    """Lay the (CPU-resident) model out for `cfg` and move its device part to the device. Modifies `lm` in place.

    `predictors`: hotneurons.predictors.train.Predictors (hybrid without oracle); `taus`: per-layer activation
    thresholds of non-ReLU models (oracle masks), None for ReLU-family models; `gate_taus`: per layer (tau_g, tau_h)
    of mask 'gate' (runtime/gated.py), which then replaces the predictors.
    """
    choose(cfg.mode, RuntimeMode, "mode")
    if cfg.cold_dtype == "auto":  # an HF model in memory holds floats: bf16 rows lose the least
        cfg = replace(cfg, cold_dtype="bf16")
    if cfg.cold_dtype not in COLD_DTYPES:
        raise ValueError(f"unknown cold-row dtype '{cfg.cold_dtype}': choose one of {', '.join(COLD_DTYPES)}")
    choose(cfg.ops, ("auto", *GpuOps.values()), "ops")
    if cfg.pcie_share is not None and not 0 <= cfg.pcie_share < 1:
        raise ValueError(f"--pcie-share {cfg.pcie_share} is out of range: give a share in [0, 1), 0 to turn it off, "
                         f"or leave it out to measure it")
    check_ctx(cfg)
    device, dtype = device_and_dtype(cfg)
    cfg = replace(cfg, gpu_dtype=str(dtype).removeprefix("torch."))  # an HF model's hot rows: in the compute dtype
    threads = set_threads(cfg.threads)
    info, n_layers = lm.info, len(lm.layers)
    mask = mask_kind(cfg.mode, cfg.oracle, gate_taus is not None)
    need_placement(cfg.mode, placement)
    if mask == "predictor" and predictors is None:
        raise ArtifactError("hybrid mode needs predictors: run `pi-train-predictors --run RUN`, or pass --oracle "
                            "(true masks) or --no-predictor (dense)")
    need_oracle_taus(mask, taus, lm.activation)
    if cfg.mode == "layer-split":
        k = layer_split_count(lm, cfg.vram, cfg.gpu_layers, dtype)
        placement = Placement.uniform(n_layers, info["n_neurons"], False)
    else:
        k = n_layers
        placement = placement or Placement.uniform(n_layers, info["n_neurons"], True)
    # the powerinfer form reads the residual before each layer's pre-FFN RMSNorm (refused for families without one)
    prenorm = mask == "predictor" and getattr(predictors, "form", None) == PredictorForm.POWERINFER
    norms = ffn_norms(lm) if prenorm else None
    lm.model.to("cpu", dtype)
    if cfg.predictor_dtype != "auto":  # its FFNs are built on the CPU and moved as modules, blocks are not buffers
        raise ValueError(f"--predictor-dtype {cfg.predictor_dtype} runs on our decoders (a model read in place, "
                         f"without --hf-decode): keep --predictor-dtype auto on the transformers path")
    layout = FFNLayout(mask, cfg.cold_dtype, graphs=cfg.cuda_graphs, prenorm=norms is not None)
    ffns: list[HybridFFN] = []
    cpu_layers: list[OnCPULayer] = []
    for i in range(n_layers):
        if i < k and cfg.mode == "layer-split":
            continue  # a whole dense layer on the device, untouched
        # a copy: Module.to moves in place, and another runtime's CUDA graphs may read the caller's predictor
        pred = copy.deepcopy(predictors.layers[i]).to("cpu", dtype) if mask == "predictor" else None
        ffn = HybridFFN(i, lm.activation, lm.adapter.layer_ffn(lm.layers[i]), placement.gpu[i], layout,
                        predictor=pred, tau=None if taus is None else taus[i],
                        gate_taus=gate_taus[i] if mask == "gate" else None)
        if norms is not None:
            ffn.watch_norm(norms[i].module)  # HF's layers; the static decoder passes the residual itself
        install(lm, i, ffn)
        ffns.append(ffn)
        if cfg.mode == "layer-split":
            layers = lm.layers
            cpu_layers.append(OnCPULayer(layers[i], device, dtype))
            layers[i] = cpu_layers[-1]
    embedding_to_cpu(lm, device)  # untied: one row a token is read, from CPU RAM (pi-solve counts it there)
    lm.model.to(device)
    bytes_gpu, bytes_cpu = count_bytes(lm, ffns, cpu_layers)
    static = cfg.static_decode and cfg.mode != "layer-split" and supported(lm, ffns) is None
    ctx = cfg.ctx or CAPACITY
    bytes_gpu += cache_bytes(lm, ctx, dtype) if static else 0  # the static KV cache, allocated below
    if cfg.vram is not None and bytes_gpu > cfg.vram:
        cache = f" (with a static KV cache of {ctx} tokens: a smaller --ctx needs less)" if static else ""
        raise ValueError(f"the layout needs {bytes_gpu:,} B on {device}{cache} but --vram is {cfg.vram:,} B: re-run "
                         f"pi-solve with this budget, or raise --vram")
    ops = gpu_ops(cfg, device)
    fast = (StaticDecoder(lm, ffns, torch.device(device), dtype, cfg.cuda_graphs, ctx, ops, cfg.prelaunch) if static
            else None)
    rt = Runtime(lm, cfg, torch.device(device), dtype, ffns, cpu_layers, bytes_gpu, bytes_cpu, k, threads, fast)
    rt.pcie_share = pcie_share(rt, mask)
    return rt


def load_source_runtime(run: Path | None, meta: dict | None, cfg: Any, *, model: str | None = None,
                        gguf_file: str | None = None, use_predictor: bool = True, recall: float | None = None,
                        placement: Any = None) -> Any:
    """The Runtime of the model a run was made for (or `model`), read in place into our decoder and hybrid FFNs.
    `placement` (artifacts.placement.Placement) replaces the run's (tests, benchmarks); for a mixture of experts, a
    (layers, experts) bool mask of the experts on the device, else the run's experts.parquet (`load_moe_runtime`)."""
    from hotneurons.models import build_model
    from hotneurons.models.ffn_weights import FFNWeights
    from hotneurons.models.open import model_info, open_model
    from hotneurons.runtime.memory import check_fits, check_vram, plan_bytes, tensor_bytes
    from tqdm.auto import tqdm

    check_ctx(cfg)
    if meta is not None and model is None:
        src = meta["model"]["source"]
        model, gguf_file = src["path"], gguf_file or src.get("gguf_file")
    activation = meta["model"]["activation"] if meta is not None and meta["model"]["activation"] == "drelu" else None
    source, sid, mcfg, act = open_model(model, gguf_file, activation)
    if mcfg.moe:
        return load_moe_runtime(run, cfg, source, sid, mcfg, act, placement)
    adapter = adapter_for(source.config)
    info = model_info(source, sid, act, adapter.name, adapter.gated)
    device, dtype = device_and_dtype(cfg)
    L, n = info["n_layers"], info["n_neurons"]
    predictors = None
    solved = None  # pi-solve's summary, where the placement came from pi-solve
    if placement is None:
        placement, solved = solved_placement(run, info)
    if cfg.predictor_dtype == "auto" and solved is not None:  # the storage the budget counted
        cfg = replace(cfg, predictor_dtype=solved.flags.predictor_dtype)
    mode = resolved_mode(cfg, use_predictor)
    gate = mode == "hybrid" and uses_gate(cfg)
    mask = mask_kind(mode, cfg.oracle, gate)
    gtaus = gate_taus(run, cfg, act, L) if gate else None

    pwri = run is None and getattr(source, "powerinfer", False)  # PowerInfer's own file: predictors and split in it
    if pwri and mask == "predictor":
        predictors = file_predictors(source, dtype)
        placement = placement or file_placement(source, L)
    elif mask == "predictor":
        if run is None:  # a model file alone (not PowerInfer's, which carries its own): no predictors to read
            raise ArtifactError("hybrid mode needs predictors: pass --run RUN (pi-profile, pi-solve, "
                                "pi-train-predictors), or use --mode dense (--no-predictor) or --oracle with a "
                                "placement")
        predictors = run_predictors(run, info, dtype, recall)
    taus = profile_taus(run, info)
    need_placement(mode, placement)
    need_oracle_taus(mask, taus, act)
    placement = placement or Placement.uniform(L, n, True)
    if len(placement.gpu) != L or any(len(g) != n for g in placement.gpu):
        raise ArtifactError(f"the placement is for {len(placement.gpu)} layers of {len(placement.gpu[0])} neurons, the "
                            f"model has {L} of {n}: run pi-solve for this model")
    cold_fmt, hot_fmt = formats_for(source, cfg.cold_dtype, cfg.gpu_dtype, dtype, device)
    cfg = replace(cfg, cold_dtype=cold_fmt, gpu_dtype=hot_fmt)  # as resolved
    requantized(source, cold_fmt, hot_fmt)
    notice = conversions(source, device, cold_fmt, hot_fmt, placement.gpu)
    if notice is not None:
        import warnings

        warnings.warn(notice, stacklevel=2)
    ctx = static_ctx(cfg, solved, mcfg.max_positions)
    need = plan_bytes(source, placement, cold_fmt, hot_fmt, dtype, ctx, info,
                      neuron_major=gate and torch.device(device).type == "cuda")
    check_fits(need, device, cfg.vram, ctx)
    prenorm = mask == "predictor" and predictors.form == PredictorForm.POWERINFER
    threads = set_threads(cfg.threads)
    decoder = build_model(mcfg, lambda name: source.get(name) if name in source.infos else None,
                          torch.device(device), dtype, ctx,
                          release=lambda name: source.release(name) if name in source.infos else 0)
    layout = FFNLayout(mask, cold_fmt, hot_fmt, device, dtype, cfg.cuda_graphs, prenorm, cfg.predictor_dtype)
    ffns = []
    for i in tqdm(range(L), desc="loading layers", unit="layer", leave=False, disable=L < 8):
        w = FFNWeights.from_source(source, i)
        # taken out of `predictors`: the FFN keeps its own (reordered) copy, so the file's is freed layer by layer
        pred = predictors.layers.pop(i).to("cpu", dtype) if mask == "predictor" else None
        ffns.append(HybridFFN(i, act, w, placement.gpu[i], layout, predictor=pred,
                              tau=None if taus is None else taus[i], gate_taus=gtaus[i] if gate else None).to(device))
        for name in w.names(i):
            if name in source.infos:
                source.release(name)
    lm = source_model(decoder, source, act, sid, info)
    # what the device really holds (the plan estimated it)
    host_embedding = host_embedding_bytes(mcfg, decoder)
    bytes_cpu = sum(f.cold_bytes() for f in ffns) + host_embedding
    bytes_gpu = tensor_bytes(decoder, *ffns, device=device) - (host_embedding if device == "cpu" else 0)
    check_vram(bytes_gpu, device, cfg.vram, ctx)
    fast = source_steps(decoder, ffns, cfg, device, dtype)
    rt = Runtime(lm, cfg, torch.device(device), dtype, ffns, [], bytes_gpu, bytes_cpu, L, threads, fast)
    rt.pcie_share = pcie_share(rt, mask)
    plan_figures(rt, solved)
    return rt


def load_moe_runtime(run: Path | None, cfg: Any, source: Any, sid: Any, mcfg: Any, act: str,
                     placement: Any = None) -> Any:
    """The Runtime of a mixture of experts (source opened by models/open.open_model), `placement` its expert mask
    (runtime/moe_load.py: the expert placement's rules)."""
    import warnings

    from hotneurons.artifacts.expert_predictors import path_in
    from hotneurons.models import build_model
    from hotneurons.models.open import model_info
    from hotneurons.runtime import expert_predictors
    from hotneurons.runtime.memory import check_fits, check_vram, plan_moe_bytes, tensor_bytes
    from hotneurons.runtime.moe_ffn import HybridMoE
    from hotneurons.runtime.placement import solved_summary

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
    ctx = static_ctx(cfg, solved, mcfg.max_positions)  # as the dense path sizes it
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
    pred_file = None if run is None or not cfg.expert_predictors else path_in(run)
    pred = expert_predictors.attach(ffns, pred_file) if pred_file is not None and pred_file.exists() else None
    stored = source.infos["blk.0.ffn_up_exps.weight"].fmt.value
    # ctx as the decoder's cache holds
    cfg = replace(cfg, cold_dtype=stored if all(f.in_place for f in ffns) else "q8_0", gpu_dtype=stored, ctx=ctx)
    lm = source_model(decoder, source, act, sid, info)
    host_embedding = host_embedding_bytes(mcfg, decoder)
    bytes_cpu = sum(f.cold_bytes() for f in ffns) + host_embedding
    bytes_gpu = (tensor_bytes(decoder, device=device) - (host_embedding if device == "cpu" else 0)
                 + sum(f.device_bytes() for f in ffns))
    check_vram(bytes_gpu, device, cfg.vram, ctx)
    # decode steps as the dense path's (CUDA graphs, the CPU's experts between them; eager pieces on a CPU); prefill
    # runs through engine.forward, HybridMoE.forward batching tokens per expert
    fast = source_steps(decoder, ffns, cfg, device, dtype)
    rt = Runtime(lm, cfg, torch.device(device), dtype, ffns, [], bytes_gpu, bytes_cpu, L, threads, fast)
    plan_figures(rt, solved)
    rt.plan_expert_share = None if solved is None or solved.experts is None else solved.experts.gpu_share_routed
    rt.expert_placement = where
    rt.locked = lock_cold_experts(ffns, rt.device)
    rt.expert_predictors = pred
    return rt
