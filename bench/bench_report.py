"""pi-bench results: the goal ratios, the markdown table, and the merged results file (record.py's schema)."""

from __future__ import annotations

import time
from pathlib import Path

from bench import fair, record

SPLIT = "llama.cpp -ngl"
SPLIT_Q8 = "llama.cpp Q8_0 -ngl"
ALL_GPU_LLAMA = "llama.cpp all layers on the GPU"
EIGHT_BIT = ("hybrid-int8",)  # systems compared in the 8-bit table, with SPLIT_Q8 and the int8 floor


def _rate(systems: dict, name: str) -> float | None:
    row = systems.get(name) or {}
    v = row.get("decode_tokens_per_s")
    return float(v) if v else None


def _split_name(systems: dict, prefix: str = SPLIT) -> str | None:
    return next((k for k in systems if k.startswith(prefix)), None)


def _goal(value: float | None, goal: float, higher: bool, what: str) -> dict:
    met = None if value is None else (value >= goal if higher else value <= goal)
    return {"value": value, "goal": (">= " if higher else "<= ") + f"{goal:g}", "met": met,
            "what": what + ("" if value is not None else " (not measured in this run)")}


def goals(res: dict) -> dict:
    """The benchmark's goals, each a ratio from this run; met = None where a figure is missing."""
    s = res.get("systems", {})
    hybrid = _rate(s, "hybrid")
    split = _split_name(s)
    llama = _rate(s, split) if split else None
    acc = _rate(s, "accelerate offload")
    floor_tps = (res.get("floor") or {}).get("tokens_per_s")
    serial = (res.get("floor") or {}).get("serial_tokens_per_s")
    bound = res.get("floor_bound") or {}
    per_rep = (res.get("floor_per_rep") or {}).get("median_share")
    kern = (res.get("kernel") or {}).get("rows") or []
    pred = (res.get("predictor_time") or {}).get("ms_per_token")
    hybrid8 = _rate(s, "hybrid-int8")
    split8 = _split_name(s, SPLIT_Q8)
    llama8 = _rate(s, split8) if split8 else None
    floor8 = (res.get("floor_int8") or {}).get("tokens_per_s")
    kern8 = (res.get("kernel_int8") or {}).get("rows") or []
    paired = {label: m["hybrid"]
              for label, m in ((res.get("interleaved") or {}).get("median_ratio_to_others") or {}).items()
              if label.startswith(SPLIT) and "hybrid" in m}  # hybrid / llama-bench, each round's pair

    def ratio(a, b):
        return a / b if a and b else None

    eight_bit = {} if not (hybrid8 or kern8) else {
        "hybrid_int8_vs_llamacpp_q8_0_layer_split": _goal(
            ratio(hybrid8, llama8), 20, True, f"8-bit option: hybrid-int8 "
            f"tok/s / {split8 or 'llama.cpp Q8_0 -ngl'} tok/s"),
        "hybrid_int8_share_of_int8_floor": _goal(ratio(hybrid8, floor8), 0.70, True,
                                                 "8-bit option: hybrid-int8 tok/s / its floor tok/s"),
        "cpu_kernel_int8_share_of_dram_bw": _goal(min(r["share_of_dram_bw"] for r in kern8) if kern8 else None, 0.80,
                                                  True, "8-bit option: int8 cold-row kernel bytes/s / "
                                                  "DRAM read bytes/s, "
                                                        "worst of 5/10/20% density"),
    }
    pinf = _rate(s, "powerinfer")
    allgpu = _rate(s, "all-gpu")
    return {
        "hybrid_vs_powerinfer": _goal(ratio(hybrid, pinf), 1.5, True, "hybrid tok/s / PowerInfer's main tok/s at the "
                                      "same budget, placement and (exact) predictor, run alone"),
        "hybrid_share_of_our_all_gpu": _goal(ratio(hybrid, allgpu), 0.8, True, "hybrid tok/s / our all-GPU tok/s"),
        "hybrid_vs_llamacpp_layer_split": _goal(ratio(hybrid, llama), 25, True,
                                                f"hybrid tok/s / {split or 'llama.cpp -ngl (budget)'} tok/s"),
        **{"hybrid_vs_llamacpp_layer_split_paired": _goal(
            v, 25, True, f"hybrid tok/s / {label} tok/s, each round's pair (llama-bench run after each round of "
                         f"--interleave), median of the rounds") for label, v in paired.items()},
        "bound_serial_floor_vs_llamacpp_layer_split": _goal(
            ratio(serial, llama), 20, True, f"bound on the first goal: "
            f"serial floor tok/s / {split or 'llama.cpp -ngl'} "
                                            "tok/s (no runtime that runs a layer's attention "
                                            "before its FFN can pass it)"),
        "hybrid_vs_accelerate_offload": _goal(ratio(hybrid, acc), 100, True,
                                              "hybrid tok/s / accelerate device_map offload tok/s"),
        "hybrid_share_of_floor": _goal(ratio(hybrid, floor_tps), 0.70, True, "hybrid tok/s / floor tok/s"),
        "hybrid_share_of_floor_dram_around_each_rep": _goal(
            per_rep, 0.70, True, "hybrid tok/s / floor tok/s per timed generation, the floor from the DRAM ceiling "
                                 "measured just before and after it; median of the generations"),
        "hybrid_share_of_serial_floor": _goal(ratio(hybrid, serial), 0.70, True,
                                              "context: hybrid tok/s / serial floor tok/s (the floor with each layer's "
                                              "attention and predictor before its FFN, as the layer order requires)"),
        "bound_floor_share_at_kernel_rate": _goal(
            bound.get("share_of_floor"), 0.70, True,
            "bound on the floor goal: serial floor tok/s with the cold rows at the cold kernel's own rate at "
            f"{100 * bound.get('kernel_density', 0.05):.0f}% density, the rest at its floor / floor tok/s (below "
            "0.7: no runtime with this kernel that runs a layer's attention before its FFN meets the goal)"),
        "cpu_kernel_share_of_dram_bw": _goal(min(r["share_of_dram_bw"] for r in kern) if kern else None, 0.80, True,
                                             "cold-row kernel bytes/s / DRAM read bytes/s, worst of 5/10/20% density"),
        "predictor_share_of_decode": _goal(pred * hybrid / 1e3 if pred and hybrid else None, 0.05, False,
                                           "predictor ms per token (alone, in a CUDA graph as the runtime runs it) "
                                            "/ hybrid ms per token"),
        **eight_bit,
    }


