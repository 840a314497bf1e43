"""Mixtures of experts at 4 bits in a GPU budget that holds 40% of the experts: our pipeline as a user runs it against
llama.cpp's `-ngl 99 --n-cpu-moe N` on the same Q4_0 GGUF. RANDOM weights, the router calibrated to published
per-expert routing skews (bench/moe_gguf.py, which cites them): speed and memory, not quality.

Variants (each its own folder WORK/<shape>-<routing>[-sparse]): --shape qwen3-30b-a3b | mixtral-8x7b, --routing
calibrated | uniform (the same router calibration without skew: what the placement buys), --sparse (Mixtral's experts
dReLU at TurboSparse-Mixtral's 85% inactive neurons; llama.cpp runs them as SwiGLU, at the same cost: it skips no
neuron). A sparse build's gates are of rank --predictor-rank (32), with exact expert predictors beside the model
(artifacts/expert_predictors.py), which the pipeline puts in the run and ours uses unless --no-expert-predictors.

Stages, each within one 10-minute call on the GPU machine, sharing --work while the machine stays up:
  build     the model (moe_gguf.write_model, layer by layer on the device) and a corpus of random token ids
  pipeline  pi-profile layer by layer (its tokenizer replaced by the ids' reader: bench_model.SyntheticTokenizer, so
            that the profile sees tokens drawn as the calibration's and llama-bench's are), then pi-solve --vram at the
            budget rule (budget_for): every non-expert tensor, the KV cache of --ctx tokens, --reserve, and
            --expert-frac (0.4) of the experts' bytes; the fraction pi-solve placed is recorded
  ours      pi-generate's runtime (load_source_runtime with pi-solve's expert mask) in a child process measured by
            memory_probe: load to the first token, prefill 512 (after one warm-up prefill), decode 32 and 256
            (tokens sampled at --temperature 1: near-uniform ids, as llama-bench decodes random ones; greedy decoding
            of random weights loops); host peak RSS/anon, GPU by the driver; the measured GPU share of routed work
  llamacpp  llama-bench -ngl 99 --n-cpu-moe N, N probed from the arithmetic guess to the smallest whose measured GPU
            memory plus our KV cache of --ctx tokens fits --vram; --n-cpu-moe 0 (everything on the GPU)
  report    the variant's stage files into bench/results/<date>-<kind>-moe-<variant>.{json,md}
  fit-predictors  (--sparse) pi-train-predictors on the run: expert predictors fitted on the experts' inputs,
            replacing the exact ones in the run (the next ours stage runs with them)
CPU smoke run (tests/test_bench_moe.py): --shape tiny --device cpu --vram auto --hardware h100, llamacpp skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

PROMPT_SHORT, PROMPT_LONG = 16, 512  # tokens: the decode runs' prompt, the prefill run's
STAGES = ("build", "pipeline", "ours", "llamacpp")


def variant(a) -> str:
    return f"{a.shape}-{a.routing}" + ("-sparse" if a.sparse else "")


def _dir(a) -> Path:
    return a.work / variant(a)


# ---------------------------------------------------------------------------------------------------------------
# build, pipeline


def stage_build(a) -> dict:
    from bench import bench_model as bm
    from bench.moe_gguf import SHAPES, write_model

    t0 = time.perf_counter()
    info = write_model(a.shape, _dir(a) / "model.gguf", a.device, routing=a.routing, sparse=a.sparse, seed=a.seed,
                       calibration_tokens=a.calibration_tokens, seq=a.seq, predictor_rank=a.predictor_rank)
    bm.synthetic_corpus(_dir(a) / "corpus.txt", a.profile_tokens, SHAPES[a.shape].vocab, a.seed + 2)
    return {**info, "build_s": round(time.perf_counter() - t0, 1)}


def file_bytes(gguf: Path) -> dict:
    """The file's tensor bytes: the routed experts' (ffn_*_exps) and the rest."""
    from hotneurons.weights.gguf_file import GGUFFile

    f = GGUFFile(gguf)
    exps = sum(t.nbytes for n, t in f.tensors.items() if "_exps." in n)
    return {"experts": exps, "other": sum(t.nbytes for t in f.tensors.values()) - exps}


def kv_bytes(shape: str, ctx: int) -> int:
    """fp16 keys and values of `ctx` tokens (what our runtime holds and pi-solve reserves)."""
    from bench.moe_gguf import SHAPES

    s = SHAPES[shape]
    return 2 * s.n_layers * s.n_kv_heads * s.head_dim * ctx * 2


def budget_for(sizes: dict, kv: int, reserve: int, frac: float) -> int:
    """The budget rule: every non-expert tensor (the token embedding too: an upper bound), the KV cache, the reserve,
    and `frac` of the experts' bytes."""
    return int(sizes["other"] + kv + reserve + frac * sizes["experts"])


