"""The relufy results file: bench/relufy_real.py's sweep and pipeline outputs -> one record + a markdown table."""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench import record

GOAL_PPL, GOAL_ZEROS = 1.10, 0.85  # relufied perplexity / original, share of FFN activations exactly zero


def _load(folders: list[str]) -> tuple[list[dict], list[dict]]:
    files = sorted(f for d in folders for f in Path(d).glob("*.json"))
    sweeps = [json.loads(f.read_text()) for f in files if f.name.startswith("sweep-")]
    pipes = [json.loads(f.read_text()) for f in files if f.name.startswith("pipeline-")]
    return sweeps, pipes


def sweep_rows(sweeps: list[dict]) -> list[dict]:
    rows = []
    for s in sorted(sweeps, key=lambda s: (s["activation"], s["tokens"], s["config"]["l1"])):
        ev = s["eval"]
        rows.append({"name": s["name"], "activation": s["activation"], "tokens": s["tokens"],
                     "l1": s["config"]["l1"], "penalty": s["config"].get("penalty", "h"),
                     "l1_ramp": s["config"]["l1_ramp"], "l1_until": s["config"].get("l1_until", 1.0),
                     "fat_threshold": s["config"]["fat_threshold"],
                     "teacher_text": s["config"]["teacher_text"], "pool_tokens": s["pool_tokens"],
                     "ppl_original": ev["original"]["perplexity"], "ppl_swapped": ev["swapped_untrained"]["perplexity"],
                     "zeros_swapped": ev["swapped_untrained"]["ffn_sparsity"], "ppl": ev["relufied"]["perplexity"],
                     "ppl_ratio": ev["perplexity_ratio"], "zeros": ev["relufied"]["ffn_sparsity"],
                     "zeros_per_layer": ev["relufied"]["ffn_sparsity_per_layer"], "tokens_per_s": s["tokens_per_s"],
                     "train_seconds": s["train_seconds"], "eval_tokens": ev["tokens"]})
    return rows


def _step_tok_s(stats: dict) -> float | None:
    ms = stats.get("decode_step_ms_median")
    return 1e3 / ms if ms else None


def pipeline_figures(p: dict) -> dict:
    prof, sol, pred, ev = p["profile"], p["solve"], p["predictors"], p["eval"]["modes"]
    share80 = prof["share_covering_80pct_per_layer"]
    gen = {k: {"decode_tokens_per_s": g["stats"]["decode_tokens_per_s"], "decode_steps": g["stats"]["decode_steps"],
               "median_step_tokens_per_s": _step_tok_s(g["stats"]), "ffn_sparsity": g["stats"]["ffn_sparsity"],
               "gpu_activation_share": g["stats"]["gpu_activation_share"], "text": g["text"],
               "token_ids": g["token_ids"]}
           for k, g in p["generate"].items() if g}
    chat = {q: {m: (r.get("text") if r else None) for m, r in c.items()} for q, c in p["chat"].items()}
    return {"name": p["name"], "profile_tokens": prof["tokens"], "ffn_sparsity": prof["mean_sparsity"],
            "sparsity_per_layer": prof["sparsity_per_layer"], "share_covering_80pct_per_layer": share80,
            "share_covering_80pct_mean": sum(share80) / len(share80),
            "placement": {"vram": sol["budget"]["vram"], "gpu_neuron_share": sol["gpu_neuron_share"],
                          "gpu_activation_share": sol["gpu_activation_share"]},
            "predictors": {k: pred["totals"][k] for k in ("mean_recall", "min_recall", "mean_predicted_sparsity",
                                                          "mean_true_sparsity", "predictor_fraction_of_ffn")},
            "eval": {m: {k: r[k] for k in ("perplexity", "ppl_vs_dense", "ffn_sparsity", "recall") if k in r}
                     for m, r in ev.items()},
            "generate": gen, "chat": chat}


