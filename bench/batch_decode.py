"""Batched decoding's aggregate rate, as llama.cpp's `llama-batched-bench` measures its own (bench_70b_baselines.
batched_bench): B sequences, each its own prompt of --prompt random tokens prefilled into its slot, then --gen
tokens each decoded together by runtime/batch.step_batch (greedy); S_TG = B gen / the decode's seconds. Beside it,
batch 1 through generate() (CUDA graphs where the runtime has them): what one user gets, and what pi-serve
--parallel 1 serves. The cold rows' union per B (UnionStats) goes in the results file too.

    python -m bench.batch_decode --run RUN --device cuda --vram 24GiB --batches 1,2,4,8 --out ours.json
    python -m bench.batch_decode --llama-batched-bench BIN --gguf F --ngl 50 --out llama.json   # alone, after
    python -m bench.batch_decode --report ours.json llama.json --out results.json                 # one table

Each system runs in its own process, one after the other (the other's memory freed). The per-step time at B over
batch 1's is the inter-token latency each stream sees, without a server's overheads.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def measure(rt, batches: list[int], prompt: int, gen: int, seed: int = 0,
            steps: tuple[str, ...] = ("batched",)) -> dict:
    """Per step kind (runtime/batch.BatchStep: batched -> figures["batches"], interleaved -> figures["interleaved"])
    and B: the aggregate decode and prefill rates."""
    import torch
    from hotneurons.runtime.batch import UnionStats, batch_step
    from hotneurons.runtime.generate import generate, sync

    rng = np.random.default_rng(seed)
    vocab, dec = rt.lm.info["vocab_size"], rt.lm.decoder
    dec.add_slots(max(dec.n_slots, max(batches)))
    ids = [rng.integers(0, vocab, prompt).tolist() for _ in range(max(batches))]
    one = generate(rt, ids[0], gen, stop_at_eos=False).stats  # compiles and warms; then timed
    one = generate(rt, ids[0], gen, stop_at_eos=False).stats
    out: dict = {"prompt": prompt, "gen": gen, "steps": list(steps), "batch1_generate": {k: one[k] for k in (
        "decode_tokens_per_s", "prefill_tokens_per_s", "decode_step_ms_median")}}
    stats = UnionStats()
    for kind in steps:
        step = batch_step(rt, kind)
        rows = out["batches" if kind == "batched" else kind] = {}
        for B in batches:
            with torch.inference_mode():
                t0 = time.perf_counter()
                logits = []
                for b in range(B):
                    with dec.slot(b):
                        logits.append(rt.lm.prefill(rt, ids[b]))
                sync(rt.device)
                t_pp = time.perf_counter() - t0
                toks = [int(torch.argmax(lg)) for lg in logits]
                for i in range(3):  # compiles this B's shapes (Triton, Numba); the timed steps write these slots again
                    step(toks, [prompt + i] * B, list(range(B)))
                sync(rt.device)
                t0 = time.perf_counter()
                for i in range(gen - 1):
                    lg = step(toks, [prompt + i] * B, list(range(B)), stats if kind == "batched" else None)
                    toks = lg.argmax(-1).tolist()  # (B,)
                sync(rt.device)
                t_tg = time.perf_counter() - t0
            rows[str(B)] = {"decode_tok_s": B * (gen - 1) / t_tg, "prefill_tok_s": B * prompt / t_pp,
                            "decode_s": t_tg, "prefill_s": t_pp}
    out["union"] = stats.summary()
    return out


def report(ours: dict, llama: dict | None) -> dict:
    """Both systems' rates per B side by side: ours over batch 1's (the aggregate's growth), the step time over batch
    1's (each stream's inter-token latency), ours over llama.cpp's at the same B."""
    one = ours["batch1_generate"]["decode_tokens_per_s"]  # the batch-1 runtime (graphs where it has them)
    rows = {}
    for B, r in ours["batches"].items():
        row = {"ours_decode_tok_s": r["decode_tok_s"], "ours_over_batch1": r["decode_tok_s"] / one,
               "step_ms": 1e3 * int(B) / r["decode_tok_s"], "itl_over_batch1": one * int(B) / r["decode_tok_s"],
               "ours_prefill_tok_s": r["prefill_tok_s"]}
        inter = ours.get("interleaved", {}).get(B)
        if inter:
            row |= {"interleaved_decode_tok_s": inter["decode_tok_s"],
                    "interleaved_over_batch1": inter["decode_tok_s"] / one}
        theirs = (llama or {}).get("batches", {}).get(B)
        if theirs:
            row |= {"llamacpp_decode_tok_s": theirs["decode_tok_s"],
                    "ours_over_llamacpp": r["decode_tok_s"] / theirs["decode_tok_s"]}
            if inter:
                row["interleaved_over_llamacpp"] = inter["decode_tok_s"] / theirs["decode_tok_s"]
        rows[B] = row
    return {"rows": rows, "union": ours.get("union"), "ours": ours, "llamacpp": llama}