def _fmt(v, nd=2) -> str:
    if v is None:
        return "–"
    return f"{v:,.{nd}f}" if abs(v) < 1000 else f"{v:,.0f}"


def _dram_note(row: dict) -> str:
    """The DRAM read ceiling measured around a system's timed run (hybrid: each generation; llama.cpp: before and
    after), since CPU-bound systems follow it and it drifts within minutes."""
    around = row.get("dram_around_bytes_per_s")
    if not around:
        return ""
    vals = around.get("per_rep") or [around["before"], around["after"]]
    lo, hi = min(vals) / 1e9, max(vals) / 1e9
    return f"DRAM around it {lo:.0f} GB/s" if round(lo) == round(hi) else f"DRAM around it {lo:.0f}-{hi:.0f} GB/s"


def markdown(res: dict) -> str:
    """The results table (README quotes it)."""
    s = res.get("systems", {})
    m = res.get("model", {})
    floor_tps = (res.get("floor") or {}).get("tokens_per_s")
    split = _split_name(s)
    llama = _rate(s, split) if split else None
    mach = res.get("machine", {})
    lines = [f"pi-bench, {res.get('machine_kind') or ''} ({mach.get('gpu') or 'CPU only'}, {mach.get('nproc')} cores), "
             f"commit {res.get('commit')}, "
             f"{res.get('created', '')}: "
             f"{m.get('shape')} shapes, {m.get('layers')} layers, {m.get('bytes', {}).get('total', 0) / 1e9:.1f} GB "
             f"fp16, RANDOM weights with calibrated power-law firing, exact predictors of trained size; GPU budget "
             f"{m.get('budget_bytes', 0) / 1e9:.2f} GB ({100 * m.get('budget_share', 0):.0f}% of the model bytes).", "",
             "| system | decode tok/s | x llama.cpp layer split | share of the floor | notes |",
             "|---|---|---|---|---|"]
    if res.get("partial"):
        lines[2:2] = [f"PARTIAL: {res['partial']}.", ""]
    for name, row in s.items():
        if name in EIGHT_BIT or name.startswith(SPLIT_Q8):
            continue
        r = _rate(s, name)
        note = row.get("error", "")[:80] if "error" in row else ""
        if name in ("hybrid", "dense"):
            note = (f"FFN sparsity {row.get('ffn_sparsity', 0):.3f}, GPU share of activations "
                    f"{row.get('gpu_activation_share', 0):.3f}")
        if row.get("pcie_share"):
            note += (", " if note else "") + (f"GPU reads {row['pcie_rows_per_layer']:.0f} of the active cold "
                                              f"neurons' rows a layer over PCIe (share {row['pcie_share']:.2f})")
        elif name.startswith("powerinfer"):
            pi = res.get("powerinfer") or {}
            note = (f"GPU share of activations {pi.get('gpu_activation_share_profile', 0):.3f} (our split, exact "
                    "predictor)" if name == "powerinfer" else "every FFN neuron skipped: the rest of its token time")
            if pi.get("gpuidx_capacity_forced_to_0"):
                note += "; split applied with capacity 0"
        elif name == "layer-split" or name.startswith(SPLIT):
            note = f"{row.get('gpu_layers', row.get('n_gpu_layers'))} layers on the GPU"
        note = ", ".join(x for x in (note, _dram_note(row)) if x)
        lines.append(f"| {name} | {_fmt(r)} | {_fmt(r / llama if r and llama else None)} | "
                     f"{_fmt(r / floor_tps if r and floor_tps else None)} | {note} |")
    for name, why in res.get("skipped", {}).items():
        lines.append(f"| {name} | – | – | – | {why} |")
    if floor_tps:
        lines.append(f"| floor (measured ceilings, the hybrid run's active bytes) | {_fmt(floor_tps)} | "
                     f"{_fmt(floor_tps / llama if llama else None)} | 1.00 | |")
        around = (res.get("floor_around_run") or {}).get("tokens_per_s")
        if around:
            d = res["floor_around_run"]["inputs"]["dram_bytes_per_s"]
            lines.append(f"| floor, DRAM ceiling measured around the hybrid run ({d / 1e9:.1f} GB/s) "
                         f"| {_fmt(around)} | "
                         f"{_fmt(around / llama if llama else None)} | {_fmt(around / floor_tps)} | |")
        only = (res.get("floor_dram_only") or {}).get("tokens_per_s")
        if only and only != floor_tps:
            lines.append(f"| floor with every cold row read from DRAM by the CPU (the floor before the PCIe path) | "
                         f"{_fmt(only)} | {_fmt(only / llama if llama else None)} | {_fmt(only / floor_tps)} | |")
        serial = res["floor"].get("serial_tokens_per_s")
        if serial:
            lines.append(f"| serial floor (each layer's attention and predictor before its FFN) | {_fmt(serial)} | "
                         f"{_fmt(serial / llama if llama else None)} | {_fmt(serial / floor_tps)} | |")
        b = res.get("floor_bound")
        if b:
            lines.append(f"| serial floor, the cold rows at the cold kernel's own rate at "
                         f"{100 * b['kernel_density']:.0f}% density ({b['kernel_bytes_per_s'] / 1e9:.1f} GB/s), "
                         f"the rest at its floor | "
                         f"{_fmt(b['serial_tokens_per_s'])} | "
                         f"{_fmt(b['serial_tokens_per_s'] / llama if llama else None)} | {_fmt(b['share_of_floor'])} | "
                         f"0.7 of the floor needs the cold rows at {_fmt(b['kernel_share_needed'])} of the DRAM "
                         f"ceiling with nothing else lost; the kernel reads {_fmt(b['kernel_share_of_dram'])} |")
    lines += eight_bit_table(res)
    c = res.get("ceilings", {})
    if c:
        parts = [f"DRAM read {c['dram']['best_bytes_per_s'] / 1e9:.1f} GB/s ({c['dram']['best']})"]
        if "hbm_bytes_per_s" in c:
            parts += [f"HBM {c['hbm_bytes_per_s'] / 1e9:,.0f} GB/s",
                      f"PCIe H2D {c['pcie_h2d_bytes_per_s'] / 1e9:.1f} / "
                      f"D2H {c['pcie_d2h_bytes_per_s'] / 1e9:.1f} GB/s", f"sync {c['sync_round_trip_s'] * 1e6:.0f} us"]
        z = c.get("zero_copy") or {}
        if "extra_bytes_per_s" in z:
            parts.append(f"GPU reading page-locked host rows in place "
                         f"{z['zero_copy_alone_bytes_per_s'] / 1e9:.1f} GB/s "
                         f"alone, {z['zero_copy_during_dram_bytes_per_s'] / 1e9:.1f} while the CPU's "
                         f"{'row gather' if z.get('cpu_pattern') == 'row_gather' else 'DRAM reduction'} "
                         f"read {z['dram_during_zero_copy_bytes_per_s'] / 1e9:.1f} (alone "
                         f"{z['dram_alone_bytes_per_s'] / 1e9:.1f}): PCIe adds {z['extra_bytes_per_s'] / 1e9:.1f} GB/s "
                         f"to the cold rows' floor")
        lines += ["", "Ceilings: " + "; ".join(parts) + "."]
    for key, rows in (("kernel", "bf16"), ("kernel_int8", "int8")):
        k = res.get(key)
        if k:
            order = f", {k['windows']} copies of the layer taken in turn" if k.get("windows") else ""
            lines.append(f"CPU cold-row kernel (ReGLU, {rows} rows, "
                         f"{k.get('threads', '?')} threads{order}): " + ", ".join(
                f"{100 * r['density']:.0f}% rows {r['bytes_per_s'] / 1e9:.1f} GB/s ({100 * r['share_of_dram_bw']:.0f}% "
                f"of DRAM)" for r in k["rows"]) + ".")
    for name in ("hybrid", "hybrid-int8"):
        t = s.get(name, {}).get("step_timeline", {})
        if "step_ms" in t:
            lines.append(f"{name} decode step (host clock, mean of {t['steps']} steps): {t['step_ms']:.1f} ms = waits "
                         f"for each layer's attention + predictor graph {t['sum_wait_pre_ms']:.1f} ms + CPU cold part "
                         f"{t['sum_cold_ms']:.1f} ms + LM head {t['final_ms']:.2f} ms; OpenMP wait policy: "
                         f"{res.get('omp_wait_policy', 'not recorded')}.")
    b = (res.get("powerinfer") or {}).get("powerinfer_breakdown_ms")
    if b:
        lines.append(f"PowerInfer decode token (its llama_print_timings, median of runs): {b['token']:.1f} ms = "
                     f"everything but the FFN neurons {b['without_ffn_neurons']:.1f} ms (a run with a threshold above "
                     f"every logit) + FFN neurons on GPU and CPU {b['ffn_neurons']:.1f} ms.")
    tc = (res.get("powerinfer") or {}).get("threads_check")
    if tc:  # its CPU down-projection adds the threads' sums without a lock (bench_powerinfer.py)
        lines.append(f"PowerInfer's greedy tokens by thread count ({tc['new_tokens']} new tokens, of them equal to "
                     f"the first 2-thread run's): " + ", ".join(f"-t {r['threads']} {r['matched_first_2_thread_run']}"
                                                                 for r in tc["runs"]) + ".")
    p = res.get("profile")
    if p:
        lines.append(f"Realised firing (profile of {p['tokens']} synthetic tokens): {100 * p['mean_active']:.1f}% of "
                     f"neurons active per token, top 20% of neurons cover {100 * p['top20pct_share']:.0f}% of firings; "
                     f"{100 * p['share_of_neurons_covering_80pct']:.0f}% of neurons cover 80%.")
    il = res.get("interleaved")
    if il and "partial" in il:  # stopped within the rounds: what they measured, unsummarised
        pr = il["partial"]
        lines.append(f"Interleaved, stopped after {pr['rounds_done']} rounds: tok/s per round " + "; ".join(
            f"{k} {', '.join(_fmt(x) for x in v)}" for k, v in pr["decode_tokens_per_s"].items()) + "; " + "; ".join(
            f"{k} {', '.join(_fmt(x.get('decode_tokens_per_s')) for x in v)}" for k, v in pr["others"].items()) + ".")
    elif il:
        rest = [f"{k} {v:.3f} ({il['rounds_above_1'][k]}/{il['reps']})" for k, v in il["median_ratio"].items()
                if k != il["ratio_to"]]
        steps = [f"{k} {v:.3f}" for k, v in (il.get("median_step_ratio") or {}).items()
                 if k != il["ratio_to"] and v is not None]
        lines.append(f"Interleaved: {', '.join(il['systems'])} timed in {il['reps']} rounds of one generation each"
                     + (f" (built side by side); per-round tok/s ratio to {il['ratio_to']}, median (rounds above 1): "
                        + ", ".join(rest) if rest else "")
                     + (f"; the same from each generation's median step: {', '.join(steps)}" if steps else "") + ".")
        for label, m in (il.get("median_ratio_to_others") or {}).items():
            lines.append(f"Paired with {label} run after each round: median per-round tok/s ratio " + ", ".join(
                f"{k} {_fmt(v)}x" for k, v in m.items()) + ".")
    sw = res.get("share_sweep")
    if sw:
        lines.append(f"PCIe shares in rounds within the hybrid runtime ({sw['reps']} rounds): balanced "
                     f"{sw['shares']['balanced']:.3f}; per-round tok/s ratio to it, median (rounds above 1): "
                     + ", ".join(f"{k} {sw['median_ratio'][k]:.3f} ({sw['rounds_above_1'][k]}/{sw['reps']})"
                                 for k in sw["shares"] if k != "balanced") + ".")
    by_pos = (res.get("calibration") or {}).get("active_by_position")
    if by_pos:
        lines.append("Firing by position (fresh random sequences, all layers): " + ", ".join(
            f"{r['positions']}: {100 * r['mean_active']:.1f}%" for r in by_pos) + ".")
    g = res.get("goals") or goals(res)
    lines += baselines_lines(res)
    lines += ["", "| goal | value | target | met |", "|---|---|---|---|"]
    for name, row in g.items():
        met = {True: "met", False: "NOT met", None: "not measured"}[row["met"]]
        lines.append(f"| {row['what']} | {_fmt(row['value'])} | {row['goal']} | {met} |")
    return "\n".join(lines) + "\n"


