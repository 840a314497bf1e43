"""Decode speed of the in-place engine (runtime/engine.py: our decoder read from a Q4_0 GGUF) with its steps replayed
as CUDA graphs against the same steps launched eagerly, and against the transformers path (the bf16 folder of the
same weights in a transformers model with runtime/static_decoder.py's graphs), all with one placement and one set of
predictors.

The model is the memory benchmark's random ReLU LLaMA (bench/memory_models.py; firing is not calibrated: random
predictors, hidden 8, threshold `--threshold`), so the figures compare how each path runs a decode step (launches,
graphs, formats), not what a trained model's sparsity gives.

  python -m bench.engine_decode --models /root/models --out bench/results/<date>-<kind>-engine-decode.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def decode_rates(rt, prompt: list[int], tokens: int, reps: int) -> dict:
    from hotneurons.runtime.generate import generate

    generate(rt, prompt, 8, stop_at_eos=False)  # captures graphs, compiles kernels
    runs = [generate(rt, prompt, tokens, stop_at_eos=False).stats for _ in range(reps)]
    return {"decode_tok_s": statistics.median(r["decode_tokens_per_s"] for r in runs),
            "step_ms_median": statistics.median(r["decode_step_ms_median"] for r in runs),
            "ffn_sparsity": runs[-1]["ffn_sparsity"], "gpu_activation_share": runs[-1]["gpu_activation_share"],
            "bytes_gpu": runs[-1]["bytes_gpu"], "bytes_cpu": runs[-1]["bytes_cpu"], "runs": len(runs)}


def setup(models: str, shape: str, threshold: float, hot_share: float):
    """The memory benchmark's model (written once under `models`), a run with random predictors for its GGUF, and a
    random placement of `hot_share` of each layer's neurons on the GPU: (files, run, placement)."""
    import numpy as np
    from hotneurons.artifacts.placement import Placement
    from hotneurons.models.family import adapter_for
    from hotneurons.models.open import model_info, open_model

    from bench import memory_models as mm
    from tests import tiny

    files = mm.ensure_models(shape, Path(models))
    source, sid, mcfg, act = open_model(files["gguf"]["model"])
    ad = adapter_for(source.config)
    info = model_info(source, sid, act, ad.name, ad.gated)
    run = Path(models) / shape / "decode-run"
    if not (run / "predictors").exists():
        run.mkdir(parents=True, exist_ok=True)
        tiny.write_predictors(run, info, threshold)
    n, L = info["n_neurons"], info["n_layers"]
    return files, run, Placement(tuple(np.random.default_rng(i).random(n) < hot_share for i in range(L)))


def main(a) -> dict:
    import torch
    from hotneurons.artifacts.predictor_file import load_predictors
    from hotneurons.models.family import load_model
    from hotneurons.runtime.generate import RuntimeConfig
    from hotneurons.runtime.load import build_runtime, load_source_runtime

    from tests import tiny

    files, run, placement = setup(a.models, a.shape, a.threshold, a.hot_share)
    gguf, hf = files["gguf"]["model"], files["hf"]["model"]
    prompt = list(range(300, 316))
    rows = {}
    for name, graphs in (("engine, CUDA graphs", True), ("engine, eager launches", False)):
        t0 = time.perf_counter()
        rt = load_source_runtime(run, None, RuntimeConfig(device=a.device, cuda_graphs=graphs), model=gguf,
                                 placement=placement)
        rows[name] = {"load_s": time.perf_counter() - t0, "gpu_dtype": rt.cfg.gpu_dtype,
                      "cold_dtype": rt.cfg.cold_dtype, **decode_rates(rt, prompt, a.tokens, a.reps)}
        print(name, rows[name], flush=True)
        del rt
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    t0 = time.perf_counter()
    lm = load_model(hf, device="cpu", dtype="float16")
    run_hf = run.with_name("decode-run-hf")  # the same predictors (seeded), recorded for the folder's model
    if not (run_hf / "predictors").exists():
        run_hf.mkdir(parents=True, exist_ok=True)
        tiny.write_predictors(run_hf, lm.info, a.threshold)
    preds = load_predictors(run_hf, lm.info, device="cpu", dtype=torch.float16)
    rt = build_runtime(lm, RuntimeConfig(device=a.device, cold_dtype="bf16"), placement, preds)
    name = "transformers model, static decoder graphs (bf16 file)"
    rows[name] = {"load_s": time.perf_counter() - t0, "gpu_dtype": "float16", "cold_dtype": "bf16",
                  **decode_rates(rt, prompt, a.tokens, a.reps)}
    print(name, rows[name], flush=True)
    return {"shape": a.shape, "gguf_bytes": files["gguf"]["file_bytes"], "hot_share": a.hot_share,
            "predictor_threshold": a.threshold, "prompt_tokens": len(prompt), "decode_tokens": a.tokens,
            "systems": rows}


def parser(doc: str) -> argparse.ArgumentParser:
    """The flags of setup()'s model, run and placement, and the device (the scripts that use setup share them)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", required=True, help="Folder for the benchmark models (written once, reused).")
    p.add_argument("--shape", default="3.1GB", help="bench/memory_models.SHAPES preset.")
    p.add_argument("--hot-share", type=float, default=0.3, help="Share of each layer's neurons on the GPU.")
    p.add_argument("--threshold", type=float, default=2.0, help="The random predictors' logit threshold.")
    p.add_argument("--device", default="cuda", help="cuda, or cpu (a smoke run: graphs need CUDA).")
    return p


def cli() -> None:
    from bench import record

    p = parser(__doc__)
    p.add_argument("--tokens", type=int, default=64, help="Decode steps per run.")
    p.add_argument("--reps", type=int, default=3, help="Runs per system (median).")
    p.add_argument("--out", default=None, help="Results file (default bench/results/<date>-<kind>-engine-decode.json).")
    a = p.parse_args()
    record.write_dated("engine-decode", main(a), path=a.out)


if __name__ == "__main__":
    cli()
