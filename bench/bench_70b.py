"""The whole LLaMA-2-70B-shaped model at 4 bits in a 24 GiB GPU budget: our pipeline as a user runs it, against
llama.cpp on the same Q4_0 GGUF. RANDOM weights with calibrated firing (bench_gguf.py: 10% of FFN neurons active per
token, the top 20% covering 80% of firings) and exact predictors: speed and memory, not quality.

Stages, each within one 10-minute call on the GPU machine, sharing --work (local disk) while the machine stays up:
  build     the model into WORK/model.gguf layer by layer (bench_gguf.write_model) and a text corpus
  pipeline  pi-profile (layer by layer, no samples), the exact predictors installed into WORK/run, pi-solve --vram
  ours      pi-generate's runtime in a child process: load to the first token, prefill of a 512-token prompt, decode
            over 32 and 256 tokens; the child's peak host memory (/proc) and GPU memory (the driver's, per process)
  llamacpp  llama.cpp built from .llamacpp/ (CUDA), llama-bench on the same file: the most layers whose measured GPU
            memory, plus the KV cache of --ctx tokens that ours holds, fits --vram (probed up or down from the
            arithmetic's count), every layer on the GPU, the CPU alone (GPUs hidden)
  powerinfer  pi-export of the run (PowerInfer's Q4_0 format, our placement as its split, the same predictors at
            threshold 0) into --pwri-dir, PowerInfer's CUDA main built, its decode at --vram (every core, 2 threads)
  report    the stage files (--inputs, or WORK/<stage>.json) into bench/results/<date>-<kind>-llama70b.{json,md}
CPU smoke run: --device cpu --shape tiny --layers 2 --ctx 1024 --vram 1100MiB --hardware rtx4090 (every stage;
llamacpp with --llama-bench of a CPU build).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

PROMPT_SHORT, PROMPT_LONG = 16, 512  # tokens: the decode runs' prompt, the prefill run's


def _tool(name: str) -> str:
    from bench.memory import tool

    return tool(name)


def _run(cmd: list[str], timeout: float) -> dict:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    row = {"command": " ".join(cmd), "seconds": round(time.perf_counter() - t0, 2), "returncode": r.returncode}
    if r.returncode:
        raise SystemExit(f"{cmd[0]} failed ({r.returncode}):\n{(r.stderr or r.stdout)[-3000:]}")
    return {**row, "stdout": r.stdout}


def measured(argv: list[str], timeout: float, pattern: str | None = None) -> dict:
    """Run argv with its host memory (bench/memory_probe.Monitor) and GPU memory (GpuMemory) sampled."""
    from bench.memory_probe import GpuMemory, Monitor

    with Monitor(argv, first_output=pattern) as m, GpuMemory(m.proc.pid) as g:
        res = m.wait(timeout)
    return {**res.to_dict(), "gpu_peak_bytes": g.peak}


# ---------------------------------------------------------------------------------------------------------------
# Stages


def stage_build(a) -> dict:
    from bench import memory_models as mm
    from bench.bench_gguf import write_model

    t0 = time.perf_counter()
    info = write_model(a.shape, a.layers, a.work / "model.gguf", a.device, seed=a.seed,
                       calibration_tokens=a.calibration_tokens, rank=a.gate_rank)
    mm.write_corpus(a.work / "corpus.txt", 8 * a.profile_tokens)
    return {**info, "build_s": round(time.perf_counter() - t0, 1)}


def install_predictors(run: Path, gguf: Path) -> dict:
    """The exact predictors written beside the model (bench_gguf) as RUN/predictors, for RUN's model and profile."""
    from hotneurons.models.family import adapter_for
    from hotneurons.models.open import model_info, open_model
    from safetensors.torch import load_file

    from tests import tiny

    source, sid, _, act = open_model(str(gguf))
    ad = adapter_for(source.config)
    info = model_info(source, sid, act, ad.name, ad.gated)
    tensors = load_file(str(gguf.with_suffix(".predictors.safetensors")))
    tiny.write_predictors(run, info, 0.0, tensors=tensors)
    return {"bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "hidden": int(tensors["layers.0.fc1.weight"].shape[0])}


def stage_pipeline(a) -> dict:
    import shutil

    run, gguf = a.work / "run", a.work / "model.gguf"
    shutil.rmtree(run, ignore_errors=True)
    rows = {"profile": _run([_tool("pi-profile"), "--model", str(gguf), "--out", str(run), "--dataset",
                             str(a.work / "corpus.txt"), "--tokens", str(a.profile_tokens), "--seq-len", "512",
                             "--samples-per-layer", "0", "--device", a.device, "--quiet"], 560)}
    rows["predictors"] = install_predictors(run, gguf)
    solve = _run([_tool("pi-solve"), "--run", str(run), "--vram", a.vram, "--dtype", "q4_0", "--cold-dtype", "q4_0",
                  "--ctx", str(a.ctx), "--hardware", a.hardware, "--reserve", a.reserve, "--json",
                  "--predictor-dtype", a.predictor_dtype]
                 + (["--measure"] if a.measure else []), 300)
    rows["solve"] = {**solve, "summary": json.loads(solve.pop("stdout"))}
    rows["profile"].pop("stdout")
    return rows


def stage_ours(a) -> dict:
    argv = [sys.executable, "-m", "bench.bench_70b", "--stage", "ours-child", "--work", str(a.work),
            "--device", a.device, "--vram", a.vram, "--ctx", str(a.ctx), "--timeline", str(a.timeline)]
    argv += ["--threads", str(a.threads)] if a.threads else []
    argv += ["--pcie-share", str(a.pcie_share)] if a.pcie_share is not None else []
    res = measured(argv, 560, pattern=r"first token")
    if res["exit_code"] != 0:
        raise SystemExit(f"the runtime's child failed:\n{res['stderr_tail'][-3000:]}")
    child = json.loads((a.work / "ours-child.json").read_text())
    return {**child, "load_to_first_token_s": res["first_output_s"], "host_peak_rss_bytes": res["peak_rss_bytes"],
            "host_peak_anon_bytes": res["peak_anon_bytes"], "gpu_peak_bytes": res["gpu_peak_bytes"],
            "host_hwm_bytes": res["hwm_bytes"],  # the largest process's own peak
            "gguf_bytes": (a.work / "model.gguf").stat().st_size}


def ours_child(a, load=None, out: Path | None = None) -> None:
    """In its own process (what stage_ours measures): the runtime as pi-generate loads it (or as `load()` does), then
    its runs, written to `out` (default WORK/ours-child.json)."""
    from hotneurons.common.units import parse_bytes
    from hotneurons.runtime.generate import RuntimeConfig, generate
    from hotneurons.runtime.load import load_runtime

    rt = (load() if load is not None
          else load_runtime(a.work / "run", RuntimeConfig(device=a.device, vram=parse_bytes(a.vram), ctx=a.ctx,
                                                          threads=a.threads, pcie_share=a.pcie_share)))
    import numpy as np

    ids = np.random.default_rng(0).integers(0, rt.lm.info["vocab_size"], PROMPT_LONG).tolist()  # random tokens
    short = ids[:PROMPT_SHORT]
    import torch

    def gpu_mem() -> dict:  # torch's own figures beside the driver's: what the tensors hold, what it keeps cached;
        # and the process's resident host memory at that point (where a peak comes from)
        with open("/proc/self/status") as f:
            host = {k: int(v.split()[0]) << 10 for k, v in (line.split(":", 1) for line in f)
                    if k in ("RssAnon", "RssFile", "RssShmem")}
        if a.device != "cuda":
            return {"host": host}
        return {"allocated": torch.cuda.memory_allocated(), "max_allocated": torch.cuda.max_memory_allocated(),
                "reserved": torch.cuda.memory_reserved(), "max_reserved": torch.cuda.max_memory_reserved(),
                "host": host}

    mem = {"loaded": gpu_mem()}
    first = generate(rt, short, 1, stop_at_eos=False)
    print("first token", flush=True)
    mem["first_token"] = gpu_mem()
    rows = {"first": first.stats}
    # the runtime's own tuning (the PCIe share's calibration and balancing rounds, graph captures) runs over its
    # first decode steps: timed apart, so that the decode figures are the steady state a served model runs at
    from hotneurons.runtime.balance import TUNING_TOKENS

    rows["tuning"] = generate(rt, short, TUNING_TOKENS + 8, stop_at_eos=False).stats
    mem["tuned"] = gpu_mem()
    for n in (32, 256):
        rows[f"decode_{n}"] = generate(rt, short, n, stop_at_eos=False).stats
    mem["decode"] = gpu_mem()
    rows["prefill_512"] = generate(rt, ids, 2, stop_at_eos=False).stats
    mem["prefill"] = gpu_mem()
    if a.timeline and rt.fast is not None and a.device == "cuda":  # where a step's time goes (after the timed runs)
        from bench.bench_timeline import step_timeline

        try:  # a diagnostic: its failure must not cost the figures above
            rows["timeline"] = step_timeline(rt, short, a.timeline)
        except Exception as e:
            rows["timeline"] = {"error": f"{type(e).__name__}: {e}"}
    res = {"decode_tok_s": {str(n): rows[f"decode_{n}"]["decode_tokens_per_s"] for n in (32, 256)},
           "prefill_tok_s": rows["prefill_512"]["prefill_tokens_per_s"],
           "gpu_activation_share": rows["decode_256"]["gpu_activation_share"],
           "ffn_sparsity": rows["decode_256"]["ffn_sparsity"], "bytes_gpu": rt.bytes_gpu, "bytes_cpu": rt.bytes_cpu,
           "torch_gpu_bytes": mem, "runs": rows}
    path = out or a.work / "ours-child.json"
    path.write_text(json.dumps(res))
    print(f"wrote {path}", flush=True)


SYSTEM_KEYS = ("decode_tok_s", "prefill_tok_s", "load_to_first_token_s", "host_peak_rss_bytes", "gpu_peak_bytes")


def run_cold_rate(ours: dict, bytes_per_neuron: float) -> float | None:
    """The cold kernel's rate in the run itself (bytes/s): per balancing round of the 256-token decode, the CPU's rows
    of a layer (its marked neurons less the PCIe share's) over the round's median CPU part; the best round. None where
    the run kept no rounds (no CUDA graphs, no share)."""
    rounds = ours.get("runs", {}).get("decode_256", {}).get("pcie_balance") or []
    rates = [(1.0 - r["share"]) * r["marked"] * bytes_per_neuron / (r["cold_ms_median"] * 1e-3)
             for r in rounds if r.get("cold_ms_median")]
    return max(rates) if rates else None


def serial_floor(pipeline: dict, ours: dict, layers: int) -> dict:
    """The decode floor of this model and placement from the ceilings pi-solve --measure took on the machine: per layer
    its attention and predictor read at the HBM ceiling and one GPU-CPU round trip before the cold rows (an exact
    decoder needs them first), the token's active cold rows (the measured activation share left to the CPU; the
    predictor's extra rows not counted) at the cold kernel's rate, and the LM head. ms, and tok/s. The kernel's rate is
    the faster of pi-solve's (decode-sized calls on random rows) and the run's own median (run_cold_rate): a floor
    priced at a rate the run beats would not be one."""
    s = pipeline["solve"]["summary"]
    hw, gpu = s["hardware"], s["memory"]["gpu"]
    n = s["layers"][0]["neurons"]
    active = (1.0 - ours["ffn_sparsity"]) * n * layers  # neurons a token
    cold_bytes = active * (1.0 - ours["gpu_activation_share"]) * s["memory"]["bytes_per_neuron"]  # bytes a token
    in_run = run_cold_rate(ours, s["memory"]["bytes_per_neuron"])
    rate = max(hw["cpu_bw"], in_run or 0.0)  # bytes/s
    parts = {"attention_and_predictor_ms": 1e3 * (gpu["attention"] + gpu["predictors"]) / hw["gpu_bw"],
             "syncs_ms": 1e3 * layers * hw["sync_latency_s"],
             "cold_rows_ms": 1e3 * cold_bytes / rate,
             "lm_head_ms": 1e3 * gpu["lm_head"] / hw["gpu_bw"]}
    ms = sum(parts.values())
    return {"tok_s": 1e3 / ms, "ms": ms, **parts, "cold_bytes_per_token": cold_bytes,
            "cold_rate_bytes_s": rate, "solver_cold_rate_bytes_s": hw["cpu_bw"], "run_cold_rate_bytes_s": in_run,
            "hbm_bytes_s": hw["gpu_bw"]}


def report(stages: dict[str, dict]) -> dict:
    """The stage files' figures (by stage name) as one record: `systems` keyed by the names printed, each with
    SYSTEM_KEYS (None where not measured), and the goals' ratios."""
    ours, lc = stages["ours"], stages.get("llamacpp", {})
    systems = {"hybrid": {k: ours.get(k) for k in SYSTEM_KEYS} | {"gpu_activation_share": ours["gpu_activation_share"],
                                                                  "ffn_sparsity": ours["ffn_sparsity"]}}
    for name, row in lc.items():
        if name.startswith("llama.cpp") and "error" not in row:
            systems[name] = {k: row.get(k) for k in SYSTEM_KEYS}
    if "powerinfer" in stages:
        from bench.bench_70b_baselines import powerinfer_systems

        systems.update(powerinfer_systems(stages["powerinfer"]))
    split = next((n for n in systems if n.startswith("llama.cpp -ngl")), None)

    def ratio(other: str | None, n: str = "256") -> float | None:
        theirs = systems.get(other, {}).get("decode_tok_s") or {}
        return ours["decode_tok_s"][n] / theirs[n] if theirs.get(n) else None

    layers = stages["build"]["layers"]
    floor = serial_floor(stages["pipeline"], ours, layers) if "solve" in stages["pipeline"] else None
    return {"shape": stages["build"]["shape"], "layers": layers, "gguf_bytes": ours["gguf_bytes"],
            "gpu_budget_bytes": stages["pipeline"]["solve"]["summary"]["flags"]["vram_bytes"],
            "llamacpp_weights_budget_bytes": stages.get("llamacpp", {}).get("budget_for_weights_bytes"),
            "systems": systems, "calibration": stages["build"]["calibration"]["mean_fired_as_stored"],
            "predictor_bytes": stages["pipeline"]["predictors"]["bytes"], "serial_floor": floor,
            "goals": {"decode_vs_layer_split": ratio(split),
                      "decode_vs_all_gpu": ratio("llama.cpp all layers on the GPU"),
                      "decode_vs_powerinfer": ratio("powerinfer"),
                      "host_rss_vs_file": ours["host_peak_rss_bytes"] / ours["gguf_bytes"],
                      "load_to_first_token_s": ours["load_to_first_token_s"],
                      "decode_vs_serial_floor": ours["decode_tok_s"]["256"] / floor["tok_s"] if floor else None,
                      "prefill_vs_layer_split": (ours["prefill_tok_s"] / systems[split]["prefill_tok_s"]
                                                 if split and systems[split].get("prefill_tok_s") else None)}}


def _seconds(s: float | None) -> str:
    return "-" if s is None else f"{s:.0f} s"


def rate_cells(r: dict) -> tuple[str, str]:
    """A system's table cells: decode tok/s over 32 / 256 tokens (and any other count in brackets), prefill tok/s."""
    dec = r.get("decode_tok_s") or {}
    cell = " / ".join(f"{dec[n]:.2f}" if dec.get(n) else "-" for n in ("32", "256"))
    cell += "".join(f" ({v:.2f} over {n})" for n, v in dec.items() if n not in ("32", "256"))
    return cell, "-" if r.get("prefill_tok_s") is None else f"{r['prefill_tok_s']:.0f}"


def markdown(fig: dict) -> str:
    gb = lambda b: "" if b is None else f"{b / 1e9:.1f} GB"  # noqa: E731
    lines = [f"# {fig['shape']} shape, {fig['layers']} layers, Q4_0 GGUF of {gb(fig['gguf_bytes'])}: random weights, "
             f"firing calibrated ({fig['calibration']:.1%} of FFN neurons active), exact predictors", "",
             "| system | decode tok/s (32 / 256) | prefill tok/s (512) | load to first token | host peak RSS | GPU |",
             "|---|---|---|---|---|---|"]
    for name, r in fig["systems"].items():
        cell, pre = rate_cells(r)
        lines.append(f"| {name} | {cell} | {pre} | {_seconds(r['load_to_first_token_s'])} | "
                     f"{gb(r['host_peak_rss_bytes'])} | {gb(r['gpu_peak_bytes'])} |")
    f = fig.get("serial_floor")
    if f:
        lines += ["", f"Serial floor {f['tok_s']:.1f} tok/s ({f['ms']:.2f} ms a token: attention and predictors "
                  f"{f['attention_and_predictor_ms']:.2f}, syncs {f['syncs_ms']:.2f}, cold rows "
                  f"{f['cold_rows_ms']:.2f} ({f['cold_bytes_per_token'] / 1e6:.0f} MB at "
                  f"{f['cold_rate_bytes_s'] / 1e9:.1f} GB/s), LM head {f['lm_head_ms']:.2f})"]
    lines += ["", "Goals: " + ", ".join(f"{k} {v:.2f}" for k, v in fig["goals"].items() if v is not None), ""]
    return "\n".join(lines)


def stage_report(a, stages=None, report_fn=None, markdown_fn=None, name: str = "llama70b") -> dict:
    """The stage files (--inputs, or WORK/<stage>.json) into bench/results/<date>-<kind>-<name>.{json,md} (or --out
    and its .md), by `report_fn` and `markdown_fn` (bench_gated70b.py passes its own; default this bench's)."""
    from bench import record

    files = {Path(f).stem: Path(f) for f in a.inputs} or {s: a.work / f"{s}.json" for s in stages or STAGES}
    recs = {stage: record.read(f) for stage, f in files.items() if f.exists()}
    fig = (report_fn or report)({stage: r["figures"] for stage, r in recs.items()})
    machine = recs["ours"]["machine"]  # where the systems ran, not where the report is made
    kind = record.machine_kind(machine)
    out = Path(a.out or record.ROOT / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}-{kind}-{name}.json")
    record.write_result(out, fig, machine_info=machine, kind=kind, commit=recs["ours"].get("commit"))
    out.with_suffix(".md").write_text((markdown_fn or markdown)(fig))
    return fig


def stage_llamacpp(a) -> dict:
    from bench.bench_70b_baselines import stage_llamacpp

    return stage_llamacpp(a)


def stage_powerinfer(a) -> dict:
    from bench.bench_70b_baselines import stage_powerinfer

    return stage_powerinfer(a)


STAGES = {"build": stage_build, "pipeline": stage_pipeline, "ours": stage_ours, "llamacpp": stage_llamacpp,
          "powerinfer": stage_powerinfer}


def parser(doc: str | None = None, stages: list[str] | None = None) -> argparse.ArgumentParser:
    """The flags of this bench (bench_gated70b.py adds its own to them)."""
    p = argparse.ArgumentParser(description=doc or __doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", required=True, choices=stages or [*STAGES, "report", "ours-child"])
    p.add_argument("--inputs", nargs="*", default=[], help="report: the stage files (default: WORK/<stage>.json).")
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "hotneurons" / "llama70b",
                   help="Local disk for the model (38.8 GB) and the run.")
    p.add_argument("--out", type=Path, default=None, help="The stage's JSON.")
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="llama-2-70b", help="bench_model.SHAPES preset.")
    p.add_argument("--layers", type=int, default=80)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calibration-tokens", type=int, default=2048)
    p.add_argument("--gate-rank", type=int, default=511,
                   help="build: rank of the gate's columns 1..; the exact predictor has 2 * rank + 2 hidden units "
                   "(511: d/8 = 1024, a trained predictor's size at d 8192)")
    p.add_argument("--profile-tokens", type=int, default=4096)
    p.add_argument("--vram", default="24GiB", help="The GPU budget of pi-solve and the runtime.")
    p.add_argument("--reserve", default="2.75GB",
                   help="pipeline: pi-solve's GPU memory kept for what is not a tensor of the model: the CUDA context, "
                   "kernels, graphs, the allocator's cache and a 512-token prefill's activations (measured on the "
                   "70B shape: 2.3-2.5 GB over the tensors' bytes)")
    p.add_argument("--ctx", type=int, default=4096, help="KV cache tokens pi-solve reserves and the runtime holds.")
    p.add_argument("--threads", type=int, default=None,
                   help="ours: the cold kernels' CPU threads (pi-generate --threads; default: every core)")
    p.add_argument("--pcie-share", type=float, default=None,
                   help="ours: the share of the marked cold rows the GPU reads over PCIe, held (pi-generate "
                   "--pcie-share; default: measured at start and balanced)")
    p.add_argument("--predictor-dtype", default="auto", choices=["auto", "q8_0"],
                   help="pipeline: pi-solve --predictor-dtype (the runtime follows the placement)")
    p.add_argument("--hardware", default="h100", help="pi-solve's hardware preset (bandwidths of the cost model).")
    p.add_argument("--no-measure", dest="measure", action="store_false",
                   help="pipeline: pi-solve with the preset's bandwidths instead of this machine's measured ones "
                   "(pi-solve --measure): a preset's faster DRAM makes the cold side look cheap, budget unused")
    p.add_argument("--timeline", type=int, default=0,
                   help="ours: after the timed runs, one more generation of this many tokens with the step's host "
                   "clock on (bench_timeline.step_timeline: per layer, the wait for the GPU and the CPU's cold part)")
    p.add_argument("--pwri-dir", type=Path, default=Path("/dev/shm/pwri70b"),
                   help="powerinfer: where pi-export writes PowerInfer's files (a second 38.8 GB file: the GPU "
                   "machine's disk holds one, its RAM the other)")
    p.add_argument("--powerinfer-src", default=None, help="powerinfer: PowerInfer's source tarball (default: the "
                   "shared one, or .gpu/PowerInfer-src.tgz)")
    p.add_argument("--llama-bench", default=None, help="llamacpp: a built llama-bench (default: build it in --work).")
    return p


def parse(argv=None):
    return parser().parse_args(argv)


def main(argv=None) -> None:
    run(parse(argv), STAGES, ours_child, stage_report, markdown)


def run(a, stages: dict, child, reporter, markdown_fn) -> None:
    """One stage of a bench of this shape (this one's, bench_gated70b's): its figures into --out or WORK/<stage>.json;
    `child` runs ours-child, `reporter` the report stage."""
    a.work.mkdir(parents=True, exist_ok=True)
    if a.stage == "ours-child":
        child(a)
        return
    if a.stage == "report":
        print(markdown_fn(reporter(a)))
        return
    from bench import record

    figures = {"stage": a.stage, "shape": a.shape, "layers": a.layers, **stages[a.stage](a)}
    out = a.out or a.work / f"{a.stage}.json"
    record.write_result(out, figures, machine_info=record.machine("torch", "transformers", "gguf"))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
