"""`generate`: batch-1 decoding with the hybrid runtime (runtime/load.py builds it; load.build_runtime lays a
transformers model out for a placement).

The model is one of our decoders reading a local file or folder in place (models/: load.load_source_runtime, in
hybrid and dense modes) or a transformers causal LM whose attention, norms, RoPE and KV cache are reused
(load.build_runtime: hub ids, layer-split, --hf-decode; load.reads_in_place decides); either way each layer's FFN
is a `HybridFFN` (runtime/hybrid_ffn.py), or a `HybridMoE` for a mixture of experts, and the decode loop reads the
model through runtime/lm.DecodeModel (its context, end ids, prefill and step), the same for both. Decode steps run
through the static decoder (`Runtime.fast`, runtime/graph_steps.py) where it applies, else the model's `step`. Modes:
- hybrid: hot neurons on the compute device, active cold neurons on the CPU; masks from the predictors, or
  from the true activations with `oracle` (correctness checks, not speed);
- dense: the same layout, every cold neuron computed (no sparsity); without a placement, all on the device;
- layer-split: whole layers on the device up to the VRAM budget, the rest run dense on the CPU (as llama.cpp
  -ngl does): the baseline. CPU layers: attention in float32 torch, FFN by the same Numba kernels, all active.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from hotneurons.runtime.balance import ShareBalance, tune_mapped_rows
from hotneurons.runtime.config import RuntimeConfig
from hotneurons.runtime.graph_steps import GraphSteps
from hotneurons.runtime.hybrid_ffn import HybridFFN
from hotneurons.runtime.lm import DecodeModel
from hotneurons.runtime.moe_load import expert_stats
from hotneurons.runtime.offload import OnCPULayer
from hotneurons.runtime.sampling import Sampling, sample


@dataclass
class Runtime:
    lm: DecodeModel  # runtime/engine.SourceModel (our decoder) or models/family.LoadedModel (transformers)
    cfg: RuntimeConfig
    device: torch.device
    dtype: torch.dtype
    ffns: list[HybridFFN]
    cpu_layers: list[OnCPULayer]
    bytes_gpu: int
    bytes_cpu: int
    gpu_layers: int
    threads: int
    fast: GraphSteps | None = None  # decode steps as CUDA graphs (StaticDecoder: HF's LLaMA; SourceSteps: ours)
    pcie_share: float = 0.0  # see RuntimeConfig; the FFNs' mapped_rows are set from it after CALIBRATION_TOKENS
    pcie_tuned: bool = False  # the share's series of balancing rounds is over (re-checks may start another)
    pcie_balance: ShareBalance | None = None  # a measured share on CUDA graphs: moved by timed rounds first
    # the placement's GPU share of the profile's activations (pi-solve's summary.json), to compare decode's with
    profile_gpu_share: float | None = None
    # what pi-solve planned on the GPU (bytes, dtype: summary.json), to compare the device's bytes with
    plan_bytes_gpu: int | None = None
    plan_dtype: str | None = None
    # a mixture of experts: the placement's expected GPU share of routed expert work (summary.json's
    # experts.gpu_share_routed), and where the expert placement came from (RUN/placement, "given" or "default")
    plan_expert_share: float | None = None
    expert_placement: str | None = None
    locked: Any = None  # runtime/cuda.LockedHost of the cold experts' rows a long prefill copies (CUDA), kept alive
    expert_predictors: dict | None = None  # runtime/expert_predictors.attach's summary where the run has them
    # our decoder: the token ids its own cache holds after the last generate, and the cache's version then
    # (Decoder.cache_version): the next prompt that starts with them computes only the rest
    cached: tuple[list[int], int] | None = None

    @property
    def mode(self) -> str:
        return "oracle" if (self.cfg.mode == "hybrid" and self.cfg.oracle) else self.cfg.mode


# ---------------------------------------------------------------------------------------------------------------
# The decode loop


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    stats: dict[str, Any]
    logits: list[torch.Tensor] = field(default_factory=list)  # per generated token (vocab,), when asked


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reusable(rt: Runtime, dec: Any, prompt_ids: list[int]) -> int:
    """How many leading prompt tokens the decoder's own cache holds from the last generate, untouched since (its
    version unchanged): their common prefix, less the prompt's last token, whose logits a pass must make."""
    if dec is None or rt.cached is None or rt.cached[1] != dec.cache_version:
        return 0
    return common_prefix(rt.cached[0], prompt_ids)


def common_prefix(held: list[int], prompt: list[int]) -> int:
    """How many leading prompt tokens `held` starts with, at most all but the prompt's last (whose logits a request
    must compute)."""
    n = min(len(held), len(prompt) - 1)
    return next((i for i in range(n) if held[i] != prompt[i]), max(n, 0))


