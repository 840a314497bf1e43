"""A real sparse model end to end: relufy SmolLM2-135M-Instruct, then profile, solve, train predictors,
evaluate and generate on it (the GPU machine; the relufied weights never leave it).

Stages (each under 10 minutes on one GPU; they share files through --work, so run them on one machine):
  sweep     relufy with each of --configs (JSON list of {"name", **RelufyConfig fields}) from one shared data pool;
            each model kept in WORK/models/NAME, each summary in OUT/sweep-NAME.json
  pipeline  pi-profile -> pi-solve -> pi-train-predictors -> pi-eval -> pi-generate on WORK/models/NAME, all
            through the CLIs a user runs; OUT/pipeline-NAME.json
  roundtrip pi-export's check on a relufied model with trained predictors: a short ReLU relufy (corpus rows only),
            pi-profile, pi-solve, pi-train-predictors --form powerinfer, pi-export, PowerInfer's CUDA main (built from
            --powerinfer-src, --rt-threads) against HF and our runtime, greedy; beside it the same model with exact
            predictors (export/roundtrip.make_run) against HF, which separates the trained predictor from
            PowerInfer's path; then both exports at 2, 4 and 16 threads, 3 runs each (PowerInfer's CPU
            down-projection races); OUT/roundtrip.json
  formats   the storage formats' cost in perplexity on both models: relufy into WORK/models/NAME (--relufy-preset,
            default quick, KL on corpus rows only; a model already there is reused), then pi-profile and pi-eval
            --mode dense --row-format bf16,q8_0,q4_0,q4_1 on it and on the original GGUF ->
            OUT/<date>-<kind>-format-quality-relufied.{json,md} (for bench/results/)
  report    (anywhere) the sweep and pipeline files (--inputs) -> bench/results/<date>-<kind>-relufy.{json,md}

The corpus is the Wikipedia sample as one .txt file per article (--wiki DIR with train/ and eval/, written by
`--stage wiki` on a machine with gensim), since the GPU image has neither gensim nor `datasets`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

from bench import record
from bench.relufy_report import report


def write_wiki(out: Path) -> None:
    from hotneurons.common.corpus import wikipedia_sample

    for split in ("train", "eval"):
        d = out / split
        d.mkdir(parents=True, exist_ok=True)
        for i, text in enumerate(wikipedia_sample(split)):
            (d / f"{i:04d}.txt").write_text(text, encoding="utf-8")


def sweep(args) -> None:
    import torch
    from hotneurons.models.family import load_model
    from hotneurons.relufy.distill import relufy
    from hotneurons.relufy.relufy import RelufyConfig, build_pool, plain_model

    configs = json.loads(args.configs)
    known = {f.name for f in fields(RelufyConfig)}
    base = RelufyConfig(dataset=str(Path(args.wiki) / "train"), eval_dataset=str(Path(args.wiki) / "eval"))
    lm = load_model(args.gguf, device="cpu", dtype="float32")
    work, out = Path(args.work), Path(args.out)
    pool_path = work / "pool.safetensors"
    from safetensors.torch import load_file, save_file

    if pool_path.exists():
        pool = load_file(str(pool_path))["pool"]
    else:
        t0 = time.perf_counter()
        teacher = plain_model(lm, torch.bfloat16, "cuda")
        pool = build_pool(teacher, lm.tokenizer, base, progress=False)
        del teacher
        save_file({"pool": pool}, str(pool_path))
        print(f"pool: {tuple(pool.shape)} in {time.perf_counter() - t0:.0f} s", flush=True)
    for c in configs:
        name = c.pop("name")
        cfg = replace(base, **{k: v for k, v in c.items() if k in known})
        t0 = time.perf_counter()
        s = relufy(None, work / "models" / name, cfg, device="cuda", force=True, progress=False, lm=lm, pool=pool)
        s["name"] = name
        s["machine"] = record.machine()
        (out / f"sweep-{name}.json").write_text(json.dumps(s, indent=1))
        ev = s["eval"]
        print(f"{name}: ppl {ev['original']['perplexity']:.2f} -> {ev['relufied']['perplexity']:.2f} "
              f"({ev['perplexity_ratio']:.3f}x), zeros {ev['relufied']['ffn_sparsity']:.1%}, "
              f"{s['tokens_per_s']:.0f} tok/s, {time.perf_counter() - t0:.0f} s", flush=True)


def _cli(cmd: list[str], log: list) -> dict:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    entry = {"command": " ".join(cmd), "rc": r.returncode, "seconds": round(time.perf_counter() - t0, 1),
             "stderr_tail": r.stderr[-1500:]}
    log.append(entry)
    print(f"[{entry['seconds']:6.1f} s rc={r.returncode}] {entry['command']}", flush=True)
    if r.returncode != 0:
        print(r.stderr[-3000:], flush=True)
        return {}
    return json.loads(r.stdout)  # --json: stdout holds the JSON alone


def pipeline(args) -> None:
    work, out = Path(args.work), Path(args.out)
    model = str(work / "models" / args.name)
    run = str(work / "runs" / args.name)
    train, held = str(Path(args.wiki) / "train"), str(Path(args.wiki) / "eval")
    log: list = []
    res: dict = {"name": args.name, "model": model, "commands": log, "machine": record.machine()}
    res["profile"] = _cli(["pi-profile", "--model", model, "--dataset", train, "--tokens", str(args.profile_tokens),
                           "--samples-per-layer", str(args.samples), "--out", run, "--force", "--quiet", "--json"], log)
    res["solve"] = _cli(["pi-solve", "--run", run, "--vram", args.vram, "--reserve", "0", "--json"], log)
    res["predictors"] = _cli(["pi-train-predictors", "--run", run, "--json", "--quiet"], log)
    res["eval"] = _cli(["pi-eval", "--run", run, "--dataset", held, "--tokens", str(args.eval_tokens), "--json",
                        "--quiet"], log)
    prompt = "The capital of France is"
    gen = {}
    for label, extra in (("cpu-dense", ["--device", "cpu", "--mode", "dense"]),
                         ("cpu-hybrid", ["--device", "cpu"]),
                         ("cuda-dense", ["--device", "cuda", "--mode", "dense"]),
                         ("cuda-hybrid", ["--device", "cuda"])):
        gen[label] = _cli(["pi-generate", "--run", run, "--prompt", prompt, "-n", str(args.new_tokens), "--json",
                           "--threads", "16", *extra], log)
    res["generate"] = gen
    chats = {}
    for q in ("What is the capital of France? Answer in one sentence.", "Name three primary colors.",
              "Write one sentence about the sea."):
        chats[q] = {m: _cli(["pi-generate", "--model", mdl, "--chat", "--prompt", q, "-n", "40", "--mode", "dense",
                             "--json"] + (["--gguf-file", Path(args.gguf).name] if m == "original" else []), log)
                    for m, mdl in (("original", str(Path(args.gguf).parent)), ("relufied", model))}
    res["chat"] = chats
    (out / f"pipeline-{args.name}.json").write_text(json.dumps(res, indent=1))


def formats(args) -> None:
    work = Path(args.work)
    model = work / "models" / args.name
    train, held = str(Path(args.wiki) / "train"), str(Path(args.wiki) / "eval")
    info = record.machine()
    kind = record.machine_kind(info)
    path = Path(args.out) / f"{time.strftime('%Y-%m-%d')}-{kind}-format-quality-relufied.json"
    log: list = []
    res: dict = {"commands": log, "row_formats": args.row_formats.split(","), "eval_tokens": args.eval_tokens,
                 "relufy": None, "models": {}}

    def save() -> None:  # after each model: a call that runs out of time still brings back what it measured
        rec = record.write_result(path, res, machine_info=info, kind=kind, commit=record.git_commit(args.commit))
        path.with_suffix(".md").write_text(formats_md(rec))
        print(f"wrote {path} and its .md", flush=True)

    # the original first: it needs no training, so its rows come back even if the relufication runs long
    _format_rows(args, "original", args.gguf, train, held, work, res, log)
    save()
    res["relufy"] = _relufied(args, model, train, held, log)
    _format_rows(args, "relufied", str(model), train, held, work, res, log)
    save()


def _relufied(args, model: Path, train: str, held: str, log: list) -> dict:
    """Relufy the GGUF into `model` unless a model is there (from an earlier call: its summary says how it was made);
    the summary's figures."""
    from hotneurons.relufy.distill import relufy
    from hotneurons.relufy.relufy import preset

    if not (model / "config.json").exists():
        # corpus rows only: the teacher's samples (minutes) keep chat behaviour, which perplexity does not measure
        cfg = replace(preset(args.relufy_preset), dataset=train, eval_dataset=held, teacher_text=0.0,
                      **({"tokens": args.relufy_tokens} if args.relufy_tokens else {}))
        t0 = time.perf_counter()
        relufy(args.gguf, model, cfg, device=args.device, force=True, progress=False)
        log.append({"command": f"relufy({args.gguf!r}, {str(model)!r}, {asdict(cfg)})",
                    "seconds": round(time.perf_counter() - t0, 1)})
    s = json.loads((model / "summary.json").read_text())
    ev = s["eval"]
    print(f"relufied: ppl x{ev['perplexity_ratio']:.3f}, zeros {ev['relufied']['ffn_sparsity']:.1%}", flush=True)
    return {"model": str(model), "activation": s["activation"], "tokens": s["tokens"], "seconds": s["seconds"],
            "teacher_text": s["config"]["teacher_text"], "perplexity_original": ev["original"]["perplexity"],
            "perplexity_relufied": ev["relufied"]["perplexity"], "perplexity_ratio": ev["perplexity_ratio"],
            "ffn_sparsity": ev["relufied"]["ffn_sparsity"]}


