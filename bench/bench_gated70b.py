"""A Llama-3-70B-shaped GATED model (SwiGLU, d 8192, FFN 28,672, 64 heads, 8 KV heads, vocabulary 128,256) at Q4_0 in
a 24 GiB GPU budget, run as downloaded: no predictor, the gate of each neuron its own (common/gating.py). RANDOM
weights whose gates are calibrated (bench_gguf.write_model, activation swiglu) so that each neuron's pass rate at the
gate threshold follows a measured profile's pass frequencies (--rates: a real model's, e.g. SmolLM2-135M's at the
same criterion and sparsity): speed and memory, not quality (docs/gated.md has the quality).

Stages, each within one 10-minute call on the GPU machine, sharing --work while the machine stays up:
  build     the model into WORK/model.gguf layer by layer and a text corpus (bench_70b's)
  pipeline  pi-profile --criterion C --target-sparsity S (layer by layer, no samples), pi-solve --vram --measure
  ours      in child processes, one per variant: the hybrid with the gate mask (`gate`), the same layout with every
            cold neuron computed (`dense`: sparsity off), and all on the GPU sparse and dense (`gpu-gate`,
            `gpu-dense`: TEAL's comparison); each as bench_70b's child measures it (load, decode 32 / 256, prefill 512)
  llamacpp  bench_70b's: llama.cpp -ngl N (the most layers that fit --vram), all on the GPU, the CPU alone
  report    bench/results/<date>-<kind>-gated70b.{json,md}
CPU smoke run: --device cpu --shape tiny --layers 2 --ctx 256 --vram 1100MiB (build, pipeline, ours).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from bench import bench_70b as b70

VARIANTS = ("gate", "dense", "gpu-gate", "gpu-dense")  # a gate variant may name its criterion: gate@h, gpu-gate@gate-h


def _kind(variant: str) -> str:
    return variant.split("@")[0]


def rates_from_profile(run: Path, criterion: str, sparsity: float, out: Path, points: int = 1000) -> dict:
    """A real model's per-neuron pass frequencies at (criterion, sparsity), pooled over its layers (RUN/profile/
    passes.safetensors / tokens), as `points` quantiles: what --rates reads (bench_gguf.resampled draws from them)."""
    import numpy as np
    from hotneurons.common.gating import key
    from safetensors.numpy import load_file

    meta = json.loads((run / "profile" / "meta.json").read_text())
    counts = load_file(str(run / "profile" / "passes.safetensors"))[f"{criterion}@{key(sparsity)}"]  # (layers, n)
    f = counts.astype(np.float64) / meta["tokens"]
    q = np.quantile(f.ravel(), (np.arange(points) + 0.5) / points)
    top = np.sort(f, axis=1)[:, ::-1][:, : int(round(0.2 * f.shape[1]))].sum(1) / f.sum(1)  # (layers,)
    rec = {"rates": np.round(q, 6).tolist(), "model": meta["model"]["name"], "criterion": criterion,
           "sparsity": sparsity, "tokens": meta["tokens"], "mean": float(f.mean()),
           "top20_share_per_layer_mean": float(top.mean())}
    out.write_text(json.dumps(rec))
    return rec


def stage_build(a) -> dict:
    import numpy as np

    from bench import memory_models as mm
    from bench.bench_gguf import write_model

    rates = np.asarray(json.loads(Path(a.rates).read_text())["rates"]) if a.rates else None
    t0 = time.perf_counter()
    info = write_model(a.shape, a.layers, a.work / "model.gguf", a.device, seed=a.seed,
                       calibration_tokens=a.calibration_tokens, activation="swiglu", rates=rates,
                       mean=1 - a.sparsity)
    mm.write_corpus(a.work / "corpus.txt", 8 * a.profile_tokens)
    return {**info, "rates": a.rates, "build_s": round(time.perf_counter() - t0, 1)}


def stage_pipeline(a) -> dict:
    import shutil

    run, gguf = a.work / "run", a.work / "model.gguf"
    shutil.rmtree(run, ignore_errors=True)
    rows = {"profile": b70._run([b70._tool("pi-profile"), "--model", str(gguf), "--out", str(run), "--dataset",
                                 str(a.work / "corpus.txt"), "--tokens", str(a.profile_tokens), "--seq-len", "512",
                                 "--samples-per-layer", "0", "--device", a.device, "--criterion", a.criterion,
                                 "--target-sparsity", str(a.sparsity), "--calibration-tokens",
                                 str(a.calibration_tokens), "--batch-size", "4", "--quiet"], 560)}
    rows["profile"].pop("stdout")
    solve = b70._run([b70._tool("pi-solve"), "--run", str(run), "--vram", a.vram, "--dtype", "q4_0", "--cold-dtype",
                      "q4_0", "--ctx", str(a.ctx), "--hardware", a.hardware, "--reserve", a.reserve, "--json"]
                     + (["--measure"] if a.measure else []), 300)
    rows["solve"] = {**solve, "summary": json.loads(solve.pop("stdout"))}
    rows["predictors"] = {"bytes": 0}  # none: the gates are their own predictors
    gated = json.loads((run / "profile" / "meta.json").read_text()).get("gated") or {}
    rows["skew"] = {k: gated.get(k, {}).get(a.criterion) for k in ("pass_share", "top20_share")}
    return rows


def stage_ours(a) -> dict:
    out = {}
    for v in a.variants.split(","):
        argv = [sys.executable, "-m", "bench.bench_gated70b", "--stage", "ours-child", "--variant", v,
                "--work", str(a.work), "--device", a.device, "--vram", a.vram, "--ctx", str(a.ctx), "--sparsity",
                str(a.sparsity), "--criterion", a.criterion]
        res = b70.measured(argv, 560, pattern=r"first token")
        if res["exit_code"] != 0:
            out[v] = {"error": res["stderr_tail"][-3000:]}
            continue
        child = json.loads((a.work / f"ours-{v}.json").read_text())
        out[v] = {**child, "load_to_first_token_s": res["first_output_s"],
                  "host_peak_rss_bytes": res["peak_rss_bytes"], "host_peak_anon_bytes": res["peak_anon_bytes"],
                  "gpu_peak_bytes": res["gpu_peak_bytes"], "gguf_bytes": (a.work / "model.gguf").stat().st_size}
    return out


def ours_child(a) -> None:
    """One variant in its own process, as bench_70b's child measures it (its runs, written to WORK/ours-V.json)."""
    from hotneurons.common.units import parse_bytes
    from hotneurons.runtime.config import RuntimeConfig

    kind, _, crit = a.variant.partition("@")
    gpu = kind.startswith("gpu-")
    cfg = RuntimeConfig(device=a.device, vram=None if gpu else parse_bytes(a.vram), ctx=a.ctx,
                        sparsity=a.sparsity if kind.endswith("gate") else 0.0, criterion=crit or a.criterion)
    if gpu:  # every neuron on the device: the run's profile (thresholds) with a placement of all of them
        from hotneurons.artifacts.placement import Placement
        from hotneurons.runtime.load import load_source_runtime

        def load():
            meta = json.loads((a.work / "run" / "profile" / "meta.json").read_text())
            m = meta["model"]
            mask = Placement.uniform(m["n_layers"], m["n_neurons"], True)
            return load_source_runtime(a.work / "run", meta, cfg, placement=mask)
    else:
        from hotneurons.runtime.load import load_runtime

        def load():
            return load_runtime(a.work / "run", cfg)
    b70.ours_child(a, load=load, out=a.work / f"ours-{a.variant}.json")


