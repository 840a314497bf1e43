"""Reading a run directory into a runtime: `check_run` (the run's files, each checked before the model loads) and
`load_runtime` (the model the run was made for, its placement, predictors and profile thresholds, laid out by
generate.build_runtime, or read in place into our decoder by `load_source_runtime`). The stages that run the runtime
build it here.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from hotneurons.artifacts.placement import Placement
from hotneurons.artifacts.profile import check_profile, read_profile
from hotneurons.common import artifacts
from hotneurons.common.artifacts import ArtifactError
from hotneurons.models.family import check_model, load_model, load_model_from_meta
from hotneurons.runtime.config import PRESETS, RuntimeConfig
from hotneurons.runtime.engine import (
    SourceModel,
    conversions,
    file_placement,
    file_predictors,
    formats_for,
    requantized,
)
from hotneurons.runtime.gated import default_sparsity, gate_taus, uses_gate
from hotneurons.runtime.generate import Runtime, build_runtime, device_and_dtype
from hotneurons.runtime.moe_load import check_moe_run, is_moe_run
from hotneurons.runtime.placement import plan_figures, solved_summary


def _first_meta(run_dir: Path) -> dict | None:
    for stage in ("placement", "predictors", "profile"):
        p = run_dir / stage / "meta.json"
        if p.exists():
            try:
                meta = artifacts.read_json(p)
            except (ValueError, OSError) as e:
                raise ArtifactError(f"{p} is not valid JSON ({e}): re-run the stage that wrote it") from None
            if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict):
                raise ArtifactError(f"{p} names no model: re-run the stage that wrote it")
            return meta
    return None


def check_run(run: Path, cfg: RuntimeConfig, recall: float | None = None, moe: bool = False) -> None:
    """The run directory's files that `load_runtime` will read, checked before the model loads: each refused in one
    line naming it (missing, empty, cut short, of another format). A mixture of experts' run (`moe`) needs no
    predictors: its router picks the experts (runtime/moe_load.check_moe_run)."""
    from hotneurons.artifacts.placement import PlacementMeta
    from hotneurons.artifacts.predictor_file import check_predictors

    if (run / "profile" / "meta.json").exists():
        check_profile(run)
    if moe:
        return check_moe_run(run)
    if (run / "placement" / "placement.parquet").exists() and cfg.mode != "layer-split":
        PlacementMeta.load(run / "placement" / "meta.json")
        artifacts.check_table(run / "placement" / "placement.parquet", ("layer", "neuron", "gpu"),
                              f"pi-solve --run {run}")
    if cfg.mode == "hybrid" and not cfg.oracle and not uses_gate(cfg):
        if not (run / "predictors" / "predictors.safetensors").exists():
            raise ArtifactError(f"no predictors in {run / 'predictors'}: run `pi-train-predictors --run {run}`, or "
                                f"pass --sparsity S (a gated model's own gates), --no-predictor (dense) or --oracle "
                                f"(true masks)")
        check_predictors(run, recall)


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
    placement and no predictors (runtime/moe_load.py)."""
    if cfg.sparsity is not None and not 0 <= cfg.sparsity < 1:
        raise ArtifactError(f"--sparsity {cfg.sparsity}: give the FFN sparsity as a share in [0, 1), e.g. 0.5")
    run = Path(run_dir) if run_dir is not None else None
    cfg = default_sparsity(run, cfg)
    if cfg.mode == "hybrid" and not cfg.oracle and (not use_predictor or cfg.sparsity == 0):
        cfg = RuntimeConfig(**{**cfg.__dict__, "mode": "dense"})
    device, dtype = device_and_dtype(cfg)
    dname = str(dtype).removeprefix("torch.")
    meta = _first_meta(run) if run is not None else None
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
    placement = predictors = taus = None
    solved = None  # pi-solve's summary, where the placement came from pi-solve
    if run is not None and (run / "placement" / "placement.parquet").exists() and cfg.mode != "layer-split":
        placement = Placement.from_run(run, lm.info)
        solved = solved_summary(run)
        if cfg.ctx is None and solved is not None:  # the KV cache the solver reserved room for
            cfg = replace(cfg, ctx=solved.flags.ctx)
    gate = uses_gate(cfg)
    if run is not None and cfg.mode == "hybrid" and not cfg.oracle and not gate:
        from hotneurons.artifacts.predictor_file import load_predictors

        if not (run / "predictors" / "predictors.safetensors").exists():
            raise ArtifactError(f"no predictors in {run / 'predictors'}: run `pi-train-predictors --run {run}`, or "
                                f"pass --no-predictor (dense) or --oracle (true masks)")
        predictors = load_predictors(run, lm.info, device="cpu", dtype=dtype)
        if recall is not None:
            predictors.set_recall(recall)
    if run is not None and (run / "profile" / "meta.json").exists():
        _, pmeta = read_profile(run)
        artifacts.check_same_model(pmeta, {"model": lm.info}, f"profile {run / 'profile'}", "the model")
        taus = pmeta.layer_taus
    gtaus = gate_taus(run, cfg, lm.activation, len(lm.layers)) if gate else None
    rt = build_runtime(lm, cfg, placement, predictors, taus, gtaus)
    plan_figures(rt, solved)
    return rt