def _format_rows(args, label: str, model: str, train: str, held: str, work: Path, res: dict, log: list) -> None:
    """pi-profile (pi-eval needs a run) and pi-eval --row-format on `model`: res["models"][label]."""
    from hotneurons.weights.formats import bytes_per_weight

    run = str(work / "runs" / f"formats-{label}")
    # float32 compute: fp16 (the CUDA default) would round the weights again, on top of the format under test
    dev = ["--device", args.device, "--dtype", "float32"]
    _cli(["pi-profile", "--model", model, "--dataset", train, "--tokens", str(args.profile_tokens),
          "--samples-per-layer", str(args.samples), "--out", run, "--force", "--quiet", "--json", *dev], log)
    rep = _cli(["pi-eval", "--run", run, "--dataset", held, "--tokens", str(args.eval_tokens), "--mode", "dense",
                "--row-format", args.row_formats, "--batch-size", "8", "--json", "--quiet", *dev], log)
    if not rep:
        return
    rows = {"unrounded": rep["modes"]["dense"], **{f: r["dense"] for f, r in rep["row_formats"].items()}}
    res["models"][label] = {
        "model": model, "dataset": rep["dataset"], "tokens": rep["modes"]["dense"]["tokens"], "device": rep["device"],
        "dtype": rep["dtype"], "true_sparsity": rep["modes"]["dense"]["true_sparsity"],
        "rows": {f: {"perplexity": r["perplexity"], "ppl_vs_unrounded": r.get("ppl_vs_unrounded", 0.0),
                     "bytes_per_weight": None if f == "unrounded" else bytes_per_weight(f), "seconds": r["seconds"]}
                 for f, r in rows.items()}}


