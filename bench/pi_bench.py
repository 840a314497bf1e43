"""pi-bench: our systems (hybrid, layer-split, all-GPU) against llama.cpp and HF accelerate on one LLaMA-2-70B-shaped
model, with the cost floor from ceilings measured in the same run. docs/benchmarks.md says how to run it.

The model has RANDOM weights (bench_model.py): LLaMA-2-70B layer shapes with grouped-query attention, a ReLU-gated
FFN, per-neuron firing probabilities calibrated to a power law (mean 10% active, the top 20% of neurons covering 80%
of firings), gate columns of rank 511. The predictor is EXACT (bench_model.exact_predictor): an MLP of a trained
predictor's size (d/8 hidden) whose logits are the gate pre-activations, so it marks the neurons that fire. Speed
only, not quality.

Stages (each device call may start a fresh machine; files persist in --work while it stays warm):
  prepare  here, with PyPI: llama.cpp source tarball into .llamacpp/, pulp/highspy/gguf wheels into .whl/ (carried)
  build    GPU: build llama-bench (CUDA sm_90), build + calibrate the model, write its GGUF into --work
  bench    GPU: our systems in a child process (ceilings, profile, solve, our systems, llama-bench paired in rounds
           with that process stopped meanwhile), then each baseline standalone (llama-bench; accelerate in its own
           process), the paired and standalone runs side by side (fair.py says why)
  powerinfer  GPU, after bench: PowerInfer's CUDA main from the shared tarball on the same model, budget and
           placement (bench_powerinfer.py), run alone
  report   anywhere: merge stage JSONs (--inputs) into bench/results/<date>-<machine kind>-pi-bench.{json,md}
  all      build + bench (more than one 10-minute device call at the 70B shape)
CPU smoke test: pi-bench --stage all --device cpu --shape tiny --layers 2 --ctx 64 --work /tmp/pib --out /tmp/pib/out
"""

from __future__ import annotations

import os

from hotneurons.bench import fair
from hotneurons.common.hardware import openmp_wait_policy

