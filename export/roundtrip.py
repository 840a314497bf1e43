"""The export's proof: one small ReGLU LLaMA, its exact predictors, and the greedy tokens of PowerInfer's `main`, our
runtime and HF `generate` side by side.

`build_model` saves a random LLaMA with ReLU(gate)·up FFNs, random norm weights (so that folding γ into fc1 is tested)
and a byte-level BPE tokenizer with a few merges (so that the vocabulary's merges are tested), its 2-D weights on the
grid that float16 and bfloat16 share (PowerInfer stores F16, our runtime's cold rows bf16: all three then compute with
the same weights). `make_run` gives it a run directory: a profile counted on some text, a placement, the exact
predictors. `roundtrip` exports the run, runs the three and compares their tokens.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from hotneurons.models.family import step as hf_step

PROMPT = "The quick brown fox jumps over the lazy dog and then"
TEXT = ("The quick brown fox jumps over the lazy dog. Sparse activations make the large models fast, "
        "and the hot neurons stay on the GPU while the cold ones are computed on the CPU. ") * 4
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s")]
SHAPE = dict(hidden_size=64, intermediate_size=1024, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)
F16_MIN_NORMAL = 2.0 ** -14  # below it float16 keeps fewer bits than bfloat16's 8


def tokenizer():
    """A byte-level BPE tokenizer (GPT-2 style) with a few merges: ids 0-255 the byte characters, then the merged
    tokens, then <s>, </s>, <pad>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    for t in ("<s>", "</s>", "<pad>"):
        vocab[t] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def shared_grid(w: torch.Tensor) -> torch.Tensor:
    """w rounded to bfloat16, with the values float16 would round differently (|w| < 2^-14) set to 0: a value both
    formats hold exactly."""
    b = w.bfloat16().float()
    return torch.where(b.abs() < F16_MIN_NORMAL, torch.zeros_like(b), b)


