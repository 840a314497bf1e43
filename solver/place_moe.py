"""`solve_expert_placement`: an MoE profile + hardware -> RUN/placement/{experts.parquet, placement.parquet (neuron
groups), summary.json, meta.json}. docs/solver.md, "Mixtures of experts"."""

from __future__ import annotations

import dataclasses
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from hotneurons.artifacts.placement import (
    Budget,
    ExpertLayer,
    ExpertsSummary,
    Memory,
    Objective,
    PlacementFlags,
    PlacementMeta,
    PlacementSummary,
    SolverInfo,
)
from hotneurons.artifacts.profile import ProfileMeta
from hotneurons.common.artifacts import ArtifactError, read_table, sha256_file, staged, write_parquet
from hotneurons.common.hardware import HardwareSpec
from hotneurons.common.kinds import Activation, choose
from hotneurons.common.model_info import ModelInfo
from hotneurons.common.units import format_bytes, format_size_arg

from .cost import ACT_BYTES, COLD_BYTES, DTYPE_BYTES, SolverError, gguf_path, model_dtype
from .experts import ExpertProblem, baselines, evaluate_experts, expert_tables, solve_experts
from .ilp import IlpResult
from .place import _check_args

MODES = ("auto", "on", "off")  # --expert-neurons: neuron groups inside ReLU-family experts


def is_moe_profile(run_dir: str | os.PathLike) -> bool:
    return (Path(run_dir) / "profile" / "experts.parquet").exists()


def read_moe_profile(run_dir: str | os.PathLike) -> tuple[pd.DataFrame, pd.DataFrame | None, ProfileMeta]:
    """(experts table, neurons table or None, meta): pi-profile's reader where it exists, else the files read here."""
    try:
        from hotneurons.artifacts.profile import read_expert_profile
    except ImportError:
        read_expert_profile = None
    if read_expert_profile is not None:
        return read_expert_profile(run_dir)
    pdir = Path(run_dir) / "profile"
    fix = f"pi-profile --out {run_dir}"
    if not (pdir / "meta.json").exists() or not (pdir / "experts.parquet").exists():
        raise ArtifactError(f"no MoE profile in {pdir}: run `{fix}` first")
    meta = ProfileMeta.load(pdir / "meta.json")
    edf = read_table(pdir / "experts.parquet", ("layer", "expert", "count"), fix)
    ndf = (read_table(pdir / "neurons.parquet", ("layer", "expert", "neuron", "count"), fix)
           if (pdir / "neurons.parquet").exists() else None)
    return edf, ndf, meta


def experts_info(meta: ProfileMeta, where: Path) -> dict:
    x = getattr(meta, "experts", None) or meta.extras.get("experts")
    x = x.to_dict() if hasattr(x, "to_dict") else dict(x or {})
    missing = [k for k in ("n_experts", "n_experts_used", "n_ff_exp") if k not in x]
    if missing:
        raise ArtifactError(f"{where} lacks experts.{missing[0]}: re-run pi-profile")
    return {"n_experts": int(x["n_experts"]), "n_experts_used": int(x["n_experts_used"]),
            "n_ff_exp": int(x["n_ff_exp"]), "n_ff_shexp": int(x.get("n_ff_shexp", 0)),
            "norm_topk": bool(x.get("norm_topk", False))}


def _expert_counts(df: pd.DataFrame, L: int, E: int, where: Path) -> np.ndarray:
    layer, expert = df["layer"].to_numpy(np.int64), df["expert"].to_numpy(np.int64)
    count = df["count"].to_numpy(np.int64)
    ok = (len(df) == L * E and (count >= 0).all() and layer.min() >= 0 and layer.max() < L and expert.min() >= 0
          and expert.max() < E and (np.bincount(layer * E + expert, minlength=L * E) == 1).all())
    if not ok:
        raise ArtifactError(f"{where} does not hold one row per expert for {L} layers x {E} experts: re-run pi-profile")
    out = np.zeros((L, E), np.float64)  # (layers, experts)
    out[layer, expert] = count
    return out


