"""The files PowerInfer's C++ runtime loads (its repository at d3ebd7c; line numbers below are from that source).

- `<name>.powerinfer.gguf`: GGUF v3 whose magic is `PWRI` (ggml.h:247; ggml.c:19481-19484 switch the loader to
  sparse inference). Arch `llama` (ReLU(gate)·up) or `bamboo` (ReLU(gate)·ReLU(up), llama.cpp:5028). The tensors
  are exactly those llm_load_sparse_model_tensors creates (llama.cpp:3236-3265; the loader refuses any other count,
  llama.cpp:2110): token_embd, output_norm, output (a tied embedding is written again), and per layer attn_norm,
  attn_q/k/v/output (q and k permuted as llama.cpp's convert.py does), ffn_norm, ffn_gate, ffn_up,
  `ffn_down_t` ({n_embd, n_ff}: the down projection transposed, one row per neuron for the axpy kernel),
  `fc1` ({n_embd, r}) and `fc2` ({r, n_ff}): the predictor. 2-D tensors F16, 1-D F32. Key
  `powerinfer.sparse_threshold` (f32, llama.cpp:362, 2347): T.
- `activation/activation_{i}.pt`: per layer a 1-D tensor of n_ff activation counts, next to the GGUF
  (llama.cpp:3101-3110); PowerInfer's own solver (powerinfer-py/powerinfer/solver.py) reads them with torch.load,
  so they are torch.save files: the one pickle format written here, and nothing here reads them back.
- `<name>.powerinfer.gguf.generated.gpuidx` (llama.cpp:3089): GGUF v3 of arch `generic.gpu_index` with magic `PWRI`,
  key `split.vram_capacity` (u64, llama.cpp:2799) and 2·n_layer I32 tensors read by position (llama.cpp:2832-2833):
  `blk.i.gpu_idx` (n_ff: 1 where the neuron lives on the GPU) then `blk.i.gpu_bucket` (the sorted indices of the
  1s), in numeric layer order. A CUDA build loads it when its VRAM left after the dense tensors is at least
  `split.vram_capacity` (llama.cpp:2816), else it runs `python3 -m powerinfer` to make another.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hotneurons.common import artifacts
from hotneurons.weights.names import layer_name

from .gguf_model import (
    ExportError,
    Tensor,
    Vocab,
    f16,
    hf_state,
    host,
    llama_metadata,
    llama_tensors,
    rope,
    write_gguf,
)

ARCH = {"reglu": "llama", "drelu": "bamboo"}  # our activation -> PowerInfer's arch
MODEL_TYPES = ("llama", "mistral")  # LLaMA-shaped: the tensors llm_build_llama_variants computes with
RELUFY = "make it ReLU-sparse with `pi-relufy --activation relu` (or drelu)"
MAGIC = b"PWRI"
# ggml.c:14904: at n_ff <= 1000 the sparse matmul runs mul_mat_sparse_head instead, which skips whole 128-neuron
# blocks whose first predictor value is < -7 and otherwise computes every neuron: not the per-neuron rule
MIN_FF = 1001


def check_width(n_ff: int) -> None:
    if n_ff < MIN_FF:
        raise ExportError(f"FFN width {n_ff} <= 1000: at that width PowerInfer's sparse matmul (ggml.c:14904) skips "
                          f"128-neuron blocks on a fixed cutoff instead of applying the predictor to each neuron, so "
                          f"it would not compute this model as trained; export a model with more than 1000 FFN neurons")


def powerinfer_arch(cfg: Any, activation: str) -> str:
    """PowerInfer's arch for a model config and our activation kind; refuses, in one line, what it cannot run
    exactly."""
    mt = getattr(cfg, "model_type", None)
    if mt not in MODEL_TYPES:
        raise ExportError(f"model type '{mt}' is not LLaMA-shaped: PowerInfer's sparse path exports LLaMA-architecture "
                          f"models ({', '.join(MODEL_TYPES)}); export one of those")
    if activation == "fatrelu":
        t = float(getattr(cfg, "fat_threshold", 0.0) or 0.0)
        raise ExportError(f"FATReLU with threshold {t:g} cannot run on PowerInfer, whose sparse FFN computes "
                          f"ReLU(gate) (FATReLU at 0): {RELUFY}")
    if activation not in ARCH:
        raise ExportError(f"activation '{activation}' cannot run on PowerInfer: its sparse FFN computes ReLU(gate)·up "
                          f"(arch llama) or ReLU(gate)·ReLU(up) (arch bamboo) only: {RELUFY}")
    check_width(cfg.intermediate_size)
    heads, d = cfg.num_attention_heads, cfg.hidden_size
    head_dim = getattr(cfg, "head_dim", None) or d // heads
    if head_dim * heads != d:
        raise ExportError(f"head_dim {head_dim} x {heads} heads != hidden size {d}: PowerInfer's LLaMA needs "
                          f"head_dim = hidden_size / num_attention_heads (llama.cpp:2336); export a model shaped so")
    for key in ("attention_bias", "mlp_bias"):
        if getattr(cfg, key, False):
            raise ExportError(f"{key} = true: PowerInfer's LLaMA has no biases there; export a model without them")
    if rope(cfg)[1] != "default":
        raise ExportError(f"RoPE scaling '{rope(cfg)[1]}' is not written by this exporter (plain RoPE only): export a "
                          f"model without rope_scaling")
    window = getattr(cfg, "sliding_window", None)
    if window is not None and getattr(cfg, "use_sliding_window", True) and window < cfg.max_position_embeddings:
        raise ExportError(f"sliding_window {window} < context {cfg.max_position_embeddings}: PowerInfer's attention "
                          f"sees the whole context; export a model without a sliding window")
    return ARCH[activation]


def counts_and_masks(counts: Sequence[np.ndarray], gpu_mask: Sequence[np.ndarray] | None, n_layers: int,
                      n_ff: int) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    c = [np.asarray(x) for x in counts]
    if len(c) != n_layers or any(x.shape != (n_ff,) for x in c):
        raise ExportError(f"activation counts for {len(c)} layers of shape {c[0].shape if c else None}; the model has "
                          f"{n_layers} layers of {n_ff} neurons: use the profile of this model")
    if gpu_mask is None:
        return c, None
    m = [np.asarray(x, dtype=bool) for x in gpu_mask]
    if len(m) != n_layers or any(x.shape != (n_ff,) for x in m):
        raise ExportError(f"GPU masks for {len(m)} layers of shape {m[0].shape if m else None}; the model has "
                          f"{n_layers} layers of {n_ff} neurons: use the placement of this model")
    return c, m


def gpu_index_tensors(gpu_mask: Sequence[np.ndarray]) -> list[Tensor]:
    """blk.i.gpu_idx (n_ff,) int32 0/1, then blk.i.gpu_bucket (k,) int32 sorted indices of the 1s, layer by layer in
    numeric order: the loader takes them by position (2i, 2i+1), not by name."""
    out = []
    for i, m in enumerate(gpu_mask):
        idx = np.asarray(m, dtype=bool).astype(np.int32)  # (n_ff,)
        bucket = np.flatnonzero(idx).astype(np.int32)  # (k,), ascending
        out += [Tensor(layer_name(i, "gpu_idx"), idx.shape, np.dtype(np.int32), lambda a=idx: a),
                Tensor(layer_name(i, "gpu_bucket"), bucket.shape, np.dtype(np.int32), lambda a=bucket: a)]
    return out


def write_gpu_index(path: Path, gpu_mask: Sequence[np.ndarray], vram_capacity: int) -> dict[str, Any]:
    def metadata(w):
        w.add_block_count(len(gpu_mask))
        w.add_uint64("split.vram_capacity", int(vram_capacity))

    return write_gguf(path, "generic.gpu_index", metadata, gpu_index_tensors(gpu_mask), magic=MAGIC)


def write_activations(folder: Path, counts: Sequence[np.ndarray]) -> None:
    """activation/activation_{i}.pt: torch.save of each layer's (n_ff,) int64 counts (PowerInfer's format)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, c in enumerate(counts):
        torch.save(torch.from_numpy(np.array(c, dtype=np.int64)), folder / f"activation_{i}.pt")


