"""`pi-relufy`: a thin click command over `relufy`."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import click
from hotneurons.common.artifacts import ArtifactError
from hotneurons.common.cli import StageCommand, interrupted
from hotneurons.common.corpus import CorpusError, known_datasets
from hotneurons.relufy.config import ACTIVATIONS, PENALTIES, PRESETS, RelufyError, RelufyInterrupted, preset


def _tokens(ctx, param, value):
    """8M, 500k, 2_000_000 -> int."""
    if value is None:
        return None
    text = str(value).strip().lower().replace("_", "")
    scale = {"k": 1_000, "m": 1_000_000, "b": 1_000_000_000}.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise click.BadParameter(f"'{value}' is not a token count: give e.g. 8M, 500k or 2000000") from None


@click.command(cls=StageCommand, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("--model", default=None, help="HF hub id, local folder, or .gguf file of a gated-FFN (SwiGLU) model. "
              "Default: the embedded SmolLM2-135M-Instruct.")
@click.option("--gguf-file", default=None, help="GGUF file name inside the --model folder.")
@click.option("--out", required=True, help="Output folder (an HF model folder).")
@click.option("--preset", "preset_name", type=click.Choice(list(PRESETS)), default="default", show_default=True,
              help="Named settings; the flags below override single fields.")
@click.option("--activation", type=click.Choice(ACTIVATIONS), default=None,
              help="relu: ReLU(gate)*up (transformers loads it as is); drelu: ReLU(gate)*ReLU(up); "
                   "fatrelu: gate zeroed at or below --fat-threshold.")
@click.option("--fat-threshold", type=float, default=None, help="fatrelu's threshold (e.g. 0.01).")
@click.option("--tokens", callback=_tokens, default=None, help="Training budget in tokens, e.g. 8M.")
@click.option("--l1", type=click.FloatRange(0), default=None,
              help="Final weight of the sparsity penalty (--penalty), reached in stages over the first half.")
@click.option("--penalty", type=click.Choice(PENALTIES), default=None,
              help="h: mean |h| entering the down projection (ProSparse's L1); gate-cos: mean ReLU(cos(FFN input, "
                   "gate row)), which no rescaling of the weights can lower.  [default: h]")
@click.option("--l1-until", type=click.FloatRange(0, 1), default=None,
              help="Share of training after which the penalty stops (KL alone for the rest).  [default: 1]")
@click.option("--lm", type=click.FloatRange(0), default=None, help="Weight of the plain next-token loss.")
@click.option("--kl", type=click.FloatRange(0), default=None, help="Weight of the KL to the original model.")
@click.option("--teacher-text", type=click.FloatRange(0, 1, max_open=True), default=None,
              help="Share of the training rows sampled from the original model.")
@click.option("--dataset", default=None, help=f"Training corpus: {known_datasets()}.")
@click.option("--lr", type=click.FloatRange(0, min_open=True), default=None, help="Peak learning rate.")
@click.option("--batch-size", type=click.IntRange(1), default=None, help="Sequences per step.")
@click.option("--seq-len", type=click.IntRange(9), default=None, help="Tokens per sequence.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run from its last checkpoint.")
@click.option("--force", is_flag=True, help="Replace --out, or discard an interrupted run.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:N.")
@click.option("--seed", type=int, default=None, help="Seed of the data order and teacher sampling.")
@click.option("--json", "as_json", is_flag=True, help="Print summary.json instead of the summary lines.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
def main(model, gguf_file, out, preset_name, activation, fat_threshold, tokens, l1, penalty, l1_until, lm, kl,
         teacher_text, dataset, lr, batch_size, seq_len, resume, force, device, seed, as_json, quiet) -> None:
    """Make a SwiGLU model ReLU-sparse: swap the FFN activation and distil from the original model.

    Writes OUT/: an HF model folder (config.json names the new activation), meta.json and summary.json
    (perplexity before and after, per-layer sparsity on held-out text, the training curve). Every pi-* stage
    loads OUT as --model.
    """
    overrides = {"activation": activation, "fat_threshold": fat_threshold, "tokens": tokens, "l1": l1,
                 "penalty": penalty, "l1_until": l1_until, "lm": lm, "kl": kl, "teacher_text": teacher_text,
                 "dataset": dataset, "lr": lr, "batch_size": batch_size, "seq_len": seq_len, "seed": seed}
    if quiet:  # transformers' own bars too (loading and writing the weights)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    from hotneurons.relufy.distill import relufy  # torch: after the arguments are read; it checks --out first

    try:
        cfg = replace(preset(preset_name), **{k: v for k, v in overrides.items() if v is not None})
        s = relufy(model, out, cfg, gguf_file=gguf_file, device=device, resume=resume, force=force,
                   progress=not quiet)
    except RelufyInterrupted as e:
        interrupted(_flags(str(e)))
    except (RelufyError, CorpusError, ArtifactError, ValueError) as e:
        raise click.ClickException(_flags(str(e))) from None
    except KeyboardInterrupt:
        from hotneurons.relufy.distill import partial_dir

        kept = (partial_dir(Path(out)) / "checkpoint" / "state.json").exists()
        interrupted(f"the last checkpoint is kept in {partial_dir(Path(out))}: continue with --resume (same flags), "
                    f"or start over with --force" if kept else f"stopped before the teacher text was built; {out} is "
                    f"as it was: run the same command again")
    if as_json:
        click.echo(json.dumps(s, indent=2))
        return
    ev = s["eval"]
    o, r = ev["original"], ev["relufied"]
    click.echo(f"relufied {s['model']} with {s['activation']}: {s['tokens']:,} tokens in {s['train_seconds']:.0f} s "
               f"({s['tokens_per_s'] or 0:,.0f} tok/s)")
    click.echo(f"perplexity on {ev['dataset']}: {o['perplexity']:.2f} -> {r['perplexity']:.2f} "
               f"({ev['perplexity_ratio']:.3f}x); FFN activations exactly zero: {o['ffn_sparsity']:.1%} -> "
               f"{r['ffn_sparsity']:.1%}")
    click.echo(f"wrote {out}/ (HF folder, meta.json, summary.json)")


def _flags(msg: str) -> str:
    """Library words -> this command's flags."""
    return (msg.replace("pass force", "pass --force").replace("or force", "or --force")
            .replace("resume it", "pass --resume").replace("with resume", "with --resume")
            .replace("without resume", "without --resume"))