def build_model(folder: Path, seed: int = 0, std: float = 0.3, activation: str = "reglu", **shape: int) -> Path:
    """A random LLaMA (untied head) with ReGLU or dReLU FFNs (config.json marks dReLU, common/sparse_act.py) and its
    tokenizer, saved to `folder` (SHAPE unless `shape` says else)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer()
    cfg = LlamaConfig(**{**SHAPE, **shape}, vocab_size=len(tok), hidden_act="relu", tie_word_embeddings=False,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(shared_grid(torch.randn_like(p) * std))
            else:  # norm weights: away from 1, so a γ folded into the wrong place shows
                p.copy_(torch.rand_like(p) + 0.5)
    if activation == "drelu":
        from hotneurons.common.sparse_act import mark_config

        mark_config(model.config, "drelu")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return Path(folder)


@torch.no_grad()
def activation_counts(lm, text: str = TEXT) -> tuple[np.ndarray, int]:
    """(n_layers, n) int64: on how many of the text's tokens each neuron's value (the down projection's input) is
    nonzero; and the token count."""
    ids = torch.tensor([lm.tokenizer(text)["input_ids"]])
    counts = []
    hooks = [lm.adapter.layer_ffn(layer)["down"].register_forward_pre_hook(
        lambda _m, args: counts.append((args[0][0] != 0).sum(0).long())) for layer in lm.layers]
    try:
        lm.model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(counts).numpy(), ids.shape[1]


def make_run(folder: Path, run: Path, form: str = "normed", gpu_share: float = 0.25) -> Path:
    """RUN/profile (counted on TEXT), RUN/placement (each layer's hottest `gpu_share` of neurons on the GPU) and
    RUN/predictors (the exact predictors in `form`, threshold 0) for the model in `folder`."""
    from hotneurons.models.family import load_model

    from .predictors import exact_predictors, write_predictors

    lm = load_model(str(folder), device="cpu", dtype="float32")
    counts, tokens = activation_counts(lm)
    write_profile_and_placement(run, lm.info, counts, tokens, gpu_share)
    write_predictors(run, lm.info, exact_predictors(dict(lm.model.state_dict()), lm.info["n_layers"], form), 0.0, form)
    return run


def write_profile_and_placement(run: Path, info: dict, counts: np.ndarray, tokens: int, gpu_share: float) -> None:
    """RUN/profile of `counts` (layers, neurons) over `tokens`, and RUN/placement: each layer's hottest `gpu_share`
    of neurons on the GPU."""
    from hotneurons.artifacts.placement import PlacementMeta
    from hotneurons.artifacts.profile import ProfileMeta
    from hotneurons.common import artifacts
    from hotneurons.common.kinds import Rule

    L, n = info["n_layers"], info["n_neurons"]
    rows = []
    for i in range(L):
        order = np.argsort(-counts[i], kind="stable")
        gpu = np.zeros(n, dtype=bool)
        gpu[order[: int(gpu_share * n)]] = True
        rank = np.empty(n, dtype=np.int32)
        rank[order] = np.arange(n)
        rows.append(pd.DataFrame({"layer": np.int32(i), "neuron": np.arange(n, dtype=np.int32), "gpu": gpu,
                                  "count": counts[i], "rank": rank}))
    with artifacts.staged(run / "profile") as tmp:
        artifacts.write_parquet(tmp / "neurons.parquet", pd.DataFrame({
            "layer": np.repeat(np.arange(L, dtype=np.int32), n), "neuron": np.tile(np.arange(n, dtype=np.int32), L),
            "count": counts.reshape(-1)}))
        ProfileMeta(model=info, tokens=tokens, rule=Rule.NONZERO, dataset="export.roundtrip.TEXT").save(
            tmp / "meta.json")
    with artifacts.staged(run / "placement") as tmp:
        artifacts.write_parquet(tmp / "placement.parquet", pd.concat(rows, ignore_index=True))
        PlacementMeta(model=info).save(tmp / "meta.json")


def hf_tokens(folder: Path, prompt: str, n: int) -> dict[str, Any]:
    """HF greedy generate: the new token ids and each step's top-two logit margin."""
    from hotneurons.models.family import load_model

    lm = load_model(str(folder), device="cpu", dtype="float32")
    ids = lm.tokenizer(prompt)["input_ids"]
    out = lm.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, output_logits=True,
                            return_dict_in_generate=True)
    margins = [float(v[0] - v[1]) for v in (lg[0].topk(2).values for lg in out.logits)]
    return {"prompt_ids": list(ids), "tokens": out.sequences[0, len(ids):].tolist(), "top2_margins": margins}


def our_tokens(run: Path, prompt: str, n: int, threads: int = 1) -> dict[str, Any]:
    """Our runtime (hybrid: the run's placement and predictors, CPU) greedy."""
    from hotneurons.runtime.generate import RuntimeConfig, generate, prompt_ids
    from hotneurons.runtime.load import load_runtime

    rt = load_runtime(run, RuntimeConfig(device="cpu", threads=threads))
    g = generate(rt, prompt_ids(rt, prompt), n)
    return {"tokens": g.token_ids, "ffn_sparsity": g.stats["ffn_sparsity"],
            "gpu_activation_share": g.stats["gpu_activation_share"], "mode": g.stats["mode"]}


@torch.no_grad()
def our_tokens_stepwise(run: Path, prompt: str, n: int, threads: int = 1,
                        hooks: Callable[[Any], list] | None = None) -> dict[str, Any]:
    """Our runtime with the prompt fed one token at a time, so that the predictor decides for the prompt's tokens too
    (generate prefills densely; PowerInfer's prompt pass is sparse), then greedy. `hooks(lm)` may install forward
    hooks on the HF modules (returns their handles, removed after)."""
    from hotneurons.runtime.generate import RuntimeConfig, prompt_ids
    from hotneurons.runtime.load import load_runtime

    rt = load_runtime(run, RuntimeConfig(device="cpu", threads=threads, static_decode=False))
    handles = hooks(rt.lm) if hooks is not None else []
    ids, cache, out = prompt_ids(rt, prompt), None, []
    for t in ids[:-1]:
        cache = hf_step(rt.lm.model, torch.tensor([[t]]), cache)[1]
    nxt = ids[-1]
    for _ in range(n):
        logits, cache = hf_step(rt.lm.model, torch.tensor([[nxt]]), cache)
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        if nxt == rt.lm.tokenizer.eos_token_id:
            break
    for h in handles:
        h.remove()
    return {"tokens": out}


def write_corpus(path: Path, docs: int = 40) -> Path:
    """A small .jsonl corpus for pi-profile (the model is random: what the text says does not matter)."""
    import json

    with open(path, "w") as f:
        for i in range(docs):
            f.write(json.dumps({"text": f"Document {i}. " + TEXT[i * 7:] + TEXT[: i * 11]}) + "\n")
    return path


# llama_print_timings' decode line ("eval time = T ms / N runs (M ms per token, ...)") and its prompt line ("prompt
# eval time = T ms / N tokens"): "/ N runs" tells the decode line apart
EVAL = re.compile(r"eval time =\s*([\d.]+) ms /\s*(\d+) runs\s*\(\s*([\d.]+) ms per token")
PROMPT_EVAL = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
# the loader's lines on the model's format, the predictor threshold and the GPU split it applied
LOADER = ("sparse_pred_threshold", "format ", "gpu_idx", "gpu split", "offloaded", "VRAM", "vram")


def timing_rates(text: str) -> dict[str, Any]:
    """Decode and prompt rates from `main`'s llama_print_timings lines in `text`; {} without a decode line."""
    m = EVAL.search(text)
    if not m:
        return {}
    pm = PROMPT_EVAL.search(text)
    ms = float(m.group(3))
    return {"decode_tokens_per_s": 1e3 / ms, "decode_ms_per_token": ms, "decode_runs": int(m.group(2)),
            "prefill_tokens_per_s": (int(pm.group(2)) * 1e3 / float(pm.group(1))) if pm else None}


def powerinfer_tokens(main: Path, gguf: Path, prompt: str, n: int, threads: int = 1, timeout: float = 300,
                      logdir: Path | None = None, extra: Sequence[str] = (), env: dict | None = None, ctx: int = 256,
                      repeat_penalty: float | None = 1.0) -> dict[str, Any]:
    """PowerInfer's `main` at --temp 0: its prompt and output token ids from the YAML log it writes with --logdir
    (main.cpp:81; common.cpp:1367), its loader's lines (LOADER) and, when it prints them, its decode and prompt rates
    (timing_rates). `ctx`: -c; `repeat_penalty`: 1.0 makes it greedy (main's sampler applies the penalty at --temp 0
    too, sampling.cpp:150), None leaves main's default; `extra`: more flags (a CUDA build's --vram-budget,
    --ignore-eos); `env`: variables added to the environment (LLAMA_SPARSE_PRED_THRESHOLD, llama.cpp:2348). A CUDA
    build refuses `threads` 1 (ggml.c:16719)."""
    logdir = Path(logdir or Path(gguf).parent / "logs").resolve()
    gguf = Path(gguf).resolve()
    main = Path(main).resolve() if Path(main).exists() else main  # else a name on PATH
    logdir.mkdir(parents=True, exist_ok=True)
    penalty = ["--repeat-penalty", str(repeat_penalty)] if repeat_penalty is not None else []
    cmd = [str(main), "-m", str(gguf), "-p", prompt, "-n", str(n), "-t", str(threads), "-s", "0", "--temp", "0",
           *penalty, "-c", str(ctx), "--logdir", str(logdir) + "/", *extra]
    before = set(logdir.glob("*.yml"))  # a failed run writes none: never read an earlier run's
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, errors="replace",
                       env={**os.environ, **(env or {})}, cwd=logdir)  # main writes main.log where it runs
    text = p.stdout + p.stderr
    row = {"command": " ".join(cmd), "env": env or {}, "returncode": p.returncode,
           "seconds": round(time.perf_counter() - t0, 3),
           "loader": [ln.strip() for ln in text.splitlines() if any(k in ln for k in LOADER)]}
    logs = sorted(set(logdir.glob("*.yml")) - before)  # named by a sortable timestamp (main.cpp:52)
    if p.returncode != 0 or not logs:
        return {**row, "error": text[-3000:]}
    log = logs[-1].read_text(errors="replace")

    def ints(key: str) -> list[int]:
        m = re.search(rf"^{key}: \[([^\]]*)\]", log, re.M)
        return [int(v) for v in m.group(1).split(",") if v.strip()] if m else []

    prompt_ids, tokens = ints("prompt_tokens"), ints("output_tokens")
    if not prompt_ids and tokens:  # main.cpp:650-655 logs a batch of one token as output: a one-token prompt's
        prompt_ids, tokens = tokens[:1], tokens[1:]
    return {**row, "prompt_ids": prompt_ids, "tokens": tokens,
            "timings": [ln.strip() for ln in text.splitlines() if "llama_print_timings" in ln], **timing_rates(text)}