def formats_md(rec: dict) -> str:
    """The formats stage's record as markdown: a table per model, the relufication, the commands."""
    f, r = rec["figures"], rec["figures"]["relufy"]
    made = "not made (the call ended first)." if r is None else (
        f"{r['activation']}, {r['tokens']:,} tokens of KL to the original (teacher text share {r['teacher_text']}), "
        f"{r['seconds']:.0f} s: perplexity {r['perplexity_original']:.2f} -> {r['perplexity_relufied']:.2f} "
        f"({r['perplexity_ratio']:.3f}x) in its own evaluation, {r['ffn_sparsity']:.1%} of FFN activations exactly "
        f"zero.")
    lines = [f"# FFN row formats on SmolLM2-135M-Instruct and a relufied copy, {rec['machine_kind']} "
             f"({rec['created'][:10]})", "",
             "pi-eval --mode dense --row-format: every neuron's gate and up rows and down column stored as the "
             "runtime stores its rows (blocks along d_model), widened back to float32; attention as the model runs "
             "it. Perplexity on the Wikipedia sample's held-out articles; `unrounded` is the file's weights as read "
             "(the original's Q4_1 blocks de-quantized, the relufied model's float32).", "",
             f"Relufied: {made}", ""]
    for label, m in f["models"].items():
        lines += [f"## {label}: {m['model']}", "",
                  f"{m['tokens']:,} predicted tokens on {m['device']}, {m['dtype']}; {m['true_sparsity']:.1%} of h "
                  f"inactive by the profile's rule (exact zeros where ReLU, |h| <= tau for SwiGLU).", "",
                  "| rows | bytes a weight | perplexity | vs unrounded | seconds |", "|---|---|---|---|---|"]
        for fmt, x in m["rows"].items():
            b = "as read" if x["bytes_per_weight"] is None else f"{x['bytes_per_weight']:.4g}"
            lines.append(f"| {fmt} | {b} | {x['perplexity']:.3f} | {100 * x['ppl_vs_unrounded']:+.2f}% | "
                         f"{x['seconds']:.1f} |")
        lines.append("")
    lines += ["## Commands", ""] + [f"- `{c['command']}` ({c.get('seconds', '-')} s, rc {c.get('rc', 0)})"
                                    for c in f["commands"]]
    return "\n".join(lines) + "\n"


