"""Both predictor forms on one profile: recall, predicted sparsity, size and perplexity (docs/predictors.md).

    python -m bench.predictor_forms --root runs/forms --out bench/results/2026-11-24-cpu-predictor-forms.json

One pi-profile (the `make demo` settings), copied into ROOT/normed and ROOT/powerinfer (the same meta.json, so both
predictor sets name the same profile), pi-train-predictors with each --form, pi-eval on each. `--collect` only reads
the runs already there. Every figure comes from the stages' own files.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click
from hotneurons.artifacts.predictors import EvalReport, PredictorsMeta, PredictorsSummary
from hotneurons.common import artifacts

from bench import record

FORMS = ("normed", "powerinfer")
PROFILE = "pi-profile --tokens 12000 --samples-per-layer 16384 --target-sparsity 0.5 --force --quiet"
TRAIN = "pi-train-predictors --preset fast --target-recall 0.97 --quiet"
EVAL = "pi-eval --tokens 4096 --seq-len 256 --mode dense --mode predictor --recall-sweep 0.99,0.9 --quiet"


def run(cmd: str, bin_dir: Path) -> None:
    argv = shlex.split(cmd)
    subprocess.run([str(bin_dir / argv[0]), *argv[1:]], check=True, stdout=subprocess.DEVNULL)


def before_fold(s: dict) -> dict:
    """Mean test recall and predicted sparsity of the kept sizes as trained, before one threshold was folded in."""
    # the size kept (a variant that widened a layer after training: the nearest size tried)
    kept = [min(r["tried"], key=lambda t: abs(t["hidden"] - r["hidden"])) for r in s["layers"]]
    n = len(kept)
    return {"mean_recall": sum(t["test"]["recall"] for t in kept) / n,
            "mean_predicted_sparsity": sum(t["test"]["predicted_sparsity"] for t in kept) / n}


def figures(root: Path, extra: dict[str, str]) -> dict:
    out: dict = {}
    for form in (*FORMS, *extra):
        d = Path(extra.get(form, root / form))
        s = PredictorsSummary.load(d / "predictors/summary.json").to_dict()
        meta = PredictorsMeta.load(d / "predictors/meta.json").to_dict()
        ev = EvalReport.load(d / "eval/eval.json").to_dict()
        t = s["totals"]
        short = ("perplexity", "ppl_vs_dense", "ffn_sparsity", "recall", "magnitude_recall")
        row = {
            "commands": [meta["command"], ev["command"]],
            "test_split": {k: t[k] for k in ("mean_recall", "min_recall", "mean_precision", "mean_predicted_sparsity",
                                             "mean_true_sparsity")},
            "predictor_params": t["predictor_params"], "predictor_fraction_of_ffn": t["predictor_fraction_of_ffn"],
            "hidden_per_layer": [r["hidden"] for r in s["layers"]], "train_seconds": t["train_seconds"],
            "eval": {m: {k: r[k] for k in short if k in r} for m, r in ev["modes"].items()},
            "recall_sweep": [{"threshold_recall": r["threshold_recall"], **{k: r[k] for k in short if k in r}}
                             for r in ev["recall_sweep"]],
        }
        if form != "normed":
            row["global_threshold"] = t["global_threshold"]
            row["moved_layers"] = [r["layer"] for r in s["layers"] if r["threshold_moved"]]
            row["test_split_before_fold"] = before_fold(s)
            row["thresholds_before_fold"] = [r["threshold_before_fold"] for r in s["layers"]]
        else:
            row["thresholds"] = [r["threshold"] for r in s["layers"]]
        out[form] = row
    ev = EvalReport.load(root / "normed/eval/eval.json").to_dict()
    out["eval_text"] = {"dataset": ev["dataset"], "predicted_tokens": ev["modes"]["dense"]["tokens"],
                        "seq_len": ev["seq_len"]}
    pmeta = artifacts.read_json(root / "normed/profile/meta.json")
    out["profile"] = {"command": pmeta["command"], "copied_to": str(root / "powerinfer/profile"),
                      "tokens": pmeta["tokens"], "samples_per_layer": pmeta["samples"]["count"],
                      "mean_sparsity": pmeta["mean_sparsity"], "rule": pmeta["rule"]}
    out["note"] = ("one profile, one seed; train_seconds are wall-clock on 2 cores shared with other jobs. "
                   "test_split: each layer's held-out 10% of the profile samples; eval: held-out Wikipedia text")
    return out


@click.command()
@click.option("--root", default="runs/forms", show_default=True, help="Folder of the two run directories.")
@click.option("--out", required=True, help="Results JSON to write (bench/record.py's schema).")
@click.option("--collect", is_flag=True, help="Only read the runs already in ROOT.")
@click.option("--extra", multiple=True, help="LABEL=RUN: another powerinfer-form run to list (repeat).")
@click.option("--note", default=None, help="A note on the extra runs.")
def main(root, out, collect, extra, note) -> None:
    root = Path(root)
    bin_dir = Path(sys.executable).parent
    if not collect:
        run(f"{PROFILE} --out {root / 'normed'}", bin_dir)
        shutil.rmtree(root / "powerinfer", ignore_errors=True)
        (root / "powerinfer").mkdir(parents=True)
        shutil.copytree(root / "normed/profile", root / "powerinfer/profile")
        for form in FORMS:
            run(f"{TRAIN} --run {root / form} --form {form} --force", bin_dir)
            run(f"{EVAL} --run {root / form}", bin_dir)
    fig = figures(root, dict(e.split("=", 1) for e in extra))
    if note:
        fig["extra_note"] = note
    record.write_result(out, fig, kind="cpu")
    click.echo(f"wrote {out}")


if __name__ == "__main__":
    main()