def _run(cmd: list[str], timeout: float) -> dict:
    import subprocess

    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        raise SystemExit(f"{cmd[0]} failed ({r.returncode}):\n{(r.stderr or r.stdout)[-3000:]}")
    return {"command": " ".join(cmd), "seconds": round(time.perf_counter() - t0, 2), "stdout": r.stdout}


def stage_pipeline(a) -> dict:
    import shutil

    from hotneurons.common.units import parse_bytes

    from bench.memory import tool

    d = _dir(a)
    run, gguf = d / "run", d / "model.gguf"
    shutil.rmtree(run, ignore_errors=True)
    prof = _run([sys.executable, "-m", "bench.bench_moe", "--stage", "profile-child", "--",
                 "--model", str(gguf), "--out", str(run), "--dataset", str(d / "corpus.txt"), "--tokens",
                 str(a.profile_tokens), "--seq-len", str(min(512, a.profile_tokens)), "--samples-per-layer", "0",
                 "--layer-by-layer", "--device", a.device, "--quiet"], 560)
    prof.pop("stdout")
    sizes, kv, reserve = file_bytes(gguf), kv_bytes(a.shape, a.ctx), parse_bytes(a.reserve)
    vram = budget_for(sizes, kv, reserve, a.expert_frac) if a.vram == "auto" else parse_bytes(a.vram)
    rounds = []
    for _ in range(3):  # pi-solve's items (workspace, router's format) differ a little from the rule's: where the
        # fraction it placed falls outside [1/3, 1/2], the budget moves by the difference's bytes and it solves again
        solve = _run([tool("pi-solve"), "--run", str(run), "--vram", f"{vram}B", "--dtype", "q4_0", "--cold-dtype",
                      "q4_0", "--ctx", str(a.ctx), "--hardware", a.hardware, "--reserve", f"{reserve}B",
                      "--expert-neurons", "off", "--time-limit", "120", "--json"]
                     + (["--measure"] if a.device == "cuda" else []), 400)
        summary = json.loads(solve.pop("stdout"))
        gpu = expert_mask(run)
        rounds.append({"vram_bytes": vram, "gpu_expert_fraction": float(gpu.mean()), "seconds": solve["seconds"]})
        if a.vram != "auto" or 1 / 3 <= gpu.mean() <= 1 / 2:
            break
        vram += int((a.expert_frac - gpu.mean()) * sizes["experts"])
    from hotneurons.artifacts.expert_predictors import path_in

    from bench.moe_gguf import predictors_path

    if predictors_path(gguf).exists():  # the build's expert predictors where pi-generate and pi-serve find them
        path_in(run).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(predictors_path(gguf), path_in(run))
    return {"profile": prof, "solve": {**solve, "summary": summary}, "file_bytes": sizes, "kv_bytes": kv,
            "reserve_bytes": reserve, "vram_bytes": vram, "expert_frac_rule": a.expert_frac, "budget_rounds": rounds,
            "gpu_expert_fraction": float(gpu.mean()), "gpu_experts": int(gpu.sum()),
            "routed_shares": routed_shares(run).tolist()}


def expert_mask(run: Path) -> np.ndarray:
    """(layers, experts) bool from pi-solve's placement/experts.parquet: True = wholly on the GPU."""
    import pandas as pd

    df = pd.read_parquet(run / "placement" / "experts.parquet")
    gpu = np.zeros((int(df.layer.max()) + 1, int(df.expert.max()) + 1), bool)
    gpu[df.layer.to_numpy(), df.expert.to_numpy()] = df.gpu.to_numpy()
    return gpu


