"""Perplexity of a model as the in-place runtime computes it, per storage format of its FFN rows: each format's
rounding (bf16; q8_0 / q4_0 / q4_1 blocks, the down projection re-quantized along neurons) on held-out Wikipedia text.
On a Q4_1 file (SmolLM2's), q4_1 keeps the file's gate and up rows as stored; q4_0 and q8_0 re-quantize them.

Every neuron is computed (dense mode), so the figure is the formats' cost alone, not the predictors'. The hot rows
(on the device, here the CPU) and the cold rows get the same format; `--hot-share` puts that share of each layer's
neurons on the device side and the rest in CPU RAM, so both code paths run.

  python -m bench.format_quality --out bench/results/<date>-cpu-format-quality.json            # SmolLM2 (Q4_1)
  python -m bench.format_quality --model models/smollm2-relu --out ...                         # a relufied one
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

FORMATS = ("bf16", "q8_0", "q4_0", "q4_1")


def perplexity(rt, batches) -> float:
    import torch
    from hotneurons.runtime.engine import forward

    nll, n = 0.0, 0
    for ids in batches:
        row = ids.tolist()
        logits = forward(rt, row, 0, every=True)  # (T, vocab) float32
        logp = torch.log_softmax(logits[:-1].double(), -1)
        tgt = torch.tensor(row[1:])
        nll -= float(logp.gather(1, tgt[:, None]).sum())
        n += len(row) - 1
    return math.exp(nll / n)


def run(model: str | None, tokens: int, seq_len: int, hot_share: float, formats: tuple[str, ...]) -> dict:
    import numpy as np
    import torch
    from hotneurons.artifacts.placement import Placement
    from hotneurons.common.corpus import iter_texts, token_batches
    from hotneurons.runtime.generate import RuntimeConfig
    from hotneurons.runtime.load import load_source_runtime

    results = {}
    batches = None
    for fmt in ("f32",) + formats:
        t0 = time.perf_counter()
        cfg = RuntimeConfig(mode="dense", device="cpu", cold_dtype="bf16" if fmt == "f32" else fmt,
                            gpu_dtype="f32" if fmt in ("f32", "bf16") else fmt)
        if fmt == "f32":  # the reference: every row on the device side in float32, no re-rounding
            rt = load_source_runtime(None, None, cfg, model=model)
        else:
            info_rt = rt
            L, n = info_rt.lm.info["n_layers"], info_rt.lm.info["n_neurons"]
            rng = np.random.default_rng(0)
            placement = Placement(tuple(rng.random(n) < hot_share for _ in range(L)))
            rt = load_source_runtime(None, None, cfg, model=model, placement=placement)
        if batches is None:
            batches = [b[0] for b in token_batches(rt.lm.tokenizer, iter_texts("wikipedia-sample:eval"), seq_len, 1,
                                                   tokens)]
        with torch.inference_mode():
            ppl = perplexity(rt, batches)
        results[fmt] = {"perplexity": ppl, "cold_bytes": int(rt.bytes_cpu), "seconds": time.perf_counter() - t0}
        print(f"{fmt:>5}: ppl {ppl:.3f}", flush=True)
    ref = results["f32"]["perplexity"]
    for r in results.values():
        r["vs_f32"] = r["perplexity"] / ref - 1
    return {"model": model or "SmolLM2-135M-Instruct (Q4_1 GGUF)", "tokens": sum(len(b) for b in batches),
            "seq_len": seq_len, "hot_share": hot_share, "results": results,
            "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
            "note": "dense decode of the in-place runtime (every neuron computed): perplexity on "
                    "wikipedia-sample:eval; "
                    "f32 = the file's weights de-quantized, no other rounding"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF file or safetensors folder (default: the embedded SmolLM2)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--hot-share", type=float, default=0.2)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    res = run(a.model, a.tokens, a.seq_len, a.hot_share, tuple(a.formats.split(",")))
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
