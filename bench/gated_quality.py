"""Training-free activation sparsity of a gated (SwiGLU) model: the quality table of docs/gated.md.

    python -m bench.gated_quality                       # the embedded SmolLM2-135M-Instruct, CPU, ~15 min on 2 cores

pi-profile (whole model through transformers, float32) calibrates every criterion of common/gating.py (h, gate,
gate-h, input, wina) at 0.25/0.4/0.5/0.65 on `--calibration-tokens` of the Wikipedia sample's training articles and
counts their passes on `--tokens` more (the top-20% skew); pi-eval then measures, per criterion and sparsity on
`--eval-tokens` held-out tokens (`wikipedia-sample:eval`, rows of `--seq-len`): perplexity against dense, the
measured sparsity, the FFN row bytes a token reads (gating.bytes_read_share) and the answer agreement on
bench/data/gated_prompts.json (greedy `--new-tokens`, dense vs masked). Sparsity 0 is dense. The relufied SmolLM2's
figures are read from the relufy results (bench/results/2026-11-24-nvidia-h200-relufy.json), not re-measured.

Writes a results record (bench/record.py) and the markdown table between the `gated-quality` markers of docs/gated.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RELUFY = ROOT / "bench" / "results" / "2026-11-24-nvidia-h200-relufy.json"
RELUFIED = ("relu-9m", "relu", "fatrelu-0.1-9m", "cos250-10m-until70", "cos100-10m")  # runs quoted beside
GOALS = {"0.4": 1.03, "0.5": 1.08}  # perplexity ratio to dense the issue asks for at these sparsities
MARK = ("<!-- gated-quality:start -->", "<!-- gated-quality:end -->")


def relufied_reference() -> list[dict]:
    """The relufied SmolLM2's perplexity ratio and exact-zero share (its own eval: 65,280 tokens on an H200), with the
    bytes a gate-first kernel would read at that sparsity (ReLU's gate is an exact predictor)."""
    from hotneurons.common.gating import bytes_read_share

    from bench import record

    if not RELUFY.exists():
        return []
    sweep = {r["name"]: r for r in record.read(RELUFY)["figures"]["sweep"]}
    return [{"name": n, "activation": sweep[n]["activation"], "tokens_trained": sweep[n]["tokens"],
             "ppl_ratio": sweep[n]["ppl_ratio"], "sparsity": sweep[n]["zeros"],
             "bytes_read_share": bytes_read_share("gate", 1 - sweep[n]["zeros"]),
             "source": str(RELUFY.relative_to(ROOT))} for n in RELUFIED if n in sweep]


def table(figures: dict) -> str:
    """The markdown table: a row per criterion and sparsity (0: dense), then the relufied models."""
    import numpy as np

    lines = ["| criterion | target sparsity | measured sparsity (eval text) | ppl ratio | same answers | tokens "
             "before divergence | bytes read / token | top-20% share of passes (profile) |",
             "|---|---|---|---|---|---|---|---|"]
    top = figures["profile"]["top20_share"]
    for r in figures["rows"]:
        s = r["sparsity"]
        skew = "-" if s == 0 else f"{np.nanmean(top[r['criterion']][r['key']]):.3f}"
        unit = " (channels)" if r["skips"] == "channels" and s else ""
        lines.append(f"| {r['criterion']} | {s:g} | {r['ffn_sparsity']:.3f}{unit} | {r['ppl_ratio']:.3f}x | "
                     f"{r['identical_share']:.2f} | {r['prefix_share']:.2f} | {r['bytes_read_share']:.3f} | {skew} |")
    for r in figures["relufied"]:
        lines.append(f"| relufied `{r['name']}` ({r['activation']}, {r['tokens_trained'] / 1e6:.1f}M tokens "
                     f"trained) | - | {r['sparsity']:.3f} (exact zeros) | {r['ppl_ratio']:.3f}x | - | - | "
                     f"{r['bytes_read_share']:.3f} | - |")
    return "\n".join(lines)


def best(figures: dict) -> dict:
    """Per goal sparsity, the criterion with the lowest perplexity ratio, and whether each meets the goal."""
    out = {}
    for k, goal in GOALS.items():
        rows = [r for r in figures["rows"] if r["key"] == k]
        if rows:
            b = min(rows, key=lambda r: r["ppl_ratio"])
            out[k] = {"goal_ppl_ratio": goal, "best": b["criterion"], "best_ppl_ratio": b["ppl_ratio"],
                      "meets": {r["criterion"]: r["ppl_ratio"] <= goal for r in rows}}
    return out


def write_doc(doc: Path, md: str) -> None:
    """The table between the markers of `doc` (appended with them where they are missing)."""
    text = doc.read_text() if doc.exists() else ""
    block = f"{MARK[0]}\n{md}\n{MARK[1]}"
    if MARK[0] in text and MARK[1] in text:
        text = text[:text.index(MARK[0])] + block + text[text.index(MARK[1]) + len(MARK[1]):]
    else:
        text = text + ("\n" if text else "") + block + "\n"
    doc.write_text(text)


def run(a: argparse.Namespace) -> dict:
    import torch
    from hotneurons.common.gating import key
    from hotneurons.models.family import load_model
    from hotneurons.predictors.evaluate import evaluate, format_table
    from hotneurons.profiler.cli import format_summary
    from hotneurons.profiler.profile import ProfileConfig, profile_model

    torch.manual_seed(0)
    t0 = time.perf_counter()
    lm = load_model(a.model, device="cpu", dtype="float32")
    cfg = ProfileConfig(model=a.model, dataset="wikipedia-sample", tokens=a.tokens, seq_len=512, batch_size=8,
                        target_sparsity=0.5, calibration_tokens=a.calibration_tokens, samples_per_layer=0,
                        dtype="float32", criterion="h", sparsities=tuple(a.sparsities))
    meta = profile_model(cfg, a.run, lm=lm, force=True, progress=not a.quiet)
    print(format_summary(meta), file=sys.stderr, flush=True)
    t1 = time.perf_counter()
    rep = evaluate(a.run, criteria=a.criteria, sparsities=a.sparsities, dataset="wikipedia-sample:eval",
                   tokens=a.eval_tokens, seq_len=a.seq_len, batch_size=8, lm=lm, answers=a.prompts,
                   new_tokens=a.new_tokens, progress=not a.quiet)
    print(format_table(rep), file=sys.stderr, flush=True)
    t2 = time.perf_counter()
    dense = rep.modes["dense"]
    rows = [{"criterion": c, "sparsity": 0.0, "key": "0", "skips": "neurons" if c in ("h", "gate", "gate-h")
             else "channels", "ffn_sparsity": 0.0, "ppl_ratio": 1.0, "perplexity": dense.perplexity,
             "identical_share": 1.0, "prefix_share": 1.0, "bytes_read_share": 1.0} for c in a.criteria]
    for g in rep.gated:
        rows.append({"criterion": g.criterion.value, "sparsity": g.sparsity, "key": key(g.sparsity),
                     "skips": g.skips, "ffn_sparsity": g.ffn_sparsity, "ppl_ratio": g.perplexity / dense.perplexity,
                     "perplexity": g.perplexity, "identical_share": g.answers.identical_share,
                     "prefix_share": g.answers.prefix_share, "bytes_read_share": g.bytes_read_share,
                     "gate_pass_share": g.gate_pass_share, "pass_share_per_layer": g.per_layer["pass_share"]})
    order = {c: i for i, c in enumerate(a.criteria)}
    rows.sort(key=lambda r: (order[r["criterion"]], r["sparsity"]))
    g = meta.gated
    return {
        "model": meta.model["name"], "dtype": "float32", "device": "cpu",
        "profile": {"dataset": "wikipedia-sample (train)", "calibration_tokens": g["calibration_tokens"],
                    "counted_tokens": meta.tokens, "seq_len": 512, "taus": g["taus"], "pass_share": g["pass_share"],
                    "top20_share": g["top20_share"], "seconds": round(t1 - t0, 1)},
        "eval": {"dataset": "wikipedia-sample:eval", "tokens": dense.tokens, "seq_len": a.seq_len,
                 "dense_perplexity": dense.perplexity, "prompts": str(Path(a.prompts).relative_to(ROOT))
                 if Path(a.prompts).resolve().is_relative_to(ROOT) else a.prompts,
                 "new_tokens": a.new_tokens, "dense_answers": rep.answers["dense"], "seconds": round(t2 - t1, 1)},
        "rows": rows,
        "relufied": relufied_reference(),
        "note": "ppl ratio: perplexity with the FFN masked by the criterion at the profile's thresholds for the target "
                "sparsity over dense, on the same held-out tokens; measured sparsity: share of (token, neuron) pairs "
                "skipped on the eval text (input, wina: of (token, FFN input channel) pairs); bytes read: share of the "
                "FFN's gate/up/down row bytes a token reads (common/gating.bytes_read_share); relufied rows: "
                "pi-relufy's models, their own eval (65,280 tokens at seq 256 on an H200, original 28.39), exact "
                "zeros, bytes as a gate-first kernel would read them",
    }


def main() -> None:
    from hotneurons.common.gating import SPARSITIES

    from bench import record

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a gated model (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--run", default=str(ROOT / "runs" / "gated-quality"), help="run directory (profile/, eval/)")
    ap.add_argument("--calibration-tokens", type=int, default=16384)
    ap.add_argument("--tokens", type=int, default=32768, help="tokens whose passes the profile counts (the skew)")
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--criteria", default="h,gate,gate-h,input,wina")
    ap.add_argument("--sparsities", default=",".join(f"{s:g}" for s in SPARSITIES))
    ap.add_argument("--prompts", default=str(ROOT / "bench" / "data" / "gated_prompts.json"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "2026-11-29-cpu-gated-quality.json"))
    ap.add_argument("--doc", default=str(ROOT / "docs" / "gated.md"), help="markdown file the table goes into")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args()
    a.criteria = a.criteria.split(",")
    a.sparsities = [float(s) for s in a.sparsities.split(",")]
    figures = run(a)
    figures["best"] = best(figures)
    md = table(figures)
    record.write_result(a.out, figures)
    write_doc(Path(a.doc), md)
    print(md)
    print(json.dumps(figures["best"], indent=1))


if __name__ == "__main__":
    main()
