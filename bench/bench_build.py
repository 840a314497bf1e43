"""pi-bench's build stage and where its outputs lie: the bench model built and calibrated (or its calibration
re-applied from --work), its GGUF and Q8_0 GGUF, llama-bench's binary, llama.cpp's -ngl at the budget and the
llama.cpp runs of the bench stage."""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import numpy as np
import torch

from bench import bench_llamacpp as lcpp
from bench import bench_model as bm


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------
# The model, its calibration and its GGUF


def model_key(args) -> str:
    d, n, heads, kv, vocab = bm.SHAPES[args.shape]
    return (f"{args.shape}-{d}x{n}x{heads}x{kv}x{vocab}-{args.layers}L-rank{args.gate_rank}-seed{args.seed}"
            f"-emb{args.embed_std:g}")


def calibrated_model(args, work: Path) -> bm.BenchModel:
    """Build the model on the device and calibrate it, or re-apply the calibration saved in --work (same weights as
    the GGUF written by the build stage)."""
    from safetensors.torch import load_file, save_file

    t0 = time.perf_counter()
    lm = bm.build_model(args.shape, args.layers, args.device, args.seed, gate_rank=args.gate_rank,
                        embed_std=args.embed_std)
    path = work / f"calibration-{model_key(args)}.safetensors"
    if path.exists():
        saved = load_file(str(path))
        info = json.loads((path.with_suffix(".json")).read_text())
        with torch.no_grad():
            for i, layer in enumerate(lm.layers):
                layer.post_attention_layernorm.weight[0] = saved[f"norm0.{i}"].to(args.device)
                layer.mlp.gate_proj.weight[:, 0] = saved[f"gate0.{i}"].to(args.device)
        targets = [saved[f"target.{i}"].numpy().astype(np.float64) for i in range(args.layers)]
        model = bm.BenchModel(lm, args.shape, args.layers, targets, {**info, "reused_from": str(path)})
    else:
        model = bm.calibrate(lm, args.shape, args.calibration_tokens, seed=args.seed)
        save_file({**{f"norm0.{i}": l.post_attention_layernorm.weight[0:1].detach().cpu().clone()
                        for i, l in enumerate(lm.layers)},
                   **{f"gate0.{i}": l.mlp.gate_proj.weight[:, 0].detach().cpu().contiguous()
                        for i, l in enumerate(lm.layers)},
                   **{f"target.{i}": torch.from_numpy(p.astype(np.float32)) for i, p in enumerate(model.targets)}},
                  str(path))
        path.with_suffix(".json").write_text(json.dumps(model.calibration))
    model.calibration["build_and_calibrate_s"] = time.perf_counter() - t0
    return model


def stage_build(args, work: Path) -> dict:
    out: dict = {"stage": "build"}
    if args.device == "cuda" or args.cpu_llamacpp:
        try:
            out["llama_cpp_build"] = lcpp.build(work, cuda=args.device == "cuda", jobs=args.jobs)
        except Exception as e:
            out["llama_cpp_build"] = {"error": f"{type(e).__name__}: {e}"}
    model = calibrated_model(args, work)
    gpath = work / f"model-{model_key(args)}.gguf"
    if not gpath.exists():
        out["gguf"] = lcpp.write_gguf(model.lm.model, gpath, lcpp.gguf_module(work))
    out["calibration"] = model.calibration
    del model
    _free(args.device)
    bin_dir = work / ("build-cuda" if args.device == "cuda" else "build-cpu") / "bin"
    q8 = q8_path(args, work)
    if (bin_dir / "llama-quantize").exists() and not q8.exists():
        try:
            out["gguf_q8_0"] = lcpp.quantize(bin_dir, gpath, q8, "Q8_0", args.jobs)
        except Exception as e:
            out["gguf_q8_0"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def q8_path(args, work: Path) -> Path:
    return work / f"model-{model_key(args)}-q8_0.gguf"



# ---------------------------------------------------------------------------------------------------------------
# llama.cpp on the build's GGUFs: its binary, -ngl at the budget, its runs


def llama_binary(args, work: Path) -> Path:
    return work / ("build-cuda" if args.device == "cuda" else "build-cpu") / "bin" / "llama-bench"


def llama_ngl(args) -> tuple[int, int]:
    """llama.cpp's -ngl at the budget: fp16 and Q8_0 layers that fit in it."""
    from hotneurons.solver.cost import DTYPE_BYTES

    budget = int(args.budget_share * bm.model_bytes(args.shape, args.layers)["total"])
    return (bm.gpu_layers_for(budget, args.shape, args.layers),
            bm.gpu_layers_for(budget, args.shape, args.layers, size=DTYPE_BYTES["q8_0"]))


def llama_runs(args, work: Path) -> list[tuple[str, int, Path]]:
    """(label, -ngl, GGUF) of the llama.cpp systems, [] where the build stage has not run here: -ngl at the budget
    first, all layers on the GPU, Q8_0 at the budget where it was quantised."""
    ngl, ngl8 = llama_ngl(args)
    gpath = work / f"model-{model_key(args)}.gguf"
    if not (llama_binary(args, work).exists() and gpath.exists()):
        return []
    runs = [(f"llama.cpp -ngl {ngl}", ngl, gpath), ("llama.cpp all layers on the GPU", args.layers + 1, gpath)]
    if q8_path(args, work).exists():
        runs.append((f"llama.cpp Q8_0 -ngl {ngl8}", ngl8, q8_path(args, work)))
    return runs
