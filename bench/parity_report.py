"""bench/parity.py's run over a set of files (a GGUF, its float and quantized copies, tiny families) and its results:
a bench/record.py record (figures: settings, one row per file) and a markdown table beside it."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable

from bench import parity_files as pf
from bench import record


def files(a: Any) -> list[tuple[str, Path]]:
    """(label, path) of every file the arguments name, the copies written into a.work (kept there between runs)."""
    from hotneurons.common.model_source import resolve_source

    a.work.mkdir(parents=True, exist_ok=True)
    if a.model is None:
        s = resolve_source(None)
        src, name = Path(s.path) / s.gguf_file, "smollm2"
    else:
        src, name = a.model, a.model.stem
    out = [(f"{name} {pf.main_type(src)} (as given)", src)]
    floats = [f for f in a.float.split(",") if f]
    types = [t for t in a.types.split(",") if t]
    f32 = a.work / f"{name}-f32.gguf"
    if (types or "f32" in floats) and not f32.exists():
        pf.float_copy(src, f32, "f32")
    for f in floats:
        p = a.work / f"{name}-{f}.gguf"
        if not p.exists():
            pf.float_copy(src, p, f)
        out.append((f"{name} {f.upper()}", p))
    for t in types:
        p = a.work / f"{name}-{t}.gguf"
        if not p.exists():
            pf.quantized_copy(f32, p, t, a.threads)
        out.append((f"{name} {pf.FTYPES[t].removeprefix('MOSTLY_')}", p))
    fams = list(pf.FAMILY_ARCH) if a.families == "all" else [f for f in a.families.split(",") if f]
    for fam in fams:
        p = a.work / f"tiny-{fam}.gguf"
        if not p.exists():
            pf.family_gguf(fam, p)
        out.append((f"tiny {fam} F32 ({pf.FAMILY_ARCH[fam]})", p))
    return out


def run_all(a: Any, parity: Callable[..., dict]) -> list[dict]:
    """bench/parity.parity (passed in: parity.py's main calls this) on every file of `files(a)`, the record rewritten
    after each."""
    rows = []
    for label, path in files(a):
        t0 = time.perf_counter()
        print(f"parity: {label} ({path})", file=sys.stderr, flush=True)
        rows.append(parity(path, a.threads, a.ctx, a.new_tokens, a.ppl_tokens, a.window, a.decode_steps,
                           speed=not a.no_speed, label=label))
        rows[-1]["seconds"] = round(time.perf_counter() - t0, 1)
        print("  " + summary(rows[-1]), file=sys.stderr, flush=True)
        write(rows, a, partial=True)
    return rows


def summary(r: dict) -> str:
    if "error" in r:
        return f"error: {r['error']}"
    p = r["ppl"]
    return (f"ids {'=' if r['ids_equal'] else '!='}, greedy {r['greedy_identical']}/{r['prompts']} identical, "
            f"last logits max diff {r['last_logits_max_diff']:.3g}, ppl {p['ours']['ppl']:.3f} / "
            f"{p['llamacpp']['ppl']:.3f} ({p['ratio']:.4f})")


def settings(a: Any) -> dict:
    from importlib.metadata import version

    return {"threads": a.threads, "ctx": a.ctx, "prompts": a.new_tokens and 5, "new_tokens": a.new_tokens,
            "ppl_tokens": a.ppl_tokens, "window": a.window, "decode_steps": a.decode_steps,
            "ppl_definition": "non-overlapping windows, each from an empty cache, positions 1..window-1 scored",
            "ours": "runtime dense, device cpu (load_runtime, RuntimeConfig(mode=dense, device=cpu))",
            "llamacpp": f"llama-cpp-python {version('llama_cpp_python')}, CPU, n_gpu_layers 0; comparisons with "
                        f"F32 KV cache, timing child with its defaults"}


def write(rows: list[dict], a: Any, partial: bool = False) -> dict:
    figures = {"settings": settings(a), "rows": rows, "complete": not partial}
    rec = record.write_dated("parity", figures, path=a.out,
                             packages=("torch", "numba", "gguf", "llama_cpp_python", "transformers"))
    md = Path(a.out or record.ROOT / "bench" / "results" /
              f"{time.strftime('%Y-%m-%d')}-{rec['machine_kind']}-parity.json").with_suffix(".md")
    md.write_text(markdown(rec))
    return rec


def _mb(b: int | None) -> str:
    return "-" if b is None else f"{b / 1e6:.2f}" if b < 10e6 else f"{b / 1e6:.0f}"


def _greedy(r: dict) -> str:
    if r["greedy_identical"] == r["prompts"]:
        return f"identical {r['prompts']}/{r['prompts']}"
    first = next(g for g in r["greedy"] if not g["identical"])
    return (f"{r['greedy_identical']}/{r['prompts']}; first at step {first['step']}: {first['ours_token']} vs "
            f"{first['llamacpp_token']}, margins {first['ours_margin']:.3f} / {first['llamacpp_margin']:.3f}")


def _speed(r: dict, key: str, fmt) -> str:
    s = r.get("speed", {})
    return " / ".join(fmt(s[side][key]) if key in s.get(side, {}) else "err" for side in ("ours", "llamacpp"))


def markdown(rec: dict) -> str:
    f = rec["figures"]
    st = f["settings"]
    m = rec["machine"]
    lines = [f"# Parity with llama.cpp ({rec['created'][:10]}, commit {rec['commit']})", "",
             f"{m.get('cpu_model')}, {m.get('nproc')} cores, {m.get('mem_total_gib')} GiB; threads {st['threads']}, "
             f"context {st['ctx']}. Ours: {st['ours']}. llama.cpp: {st['llamacpp']}.", "",
             f"Greedy: {st['prompts']} prompts x {st['new_tokens']} tokens (both fed llama.cpp's prompt ids). Logits: "
             f"the last prompt position's. Perplexity: {st['ppl_tokens']} tokens of held-out Wikipedia (llama.cpp's "
             f"ids), windows of {st['window']}: {st['ppl_definition']}. Decode: median step of {st['decode_steps']} "
             f"greedy steps, each side alone in its own process; peak RSS of that process (MB).", "",
             "| file | MB | ids equal | greedy | logits max diff | top-5 | ppl ours | ppl llama.cpp | ratio | "
             "decode ms/token ours / llama.cpp | peak RSS MB ours / llama.cpp |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in f["rows"]:
        if "error" in r:
            lines.append(f"| {r['label']} | {_mb(r['file_bytes'])} | error: {r['error']} | | | | | | | "
                         f"{_speed(r, 'decode_ms_per_token', lambda v: f'{v:.1f}')} | "
                         f"{_speed(r, 'peak_rss_bytes', _mb)} |")
            continue
        p = r["ppl"]
        ids = "yes" if r["ids_equal"] and r["ppl_text_ids_equal"] else (
            f"prompts {'yes' if r['ids_equal'] else 'NO'}, text {'yes' if r['ppl_text_ids_equal'] else 'NO'}")
        lines.append(f"| {r['label']} | {_mb(r['file_bytes'])} | {ids} | {_greedy(r)} | "
                     f"{r['last_logits_max_diff']:.2g} | {r['last_top5_agreement']:.2f} | {p['ours']['ppl']:.3f} | "
                     f"{p['llamacpp']['ppl']:.3f} | {p['ratio']:.4f} | "
                     f"{_speed(r, 'decode_ms_per_token', lambda v: f'{v:.1f}')} | {_speed(r, 'peak_rss_bytes', _mb)} |")
    refs = [(r["label"], i, g) for r in f["rows"] for i, g in enumerate(r.get("greedy", [])) if "reference" in g]
    if refs:
        lines += ["", "Divergences against a float64 reference of llama.cpp's graph (bench/parity_ref.py) on the "
                      "shared context: `exact` = the file's de-quantized weights, `rounded` = the same with "
                      "activations rounded as llama.cpp's CPU matrix products round them. Max |logit difference| "
                      "over the prompt's last position and every shared step; the reference's greedy token at the "
                      "divergence step. `rounding explains`: 1 - |llama.cpp - rounded|^2 / |llama.cpp - exact|^2 over "
                      "those logits, the share of llama.cpp's departure from exact arithmetic that the modelled "
                      "rounding accounts for.", "",
                  "| file | prompt | step | ours vs exact | llama.cpp vs rounded | llama.cpp vs exact | ours vs "
                  "llama.cpp | rounding explains | tokens ours / llama.cpp / exact / rounded |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for label, i, g in refs:
            x = g["reference"]
            lines.append(f"| {label} | {i} | {g['step']} | {x['ours_vs_exact']:.3g} | {x['llamacpp_vs_rounded']:.3g}"
                         f" | {x['llamacpp_vs_exact']:.3g} | {g['steps_logits_max_diff']:.3g} | "
                         f"{x['rounding_explains']:.0%} | {g['ours_token']} / "
                         f"{g['llamacpp_token']} / {x['exact_token']} / {x['rounded_token']} |")
    return "\n".join(lines) + "\n"
