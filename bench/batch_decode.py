"""Batched decoding's aggregate rate, as llama.cpp's `llama-batched-bench` measures its own (bench_70b_baselines.
batched_bench): B sequences, each its own prompt of --prompt random tokens prefilled into its slot, then --gen
tokens each decoded together by runtime/batch.step_batch (greedy); S_TG = B gen / the decode's seconds. Beside it,
batch 1 through generate() (CUDA graphs where the runtime has them): what one user gets, and what pi-serve
--parallel 1 serves. The cold rows' union per B (UnionStats) goes in the results file too.

    python -m bench.batch_decode --run RUN --device cuda --vram 24GiB --batches 1,2,4,8 --out results.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np


def measure(rt, batches: list[int], prompt: int, gen: int, seed: int = 0) -> dict:
    import torch
    from hotneurons.runtime.batch import UnionStats, step_batch
    from hotneurons.runtime.generate import generate, sync

    rng = np.random.default_rng(seed)
    vocab, dec = rt.lm.info["vocab_size"], rt.lm.decoder
    dec.add_slots(max(dec.n_slots, max(batches)))
    ids = [rng.integers(0, vocab, prompt).tolist() for _ in range(max(batches))]
    one = generate(rt, ids[0], gen, stop_at_eos=False).stats  # compiles and warms; then timed
    one = generate(rt, ids[0], gen, stop_at_eos=False).stats
    out: dict = {"prompt": prompt, "gen": gen, "batch1_generate": {k: one[k] for k in (
        "decode_tokens_per_s", "prefill_tokens_per_s", "decode_step_ms_median")}, "batches": {}}
    stats = UnionStats()
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
            t0 = time.perf_counter()
            for i in range(gen - 1):
                lg = step_batch(rt, toks, [prompt + i] * B, list(range(B)), stats)  # (B, vocab)
                toks = lg.argmax(-1).tolist()
            sync(rt.device)
            t_tg = time.perf_counter() - t0
        out["batches"][str(B)] = {"decode_tok_s": B * (gen - 1) / t_tg, "prefill_tok_s": B * prompt / t_pp,
                                  "decode_s": t_tg, "prefill_s": t_pp}
    out["union"] = stats.summary()
    return out


def main(argv: list[str] | None = None) -> dict:
    from hotneurons.common.units import parse_bytes
    from hotneurons.runtime.generate import RuntimeConfig
    from hotneurons.runtime.load import load_runtime

    from bench.record import write_result

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, default=None, help="a run directory (pi-profile, pi-solve, predictors)")
    ap.add_argument("--model", default=None, help="a model file or folder, without a run")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vram", default=None)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    cfg = RuntimeConfig(device=a.device, vram=parse_bytes(a.vram) if a.vram else None, ctx=a.ctx)
    rt = load_runtime(a.run, cfg, model=a.model)
    figures = measure(rt, [int(b) for b in a.batches.split(",")], a.prompt, a.gen)
    one = figures["batch1_generate"]["decode_tokens_per_s"]
    for B, r in figures["batches"].items():
        print(f"B={B}: {r['decode_tok_s']:.1f} tok/s decode in all ({r['decode_tok_s'] / one:.2f}x batch 1's "
              f"{one:.1f}), prefill {r['prefill_tok_s']:.0f} tok/s")
    write_result(a.out, {**figures, "run": str(a.run), "model": a.model, "device": a.device, "vram": a.vram})
    return figures


if __name__ == "__main__":
    main()
