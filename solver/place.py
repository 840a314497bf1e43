"""`solve_placement`: profile + hardware -> RUN/placement/{placement.parquet, summary.json, meta.json}."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import pandas as pd
from hotneurons.artifacts.placement import (
    Budget,
    LayerPlacement,
    Memory,
    Objective,
    PlacementFlags,
    PlacementMeta,
    PlacementSummary,
    SolverInfo,
)
from hotneurons.artifacts.profile import ProfileMeta, read_profile
from hotneurons.common.artifacts import ArtifactError, sha256_file, staged, write_parquet
from hotneurons.common.hardware import HardwareSpec
from hotneurons.common.kinds import PredictorDtype, choose
from hotneurons.common.model_info import ModelInfo
from hotneurons.common.units import format_bytes, format_size_arg

from .batching import batch_table, measured_union
from .cost import (
    ACT_BYTES,
    COLD_BYTES,
    DTYPE_BYTES,
    PlacementProblem,
    SolverError,
    build_problem,
    cold_weight_bytes,
    default_formats,
    embedding_on_cpu,
    estimate_predictor_params,
    evaluate,
    layer_tables,
    memory_items,
    predictor_hidden,
    safetensors_bytes,
)
from .ilp import IlpResult, solve_ilp


def _check_args(ctx: int, group_size: int, time_limit: float, mip_gap: float, hw: HardwareSpec) -> None:
    if ctx < 1:
        raise SolverError(f"the context length must be >= 1 token, got {ctx}", params="ctx")
    if group_size < 1:
        raise SolverError(f"the group size must be >= 1 neuron, got {group_size}", params="group_size")
    if not time_limit > 0:
        raise SolverError(f"the time limit must be > 0 seconds, got {time_limit}", params="time_limit")
    if not 0 <= mip_gap < 1:
        raise SolverError(f"the relative MIP gap must be in [0, 1), got {mip_gap}", params="mip_gap")
    if hw.cpu_bw <= 0 or hw.cores < 1:
        raise SolverError(f"the CPU needs a DRAM bandwidth > 0 and >= 1 core (got {hw.cpu_bw:g} B/s, {hw.cores} "
                          f"cores)", params=("cpu_bw", "cores"))
    if hw.vram_bytes > 0 and (hw.gpu_bw <= 0 or hw.pcie_bw <= 0):
        raise SolverError(f"a VRAM budget of {format_bytes(hw.vram_bytes)} on hardware '{hw.name}', which has no GPU "
                          f"or PCIe bandwidth: pick a GPU preset, or give both bandwidths",
                          params=("hardware", "gpu_bw", "pcie_bw"))


def _sorted_counts(df: pd.DataFrame, shape: ModelInfo, where: Path) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per layer neuron ids and counts, hottest first (ties by neuron id). Validates the table."""
    missing = {"layer", "neuron", "count"} - set(df.columns)
    if missing:
        raise ArtifactError(f"{where} lacks columns {sorted(missing)}: re-run pi-profile")
    layer = df["layer"].to_numpy(np.int64)
    neuron = df["neuron"].to_numpy(np.int64)
    count = df["count"].to_numpy(np.int64)
    if (count < 0).any():
        raise ArtifactError(f"{where} has negative counts: re-run pi-profile")
    expected = shape.n_layers * shape.n_neurons
    ok = (len(df) == expected and layer.min() >= 0 and layer.max() < shape.n_layers
          and neuron.min() >= 0 and neuron.max() < shape.n_neurons)
    # every (layer, neuron) exactly once
    ok = ok and bool((np.bincount(layer * shape.n_neurons + neuron, minlength=expected) == 1).all())
    if not ok:
        raise ArtifactError(f"{where} does not hold one row per neuron for {shape.n_layers} layers x {shape.n_neurons} "
                            f"neurons: re-run pi-profile")
    order = np.lexsort((neuron, -count, layer))  # layer, then count descending, then neuron id
    ids = neuron[order].reshape(shape.n_layers, shape.n_neurons)  # (layers, neurons)
    cts = count[order].reshape(shape.n_layers, shape.n_neurons)  # (layers, neurons)
    return list(ids), list(cts)