def report(stages: dict[str, dict]) -> dict:
    ours, lc = stages["ours"], stages.get("llamacpp", {})
    systems = {}
    for v, row in ours.items():
        if _kind(v) in VARIANTS and isinstance(row, dict) and "error" not in row:
            systems[f"ours {v}"] = {k: row.get(k) for k in b70.SYSTEM_KEYS} | {
                "ffn_sparsity": row["ffn_sparsity"], "gpu_activation_share": row["gpu_activation_share"],
                "bytes_gpu": row["bytes_gpu"], "bytes_cpu": row["bytes_cpu"]}
    for name, row in lc.items():
        if name.startswith("llama.cpp") and "error" not in row:
            systems[name] = {k: row.get(k) for k in b70.SYSTEM_KEYS}
    split = next((n for n in systems if n.startswith("llama.cpp -ngl")), None)

    def ratio(a: str, b: str | None, n: str = "256") -> float | None:
        x, y = (systems.get(s or "", {}).get("decode_tok_s") or {} for s in (a, b))
        return x[n] / y[n] if x.get(n) and y.get(n) else None

    goals = {}
    for name in systems:  # every gate variant against the layer split and its own sparsity-off twin
        v = name.removeprefix("ours ")
        if _kind(v) == "gate":
            goals[f"{v}_vs_layer_split"] = ratio(name, split)
            goals[f"{v}_vs_sparsity_off"] = ratio(name, "ours dense")
            goals[f"{v}_vs_llamacpp_all_gpu"] = ratio(name, "llama.cpp all layers on the GPU")
        elif _kind(v) == "gpu-gate":
            goals[f"{v}_vs_gpu_dense"] = ratio(name, "ours gpu-dense")
    pipe = stages["pipeline"]
    return {"shape": stages["build"]["shape"], "layers": stages["build"]["layers"],
            "gguf_bytes": next((r["gguf_bytes"] for r in ours.values() if isinstance(r, dict) and "gguf_bytes" in r),
                               None),
            "gpu_budget_bytes": pipe["solve"]["summary"]["flags"]["vram_bytes"],
            "calibration": stages["build"]["calibration"], "rates": stages["build"].get("rates"),
            "skew": pipe.get("skew"), "systems": systems,
            "goals": goals}