def goals(rows: list[dict], pipes: list[dict]) -> dict:
    ok = [r for r in rows if r["ppl_ratio"] <= GOAL_PPL]
    best = max(rows, key=lambda r: r["zeros"] if r["ppl_ratio"] <= GOAL_PPL else r["zeros"] - 10 * r["ppl_ratio"])
    out = {"relufied_ppl_and_sparsity": {
        "target": f"perplexity <= {GOAL_PPL}x the original with >= {GOAL_ZEROS:.0%} exact zeros",
        "met": any(r["zeros"] >= GOAL_ZEROS for r in ok),
        "closest_in_quality": min(rows, key=lambda r: r["ppl_ratio"])["name"],
        "sparsest": max(rows, key=lambda r: r["zeros"])["name"], "best": best["name"]}}
    for p in pipes:
        f = pipeline_figures(p)
        pr, ev = f["predictors"], f["eval"]
        out[f"predictors_{f['name']}"] = {
            "target": "recall >= 0.95 at predicted sparsity >= 0.75, <= 10% of FFN params, predictor ppl <= +3%",
            "recall": pr["mean_recall"], "predicted_sparsity": pr["mean_predicted_sparsity"],
            "fraction_of_ffn": pr["predictor_fraction_of_ffn"], "ppl_vs_dense": ev.get("predictor", {}).get(
                "ppl_vs_dense"),
            # a predictor at recall r cannot skip more than s + (1 - r)(1 - s) of the neurons, s the true sparsity
            "predicted_sparsity_bound_at_recall": pr["mean_true_sparsity"] + (1 - pr["mean_recall"]) * (
                1 - pr["mean_true_sparsity"]),
            "met": pr["mean_recall"] >= 0.95 and pr["mean_predicted_sparsity"] >= 0.75
            and pr["predictor_fraction_of_ffn"] <= 0.10 and (ev.get("predictor", {}).get("ppl_vs_dense") or 1) <= 0.03}
    return out


