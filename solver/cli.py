"""`pi-solve`: choose which FFN neurons live on the GPU (thin wrapper over `solve_placement`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from hotneurons.artifacts.placement import Objective, PlacementSummary
from hotneurons.artifacts.profile import check_profile
from hotneurons.common.artifacts import ArtifactError, read_json
from hotneurons.common.cli import StageCommand, cli_error, interrupted, stdout_to_stderr
from hotneurons.common.hardware import HARDWARE, UnknownHardware, get_hardware, presets_table
from hotneurons.common.kinds import PredictorDtype
from hotneurons.common.model_info import ModelInfo
from hotneurons.common.units import format_bytes, format_rate, parse_bytes, parse_rate
from hotneurons.kernels.measure import measure_cold_rate, measure_expert_rate, measure_hardware

from .cost import COLD_BYTES, DTYPE_BYTES, SolverError, default_formats

# solve_placement's arguments whose flag is spelled otherwise
FLAGS = {"vram_bytes": "--vram", "reserve_bytes": "--reserve", "comm": "--no-comm-constraint"}


def _parsed(parse, flag: str, text: str | None):
    """A size (`parse_bytes`) or rate (`parse_rate`) flag, or None; bad text -> a one-line error naming the flag."""
    if text is None:
        return None
    try:
        return parse(text)
    except ValueError as e:
        raise click.ClickException(f"{flag}: {e}") from None


@click.command(cls=StageCommand, run_folder=lambda p: p["run_dir"],
               context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("--run", "run_dir", type=click.Path(file_okay=False),
              help="Run directory holding profile/ (from pi-profile).")
@click.option("--vram", help="GPU memory to plan for, e.g. 24GB (10^9 B) or 24GiB (2^30 B). Default: the preset's.")
@click.option("--hardware", default="rtx4090", show_default=True,
              help=f"Preset ({', '.join(HARDWARE)}), or 'list' to print them.")
@click.option("--measure", is_flag=True,
              help="Measure this machine: DRAM and the cold kernel's own rate on decode-sized calls (which becomes "
                   "the CPU rate of the cost model), and with CUDA VRAM, PCIe, GPU bandwidth, sync.")
@click.option("--pcie-bw", help="Override PCIe bandwidth, e.g. 25GB/s.")
@click.option("--gpu-bw", help="Override GPU memory bandwidth, e.g. 1008GB/s.")
@click.option("--cpu-bw", help="Override the CPU's rate for cold rows (DRAM, or the cold kernel's), e.g. 60GB/s.")
@click.option("--cores", type=int, help="Override CPU cores used for cold neurons.")
@click.option("--sync-us", type=float, help="Override the per-layer GPU<->CPU sync latency, microseconds.")
@click.option("--dtype", type=click.Choice(list(DTYPE_BYTES)),
              help="Weight format on both devices (sets bytes per neuron; llama.cpp's block formats q8_0 ... iq1_m "
                   "for sizing only: name the format pi-generate keeps, e.g. q8_0 for a Q5_0 or IQ4_XS file, whose "
                   "rows it converts; docs/memory.md). Default: what pi-generate keeps of the profiled file: its block "
                   "format where the GPU kernels read it (else the nearest one they do), fp16 for a float model; a "
                   "mixture of experts: the formats of its GGUF file.")
@click.option("--cold-dtype", type=click.Choice(list(COLD_BYTES)),
              help="How pi-generate will store the cold rows in CPU RAM (its --cold-dtype): int8 and q8_0 take 0.53 "
                   "of bf16's bytes for an active cold neuron to read, q4_0 0.28. Default: what pi-generate keeps "
                   "(--cold-dtype auto): the file's block format where the CPU kernels read it, else the nearest; "
                   "bf16 for a float model; a mixture of experts: as on the GPU (cold experts read in place).")
@click.option("--ctx", type=int, default=4096, show_default=True, help="Context length the KV cache must hold.")
@click.option("--parallel", type=int, default=1, show_default=True,
              help="Sequences pi-serve decodes at once (its --parallel, which it takes from here by default): a KV "
                   "cache slot of --ctx tokens each in the budget. A dense model's summary prices batches of 1-8.")
@click.option("--predictor-dtype", type=click.Choice(PredictorDtype.values()), default="auto", show_default=True,
              help="The predictors' storage on the GPU (pi-generate's --predictor-dtype, which it takes from here by "
                   "default): q8_0 counts 17/32 of their fp16 bytes (docs/predictors.md).")
@click.option("--reserve", help="VRAM kept for the CUDA context and allocator, e.g. 1GiB or 0. Default: the preset's.")
@click.option("--group-size", type=int, default=64, show_default=True, help="Neurons per placement group.")
@click.option("--objective", type=click.Choice(Objective.values()), default="latency", show_default=True,
              help="latency: minimise expected ms/token; activations: maximise activations served by the GPU (paper).")
@click.option("--no-comm-constraint", is_flag=True, help="Drop the per-layer minimum C_l of GPU neurons.")
@click.option("--time-limit", type=float, default=30.0, show_default=True, help="Solver time limit, seconds.")
@click.option("--mip-gap", type=float, default=1e-3, show_default=True, help="Relative optimality gap to stop at.")
@click.option("--threads", type=int, help="HiGHS threads (default: HiGHS's choice).")
@click.option("--expert-neurons", type=click.Choice(["auto", "on", "off"]), default="off", show_default=True,
              help="Mixtures of experts: also place groups of the hottest neurons inside ReLU-family experts (auto: "
                   "where the activation is ReLU-family and the profile counts the experts' neurons), for study: "
                   "pi-generate and pi-serve compute whole experts and refuse such a placement.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead of the human summary.")
def main(run_dir, vram, hardware, measure, pcie_bw, gpu_bw, cpu_bw, cores, sync_us, dtype, cold_dtype, ctx, parallel,
         predictor_dtype, reserve, group_size, objective, no_comm_constraint, time_limit, mip_gap, threads,
         expert_neurons, as_json):
    """Place each layer's hottest FFN neurons on the GPU, the rest on the CPU, within a VRAM budget.

    Reads RUN/profile/, writes RUN/placement/{placement.parquet, summary.json, meta.json}. A mixture-of-experts
    profile (profile/experts.parquet) places whole experts, and neuron groups inside ReLU-family ones: it writes
    RUN/placement/experts.parquet (docs/solver.md, "Mixtures of experts").

    Example: pi-solve --run runs/SmolLM2-135M-Instruct --vram 24GB --hardware rtx4090
    """
    if hardware.strip().lower() == "list":
        click.echo(presets_table())
        return
    if run_dir is None:
        raise click.ClickException("--run is required: the run directory that pi-profile wrote (e.g. runs/<model>)")
    try:
        hw = get_hardware(hardware)
    except UnknownHardware as e:
        raise click.ClickException(str(e)) from None
    rates = {flag: _parsed(parse_rate, flag, text) for flag, text in
             (("--pcie-bw", pcie_bw), ("--gpu-bw", gpu_bw), ("--cpu-bw", cpu_bw))}
    vram_bytes, reserve_bytes = _parsed(parse_bytes, "--vram", vram), _parsed(parse_bytes, "--reserve", reserve)
    if cores is not None and cores < 1:
        raise click.ClickException(f"--cores must be >= 1, got {cores}")
    if sync_us is not None and sync_us < 0:
        raise click.ClickException(f"--sync-us must be >= 0, got {sync_us}")
    moe = (Path(run_dir) / "profile" / "experts.parquet").exists()  # a mixture of experts (solver/place_moe.py)
    try:  # before --measure's seconds
        if moe:
            from .place_moe import read_moe_profile

            meta = read_moe_profile(run_dir)[2]
        else:
            meta = check_profile(run_dir)
            check_run_predictors(run_dir, meta.model)
    except ArtifactError as e:
        raise cli_error(e, FLAGS) from None
    # unset formats: those pi-generate's `auto` keeps of the profiled file (a mixture of experts sizes by its file)
    auto = None if moe else default_formats(ModelInfo.from_meta(meta.model))
    with stdout_to_stderr(as_json):  # HiGHS prints its banner to fd 1 whatever it is told
        notes: list[str] = []
        if measure:
            hw, notes = measure_hardware(hw)
            if moe:
                hw, note = measure_expert_rate(hw, int(meta.model["d_model"]), int(meta.experts.n_ff_exp),
                                               int(meta.experts.n_experts_used), cold_dtype or "q4_0")
            else:
                hw, note = measure_cold_rate(hw, meta.model, meta.mean_sparsity, cold_dtype or auto[1])
            notes.append(note)
            if not as_json:
                for n in notes:
                    click.echo(f"measure: {n}", err=True)
        hw = hw.replace(pcie_bw=rates["--pcie-bw"], gpu_bw=rates["--gpu-bw"], cpu_bw=rates["--cpu-bw"], cores=cores,
                        sync_latency_s=None if sync_us is None else sync_us * 1e-6)
        # a placement is re-solved in place (another budget, a new profile): said, never silent
        before = Path(run_dir) / "placement" / "summary.json"
        written = before.stat().st_mtime_ns if before.exists() else None
        try:
            replaced = PlacementSummary.load(before).budget.vram if before.exists() else None
        except (ArtifactError, ValueError, KeyError, TypeError):  # unreadable: replaced all the same
            replaced = "an unreadable summary"
        from .place import solve_placement  # pandas, torch: after the arguments are read
        from .place_moe import solve_expert_placement

        try:
            if moe:
                summary = solve_expert_placement(
                    run_dir, hw, vram_bytes=vram_bytes, dtype=dtype, ctx=ctx, reserve_bytes=reserve_bytes,
                    group_size=group_size, objective=objective, time_limit=time_limit, mip_gap=mip_gap,
                    threads=threads, hardware_notes=notes, cold_dtype=cold_dtype, expert_neurons=expert_neurons,
                    parallel=parallel)
            else:
                summary = solve_placement(run_dir, hw, vram_bytes=vram_bytes, dtype=dtype, ctx=ctx,
                                          reserve_bytes=reserve_bytes, group_size=group_size,
                                          objective=objective, comm=not no_comm_constraint, time_limit=time_limit,
                                          mip_gap=mip_gap, threads=threads, hardware_notes=notes,
                                          cold_dtype=cold_dtype, parallel=parallel,
                                          predictor_dtype=predictor_dtype)
        except (SolverError, ArtifactError) as e:
            raise cli_error(e, FLAGS) from None
        except KeyboardInterrupt:  # a Ctrl-C during the write waits for it (common/artifacts.staged)
            if before.exists() and before.stat().st_mtime_ns != written:
                interrupted(f"the placement was complete and is written in {before.parent}")
            interrupted(f"nothing was written ({before.parent} is as it was): run the command again")
    if before.exists() and replaced is not None:
        click.echo(f"replaced the placement in {before.parent} (solved before for {replaced})", err=True)
    if as_json:
        click.echo(json.dumps(summary.to_dict(), indent=2))
    else:
        click.echo(human_moe_summary(summary, run_dir) if moe else human_summary(summary, run_dir))


def check_run_predictors(run_dir: str, model: dict) -> None:
    """RUN/predictors/ left by another model (or of another shape) would size the VRAM budget with its bytes:
    refused in one line that says what differs, before the solve."""
    pdir = Path(run_dir) / "predictors"
    if not (pdir / "meta.json").exists():
        return
    fix = f"retrain them (pi-train-predictors --run {run_dir} --force) or delete {pdir}"
    try:
        old = read_json(pdir / "meta.json").get("model") or {}  # any version: only its model matters here
    except (OSError, ValueError):
        raise ArtifactError(f"{pdir / 'meta.json'} is unreadable, so the predictors' size is unknown: {fix}") from None
    diff = [f"model '{old.get('name')}' ({str(old.get('fingerprint'))[:12]}), the profile's '{model['name']}' "
            f"({model['fingerprint'][:12]})"] if old.get("fingerprint") != model["fingerprint"] else []
    diff += [f"{what} {old.get(key)}, the profile's {model[key]}" for key, what in
             (("n_layers", "layers"), ("n_neurons", "FFN neurons"), ("d_model", "d_model"))
             if old.get(key) != model.get(key)]
    if diff:
        raise ArtifactError(f"{pdir} holds predictors of another model ({'; '.join(diff)}), whose size pi-solve "
                            f"would budget: {fix}")


def human_summary(s: PlacementSummary, run_dir: str) -> str:
    g, sv, hw, b = s.memory.gpu, s.solver, s.hardware, s.budget
    shares = sorted(x.gpu_neuron_share for x in s.layers)
    fixed = ", ".join(f"{k} {format_bytes(v)}" for k, v in g.items() if k not in ("ffn_neurons", "total", "free") and v)
    lines = [
        f"model      {s.model}  ({len(s.layers)} layers, {s.layers[0].neurons} FFN neurons each)",
        f"formats    {s.flags.dtype} on the GPU, {s.flags.cold_dtype} cold rows (--dtype, --cold-dtype)",
        f"hardware   {hw['name']}: VRAM {format_bytes(b.vram_bytes)}, GPU {format_rate(hw['gpu_bw'])}, "
        f"PCIe {format_rate(hw['pcie_bw'])}, DRAM {format_rate(hw['cpu_bw'])} x {hw['cores']} cores",
        f"fixed GPU  {format_bytes(b.fixed_gpu_bytes)}: {fixed}" if g else "fixed GPU  none (no GPU)",
        f"           predictors: {s.memory.predictors_source}",
        f"FFN        GPU {format_bytes(g['ffn_neurons'])} of budget {format_bytes(b.ffn_budget_bytes)}; "
        f"CPU {format_bytes(s.memory.cpu['ffn_neurons'])}",
        f"placement  {s.gpu_neuron_share:.1%} of neurons on the GPU serve {s.gpu_activation_share:.1%} of "
        f"activations; per layer GPU share {shares[0]:.1%} .. {shares[len(shares) // 2]:.1%} (median) .. "
        f"{shares[-1]:.1%}",
        f"expected   {s.expected_latency_ms:.2f} ms/token = {s.expected_tokens_per_s:.2f} tokens/s "
        f"(FFN all on CPU: {s.reference_tokens_per_s['ffn_all_on_cpu']:.2f}, all on GPU, dense: "
        f"{s.reference_tokens_per_s['all_on_gpu_dense']:.2f}; cost-model floor, not a measurement)",
        f"solver     {sv.backend}, objective {sv.objective}: {sv.status}, gap {sv.gap:.2e}, "
        f"{sv.groups} groups of {sv.group_size}, build {sv.build_seconds:.2f} s + solve {sv.solve_seconds:.2f} s",
        *_batching_lines(s.batching),
        f"wrote      {run_dir}/placement/{{placement.parquet, summary.json, meta.json}}",
    ]
    return "\n".join(lines)


def _batching_lines(b: dict | None) -> list[str]:
    """pi-serve --parallel B: the cost model's aggregate tokens/s per B against the layer split's."""
    if not b:
        return []
    rates = ", ".join(f"B={k} {r['tokens_per_s']:.1f} ({r['vs_layer_split']:.2f}x layer split)"
                      for k, r in b["batches"].items())
    stop = b["stops_paying_at"]
    return [f"batches    {rates}; the layer split is faster from B={stop}" if stop else
            f"batches    {rates}; ahead of the layer split up to B=64"]


def human_moe_summary(s: PlacementSummary, run_dir: str) -> str:
    x, g, sv, b = s.experts, s.memory.gpu, s.solver, s.budget
    base = x.baselines
    per = sorted(x.gpu_experts_per_layer)
    fixed = ", ".join(f"{k} {format_bytes(v)}" for k, v in g.items() if k not in ("experts", "total", "free") and v)
    partial = sum(y.partial_experts for y in x.layers)
    lines = [
        f"model      {s.model}  ({len(x.layers)} layers x {x.n_experts} experts, top-{x.n_experts_used}, "
        f"{x.n_ff_exp} neurons each; {x.mode})",
        f"weights    {format_bytes(x.expert_bytes[0])} an expert ({s.flags.dtype}; {x.weights_source})",
        f"fixed GPU  {format_bytes(b.fixed_gpu_bytes)}: {fixed}" if g else "fixed GPU  none (no GPU)",
        f"experts    GPU {format_bytes(g.get('experts', 0))} of budget {format_bytes(b.ffn_budget_bytes)}; "
        f"CPU {format_bytes(s.memory.cpu['experts'])}; per layer {per[0]} .. {per[len(per) // 2]} (median) .. "
        f"{per[-1]} whole experts on the GPU" + (f", {partial} partly" if partial else ""),
        f"routed     {x.gpu_share_routed:.1%} of routed expert work on the GPU"
        + (f" (llama.cpp --n-cpu-moe {base['n_cpu_moe']['n']}: {base['n_cpu_moe']['gpu_share_routed']:.1%}; "
           f"uniform, as many experts: {base['uniform']['gpu_share_routed']:.1%})" if base else ""),
        f"expected   {s.expected_latency_ms:.2f} ms/token = {s.expected_tokens_per_s:.2f} tokens/s"
        + (f" (--n-cpu-moe: {base['n_cpu_moe']['expected_latency_ms']:.2f} ms)" if base else "")
        + "; cost-model floor, not a measurement",
        f"solver     {sv.backend}, objective {sv.objective}: {sv.status}, gap {sv.gap:.2e}, {sv.variables} variables, "
        f"build {sv.build_seconds:.2f} s + solve {sv.solve_seconds:.2f} s",
        f"wrote      {run_dir}/placement/{{experts.parquet, "
        f"{'placement.parquet, ' if x.mode != 'whole experts' else ''}summary.json, meta.json}}",
    ]
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