def markdown(fig: dict) -> str:
    gb = lambda b: "-" if b is None else f"{b / 1e9:.1f} GB"  # noqa: E731
    lines = [f"# {fig['shape']} shape (SwiGLU), {fig['layers']} layers, Q4_0 GGUF of {gb(fig['gguf_bytes'])}: random "
             f"weights, gate pass rates calibrated to {fig['rates'] or 'a power law'}", "",
             "| system | decode tok/s (32 / 256) | prefill tok/s (512) | FFN sparsity | host peak RSS | GPU |",
             "|---|---|---|---|---|---|"]
    for name, r in fig["systems"].items():
        cell, pre = b70.rate_cells(r)
        sp = "-" if r.get("ffn_sparsity") is None else f"{r['ffn_sparsity']:.1%}"
        lines.append(f"| {name} | {cell} | {pre} | {sp} | {gb(r.get('host_peak_rss_bytes'))} | "
                     f"{gb(r.get('gpu_peak_bytes'))} |")
    lines += ["", "Goals: " + ", ".join(f"{k} {v:.2f}" for k, v in fig["goals"].items() if v is not None), ""]
    return "\n".join(lines)


def stage_report(a) -> dict:
    return b70.stage_report(a, STAGES, report, markdown, "gated70b")


STAGES = {"build": stage_build, "pipeline": stage_pipeline, "ours": stage_ours, "llamacpp": b70.stage_llamacpp}


def parse(argv=None):
    p = b70.parser(__doc__, stages=[*STAGES, "report", "ours-child"])
    p.set_defaults(shape="llama-3-70b", work=Path.home() / ".cache" / "hotneurons" / "gated70b")
    p.add_argument("--sparsity", type=float, default=0.5, help="The target FFN sparsity (the profile's thresholds).")
    p.add_argument("--criterion", default="gate", help="pi-profile's --criterion (gate, h, gate-h).")
    p.add_argument("--rates", default=None, help="build: a JSON {'rates': [...]} of per-neuron pass frequencies at "
                   "that criterion and sparsity (a real model's profile: bench/gated_quality.py writes one); default: "
                   "a power law of mean 1 - sparsity")
    p.add_argument("--variants", default=",".join(VARIANTS), help="ours: which of " + ", ".join(VARIANTS))
    p.add_argument("--variant", default="gate", help="ours-child: the one to run")
    return p.parse_args(argv)


def main(argv=None) -> None:
    b70.run(parse(argv), STAGES, ours_child, stage_report, markdown)


if __name__ == "__main__":
    main()