STEP_PREFILL_MOE = 16  # prompt tokens a mixture of experts on CUDA graphs takes through its decode step (RuntimeConfig)


def step_prefill(rt: Runtime) -> int:
    """Prompts of at most this many tokens are fed through the decode step a token at a time (RuntimeConfig
    .step_prefill; None: STEP_PREFILL_MOE for a mixture of experts decoding by CUDA graphs, 0 elsewhere)."""
    if rt.cfg.step_prefill is not None:
        return rt.cfg.step_prefill
    from hotneurons.runtime.moe_ffn import HybridMoE

    graphs = rt.fast is not None and rt.fast.graphs
    return STEP_PREFILL_MOE if graphs and any(isinstance(f, HybridMoE) for f in rt.ffns) else 0


@torch.inference_mode()
def generate(rt: Runtime, prompt_ids: list[int], max_new_tokens: int = 128, sampling: Sampling = Sampling(),
             on_text: Callable[[str], None] | None = None, stop_at_eos: bool = True,
             keep_logits: bool = False, should_stop: Callable[[], bool] | None = None,
             reuse: bool = False) -> Generation:
    """Prefill the prompt (dense), then decode one token at a time; `on_text` receives text as it is made.

    `should_stop` is asked after each token (e.g. a server whose client left, or a stop string seen by `on_text`);
    True ends the generation there, with stats["stopped"] = True. `reuse`: where our decoder's cache still holds the
    last generate's tokens (Runtime.cached), the prompt's common prefix with them is not computed again (a chat's
    next turn: its history); off by default, so that a prompt's figures are its whole prefill's."""
    lm = rt.lm
    ctx = lm.ctx
    if not prompt_ids:
        raise ValueError("the prompt is empty: pass some text")
    if len(prompt_ids) >= ctx:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens but the model's context is {ctx}: shorten it")
    max_new = min(max_new_tokens, ctx - len(prompt_ids))
    tok = lm.tokenizer
    stop = set(lm.eos) if stop_at_eos else set()
    gen = torch.Generator().manual_seed(sampling.seed)
    for f in rt.ffns:
        f.reset_counts()

    # the static decoder when it applies (LLaMA family, cache long enough, no FFN probed: its marks are HF's path's)
    fast = rt.fast if (rt.fast is not None and len(prompt_ids) + max_new <= rt.fast.capacity
                       and all(f.probe is None for f in rt.ffns)) else None
    step = fast.step if fast is not None else functools.partial(lm.step, rt)  # (token, position) -> (vocab,)
    dec = getattr(lm, "decoder", None)  # our decoder (transformers' keeps its own cache)
    reused = _reusable(rt, dec, prompt_ids) if reuse else 0  # positions whose keys and values the cache holds
    new = prompt_ids[reused:]
    # through the static decoder; off it only where asked and on our decoder (transformers' own decoding extends the
    # cache its prefill made, and an eager step of a mixture of experts costs as much as a pass)
    by_steps = len(new) <= step_prefill(rt) and (fast is not None or rt.cfg.step_prefill is not None
                                                 and dec is not None)
    t0 = time.perf_counter()
    if by_steps:  # a short prompt: the decode step a token at a time writes the cache as a pass would
        for pos, t in enumerate(new, start=reused):
            logits = step(t, pos)  # (vocab,)
        for f in rt.ffns:  # decode's counts are the generated tokens'
            f.reset_counts()
    else:
        logits = lm.prefill(rt, new, reused) if reused else lm.prefill(rt, prompt_ids)  # (vocab,)
    sync(rt.device)
    t_prefill = time.perf_counter() - t0
    if fast is not None and not by_steps:
        fast.load_prefill(len(prompt_ids))
    ids: list[int] = []
    kept: list[torch.Tensor] = []
    shown, steps, stopped = "", 0, False
    step_s: list[float] = []  # each step's wall time: its sampling waits for the logits, so each is one token's
    t1 = t_step = time.perf_counter()
    for _ in range(max_new):
        if keep_logits:
            kept.append(logits.float().cpu())
        nxt = sample(logits, prompt_ids + ids, sampling, gen)
        ids.append(nxt)
        if on_text is not None:
            text = tok.decode(ids, skip_special_tokens=True)
            if not text.endswith("\ufffd") and len(text) > len(shown):  # wait for a whole UTF-8 character
                on_text(text[len(shown):])
                shown = text
        if nxt in stop or len(ids) == max_new:
            break
        if should_stop is not None and should_stop():
            stopped = True
            break
        logits = step(nxt, len(prompt_ids) + len(ids) - 1)
        steps += 1
        tune_mapped_rows(rt)
        step_s.append(time.perf_counter() - t_step)
        t_step = time.perf_counter()
    sync(rt.device)
    t_decode = time.perf_counter() - t1
    # the cache holds the prompt and every generated token but the last (sampled, never fed)
    rt.cached = (prompt_ids + ids[:-1], dec.cache_version) if dec is not None else None
    # the rate is the steady state's: the first step is left out, as it compiles or loads the kernels it meets first
    # (Numba's cold kernels: a minute on a first run, a second from its cache after) and warms the caches
    warmup = 1 if steps > 1 else 0  # one step only: it is all there is to time
    t_warmup = sum(step_s[:warmup])
    text = tok.decode(ids, skip_special_tokens=True)
    if on_text is not None and len(text) > len(shown):
        on_text(text[len(shown):])
    # the median step: a rate that a few stalled steps (another process, the OS) do not move; the first is left out,
    # as its sampling found the prefill's logits ready while later ones wait for the step before
    median_ms = 1e3 * float(np.median(step_s[1:])) if len(step_s) > 1 else None
    return Generation(text, ids, {**_stats(rt, len(new), t_prefill, steps - warmup, t_decode - t_warmup),
                                      "prompt_tokens_reused": reused,
                                      "new_tokens": len(ids), "stopped": stopped, "decode_step_ms_median": median_ms,
                                      "prefill_by_steps": by_steps,
                                      "decode_steps": steps, "decode_warmup_steps": warmup,
                                      "decode_warmup_s": t_warmup},
                      kept)