def repeated_runs(main: Path, gguf: Path, prompt: str, n: int, threads: int, times: int, logs: Path,
                  ref: list[int], extra: Sequence[str] = ()) -> list[dict[str, Any]]:
    """`main` run `times` times alike at `threads` (logs/0, logs/1, ...): per run its tokens, its error if any and how
    many of them equal `ref`'s. Its CPU down-projection adds the threads' partial sums without a lock
    (ggml.c:14433-14457), so runs alike can differ."""
    runs = [powerinfer_tokens(main, gguf, prompt, n, threads, logdir=logs / str(k), extra=extra) for k in range(times)]
    return [{"matched": common_prefix(r.get("tokens", []), ref), "tokens": r.get("tokens"), "error": r.get("error")}
            for r in runs]


def common_prefix(a: list[int], b: list[int]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def roundtrip(work: Path, main: Path | None, form: str = "normed", prompt: str = PROMPT, n: int = 16,
              threads: int = 1, seed: int = 0, main_args: Sequence[str] = (), activation: str = "reglu"
              ) -> dict[str, Any]:
    """Build, profile, place, export and run; the figures of the comparison (PowerInfer's only with `main`). The exact
    predictor marks the open gates, a superset of dReLU's active neurons (ReLU(up) zeroes the rest): exact for both."""
    from .run import export_run

    work = Path(work)
    folder = build_model(work / "model", seed=seed, activation=activation)
    run = make_run(folder, work / "run", form)
    summary = export_run(run, work / "export", force=True)
    hf = hf_tokens(folder, prompt, n)
    ours = our_tokens(run, prompt, n, threads)
    res: dict[str, Any] = {
        "model": {**SHAPE, "vocab": summary["vocab"], "activation": activation, "arch": summary["arch"], "seed": seed},
        "predictor": {"form_in_run": form, "kind": "exact (fc2 ReLU(fc1 x) = gate pre-activation, threshold 0)",
                      "hidden": summary["predictor_hidden"][0], "sparse_threshold": summary["sparse_threshold"]},
        "prompt": prompt, "new_tokens": n, "threads": threads,
        "hf": hf, "ours": ours,
        "ours_vs_hf_matched": common_prefix(ours["tokens"], hf["tokens"]),
        "export": {k: summary[k] for k in ("arch", "files", "file_bytes", "gpu_neurons_per_layer", "vram_capacity")},
    }
    if main is not None:
        pi = powerinfer_tokens(main, work / "export" / summary["files"]["model"], prompt, n, threads, extra=main_args)
        res["powerinfer"] = pi
        if "error" not in pi:
            res["prompt_ids_equal"] = pi["prompt_ids"] == hf["prompt_ids"]
            res["powerinfer_vs_hf_matched"] = common_prefix(pi["tokens"], hf["tokens"])
            res["powerinfer_vs_ours_matched"] = common_prefix(pi["tokens"], ours["tokens"])
            res["all_equal"] = pi["tokens"] == hf["tokens"] == ours["tokens"]
    return res
