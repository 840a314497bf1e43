"""pi_bench's runners of our systems (build, warm up, timed generations, one row of results each; or several side
by side, timed in rounds) and of HF accelerate's offload. llama.cpp's runner is bench_llamacpp.llama_bench."""

from __future__ import annotations

import copy
import time

import numpy as np
import torch

from bench import bench_ceilings as ceil
from bench import bench_timeline as tl


def build_ours(base, cfg, placement, preds, prompt: list[int]):
    """One of our systems (its RuntimeConfig from bench/systems.py) built and warmed up; returns (runtime, build
    seconds)."""
    from hotneurons.runtime.balance import TUNING_TOKENS
    from hotneurons.runtime.generate import generate
    from hotneurons.runtime.load import build_runtime

    lm = copy.deepcopy(base)
    t0 = time.perf_counter()
    rt = build_runtime(lm, cfg, placement, preds)
    build_s = time.perf_counter() - t0
    # warm-up: Numba, CUDA kernels, pinned buffers, and the calibration that sets the GPU's share of the cold rows
    generate(rt, prompt, TUNING_TOKENS + 4, stop_at_eos=False)
    return rt, build_s


def timed_ours(rts: dict, prompt: list[int], tokens: int, reps: int, dram_bytes: int | None,
               after_round=None) -> dict:
    """`reps` rounds of one timed generation of each runtime in `rts` (the order rotated each round, so that none is
    always first); with `dram_bytes`, the DRAM read ceiling before the first round and after each generation (the
    machine's bandwidth drifts within minutes); `after_round(out)` after each round, with the results so
    far. Returns per name (generations, [(ceiling just before, just after)] for each)."""
    from hotneurons.runtime.generate import generate

    last = ceil.dram_now(dram_bytes) if dram_bytes else None
    out = {name: ([], []) for name in rts}
    names = list(rts)
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            gens, around = out[name]
            gens.append(generate(rts[name], prompt, tokens, stop_at_eos=False))
            if dram_bytes:
                now = ceil.dram_now(dram_bytes)
                around.append((last, now))
                last = now
        if after_round is not None:
            after_round(out)
            last = ceil.dram_now(dram_bytes) if dram_bytes else None  # the next "before": after the other system
    return out


def row_ours(name: str, rt, build_s: float, gens: list, around: list[tuple[float, float]], prompt: list[int],
             tokens: int) -> dict:
    """A system's results row: the median of its timed generations, counts, the ceiling around each, the timeline."""
    rates = [g.stats["decode_tokens_per_s"] for g in gens]
    per_layer = [dict(zip(("tokens", "active", "active_hot", "active_cold"), map(float, f.read_counts())),
                      layer=f.layer, n_hot=f.n_hot, n_cold=f.n_cold) for f in rt.ffns]
    row = {**gens[-1].stats, "build_s": build_s, "decode_tokens_per_s_reps": rates,
           "decode_tokens_per_s": float(np.median(rates)), "per_layer_counts": per_layer, "tokens": tokens,
           "decode_step_ms_median_reps": [g.stats["decode_step_ms_median"] for g in gens], "host_memory": host_memory()}
    if around:
        row["dram_around_bytes_per_s"] = {"before": around[0][0], "after": around[-1][1],
                                          "per_rep": [(a + b) / 2 for a, b in around]}
    if rt.fast is not None and rt.fast.graphs:
        try:
            row["step_timeline"] = tl.step_timeline(rt, prompt, tokens)
        except Exception as e:
            row["step_timeline"] = {"error": f"{type(e).__name__}: {e}"}
    print("ours", name, {k: row[k] for k in ("decode_tokens_per_s", "ffn_sparsity", "gpu_activation_share",
                                              "bytes_gpu", "bytes_cpu")}, flush=True)
    return row


def run_ours(name: str, base, cfg, placement, preds, prompt: list[int], tokens: int, reps: int,
             dram_bytes: int | None = None) -> dict:
    """One of our systems: build, warm up, `reps` timed generations (timed_ours)."""
    rt, build_s = build_ours(base, cfg, placement, preds, prompt)
    gens, around = timed_ours({name: rt}, prompt, tokens, reps, dram_bytes)[name]
    row = row_ours(name, rt, build_s, gens, around, prompt, tokens)
    extra = {"rt": rt} if name == "hybrid" else {}
    return row, extra