def _neuron_counts(df: pd.DataFrame | None, L: int, E: int, n: int) -> np.ndarray | None:
    """(layers, experts, n_ff_exp) counts in neuron-id order, or None where the table does not cover every routed
    expert's neurons (the shared expert's rows, expert -1, stay on the GPU and are not needed)."""
    if df is None:
        return None
    df = df[df["expert"] >= 0]
    ix = [df[c].to_numpy(np.int64) for c in ("layer", "expert", "neuron")]
    if len(df) != L * E * n or ix[0].max() >= L or ix[1].max() >= E or ix[2].max() >= n or ix[2].min() < 0:
        return None
    out = np.full((L, E, n), -1, np.int64)  # (layers, experts, n_ff_exp)
    out[ix[0], ix[1], ix[2]] = df["count"].to_numpy(np.int64)
    return out if (out >= 0).all() else None


@dataclass(frozen=True)
class WeightSizes:
    """GPU bytes of every weight of the model, by item, in the formats they will have."""

    expert: np.ndarray  # (layers,) bytes of one routed expert
    fixed_layer: np.ndarray  # (layers,) attention, norms, router, shared expert: read by the GPU every token
    items: dict[str, int]  # attention, router, shared_expert, final_norm_and_other, embedding, lm_head
    format: str  # the experts' format ("q4_0", or "mixed" in a GGUF of several)
    source: str


def weight_sizes(model: ModelInfo, x: dict, dtype: str | None) -> WeightSizes:
    """From the GGUF file's tensor table (the formats the file stores) where the profile names one that exists and no
    `dtype` is given; otherwise every weight in `dtype` (default: the model's own float format, else fp16)."""
    L, E, d, p = model.n_layers, x["n_experts"], model.d_model, model.params
    path = None if dtype else gguf_path(model)
    if path is not None:
        from hotneurons.weights.formats import from_ggml_type
        from hotneurons.weights.gguf_file import GGUFFile

        expert, fixed = np.zeros(L), np.zeros(L)  # (layers,) bytes
        items = dict.fromkeys(("attention", "router", "shared_expert", "final_norm_and_other", "embedding",
                               "lm_head"), 0)
        formats = set()
        for name, t in GGUFFile(path).tensors.items():
            m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
            if m is None:
                key = {"token_embd.weight": "embedding", "output.weight": "lm_head"}.get(name, "final_norm_and_other")
                items[key] += t.nbytes
                continue
            l, rest = int(m[1]), m[2]
            if "_exps" in rest:
                expert[l] += t.nbytes / E
                formats.add(str(from_ggml_type(t.ggml_type)))
                continue
            key = "shared_expert" if "_shexp" in rest else "router" if rest.startswith("ffn_gate_inp") else "attention"
            items[key] += t.nbytes
            fixed[l] += t.nbytes
        fmt = formats.pop() if len(formats) == 1 else "mixed"
        return WeightSizes(expert, fixed, items, fmt, f"tensor table of {path}")
    wd = model_dtype(model.weight_dtype)
    dtype = choose(dtype or wd, DTYPE_BYTES, "weight dtype", SolverError, "dtype")
    w, a = DTYPE_BYTES[dtype], ACT_BYTES[dtype]  # block formats: router and norms stay 16-bit
    n, n_sh = x["n_ff_exp"], x["n_ff_shexp"]
    attn = np.array(p.attention_per_layer, np.float64) * w  # (layers,) everything outside the MoE FFN
    router = E * d * a
    shexp = 3 * d * n_sh * w + (d * a if n_sh else 0)  # rows + its sigmoid gate
    items = {"attention": int(attn.sum()), "router": int(L * router), "shared_expert": int(L * shexp),
             "final_norm_and_other": int(p.other * a), "embedding": int(p.embedding * w), "lm_head": int(p.lm_head * w)}
    return WeightSizes(np.full(L, 3 * d * n * w), attn + router + shexp, items, dtype,
                       f"{dtype} for every weight ({'--dtype' if dtype != wd else 'the model weight_dtype'})")


