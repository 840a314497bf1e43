"""`pi-profile`: a thin click command over `profile_model`."""

from __future__ import annotations

import json
from pathlib import Path

import click
from hotneurons.artifacts.profile import ProfileMeta
from hotneurons.common.artifacts import ArtifactError, StageInterrupted, default_run_dir
from hotneurons.common.cli import StageCommand, cli_error, interrupted, parse_sparsities, stdout_to_stderr
from hotneurons.common.corpus import CorpusError, known_datasets
from hotneurons.common.gating import SPARSITIES
from hotneurons.common.kinds import Activation, FixableError

# library parameters that are not spelled as their flag (a resumed run's settings name ProfileConfig fields)
FLAGS = {"fingerprint": "--model", "world_size": "torchrun --nproc-per-node"}

MIN_USEFUL_TOKENS = 1000  # tokens: below this a neuron firing 1% of the time is counted ~10 times or fewer


def run_folder(params: dict) -> Path | None:
    """The run folder pi-profile writes into: --out, else runs/<model-slug>; None where the model does not resolve
    (profile_model refuses it in one line)."""
    from hotneurons.common.model_source import resolve_source

    if params.get("out") is not None:
        return Path(params["out"])
    try:
        return default_run_dir(resolve_source(params["model"], params["gguf_file"], params["revision"]).name)
    except ValueError:
        return None


@click.command(cls=StageCommand, run_folder=run_folder,
               context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("--model", default=None, help="HF hub id, local folder, or .gguf file. Default: the embedded "
              "SmolLM2-135M-Instruct (needs the [demo] extra).")
@click.option("--gguf-file", default=None, help="GGUF file name inside the --model folder.")
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit).")
@click.option("--dataset", default="wikipedia-sample", show_default=True, help=f"Corpus: {known_datasets()}.")
@click.option("--text-column", default="text", show_default=True, help="Text column of .jsonl/.parquet/hub data.")
@click.option("--tokens", default=100_000, show_default=True, type=click.IntRange(1), help="Token budget.")
@click.option("--seq-len", default=512, show_default=True, type=click.IntRange(2), help="Tokens per sequence.")
@click.option("--batch-size", default=8, show_default=True, type=click.IntRange(1), help="Sequences per forward.")
@click.option("--target-sparsity", default=0.5, show_default=True, type=click.FloatRange(0, 1, max_open=True),
              help="Non-ReLU models: share of neurons inactive per token; sets each layer's |act| threshold tau.")
@click.option("--criterion", default="h", show_default=True, type=click.Choice(["h", "gate", "gate-h"]),
              help="SwiGLU/GeGLU models: what neurons.parquet counts at --target-sparsity: h (|act(gate)*up| > "
              "tau_h), gate (|act(gate)| > tau_g, CATS) or gate-h (both). Every criterion's thresholds and pass "
              "counts are tabulated anyway (meta.json gated, passes.safetensors).")
@click.option("--sparsities", default=",".join(f"{s:g}" for s in SPARSITIES), show_default=True,
              help="SwiGLU/GeGLU models: comma list of the sparsities every criterion is tabulated at (the target "
              "is added).")
@click.option("--calibration-tokens", default=8192, show_default=True, type=click.IntRange(1),
              help="First tokens of the corpus used to calibrate tau (non-ReLU models).")
@click.option("--samples-per-layer", default=16384, show_default=True, type=click.IntRange(0),
              help="Predictor training samples (FFN input + mask) kept per layer, reservoir-sampled; 0 = none.")
@click.option("--activation", type=click.Choice(Activation.values()), default=None,
              help="Override the activation read from the config (e.g. drelu for Bamboo/TurboSparse).")
@click.option("--out", default=None, help="Run directory. Default: runs/<model-slug>.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run in --out from its last checkpoint.")
@click.option("--force", is_flag=True, help="Replace the run's profile, or discard an interrupted run.")
@click.option("--checkpoint-every", default=50, show_default=True, type=click.IntRange(1),
              help="Batches between checkpoints.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:N.")
@click.option("--dtype", default="auto", show_default=True,
              help="auto (f32 on CPU, f16 on CUDA), f32, f16, bf16 (aliases fp16, float16, ... accepted).")
@click.option("--layer-by-layer/--whole-model", default=None,
              help="How the model runs: layer by layer from its file (one layer's weights on the device at a time: "
              "models bigger than it) or whole through transformers. Default: layer by layer for a local "
              "safetensors folder or .gguf file, whole for hub ids.")