def load_source_runtime(run: Path | None, meta: dict | None, cfg: Any, *, model: str | None = None,
                        gguf_file: str | None = None, use_predictor: bool = True, recall: float | None = None,
                        placement: Any = None) -> Any:
    """The Runtime of the model a run was made for (or `model`), read in place into our decoder and hybrid FFNs.
    `placement` (artifacts.placement.Placement) replaces the run's (tests, benchmarks); for a mixture of experts, a
    (layers, experts) bool mask of the experts on the device, else the run's experts.parquet (runtime/moe_load.py)."""
    from hotneurons.artifacts.placement import Placement
    from hotneurons.artifacts.predictors import PredictorForm
    from hotneurons.artifacts.profile import read_profile
    from hotneurons.common import artifacts
    from hotneurons.kernels.cold import set_threads
    from hotneurons.kernels.ops import default_ops
    from hotneurons.models import build_model
    from hotneurons.models.family import RELU_FAMILY, adapter_for
    from hotneurons.models.ffn_weights import FFNWeights
    from hotneurons.models.open import model_info, open_model
    from hotneurons.runtime.balance import pcie_share
    from hotneurons.runtime.gated import gate_taus, uses_gate
    from hotneurons.runtime.generate import CAPACITY, Runtime, device_and_dtype
    from hotneurons.runtime.hybrid_ffn import HybridFFN
    from hotneurons.runtime.memory import check_fits, check_vram, plan_bytes, tensor_bytes
    from hotneurons.runtime.placement import plan_figures, solved_summary
    from hotneurons.runtime.source_steps import SourceSteps
    from tqdm.auto import tqdm

    if cfg.ctx is not None and cfg.ctx < 1:
        raise ValueError(f"--ctx {cfg.ctx}: the static KV cache needs at least 1 token (leave it out for the "
                         f"placement's)")
    if meta is not None and model is None:
        src = meta["model"]["source"]
        model, gguf_file = src["path"], gguf_file or src.get("gguf_file")
    activation = meta["model"]["activation"] if meta is not None and meta["model"]["activation"] == "drelu" else None
    source, sid, mcfg, act = open_model(model, gguf_file, activation)
    if mcfg.moe:
        from hotneurons.runtime.moe_load import load_moe_runtime

        return load_moe_runtime(run, cfg, source, sid, mcfg, act, placement)
    adapter = adapter_for(source.config)
    info = model_info(source, sid, act, adapter.name, adapter.gated)
    device, dtype = device_and_dtype(cfg)
    L, n = info["n_layers"], info["n_neurons"]
    predictors = taus = None
    solved = None  # pi-solve's summary, where the placement came from pi-solve
    if placement is None and run is not None and (run / "placement" / "placement.parquet").exists():
        placement = Placement.from_run(run, info)
        solved = solved_summary(run)
    mode = cfg.mode
    oracle = mode == "hybrid" and cfg.oracle
    if mode == "hybrid" and not oracle and (not use_predictor or cfg.sparsity == 0):
        mode = "dense"
    gate = mode == "hybrid" and uses_gate(cfg)
    mask = "dense" if mode == "dense" else ("oracle" if oracle else ("gate" if gate else "predictor"))
    gtaus = gate_taus(run, cfg, act, L) if gate else None

    pwri = run is None and getattr(source, "powerinfer", False)  # PowerInfer's own file: predictors and split in it
    if pwri and mask == "predictor":
        predictors = file_predictors(source, dtype)
        placement = placement or file_placement(source, L)
    elif mask == "predictor":
        from hotneurons.artifacts.predictor_file import load_predictors

        if run is None:  # a model file alone (not PowerInfer's, which carries its own): no predictors to read
            raise ArtifactError("hybrid mode needs predictors: pass --run RUN (pi-profile, pi-solve, "
                                "pi-train-predictors), or use --mode dense (--no-predictor) or --oracle with a "
                                "placement")

        predictors = load_predictors(run, info, device="cpu", dtype=dtype)
        if recall is not None:
            predictors.set_recall(recall)
    if run is not None and (run / "profile" / "meta.json").exists():
        _, pmeta = read_profile(run)
        artifacts.check_same_model(pmeta, {"model": info}, f"profile {run / 'profile'}", "the model")
        taus = pmeta.layer_taus
    if mode == "hybrid" and placement is None:
        raise ArtifactError("hybrid mode needs a placement: run `pi-solve --run RUN` first, or use --mode dense")
    if mask == "oracle" and taus is None and act not in RELU_FAMILY:
        raise ArtifactError(f"--oracle on a {act} model needs the profile's thresholds (RUN/profile/)")
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
    ctx = cfg.ctx or min(solved.flags.ctx if solved is not None else CAPACITY, mcfg.max_positions)
    need = plan_bytes(source, placement, cold_fmt, hot_fmt, dtype, ctx, info,
                      neuron_major=gate and torch.device(device).type == "cuda")
    check_fits(need, device, cfg.vram, ctx)
    prenorm = mask == "predictor" and predictors.form == PredictorForm.POWERINFER
    threads = set_threads(cfg.threads)
    decoder = build_model(mcfg, lambda name: source.get(name) if name in source.infos else None,
                          torch.device(device), dtype, ctx,
                          release=lambda name: source.release(name) if name in source.infos else 0)
    ffns = []
    for i in tqdm(range(L), desc="loading layers", unit="layer", leave=False, disable=L < 8):
        w = FFNWeights.from_source(source, i)
        # taken out of `predictors`: the FFN keeps its own (reordered) copy, so the file's is freed layer by layer
        pred = predictors.layers.pop(i).to("cpu", dtype) if mask == "predictor" else None
        ffns.append(HybridFFN(i, act, w, placement.gpu[i], mask, pred, None if taus is None else taus[i], cold_fmt,
                              cfg.cuda_graphs, prenorm, hot_fmt, device, dtype,
                              gtaus[i] if gate else None).to(device))
        for name in w.names(i):
            if name in source.infos:
                source.release(name)
    tok = source.tokenizer()
    eos = getattr(tok, "eos_token_id", None)
    lm = SourceModel(decoder, tok, act, sid, info, source.config, set() if eos is None else {int(eos)})
    # what the device really holds (the plan estimated it); an untied embedding stays in CPU RAM (models/common.py)
    host_embedding = 0 if mcfg.tied_embeddings else tensor_bytes(decoder.tok_embd)
    bytes_cpu = sum(f.cold_bytes() for f in ffns) + host_embedding
    bytes_gpu = tensor_bytes(decoder, *ffns, device=device) - (host_embedding if device == "cpu" else 0)
    check_vram(bytes_gpu, device, cfg.vram, ctx)
    ops = default_ops(torch.device(device)) if cfg.ops == "auto" else cfg.ops
    # decode steps as CUDA graphs over the decoder's own cache (eager on a CPU, the same pieces)
    fast = (SourceSteps(decoder, ffns, torch.device(device), dtype, cfg.cuda_graphs, ops, cfg.prelaunch)
            if cfg.static_decode else None)
    rt = Runtime(lm, cfg, torch.device(device), dtype, ffns, [], bytes_gpu, bytes_cpu, L, threads, fast)
    rt.pcie_share = pcie_share(rt, mask)
    plan_figures(rt, solved)
    return rt