def solve_expert_placement(run_dir: str | Path, hardware: HardwareSpec, vram_bytes: int | None = None,
                           dtype: str | None = None, ctx: int = 4096, reserve_bytes: int | None = None,
                           group_size: int = 64, objective: Objective | str = Objective.LATENCY,
                           time_limit: float = 30.0, mip_gap: float = 1e-3, threads: int | None = None,
                           write: bool = True, hardware_notes: list[str] | None = None, cold_dtype: str | None = None,
                           expert_neurons: str = "off", parallel: int = 1) -> PlacementSummary:
    """Place whole experts (and neuron groups inside ReLU-family experts) on the GPU. `dtype`: the weights' format
    (None: the GGUF file's own); `cold_dtype`: how the CPU stores cold experts (None: as on the GPU, read in place)."""
    t_start = time.perf_counter()
    run_dir = Path(run_dir)
    hw = hardware.replace(vram_bytes=vram_bytes, reserve_bytes=reserve_bytes)
    objective = choose(objective, Objective, "objective", SolverError, "objective")
    expert_neurons = choose(expert_neurons, MODES, "expert-neurons mode", SolverError, "expert_neurons")
    if cold_dtype is not None:
        cold_dtype = choose(cold_dtype, COLD_BYTES, "cold dtype", SolverError, "cold_dtype")
    _check_args(ctx, group_size, time_limit, mip_gap, hw)
    if not 1 <= parallel <= 64:
        raise SolverError(f"--parallel {parallel} must be 1 to 64 (sequences decoded together)", params="parallel")

    edf, ndf, meta = read_moe_profile(run_dir)
    pdir = run_dir / "profile"
    if meta.tokens <= 0:
        raise ArtifactError(f"{pdir}/meta.json counts no tokens: re-run pi-profile")
    model, x = ModelInfo.from_meta(meta.model), experts_info(meta, pdir / "meta.json")
    L, E, n = model.n_layers, x["n_experts"], x["n_ff_exp"]
    counts = _expert_counts(edf, L, E, pdir / "experts.parquet")  # (layers, experts)
    try:
        relu = Activation(str(model.activation)).relu_family
    except ValueError:
        relu = False
    neuron_ids = _neuron_counts(ndf, L, E, n) if relu else None  # whole experts too: what the CPU computes
    if expert_neurons == "on" and neuron_ids is None:
        why = "are not ReLU-family" if not relu else "have no complete neuron counts in neurons.parquet"
        raise SolverError(f"--expert-neurons on: the experts of {model.name} {why}: use --expert-neurons auto "
                          f"or off", params="expert_neurons")

    sizes = weight_sizes(model, x, dtype)
    cold = sizes.expert if cold_dtype is None else np.full(L, 3 * model.d_model * n * COLD_BYTES[cold_dtype])
    kv_b = ACT_BYTES.get(sizes.format, 2.0)
    items = {**sizes.items, "embedding": 0 if model.params.lm_head else sizes.items["embedding"],
             # a slot of ctx tokens per sequence pi-serve decodes at once
             "kv_cache": int(2 * L * model.num_key_value_heads * model.head_dim * kv_b * ctx) * parallel,
             # fp32 buffers of a decode step: logits, hidden states, the k experts' and the shared expert's
             # intermediates, attention scores; doubled for allocator slack
             "workspace": int(2 * 4 * (model.vocab_size + 4 * model.d_model
                                       + 3 * (x["n_experts_used"] * n + x["n_ff_shexp"])
                                       + model.num_attention_heads * ctx)),
             "reserve": int(hw.reserve_bytes) if hw.has_gpu else 0}
    emb_cpu = sizes.items["embedding"] - items["embedding"]  # an untied input embedding stays in CPU RAM
    fixed = sum(items.values())
    if hw.has_gpu and fixed > hw.vram_bytes:
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in items.items() if v)
        raise SolverError(
            f"the VRAM budget {format_bytes(hw.vram_bytes)} is below the {format_bytes(fixed)} that {model.name} "
            f"needs on the GPU besides its routed experts at a context of {ctx} tokens ({parts}): raise the VRAM "
            f"budget to at least {format_size_arg(fixed)} or lower the context or the reserve",
            params=("vram_bytes", "ctx", "reserve_bytes"))

    bw = hw.gpu_bw if hw.has_gpu else hw.effective_cpu_bw  # bytes/s of the placement-independent reads
    # per layer with a cold routed expert: the hidden state down, the routed ids (int32) and weights (fp32) too, the
    # CPU's partial sum up; no weight crosses PCIe per token
    xfer = 2 * model.d_model * kv_b + 8 * x["n_experts_used"]  # bytes
    sync = (hw.sync_latency_s + xfer / hw.pcie_bw) * 1e3 if hw.has_gpu else 0.0  # ms
    head = (sizes.items["lm_head"] or sizes.items["embedding"]) + sizes.items["final_norm_and_other"]
    nc = None if neuron_ids is None else -np.sort(-neuron_ids, axis=2).astype(np.float64)  # hottest first
    problem = ExpertProblem(
        tokens=int(meta.tokens), counts=counts, expert_bytes=sizes.expert, cold_bytes=cold,
        gpu_bw=hw.gpu_bw if hw.has_gpu else np.inf, cpu_bw=hw.effective_cpu_bw, sync_ms=np.full(L, sync),
        fixed_ms=sizes.fixed_layer / bw * 1e3, global_ms=head / bw * 1e3,
        budget_bytes=float(hw.vram_bytes - fixed) if hw.has_gpu else 0.0,
        group_size=group_size if nc is not None and expert_neurons != "off" else 0, neuron_counts=nc)
    tables = expert_tables(problem)
    if hw.has_gpu:
        result = solve_experts(problem, objective, time_limit, mip_gap, threads, tables)
    else:
        result = IlpResult(np.zeros((L, E), np.int64), "trivial (no GPU)", 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0)
    ev = evaluate_experts(problem, result.k, tables)
    if not ev["feasible"]:  # never expected; the tests check it
        raise SolverError("internal error: the solver returned an expert placement that breaks the VRAM budget")

    flags = PlacementFlags(vram_bytes=hw.vram_bytes, dtype=sizes.format, cold_dtype=cold_dtype or sizes.format,
                           ctx=ctx, reserve_bytes=hw.reserve_bytes, group_size=problem.group_size,
                           objective=objective, comm_constraint=False, time_limit=time_limit, mip_gap=mip_gap,
                           threads=threads, parallel=parallel)
    summary = _summary(problem, tables, result, ev, items, emb_cpu, sizes, hw, model, x, int(xfer), flags,
                       hardware_notes or [])
    summary.seconds_total = time.perf_counter() - t_start
    if write:
        _write(run_dir, problem, counts, neuron_ids, result.k, summary, meta, x, hw)
    return summary