def baselines_lines(res: dict) -> list[str]:
    """Each baseline paired in rounds beside its standalone run, flagged where they disagree by more than
    fair.TOLERANCE, and the CPU probe that shows whether our stopped process left the cores free."""
    lines = []
    b = res.get("baselines") or {}
    if b:
        lines += ["", "Baselines paired in rounds (our process stopped while each ran) against the same baseline run "
                      "standalone after our process had exited:", "",
                  "| baseline | standalone tok/s | paired tok/s (median of rounds) | paired / standalone | check |",
                  "|---|---|---|---|---|"]
        for label, c in b.items():
            check = {True: f"FLAG: more than {100 * fair.TOLERANCE:.0f}% apart", False: "agree",
                     None: "not comparable"}[c["flag"]]
            lines.append(f"| {label} | {_fmt(c['standalone_tokens_per_s'])} | {_fmt(c['paired_median_tokens_per_s'])}"
                         f" ({c['paired_rounds']} rounds) | {_fmt(c['paired_over_standalone'])} | {check} |")
    f = res.get("fairness") or {}
    if f.get("alone_s"):
        lines += ["", "CPU probe (a CPU-bound job on every core, seconds): " + ", ".join(
            f"{k.removesuffix('_s').replace('_', ' ')} {_fmt(v)}" for k, v in f.items()
            if k.endswith("_s") and v is not None) + "."]
    return lines


