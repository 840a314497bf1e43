"""PowerInfer itself on pi-bench's model (`pi-bench --stage powerinfer`, after the build and bench stages).

Its CUDA `main` is built from the shared source tarball; the bench model is exported in PowerInfer's format
(hotneurons.export) with the placement our bench stage solved at the budget as its gpuidx, our profile's counts as
its activation files and the model's exact predictor (bench_model.exact_predictor: logits = the gate
pre-activations, threshold 0) with the FFN norm's weight folded into fc1, which PowerInfer's pre-norm input needs
(the logit then scales by the input's RMS, so its sign, the decision, is unchanged). `main` then decodes with
--vram-budget at the same budget and 16 threads; nothing of ours runs meanwhile (this stage runs alone).

Two runs split PowerInfer's token time: as exported, and with LLAMA_SPARSE_PRED_THRESHOLD above every logit, which
skips every FFN neuron on both devices and leaves attention, norms, the predictor and the per-layer
synchronisation: the difference is the time of its FFN work.

PowerInfer's CPU down-projection (ggml.c:14433-14457, ggml_compute_forward_mul_mat_axpy) adds each thread's partial
sums into the shared output without a lock, so its timed 16-thread runs may compute slightly wrong sums (its CUDA build
refuses 1 thread, ggml.c:16719). After the timing runs a thread check decodes 16 greedy tokens twice at 2 threads and
twice at the timed count: whether they agree shows whether the race changes this model's tokens.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from bench import bench_model as bm

NO_NEURON = "1e30"  # a threshold above every logit: no FFN neuron is computed
PROMPT = "abcdefghijklmno"  # 15 byte tokens plus <s>: the bench's 16-token prompt (placeholder vocabulary)


def default_source() -> Path:
    """The shared tarball beside the checkout, or a copy inside it (.gpu/, for the device machine)."""
    root = Path(__file__).resolve().parents[1]
    for p in (root.parent / "shared" / "vendor" / "PowerInfer-src.tgz", root / ".gpu" / "PowerInfer-src.tgz"):
        if p.exists():
            return p
    return root.parent / "shared" / "vendor" / "PowerInfer-src.tgz"


def profile_and_placement(run: Path, layers: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per layer the profile's activation counts (n,) and the placement's GPU mask (n,), in neuron order."""
    import pandas as pd

    counts_df = pd.read_parquet(run / "profile" / "neurons.parquet", columns=["layer", "neuron", "count"])
    place_df = pd.read_parquet(run / "placement" / "placement.parquet", columns=["layer", "neuron", "gpu"])
    counts = [counts_df[counts_df.layer == i].sort_values("neuron")["count"].to_numpy(np.int64) for i in range(layers)]
    gpu = [place_df[place_df.layer == i].sort_values("neuron")["gpu"].to_numpy(bool) for i in range(layers)]
    return counts, gpu


def export_bench_model(args, work: Path, counts: list[np.ndarray], gpu_mask: list[np.ndarray], out: Path) -> dict:
    """The bench model (rebuilt with the saved calibration) with our placement, profile counts and exact
    predictors, as PowerInfer's files in `out`."""
    import torch
    from hotneurons.export.gguf_model import placeholder_vocab
    from hotneurons.export.powerinfer import write_powerinfer
    from hotneurons.export.run import split_bytes

    from bench.bench_build import calibrated_model

    model = calibrated_model(args, work)
    lm = model.lm
    L, n = args.layers, bm.SHAPES[args.shape][1]
    preds = []
    with torch.no_grad():
        for i in range(L):
            p = bm.exact_predictor(lm, args.shape, i, args.seed, args.gate_rank)
            gamma = lm.layers[i].post_attention_layernorm.weight.float()  # (d,)
            preds.append(((p.fc1.weight.float() * gamma).cpu(), p.fc2.weight.float().cpu()))  # (r, d), (n, r)
    d = bm.SHAPES[args.shape][0]
    capacity = split_bytes(gpu_mask, 3 * d * 2)  # F16 rows of gate, up, down_t
    summary = write_powerinfer(lm.model, placeholder_vocab(lm.model.config.vocab_size), preds, 0.0, counts, gpu_mask,
                               capacity, out, name="bench", force=True,
                               info={"predictor": "exact (bench_model.exact_predictor, γ folded into fc1)"})
    del model, lm
    return {**summary, "n_neurons": n}


def run_main(binary: Path, gguf: Path, budget_gib: float, threads: int, tokens: int, env: dict | None = None,
             timeout: float = 300, logdir: Path | None = None, greedy: bool = False, prompt: str = PROMPT) -> dict:
    """PowerInfer's `main` at --temp 0, `tokens` new tokens past the 16-token prompt (export/roundtrip.py's runner):
    decode and prompt rates from its llama_print_timings lines, its loader's lines on the split it applied, its token
    ids. `greedy` adds --repeat-penalty 1.0; the timed runs keep main's default penalty."""
    from hotneurons.export.roundtrip import powerinfer_tokens

    r = powerinfer_tokens(binary, gguf, prompt, tokens, threads, timeout, logdir=logdir, env=env,
                          ctx=max(512, len(prompt) + tokens + 8),
                          extra=["--ignore-eos", "--vram-budget", f"{budget_gib:.4f}"],
                          repeat_penalty=1.0 if greedy else None)
    if "error" not in r and "decode_tokens_per_s" not in r:
        r["error"] = "no decode line in main's llama_print_timings: " + " | ".join(r.get("timings", []))
    return r


