"""Profiling throughput with the counting hooks vs a plain forward pass on the same batches.

    python -m bench.profile_overhead                       # SmolLM2-135M GGUF on wikipedia-sample (CPU here)
    python -m bench.profile_overhead --shape llama-2-7b --layers 8 --device cuda   # random weights, GPU

Four timings per batch, interleaved so that drift hits all alike: `plain` (decoder stack, no hooks),
`count` (counting hooks only), `count+samples:filling` (counting + writing every row to a fresh sample
reservoir: the worst case, the first --samples-per-layer tokens of a run) and `count+samples:steady` (a
16384-row reservoir that has already seen 100k tokens: what most of a default run costs). Writes a JSON
results file with the machine.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import click
import torch
from hotneurons.common.hardware import machine_info
from hotneurons.common.model_source import ModelSource
from hotneurons.models.family import load_model, pick_device, pick_dtype, wrap_model
from hotneurons.profiler.hooks import ActivationCounter, SampleReservoir
from hotneurons.profiler.profile import forward

from bench import record

# Real layer shapes (hidden, FFN, heads, kv heads) of public models; the weights are random.
SHAPES = {
    "llama-2-7b": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32),
    "llama-2-13b": dict(hidden_size=5120, intermediate_size=13824, num_attention_heads=40, num_key_value_heads=40),
    "llama-2-70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8),
}


def random_model(shape: str, layers: int, device: str, dtype: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    if shape not in SHAPES:
        raise click.BadParameter(f"unknown shape '{shape}': choose {', '.join(SHAPES)}")
    cfg = LlamaConfig(**SHAPES[shape], num_hidden_layers=layers, vocab_size=32000, hidden_act="relu",
                      max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=pick_dtype(dtype, device))

    class _Tok:  # random token ids need no tokenizer
        bos_token_id, eos_token_id = 1, 2

    return wrap_model(model, _Tok(), ModelSource(f"random-{shape}-{layers}L", f"random-{shape}"))


@click.command()
@click.option("--model", default=None, help="Model to load (default: embedded SmolLM2-135M GGUF).")
@click.option("--shape", default=None, help=f"Build a random ReLU-gated model instead: {', '.join(SHAPES)}.")
@click.option("--layers", default=4, show_default=True, help="Layers of the --shape model.")
@click.option("--device", default="auto", show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--batches", default=8, show_default=True, help="Timed batches per variant.")
@click.option("--batch-size", default=8, show_default=True)
@click.option("--seq-len", default=512, show_default=True)
@click.option("--out", default="bench/results/profile_overhead.json", show_default=True)
def main(model, shape, layers, device, dtype, batches, batch_size, seq_len, out):
    device = pick_device(device)
    lm = random_model(shape, layers, device, dtype) if shape else load_model(model, device=device, dtype=dtype)
    n_layers, d, n = lm.info["n_layers"], lm.info["d_model"], lm.info["n_neurons"]
    if shape:
        ids = torch.randint(3, 32000, (batches + 2, batch_size, seq_len))
    else:
        from hotneurons.common.corpus import iter_texts
        from hotneurons.profiler.profile import token_batches

        stream = token_batches(lm.tokenizer, iter_texts("wikipedia-sample"), seq_len, batch_size,
                               (batches + 2) * batch_size * seq_len)
        ids = torch.stack([b for b in stream if b.shape == (batch_size, seq_len)])
    taus = None if lm.activation in ("relu", "reglu", "drelu") else [0.01] * n_layers
    tmp = Path(tempfile.mkdtemp())
    times: dict[str, list[float]] = {"plain": [], "count": [], "count+samples:filling": [],
                                     "count+samples:steady": []}

    def timed(fn) -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t

    counter = ActivationCounter(lm, taus)
    filling = SampleReservoir(tmp / "filling", ids[0].numel() * len(ids), n_layers, d, n, seed=0)
    steady = SampleReservoir(tmp / "steady", 16384, n_layers, d, n, seed=0)
    for arr in (*steady.x, *steady.mask):  # a full reservoir has its pages resident already
        arr[:] = 0
    variants = {"count": (counter, None, 0),
                "count+samples:filling": (ActivationCounter(lm, taus, filling), filling, 0),
                "count+samples:steady": (ActivationCounter(lm, taus, steady), steady, 100_000)}
    for b, batch in enumerate(ids):
        t = {"plain": timed(lambda: forward(lm, batch))}
        for name, (hooks, reservoir, offset) in variants.items():
            with hooks:
                if reservoir is not None:
                    reservoir.plan(b, offset + b * batch.numel(), batch.numel(), counter.counts.device)
                t[name] = timed(lambda: (forward(lm, batch), reservoir.commit() if reservoir else None))
        if b >= 2:  # the first two are warm-up
            for name, v in t.items():
                times[name].append(v)
    filling.flush()
    steady.flush()
    tokens = batch_size * seq_len
    res = {k: {"median_s": statistics.median(v), "tokens_per_s": tokens / statistics.median(v)}
           for k, v in times.items()}
    for k in list(variants):
        res[k]["overhead_vs_plain"] = res[k]["median_s"] / res["plain"]["median_s"] - 1
    result = {
        "benchmark": "profile_overhead",
        "command": " ".join(["python", *sys.argv]),
        "model": lm.info["name"], "family": lm.info["family"], "activation": lm.activation,
        "n_layers": n_layers, "d_model": d, "n_neurons": n, "device": device,
        "dtype": str(next(lm.model.parameters()).dtype), "batch_size": batch_size, "seq_len": seq_len,
        "timed_batches": len(times["plain"]), "results": res, "machine": machine_info("numba", "transformers"),
        "note": "median over batches; plain = decoder stack without hooks; see the module docstring",
    }
    record.write_flat(out, result)
    click.echo(json.dumps(result["results"], indent=2))


if __name__ == "__main__":
    main()