def _agreement(gen: dict) -> str:
    """Which decodes produced the same greedy tokens, and where the groups part."""
    groups: dict[tuple, list[str]] = {}
    for k, g in gen.items():
        groups.setdefault(tuple(g["token_ids"]), []).append(k)
    ids = list(groups)
    parts = [f"{' = '.join(v)} ({len(k)} tokens)" for k, v in groups.items()]
    if len(ids) > 1:
        first = next((i for i, (a, b) in enumerate(zip(ids[0], ids[1])) if a != b), min(len(ids[0]), len(ids[1])))
        parts.append(f"the first two groups agree on the first {first} tokens")
    return "; ".join(parts) + f". Text: {next(iter(gen.values()))['text'][:120]!r}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def markdown(rec: dict) -> str:
    f = rec["figures"]
    lines = [f"# pi-relufy on SmolLM2-135M-Instruct, {rec['machine_kind']} ({rec['created'][:10]})", "",
             "Original: the demo GGUF (Q4_1, de-quantized). Perplexity on the Wikipedia sample's held-out articles "
             f"(`wikipedia-sample:eval`, {f['sweep'][0]['eval_tokens']:,} tokens in 256-token rows). Training: KL to "
             "the original on the Wikipedia sample's training articles plus as many rows sampled from the original "
             "(top-p 0.95, 8-token prompts), batch 32 x 256, AdamW 2e-4, warmup then cosine.", "",
             "| run | activation | tokens | penalty (weight, ramp, until) | ppl (original -> relufied) | ratio "
             "| exact zeros | swapped, untrained | tok/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in f["sweep"]:
        act = r["activation"] + (f" t={r['fat_threshold']:g}" if r["activation"] == "fatrelu" else "")
        pen = "–" if not r["l1"] else (f"{r.get('penalty', 'h')} {r['l1']:g}, {r.get('l1_ramp', 0.5):g}, "
                                        f"{r.get('l1_until', 1.0):g}")
        lines.append(f"| {r['name']} | {act} | {r['tokens'] / 1e6:.1f}M | {pen} | {r['ppl_original']:.2f} -> "
                     f"{r['ppl']:.2f} | {r['ppl_ratio']:.3f}x | {_pct(r['zeros'])} | ppl {r['ppl_swapped']:,.0f}, "
                     f"{_pct(r['zeros_swapped'])} | {r['tokens_per_s']:,.0f} |")
    lines += ["", f"Curve: {f['curve_note']}", ""]
    for p in f["pipelines"]:
        ev, pr, pl = p["eval"], p["predictors"], p["placement"]
        s80, sp = p["share_covering_80pct_per_layer"], p["sparsity_per_layer"]
        lines += [f"## The whole pipeline on `{p['name']}`", "",
                  f"- profile ({p['profile_tokens']:,} training tokens): {_pct(p['ffn_sparsity'])} of FFN activations "
                  f"exactly zero (per layer {_pct(min(sp))} to {_pct(max(sp))}); the share of a layer's neurons that "
                  f"covers 80% of its activations: mean {p['share_covering_80pct_mean']:.2f}"
                  f" ({min(s80):.2f}-{max(s80):.2f}; the SwiGLU original needs 0.75 at its calibrated threshold)",
                  f"- placement at {pl['vram']}: {_pct(pl['gpu_neuron_share'])} of FFN neurons on the GPU serve "
                  f"{_pct(pl['gpu_activation_share'])} of activations",
                  f"- predictors: mean recall {pr['mean_recall']:.3f} (min {pr['min_recall']:.3f}), predicted sparsity "
                  f"{pr['mean_predicted_sparsity']:.3f} (true {pr['mean_true_sparsity']:.3f}), "
                  f"{_pct(pr['predictor_fraction_of_ffn'])} of FFN parameters",
                  "- perplexity: " + ", ".join(f"{m} {r['perplexity']:.2f}" + (
                      f" ({100 * r['ppl_vs_dense']:+.2f}%)" if m != "dense" else "") for m, r in ev.items()), "",
                  "| decode | tok/s over the generation | tok/s at the median step | FFN sparsity | GPU share |",
                  "|---|---|---|---|---|"]
        for k, g in p["generate"].items():
            med = g["median_step_tokens_per_s"]
            lines.append(f"| {k} | {g['decode_tokens_per_s']:.1f} ({g['decode_steps']} steps) | "
                         f"{'–' if med is None else f'{med:.1f}'} | {_pct(g['ffn_sparsity'])} | "
                         f"{_pct(g['gpu_activation_share'])} |")
        lines += ["", "Greedy tokens: " + _agreement(p["generate"]), "", "| chat prompt | original | relufied |",
                  "|---|---|---|"]
        for q, c in p["chat"].items():
            lines.append(f"| {q} | {c.get('original')!r} | {c.get('relufied')!r} |")
        lines.append("")
    lines += ["## Goals", ""] + [f"- {k}: {json.dumps(v)}" for k, v in f["goals"].items()] + ["", f["note"], ""]
    return "\n".join(lines)


def report(args) -> None:
    sweeps, pipes = _load(args.inputs)
    rows = sweep_rows(sweeps)
    earlier = []  # pipelines of earlier records (--previous), already in figures form
    for path in getattr(args, "previous", None) or []:  # earlier records of the same study: one file holds them all
        old = json.loads(Path(path).read_text())
        seen = {r["name"] for r in rows}
        rows += [{**r, "commit": old.get("commit")} for r in old["figures"]["sweep"] if r["name"] not in seen]
        earlier += [{**p, "commit": old.get("commit")} for p in old["figures"]["pipelines"]]
    rows.sort(key=lambda r: (r["activation"], r.get("penalty", "h"), r["tokens"], r["l1"]))
    relu = sorted((r for r in rows if r["activation"] == "relu" and r["l1"] == 0), key=lambda r: r["tokens"])
    curve = "; ".join(f"ReLU, KL only, {r['tokens'] / 1e6:.1f}M tokens: {r['ppl_ratio']:.3f}x at {_pct(r['zeros'])}"
                      for r in relu)
    if len(relu) >= 2:  # ratio = a + b / tokens through the two longest runs: where more tokens of this recipe lead
        (t1, r1), (t2, r2) = [(r["tokens"] / 1e6, r["ppl_ratio"]) for r in relu[-2:]]
        b = (r1 - r2) / (1 / t1 - 1 / t2)
        curve += f". A fit ratio = a + b/tokens through the last two gives a = {r2 - b / t2:.3f}: the limit of this " \
                 "recipe's quality with more tokens, at an unchanged share of zeros"
    figures = {"sweep": rows, "pipelines": earlier + [pipeline_figures(p) for p in pipes], "goals": goals(rows, pipes),
               "curve_note": curve, "note": args.note if hasattr(args, "note") else ""}
    info = next((s.get("machine") for s in sweeps + pipes if s.get("machine")), None) or {
        "gpu": "NVIDIA H200", "nproc": 16, "note": "the sweep ran before machine info was recorded"}
    rec = record.make(figures, machine_info=info, kind=args.machine_kind, commit=getattr(args, "commit", None))
    stem = Path(args.results) / f"{time.strftime('%Y-%m-%d')}-{args.machine_kind}-relufy"
    record.write(stem.with_suffix(".json"), rec)
    stem.with_suffix(".md").write_text(markdown(rec))
    print(f"wrote {stem}.json {stem}.md")