def thread_check(binary: Path, gguf: Path, budget_gib: float, threads: int, logs: Path, n: int = 16) -> dict:
    """Greedy tokens from `main` twice at 2 threads and twice at the timed `threads`: its CPU down-projection adds the
    threads' partial sums into one output without a lock (ggml.c:14433-14457), so more threads can change them."""
    from hotneurons.export.roundtrip import common_prefix

    runs = [{"threads": t, **run_main(binary, gguf, budget_gib, t, n, logdir=logs / f"t{t}-{k}", greedy=True)}
            for t, k in ((2, 0), (2, 1), (threads, 0), (threads, 1))]
    first = runs[0].get("tokens", [])
    rows = [{"threads": r["threads"], "tokens": r.get("tokens"), "error": r.get("error"),
             "matched_first_2_thread_run": common_prefix(r.get("tokens", []), first)} for r in runs]
    return {"new_tokens": n, "sampling": "--temp 0 --repeat-penalty 1.0, the timed runs' -c and budget", "runs": rows}


def stage_powerinfer(args, work: Path) -> dict:
    """Build, export (kept in WORK for the next call) and time PowerInfer at the budget."""
    from bench.powerinfer_check import build

    res: dict = {"stage": "powerinfer"}
    run = work / f"run-{args.shape}-{args.layers}"
    if not (run / "placement" / "placement.parquet").exists():
        raise SystemExit(f"no placement in {run}: run pi-bench --stage bench first (same --work)")
    counts, gpu = profile_and_placement(run, args.layers)
    t0 = time.perf_counter()
    res["build"] = build(Path(args.powerinfer_src or default_source()), work / "powerinfer",
                         cuda=args.device == "cuda", jobs=args.jobs)
    out = work / f"powerinfer-{args.shape}-{args.layers}"
    if not (out / "export.json").exists():
        res["export"] = export_bench_model(args, work, counts, gpu, out)
    else:
        res["export"] = {**json.loads((out / "export.json").read_text()), "reused": True}
    res["export_seconds"] = time.perf_counter() - t0
    from bench.bench_build import _free

    _free(args.device)
    budget = int(args.budget_share * bm.model_bytes(args.shape, args.layers)["total"])
    gguf = out / "bench.powerinfer.gguf"
    threads = args.threads or os.cpu_count()
    systems = {}
    binary = Path(res["build"]["binary"])
    probe = run_main(binary, gguf, budget / 2**30, threads, 4)
    if any("failed" in ln and "gpu split" in ln for ln in probe.get("loader", [])):
        # its budget left after the dense tensors is below the split's own bytes: it would solve another split (its
        # Python solver); capacity 0 makes it apply ours as it is, so both run the same placement
        from hotneurons.export.powerinfer import write_gpu_index

        write_gpu_index(Path(f"{gguf}.generated.gpuidx"), gpu, 0)
        res["gpuidx_capacity_forced_to_0"] = {"because": probe["loader"]}
    for label, env in (("powerinfer", {}), ("powerinfer, no FFN neuron computed",
                                            {"LLAMA_SPARSE_PRED_THRESHOLD": NO_NEURON})):
        runs = [run_main(binary, gguf, budget / 2**30, threads, args.llama_tokens, env)
                for _ in range(max(1, args.llama_reps))]
        ok = [r for r in runs if "decode_tokens_per_s" in r]
        row = {"runs": runs, "standalone": True, "budget_bytes": budget, "threads": threads}
        if ok:
            rates = sorted(r["decode_tokens_per_s"] for r in ok)
            row.update(decode_tokens_per_s=rates[len(rates) // 2], loader=ok[-1]["loader"])
        else:
            row["error"] = runs[-1].get("error", "no run")
        systems[label] = row
        print(label, row.get("decode_tokens_per_s", row.get("error", "")[-300:]), flush=True)
    check = thread_check(binary, gguf, budget / 2**30, threads, out / "threads-check")
    res["threads_check"] = check
    print("threads check (tokens equal to the first 2-thread run's, of 16): " + ", ".join(
        f"{r['threads']} threads {r['matched_first_2_thread_run']}" for r in check["runs"]), flush=True)
    # the same split and an exact predictor: the share of activations its GPU neurons serve is the profile's
    res["gpu_activation_share_profile"] = float(sum(c[g].sum() for c, g in zip(counts, gpu)) /
                                                max(1, sum(c.sum() for c in counts)))
    a, b = (systems[k].get("decode_tokens_per_s") for k in systems)
    if a and b:
        res["powerinfer_breakdown_ms"] = {"token": 1e3 / a, "without_ffn_neurons": 1e3 / b,
                                          "ffn_neurons": 1e3 / a - 1e3 / b}
    res["systems"] = systems
    return res
