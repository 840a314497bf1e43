"""bench_moe's report: a variant's stage files (WORK/<variant>/{build,pipeline,ours,llamacpp}.json) as one results
record (bench/record.py's schema) with `systems` keyed by the names printed, the GPU shares of routed expert work, the
goals' ratios and a markdown table. Where the calibrated variant's uniform-routing sibling has run, its systems are
added with " (uniform routing)" after their names: what the placement buys when the router has no skew. Further runs of
ours kept beside the folder's ours.json as ours.<label>.json (an A/B of one option) become rows "hybrid, <label>"."""

from __future__ import annotations

import time
from pathlib import Path

SYSTEM_KEYS = ("decode_tok_s", "prefill_tok_s", "load_to_first_token_s", "host_peak_rss_bytes", "gpu_peak_bytes")
GOALS = {"decode_vs_n_cpu_moe": 1.5, "decode_vs_n_cpu_moe_sparse": 3.0, "gpu_share_vs_n_cpu_moe": 1.3,
         "host_rss_vs_file": 1.10}


def systems_of(ours: dict | None, lc: dict) -> dict[str, dict]:
    """`hybrid` (ours) and llama.cpp's rows that ran, each with SYSTEM_KEYS (None where not measured)."""
    out = {}
    if ours is not None:
        out["hybrid"] = {k: ours.get(k) for k in SYSTEM_KEYS} | {
            "gpu_share_routed_measured": ours.get("gpu_share_routed_measured"),
            "cold_firing_share": ours.get("cold_firing_share"), "expert_predictors": ours.get("expert_predictors")}
    for name, row in lc.items():
        if name.startswith("llama.cpp") and isinstance(row, dict) and "error" not in row:
            out[name] = {k: row.get(k) for k in SYSTEM_KEYS}
    return out


def report(stages: dict[str, dict], uniform: dict[str, dict] | None = None) -> dict:
    """The stage figures (by stage name) as one record; `uniform`: the uniform-routing sibling's, if any."""
    build, pipe, ours, lc = stages["build"], stages["pipeline"], stages.get("ours"), stages.get("llamacpp", {})
    systems = systems_of(ours, lc)
    summary = pipe["solve"]["summary"]["experts"]
    base = summary.get("baselines", {})
    split = next((n for n in systems if "--n-cpu-moe" in n), None)

    def ratio(n: str = "256") -> float | None:
        theirs = (systems.get(split) or {}).get("decode_tok_s") or {}
        mine = (ours or {}).get("decode_tok_s") or {}
        return mine[n] / theirs[n] if theirs.get(n) and mine.get(n) else None

    shares = {"ours_planned": summary.get("gpu_share_routed"),
              "ours_measured_decode": (ours or {}).get("gpu_share_routed_measured"),
              "n_cpu_moe_planned": base.get("n_cpu_moe", {}).get("gpu_share_routed"),
              "n_cpu_moe_planned_n": base.get("n_cpu_moe", {}).get("n"),
              "n_cpu_moe_measured_n": lc.get("n_cpu_moe"),
              "n_cpu_moe_at_measured_n": lc.get("gpu_share_routed"),
              "uniform_ids_planned": base.get("uniform", {}).get("gpu_share_routed")}
    theirs = shares["n_cpu_moe_at_measured_n"] or shares["n_cpu_moe_planned"]
    sparse = bool(build.get("activation") == "drelu")
    goals = {"decode_vs_n_cpu_moe": ratio(), "decode_vs_n_cpu_moe_32": ratio("32"),
             "decode_vs_all_gpu": (ours["decode_tok_s"]["256"] / systems["llama.cpp all on the GPU"]["decode_tok_s"]
                                   ["256"] if ours and (systems.get("llama.cpp all on the GPU") or {}).get(
                                       "decode_tok_s") else None),
             # ours as decode measured it (the plan's is the profile's tokens'); llama.cpp's is exact: whole layers
             "gpu_share_vs_n_cpu_moe": ((shares["ours_measured_decode"] or shares["ours_planned"]) / theirs
                                        if theirs else None),
             "host_rss_vs_file": (ours["host_peak_rss_bytes"] / ours["gguf_bytes"] if ours else None)}
    fig = {"variant": stages["pipeline"].get("variant"), "shape": build["shape"], "routing": build["routing"],
           "activation": build["activation"], "gguf_bytes": build["gguf_bytes"],
           "calibration": {"target_top": build["target_top"], "mean_top_share": build["calibration"]["mean_top_share"],
                           "mean_fired": build["calibration"].get("mean_fired")},
           "gpu_budget_bytes": pipe["vram_bytes"], "expert_frac_rule": pipe["expert_frac_rule"],
           "gpu_expert_fraction": pipe["gpu_expert_fraction"],
           "llamacpp_weights_budget_bytes": lc.get("budget_for_weights_bytes"), "systems": systems,
           "gpu_share_routed": shares, "goals": goals,
           "goal_targets": {**GOALS, "decode_vs_n_cpu_moe": GOALS["decode_vs_n_cpu_moe_sparse" if sparse
                                                                 else "decode_vs_n_cpu_moe"]}}
    fig["goal_targets"].pop("decode_vs_n_cpu_moe_sparse")
    for key in sorted(k for k in stages if k.startswith("ours.")):
        systems[f"hybrid, {key[len('ours.'):].replace('-', ' ')}"] = systems_of(stages[key], {})["hybrid"]
    if uniform:
        for name, row in systems_of(uniform.get("ours"), uniform.get("llamacpp", {})).items():
            systems[f"{name} (uniform routing)"] = row
        fig["uniform_routing"] = {"gpu_share_routed_planned": uniform["pipeline"]["solve"]["summary"]["experts"].get(
            "gpu_share_routed"), "gpu_expert_fraction": uniform["pipeline"]["gpu_expert_fraction"]}
    return fig


