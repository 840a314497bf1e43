"""pi-export's exactness on SmolLM2-135M's architecture (GQA 9/3 heads, d 576, a byte-level BPE vocabulary, tied
embeddings): the demo GGUF with its FFN activation swapped to ReLU (untrained: the check is the export, not the text),
exact powerinfer-form predictors (export/roundtrip.make_run), PowerInfer's `main` against HF and our runtime, greedy,
PowerInfer at --threads (1: its CPU down-projection races with more, ggml.c:14433-14457; a CUDA build refuses 1,
ggml.c:16719, so give it 2), our runtime at one thread. The untrained model's logits are nearly flat, so the three
may part at a near-tie: each step's top-two margin of HF's logits is recorded beside the tokens.

    python -m bench.powerinfer_smollm2 --main PATH --out DIR [--threads N] [--results FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from bench import record


def check(work: Path, main: Path, prompt: str = "The capital of France is", n: int = 16, threads: int = 1) -> dict:
    from hotneurons.export import export_run
    from hotneurons.export import roundtrip as rt
    from hotneurons.models.family import load_model
    from hotneurons.relufy.relufy import plain_model

    folder = work / "smollm2-relu"
    if not (folder / "config.json").exists():
        lm = load_model(None, device="cpu", dtype="float32")  # the embedded demo GGUF
        plain_model(lm, torch.float32, "cpu", "relu").save_pretrained(folder)
        lm.tokenizer.save_pretrained(folder)
    run = rt.make_run(folder, work / "run", "powerinfer")
    s = export_run(run, work / "export", force=True)
    hf = rt.hf_tokens(folder, prompt, n)
    ours = rt.our_tokens(run, prompt, n, 1)
    pi = rt.powerinfer_tokens(main, work / "export" / s["files"]["model"], prompt, n, threads, logdir=work / "logs")
    pt = pi.get("tokens", [])
    first = {k: rt.common_prefix(v, hf["tokens"]) for k, v in (("powerinfer", pt), ("ours", ours["tokens"]))}
    return {"model": "SmolLM2-135M-Instruct (demo GGUF), FFN activation swapped to ReLU, untrained",
            "predictor": "exact, powerinfer form (threshold 0)", "prompt": prompt, "new_tokens": n,
            "powerinfer_threads": threads,
            "export": {k: s[k] for k in ("arch", "vocab", "file_bytes", "vram_capacity")},
            "matched": {"prompt_ids_equal": pi.get("prompt_ids") == hf["prompt_ids"],
                        "powerinfer_vs_hf": first["powerinfer"], "ours_vs_hf": first["ours"],
                        "powerinfer_vs_ours": rt.common_prefix(pt, ours["tokens"])},
            # HF's top-two logit margin where each parts from HF: a near-tie there means rounding, not the export
            "hf_margin_where_parted": {k: (hf["top2_margins"][m] if m < n else None) for k, m in first.items()},
            "hf": hf, "ours": ours, "powerinfer": pi}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--main", type=Path, required=True, help="PowerInfer's main (bench/powerinfer_check.py builds it)")
    p.add_argument("--out", type=Path, required=True, help="work folder")
    p.add_argument("--threads", type=int, default=1, help="PowerInfer's -t (a CUDA main needs 2)")
    p.add_argument("--results", type=Path, default=None)
    p.add_argument("--commit", default=None)
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    figures = check(a.out, a.main, threads=a.threads)
    print(figures["matched"], figures["hf_margin_where_parted"], file=sys.stderr)
    return record.write_dated("powerinfer-smollm2", figures, path=a.results, commit=a.commit)


if __name__ == "__main__":
    main()