def write_powerinfer(model: Any, vocab: Vocab, predictors: Sequence[tuple[torch.Tensor, torch.Tensor]],
                     threshold: float, counts: Sequence[np.ndarray], gpu_mask: Sequence[np.ndarray] | None,
                     vram_capacity: int, out: str | Path, *, config: Any = None, activation: str | None = None,
                     name: str = "model", force: bool = False, progress: bool = False,
                     info: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write OUT/{name}.powerinfer.gguf, OUT/activation/ and (with `gpu_mask`) the .generated.gpuidx beside it.

    `model`: an HF LLaMA causal LM (any device and dtype) or its state dict with `config`; `predictors`: per layer
    (fc1 (r, d), fc2 (n_ff, r)) already in PowerInfer's form, decided by `idx >= threshold`; `counts`: per layer
    (n_ff,) activation counts; `gpu_mask`: per layer (n_ff,) bool, True on the GPU; `vram_capacity`: bytes, the
    gpuidx's split.vram_capacity. The folder appears whole or not at all; an existing one needs `force`.
    Returns the summary also written to OUT/export.json.
    """
    from hotneurons.models.family import adapter_for

    out = Path(out)
    cfg = config if config is not None else model.config
    act = str(activation or adapter_for(cfg).activation(cfg))
    arch = powerinfer_arch(cfg, act)
    L, d, n_ff = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
    if out.exists() and not force:
        raise ExportError(f"{out} exists: pass force=True (--force) to replace it, or another output folder",
                          params="force")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file, not a folder: name another output folder", params="out")
    if len(vocab.tokens) != cfg.vocab_size:
        raise ExportError(f"the vocabulary has {len(vocab.tokens)} tokens but the model {cfg.vocab_size} embedding "
                          f"rows: use the model's own tokenizer")
    check_predictors(predictors, L, d, n_ff, threshold, vram_capacity)
    counts, gpu_mask = counts_and_masks(counts, gpu_mask, L, n_ff)
    state = hf_state(model)

    def ffn(i: int) -> list[Tensor]:
        p = f"model.layers.{i}.mlp."
        down = state[p + "down_proj.weight"]  # (d, n_ff)
        fc1, fc2 = predictors[i]
        return [f16(layer_name(i, "ffn_gate.weight"), state[p + "gate_proj.weight"]),  # (n_ff, d)
                f16(layer_name(i, "ffn_up.weight"), state[p + "up_proj.weight"]),  # (n_ff, d)
                Tensor(layer_name(i, "ffn_down_t.weight"), (n_ff, d), np.dtype(np.float16),  # a row per neuron
                       lambda: host(down.t(), np.float16, layer_name(i, "ffn_down_t.weight"))),
                f16(layer_name(i, "fc1.weight"), fc1),  # (r, d)
                f16(layer_name(i, "fc2.weight"), fc2)]  # (n_ff, r)

    def metadata(w):
        llama_metadata(w, cfg, name)
        vocab.add_to(w)
        w.add_float32("powerinfer.sparse_threshold", float(threshold))

    gguf_name = f"{name}.powerinfer.gguf"
    tensors = llama_tensors(state, cfg, ffn=ffn)
    summary: dict[str, Any] = {
        "format": "powerinfer", "arch": arch, "activation": act, "name": name, "n_layers": L, "d_model": d,
        "n_neurons": n_ff, "vocab": {"model": vocab.model, "tokens": len(vocab.tokens)},
        "sparse_threshold": float(threshold), "predictor_hidden": [int(f1.shape[0]) for f1, _ in predictors],
        "files": {"model": gguf_name, "activation": "activation/activation_{i}.pt",
                  "gpu_index": f"{gguf_name}.generated.gpuidx" if gpu_mask is not None else None},
        "gpu_neurons_per_layer": None if gpu_mask is None else [int(m.sum()) for m in gpu_mask],
        "vram_capacity": int(vram_capacity) if gpu_mask is not None else None, **(info or {})}
    return write_folder(out, gguf_name, arch, metadata, tensors, counts, gpu_mask, vram_capacity, summary, progress)


def check_predictors(predictors: Sequence[tuple[torch.Tensor, torch.Tensor]], n_layers: int, d: int, n_ff: int,
                     threshold: float, vram_capacity: int) -> None:
    """One-line refusals of predictors, threshold and capacity that PowerInfer cannot take."""
    if len(predictors) != n_layers:
        raise ExportError(f"{len(predictors)} predictor layers for a {n_layers}-layer model: one predictor per layer "
                          f"needed")
    for i, (f1, f2) in enumerate(predictors):
        if f1.dim() != 2 or f2.dim() != 2 or f1.shape[1] != d or f2.shape != (n_ff, f1.shape[0]):
            raise ExportError(f"layer {i}'s predictor has fc1 {tuple(f1.shape)} and fc2 {tuple(f2.shape)}; PowerInfer "
                              f"needs fc1 (r, {d}) and fc2 ({n_ff}, r)")
    if not math.isfinite(threshold):
        raise ExportError(f"threshold {threshold} is not finite: PowerInfer's sparse_threshold is one finite float")
    if vram_capacity < 0:
        raise ExportError(f"vram_capacity {vram_capacity} is negative: give bytes >= 0", params="vram_capacity")


def write_folder(out: Path, gguf_name: str, arch: str, metadata, tensors: Sequence[Tensor], counts, gpu_mask,
                 vram_capacity: int, summary: dict[str, Any], progress: bool) -> dict[str, Any]:
    """OUT/{gguf_name} (magic PWRI), OUT/activation/, the .generated.gpuidx (with `gpu_mask`) and OUT/export.json,
    in a staging folder renamed into place: the folder appears whole or not at all."""
    with artifacts.staged(out.resolve()) as tmp:
        res = write_gguf(tmp / gguf_name, arch, metadata, tensors, magic=MAGIC, progress=progress,
                         desc=f"writing {gguf_name}")
        summary.update(tensor_bytes=res["tensor_bytes"], file_bytes=res["file_bytes"], seconds=round(res["seconds"], 3))
        write_activations(tmp / "activation", counts)
        if gpu_mask is not None:
            write_gpu_index(tmp / f"{gguf_name}.generated.gpuidx", gpu_mask, vram_capacity)
        artifacts.write_json(tmp / "export.json", summary)
    return summary