def gate_first_rows(run_dir: Path, meta) -> tuple[int, str]:
    """(rows of each cold neuron read every token, a note saying why): a gated model's run without predictors decodes
    with its own gates (runtime/gated.py), whose CPU kernel reads a cold neuron's gate row always (and its up row too
    for the |h| criterion) and the rest only when it passes; with predictors (or a ReLU-family model) only active
    neurons' rows are read."""
    gated = meta.get("gated")
    if not gated or (run_dir / "predictors" / "predictors.safetensors").exists():
        return 0, "cold rows priced per active neuron (a predictor or exact zeros decide which are read)"
    crit = gated.get("criterion", "h")
    always = 2 if crit == "h" else 1  # gate-h's up rows of gate-passing neurons are priced as passing ones
    return always, (f"cold rows priced gate-first ({crit} criterion of the profile): {always} row(s) of every cold "
                    f"neuron a token, the rest only where it passes")


def _predictor_bytes(run_dir: Path, shape: ModelInfo, dtype_bytes: float) -> tuple[int, str]:
    real = run_dir / "predictors" / "predictors.safetensors"
    if real.exists():
        return safetensors_bytes(real), f"measured from {real}"
    h = predictor_hidden(shape.d_model)
    return (int(estimate_predictor_params(shape) * dtype_bytes),
            f"estimate: no {real.parent}; per layer Linear({shape.d_model}->{h})+Linear({h}->{shape.n_neurons}), "
            f"hidden = d_model/4 rounded up to 64")


def solve_placement(run_dir: str | Path, hardware: HardwareSpec, vram_bytes: int | None = None,
                    dtype: str | None = None, ctx: int = 4096, reserve_bytes: int | None = None, group_size: int = 64,
                    objective: Objective | str = Objective.LATENCY, comm: bool = True, time_limit: float = 30.0,
                    mip_gap: float = 1e-3, threads: int | None = None, write: bool = True,
                    hardware_notes: list[str] | None = None, cold_dtype: str | None = None,
                    parallel: int = 1, predictor_bytes: int | None = None,
                    predictor_dtype: str = "auto") -> PlacementSummary:
    """Place each layer's hottest FFN neurons on the GPU. Returns the summary (also written to
    RUN/placement/summary.json with placement.parquet and meta.json when `write`). `dtype`: the weights' format on
    the GPU; `cold_dtype`: how the runtime will store the cold rows in CPU RAM (COLD_BYTES), which sets what an active
    cold neuron costs to read; None: what pi-generate keeps of the profiled model (cost.default_formats).
    `predictor_bytes`: the predictors' bytes on the GPU, in place of RUN/predictors' (what-if studies: smaller or
    quantized predictors, bench/predictor_quant.py). `predictor_dtype` q8_0: RUN/predictors' fp16 weights counted as
    the Q8_0 blocks pi-generate makes of them (--predictor-dtype), 17/32 of their bytes."""
    t_start = time.perf_counter()
    run_dir = Path(run_dir)
    hw = hardware.replace(vram_bytes=vram_bytes, reserve_bytes=reserve_bytes)
    objective = choose(objective, Objective, "objective", SolverError, "objective")
    _check_args(ctx, group_size, time_limit, mip_gap, hw)

    df, meta = read_profile(run_dir)
    tokens = meta.tokens
    if tokens <= 0:
        raise ArtifactError(f"{run_dir / 'profile'}/meta.json counts no tokens: re-run pi-profile")
    shape = ModelInfo.from_meta(meta.model)
    auto = default_formats(shape) if dtype is None or cold_dtype is None else None
    dtype = choose(dtype or auto[0], DTYPE_BYTES, "weight dtype", SolverError, "dtype")
    cold_dtype = choose(cold_dtype or auto[1], COLD_BYTES, "cold dtype", SolverError, "cold_dtype")
    if not 1 <= parallel <= 64:
        raise SolverError(f"--parallel {parallel} must be 1 to 64 (sequences decoded together)", params="parallel")
    ids, counts = _sorted_counts(df, shape, run_dir / "profile" / "neurons.parquet")
    db = DTYPE_BYTES[dtype]

    always, pricing = gate_first_rows(run_dir, meta)
    pred_bytes, pred_source = (_predictor_bytes(run_dir, shape, db) if not always
                               else (0, "none: a gated model's run without predictors decodes by its own gates"))
    predictor_dtype = choose(predictor_dtype, PredictorDtype, "predictor dtype", SolverError, "predictor_dtype").value
    if predictor_dtype == "q8_0" and not always:  # 34 bytes a block of 32 weights where fp16 takes 64
        pred_bytes, pred_source = pred_bytes * 17 // 32, f"{pred_source}, as Q8_0 blocks (17/32 of fp16's bytes)"
    if predictor_bytes is not None:
        pred_bytes, pred_source = int(predictor_bytes), "given (solve_placement's predictor_bytes)"
    items = memory_items(shape, db, ctx, hw.reserve_bytes if hw.has_gpu else 0, pred_bytes, ACT_BYTES[dtype])
    items["kv_cache"] *= parallel  # a slot of ctx tokens per sequence pi-serve decodes at once
    fixed = sum(items.values())
    if hw.has_gpu and fixed > hw.vram_bytes:
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in items.items() if v)
        raise SolverError(
            f"the VRAM budget {format_bytes(hw.vram_bytes)} is below the minimum {format_bytes(fixed)} for "
            f"{shape.name} at a context of {ctx} tokens in {dtype} ({parts}): raise the VRAM budget to at least "
            f"{format_size_arg(fixed)} or lower the context or the reserve",
            params=("vram_bytes", "ctx", "reserve_bytes"))
    budget = hw.vram_bytes - fixed if hw.has_gpu else 0.0
    problem = build_problem(counts, tokens, shape, hw, db, budget, pred_bytes / db / shape.n_layers, group_size, comm,
                            cold_weight_bytes(cold_dtype, shape.rows), always, ACT_BYTES[dtype])
    hardware_notes = [*(hardware_notes or []), pricing]
    tables = layer_tables(problem)

    if hw.has_gpu:
        result = solve_ilp(problem, objective, time_limit, mip_gap, threads, tables)
    else:  # nothing can go to a GPU: the all-CPU placement is the only one
        result = IlpResult(np.zeros(shape.n_layers, np.int64), "trivial (no GPU)", 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0)
    ev = evaluate(problem, result.k, tables)
    if not ev["feasible"]:  # never expected; the tests check it on random instances
        raise SolverError("internal error: the solver returned a placement that breaks a constraint")

    flags = PlacementFlags(vram_bytes=hw.vram_bytes, dtype=dtype, cold_dtype=cold_dtype, ctx=ctx,
                           reserve_bytes=hw.reserve_bytes, group_size=group_size, objective=objective,
                           comm_constraint=comm, time_limit=time_limit, mip_gap=mip_gap, threads=threads,
                           parallel=parallel, predictor_dtype=predictor_dtype)
    summary = _summary(problem, tables, result, ev, items, pred_source, hw, shape, tokens, flags, hardware_notes)
    summary.batching = batch_table(problem, tables, result.k, counts, shape, hw, db,
                                   predictor_bytes=pred_bytes if hw.has_gpu else 0.0)
    if hw.has_gpu:
        hot = tables.neurons[np.arange(problem.n_layers), result.k].astype(np.int64)
        summary.batching["measured_cold_rows_per_token"] = measured_union(
            run_dir / "profile" / "samples", [i[h:] for i, h in zip(ids, hot)])
    summary.seconds_total = time.perf_counter() - t_start
    if write:
        _write(run_dir, problem, ids, counts, summary, meta, hw)
    return summary


