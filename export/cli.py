"""`pi-export`: a run's model, predictors, profile and placement as another runtime's files (thin click command over
`export_run`)."""

from __future__ import annotations

import json
import sys

import click
from hotneurons.common.artifacts import ArtifactError
from hotneurons.common.cli import cli_error, interrupted, stdout_to_stderr
from hotneurons.common.units import format_bytes, parse_bytes
from hotneurons.weights.formats import ALIASES, TORCH_FLOATS

from . import FORMATS
from . import QUANT_TYPES as TYPES

# the float formats of weights/formats.py's table, by name and by its aliases (float32, fp16, ...)
_DTYPES = [str(f) for f in TORCH_FLOATS] + [a for a, f in ALIASES.items() if f in TORCH_FLOATS]
FLAGS = {"fmt": "--format", "vram_capacity": "--vram-capacity", "out": "--out"}


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("--run", "run_dir", default=None, type=click.Path(file_okay=False),
              help="Run directory holding profile/, predictors/ and (optionally) placement/ (--format powerinfer).")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="powerinfer", show_default=True,
              help="powerinfer: the PWRI GGUF, activation/ files and .gpuidx that PowerInfer's C++ runtime loads; "
                   "gguf: a copy of the --model GGUF file with its weight matrices re-quantized to --type.")
@click.option("--out", required=True, type=click.Path(),
              help="Output folder (powerinfer; created, --force replaces it) or .gguf file (gguf).")
@click.option("--type", "qtype", default=None,
              help=f"--format gguf: the type the matrices are written in: {', '.join(TYPES)} (the embeddings and "
                   f"head of a 4-bit type at q8_0; norms, biases and routers as stored).")
@click.option("--recall", type=float, default=None,
              help="Use the predictor thresholds tabulated for this recall (default: the trained target's).")
@click.option("--threshold", type=float, default=None,
              help="One threshold for every layer in place of the run's per-layer ones (PowerInfer applies one; "
                   "export.json keeps those replaced). Normed-form predictors convert exactly at 0 only.")
@click.option("--vram-capacity", default=None,
              help="split.vram_capacity of the .gpuidx, e.g. 6GiB [the GPU neurons' own F16 bytes].")
@click.option("--model", default=None,
              help="powerinfer: load this model (same fingerprint) instead of the one the run names; gguf: the "
                   ".gguf file to copy.")
@click.option("--dtype", type=click.Choice(_DTYPES, case_sensitive=False), default="f32", show_default=True,
              help="Dtype the model loads in before the F16 write: f32, bf16 or f16 (their aliases fp32, float32, "
                   "bfloat16, fp16, float16 accepted; f32 keeps the folded norm weights exact).")
@click.option("--force", is_flag=True, help="Replace an existing output folder or file.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON (stdout holds only the JSON).")
def main(run_dir, fmt, out, qtype, recall, threshold, vram_capacity, model, dtype, force, as_json):
    """Export a run for PowerInfer's C++ runtime, or a model file re-quantized.

    powerinfer writes OUT/<model>.powerinfer.gguf (GGUF v3 with magic PWRI: the model in F16, ffn_down transposed,
    the predictors as blk.N.fc1/fc2, powerinfer.sparse_threshold), OUT/activation/activation_N.pt (the profile's
    counts) and OUT/<model>.powerinfer.gguf.generated.gpuidx (the placement), plus OUT/export.json.
    gguf writes OUT, the --model file with its matrices in --type, tensor by tensor.

    Examples: pi-export --run runs/relu-llama --format powerinfer --out exported/relu-llama;
    pi-export --format gguf --type q4_0 --model model.gguf --out model-q4_0.gguf
    """
    if fmt == "gguf":
        return _requantize(model, out, qtype, force, as_json,
                           {"--run": run_dir, "--recall": recall, "--threshold": threshold,
                            "--vram-capacity": vram_capacity})
    from .gguf_model import ExportError  # torch: after the arguments are read

    if run_dir is None or qtype is not None:
        raise cli_error(ExportError("--format powerinfer exports a run: give --run RUN" if run_dir is None else
                                    "--type re-quantizes a model file: use it with --format gguf"), FLAGS)
    cap = None
    if vram_capacity is not None:
        try:
            cap = parse_bytes(vram_capacity)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--vram-capacity") from None
    from .run import export_run  # torch: after the arguments are read

    try:
        with stdout_to_stderr(as_json):
            s = export_run(run_dir, out, fmt=fmt, recall=recall, vram_capacity=cap, model=model, dtype=dtype,
                           threshold=threshold, force=force, progress=sys.stderr.isatty())
    except (ExportError, ArtifactError, ValueError) as e:
        raise cli_error(e, FLAGS) from None
    except KeyboardInterrupt:
        interrupted(f"nothing was written ({out} is as it was)")
    if as_json:
        click.echo(json.dumps(s, indent=2))
    else:
        click.echo(human_summary(s, out))


def _requantize(model, out, qtype, force, as_json, unused: dict) -> None:
    """pi-export --format gguf: the arguments checked, then export/requantize.py."""
    from .gguf_model import ExportError
    from .requantize import check_type, human_summary, requantize

    try:
        given = [k for k, v in unused.items() if v is not None]
        if given:
            raise ExportError(f"{given[0]} is not read by --format gguf, which copies --model: leave it out")
        if model is None or qtype is None:
            raise ExportError(f"--format gguf needs --model FILE.gguf and --type ({', '.join(TYPES)})")
        check_type(qtype)
        with stdout_to_stderr(as_json):
            s = requantize(model, out, qtype, force=force, progress=sys.stderr.isatty())
    except ValueError as e:
        raise cli_error(e, FLAGS) from None
    except KeyboardInterrupt:
        interrupted(f"nothing was written ({out} is as it was)")
    click.echo(json.dumps(s, indent=2) if as_json else human_summary(s))


def human_summary(s: dict, out: str) -> str:
    gguf = f"{out}/{s['files']['model']}"
    gpu = s["gpu_neurons_per_layer"]
    lines = [
        f"model      {s['source']['model']} -> arch {s['arch']} ({s['activation']}), {s['n_layers']} layers, "
        f"{s['n_neurons']} FFN neurons each, vocabulary {s['vocab']['model']} ({s['vocab']['tokens']} tokens)",
        f"predictors {s['source']['predictor_form']} form"
        + (" (norm weights folded into fc1)" if s["source"]["folded_norm_into_fc1"] else "")
        + f", hidden {min(s['predictor_hidden'])}..{max(s['predictor_hidden'])}, sparse_threshold "
        f"{s['sparse_threshold']:g}",
        "placement  " + ("none: PowerInfer solves its own split (python3 -m powerinfer) on a CUDA build"
                          if gpu is None else f"{sum(gpu)} of {s['n_layers'] * s['n_neurons']} neurons on the GPU, "
                          f"split.vram_capacity {format_bytes(s['vram_capacity'])}"),
        f"wrote      {gguf} ({format_bytes(s['file_bytes'])}), {out}/activation/, "
        + (f"{gguf}.generated.gpuidx, " if gpu is not None else "") + f"{out}/export.json",
        f"run        main -m {gguf} -p \"...\" -n 64 -t 8" + (" --vram-budget <GiB>" if gpu is not None else ""),
    ]
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