def routed_shares(run: Path) -> np.ndarray:
    """(layers, experts) the profile's share of each layer's routed picks."""
    import pandas as pd

    df = pd.read_parquet(run / "profile" / "experts.parquet")
    c = np.zeros((int(df.layer.max()) + 1, int(df.expert.max()) + 1))
    c[df.layer.to_numpy(), df.expert.to_numpy()] = df["count"].to_numpy()
    return c / c.sum(1, keepdims=True)


def n_cpu_moe_share(shares: np.ndarray, n: int) -> float:
    """llama.cpp --n-cpu-moe N's GPU share of routed work on the profile: the layers past the first N, all experts."""
    return float(shares[n:].sum() / shares.sum())


def profile_child(argv: list[str], command: str = "pi-profile") -> None:
    """pi-profile (or pi-train-predictors), with the file's tokenizer replaced by bench_model.SyntheticTokenizer (the
    corpus is token ids)."""
    from hotneurons.predictors.cli import train_main
    from hotneurons.profiler.cli import main as pi_profile
    from hotneurons.weights.gguf_source import GGUFSource

    from bench import bench_model as bm

    GGUFSource.tokenizer = lambda self: bm.SyntheticTokenizer(self.infos["token_embd.weight"].shape[0])
    (train_main if command == "pi-train-predictors" else pi_profile)(argv)


def stage_fit_predictors(a) -> dict:
    """pi-train-predictors on the run (a --sparse variant): expert predictors fitted from the gates on the experts'
    routed inputs (predictors/experts_fit.py), replacing the build's exact ones in the run for the next ours stage."""
    res = _run([sys.executable, "-m", "bench.bench_moe", "--stage", "fit-child", "--", "--run", str(_dir(a) / "run"),
                "--expert-rank", str(a.predictor_rank), "--device", a.device, "--json", "--quiet"], 560)
    out = res.pop("stdout")
    return {**res, "summary": json.loads(out[out.index("{"):])}


# ---------------------------------------------------------------------------------------------------------------
# ours


def stage_ours(a) -> dict:
    from bench.bench_70b import measured

    argv = [sys.executable, "-m", "bench.bench_moe", "--stage", "ours-child", "--work", str(a.work),
            "--shape", a.shape, "--routing", a.routing, "--device", a.device, "--ctx", str(a.ctx),
            "--temperature", str(a.temperature)] + (["--sparse"] if a.sparse else [])
    argv += [] if a.expert_predictors else ["--no-expert-predictors"]
    res = measured(argv, 560, pattern=r"first token")
    if res["exit_code"] != 0:
        raise SystemExit(f"the runtime's child failed:\n{res['stderr_tail'][-3000:]}")
    child = json.loads((_dir(a) / "ours-child.json").read_text())
    return {**child, "load_to_first_token_s": res["first_output_s"], "host_peak_rss_bytes": res["peak_rss_bytes"],
            "host_peak_anon_bytes": res["peak_anon_bytes"], "gpu_peak_bytes": res["gpu_peak_bytes"],
            "host_hwm_bytes": res["hwm_bytes"], "gguf_bytes": (_dir(a) / "model.gguf").stat().st_size}