@click.option("--seed", default=0, show_default=True, help="Seed of the sample reservoir.")
@click.option("--trust-remote-code", is_flag=True, help="Allow the model repo's own Python code (off by default).")
@click.option("--json", "as_json", is_flag=True, help="Print meta.json instead of the summary.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def main(model, gguf_file, revision, dataset, text_column, tokens, seq_len, batch_size, target_sparsity,
         criterion, sparsities, calibration_tokens, samples_per_layer, activation, out, resume, force,
         checkpoint_every, device, dtype, layer_by_layer, seed, trust_remote_code, as_json, quiet) -> None:
    """Count which FFN neurons fire on a corpus; store predictor training samples.

    Writes RUN/profile/: neurons.parquet (layer, neuron, count), meta.json, samples/. A mixture of experts (layer by
    layer only): experts.parquet (layer, expert, count, weight_sum), neurons.parquet with an expert column, no samples.
    Under torchrun (`torchrun --nproc-per-node N -m hotneurons.profiler ...`) ranks share the corpus and
    the counts are all-reduced.
    """
    sparsities = parse_sparsities(sparsities, "--sparsities")  # refused before torch and the model load
    from hotneurons.profiler.profile import ProfileConfig, profile_model  # torch: after the arguments are read

    cfg = ProfileConfig(model=model, gguf_file=gguf_file, revision=revision, dataset=dataset,
                        text_column=text_column, tokens=tokens, seq_len=seq_len, batch_size=batch_size,
                        target_sparsity=target_sparsity, calibration_tokens=calibration_tokens,
                        samples_per_layer=samples_per_layer, seed=seed, dtype=dtype, activation=activation,
                        trust_remote_code=trust_remote_code, criterion=criterion, sparsities=sparsities)
    try:
        if not (resume or force):
            refuse_existing(run_folder({"out": out, "model": model, "gguf_file": gguf_file, "revision": revision}))
        with stdout_to_stderr(as_json):
            meta = profile_model(cfg, out, resume=resume, force=force, device=device,
                                 checkpoint_every=checkpoint_every, progress=not quiet,
                                 layer_by_layer=layer_by_layer)
    except (ArtifactError, CorpusError, FixableError, ValueError) as e:
        raise cli_error(e, FLAGS) from None
    except KeyboardInterrupt as e:
        interrupted(interrupt_message(e))
    if meta is None:  # a non-zero rank under torchrun
        return
    if meta.tokens < MIN_USEFUL_TOKENS:
        click.echo(f"warning: only {meta.tokens:,} tokens profiled: activation counts (and predictors trained on "
                   f"their samples) are mostly noise below {MIN_USEFUL_TOKENS:,}; profile 10,000 or more (--tokens)",
                   err=True)
    try:
        click.echo(json.dumps(meta.to_dict(), indent=2) if as_json else format_summary(meta))
    except KeyboardInterrupt:
        interrupted("the profile was complete and is written")


def refuse_existing(run: Path | None) -> None:
    """A profile already in the run folder is replaced only with --force (the predictors and placement made from it
    would no longer match it): refused in one line, before the model loads."""
    if run is not None and (run / "profile" / "meta.json").exists():
        raise click.ClickException(f"{run / 'profile'} already holds a profile: pass --force to replace it, or "
                                   f"write to another run folder (--out)")


def interrupt_message(e: KeyboardInterrupt) -> str:
    """What an interrupt left behind, and the command that goes on from there."""
    if isinstance(e, StageInterrupted) and e.done is not None:
        return f"the profile was complete and is written in {e.done}"
    if isinstance(e, StageInterrupted) and e.kept is not None:
        return (f"the last checkpoint is kept in {e.kept}: continue with --resume (same flags), or start over with "
                f"--force")
    return "stopped before the first checkpoint, nothing was kept: run the same command again"


def format_summary(meta: ProfileMeta) -> str:
    """One screen: tokens, then per layer mean sparsity and the share of neurons covering 80% of activations."""
    m = meta.model
    lines = [f"profiled {m['name']} ({m['family']}, {m['activation']}, {m['n_layers']} layers x {m['n_neurons']} "
             f"neurons) on {meta.dataset}",
             f"tokens: {meta.tokens:,} in {meta.seconds:.1f} s ({meta.tokens_per_second:,} tok/s)   "
             f"rule: {meta.rule}" + (f" (target sparsity {meta.target_sparsity})" if meta.taus else "")]
    if meta.experts is not None:  # docs/profiler.md, "Mixtures of experts"
        e = meta.experts
        lines.append(f"experts: {e.n_experts} per layer, {e.n_experts_used} per token, {e.n_ff_exp} neurons each"
                     + (f", a shared expert of {e.n_ff_shexp}" if e.n_ff_shexp else "")
                     + "; sparsity over routed (token, expert) pairs, no samples (the router picks the experts)")
    if meta.corpus_exhausted:
        lines.append(f"note: the corpus held fewer tokens than --tokens {meta.tokens_requested:,}; used them all")
    lines.append(f"mean FFN sparsity {meta.mean_sparsity:.3f}; samples per layer: {meta.sample_count:,}")
    lines.append("layer  sparsity  neurons-for-80%")
    cells = [f"{i:5d}  {s:8.3f}  {c:15.3f}" for i, (s, c) in
             enumerate(zip(meta.sparsity_per_layer, meta.share_covering_80pct_per_layer))]
    per_col = -(-len(cells) // 3) if len(cells) > 24 else len(cells)
    cols = [cells[i:i + per_col] for i in range(0, len(cells), per_col)]
    for r in range(per_col):
        lines.append("   ".join(col[r] for col in cols if r < len(col)))
    if meta.gated:  # SwiGLU / GeGLU: every criterion's pass share and skew (docs/gated.md)
        from hotneurons.profiler.gated import skew_lines

        lines += skew_lines(meta.gated)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