def roundtrip(args) -> None:
    from hotneurons.common.units import parse_bytes
    from hotneurons.export import export_run
    from hotneurons.export import roundtrip as rt
    from hotneurons.relufy.distill import relufy
    from hotneurons.relufy.relufy import RelufyConfig

    from bench.bench_powerinfer import default_source
    from bench.powerinfer_check import build, f16_attention, predictor_f16_flips

    work, out = Path(args.work), Path(args.out)
    model, run, exp = work / "models" / "roundtrip", work / "runs" / "roundtrip", work / "export-roundtrip"
    train, held = str(Path(args.wiki) / "train"), str(Path(args.wiki) / "eval")
    log: list = []
    res: dict = {"name": "roundtrip", "machine": record.machine(), "commands": log, "new_tokens": args.rt_new_tokens}
    if not (model / "config.json").exists():
        cfg = RelufyConfig(dataset=train, eval_dataset=held, tokens=args.rt_tokens, teacher_text=0.0,
                           eval_tokens=8192)
        s = relufy(args.gguf, model, cfg, device=args.device, force=True, progress=False)
        ev = s["eval"]
        res["relufy"] = {"tokens": s["tokens"], "train_seconds": s["train_seconds"],
                         "perplexity_ratio": ev["perplexity_ratio"], "ffn_sparsity": ev["relufied"]["ffn_sparsity"]}
    res["profile"] = _cli(["pi-profile", "--model", str(model), "--dataset", train, "--tokens", "50000",
                           "--samples-per-layer", "8192", "--out", str(run), "--force", "--quiet", "--json"], log)
    res["solve"] = _cli(["pi-solve", "--run", str(run), "--vram", args.vram, "--reserve", "0", "--json"], log)
    res["predictors"] = _cli(["pi-train-predictors", "--run", str(run), "--form", "powerinfer", "--json", "--quiet",
                              "--force"], log).get("totals")
    res["export"] = export_run(run, exp, force=True)
    res["powerinfer_build"] = build(Path(args.powerinfer_src or default_source()), work / "powerinfer",
                                    cuda=args.device == "cuda", jobs=os.cpu_count() or 16)
    gguf = exp / res["export"]["files"]["model"]
    gib = parse_bytes(args.vram) / 2**30
    prompt, n, threads = "The capital of France is", args.rt_new_tokens, os.cpu_count() or 16
    hf = rt.hf_tokens(model, prompt, n)
    ours = rt.our_tokens(run, prompt, n, threads)
    step = rt.our_tokens_stepwise(run, prompt, n, threads)
    # ggml computes attention and the predictor from float16 weights and inputs: our stepwise run with attention so
    # rounded, and per step how many predictor decisions float16 flips, say whether rounding explains where they part
    emulated = rt.our_tokens_stepwise(run, prompt, n, threads, hooks=f16_attention)
    flips = predictor_f16_flips(run, prompt, n)
    binary, budget = Path(res["powerinfer_build"]["binary"]), ["--vram-budget", f"{gib:.4f}"]
    pi = rt.powerinfer_tokens(binary, gguf, prompt, n, args.rt_threads, logdir=work / "roundtrip-logs", extra=budget)
    pt = pi.get("tokens", [])
    res["tokens"] = {"prompt": prompt, "hf": hf, "ours": ours, "ours_prompt_one_token_at_a_time": step,
                     "ours_stepwise_f16_attention": emulated, "ours_stepwise_steps": flips, "powerinfer": pi}
    # the same model with exact predictors (the gate pre-activations, threshold 0; a placement of each layer's
    # hottest quarter, counted on export/roundtrip.TEXT): PowerInfer should then give HF's tokens, which separates
    # the trained predictor's misses from PowerInfer's own path
    exact_run = rt.make_run(model, work / "runs" / "roundtrip-exact", "powerinfer")
    exact_exp = work / "export-roundtrip-exact"
    exact = export_run(exact_run, exact_exp, force=True)
    exact_gguf = exact_exp / exact["files"]["model"]
    pe = rt.powerinfer_tokens(binary, exact_gguf, prompt, n, args.rt_threads, logdir=work / "roundtrip-exact-logs",
                              extra=budget)
    pet = pe.get("tokens", [])
    res["exact_predictor"] = {"export": {k: exact[k] for k in ("files", "gpu_neurons_per_layer", "vram_capacity")},
                              "powerinfer": pe}
    res["matched"] = {"prompt_ids_equal": pi.get("prompt_ids") == hf["prompt_ids"],
                      "powerinfer_vs_ours_prompt_one_token_at_a_time": rt.common_prefix(pt, step["tokens"]),
                      "powerinfer_vs_ours_stepwise_f16_attention": rt.common_prefix(pt, emulated["tokens"]),
                      "powerinfer_vs_ours": rt.common_prefix(pt, ours["tokens"]),
                      "powerinfer_vs_hf": rt.common_prefix(pt, hf["tokens"]),
                      "ours_vs_hf": rt.common_prefix(ours["tokens"], hf["tokens"]),
                      "exact_prompt_ids_equal": pe.get("prompt_ids") == hf["prompt_ids"],
                      "exact_powerinfer_vs_hf": rt.common_prefix(pet, hf["tokens"])}
    print(json.dumps(res["matched"]), flush=True)
    # PowerInfer's CPU down-projection adds the threads' partial sums without a lock (ggml.c:14433-14457): each export
    # at several thread counts, against what it should give (HF for the exact predictor; for the trained one our
    # runtime with the prompt fed one token at a time, since PowerInfer's prompt pass is sparse and ours dense)
    by_threads: dict = {}
    for label, path, ref in (("exact_vs_hf", exact_gguf, hf["tokens"]),
                             ("trained_vs_ours_prompt_one_token_at_a_time", gguf, step["tokens"])):
        by_threads[label] = {}
        for t in (2, 4, 16):
            by_threads[label][t] = rt.repeated_runs(binary, path, prompt, n, t, 3, work / f"threads-{label}" / f"t{t}",
                                                    ref, budget)
    res["threads"] = by_threads
    print(json.dumps({k: {t: [r["matched"] for r in rs] for t, rs in v.items()} for k, v in by_threads.items()}),
          flush=True)
    (out / "roundtrip.json").write_text(json.dumps(res, indent=1, default=str))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", choices=("wiki", "sweep", "pipeline", "roundtrip", "formats", "report"),
                    required=True)
    ap.add_argument("--gguf", default="/root/smol/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--wiki", default="/root/wiki")
    ap.add_argument("--work", default="/root/rl")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--configs", default='[{"name": "relu"}]')
    ap.add_argument("--name", default="relu")
    ap.add_argument("--vram", default="150MB")
    ap.add_argument("--profile-tokens", type=int, default=200_000)
    ap.add_argument("--samples", type=int, default=16384)
    ap.add_argument("--eval-tokens", type=int, default=65536)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--rt-tokens", type=int, default=1_000_000, help="roundtrip: relufy's training tokens")
    ap.add_argument("--rt-new-tokens", type=int, default=16, help="roundtrip: greedy tokens each system generates")
    ap.add_argument("--rt-threads", type=int, default=2, help="roundtrip: PowerInfer's -t (its CPU sparse path races "
                    "with more threads; its CUDA build needs at least 2)")
    ap.add_argument("--device", default="cuda", help="roundtrip: where relufy trains and PowerInfer runs (cpu: a smoke "
                    "test on a tiny model); formats: where relufy, pi-profile and pi-eval run")
    ap.add_argument("--relufy-preset", default="quick", help="formats: pi-relufy's preset (tiny: a CPU smoke test)")
    ap.add_argument("--relufy-tokens", type=int, default=None, help="formats: relufy's training tokens (default: "
                    "the preset's)")
    ap.add_argument("--row-formats", default="bf16,q8_0,q4_0,q4_1", help="formats: pi-eval's --row-format")
    ap.add_argument("--powerinfer-src", default=None, help="roundtrip: PowerInfer's source tarball")
    ap.add_argument("--inputs", nargs="*", default=[], help="report: folders of sweep-*.json and pipeline-*.json")
    ap.add_argument("--results", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--machine-kind", default="nvidia-h200")
    ap.add_argument("--commit", default=None, help="report: the commit measured")
    ap.add_argument("--previous", nargs="*", default=[], help="report: earlier records whose rows this one keeps")
    ap.add_argument("--note", default="", help="report: a closing paragraph for the markdown")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    print(json.dumps({"host": platform.node(), "python": sys.version.split()[0]}), flush=True)
    stages = {"wiki": lambda a: write_wiki(Path(a.out)), "sweep": sweep, "pipeline": pipeline, "roundtrip": roundtrip,
              "formats": formats, "report": report}
    stages[args.stage](args)


if __name__ == "__main__":
    main()
