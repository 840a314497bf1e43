"""`pi-generate`: thin click command over `load_runtime` + `generate`."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Mapping
from typing import Any

import click
from hotneurons.common.cli import StageCommand, check_port, interrupted, stdout_to_stderr
from hotneurons.common.kinds import GpuOps, PredictorDtype, RuntimeMode
from hotneurons.common.schema import ArtifactError
from hotneurons.kernels.names import COLD_DTYPES
from hotneurons.runtime.config import RuntimeConfig, RuntimeRequest
from hotneurons.weights.formats import FORMATS, GPU_DTYPES, weight_format

# torch, numba and transformers load after the flags are parsed (--help answers at once): the engine's modules are
# imported where they are used, as modules, so that tests and benchmarks can wrap their functions


def _bytes(text: str | None) -> int | None:
    if text is None:
        return None
    from hotneurons.common.units import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--vram")


SHARE_WARN = 0.8  # decode's GPU share of activations below this fraction of the profile's: say so
SHARE_WARN_STEPS = 16  # ... once this many tokens were decoded (fewer say little)


def format_stats(s: dict) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    hot = s.get("gpu_dtype", s["dtype"])
    mode = f"{s['mode']}, gate mask" if s.get("mask") == "gate" else s["mode"]
    text = (f"[{mode} on {s['device']} ({s['dtype']}" + (f", hot rows {hot}" if hot != s["dtype"] else "")
            + f", cold rows {s['cold_dtype']}), {s['threads']} CPU "
            f"threads] prefill "
            f"{fmt(s['prefill_tokens_per_s'])} tok/s, decode {fmt(s['decode_tokens_per_s'])} tok/s"
            + (f" (a first step of {s['decode_warmup_s']:.2f} s left out)" if s.get("decode_warmup_steps") else "")
            + ", "
            f"FFN sparsity {s['ffn_sparsity']:.3f}, {gpu_share(s)}, "
            f"{device_bytes(s)}, {s['bytes_cpu'] / 1e6:.1f} MB cold in CPU RAM"
            + (f"; {host_text(s['host_memory'])}" if s.get("host_memory") else ""))
    warning = share_warning(s)
    return text if warning is None else f"{text}\nwarning: {warning}"


def host_memory(start, end) -> dict | None:
    """The process's host memory (common/memory.ProcessMemory before the model loaded and after generating) as
    stats: its peak RSS, and the fixed part of it: what the interpreter and libraries held before the model."""
    if start is None or end is None:
        return None
    return {"peak_rss_bytes": end.peak, "rss_bytes": end.rss, "anon_bytes": end.anon, "file_bytes": end.file,
            "before_model_bytes": start.rss, "since_bytes": end.peak - start.rss}


def host_text(m: dict) -> str:
    return (f"host RSS peak {m['peak_rss_bytes'] / 1e6:.0f} MB: {m['before_model_bytes'] / 1e6:.0f} MB before the "
            f"model (interpreter and libraries), {m['since_bytes'] / 1e6:.0f} MB since (the model as held, its "
            f"config and tokenizer, buffers, compiled kernels)")


def gpu_share(s: dict) -> str:
    """Decode's GPU share beside pi-solve's expectation: of the activations (dense FFNs), or of the routed expert
    work (a mixture of experts: the (token, expert) pairs whose expert is on the device)."""
    x, profile = s.get("experts"), s.get("profile_gpu_activation_share")
    if x is not None:
        got, plan = x["gpu_share_routed"], x["plan_gpu_share_routed"]
        return (f"GPU share of routed expert work {'-' if got is None else f'{got:.3f}'}"
                + (f" (the placement's: {plan:.3f})" if plan is not None else "")
                + f", {x['gpu_experts']}/{x['experts']} experts on the device")
    return (f"GPU share of activations {s['gpu_activation_share']:.3f}"
            + (f" (the profile's: {profile:.3f})" if profile is not None and s["mode"] == "hybrid" else ""))


def _float_bytes(name: str | None) -> int | None:
    """Bytes a weight of a float format under any of its names (f16, fp16, float16: weights/formats.py's aliases);
    None for a block format or no name."""
    try:
        s = FORMATS.get(weight_format(name)) if name else None
    except ValueError:
        return None
    return s.block_bytes if s is not None and s.block == 1 else None


def device_bytes(s: dict) -> str:
    """The device's bytes, where and in which dtype, beside pi-solve's plan when the run has one: on the CPU the
    "device" part runs in float32 (fast there), twice the bytes of the fp16 the plan counts for a GPU."""
    device = "CPU" if s["device"] == "cpu" else s["device"]
    text = f"{s['bytes_gpu'] / 1e6:.1f} MB on the {device} device in {s['dtype']}"
    plan, plan_dtype = s.get("plan_bytes_gpu"), s.get("plan_dtype")
    if plan is None or s["mode"] == "layer-split":
        return text
    text += f" (the plan counts {plan / 1e6:.1f} MB" + (f" in {plan_dtype}" if plan_dtype else "")
    have, planned = _float_bytes(s["dtype"]), _float_bytes(plan_dtype)
    if have and planned and have != planned:
        text += f": {planned} bytes a weight, not {have}"
    return text + ")"


def share_warning(s: dict) -> str | None:
    """A hint when decode's activations fell on the GPU's neurons much less often than the profile's did: the
    profile's corpus then fires other neurons than this text, and the placement keeps the wrong ones on the GPU."""
    profile = s.get("profile_gpu_activation_share")
    if s["mode"] != "hybrid" or not profile or s.get("decode_steps", 0) < SHARE_WARN_STEPS:
        return None
    if s["gpu_activation_share"] >= SHARE_WARN * profile:
        return None
    if s.get("experts") is not None:
        return (f"decode routed {s['gpu_activation_share']:.0%} of the tokens' experts to the GPU's, the placement "
                f"expected {profile:.0%}: this text picks other experts than the profiled corpus. Profile text like "
                f"it (pi-profile --dataset) and run pi-solve again")
    return (f"decode put {s['gpu_activation_share']:.0%} of the FFN activations on the GPU's neurons, the profile "
            f"{profile:.0%}: this text fires other neurons than the profiled corpus. Profile text like it "
            f"(pi-profile --dataset) and run pi-solve again to put more of them on the GPU")


def runtime_options(f):
    """The flags that pick the model and lay it out, shared by pi-generate and pi-serve: the command receives them
    as one `runtime` argument, a RuntimeRequest (`runtime_request`; `open_runtime` loads it).

    A command that also takes `host` and `port` (pi-serve) has the address checked first (common/cli.check_port):
    a port in use is refused in one line before the model loads, not after."""
    options = [
        click.option("--run", "run_dir", type=click.Path(file_okay=False), help="Run directory (profile/, placement/, "
                     "predictors/). The model is the one the run was made for unless --model is given."),
        click.option("--mode", type=click.Choice(RuntimeMode.values()), default="hybrid", show_default=True,
                     help="hybrid: hot neurons on the device, active cold ones on the CPU; dense: same layout, no "
                          "sparsity; layer-split: whole layers on the device up to --vram, the rest on the CPU."),
        click.option("--oracle", is_flag=True, help="Hybrid masks from the true activations (checks, not speed)."),
        click.option("--no-predictor", is_flag=True, help="Run without predictors: dense (a mixture of sparse experts: "
                     "every gate row of its cold experts read, its expert predictors unused)."),
        click.option("--recall", type=float, default=None, help="Predictor threshold tabulated for this recall."),
        click.option("--sparsity", type=click.FloatRange(0, 1, max_open=True), default=None,
                     help="Gated models (SwiGLU, GeGLU): skip this share of FFN neurons by their own gates at the "
                          "profile's thresholds, no predictor (docs/gated.md) [off; 0: dense]."),
        click.option("--criterion", type=click.Choice(("gate", "h", "gate-h")), default=None,
                     help="With --sparsity: gate (|act(gate)|, CATS), h (|act(gate)*up|) or gate-h (both) [the "
                          "profile's --criterion]."),
        click.option("--model", default=None, help="Model (hub id, folder or .gguf) instead of the run's."),
        click.option("--gguf-file", default=None, help="GGUF file inside --model's folder."),
        click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:1 ..."),
        click.option("--dtype", default="auto", show_default=True, help="Device compute dtype: auto (f16 on CUDA, "
                     "f32 on CPU), f32, f16, bf16 (aliases fp16, float16, ... accepted)."),
        click.option("--cold-dtype", type=click.Choice(("auto",) + COLD_DTYPES), default="auto", show_default=True,
                     help="Storage of the cold rows in CPU RAM. auto: the file's format where the CPU kernels read it "
                          "(a GGUF's Q4_0/Q4_1/Q8_0 and Q4_K/Q5_K/Q6_K rows as stored; beside K-quant rows the down "
                          "projection's re-blocked in q8_0 or q4_1), else its nearest one (Q5_0, IQ4_XS...: q8_0; "
                          "Q2_K, Q3_K, IQ1-IQ3...: q4_0; docs/memory.md), bf16 for float files. K-quants are kept, "
                          "never made. Fewer bits: fewer bytes read per token, a small rounding error."),
        click.option("--gpu-dtype", type=click.Choice(("auto",) + GPU_DTYPES), default="auto", show_default=True,
                     help="Storage of the hot rows on the device. auto: the file's format where the GPU kernels "
                          "read it (Q4_0/Q4_1/Q8_0, Q4_K/Q5_K/Q6_K), else its nearest one (as --cold-dtype's), the "
                          "compute dtype for float files. A GGUF's other matrices in a type no kernel reads are "
                          "converted likewise."),
        click.option("--predictor-dtype", type=click.Choice(PredictorDtype.values()), default="auto", show_default=True,
                     help="The predictors on the device: q8_0 (made at load: about half the bytes a token reads, the "
                          "same recall and precision on the measured run: docs/predictors.md) or auto (the run's "
                          "pi-solve --predictor-dtype, else as trained)."),
        click.option("--threads", "-t", type=click.IntRange(1), default=None,
                     help="CPU threads for the cold neurons [all cores]."),
        click.option("--pcie-share", type=float, default=None, help="CUDA: share of each token's active cold neurons "
                     "the GPU computes itself, reading their rows over PCIe from page-locked host RAM while the CPU "
                     "reads the rest [measured at start; 0: off]."),
        click.option("--vram", default=None, help="Device budget, e.g. 8GB: refuse a layout above it; layer-split "
                     "fills it with whole layers."),
        click.option("--gpu-layers", type=click.IntRange(0), default=None,
                     help="layer-split: layers on the device (like -ngl)."),
        click.option("--ctx", type=int, default=None, help="Tokens the static KV cache holds on the device, counted "
                     "by --vram; longer generations decode through HF [the run's pi-solve --ctx, else 4096]."),
        click.option("--no-cuda-graphs", is_flag=True, help="CUDA: launch the per-token GPU work eagerly (slower; "
                     "for checks and profiling)."),
        click.option("--ops", type=click.Choice(("auto",) + GpuOps.values()), default="auto", show_default=True,
                     help="CUDA graphs: what computes a decode step's GPU ops (norms, RoPE, attention, the "
                          "predictor, one token's GEMVs). triton: fused kernels (kernels/fused.py); torch: torch's "
                          "kernels; compile: torch.compile on the small ops (a few seconds at start); auto: triton "
                          "where it imports, else torch."),
        click.option("--step-prefill", type=click.IntRange(0), default=None,
                     help="Prompts of at most this many tokens go through the decode step a token at a time "
                          "instead of one prefill pass [16 for a mixture of experts on CUDA graphs, else 0: off]."),
        click.option("--hf-decode", is_flag=True, help="Decode through the HF decoder layers instead of the static "
                     "decoder (LLaMA family; slower; for checks)."),
        click.option("--trust-remote-code", is_flag=True),
    ]
    probe = functools.reduce(lambda fn, option: option(fn), options, lambda: None)
    names = {p.name for p in probe.__click_params__}  # the flags' parameter names, which the request takes

    @functools.wraps(f)
    def checked(*args, **kw):
        if isinstance(kw.get("port"), int) and "host" in kw:
            check_port(kw["host"], kw["port"])
        runtime = runtime_request(kw)
        return f(*args, runtime=runtime, **{k: v for k, v in kw.items() if k not in names})
    for option in reversed(options):
        checked = option(checked)
    return checked


def runtime_request(flags: Mapping[str, Any]) -> RuntimeRequest:
    """The RuntimeRequest that `runtime_options`' flags describe: `flags` holds click's values by parameter name
    (a command's other parameters are left alone)."""
    f = flags
    if f["run_dir"] is None and f["model"] is None:
        raise click.UsageError("pass --run RUN (from pi-profile/pi-solve/pi-train-predictors) or --model")
    cfg = RuntimeConfig(mode=f["mode"], oracle=f["oracle"], device=f["device"], dtype=f["dtype"],
                        cold_dtype=f["cold_dtype"], gpu_dtype=f["gpu_dtype"], threads=f["threads"],
                        predictor_dtype=f["predictor_dtype"],
                        vram=_bytes(f["vram"]), gpu_layers=f["gpu_layers"], cuda_graphs=not f["no_cuda_graphs"],
                        static_decode=not f["hf_decode"], pcie_share=f["pcie_share"], ctx=f["ctx"], ops=f["ops"],
                        sparsity=f["sparsity"], criterion=f["criterion"], expert_predictors=not f["no_predictor"],
                        step_prefill=f["step_prefill"])
    return RuntimeRequest(cfg, run_dir=f["run_dir"], model=f["model"], gguf_file=f["gguf_file"],
                          use_predictor=not f["no_predictor"], recall=f["recall"],
                          trust_remote_code=f["trust_remote_code"])


def open_runtime(req: RuntimeRequest):
    """Load and lay out the model `req` names (a runtime.generate.Runtime); errors become one-line click errors."""
    from hotneurons.runtime.load import load_runtime

    try:
        return load_runtime(req.run_dir, req.cfg, model=req.model, gguf_file=req.gguf_file,
                            use_predictor=req.use_predictor, trust_remote_code=req.trust_remote_code,
                            recall=req.recall)
    except (ArtifactError, ValueError) as e:
        raise click.ClickException(str(e))


@click.command(cls=StageCommand, context_settings={"help_option_names": ["-h", "--help"]})
@runtime_options
@click.option("--prompt", "-p", default=None, help="Prompt text (default: read from stdin unless -i).")
@click.option("-n", "--max-new-tokens", type=click.IntRange(1), default=128, show_default=True,
              help="Tokens to generate (at least 1).")
@click.option("--temperature", type=click.FloatRange(0), default=0.0, show_default=True, help="0: greedy.")
@click.option("--top-k", type=click.IntRange(0), default=0, show_default=True, help="0: off.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True, help="1: off.")
@click.option("--repetition-penalty", type=click.FloatRange(0, min_open=True), default=1.0, show_default=True,
              help="1: off.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--chat", is_flag=True, help="Apply the model's chat template to the prompt.")
@click.option("-i", "--interactive", is_flag=True, help="Interactive chat (empty line or Ctrl-D ends).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object {text, token_ids, stats}.")
def main(prompt, max_new_tokens, temperature, top_k, top_p, repetition_penalty, seed, chat, interactive, as_json,
         runtime):
    """Generate text with the hybrid GPU-CPU runtime.

    Example: pi-generate --run runs/SmolLM2-135M-Instruct --prompt "The capital of France is" -n 64
    """
    from hotneurons.common.memory import process_memory
    from hotneurons.runtime import generate as gen
    from hotneurons.runtime.sampling import Sampling

    start = process_memory()  # the interpreter and the libraries the runtime imports (torch, Numba, Triton)
    sampling = Sampling(temperature, top_k, top_p, repetition_penalty, seed)
    try:
        with stdout_to_stderr(as_json):
            rt = open_runtime(runtime)
            if interactive:
                return _chat_loop(rt, max_new_tokens, sampling)
            if prompt is None:
                prompt = sys.stdin.read()
            ids = gen.prompt_ids(rt, prompt, chat)
            check_room(rt, len(ids), max_new_tokens)
            stream = None if as_json else (lambda t: (sys.stdout.write(t), sys.stdout.flush()))
            g = gen.generate(rt, ids, max_new_tokens, sampling, on_text=stream)
    except (ArtifactError, ValueError) as e:
        raise click.ClickException(str(e))
    except KeyboardInterrupt:
        interrupted("stopped (pi-generate writes no files)")
    g.stats["host_memory"] = host_memory(start, process_memory())
    if as_json:
        click.echo(json.dumps({"text": g.text, "token_ids": g.token_ids, "stats": g.stats}))
    else:
        click.echo("")
        click.echo(format_stats(g.stats), err=True)


def check_room(rt, prompt_tokens: int, max_new_tokens: int) -> None:
    """-n past the context is refused in one line, as pi-serve refuses such a max_tokens (generate would stop at the
    context's end without a word). A prompt that fills the context alone is generate's to refuse."""
    ctx = rt.lm.ctx
    room = ctx - prompt_tokens
    if 0 < room < max_new_tokens:
        # a static KV cache (our decoder's) holds --ctx tokens; transformers' context is the model's own
        longer = f", or --ctx {prompt_tokens + max_new_tokens}" if rt.lm.static_ctx is not None else ""
        raise ValueError(f"the prompt's {prompt_tokens:,} tokens and -n {max_new_tokens:,} make "
                         f"{prompt_tokens + max_new_tokens:,}, past the model's context of {ctx:,} tokens: pass -n "
                         f"{room} or less{longer}")


def _chat_loop(rt, max_new_tokens: int, sampling) -> None:
    from hotneurons.runtime import generate as gen

    messages: list[dict] = []
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        g = gen.generate(rt, gen.prompt_ids(rt, messages, chat=True), max_new_tokens, sampling,
                         on_text=lambda t: (sys.stdout.write(t), sys.stdout.flush()), reuse=True)  # the history
        messages.append({"role": "assistant", "content": g.text})
        click.echo("")
        click.echo(format_stats(g.stats), err=True)
