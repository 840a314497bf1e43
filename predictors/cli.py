"""`pi-train-predictors` and `pi-eval`: thin click commands over `train_predictors` and `evaluate`."""

from __future__ import annotations

import json
from pathlib import Path

import click
from hotneurons.artifacts.predictors import EvalMode, PredictorsSummary
from hotneurons.common.artifacts import ArtifactError, default_run_dir
from hotneurons.common.cli import StageCommand, cli_error, interrupted, stdout_to_stderr
from hotneurons.common.corpus import CorpusError, known_datasets
from hotneurons.common.kinds import FixableError

_CTX = {"help_option_names": ["-h", "--help"], "max_content_width": 110}
_DEFAULT_RUN = str(default_run_dir("SmolLM2-135M-Instruct"))


@click.command(cls=StageCommand, run_folder=lambda p: p["run_dir"], context_settings=_CTX)
@click.option("--run", "run_dir", default=_DEFAULT_RUN, show_default=True,
              help="Run directory holding profile/ (with samples); predictors/ is written there.")
@click.option("--preset", "preset_name", default="default", show_default=True,
              help="Named settings: default, fast (fewer epochs and size steps), thorough, plain "
              "(--magnitude-weight 0: no model needed).")
@click.option("--form", default=None,
              help="What the predictors read: normed (the FFN input, a threshold per layer) or powerinfer (the "
              "residual before the pre-FFN RMSNorm, one threshold for all layers: what PowerInfer runs) [preset: "
              "normed].")
@click.option("--target-recall", type=float, default=None,
              help="Share of truly active neurons the threshold must catch on the val split [preset: 0.95].")
@click.option("--max-predictor-fraction", type=float, default=None,
              help="Budget: total predictor parameters / total FFN parameters [preset: 0.10].")
@click.option("--epochs", type=click.IntRange(1), default=None, help="Max epochs per fit [preset: 8].")
@click.option("--base-scale", type=float, default=None,
              help="Base size h = base-scale * n_neurons * active share * share80/0.8 [preset: 0.125].")
@click.option("--max-steps", type=click.IntRange(0), default=None,
              help="Size changes tried per layer by the skewness search [preset: 2].")
@click.option("--magnitude-weight", type=click.FloatRange(0), default=None,
              help="Weigh active pairs by (|h|/tau)^W in the loss (reads the model's FFN weights; 0 = off) "
              "[preset: 1].")
@click.option("--seed", type=int, default=None, help="Seed of the split, init and batch order [preset: 0].")
@click.option("--device", default="auto", show_default=True, help="auto (CUDA when present), cpu, cuda, cuda:N.")
@click.option("--force", is_flag=True, help="Replace predictors of another model.")
@click.option("--expert-rank", type=click.IntRange(1), default=32, show_default=True,
              help="Sparse experts: each expert predictor's rank.")
@click.option("--expert-tokens", type=click.IntRange(1), default=8192, show_default=True,
              help="Sparse experts: tokens of the profile's corpus streamed for the experts' inputs.")
@click.option("--json", "as_json", is_flag=True, help="Print summary.json instead of the table.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def train_main(run_dir, preset_name, form, target_recall, max_predictor_fraction, epochs, base_scale, max_steps,
               magnitude_weight, seed, device, force, expert_rank, expert_tokens, as_json, quiet) -> None:
    """Train one activation predictor per layer from RUN/profile/samples.

    Each predictor is Linear(d_model->h) -> ReLU -> Linear(h->n_neurons); h is sized per layer from the
    layer's sparsity and skewness (share of neurons covering 80% of activations) within the parameter
    budget. Writes RUN/predictors/: predictors.safetensors, summary.json, meta.json.

    A mixture of sparse experts (reglu, drelu): one low-rank predictor per expert, fitted from its gate on
    its routed inputs (--expert-rank, --expert-tokens, --target-recall [0.99]), so that the CPU reads only
    the marked neurons' rows of its cold experts. Writes RUN/predictors/expert_predictors.{safetensors,json}.
    """
    from hotneurons.predictors.train import preset, train_predictors

    if experts_run(run_dir):
        return train_experts(run_dir, expert_rank, target_recall, expert_tokens, device, as_json, quiet)
    try:
        cfg = preset(preset_name, form=form, target_recall=target_recall, max_predictor_fraction=max_predictor_fraction,
                     epochs=epochs, base_scale=base_scale, max_steps=max_steps, seed=seed,
                     magnitude_weight=magnitude_weight)
        with stdout_to_stderr(as_json):
            summary = train_predictors(run_dir, cfg, device=device, force=force, progress=not quiet)
    except (ArtifactError, ValueError) as e:
        raise cli_error(e, {"preset": "--preset"}) from None
    except KeyboardInterrupt:
        interrupted(f"nothing was written ({Path(run_dir) / 'predictors'} is as it was): run the command again")
    click.echo(json.dumps(summary.to_dict(), indent=2) if as_json else format_train(summary, Path(run_dir)))
    from hotneurons.predictors.train import training_warning

    if (warning := training_warning(summary)) is not None:
        click.echo(warning, err=True)