def _summary(p: ExpertProblem, t, result: IlpResult, ev: dict, items: dict, emb_cpu: int, sizes: WeightSizes,
             hw: HardwareSpec, model: ModelInfo, x: dict, xfer: int, flags: PlacementFlags,
             notes: list[str]) -> PlacementSummary:
    L, E = p.shape
    G, n = p.n_groups, x["n_ff_exp"]
    k = result.k  # (layers, experts)
    frac = t.neurons[k]  # (layers, experts) share of each expert's rows on the GPU
    gpu_b = t.bytes[np.arange(L)[:, None], k]  # (layers, experts) bytes
    cold_b = (1.0 - frac) * p.cold_bytes[:, None]  # (layers, experts) bytes in CPU RAM
    layers = [ExpertLayer(
        layer=l, gpu_experts=int((k[l] == G).sum()), partial_experts=int(((k[l] > 0) & (k[l] < G)).sum()),
        gpu_neurons=int(np.round(frac[l] * n).sum()), gpu_share_routed=float(ev["layer_share"][l]),
        gpu_bytes=int(gpu_b[l].sum()), cpu_bytes=int(cold_b[l].sum()), expected_ms=float(ev["layer_ms"][l]),
        gpu_ms=float(ev["gpu_ms"][l]), cpu_ms=float(ev["cpu_ms"][l]), sync_ms=float(ev["sync_ms"][l]))
        for l in range(L)]
    all_cpu = evaluate_experts(p, np.zeros((L, E), np.int64), t)
    all_gpu = evaluate_experts(p, np.full((L, E), G, np.int64), t)
    gpu_total = int(sum(items.values()) + ev["gpu_expert_bytes"]) if hw.has_gpu else 0
    mode = "neuron groups" if p.group_size else "whole experts"
    return PlacementSummary(
        model=model.name,
        budget=Budget(vram_bytes=int(hw.vram_bytes), vram=format_bytes(hw.vram_bytes),
                      fixed_gpu_bytes=int(sum(items.values())) if hw.has_gpu else 0,
                      ffn_budget_bytes=int(p.budget_bytes)),
        memory=Memory(
            gpu={**(items if hw.has_gpu else {}), "experts": int(ev["gpu_expert_bytes"]), "total": gpu_total,
                 "free": int(hw.vram_bytes - gpu_total) if hw.has_gpu else 0},
            cpu={"experts": int(cold_b.sum()), **({"embedding": emb_cpu} if emb_cpu else {}),
                 **({} if hw.has_gpu else {k_: v for k_, v in items.items() if k_ != "reserve"})},
            predictors_source="none: the router chooses the experts (an exact predictor)",
            bytes_per_neuron=float(p.expert_bytes[0] / n), rows_per_neuron=3),
        bytes_per_device={"gpu": gpu_total, "cpu": int(cold_b.sum()) + emb_cpu
                          + (0 if hw.has_gpu else int(sum(items.values())))},
        gpu_activation_share=ev["gpu_share_routed"],
        gpu_neuron_share=float(frac.mean()),
        expected_latency_ms=ev["latency_ms"], expected_tokens_per_s=ev["tokens_per_s"],
        reference_tokens_per_s={"experts_all_on_cpu": all_cpu["tokens_per_s"],
                                "experts_all_on_gpu": all_gpu["tokens_per_s"]},
        solver=SolverInfo(
            backend="PuLP + HiGHS", objective=flags.objective, status=result.status,
            objective_value=result.objective, bound=result.bound, gap=result.gap,
            objective_units="ms/token of the routed experts and sync (placement-dependent part)"
            if flags.objective == Objective.LATENCY else "mean over layers of the GPU share of routed expert work",
            build_seconds=result.build_seconds, solve_seconds=result.solve_seconds,
            variables=result.n_variables, constraints=result.n_constraints, groups=int(L * E * G),
            group_size=p.group_size),
        layers=[],
        hardware={**dataclasses.asdict(hw), "effective_cpu_bw": hw.effective_cpu_bw, "notes": notes},
        flags=flags,
        experts=ExpertsSummary(
            n_experts=E, n_experts_used=x["n_experts_used"], n_ff_exp=n, n_ff_shexp=x["n_ff_shexp"], mode=mode,
            expert_bytes=[int(b) for b in p.expert_bytes], cold_expert_bytes=[int(b) for b in p.cold_bytes],
            weights_source=sizes.source, gpu_share_routed=ev["gpu_share_routed"],
            gpu_experts_per_layer=[y.gpu_experts for y in layers], pcie_bytes_per_token=xfer,
            baselines=baselines(p, k, t) if hw.has_gpu else {}, layers=layers),
    )