def markdown(fig: dict) -> str:
    gb = lambda b: "-" if b is None else f"{b / 1e9:.1f} GB"  # noqa: E731
    cal = fig["calibration"]
    lines = [f"# {fig['shape']} shape, {fig['routing']} routing, {fig['activation']} experts: Q4_0 GGUF of "
             f"{gb(fig['gguf_bytes'])}, random weights", "",
             f"Router: the hottest {cal['target_top']['frac']:.0%} of experts take {cal['mean_top_share']:.1%} of the "
             f"routed picks on the calibration tokens (target {cal['target_top']['share']:.1%})"
             + (f"; {cal['mean_fired']:.1%} of routed experts' neurons active" if cal.get("mean_fired") else "")
             + f". Budget {gb(fig['gpu_budget_bytes'])}: {fig['gpu_expert_fraction']:.1%} of the experts on the GPU "
             f"(rule: {fig['expert_frac_rule']:.0%} of the experts' bytes).", "",
             "| system | decode tok/s (32 / 256) | prefill tok/s (512) | load to first token | host peak RSS | GPU |",
             "|---|---|---|---|---|---|"]
    for name, r in fig["systems"].items():
        dec = r.get("decode_tok_s") or {}
        cell = " / ".join(f"{dec[n]:.2f}" if dec.get(n) else "-" for n in ("32", "256"))
        pre = "-" if r.get("prefill_tok_s") is None else f"{r['prefill_tok_s']:.0f}"
        load = "-" if r.get("load_to_first_token_s") is None else f"{r['load_to_first_token_s']:.0f} s"
        lines.append(f"| {name} | {cell} | {pre} | {load} | {gb(r.get('host_peak_rss_bytes'))} | "
                     f"{gb(r.get('gpu_peak_bytes'))} |")
    firing = (fig["systems"].get("hybrid") or {}).get("cold_firing_share")
    if firing is not None:  # sparse experts: what ours computes of its routed cold experts
        pred = fig["systems"]["hybrid"].get("expert_predictors")
        lines += ["", f"Ours computes {firing:.1%} of its routed cold experts' neurons in decode (those that fire"
                  + (f"; of them the marked ones of {pred['predictors']} expert predictors of rank {pred['rank']}, "
                     f"{pred['bytes'] / 1e9:.2f} GB" if pred else "; every gate row read") + ")."]
    sh = {k: v for k, v in fig["gpu_share_routed"].items() if v is not None}
    lines += ["", "GPU share of routed expert work: " + ", ".join(
        f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in sh.items()), "",
        "Goals: " + ", ".join(f"{k} {v:.2f}" + (f" (goal {fig['goal_targets'][k]})" if k in fig["goal_targets"]
                                                 else "") for k, v in fig["goals"].items() if v is not None), ""]
    return "\n".join(lines)


def _stage_files(folder: Path) -> dict[str, dict]:
    from bench import record

    names = ["build", "pipeline", "ours", "llamacpp", *sorted(f.stem for f in folder.glob("ours.*.json"))]
    return {s: record.read(folder / f"{s}.json") for s in names if (folder / f"{s}.json").exists()}


def stage_report(a, folder: Path, variant: str) -> dict:
    """WORK/<variant>'s stage files (`folder`) into bench/results/<date>-<kind>-moe-<variant>.{json,md} (or --out and
    .md)."""
    from bench import record

    recs = _stage_files(folder)
    uni = None
    if a.routing == "calibrated" and not a.sparse:
        u = _stage_files(a.work / f"{a.shape}-uniform")
        uni = {k: r["figures"] for k, r in u.items()} if "pipeline" in u else None
    fig = report({k: r["figures"] for k, r in recs.items()}, uni)
    src = recs.get("ours") or recs["pipeline"]  # where the systems ran, not where the report is made
    kind = record.machine_kind(src["machine"])
    out = Path(a.out or record.ROOT / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}-{kind}-moe-{variant}.json")
    record.write_result(out, fig, machine_info=src["machine"], kind=kind, commit=src.get("commit"))
    out.with_suffix(".md").write_text(markdown(fig))
    return fig
