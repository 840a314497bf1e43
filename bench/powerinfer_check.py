"""PowerInfer's `main` against our runtime and HF generate on a small ReGLU LLaMA exported by pi-export, as a results
record (bench/record.py): the round trip of docs/export.md.

    python -m bench.powerinfer_check --out DIR [--cuda] [--main PATH] [--results FILE]

Builds `main` from PowerInfer's source tarball (../shared/vendor/PowerInfer-src.tgz; CPU, or its CUDA build with
--cuda) in DIR/build, kept for the next run; then, for each predictor form the run can hold (normed: γ is folded into
fc1 at export; powerinfer: pre-norm as trained), and for a dReLU model (arch bamboo), builds the model and its run
(export/roundtrip.py), exports it and compares the greedy tokens of the three. Two controls show that the comparison
can fail: a threshold above every logit (PowerInfer computes no FFN neuron) and the normed predictor exported without
folding γ. Last, the ReGLU model with trained powerinfer-form predictors (pi-profile, pi-train-predictors --form
powerinfer, pi-export): PowerInfer's tokens against ours.

Threads: PowerInfer's CPU down-projection adds each thread's partial sums into the shared output without a lock
(ggml.c:14433-14457), so with more threads its tokens can part from HF's; its CUDA build refuses 1 thread
(ggml.c:16719). --threads (main's -t for the comparisons) is therefore 1 on the CPU build and 2 with --cuda (a CUDA
main given with --main needs --threads 2 or more), and `main` is run --repeats times alike at each of --race-threads
(1 and 2 on the CPU build, 2 and 16 with --cuda) so that the record shows the race.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch
from hotneurons.models.family import step as hf_step

from bench import ROOT, record

TARBALL = ROOT.parent / "shared" / "vendor" / "PowerInfer-src.tgz"
CMAKE_FLAGS = ["-DLLAMA_BUILD_TESTS=OFF", "-DCMAKE_BUILD_TYPE=Release"]
CUDA_FLAGS = ["-DLLAMA_CUBLAS=ON", "-DCMAKE_CUDA_ARCHITECTURES=90"]


def build(tarball: Path, work: Path, cuda: bool = False, jobs: int = 2) -> dict:
    """PowerInfer's `main`, built with cmake (Ninja where installed) from the tarball in work/; reused when built."""
    kind = "cuda" if cuda else "cpu"
    src, out = work / "PowerInfer", work / f"build-{kind}"
    binary = out / "bin" / "main"
    if binary.exists():
        return {"binary": str(binary), "seconds": 0.0, "cached": True, "kind": kind}
    if shutil.which("cmake") is None:
        raise SystemExit("cmake is not on PATH: install it (apt-get install cmake, or pip install cmake)")
    if not (src / "CMakeLists.txt").exists():
        if not tarball.exists():
            raise SystemExit(f"no {tarball}: pass --tarball, or --main with a built PowerInfer main")
        with tarfile.open(tarball) as t:
            t.extractall(work, filter="data")
    env = dict(os.environ)
    if cuda and Path("/usr/local/cuda/bin").exists():
        env["PATH"] = f"/usr/local/cuda/bin:{env['PATH']}"
    flags = CMAKE_FLAGS + (CUDA_FLAGS if cuda else []) + (["-G", "Ninja"] if shutil.which("ninja") else [])
    t0 = time.perf_counter()
    for cmd in (["cmake", "-S", str(src), "-B", str(out), *flags],
                ["cmake", "--build", str(out), "--target", "main", "-j", str(jobs)]):
        print("+", " ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, env=env, stdout=sys.stderr)
    return {"binary": str(binary), "seconds": round(time.perf_counter() - t0, 1), "cached": False, "kind": kind,
            "cmake_flags": flags}


def unfolded_control(work: Path, main: Path, n: int, threads: int, extra: list[str]) -> dict:
    """The normed run's predictors written as they are (γ not folded into fc1) through write_powerinfer: PowerInfer then
    decides from W_gate·x_pre instead of W_gate·diag(γ)·x_pre, and its tokens should part from HF's."""
    import numpy as np
    from hotneurons.export import roundtrip as rt
    from hotneurons.export import vocab_from_tokenizer, write_powerinfer
    from hotneurons.export.predictors import read_predictors
    from hotneurons.models.family import load_model

    lm = load_model(str(work / "model"), device="cpu", dtype="float32")
    cfg = lm.model.config
    layers, thresholds, form = read_predictors(work / "run", cfg.num_hidden_layers)
    counts = [np.zeros(cfg.intermediate_size, np.int64)] * cfg.num_hidden_layers
    out = work / "unfolded"
    write_powerinfer(lm.model, vocab_from_tokenizer(lm.tokenizer, cfg.vocab_size), layers, 0.0, counts, None, 0, out,
                     force=True)
    return rt.powerinfer_tokens(main, out / "model.powerinfer.gguf", rt.PROMPT, n, threads, extra=extra)


def f16_attention(lm) -> list:
    """Hooks that round attention's matmul inputs (and the LM head's) and the keys and values to float16, as ggml's
    F16 path does (activations converted to F16 for each vec_dot, an F16 KV cache): our runtime then computes the
    residual stream PowerInfer computes, up to summation order."""
    def rounded(_m, args):
        return (args[0].half().float(),)

    def rounded_out(_m, _args, out):
        return out.half().float()

    handles = [lm.model.lm_head.register_forward_pre_hook(rounded)]
    for layer in lm.layers:
        a = layer.self_attn
        handles += [m.register_forward_pre_hook(rounded) for m in (a.q_proj, a.k_proj, a.v_proj, a.o_proj)]
        handles += [m.register_forward_hook(rounded_out) for m in (a.k_proj, a.v_proj)]
    return handles


@torch.no_grad()
def predictor_f16_flips(run: Path, prompt: str, n: int) -> list[dict]:
    """Along our own greedy trajectory (prompt fed token by token): each step's token, its top-two logit margin, and per
    layer how many predictor decisions change when fc1, fc2 and their inputs are rounded to float16 as PowerInfer's
    matmuls round them (F16 weights, activations converted to F16 for each vec_dot, float accumulation)."""
    from hotneurons.runtime.generate import RuntimeConfig, prompt_ids
    from hotneurons.runtime.load import load_runtime
    from safetensors.torch import load_file

    t = load_file(str(run / "predictors" / "predictors.safetensors"))
    r = load_runtime(run, RuntimeConfig(device="cpu", threads=1, static_decode=False))
    seen: list = []
    handles = [layer.post_attention_layernorm.register_forward_pre_hook(
        lambda _m, args, i=i: seen.append((i, args[0].reshape(-1).clone()))) for i, layer in enumerate(r.lm.layers)]
    ids, cache, steps = prompt_ids(r, prompt), None, []
    for tok in ids[:-1]:
        cache = hf_step(r.lm.model, torch.tensor([[tok]]), cache)[1]
    nxt = ids[-1]
    for _ in range(n):
        seen.clear()
        logits, cache = hf_step(r.lm.model, torch.tensor([[nxt]]), cache)
        top = logits[0, -1].topk(2)
        nxt = int(top.indices[0])
        flips = []
        for i, x in seen:  # x (d,): the residual entering layer i's FFN block
            f1, f2, thr = t[f"layers.{i}.fc1.weight"], t[f"layers.{i}.fc2.weight"], float(t[f"layers.{i}.threshold"])
            exact = f2 @ torch.relu(f1 @ x) >= thr  # (n,)
            h = torch.relu(f1.half().float() @ x.half().float()).half().float()  # (r,)
            flips.append(int(((f2.half().float() @ h >= thr) != exact).sum()))
        steps.append({"token": nxt, "top2_margin": round(float(top.values[0] - top.values[1]), 4),
                      "decisions_flipped_per_layer": flips})
    for h in handles:
        h.remove()
    return steps


def trained(work: Path, main: Path, n: int, threads: int, extra: list[str]) -> dict:
    """The round trip's model with trained predictors: pi-profile on a small corpus, every neuron on the CPU (as in
    PowerInfer's CPU build, where the predictor decides for all of them), pi-train-predictors --form powerinfer,
    pi-export. The predictor is approximate now, so HF's tokens part from both runtimes; PowerInfer's and ours are
    compared with the long prompt (our prompt pass is dense, PowerInfer's sparse), with our prompt fed one token at a
    time (sparse like PowerInfer's), also with attention rounded to float16 as ggml computes it (f16_attention), and
    with a one-token prompt."""
    import numpy as np
    import pandas as pd
    from hotneurons.artifacts.placement import PlacementMeta
    from hotneurons.artifacts.profile import ProfileMeta
    from hotneurons.common import artifacts
    from hotneurons.export import export_run
    from hotneurons.export import roundtrip as rt

    model, run = work / "model", work / "trained"
    corpus = rt.write_corpus(work / "corpus.jsonl")
    py = [sys.executable, "-m"]
    t0 = time.perf_counter()
    subprocess.run([*py, "hotneurons.profiler", "--model", str(model), "--out", str(run), "--dataset", str(corpus),
                    "--tokens", "8192", "--seq-len", "128", "--samples-per-layer", "4096", "--device", "cpu",
                    "--quiet", "--force"], check=True, stdout=sys.stderr)
    info = ProfileMeta.load(run / "profile" / "meta.json").model
    L, nn = info["n_layers"], info["n_neurons"]
    with artifacts.staged(run / "placement") as tmp:
        artifacts.write_parquet(tmp / "placement.parquet", pd.DataFrame({
            "layer": np.repeat(np.arange(L, dtype=np.int32), nn), "neuron": np.tile(np.arange(nn, dtype=np.int32), L),
            "gpu": np.zeros(L * nn, bool)}))
        PlacementMeta(model=info).save(tmp / "meta.json")
    subprocess.run([*py, "hotneurons.predictors", "train", "--run", str(run), "--form", "powerinfer", "--preset",
                    "fast", "--device", "cpu", "--quiet", "--force"], check=True, stdout=sys.stderr)
    summary = export_run(run, work / "trained-export", force=True)
    gguf = work / "trained-export" / summary["files"]["model"]
    pred = artifacts.read_json(run / "predictors" / "summary.json")["totals"]
    out = {"pipeline_seconds": round(time.perf_counter() - t0, 1), "sparse_threshold": summary["sparse_threshold"],
           "predictor_test_recall": pred["mean_recall"], "predictor_test_sparsity": pred["mean_predicted_sparsity"],
           "placement": "every neuron on the CPU", "prompts": {}}
    for name, prompt in (("long", rt.PROMPT), ("one_token", "T")):
        hf = rt.hf_tokens(model, prompt, n)["tokens"]
        ours = rt.our_tokens(run, prompt, n, threads)["tokens"]
        step = rt.our_tokens_stepwise(run, prompt, n, threads)["tokens"]
        emulated = rt.our_tokens_stepwise(run, prompt, n, threads, hooks=f16_attention)["tokens"]
        pi = rt.powerinfer_tokens(main, gguf, prompt, n, threads, logdir=work / f"trained-{name}", extra=extra)
        pt = pi.get("tokens", [])
        out["prompts"][name] = {
            "prompt": prompt, "hf": hf, "ours": ours, "ours_prompt_one_token_at_a_time": step, "powerinfer": pt,
            "error": pi.get("error"), "powerinfer_vs_ours_matched": rt.common_prefix(pt, ours),
            "ours_stepwise_f16_attention": emulated,
            "powerinfer_vs_ours_stepwise_matched": rt.common_prefix(pt, step),
            "powerinfer_vs_ours_stepwise_f16_attention_matched": rt.common_prefix(pt, emulated),
            "powerinfer_vs_hf_matched": rt.common_prefix(pt, hf), "ours_vs_hf_matched": rt.common_prefix(ours, hf)}
        print(f"trained, {name} prompt: " + ", ".join(f"{k} {v}" for k, v in out["prompts"][name].items()
                                                      if k.endswith("matched")), file=sys.stderr)
    out["prompts"]["one_token"]["ours_stepwise_steps"] = predictor_f16_flips(run, "T", n)
    return out


def repeated(main: Path, gguf: Path, n: int, threads: int, times: int, logs: Path, extra: list[str],
             hf: list[int]) -> dict:
    """`main` run `times` times alike: how many runs give HF's tokens, and where the others part from them."""
    from hotneurons.export import roundtrip as rt

    parted = [r["matched"] for r in rt.repeated_runs(main, gguf, rt.PROMPT, n, threads, times, logs, hf, extra)
              if r["matched"] < n]
    return {"runs": times, "equal_to_hf": times - len(parted), "parted_at_token": parted}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="work folder: the build, the models, the exports")
    p.add_argument("--tarball", type=Path, default=TARBALL)
    p.add_argument("--main", type=Path, default=None, help="a built PowerInfer main (skips the build)")
    p.add_argument("--cuda", action="store_true", help="build with CUDA (LLAMA_CUBLAS; sm_90)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    p.add_argument("--threads", type=int, default=None,
                   help="main's -t and our runtime's threads [1; 2 with --cuda: a CUDA main needs 2 or more]")
    p.add_argument("-n", "--new-tokens", type=int, default=16, help="greedy tokens each system generates")
    p.add_argument("--vram-budget", type=float, default=None, help="CUDA build: main's --vram-budget in GiB")
    p.add_argument("--repeats", type=int, default=50, help="runs of main per thread count of --race-threads alike")
    p.add_argument("--race-threads", type=int, nargs="+", default=None,
                   help="main's thread counts for the repeated runs [1 2; 2 16 with --cuda]")
    p.add_argument("--skip-trained", action="store_true",
                   help="leave out the trained-predictor part (it needs the profiler's packages: datasets)")
    p.add_argument("--results", type=Path, default=None,
                   help="results file [bench/results/<date>-<machine kind>-powerinfer-roundtrip.json]")
    p.add_argument("--machine-kind", default=None)
    p.add_argument("--commit", default=None)
    a = p.parse_args(argv)
    if a.threads is None:
        a.threads = 2 if a.cuda else 1
    if a.race_threads is None:
        a.race_threads = [2, 16] if a.cuda else [1, 2]
    from hotneurons.export import roundtrip as rt

    a.out.mkdir(parents=True, exist_ok=True)
    built = {"binary": str(a.main), "cached": True, "kind": "given"} if a.main else build(a.tarball, a.out, a.cuda,
                                                                                              a.jobs)
    main_bin = Path(built["binary"])
    extra = ["--vram-budget", str(a.vram_budget)] if a.vram_budget is not None else []
    runs, matched = {}, {}
    for name, form, act in (("normed", "normed", "reglu"), ("powerinfer", "powerinfer", "reglu"),
                            ("drelu-powerinfer", "powerinfer", "drelu")):
        res = rt.roundtrip(a.out / f"roundtrip-{name}", main_bin, form=form, n=a.new_tokens, threads=a.threads,
                           main_args=extra, activation=act)
        runs[name] = res
        matched[name] = {k: res.get(k) for k in ("ours_vs_hf_matched", "powerinfer_vs_hf_matched",
                                                 "powerinfer_vs_ours_matched", "prompt_ids_equal", "all_equal")}
        print(f"{name}: {matched[name]}", file=sys.stderr)
    normed = a.out / "roundtrip-normed"
    hf = runs["normed"]["hf"]["tokens"]
    gguf = normed / "export" / "model.powerinfer.gguf"
    off = rt.powerinfer_tokens(main_bin, gguf, rt.PROMPT, a.new_tokens, a.threads, logdir=normed / "off", extra=extra,
                               env={"LLAMA_SPARSE_PRED_THRESHOLD": "1e30"})
    unfolded = unfolded_control(normed, main_bin, a.new_tokens, a.threads, extra)
    repeats = {t: repeated(main_bin, gguf, a.new_tokens, t, a.repeats, normed / f"t{t}", extra, hf)
               for t in a.race_threads}
    with_training = None
    if not a.skip_trained:
        try:
            with_training = trained(normed, main_bin, a.new_tokens, a.threads, extra)
        except (subprocess.CalledProcessError, ImportError) as e:  # recorded: the round trip above stands alone
            with_training = {"error": f"{type(e).__name__}: {e}"}
    controls = {
        "threshold_above_every_logit": {**off, "vs_hf_matched": rt.common_prefix(off.get("tokens", []), hf)},
        "normed_predictor_without_gamma": {**unfolded, "vs_hf_matched": rt.common_prefix(unfolded.get("tokens", []),
                                                                                         hf)},
    }
    figures = {"powerinfer_build": built, "tarball": str(a.tarball), "new_tokens": a.new_tokens, "threads": a.threads,
               "matched": matched,
               "controls": {k: {"vs_hf_matched": v["vs_hf_matched"], "tokens": v.get("tokens"),
                                "error": v.get("error")} for k, v in controls.items()},
               "repeated_runs_by_threads": repeats, "trained_predictors": with_training, "runs": runs,
               "control_runs": controls}
    return record.write_dated("powerinfer-roundtrip", figures, path=a.results, kind=a.machine_kind, commit=a.commit)


if __name__ == "__main__":
    main()