def run_interleaved(plan: list, base, prompt: list[int], dram_bytes: int | None,
                    others: dict | None = None, on_round=None) -> tuple[dict, dict]:
    """Our systems of `plan` built side by side and timed in rounds, one generation of each a round, so that a
    pair's generations share the machine's DRAM bandwidth of the moment (it drifts by 10-30% within minutes); small
    changes show in the per-round ratios to the first system long before they show in medians of separate runs.
    `others`: label -> a function that runs another system once and returns its row (decode_tokens_per_s), run after
    our systems in each round (llama-bench), so that our systems' ratios to it are paired too. `on_round(partial)`
    after each round gets the rounds so far (tok/s of each generation, the other systems' rows), so that a run stopped
    by a timeout keeps them; each round also prints a line."""
    built = {name: build_ours(base, cfg, pl, pr, prompt) for name, cfg, pl, pr, _, _ in plan}
    n_tok, reps = plan[0][4], plan[0][5]
    others = others or {}
    other_rows: dict = {label: [] for label in others}

    def after_round(out: dict) -> None:
        for label, run in others.items():
            other_rows[label].append(run())
        partial = {"rounds_done": len(next(iter(out.values()))[0]),
                   "decode_tokens_per_s": {name: [g.stats["decode_tokens_per_s"] for g in gens]
                                           for name, (gens, _) in out.items()},
                   "others": {label: list(rows) for label, rows in other_rows.items()}}
        print("round", partial["rounds_done"], {k: round(v[-1], 2) for k, v in partial["decode_tokens_per_s"].items()},
              {k: v[-1].get("decode_tokens_per_s", v[-1].get("error")) for k, v in other_rows.items()}, flush=True)
        if on_round is not None:
            on_round(partial)

    timed = timed_ours({name: rt for name, (rt, _) in built.items()}, prompt, n_tok, reps, dram_bytes, after_round)
    rows = {name: row_ours(name, rt, build_s, *timed[name], prompt, n_tok) for name, (rt, build_s) in built.items()}
    first = plan[0][0]
    per_round = {name: r["decode_tokens_per_s_reps"] for name, r in rows.items()}
    per_round.update({label: [x.get("decode_tokens_per_s") for x in xs] for label, xs in other_rows.items()})

    def ratios(to: str) -> dict:  # per round; a round whose other system failed (no tok/s) drops out
        return {name: [a / b for a, b in zip(v, per_round[to]) if b]
                for name, v in per_round.items() if name in rows}

    summary = {"systems": list(rows), "reps": reps, "tokens": n_tok, "ratio_to": first,
               **round_ratios({name: r["decode_tokens_per_s_reps"] for name, r in rows.items()},
                              {name: r["decode_step_ms_median_reps"] for name, r in rows.items()}, first),
               "others": {label: other_rows[label] for label in others}}
    summary["median_ratio_to_others"] = {label: {k: _median(v) for k, v in ratios(label).items()}
                                         for label in others}
    extra = {"rt": built["hybrid"][0]} if "hybrid" in built else {}
    return rows, {"interleaved": summary, **extra}


def _median(v: list) -> float | None:
    return float(np.median(v)) if v else None


def round_ratios(rates: dict, steps: dict, first: str) -> dict:
    """Per round, each system's tok/s over `first`'s (a round without a figure drops out) and `first`'s median step
    over each one's (> 1 is faster than `first`; a round where a few steps stalled moves less), their medians and the
    rounds above 1. rates, steps: name -> one figure a round."""
    ratio = {k: [a / b for a, b in zip(v, rates[first]) if b] for k, v in rates.items()}
    step = {k: [b / a for a, b in zip(v, steps[first]) if a and b] for k, v in steps.items()}
    return {"ratios_per_round": ratio, "median_ratio": {k: _median(v) for k, v in ratio.items()},
            "rounds_above_1": {k: int(sum(x > 1 for x in v)) for k, v in ratio.items()},
            "step_ratios_per_round": step, "median_step_ratio": {k: _median(v) for k, v in step.items()}}


