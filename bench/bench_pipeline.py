"""pi-bench's pipeline on the bench model, before our systems run: profile (with the realised statistics against
the calibration's targets), the exact predictors and their agreement with the gate, the hardware spec from the
measured ceilings, and the placement (pi-solve, or a top-k fallback without the solver)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from bench import bench_model as bm


def profile(args, model: bm.BenchModel, run: Path) -> dict:
    from hotneurons.profiler.profile import ProfileConfig, profile_model, share_covering

    corpus = run.parent / "synthetic-corpus.txt"
    bm.synthetic_corpus(corpus, args.profile_tokens, bm.SHAPES[args.shape][4], args.seed + 2)
    cfg = ProfileConfig(model=model.lm.info["name"], dataset=str(corpus), tokens=args.profile_tokens, seq_len=512,
                        batch_size=4, samples_per_layer=0)
    t0 = time.perf_counter()
    meta = profile_model(cfg, run, force=True, device=args.device, progress=False, lm=model.lm)
    seconds = time.perf_counter() - t0
    from hotneurons.artifacts.profile import read_profile

    df, _ = read_profile(run)
    n = bm.SHAPES[args.shape][1]
    counts = [df[df.layer == i].sort_values("neuron")["count"].to_numpy() for i in range(args.layers)]
    freq = [c / meta["tokens"] for c in counts]
    rows = [{"layer": i, "mean_active": float(f.mean()), "target_mean_active": float(t.mean()),
             "share_of_neurons_covering_80pct": float(share_covering(c[None], 0.8)[0]) if c.sum() else None,
             "top20pct_share": bm.share_of_top(f), "target_top20pct_share": bm.share_of_top(t),
             "corr_with_target": float(np.corrcoef(f, t)[0, 1])}
            for i, (c, f, t) in enumerate(zip(counts, freq, model.targets))]
    return {"tokens": int(meta["tokens"]), "corpus": "synthetic: uniformly random token ids (a .txt of decimal ids)",
            "seconds": seconds, "per_layer": rows, "n_neurons": n,
            "mean_active": float(np.mean([r["mean_active"] for r in rows])),
            "share_of_neurons_covering_80pct": float(np.mean([r["share_of_neurons_covering_80pct"] or 1
            for r in rows])),
            "top20pct_share": float(np.mean([r["top20pct_share"] for r in rows])), "freq": freq}


def write_predictors(args, run: Path, model: bm.BenchModel) -> dict:
    """The exact predictors (bench_model.exact_predictor), written as RUN/predictors (threshold 0, normed form) so that
    pi-solve counts their real bytes."""
    from hotneurons.export.predictors import Form
    from hotneurons.export.predictors import write_predictors as write

    preds = {i: bm.exact_predictor(model.lm, args.shape, i, args.seed, args.gate_rank) for i in range(args.layers)}
    layers = [(p.fc1.weight, p.fc2.weight) for p in preds.values()]  # fp16: (r, d), (n, r)
    write(run, model.lm.info, layers, 0.0, Form.NORMED)
    nbytes = sum(t.numel() * t.element_size() for pair in layers for t in pair)
    return {"kind": "exact (bench_model.exact_predictor: a trained predictor's size, "
                    "logits = the gate pre-activations)",
            "hidden": 2 * args.gate_rank + 2, "bytes": nbytes, "layers": preds,
            "agreement_with_gate": predictor_agreement(model, preds)}


@torch.no_grad()
def predictor_agreement(model: bm.BenchModel, preds: dict, tokens: int = 64) -> dict:
    """Share of (token, neuron) pairs where the predictor's mask equals gate . x > 0, on layer 0's FFN inputs of random
    tokens, with the recall and precision of firing."""
    vocab = bm.SHAPES[model.shape][4]
    dev = next(model.lm.model.parameters()).device
    ids = torch.randint(0, vocab, (1, tokens), device=dev, generator=torch.Generator(dev).manual_seed(11))
    x = bm._ffn_input(model.lm, 0, ids).half()  # (tokens, d)
    truth = (x @ model.lm.layers[0].mlp.gate_proj.weight.T) > 0  # (tokens, n)
    pred = preds[0].mask(x)
    hit = (pred & truth).sum().item()
    return {"agreement": float((pred == truth).float().mean()), "recall": hit / max(1, truth.sum().item()),
            "precision": hit / max(1, pred.sum().item()), "tokens": tokens, "layer": 0}


def hardware_spec(c: dict, budget: int):
    from hotneurons.common.hardware import get_hardware

    base = get_hardware("h100" if "hbm_bytes_per_s" in c else "cpu-only")
    changes = {"cpu_bw": c["dram"]["best_bytes_per_s"], "cores": c["dram"]["threads"]}
    if "hbm_bytes_per_s" in c:
        changes.update(pcie_bw=c["pcie_h2d_bytes_per_s"], gpu_bw=c["hbm_bytes_per_s"],
                       sync_latency_s=c["sync_round_trip_s"])
    else:  # CPU smoke test: pretend a GPU so the solver places something
        changes.update(vram_bytes=budget, pcie_bw=32e9, gpu_bw=c["dram"]["best_bytes_per_s"] * 4, sync_latency_s=30e-6)
    return base.replace(name="measured in this run", **changes)


def place(args, run: Path, hw, budget: int) -> dict:
    """pi-solve's solver at the budget (KV cache for --ctx, no reserve: every system gets the same bytes); without
    pulp/highspy, the top-k-by-frequency fallback that fills the same FFN budget."""
    import pandas as pd
    from hotneurons.solver.place import solve_placement

    t0 = time.perf_counter()
    try:
        import highspy  # noqa: F401
        import pulp  # noqa: F401

        missing = None
    except ImportError as e:
        missing = str(e)
    if missing is None:
        s = solve_placement(run, hw, vram_bytes=budget, dtype="fp16", ctx=args.ctx, reserve_bytes=0)
        kind = "pi-solve (PuLP + HiGHS), latency objective"
    else:
        s = topk_placement(run, budget, args)
        kind = f"top-k by frequency, same FFN budget (solver unavailable: {missing})"
    df = pd.read_parquet(run / "placement" / "placement.parquet")
    return {"kind": kind, "seconds": time.perf_counter() - t0, "summary": s.to_dict() if hasattr(s, "to_dict") else s,
            "gpu_neuron_share": float(df.gpu.mean())}


def topk_placement(run: Path, budget: int, args) -> dict:
    """Fallback placement: each layer's most active neurons, the same number per layer, filling the FFN budget
    (budget minus what pi-solve's memory_items counts before any neuron)."""
    from hotneurons.artifacts.profile import read_profile
    from hotneurons.common import artifacts
    from hotneurons.common.model_info import ModelInfo
    from hotneurons.solver.cost import memory_items, safetensors_bytes

    df, meta = read_profile(run)
    shape = ModelInfo.from_meta(meta["model"])
    pred = safetensors_bytes(run / "predictors" / "predictors.safetensors")
    fixed = sum(memory_items(shape, 2, args.ctx, 0, pred).values())
    per_neuron = shape.rows * shape.d_model * 2
    k = max(0, min(shape.n_neurons, int((budget - fixed) // (per_neuron * shape.n_layers))))
    df = df.sort_values(["layer", "count", "neuron"], ascending=[True, False, True]).reset_index(drop=True)
    df["rank"] = df.groupby("layer").cumcount().astype("int32")
    df["gpu"] = df["rank"] < k
    (run / "placement").mkdir(exist_ok=True)
    artifacts.write_parquet(run / "placement" / "placement.parquet", df[["layer", "neuron", "gpu", "count", "rank"]])
    pmeta = artifacts.base_meta("placement", inputs={})
    pmeta["model"] = meta["model"]
    artifacts.write_json(run / "placement" / "meta.json", pmeta)
    act = df[df.gpu].groupby("layer")["count"].sum() / df.groupby("layer")["count"].sum()
    return {"gpu_neurons_per_layer": k, "fixed_gpu_bytes": fixed, "gpu_activation_share": float(act.mean())}
