"""How much FFN sparsity can a predictor of a given size buy? One layer, several hidden sizes, the train recipe.

    python -m bench.predictor_capacity --run runs/smollm2-s0.7 --layer 14 --sizes 48,112,256,512 --epochs 8 30

For each (epochs, hidden size) it trains one predictor with `fit_layer` (the default preset otherwise: magnitude
weighting, early stopping on val) on the layer's profile samples and reports the predicted sparsity at recall
0.95 on the train split (its own threshold: what the network can fit), val and test (the val threshold).
Train and test close together = the size limits it, not the number of samples. Writes a JSON results file.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import click
import torch
from hotneurons.artifacts.predictor_file import Predictor
from hotneurons.artifacts.profile import read_profile
from hotneurons.common import artifacts
from hotneurons.common.hardware import machine_info
from hotneurons.models.family import load_model_from_meta
from hotneurons.predictors.train import (
    PRESETS,
    ffn_values,
    fit_layer,
    importance_weights,
    load_samples,
    metrics,
    samples_dir,
    split_indices,
    threshold_for_recall,
)

from bench import record


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--run", "run_dir", required=True, help="Run directory with profile/ (and samples).")
@click.option("--layer", type=int, default=14, show_default=True)
@click.option("--sizes", default="48,112,256,512", show_default=True, help="Hidden sizes, comma-separated.")
@click.option("--epochs", "epoch_list", type=int, multiple=True, default=(8,), show_default=True,
              help="Max epochs (repeat for several).")
@click.option("--threads", type=int, default=1, show_default=True, help="torch threads.")
@click.option("--out", default=None, help="JSON file to write (default: print only).")
def main(run_dir, layer, sizes, epoch_list, threads, out) -> None:
    torch.set_num_threads(threads)
    _, pmeta = read_profile(run_dir)
    base = PRESETS["default"]
    lm = load_model_from_meta(pmeta["model"], device="cpu", dtype=pmeta.get("config", {}).get("dtype", "auto"))
    n = pmeta["model"]["n_neurons"]
    x, m = load_samples(samples_dir(Path(run_dir), pmeta), layer, n)  # (count, d), (count, n)
    tau = pmeta["taus"][layer] if pmeta["rule"] == "abs>tau" else None
    w = importance_weights(ffn_values(lm, layer, x), m, tau, base)
    splits = split_indices(len(x), base)
    ffn = pmeta["model"]["params"]["ffn_per_layer"][layer]
    rows = []
    for epochs in epoch_list:
        cfg = replace(base, epochs=epochs, patience=max(base.patience, epochs // 10))
        for h in (int(s) for s in sizes.split(",")):
            f = fit_layer(x, m, h, cfg, splits, "cpu", seed=cfg.seed * 100_003 + layer, importance=w)
            p = Predictor(x.shape[1], h, n)
            p.load_state_dict({**f.state, "threshold": torch.zeros(1)})
            with torch.no_grad():
                lt, mt = p(x[splits[0]]), m[splits[0]]
                train = metrics(lt, mt, threshold_for_recall(lt, mt, cfg.target_recall))
            row = {"hidden": h, "params_share_of_ffn": f.params / ffn, "max_epochs": epochs, "epochs": f.epochs,
                   "seconds": round(f.seconds, 1), "train_own_threshold": train, "val": f.val, "test": f.test}
            rows.append(row)
            click.echo(f"h={h:4d} ({row['params_share_of_ffn']:.3f} of FFN) epochs {f.epochs:2d}/{epochs}: predicted "
                       f"sparsity at recall {cfg.target_recall} train {train['predicted_sparsity']:.3f} "
                       f"val {f.val['predicted_sparsity']:.3f} test {f.test['predicted_sparsity']:.3f} "
                       f"(test recall {f.test['recall']:.3f}, precision {f.test['precision']:.3f})")
    if out:
        record.write_flat(out, {
            "what": "predicted FFN sparsity at recall 0.95 vs predictor hidden size, one layer "
                    "(bench/predictor_capacity.py)",
            "command": artifacts.command_line(), "machine": machine_info("numpy"), "run": str(run_dir),
            "layer": layer, "profile": {k: pmeta[k] for k in ("tokens", "rule", "target_sparsity")},
            "true_sparsity_test": rows[0]["test"]["true_sparsity"], "rows": rows})
        click.echo(f"wrote {out}")


if __name__ == "__main__":
    main()