def runtime_args(ap: argparse.ArgumentParser) -> None:
    """The arguments `load` reads."""
    ap.add_argument("--run", type=Path, default=None, help="a run directory (pi-profile, pi-solve, predictors)")
    ap.add_argument("--model", default=None, help="a model file or folder, without a run")
    ap.add_argument("--moe-dir", type=Path, default=None, help="a bench_moe variant's folder: its model.gguf at "
                    "pi-solve's expert placement and budget, as bench_moe's ours stage loads it")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vram", default=None)
    ap.add_argument("--ctx", type=int, default=1024)


def load(a: argparse.Namespace):
    """The runtime the arguments name: --run (or --model alone) at --vram, or --moe-dir's model.gguf at pi-solve's
    expert placement and budget, as bench_moe's ours stage loads it; --device, --ctx."""
    from hotneurons.common.units import parse_bytes
    from hotneurons.runtime.generate import RuntimeConfig
    from hotneurons.runtime.load import load_runtime, load_source_runtime

    if a.moe_dir:
        from bench.bench_moe import expert_mask

        pipe = json.loads((a.moe_dir / "pipeline.json").read_text())["figures"]
        cfg = RuntimeConfig(device=a.device, vram=pipe["vram_bytes"], ctx=a.ctx)
        return load_source_runtime(None, None, cfg, model=str(a.moe_dir / "model.gguf"),
                                   placement=expert_mask(a.moe_dir / "run"))
    cfg = RuntimeConfig(device=a.device, vram=parse_bytes(a.vram) if a.vram else None, ctx=a.ctx)
    return load_runtime(a.run, cfg, model=a.model)


def main(argv: list[str] | None = None) -> dict:
    from bench.record import write_result

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    runtime_args(ap)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--steps", default="batched,interleaved", help="runtime/batch.BatchStep kinds to time")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--llama-batched-bench", default=None, help="instead of ours: this llama-batched-bench "
                    "binary on --gguf, the first --ngl layers on the GPU (--n-cpu-moe N: the first N's experts on "
                    "the CPU)")
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--ngl", type=int, default=99)
    ap.add_argument("--n-cpu-moe", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp's threads (default: every core)")
    ap.add_argument("--commit", default=None, help="the checkout's commit, where its .git is stale or missing")
    ap.add_argument("--report", nargs=2, type=Path, default=None, metavar=("OURS", "LLAMA"),
                    help="merge the two systems' files into one table")
    a = ap.parse_args(argv)
    if a.report:
        from bench.record import read

        ours, llama = (read(f) for f in a.report)
        figures = report(ours["figures"], llama["figures"])
        # where and when each side ran (the header below is ours'): a pairing across calls says so
        figures["records"] = {side: {k: r[k] for k in ("commit", "created", "machine_kind", "command")}
                              for side, r in (("ours", ours), ("llamacpp", llama))}
        for B, r in figures["rows"].items():
            print(f"B={B}: ours {r['ours_decode_tok_s']:.1f} tok/s ({r['ours_over_batch1']:.2f}x batch 1, step "
                  f"{r['itl_over_batch1']:.2f}x), interleaved {r.get('interleaved_decode_tok_s', float('nan')):.1f}, "
                  f"llama.cpp {r.get('llamacpp_decode_tok_s', float('nan')):.2f}")
        write_result(a.out, figures, machine_info=ours["machine"], kind=ours["machine_kind"], commit=ours["commit"])
        return figures
    if a.llama_batched_bench:
        import os

        from bench.bench_70b_baselines import batched_bench

        extra = ("--n-cpu-moe", str(a.n_cpu_moe)) if a.n_cpu_moe is not None else ()
        figures = batched_bench(a.llama_batched_bench, a.gguf, a.ngl, a.threads or os.cpu_count() or 4, a.batches,
                                a.prompt, a.gen, extra=extra)
        print(json.dumps({B: r["decode_tok_s"] for B, r in figures.get("batches", {}).items()}) if "batches" in
              figures else figures.get("error"))
        write_result(a.out, figures, commit=a.commit)
        return figures
    rt = load(a)
    figures = measure(rt, [int(b) for b in a.batches.split(",")], a.prompt, a.gen, steps=tuple(a.steps.split(",")))
    with open("/proc/self/status") as f:
        figures["host_hwm_bytes"] = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM"))
    if a.device.startswith("cuda"):
        import torch

        figures["gpu_max_reserved_bytes"] = torch.cuda.max_memory_reserved()
    one = figures["batch1_generate"]["decode_tokens_per_s"]
    for B, r in figures["batches"].items():
        inter = figures.get("interleaved", {}).get(B, {}).get("decode_tok_s", float("nan"))
        print(f"B={B}: {r['decode_tok_s']:.1f} tok/s decode in all ({r['decode_tok_s'] / one:.2f}x batch 1's "
              f"{one:.1f}), interleaved {inter:.1f}, prefill {r['prefill_tok_s']:.0f} tok/s")
    write_result(a.out, {**figures, "run": str(a.run), "model": a.model, "device": a.device, "vram": a.vram,
                         "ctx": a.ctx}, commit=a.commit)
    return figures


if __name__ == "__main__":
    main()