_SET_BEFORE = {k for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
if os.environ.get(fair.BASELINE_PROCESS):  # a baseline's own process: the user's OpenMP settings, not ours
    OMP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY", "unset")
else:
    OMP_WAIT_POLICY = openmp_wait_policy()  # before torch loads (common/hardware.py says why)
    fair.note_env(_SET_BEFORE)

import argparse  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from hotneurons.bench import ROOT, record  # noqa: E402
from hotneurons.bench import bench_ceilings as ceil  # noqa: E402
from hotneurons.bench import bench_llamacpp as lcpp  # noqa: E402
from hotneurons.bench import bench_model as bm  # noqa: E402
from hotneurons.bench import bench_timeline as tl  # noqa: E402
from hotneurons.bench.bench_report import goals, markdown, write_results  # noqa: E402
from hotneurons.bench.bench_systems import run_accelerate, run_interleaved, run_ours, share_sweep  # noqa: E402


class Deadline:
    def __init__(self, seconds: float):
        self.t0, self.limit = time.perf_counter(), seconds

    def left(self) -> float:
        return self.limit - (time.perf_counter() - self.t0)

    def allows(self, estimate_s: float, what: str, skipped: dict) -> bool:
        if self.left() >= estimate_s:
            return True
        skipped[what] = f"skipped: {self.left():.0f} s left of --time-limit, about {estimate_s:.0f} s needed"
        print(what, skipped[what], flush=True)
        return False


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
        except Exception as e:  # noqa: BLE001 - reported, the rest of the stage still runs
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
        except Exception as e:  # noqa: BLE001 - the fp16 comparison does not need it
            out["gguf_q8_0"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def q8_path(args, work: Path) -> Path:
    return work / f"model-{model_key(args)}-q8_0.gguf"


# ---------------------------------------------------------------------------------------------------------------
# Pipeline: profile, realised statistics, placement


def profile(args, model: bm.BenchModel, run: Path) -> dict:
    from hotneurons.profiler.profile import ProfileConfig, profile_model, share_covering

    corpus = run.parent / "synthetic-corpus.txt"
    bm.synthetic_corpus(corpus, args.profile_tokens, bm.SHAPES[args.shape][4], args.seed + 2)
    cfg = ProfileConfig(model=model.lm.info["name"], dataset=str(corpus), tokens=args.profile_tokens, seq_len=512,
                        batch_size=4, samples_per_layer=0)
    t0 = time.perf_counter()
    meta = profile_model(cfg, run, force=True, device=args.device, progress=False, lm=model.lm)
    seconds = time.perf_counter() - t0
    from hotneurons.common import artifacts

    df, _ = artifacts.read_profile(run)
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
    """The exact predictors (bench_model.exact_predictor), and their weights in RUN/predictors/predictors.safetensors so
    that pi-solve counts their real bytes."""
    from safetensors.torch import save_file

    preds = {i: bm.exact_predictor(model.lm, args.shape, i, args.seed, args.gate_rank) for i in range(args.layers)}
    tensors = {f"layers.{i}.{name}.weight": getattr(p, name).weight.detach().cpu().contiguous()
               for i, p in preds.items() for name in ("fc1", "fc2")}
    (run / "predictors").mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(run / "predictors" / "predictors.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
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
    from hotneurons.common import artifacts
    from hotneurons.solver.cost import ModelShape, memory_items, safetensors_bytes

    df, meta = artifacts.read_profile(run)
    shape = ModelShape.from_meta(meta["model"])
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


# ---------------------------------------------------------------------------------------------------------------
# The floor (our systems' and accelerate's runners: bench_systems.py)


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


def fairness_probe(rt, prompt: list[int]) -> dict:
    """fair.cpu_probe just after a generation of `rt` (our threads still hot): beside them, then with this process
    stopped as for a paired baseline. The parent adds the probe alone."""
    from hotneurons.runtime.generate import generate

    out = {}
    for key, freeze in (("beside_ours_s", False), ("ours_stopped_s", True)):
        generate(rt, prompt, 4, stop_at_eos=False)
        out[key] = fair.cpu_probe(freeze=freeze)
    print("cpu probe", out, flush=True)
    return out


def stage_bench(args, work: Path, out: Path) -> dict:
    """Our systems in a child process (stage_ours), then every baseline standalone from this process, which has run
    nothing on the CPU meanwhile: llama-bench, and accelerate in a process of its own. The paired and standalone
    llama.cpp figures side by side (`baselines`, flagged beyond fair.TOLERANCE)."""
    dl = Deadline(args.time_limit)
    runs = llama_runs(args, work) if "llama.cpp" in args.systems else []
    reserve = (len(runs) * args.estimates["llama.cpp"]
               + ("accelerate" in args.systems) * args.estimates["accelerate"])
    args.ours_time_limit = max(10.0, args.time_limit - reserve)
    alone = None if args.in_process else fair.cpu_probe()
    if args.in_process:
        res = stage_ours(args, work)
    else:
        res = run_part(args, "ours", out, args.ours_time_limit + 120)
    res["stage"] = "bench"
    systems, skipped = res.setdefault("systems", {}), res.setdefault("skipped", {})
    res["llama_cpp_ngl_at_budget"], res["llama_cpp_q8_0_ngl_at_budget"] = llama_ngl(args)
    if alone is not None:
        res["fairness"] = {"alone_s": alone, **res.get("fairness", {}), "what": (
            "seconds of a CPU-bound job on every core (fair.cpu_probe): alone, just after one of our generations "
            "beside our process, and with our process stopped as for a paired baseline")}
    if "llama.cpp" in args.systems and not runs:
        skipped["llama.cpp"] = f"not built in {work}: run --stage build on this machine first"
    threads = args.threads or os.cpu_count()
    for label, k, path in runs:
        if dl.allows(args.estimates["llama.cpp"], label, skipped):
            systems[label] = lcpp.llama_bench(str(llama_binary(args, work)), path, k, threads, args.llama_tokens,
                                              args.llama_reps, max(30, dl.left()))
            systems[label]["standalone"] = True
            print(label, systems[label].get("decode_tokens_per_s", systems[label].get("error")), flush=True)
            checkpoint(args, res, systems, skipped)
    if "accelerate" in args.systems and dl.allows(args.estimates["accelerate"], "accelerate", skipped):
        if args.in_process:
            row = stage_accelerate(args, work)["systems"]["accelerate offload"]
        else:
            part = run_part(args, "accelerate", out, max(30, dl.left()))
            row = (part.get("systems") or {}).get("accelerate offload") or {"error": part.get("error", "no result")}
        systems["accelerate offload"] = {**row, "standalone": True}
        checkpoint(args, res, systems, skipped)
    paired = {label: [r.get("decode_tokens_per_s") for r in rows]
              for label, rows in ((res.get("interleaved") or {}).get("others") or {}).items()}
    res["baselines"] = {label: fair.compare(_rate_of(systems.get(label)), v) for label, v in paired.items()}
    for label, c in res["baselines"].items():
        if c["flag"]:
            print(f"FLAG: {label} paired {c['paired_median_tokens_per_s']} tok/s, standalone "
                  f"{c['standalone_tokens_per_s']} tok/s", flush=True)
    res["seconds"] = time.perf_counter() - dl.t0
    return res


def _rate_of(row: dict | None) -> float | None:
    return (row or {}).get("decode_tokens_per_s")


def stage_accelerate(args, work: Path) -> dict:
    """HF accelerate's offload of the bench model at the budget, in a process of its own (--part accelerate)."""
    budget = int(args.budget_share * bm.model_bytes(args.shape, args.layers)["total"])
    model = calibrated_model(args, work)
    base = model.lm.model.to("cpu")
    _free(args.device)
    prompt = list(range(100, 100 + args.prompt_tokens))
    try:
        row = run_accelerate(base, budget, args.device, prompt, args.slow_tokens)
    except Exception as e:  # noqa: BLE001 - reported in the results
        row = {"error": f"{type(e).__name__}: {e}"}
    row["omp_wait_policy"] = OMP_WAIT_POLICY
    return {"stage": "part accelerate", "systems": {"accelerate offload": row}}


def run_part(args, part: str, out: Path, timeout: float) -> dict:
    """`pi-bench --part PART` (this command line) in a child process; its JSON (out/pi_bench_PART.json, partial if
    the child stopped early), or {"error": ...} where it wrote none. accelerate's child gets the baseline environment
    (fair.baseline_env)."""
    path = out / f"pi_bench_{part}.json"
    path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "hotneurons.bench.pi_bench", *args.argv, "--part", part, "--out", str(out)]
    env = fair.baseline_env() if part != "ours" else None
    print("+", " ".join(cmd), flush=True)
    try:
        rc = subprocess.run(cmd, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if not path.exists():
        return {"error": f"the {part} process ended ({rc}) before writing {path.name}"}
    res = record.read(path)["figures"]  # the header is this process's
    if rc != 0:
        res.setdefault("partial", f"the {part} process ended ({rc}) before its end")
    return res


def checkpoint(args, res: dict, systems: dict, skipped: dict) -> None:
    """The bench stage's JSON as it stands (args.save, set by main), marked partial: a run stopped by a timeout keeps
    the systems measured before it."""
    if getattr(args, "save", None) is not None:
        args.save({**res, "systems": systems, "skipped": skipped,
                   "partial": "the bench stage stopped before its end: the systems measured until then"})


def stage_ours(args, work: Path) -> dict:
    """Our systems, in the process that pi-bench's bench stage starts for them (or in-process with --in-process):
    ceilings, model, profile, placement, our systems (with --interleave, llama-bench paired in rounds while this
    process is stopped), the kernel rows and the floors. The standalone baselines run after it (stage_bench)."""
    from hotneurons.runtime.generate import RuntimeConfig, layer_split_count
    from hotneurons.runtime.placement import Placement

    dl = Deadline(args.ours_time_limit)
    skipped: dict = {}
    res: dict = {"stage": "part ours" if args.part == "ours" else "bench", "skipped": skipped}
    cuda = args.device == "cuda"
    c = {"dram": ceil.dram_read_bw(args.dram_bytes)}
    if cuda:
        c.update(ceil.cuda_ceilings())
        try:
            c["zero_copy"] = ceil.zero_copy_read(args.dram_bytes)
        except Exception as e:  # noqa: BLE001 - the other ceilings stand without it
            c["zero_copy"] = {"error": f"{type(e).__name__}: {e}"}
    res["ceilings"] = c
    print("ceilings", json.dumps(c, default=float)[:600], flush=True)

    mb = bm.model_bytes(args.shape, args.layers)
    budget = int(args.budget_share * mb["total"])
    res["model"] = {"shape": args.shape, "layers": args.layers, "dims": bm.SHAPES[args.shape], "bytes": mb,
                    "budget_bytes": budget, "budget_share": args.budget_share, "weights": "random, fp16",
                    "embed_std": args.embed_std}
    model = calibrated_model(args, work)
    res["calibration"] = model.calibration
    run = work / f"run-{args.shape}-{args.layers}"
    res["profile"] = profile(args, model, run)
    res["profile"].pop("freq")
    preds = write_predictors(args, run, model)
    res["predictors"] = {k: v for k, v in preds.items() if k != "layers"}
    res["placement"] = place(args, run, hardware_spec(c, budget), budget)
    placement = Placement.from_run(run, model.lm.info)

    base = model.lm
    base.model.to("cpu")
    _free(args.device)
    prompt = list(range(100, 100 + args.prompt_tokens))
    res["prompt_tokens"] = len(prompt)
    P = type("Predictors", (), {"layers": preds["layers"]})()
    dt = "float16"  # the solver counted fp16 bytes; on the CPU too, so the --vram check means the same
    systems = {}
    C = functools.partial(RuntimeConfig, ctx=args.ctx, device=args.device, dtype=dt,  # the solver's --ctx: its KV
                          **({} if args.pcie_share is None else {"pcie_share": args.pcie_share}))
    plan = [("hybrid", C(vram=budget), placement, P, args.tokens, args.reps),
            ("layer-split", C(mode="layer-split", vram=budget), None, None, args.slow_tokens, 1),
            ("all-gpu", C(mode="dense"), None, None, args.tokens, args.reps),
            ("hybrid-no-prelaunch", C(vram=budget), placement, P, args.tokens, args.reps),
            ("hybrid-no-pcie", C(vram=budget, pcie_share=0.0), placement, P, args.tokens, args.reps),
            ("hybrid-no-pcie-no-prelaunch", C(vram=budget, pcie_share=0.0), placement, P, args.tokens, args.reps),
            ("hybrid-no-balance", C(vram=budget), placement, P, args.tokens, args.reps),
            ("hybrid-int8", C(vram=budget, cold_dtype="int8"), placement, P, args.tokens, args.reps),
            ("hybrid-compiled", C(vram=budget, ops="compile"), placement, P, args.tokens, args.reps),
            ("hybrid-torch-ops", C(vram=budget, ops="torch"), placement, P, args.tokens, args.reps),
            ("hybrid-no-recheck", C(vram=budget), placement, P, args.tokens, args.reps)]
    if "dense" in args.systems:
        plan.append(("dense", C(mode="dense", vram=budget), placement, None, args.slow_tokens, 1))
    plan = [p for p in plan if p[0] in args.systems]
    runs = llama_runs(args, work)
    threads = args.threads or os.cpu_count()
    others = {}  # with --interleave: llama-bench once after each round, so that hybrid's ratio to it is paired
    if args.interleave and "llama.cpp" in args.systems and runs:
        label, k, path = runs[0]  # -ngl at the budget; this process is stopped while it runs unless --in-process
        others[label] = functools.partial(lcpp.llama_bench, str(llama_binary(args, work)), path, k, threads,
                                          args.llama_tokens, 1, 120, freeze=not args.in_process)
    together = [p for p in plan if args.interleave and p[0].startswith("hybrid")]
    rounds = len(together) > 1 or (len(together) == 1 and bool(others))  # else nothing to pair
    if rounds:  # one entry that times the hybrid systems in rounds, where the first of them stood
        later = {p[0] for p in together[1:]}
        plan = [p for p in plan if p[0] not in later]
    for name, cfg, pl, pr, n_tok, reps in plan:
        in_rounds = rounds and name == together[0][0]
        group = together if in_rounds else [(name, cfg, pl, pr, n_tok, reps)]
        need = sum(args.estimates.get(g[0], 30) for g in group)
        if in_rounds:  # llama-bench once a round
            need += len(others) * group[0][5] * args.estimates["llama.cpp round"]
        if not dl.allows(need, name, skipped):
            continue
        try:
            if in_rounds:
                def on_round(partial: dict) -> None:  # the rounds so far, kept if a timeout stops the run
                    res["interleaved"] = {"partial": partial}
                    checkpoint(args, res, systems, skipped)

                rows, extra = run_interleaved(group, base, prompt, args.dram_bytes, others, on_round)
                res["interleaved"] = extra.pop("interleaved")
                systems.update(rows)
                row = rows[name]
            else:
                row, extra = run_ours(name, base, cfg, pl, pr, prompt, n_tok, reps,
                                      args.dram_bytes if name.startswith("hybrid") else None)
        except Exception as e:  # noqa: BLE001 - one system failing must not lose the others' figures
            row, extra = {"error": f"{type(e).__name__}: {e}"}, {}
            print(name, "failed:", row["error"], flush=True)
        if name == "layer-split" and "error" not in row:
            row["gpu_layers"] = layer_split_count(base, budget, None, torch.float16)
        systems[name] = row
        if "rt" in extra and not args.in_process and "fairness" not in res:
            res["fairness"] = fairness_probe(extra["rt"], prompt)
        if "rt" in extra:
            res["predictor_time"] = tl.predictor_time(P, bm.SHAPES[args.shape][0], args.device, rt=extra["rt"])
            if args.share_sweep:
                res["share_sweep"] = share_sweep(extra["rt"], prompt, n_tok, args.reps, args.share_sweep)
        del extra
        _free(args.device)
        checkpoint(args, res, systems, skipped)

    res["systems"] = systems
    del base, model
    _free(args.device)
    for key, cold_dtype in (("kernel", "bf16"), ("kernel_int8", "int8")):
        if dl.allows(20, key, skipped):
            d, n = bm.SHAPES[args.shape][:2]
            res[key] = ceil.kernel_bench(d, n, dtype=cold_dtype)
    ceil.add_floors(res, c, args.shape, args.layers, preds["bytes"])
    res["seconds"] = time.perf_counter() - dl.t0
    return res


# ---------------------------------------------------------------------------------------------------------------


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", choices=("prepare", "build", "bench", "powerinfer", "report", "all"), required=True)
    ap.add_argument("--work", type=Path, default=Path("/root/pi-bench"), help="local disk: build, GGUF, run dir")
    ap.add_argument("--out", type=Path, default=None, help="where the stage's JSON goes (on the device: $OUT)")
    ap.add_argument("--inputs", type=Path, nargs="*", default=[], help="report: stage JSON files or folders")
    ap.add_argument("--label", default=None, help="report: a suffix of the results file name (a second run that day)")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results", help="report: output folder")
    ap.add_argument("--machine-kind", default=None,
                    help="the results' machine kind, e.g. nvidia-h200 (default: from the GPU's name and count)")
    ap.add_argument("--commit", default=None,
                    help="the commit measured (wins over the checkout's .git, which a copied tree may hold stale)")
    ap.add_argument("--in-process", action="store_true",
                    help="bench: our systems and the baselines in this one process (tests, CPU smoke runs); paired "
                         "baselines then share the CPU with our threads: not a fair comparison")
    ap.add_argument("--part", choices=("ours", "accelerate"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--shape", default="llama-2-70b", choices=list(bm.SHAPES))
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-share", type=float, default=0.30, help="GPU budget as a share of the model's bytes")
    ap.add_argument("--ctx", type=int, default=512, help="KV cache the solver reserves and our systems hold (tokens)")
    ap.add_argument("--calibration-tokens", type=int, default=2048)
    ap.add_argument("--embed-std", type=float, default=bm.EMBED_STD,
                    help="token embeddings' std (0.02: the bench model before, whose statistics moved with position)")
    ap.add_argument("--profile-tokens", type=int, default=4096)
    ap.add_argument("--predictor-hidden", type=int, default=None,
                    help="default d_model/8 (1024 at d=8192); sets the gate rank")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens of the fast systems")
    ap.add_argument("--reps", type=int, default=7,
                    help="timed generations of each fast system (the median is reported)")
    ap.add_argument("--slow-tokens", type=int, default=8, help="decode tokens of layer-split, dense, accelerate")
    ap.add_argument("--llama-tokens", type=int, default=32)
    ap.add_argument("--llama-reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: all cores)")
    ap.add_argument("--systems", default="hybrid,layer-split,all-gpu,hybrid-int8,llama.cpp,accelerate",
                    help="comma list; add 'dense' for cold-on-CPU dense at the budget, "
                         "'hybrid-no-prelaunch' for hybrid "
                         "with each graph launched after the previous cold part (an A/B of runtime/fast.py), "
                         "'hybrid-no-pcie' for hybrid with the CPU reading every cold row (--pcie-share 0), "
                         "'hybrid-no-pcie-no-prelaunch' for both, "
                         "'hybrid-no-balance' for hybrid keeping the share measured at start (no balancing rounds), "
                         "'hybrid-compiled' for hybrid with torch.compile on pre's small ops (RuntimeConfig.ops), "
                         "'hybrid-torch-ops' for hybrid with torch's kernels there instead of runtime/fused.py's, "
                         "'hybrid-no-recheck' for hybrid keeping the share of its first balancing rounds for life")
    ap.add_argument("--pcie-share", type=float, default=None,
                    help="the share of marked cold rows the GPU reads over PCIe, fixed for every hybrid system "
                         "(default: "
                         "measured, then balanced in decode; an A/B in rounds fixes it so that the balancing's spread "
                         "between two builds does not decide it)")
    ap.add_argument("--share-sweep", type=lambda v: [float(x) for x in v.split(",")], default=[],
                    help="comma list of PCIe shares: after hybrid's timed generations, the same runtime at the "
                         "balanced share and at each of these in rounds (bench_systems.share_sweep)")
    ap.add_argument("--interleave", action="store_true",
                    help="build the hybrid systems of --systems side by side and time them in rounds, one generation "
                         "of each a round (an A/B whose pairs share the machine's DRAM bandwidth of the moment); each "
                         "holds its cold rows in RAM at once: at the 70B shape two bf16 hybrids fit in 128 GiB, "
                         "three did not; "
                         "with llama.cpp in --systems and built, llama-bench -ngl at the budget "
                         "runs once after each round, "
                         "so that hybrid's ratio to it is paired too")
    ap.add_argument("--dram-bytes", type=int, default=2 * 2**30)
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--time-limit", type=float, default=540, help="seconds; later systems are skipped past it")
    ap.add_argument("--powerinfer-src", type=Path, default=None,
                    help="powerinfer stage: PowerInfer's source tarball (default: ../shared/vendor/PowerInfer-src.tgz)")
    ap.add_argument("--cpu-llamacpp", action="store_true", help="build a CPU llama-bench when --device cpu")
    ap.add_argument("--python-version", default=None,
                    help="prepare: the device's Python for the wheels (default: this one)")
    args = ap.parse_args(argv)
    bad = [v for v in args.share_sweep if not 0 <= v < 1]
    if bad:
        ap.error(f"--share-sweep {bad[0]:g}: give shares in [0, 1), e.g. 0.1,0.2,0.3")
    args.systems = set(args.systems.split(","))
    args.ours_time_limit = args.time_limit
    args.predictor_hidden = args.predictor_hidden or max(16, bm.SHAPES[args.shape][0] // 8)
    args.gate_rank = max(1, (args.predictor_hidden - 2) // 2)  # the exact predictor's hidden size is 2 * rank + 2
    args.estimates = {"hybrid": 60, "layer-split": 60, "all-gpu": 40, "hybrid-int8": 60, "dense": 60, "llama.cpp": 45,
                      "accelerate": 60, "llama.cpp round": 10}  # seconds; a round: one llama-bench -r 1 (--interleave)
    if args.device == "cpu" or args.shape == "tiny":
        args.estimates = {k: 1 for k in args.estimates}
    return args


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    args.argv = [a for a in argv]  # what a child process of the bench stage runs again, with --part
    if args.stage == "prepare":
        info = lcpp.prepare(args.python_version)
        print(json.dumps(info, indent=1))
        return info
    if args.stage == "report":
        return write_results(args.inputs, args.results, kind=args.machine_kind, commit=args.commit, label=args.label)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: pass --device cpu for a smoke test")
    import numba

    args.work.mkdir(parents=True, exist_ok=True)
    out = args.out or args.work
    out.mkdir(parents=True, exist_ok=True)
    info = record.machine("numba", "transformers", "accelerate", "pulp", "highspy", "gguf")
    header = {"machine_info": info, "kind": args.machine_kind, "commit": args.commit or record.git_commit(),
              "command": record.command_line(argv), "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    common = {"numba_threads": numba.get_num_threads(), "omp_wait_policy": OMP_WAIT_POLICY,
              "args": {k: (sorted(v) if isinstance(v, set) else str(v)) for k, v in vars(args).items()}}
    done = {}
    if args.part:
        stages = [args.part]
    else:
        stages = ["build", "bench"] if args.stage == "all" else [args.stage]
    for stage in stages:
        t0 = time.perf_counter()
        path = out / f"pi_bench_{stage}.json"

        def save(res: dict, path: Path = path, t0: float = t0) -> dict:  # atomic: never a half-written file
            rec = record.make({**common, **res, "stage_seconds": time.perf_counter() - t0}, **header)
            record.write(path, rec)
            return rec

        args.save = save if stage in ("bench", "ours") else None
        if stage == "build":
            res = stage_build(args, args.work)
        elif stage == "bench":
            res = stage_bench(args, args.work, out)
        elif stage == "ours":
            res = stage_ours(args, args.work)
        elif stage == "powerinfer":
            from hotneurons.bench.bench_powerinfer import stage_powerinfer

            res = stage_powerinfer(args, args.work)
        else:
            res = stage_accelerate(args, args.work)
        res.pop("partial", None)
        if stage == "bench":
            res["goals"] = goals({**res, **common})
        rec = save(res)
        print("wrote", path, flush=True)
        done[stage] = record.flat(rec)
        _free(args.device)
    if "bench" in done:
        print(markdown(done["bench"]))
    return done


def cli() -> None:
    """The pi-bench console script."""
    main()


if __name__ == "__main__":
    main()