def ours_child(a) -> None:
    """In its own process (what stage_ours measures): the runtime as pi-generate loads it, pi-solve's expert mask."""
    from hotneurons.runtime.generate import RuntimeConfig, generate
    from hotneurons.runtime.load import load_source_runtime
    from hotneurons.runtime.sampling import Sampling

    d = _dir(a)
    pipe = json.loads((d / "pipeline.json").read_text())["figures"]
    # the budget is the GPU's: a CPU run (the smoke test) holds its "device" experts in RAM, de-quantized
    cfg = RuntimeConfig(device=a.device, vram=pipe["vram_bytes"] if a.device == "cuda" else None, ctx=a.ctx)
    rt = load_source_runtime(None, None, cfg, model=str(d / "model.gguf"), placement=expert_mask(d / "run"))
    from hotneurons.artifacts.expert_predictors import path_in
    from hotneurons.runtime.expert_predictors import attach

    if a.expert_predictors and path_in(d / "run").exists():  # as pi-generate finds them in the run
        rt.expert_predictors = attach(rt.ffns, path_in(d / "run"))
    ids = np.random.default_rng(0).integers(0, rt.lm.info["vocab_size"], PROMPT_LONG).tolist()  # random tokens
    short, samp = ids[:PROMPT_SHORT], Sampling(temperature=a.temperature, seed=0)
    first = generate(rt, short, 1, samp, stop_at_eos=False)
    print("first token", flush=True)
    rows = {"first": first.stats, "warmup": generate(rt, short, 16, samp, stop_at_eos=False).stats}
    for n in (32, 256):
        rows[f"decode_{n}"] = generate(rt, short, n, samp, stop_at_eos=False).stats
    # a first long prompt compiles the prefill's kernels (Triton) at their shapes; llama-bench warms up alike
    rows["prefill_512_warmup"] = generate(rt, ids, 2, samp, stop_at_eos=False).stats
    rows["prefill_512"] = generate(rt, ids, 2, samp, stop_at_eos=False).stats
    out = {"decode_tok_s": {str(n): rows[f"decode_{n}"]["decode_tokens_per_s"] for n in (32, 256)},
           "prefill_tok_s": rows["prefill_512"]["prefill_tokens_per_s"],
           "gpu_share_routed_measured": rows["decode_256"]["gpu_activation_share"],
           "gpu_share_routed_prefill": rows["prefill_512"]["gpu_activation_share"],
           # sparse (ReLU-family) experts: the share of the routed cold experts' neurons that fired in decode
           "cold_firing_share": (rows["decode_256"].get("experts") or {}).get("cold_firing_share"),
           "bytes_gpu": rt.bytes_gpu, "bytes_cpu": rt.bytes_cpu, "expert_predictors": rt.expert_predictors,
           "runs": rows}
    (d / "ours-child.json").write_text(json.dumps(out, default=float))
    print(f"wrote {d / 'ours-child.json'}", flush=True)


# ---------------------------------------------------------------------------------------------------------------
# llama.cpp


def llama_bench(binary: str, gguf: Path, ncmoe: int, threads: int, gen: str, prompt: int,
                timeout: float = 500) -> dict:
    """One `llama-bench -ngl 99 --n-cpu-moe N` process: tokens/s per test, peak host and GPU (driver) memory."""
    from bench.bench_70b_baselines import llama_bench as run

    row = run(binary, gguf, 99, threads, gen, prompt, timeout=timeout, extra=("--n-cpu-moe", str(ncmoe)))
    return {"n_cpu_moe": ncmoe, **{k: v for k, v in row.items() if k != "ngl"}}


def smallest_fitting(probe, guess: int, layers: int, budget: int) -> tuple[int | None, dict]:
    """The smallest N in [0, layers] whose probe(N) ran and measured GPU memory <= budget, walking from `guess` (more
    layers' experts on the CPU lower the GPU's bytes: fits(N) is monotone in N). Returns (N or None, the probes)."""
    runs: dict[int, dict] = {}

    def fits(n: int) -> bool:
        if n not in runs:
            runs[n] = probe(n)
        return "error" not in runs[n] and runs[n]["gpu_peak_bytes"] <= budget

    n = min(max(guess, 0), layers)
    if fits(n):
        while n > 0 and fits(n - 1):
            n -= 1
        return n, runs
    while n < layers:
        n += 1
        if fits(n):
            return n, runs
    return None, runs


def stage_llamacpp(a) -> dict:
    from bench import bench_llamacpp as lcpp
    from bench.moe_gguf import SHAPES

    d = _dir(a)
    gguf, layers = d / "model.gguf", SHAPES[a.shape].n_layers
    pipe = json.loads((d / "pipeline.json").read_text())["figures"]
    built = lcpp.build(a.work, a.device == "cuda", os.cpu_count() or 4) if a.llama_bench is None else {
        "binary": a.llama_bench}
    binary, threads = built["binary"], os.cpu_count() or 4
    budget = pipe["vram_bytes"] - pipe["kv_bytes"]  # llama-bench's own cache holds only its prompt and generation
    sizes = pipe["file_bytes"]
    per_layer = sizes["experts"] / layers
    room = budget - sizes["other"] - parse_reserve(a)  # for experts, after the rest and a CUDA context's worth
    guess = int(np.clip(math.ceil(layers - room / per_layer), 0, layers))
    n, probes = smallest_fitting(lambda k: llama_bench(binary, gguf, k, threads, "8", 0), guess, layers, budget)
    rows: dict = {"build": built, "budget_for_weights_bytes": budget, "guess": guess, "probes": probes, "n_cpu_moe": n}
    systems = ([(f"llama.cpp -ngl 99 --n-cpu-moe {n}", n)] if n is not None else []) + [
        ("llama.cpp all on the GPU", 0)]
    for name, k in systems:
        row = llama_bench(binary, gguf, k, threads, "32,256", PROMPT_LONG)
        if "error" not in row:  # llama-bench prints no load time: the wall time of load, a warm-up and one token
            one = llama_bench(binary, gguf, k, threads, "1", 0)
            row["load_to_first_token_s"] = None if "error" in one else round(one["seconds"], 2)
        rows[name] = row
    if n is not None:
        rows["gpu_share_routed"] = n_cpu_moe_share(np.asarray(pipe["routed_shares"]), n)
    return rows