def experts_run(run_dir: str | Path) -> bool:
    """A run whose profile is a mixture of experts' (meta.experts set)."""
    from hotneurons.artifacts.profile import check_profile

    try:
        return (Path(run_dir) / "profile" / "meta.json").exists() and check_profile(run_dir).experts is not None
    except (ArtifactError, ValueError):
        return False  # train_predictors says what is wrong with the run


def train_experts(run_dir, rank: int, recall: float | None, tokens: int, device: str, as_json: bool,
                  quiet: bool) -> None:
    """pi-train-predictors on a mixture of experts: expert predictors for sparse experts, else refused in one line."""
    from hotneurons.predictors.experts_fit import fit_expert_predictors

    try:
        with stdout_to_stderr(as_json):
            s = fit_expert_predictors(run_dir, rank=rank, recall=0.99 if recall is None else recall, tokens=tokens,
                                      device=device, progress=not quiet)
    except FixableError as e:
        raise cli_error(e, {"expert_rank": "--expert-rank", "target_recall": "--target-recall",
                            "expert_tokens": "--expert-tokens", "run": "--run"}) from None
    except (ArtifactError, CorpusError, ValueError) as e:
        raise cli_error(e, {}) from None
    except KeyboardInterrupt:
        interrupted(f"nothing was written ({Path(run_dir) / 'predictors'} is as it was): run the command again")
    if as_json:
        click.echo(json.dumps({k: v for k, v in s.items() if k != "experts_fitted"}, indent=2))
        return
    click.echo(f"expert predictors for {s['predictors']} of {s['experts']} experts (rank {s['rank']}) in "
               f"{s['seconds']:.1f} s on {s['device']} -> {s['file']}\n"
               f"held-out recall mean {s['mean_recall']:.3f} (min {s['min_recall']:.3f}) at target "
               f"{s['target_recall']}; "
               f"neurons marked {s['mean_marked']:.3f} where the gate fires for {s['mean_gate_fires']:.3f} "
               f"(the cold experts read the marked neurons' rows only)")


def format_train(summary: PredictorsSummary, run_dir: Path) -> str:
    t = summary.totals
    lines = [f"predictors for {t.layers} layers in {t.train_seconds:.1f} s on {t.device} "
             f"({t.fits} fits) -> {run_dir / 'predictors'}",
             f"params {t.predictor_params:,} = {t.predictor_fraction_of_ffn:.3f} of FFN params "
             f"(budget {summary.config['max_predictor_fraction']})",
             f"test split: mean recall {t.mean_recall:.3f} (min {t.min_recall:.3f}), precision "
             f"{t.mean_precision:.3f}, predicted sparsity {t.mean_predicted_sparsity:.3f} "
             f"(true {t.mean_true_sparsity:.3f})"]
    if t.global_threshold is not None:
        lines.append(f"powerinfer form: one threshold {t.global_threshold:.6g} for all layers ({t.moved_layers} "
                     f"lowered to fold it)")
    lines.append("layer  share80  hidden  tried         recall  precision  pred.sparsity")
    for r in summary.layers:
        tried = ",".join(str(x["hidden"]) for x in r.tried)
        lines.append(f"{r.layer:5d}  {r.share80:7.3f}  {r.hidden:6d}  {tried:12.12s}  {r.recall:6.3f}  "
                     f"{r.precision:9.3f}  {r.predicted_sparsity:13.3f}")
    return "\n".join(lines)


@click.command(cls=StageCommand, run_folder=lambda p: p["run_dir"], context_settings=_CTX)
@click.option("--run", "run_dir", default=_DEFAULT_RUN, show_default=True,
              help="Run directory with profile/ and, optionally, predictors/ and placement/.")
@click.option("--mode", "modes", multiple=True, type=click.Choice(EvalMode.values()),
              help="Modes to evaluate (repeat). Default: dense, oracle, and predictor/placement when present; a "
              "mixture of experts runs dense only.")
@click.option("--dataset", default="wikipedia-sample:eval", show_default=True, help=f"Corpus: {known_datasets()}.")
@click.option("--text-column", default="text", show_default=True, help="Text column of .jsonl/.parquet/hub data.")
@click.option("--tokens", default=32768, show_default=True, type=click.IntRange(2), help="Token budget.")
@click.option("--seq-len", default=512, show_default=True, type=click.IntRange(2), help="Tokens per sequence.")
@click.option("--batch-size", default=2, show_default=True, type=click.IntRange(1), help="Sequences per forward.")
@click.option("--recall", type=float, default=None,
              help="Use the predictors' thresholds tabulated for this recall (e.g. 0.8) instead of the trained one.")