def _write(run_dir: Path, p: ExpertProblem, counts: np.ndarray, neuron_ids: np.ndarray | None, k: np.ndarray,
           summary: PlacementSummary, profile_meta: ProfileMeta, x: dict, hw: HardwareSpec) -> None:
    L, E = p.shape
    G = p.n_groups
    li, ei = np.meshgrid(np.arange(L), np.arange(E), indexing="ij")  # (layers, experts)
    order = np.lexsort((ei.ravel(), -counts.ravel(), li.ravel()))  # layer, count descending, expert id
    edf = pd.DataFrame({"layer": li.ravel()[order].astype(np.int32), "expert": ei.ravel()[order].astype(np.int32),
                        "gpu": (k == G).ravel()[order], "count": counts.ravel()[order].astype(np.int64),
                        "rank": np.tile(np.arange(E, dtype=np.int32), L)})
    pdir = run_dir / "profile"
    inputs = {f"{f.split('.')[0]}_sha256": sha256_file(pdir / f)
              for f in ("meta.json", "experts.parquet", "neurons.parquet") if (pdir / f).exists()}
    meta = PlacementMeta(inputs={"profile": inputs}, model=profile_meta.model, hardware=dataclasses.asdict(hw),
                         flags=summary.flags, experts={**x, "mode": summary.experts.mode})
    with staged(run_dir / "placement") as partial:
        write_parquet(partial / "experts.parquet", edf)
        if neuron_ids is not None and p.group_size:
            n = neuron_ids.shape[2]
            # per expert: neurons by count descending (ties by id); the GPU holds a prefix of k groups
            nid = np.argsort(-neuron_ids, axis=2, kind="stable")  # (layers, experts, n) ids, hottest first
            hot = np.minimum(k * p.group_size, n)  # (layers, experts) neurons on the GPU
            write_parquet(partial / "placement.parquet", pd.DataFrame({
                "layer": np.repeat(np.arange(L, dtype=np.int32), E * n),
                "expert": np.tile(np.repeat(np.arange(E, dtype=np.int32), n), L),
                "neuron": nid.ravel().astype(np.int32),
                "gpu": (np.arange(n)[None, None, :] < hot[:, :, None]).ravel(),
                "count": np.take_along_axis(neuron_ids, nid, 2).ravel().astype(np.int64),
                "rank": np.tile(np.arange(n, dtype=np.int32), L * E)}))
        summary.save(partial / "summary.json")
        meta.save(partial / "meta.json")