def parse_reserve(a) -> int:
    from hotneurons.common.units import parse_bytes

    return parse_bytes(a.reserve)


# ---------------------------------------------------------------------------------------------------------------
# report


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] in (["--stage", "profile-child"], ["--stage", "fit-child"]):
        profile_child(argv[3:] if argv[2:3] == ["--"] else argv[2:],
                      "pi-train-predictors" if argv[1] == "fit-child" else "pi-profile")
        return
    a = parse(argv)
    _dir(a).mkdir(parents=True, exist_ok=True)
    if a.stage == "ours-child":
        ours_child(a)
        return
    from bench import bench_moe_report as rep
    from bench import record

    if a.stage == "report":
        print(rep.markdown(rep.stage_report(a, _dir(a), variant(a))))
        return
    fn = {"build": stage_build, "pipeline": stage_pipeline, "ours": stage_ours, "llamacpp": stage_llamacpp,
          "fit-predictors": stage_fit_predictors}[a.stage]
    figures = {"stage": a.stage, "variant": variant(a), "shape": a.shape, "routing": a.routing, "sparse": a.sparse,
               **fn(a)}
    out = a.out or _dir(a) / f"{a.stage}.json"
    record.write_result(out, figures, machine_info=record.machine("torch", "transformers", "gguf"))
    print(f"wrote {out}", file=sys.stderr)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", required=True, choices=[*STAGES, "fit-predictors", "report", "ours-child"])
    p.add_argument("--shape", default="qwen3-30b-a3b", help="moe_gguf.SHAPES: qwen3-30b-a3b, mixtral-8x7b, tiny.")
    p.add_argument("--routing", default="calibrated", choices=["calibrated", "uniform"])
    p.add_argument("--sparse", action="store_true", help="dReLU experts at TurboSparse-Mixtral's sparsity.")
    p.add_argument("--predictor-rank", type=int, default=32,
                   help="build, --sparse: every expert's gate of this rank, exact expert predictors (rank + 1) beside "
                   "the model (0: full-rank gates, no predictors).")
    p.add_argument("--no-expert-predictors", dest="expert_predictors", action="store_false",
                   help="ours: the cold experts read every gate row (the predictors beside the model unused).")
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "hotneurons" / "moe",
                   help="Local disk: WORK/<variant>/ holds the model (17 GB Qwen3, 26 GB Mixtral) and the run.")
    p.add_argument("--out", type=Path, default=None, help="The stage's JSON (report: the results file).")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calibration-tokens", type=int, default=4096)
    p.add_argument("--seq", type=int, default=256, help="build: calibration sequence length.")
    p.add_argument("--profile-tokens", type=int, default=8192)
    p.add_argument("--vram", default="auto", help="The GPU budget; auto: the budget rule (budget_for).")
    p.add_argument("--expert-frac", type=float, default=0.4,
                   help="auto budget: the share of the experts' bytes it holds (between a third and a half).")
    p.add_argument("--reserve", default="2.5GB", help="GPU memory kept for what is not a tensor (the CUDA context, "
                   "allocator cache, activations): pi-solve's --reserve and the budget rule's")
    p.add_argument("--ctx", type=int, default=4096, help="KV cache tokens pi-solve reserves and the runtime holds.")
    p.add_argument("--hardware", default="h100", help="pi-solve's hardware preset.")
    p.add_argument("--temperature", type=float, default=1.0, help="ours: decode sampling temperature.")
    p.add_argument("--llama-bench", default=None, help="llamacpp: a built llama-bench (default: build it in WORK).")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