def eight_bit_table(res: dict) -> list[str]:
    """8-bit weights on the CPU: hybrid-int8 (int8 cold rows; hot rows and attention stay fp16 on the GPU) against
    llama.cpp with the whole model in Q8_0 at the same GPU budget (so more of its layers fit), and the int8 floor."""
    s = res.get("systems", {})
    names = [n for n in s if n in EIGHT_BIT or n.startswith(SPLIT_Q8)]
    if not names:
        return []
    split8 = _split_name(s, SPLIT_Q8)
    llama8 = _rate(s, split8) if split8 else None
    floor8 = (res.get("floor_int8") or {}).get("tokens_per_s")
    lines = ["", "8-bit weights on the CPU (hybrid-int8: int8 cold rows with a float32 scale per 64 weights, the GPU "
                 "part fp16; llama.cpp: the whole model in Q8_0, so more layers fit in the same budget):", "",
             "| system | decode tok/s | x llama.cpp Q8_0 layer split | share of the int8 floor | notes |",
             "|---|---|---|---|---|"]
    for name in names:
        row, r = s[name], _rate(s, name)
        note = row.get("error", "")[:80] if "error" in row else ""
        if name in EIGHT_BIT and "error" not in row:
            note = (f"{row.get('bytes_cpu', 0) / 1e9:.1f} GB of cold rows in CPU RAM, GPU share of activations "
                    f"{row.get('gpu_activation_share', 0):.3f}")
        elif name.startswith(SPLIT_Q8):
            note = f"{row.get('n_gpu_layers')} layers on the GPU"
        note = ", ".join(x for x in (note, _dram_note(row)) if x)
        lines.append(f"| {name} | {_fmt(r)} | {_fmt(r / llama8 if r and llama8 else None)} | "
                     f"{_fmt(r / floor8 if r and floor8 else None)} | {note} |")
    if floor8:
        lines.append(f"| floor (measured ceilings, the hybrid-int8 run's active bytes) | {_fmt(floor8)} | "
                     f"{_fmt(floor8 / llama8 if llama8 else None)} | 1.00 | |")
    return lines