def _stats(rt: Runtime, n_prompt: int, t_prefill: float, steps: int, t_decode: float) -> dict[str, Any]:
    n_layers, n = len(rt.lm.layers), rt.lm.info["n_neurons"]
    counts = sum((f.read_counts() for f in rt.ffns), np.zeros(4))  # tokens x layers, active, active hot, cold
    if rt.cfg.mode == "layer-split":
        sparsity, gpu_share = 0.0, rt.gpu_layers / n_layers
    elif counts[0] > 0:
        sparsity = 1 - counts[1] / (counts[0] * n)
        gpu_share = counts[2] / counts[1] if counts[1] else 1.0
    else:
        sparsity, gpu_share = 0.0, float("nan")
    return {"prefill_tokens_per_s": n_prompt / t_prefill if t_prefill else None,
            "decode_tokens_per_s": steps / t_decode if steps and t_decode else None,
            "ffn_sparsity": float(sparsity), "gpu_activation_share": float(gpu_share),
            "profile_gpu_activation_share": rt.profile_gpu_share,
            "bytes_gpu": int(rt.bytes_gpu), "bytes_cpu": int(rt.bytes_cpu), "mode": rt.mode,
            "mask": rt.ffns[0].mask if rt.ffns else None,  # predictor, gate (a gated model's own), dense, oracle
            "plan_bytes_gpu": rt.plan_bytes_gpu, "plan_dtype": rt.plan_dtype,
            "device": str(rt.device), "dtype": str(rt.dtype).removeprefix("torch."), "cold_dtype": rt.cfg.cold_dtype,
            "gpu_dtype": rt.cfg.gpu_dtype,  # as the builder resolved it (the compute dtype on the transformers path)
            "threads": rt.threads, "graph_prelaunch": bool(rt.fast is not None and rt.fast.prelaunch),
            "static_ctx": rt.fast.capacity if rt.fast is not None else rt.lm.static_ctx,
            "ops": None if rt.fast is None else rt.fast.ops_name,
            "pcie_share": rt.pcie_share, "pcie_balance": rt.pcie_balance.rounds if rt.pcie_balance else [],
            "pcie_rows_per_layer": float(np.mean([f.mapped_rows for f in rt.ffns]))
            if rt.ffns else 0.0,
            "prompt_tokens": n_prompt, "decode_steps": steps, "gpu_layers": rt.gpu_layers,
            **({"experts": x} if (x := expert_stats(rt)) is not None else {})}


def prompt_ids(rt: Runtime, prompt: str | list[dict], chat: bool = False) -> list[int]:
    """Token ids of a prompt; with `chat`, `prompt` (a string or a message list) goes through the chat template."""
    tok = rt.lm.tokenizer
    if chat:
        if getattr(tok, "chat_template", None) is None:
            raise ValueError("--chat: this model's tokenizer has no chat template; drop --chat")
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return list(tok(prompt)["input_ids"])