@click.option("--recall-sweep", default=None,
              help="Comma-separated tabulated recalls (e.g. 0.9,0.8,0.7): also run the predictor mode at each.")
@click.option("--model", default=None, help="Model to load. Default: the one recorded in the profile.")
@click.option("--gguf-file", default=None, help="GGUF file name inside the --model folder.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:N.")
@click.option("--dtype", default="auto", show_default=True,
              help="auto (f32 on CPU, f16 on CUDA), f32, f16, bf16 (aliases fp16, float16, ... accepted).")
@click.option("--row-format", "row_formats", multiple=True, metavar="FMT",
              help="Also evaluate every mode with the FFN rows stored as the runtime stores them in FMT: "
              "bf16, q8_0, q4_0 or q4_1 (repeat, or a comma list; gate and up rows and the down projection's "
              "columns, blocks along d_model). Default: none.")
@click.option("--criterion", "criteria", default=None, metavar="CRIT[,CRIT...]",
              help="Gated (SwiGLU/GeGLU) models: also evaluate with the FFN masked by each training-free criterion "
              "at the profile's thresholds: h (|act(gate)*up|), gate (|act(gate)|, CATS), gate-h (both), input "
              "(|x|, TEAL: input channels), wina (|x| * gate column norm). Default with --sparsity: the profile's.")
@click.option("--sparsity", "sparsities", default=None, metavar="S[,S...]",
              help="Sparsities to evaluate each --criterion at, among those the profile tabulates (default "
              "0.25,0.4,0.5,0.65 and its target). Default with --criterion: the profile's target.")
@click.option("--answers", default=None, type=click.Path(dir_okay=False),
              help="With --criterion: a JSON list of chat prompts (bench/data/gated_prompts.json) answered greedily "
              "dense and masked; reports the share of identical answers and of tokens before the first divergence "
              "(the whole model through transformers: --whole-model).")
@click.option("--answer-tokens", default=32, show_default=True, type=click.IntRange(1),
              help="Greedy tokens per answer (--answers).")
@click.option("--layer-by-layer/--whole-model", default=None,
              help="How the model runs: layer by layer from its file (one layer's weights on the device at a time: "
              "models bigger than it) or whole through transformers. Default: layer by layer for a local "
              "safetensors folder or .gguf file, whole for hub ids.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report instead of the table.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
def eval_main(run_dir, modes, dataset, text_column, tokens, seq_len, batch_size, recall, recall_sweep, model,
              gguf_file, device, dtype, row_formats, criteria, sparsities, answers, answer_tokens, layer_by_layer,
              as_json, quiet) -> None:
    """Perplexity with the FFN dense, oracle-sparse, predictor-sparse and as the runtime would run it.

    Writes RUN/eval/eval.json. Oracle: the profile's activation rule on the true values. Predictor: neurons
    computed iff the predictor fires. Placement: GPU neurons always, the others where the predictor fires.
    --row-format repeats the modes with the FFN rows rounded to each storage format (eval.json's row_formats).
    """
    from hotneurons.common.cli import parse_sparsities
    from hotneurons.common.gating import criterion as check_criterion
    from hotneurons.predictors.row_formats import RowFormatError, parse_row_formats

    sparsities = parse_sparsities(sparsities, "--sparsity") if sparsities is not None else None
    try:  # a criterion name is refused before torch and the model load
        criteria = [check_criterion(c.strip()).value for c in criteria.split(",") if c.strip()] if criteria else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--criterion") from None
    try:
        sweep = [float(r) for r in recall_sweep.split(",")] if recall_sweep else None
    except ValueError:
        raise click.BadParameter(f"'{recall_sweep}' is not a comma-separated list of numbers, e.g. 0.9,0.8",
                                 param_hint="--recall-sweep") from None
    try:
        row_formats = parse_row_formats(row_formats)  # refused here, before torch and the model load
    except RowFormatError as e:
        raise cli_error(e, {"row_formats": "--row-format"}) from None
    from hotneurons.predictors.evaluate import evaluate, format_table

    try:
        with stdout_to_stderr(as_json):
            report = evaluate(run_dir, modes=list(modes) or None, recall_sweep=sweep, dataset=dataset,
                              text_column=text_column,
                              tokens=tokens, seq_len=seq_len, batch_size=batch_size, recall=recall, model=model,
                              gguf_file=gguf_file, device=device, dtype=dtype, progress=not quiet,
                              layer_by_layer=layer_by_layer, row_formats=row_formats, criteria=criteria,
                              sparsities=sparsities, answers=answers, new_tokens=answer_tokens)
    except (ArtifactError, CorpusError, FixableError, ValueError) as e:
        raise cli_error(e, {"modes": "--mode", "row_formats": "--row-format", "sparsity": "--sparsity",
                            "layer_by_layer": "--whole-model"}) from None
    except KeyboardInterrupt:
        interrupted(f"nothing was written ({Path(run_dir) / 'eval'} is as it was): run the command again")
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else format_table(report))