def _load(inputs: list[Path]) -> dict[str, dict]:
    """Stage JSONs (files, or folders of pi_bench_*.json) by stage, flat (record.flat)."""
    found: dict[str, dict] = {}
    for p in inputs:
        files = sorted(p.glob("pi_bench_*.json")) if p.is_dir() else [p]
        for f in files:
            d = record.flat(record.read(f))
            found[d.get("stage", f.stem.removeprefix("pi_bench_"))] = d
    return found


def write_results(inputs: list[Path], folder: Path, kind: str | None = None, commit: str | None = None,
                  label: str | None = None) -> dict:
    """Merge the stage JSONs into <folder>/<date>-<machine kind>-pi-bench.json (record.py's schema) and the markdown
    table beside it."""
    stages = _load(inputs)
    if "bench" not in stages:
        raise SystemExit(f"no pi_bench_bench.json among {', '.join(map(str, inputs)) or 'the inputs (pass --inputs)'}")
    res = dict(stages["bench"])
    if "build" in stages:
        res["build"] = {k: v for k, v in stages["build"].items() if k not in record.HEADER}
    if "powerinfer" in stages:  # its own call after the bench stage: same model, budget and placement
        pi = {k: v for k, v in stages["powerinfer"].items() if k not in record.HEADER}
        res["systems"] = {**res.get("systems", {}), **pi.pop("systems", {})}
        res["powerinfer"] = pi
    res["goals"] = goals(res)
    kind = kind or res.get("machine_kind") or record.machine_kind(res.get("machine") or {})
    commit = commit or res.get("commit")  # what the caller says was measured wins: a copied tree's .git may be stale
    figures = {k: v for k, v in res.items() if k not in record.HEADER}
    rec = record.make(figures, machine_info=res.get("machine") or {}, kind=kind, commit=commit or "unknown",
                      command=res.get("command") or "",
                      created=res.get("created") or time.strftime("%Y-%m-%dT%H:%M:%S"))
    stem = folder / f"{rec['created'][:10]}-{kind}-pi-bench{'-' + label if label else ''}"
    record.write(stem.with_suffix(".json"), rec)
    md = markdown(record.flat(rec))
    stem.with_suffix(".md").write_text(md)
    print(md)
    print("wrote", stem.with_suffix(".json"), stem.with_suffix(".md"))
    return record.flat(rec)