def _summary(p: PlacementProblem, t, result: IlpResult, ev: dict, items: dict, pred_source: str, hw: HardwareSpec,
             shape: ModelInfo, tokens: int, flags: PlacementFlags, notes: list[str]) -> PlacementSummary:
    rows = np.arange(p.n_layers)
    k = result.k
    gpu_neurons = t.neurons[rows, k].astype(np.int64)  # (layers,)
    total_ffn = float(t.bytes[:, -1].sum())
    cold_scale = cold_weight_bytes(flags.cold_dtype, shape.rows) / DTYPE_BYTES[flags.dtype]  # CPU RAM bytes a GPU byte
    ffn_gpu = ev["gpu_ffn_bytes"]
    layers = []
    for l in range(p.n_layers):
        layer_counts = float(t.counts[l, -1])
        layers.append(LayerPlacement(
            layer=l, gpu_groups=int(k[l]), gpu_neurons=int(gpu_neurons[l]), neurons=int(t.neurons[l, -1]),
            gpu_neuron_share=float(gpu_neurons[l] / t.neurons[l, -1]),
            gpu_activation_share=float(t.counts[l, k[l]] / layer_counts) if layer_counts else 0.0,
            gpu_bytes=int(t.bytes[l, k[l]]), cpu_bytes=int((t.bytes[l, -1] - t.bytes[l, k[l]]) * cold_scale),
            active_per_token=layer_counts / tokens, min_gpu_neurons=int(p.min_neurons[l]),
            expected_ms=float(t.layer_ms[l, k[l]]), gpu_ms=float(t.gpu_ms[l, k[l]]), cpu_ms=float(t.cpu_ms[l, k[l]]),
        ))
    all_cpu = evaluate(p, np.zeros(p.n_layers, np.int64), t)
    gpu_total = (sum(items.values()) + ffn_gpu) if hw.has_gpu else 0
    # bytes of an untied input embedding, which memory_items leaves off the GPU
    emb_cpu = int(shape.params.embedding * DTYPE_BYTES[flags.dtype]) if embedding_on_cpu(shape) else 0
    return PlacementSummary(
        model=shape.name,
        budget=Budget(vram_bytes=int(hw.vram_bytes), vram=format_bytes(hw.vram_bytes),
                      fixed_gpu_bytes=int(sum(items.values())) if hw.has_gpu else 0,
                      ffn_budget_bytes=int(p.budget_bytes)),
        memory=Memory(
            gpu={**({k_: int(v) for k_, v in items.items()} if hw.has_gpu else {}), "ffn_neurons": int(ffn_gpu),
                 "total": int(gpu_total), "free": int(hw.vram_bytes - gpu_total) if hw.has_gpu else 0},
            cpu={"ffn_neurons": int((total_ffn - ffn_gpu) * cold_scale),  # stored as the cold dtype
                 **({} if hw.has_gpu else {k_: int(v) for k_, v in items.items() if k_ != "reserve"}),
                 **({"embedding": emb_cpu} if emb_cpu else {})},
            predictors_source=pred_source,
            bytes_per_neuron=float(p.bytes_per_neuron[0]), rows_per_neuron=shape.rows),
        bytes_per_device={"gpu": int(gpu_total),
                          "cpu": int(total_ffn - ffn_gpu) + emb_cpu + (0 if hw.has_gpu else int(sum(items.values())))},
        gpu_activation_share=ev["gpu_activation_share"],
        gpu_neuron_share=float(gpu_neurons.sum() / t.neurons[:, -1].sum()),
        expected_latency_ms=ev["latency_ms"],
        expected_tokens_per_s=ev["tokens_per_s"],
        reference_tokens_per_s={"ffn_all_on_cpu": all_cpu["tokens_per_s"],
                                "all_on_gpu_dense": 1e3 / float(t.layer_ms[rows, p.n_groups].sum() + p.global_ms)},
        solver=SolverInfo(
            backend="PuLP + HiGHS", objective=flags.objective, status=result.status,
            objective_value=result.objective, bound=result.bound, gap=result.gap,
            objective_units="ms/token of the FFN and sync (placement-dependent part)"
            if flags.objective == Objective.LATENCY else "share of all activations served by the GPU",
            build_seconds=result.build_seconds, solve_seconds=result.solve_seconds,
            variables=result.n_variables, constraints=result.n_constraints,
            groups=int(p.n_groups.sum()), group_size=p.group_size),
        layers=layers,
        hardware={**dataclasses.asdict(hw), "effective_cpu_bw": hw.effective_cpu_bw, "notes": notes},
        flags=flags,
    )


def _write(run_dir: Path, p: PlacementProblem, ids, counts, summary: PlacementSummary, profile_meta: ProfileMeta,
           hw: HardwareSpec) -> None:
    L = p.n_layers
    n = [len(c) for c in counts]
    rank = np.concatenate([np.arange(m, dtype=np.int32) for m in n])
    gpu_neurons = np.array([x.gpu_neurons for x in summary.layers])  # (layers,)
    df = pd.DataFrame({
        "layer": np.repeat(np.arange(L, dtype=np.int32), n),
        "neuron": np.concatenate(ids).astype(np.int32),
        "gpu": rank < np.repeat(gpu_neurons, n),
        "count": np.concatenate(counts).astype(np.int64),
        "rank": rank,
    })
    pdir = run_dir / "profile"
    meta = PlacementMeta(inputs={"profile": {"meta_sha256": sha256_file(pdir / "meta.json"),
                                             "neurons_sha256": sha256_file(pdir / "neurons.parquet")}},
                         model=profile_meta.model, hardware=dataclasses.asdict(hw), flags=summary.flags)
    with staged(run_dir / "placement") as partial:
        write_parquet(partial / "placement.parquet", df)
        summary.save(partial / "summary.json")
        meta.save(partial / "meta.json")