def share_sweep(rt, prompt: list[int], tokens: int, reps: int, shares: list[float]) -> dict:
    """hybrid's decode at fixed PCIe shares, in rounds within one runtime (128 GiB of RAM holds two runtimes of
    the bench model side by side, not five): each round the balanced share and each of `shares` in turn (the order
    rotated each round), each a short generation once set (its graphs are captured again), then a timed one. The
    balancing's re-checks are off meanwhile; the balanced share is set again at the end. Whether the balancing lands
    where decode is fastest: the per-round tok/s and median-step ratios of each share to the balanced one."""
    from dataclasses import replace

    from hotneurons.runtime.balance import set_pcie_share
    from hotneurons.runtime.generate import generate

    balanced, cfg = rt.pcie_share, rt.cfg
    points = {"balanced": balanced, **{f"{x:g}": x for x in shares}}
    names = list(points)
    rates: dict = {k: [] for k in names}
    steps: dict = {k: [] for k in names}
    rt.cfg = replace(cfg, pcie_recheck=False)
    try:
        for r in range(reps):
            for name in names[r % len(names):] + names[:r % len(names)]:
                set_pcie_share(rt, points[name])
                generate(rt, prompt, 4, stop_at_eos=False)  # captures the graphs at this share
                st = generate(rt, prompt, tokens, stop_at_eos=False).stats
                rates[name].append(st["decode_tokens_per_s"])
                steps[name].append(st["decode_step_ms_median"])
            print("share sweep round", r + 1, {k: round(v[-1], 2) for k, v in rates.items()}, flush=True)
    finally:
        set_pcie_share(rt, balanced)
        rt.cfg = cfg
    return {"shares": points, "reps": reps, "tokens": tokens, "decode_tokens_per_s_reps": rates,
            "decode_step_ms_median_reps": steps, **round_ratios(rates, steps, "balanced")}


def host_memory() -> dict:
    """/proc/meminfo's figures that tell memory pressure and huge-page use, in GiB."""
    keys = ("MemTotal", "MemAvailable", "Cached", "AnonPages", "AnonHugePages", "SwapTotal")
    try:
        rows = dict(line.split(":", 1) for line in open("/proc/meminfo"))
    except OSError:
        return {}
    return {k: int(rows[k].split()[0]) / 2**20 for k in keys if k in rows}


def run_accelerate(base_model, budget: int, device: str, prompt: list[int], tokens: int) -> dict:
    """HF transformers + accelerate: device_map offload with max_memory = the budget (weights stream over PCIe)."""
    model = copy.deepcopy(base_model)
    row: dict = {}
    if device == "cuda":
        from accelerate import dispatch_model, infer_auto_device_map

        dm = infer_auto_device_map(model, max_memory={0: budget, "cpu": 200 * 2**30},
                                   no_split_module_classes=["LlamaDecoderLayer"], dtype=torch.float16)
        model = dispatch_model(model, device_map=dm, main_device=0)
        row["device_map_gpu_entries"] = sum(v == 0 or v == "cuda:0" for v in dm.values())
        row["device_map_cpu_entries"] = sum(v == "cpu" for v in dm.values())
        row["device_map"] = {k: str(v) for k, v in dm.items()}
    else:
        row["device_map"] = {"": "cpu"}
    from hotneurons.models.family import step as hf_step

    dev = "cuda:0" if device == "cuda" else "cpu"
    with torch.inference_mode():
        logits, cache = hf_step(model, torch.tensor([prompt], device=dev))
        nxt = int(logits[0, -1].argmax())
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(tokens):
            logits, cache = hf_step(model, torch.tensor([[nxt]], device=dev), cache)
            nxt = int(logits[0, -1].argmax())
        seconds = time.perf_counter() - t0
    import accelerate
    import transformers

    row.update(decode_tokens_per_s=tokens / seconds, tokens=tokens, seconds=seconds,
               versions={"accelerate": accelerate.__version__, "transformers": transformers.__version__})
    print("accelerate", row["decode_tokens_per_s"], flush=True)
    del model
    return row
