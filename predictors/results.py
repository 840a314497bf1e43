"""Collect a run's predictor and eval figures into one results file, against the issue's goals.

`python -m hotneurons.predictors.results --run RUN --out bench/results/predictors_smollm2.json --command "..."`
reads RUN/predictors/summary.json and RUN/eval/eval.json; every figure comes from those files.
`--sweep LABEL=RUN` (repeat) adds one row per other run (e.g. another `--target-sparsity`) with its commands.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import click
from hotneurons.artifacts.predictors import EvalReport, PredictorsMeta, PredictorsSummary
from hotneurons.artifacts.profile import ProfileMeta
from hotneurons.common import artifacts
from hotneurons.common.hardware import machine_info
from hotneurons.predictors.train import PRESETS

PRESETS_DEFAULT = asdict(PRESETS["default"])  # a sweep row lists only the fields it changed

GOALS = {"mean_recall": ">= 0.95", "predicted_ffn_sparsity": ">= 0.40", "predictor_fraction_of_ffn": "<= 0.10",
         "predictor_ppl_vs_dense": "<= +6%"}


def goals_met(totals: dict, pred: dict) -> dict[str, bool]:
    """GOALS judged on a predictors summary's totals (test split) and the eval's predictor mode."""
    return {
        "mean_recall": totals["mean_recall"] >= 0.95,
        "predicted_ffn_sparsity": totals["mean_predicted_sparsity"] >= 0.40,
        "predictor_fraction_of_ffn": totals["predictor_fraction_of_ffn"] <= 0.10,
        "predictor_ppl_vs_dense": bool(pred) and pred.get("ppl_vs_dense", 1.0) <= 0.06,
    }


def _short(r: dict) -> dict:
    return {k: r[k] for k in ("perplexity", "ppl_vs_dense", "ffn_sparsity", "recall", "magnitude_recall") if k in r}


def sweep_row(label: str, run_dir: str | Path) -> dict[str, Any]:
    """One setting of a sweep: the commands (from each stage's meta.json), training totals and eval figures."""
    run_dir = Path(run_dir)
    pmeta = ProfileMeta.load(run_dir / "profile" / "meta.json").to_dict()
    s = PredictorsSummary.load(run_dir / "predictors" / "summary.json").to_dict()
    tmeta = PredictorsMeta.load(run_dir / "predictors" / "meta.json").to_dict()
    ev_path = run_dir / "eval" / "eval.json"
    ev = EvalReport.load(ev_path).to_dict() if ev_path.exists() else None
    t = s["totals"]
    row: dict[str, Any] = {
        "label": label, "run": str(run_dir),
        "commands": [pmeta["command"], tmeta["command"]] + ([ev["command"]] if ev else []),
        "profile": {"tokens": pmeta["tokens"], "rule": pmeta["rule"], "target_sparsity": pmeta["target_sparsity"],
                    "mean_sparsity": pmeta["mean_sparsity"], "samples_per_layer": pmeta["samples"]["count"],
                    "seconds": pmeta["seconds"],
                    "mean_share80": sum(pmeta["share_covering_80pct_per_layer"]) / pmeta["model"]["n_layers"]},
        "training": {k: t[k] for k in ("mean_recall", "min_recall", "mean_precision", "mean_predicted_sparsity",
                                       "mean_true_sparsity", "predictor_params", "predictor_fraction_of_ffn",
                                       "fits", "train_seconds", "device")},
        "hidden_per_layer": [r["hidden"] for r in s["layers"]],
        "config": {k: v for k, v in s["config"].items() if PRESETS_DEFAULT.get(k) != v},
    }
    if ev:
        row["eval"] = {"dataset": ev["dataset"], "tokens": next(iter(ev["modes"].values()))["tokens"],
                       "modes": {m: _short(r) for m, r in ev["modes"].items()},
                       "recall_sweep": [{"threshold_recall": r["threshold_recall"], **_short(r)}
                                        for r in ev.get("recall_sweep", [])]}
        row["goal_met"] = goals_met(t, ev["modes"].get("predictor", {}))
    return row


def collect(run_dir: str | Path, commands: list[str], extra: dict[str, str] | None = None,
            sweep: dict[str, str] | None = None) -> dict[str, Any]:
    """The figures of RUN; `extra` = {label: path of another eval.json} adds its modes (e.g. an ablation);
    `sweep` = {label: other run directory} adds a `sweep` list of `sweep_row`s."""
    run_dir = Path(run_dir)
    # typed loads check each file's version; the figures are then copied key by key into the results file
    s = PredictorsSummary.load(run_dir / "predictors" / "summary.json").to_dict()
    ev = EvalReport.load(run_dir / "eval" / "eval.json").to_dict()
    pmeta = ProfileMeta.load(run_dir / "profile" / "meta.json").to_dict()
    t, modes = s["totals"], ev["modes"]
    pred = modes.get("predictor", {})
    met = goals_met(t, pred)
    others = {}
    for label, path in (extra or {}).items():
        e = EvalReport.load(path).to_dict()
        others[label] = {"command": e.get("command"), "dataset": e["dataset"],
                         "modes": {m: _short(r) for m, r in e["modes"].items()}}
    return {
        "what": "per-layer activation predictors for SmolLM2-135M-Instruct: recall, predicted FFN sparsity, size, "
                "and perplexity dense / oracle / predictor (/ placement) on held-out Wikipedia text",
        "command": commands,
        "machine": machine_info("numpy"),
        "profile": {"dataset": pmeta["dataset"], "tokens": pmeta["tokens"], "rule": pmeta["rule"],
                    "target_sparsity": pmeta["target_sparsity"], "samples_per_layer": pmeta["samples"]["count"],
                    "mean_share80": sum(pmeta["share_covering_80pct_per_layer"]) / pmeta["model"]["n_layers"]},
        "goals": GOALS,
        "goal_met": met,
        "goal_basis": "recall and predicted sparsity: mean over layers on each layer's test split of the profile "
                      "samples; perplexity: eval.modes.predictor on held-out text",
        "goal_met_on_eval_text": {
            "recall": bool(pred) and pred["recall"] >= 0.95,
            "predicted_ffn_sparsity": bool(pred) and pred["ffn_sparsity"] >= 0.40,
        },
        "training": {
            "seconds": t["train_seconds"], "device": t["device"], "fits": t["fits"],
            "predictor_params": t["predictor_params"], "ffn_params": t["ffn_params"],
            "predictor_fraction_of_ffn": t["predictor_fraction_of_ffn"],
            "mean_recall_test": t["mean_recall"], "min_recall_test": t["min_recall"],
            "mean_precision_test": t["mean_precision"], "mean_predicted_sparsity_test": t["mean_predicted_sparsity"],
            "mean_true_sparsity_test": t["mean_true_sparsity"], "config": s["config"],
        },
        "per_layer": [{k: r[k] for k in ("layer", "hidden", "params", "share80", "recall", "precision",
                                         "predicted_sparsity", "threshold")} | {"sizes_tried": [x["hidden"] for x in
                                                                                                 r["tried"]]}
                      for r in s["layers"]],
        "eval": {
            "dataset": ev["dataset"], "tokens": next(iter(modes.values()))["tokens"], "seq_len": ev["seq_len"],
            "device": ev["device"], "dtype": ev["dtype"], "threshold_recall": ev["threshold_recall"],
            "modes": {m: {k: r[k] for k in ("perplexity", "ppl_vs_dense", "ffn_sparsity", "recall",
                                             "magnitude_recall", "seconds") if k in r}
                      | ({"gpu_neuron_share": r["gpu_neuron_share"]} if "gpu_neuron_share" in r else {})
                      for m, r in modes.items()},
            "recall_sweep": [{k: r[k] for k in ("threshold_recall", "perplexity", "ppl_vs_dense", "ffn_sparsity",
                                                "recall", "magnitude_recall", "seconds")}
                             for r in ev.get("recall_sweep", [])],
        },
        "other_evals": others,
        **({"sweep": [sweep_row(label, path) for label, path in sweep.items()]} if sweep else {}),
    }


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--run", "run_dir", required=True, help="Run directory with predictors/ and eval/.")
@click.option("--out", required=True, help="Results JSON to write.")
@click.option("--command", "commands", multiple=True, help="A command that produced the run (repeat).")
@click.option("--extra-eval", multiple=True, help="LABEL=PATH of another eval.json to include (repeat).")
@click.option("--sweep", "sweep_runs", multiple=True,
              help="LABEL=RUN of another run directory (profile, predictors, eval) to list in `sweep` (repeat).")
def main(run_dir, out, commands, extra_eval, sweep_runs) -> None:
    """Write the predictor and eval figures of RUN to one JSON file."""
    extra = dict(e.split("=", 1) for e in extra_eval)
    sweep = dict(e.split("=", 1) for e in sweep_runs)
    artifacts.write_json(out, collect(run_dir, list(commands), extra, sweep))
    click.echo(f"wrote {out}")


if __name__ == "__main__":
    main()
