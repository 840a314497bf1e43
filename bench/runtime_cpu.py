"""pi-generate decode speed on this machine's CPU: dense vs hybrid (predictors) on a run, e.g. `make demo`'s.

Usage: python -m bench.runtime_cpu [--run runs/demo] [--tokens 64] [--reps 3]
                          [--out bench/results/runtime_cpu_smollm2.json]
Each mode: one warm-up generation, then `reps` greedy generations of `tokens` tokens from the same chat prompt;
the median decode tok/s is reported with every rep and the measured FFN sparsity. Writes JSON with the machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from hotneurons.common.hardware import machine_info
from hotneurons.runtime.config import PRESETS
from hotneurons.runtime.generate import generate, prompt_ids
from hotneurons.runtime.load import load_runtime

from bench import record

PROMPT = "Explain in a few sentences why the sky is blue."


def measure(run: str, mode: str, tokens: int, reps: int) -> dict:
    rt = load_runtime(run, PRESETS["hybrid" if mode == "hybrid" else "dense"])
    ids = prompt_ids(rt, PROMPT, chat=True)
    generate(rt, ids, 8, stop_at_eos=False)  # warm-up: Numba load, first-call paths
    gens = [generate(rt, ids, tokens, stop_at_eos=False) for _ in range(reps)]
    rates = [g.stats["decode_tokens_per_s"] for g in gens]
    s = gens[0].stats
    return {"decode_tokens_per_s": float(np.median(rates)), "decode_tokens_per_s_reps": rates,
            "prefill_tokens_per_s": s["prefill_tokens_per_s"], "ffn_sparsity": s["ffn_sparsity"],
            "gpu_activation_share": s["gpu_activation_share"], "bytes_gpu": s["bytes_gpu"],
            "bytes_cpu": s["bytes_cpu"], "threads": s["threads"], "text": gens[0].text}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default="runs/demo")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench/results/runtime_cpu_smollm2.json"))
    args = ap.parse_args()
    res = {"what": "pi-generate decode tok/s on the CPU, dense vs hybrid (trained predictors), greedy, chat prompt",
           "command": "python " + " ".join(sys.argv), "machine": machine_info("numba", "transformers"),
           "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "run": args.run, "prompt": PROMPT,
           "tokens": args.tokens, "reps": args.reps, "modes": {}}
    for mode in ("dense", "hybrid"):
        res["modes"][mode] = measure(args.run, mode, args.tokens, args.reps)
        print(mode, {k: v for k, v in res["modes"][mode].items() if k != "text"}, flush=True)
    record.write_flat(args.out, res)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
