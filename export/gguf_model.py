"""GGUF writing shared by the PowerInfer export and the llama.cpp benchmark: a streamed, atomic file writer, the
LLaMA tensors and hyperparameters of an HF model in llama.cpp's names and layout, and the tokenizer vocabulary.

`write_gguf` takes tensors as `Tensor` specs whose data is produced one at a time while the file is written, so a
model never sits in host memory twice. The file is written to `<name>.partial` and renamed, so a stopped export leaves
no file that a later run would take for whole; `magic` overwrites the first four bytes (PowerInfer marks its files
`PWRI`, ggml.h:247, and reads the rest as GGUF).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hotneurons.common.kinds import FixableError
from hotneurons.weights.names import layer_name


class ExportError(FixableError, ValueError):
    """A model, artifact or setting that cannot be exported exactly; one line naming the value and the fix."""


@dataclass(frozen=True)
class Tensor:
    """One tensor of a GGUF file. `shape` is numpy's order (gguf writes ggml's `ne`, the reverse); `data` makes the
    array (of `dtype` and `shape`) when the writer reaches it. A tensor of blocks (Q4_0, ...) is given as its bytes:
    `ggml_type` set, dtype uint8, shape (rows, row bytes)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    data: Callable[[], np.ndarray]
    ggml_type: int | None = None  # a block format's ggml type number: then shape and dtype are its bytes' (uint8)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def host(t: torch.Tensor, dtype: np.dtype, name: str = "") -> np.ndarray:
    """A torch tensor (any device and dtype) as a contiguous numpy array of `dtype`; values that float16 cannot hold
    (beyond +-65504) are refused rather than written as inf."""
    tdtype = {np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32,
              np.dtype(np.int32): torch.int32}[np.dtype(dtype)]
    a = t.detach().to(device="cpu", dtype=tdtype).contiguous().numpy()
    if a.dtype == np.float16 and not np.isfinite(a).all():
        big = float(t.detach().abs().max())
        raise ExportError(f"tensor {name or '?'} holds values beyond float16's range (max |w| {big:.4g} > 65504): "
                          f"scale the model or its predictor so that its weights fit in float16")
    return a


def f16(name: str, t: torch.Tensor) -> Tensor:
    """A 2-D weight, written F16 (what PowerInfer's sparse CPU path and llama.cpp's F16 files hold)."""
    return Tensor(name, tuple(t.shape), np.dtype(np.float16), lambda: host(t, np.float16, name))


def f32(name: str, t: torch.Tensor) -> Tensor:
    """A 1-D tensor (norm weights), written F32 as llama.cpp's converters do."""
    return Tensor(name, tuple(t.shape), np.dtype(np.float32), lambda: host(t, np.float32, name))


def write_gguf(path: Path, arch: str, metadata: Callable[[Any], None], tensors: Sequence[Tensor], *,
               magic: bytes = b"GGUF", progress: bool = False, desc: str = "tensors") -> dict[str, Any]:
    """Write a GGUF v3 file: `metadata(writer)` adds the key-value pairs, then each tensor's data in order.
    Returns path, tensor_bytes, file_bytes, seconds."""
    import gguf
    from tqdm import tqdm

    path = Path(path)
    t0 = time.perf_counter()
    tmp = path.with_name(path.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), arch)
    metadata(w)
    for t in tensors:
        raw = None if t.ggml_type is None else gguf.GGMLQuantizationType(t.ggml_type)
        w.add_tensor_info(t.name, t.shape, np.dtype(t.dtype), t.nbytes, raw_dtype=raw)
    total = sum(t.nbytes for t in tensors)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        with tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not progress, leave=False) as bar:
            for t in tensors:
                a = t.data()
                if a.shape != t.shape or a.dtype != t.dtype:  # the header already promised shape and dtype
                    raise ExportError(f"tensor {t.name} came out {a.dtype} {a.shape}, announced {t.dtype} {t.shape}")
                w.write_tensor_data(a)
                bar.update(a.nbytes)
        w.close()
        if magic != b"GGUF":
            with open(tmp, "r+b") as f:
                f.write(magic)  # the header's first 4 bytes; version, counts and the rest stay GGUF v3
        if magic == b"PWRI":
            retype_ints(tmp, tensors, GGML_I32, POWERINFER_I32)
        os.replace(tmp, path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return {"path": str(path), "tensor_bytes": total, "file_bytes": path.stat().st_size,
            "seconds": time.perf_counter() - t0}


def source_fields(path: Path, skip: Sequence[str] = ("general.architecture", "general.alignment")
                  ) -> list[tuple[str, Any, Any, Any]]:
    """A GGUF file's key-values as (name, value, value type, array element type or None), for a writer's
    add_key_value; GGUF.* and `skip` (what the writer sets itself) left out."""
    import gguf

    r = gguf.GGUFReader(str(path))
    return [(f.name, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
            for f in r.fields.values() if not f.name.startswith("GGUF.") and f.name not in skip]


# ggml's type number of I32: the gguf package writes today's (26); PowerInfer's ggml, from December 2023, numbers
# I8/I16/I32 16/17/18 (ggml.h:351-353) and reads 26 as an unknown type with a garbage block size
GGML_I32, POWERINFER_I32 = 26, 18


def retype_ints(path: Path, tensors: Sequence[Tensor], old: int, new: int) -> None:
    """Rewrite the type number of each int32 tensor's info in a written GGUF header from `old` to `new`.

    A tensor info is its name (u64 length, bytes), n_dims (u32), the dims in ggml order (u64 each), then the type
    (u32): each is found by its exact bytes, so nothing else in the file can match."""
    import struct

    ints = [t for t in tensors if np.dtype(t.dtype) == np.int32]
    if not ints:
        return
    with open(path, "r+b") as f:
        head = f.read(64 << 20)  # the header: key-values (a vocabulary among them), then the tensor infos
        for t in ints:
            name = t.name.encode()
            info = struct.pack("<Q", len(name)) + name + struct.pack("<I", len(t.shape)) + b"".join(
                struct.pack("<Q", n) for n in reversed(t.shape))
            at = head.find(info + struct.pack("<I", old))
            if at < 0:
                raise ExportError(f"tensor {t.name}: its type field ({old}) was not found in the header of {path}")
            f.seek(at + len(info))
            f.write(struct.pack("<I", new))


# ---------------------------------------------------------------------------------------------------------------
# LLaMA tensors and hyperparameters


def permute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF's q/k rows (each head's RoPE pairs split into halves) -> llama.cpp's (pairs adjacent), as llama.cpp's
    convert.py `permute` does (PowerInfer's convert.py:447). Rows: n_heads * head_dim; head_dim even."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_state(model: Any) -> dict[str, torch.Tensor]:
    """The weights by HF name of an HF causal LM module (or a state dict as is)."""
    return dict(model) if isinstance(model, Mapping) else dict(model.state_dict())


def llama_tensors(state: Mapping[str, torch.Tensor], cfg: Any, *, ffn: Callable[[int], list[Tensor]] | None = None
                  ) -> list[Tensor]:
    """llama.cpp's LLaMA tensors of an HF LLaMA state dict, in file order: embedding, output norm and head, then per
    layer attention and FFN. `ffn(i)` replaces layer i's FFN tensors (default: ffn_gate, ffn_up, ffn_down as llama.cpp
    has them). A tied embedding is written again as `output.weight` (the loader requires it)."""
    n_heads, n_kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    emb = state["model.embed_tokens.weight"]
    out = [f16("token_embd.weight", emb), f32("output_norm.weight", state["model.norm.weight"]),
           f16("output.weight", state.get("lm_head.weight", emb))]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        q, k = state[p + "self_attn.q_proj.weight"], state[p + "self_attn.k_proj.weight"]
        out += [f32(layer_name(i, "attn_norm.weight"), state[p + "input_layernorm.weight"]),
                Tensor(layer_name(i, "attn_q.weight"), tuple(q.shape), np.dtype(np.float16),
                       lambda q=q, i=i: host(permute_qk(q, n_heads), np.float16, layer_name(i, "attn_q.weight"))),
                Tensor(layer_name(i, "attn_k.weight"), tuple(k.shape), np.dtype(np.float16),
                       lambda k=k, i=i: host(permute_qk(k, n_kv), np.float16, layer_name(i, "attn_k.weight"))),
                f16(layer_name(i, "attn_v.weight"), state[p + "self_attn.v_proj.weight"]),
                f16(layer_name(i, "attn_output.weight"), state[p + "self_attn.o_proj.weight"]),
                f32(layer_name(i, "ffn_norm.weight"), state[p + "post_attention_layernorm.weight"])]
        if ffn is not None:
            out += ffn(i)
        else:
            out += [f16(layer_name(i, "ffn_gate.weight"), state[p + "mlp.gate_proj.weight"]),
                    f16(layer_name(i, "ffn_up.weight"), state[p + "mlp.up_proj.weight"]),
                    f16(layer_name(i, "ffn_down.weight"), state[p + "mlp.down_proj.weight"])]
    return out


def rope(cfg: Any) -> tuple[float, str]:
    """(theta, scaling type) of a LLaMA config: transformers 5 keeps both in `rope_parameters` (type "default" for
    plain RoPE), older versions in `rope_theta` and `rope_scaling` (None for plain RoPE)."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    theta = params.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0
    return float(theta), str(params.get("rope_type") or params.get("type") or "default")


def llama_metadata(w: Any, cfg: Any, name: str, activation: str | None = None) -> None:
    """The hyperparameter keys llama.cpp reads for a LLaMA-shaped model (under the writer's arch prefix), and the
    FFN activation (`activation`, else the config's) under our key, which llama.cpp ignores: its arch llama means
    SwiGLU, so without it a ReLU LLaMA would read back as SwiGLU (weights/gguf_source.py)."""
    w.add_name(name)
    activation_metadata(w, cfg, activation)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    # checked == n_rot (llama.cpp:2336): the head size, which Qwen3(-MoE) sets apart from hidden / heads
    w.add_rope_dimension_count(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(rope(cfg)[0])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(1)  # MOSTLY_F16


def activation_metadata(w: Any, cfg: Any, activation: str | None = None) -> None:
    """`hotneurons.activation` (and `hotneurons.fat_threshold` for FATReLU) from `activation` or the config."""
    from hotneurons.models.family import adapter_for
    from hotneurons.weights.names import ACTIVATION_KEY, FAT_THRESHOLD_KEY

    act = str(activation or adapter_for(cfg).activation(cfg))
    w.add_string(ACTIVATION_KEY, act)
    if act == "fatrelu":
        w.add_float32(FAT_THRESHOLD_KEY, float(getattr(cfg, "fat_threshold", 0.0) or 0.0))


# ---------------------------------------------------------------------------------------------------------------
# Mixtures of experts

# transformers model_type -> llama.cpp arch: convert_hf_to_gguf.py writes Mixtral as a llama with experts
MOE_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}


def moe_tensors(state: Mapping[str, torch.Tensor], cfg: Any) -> list[Tensor]:
    """llama.cpp's tensors of an HF mixture of experts (MOE_ARCH) under weights/names.py's canonical names, each
    projection's experts stacked (E, out, in) (gguf writes ne [in, out, E]), as convert_hf_to_gguf.py writes them: Q/K
    rows permuted for arch llama (Mixtral) only; 1-D tensors and routers F32, the rest F16; (1, d) gates as (d,)."""
    from hotneurons.weights.names import NameMap

    arch = MOE_ARCH[cfg.model_type]
    canon = NameMap(cfg.model_type, cfg.num_hidden_layers).tensors(state)  # experts stacked (a copy), rest views
    canon.setdefault("output.weight", canon["token_embd.weight"])  # tied: written again (the loader requires it)
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}

    def value(name: str, t: torch.Tensor) -> torch.Tensor:  # run when the writer reaches the tensor
        kind = name.split(".")[-2]
        if arch == "llama" and kind in heads and name.endswith(".weight"):
            return permute_qk(t, heads[kind])  # (rows, d) in llama.cpp's rope order
        return t.reshape(-1) if kind == "ffn_gate_inp_shexp" else t  # (1, d) -> (d,)

    out = []
    for name, t in canon.items():
        shape = (t.numel(),) if name.endswith("ffn_gate_inp_shexp.weight") else tuple(t.shape)
        dt = np.dtype(np.float32 if len(shape) == 1 or ".ffn_gate_inp." in name else np.float16)
        out.append(Tensor(name, shape, dt, lambda name=name, t=t, dt=dt: host(value(name, t), dt, name)))
    return out


def moe_metadata(w: Any, cfg: Any, name: str) -> None:
    """llama_metadata's keys and the experts' as llama.cpp's converter writes them: expert_count, expert_used_count;
    for the qwen archs expert_feed_forward_length (feed_forward_length stays the config's intermediate_size) and
    Qwen2-MoE's expert_shared_feed_forward_length; OLMoE's clip_qkv as attention.clamp_kqv. expert_weights_norm
    (renormalised top-k) too, outside Mixtral (always): llama.cpp fixes it per arch, our reader reads the key."""
    from hotneurons.models.family import adapter_for

    llama_metadata(w, cfg, name, activation=adapter_for(cfg, experts=True).activation(cfg))
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_expert_count(int(getattr(cfg, "num_local_experts", None) or cfg.num_experts))
    w.add_expert_used_count(int(cfg.num_experts_per_tok))
    if cfg.model_type == "mixtral":
        return
    w.add_expert_weights_norm(bool(getattr(cfg, "norm_topk_prob", False)))
    if getattr(cfg, "moe_intermediate_size", None):
        w.add_expert_feed_forward_length(int(cfg.moe_intermediate_size))
    if getattr(cfg, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(int(cfg.shared_expert_intermediate_size))
    if getattr(cfg, "clip_qkv", None):
        w.add_clamp_kqv(float(cfg.clip_qkv))


def write_moe_gguf(model: Any, path: Path, vocab: Vocab | None = None, name: str | None = None) -> dict[str, Any]:
    """An HF mixture of experts (module) as an F16 GGUF in llama.cpp's layout (moe_tensors, moe_metadata)."""
    cfg = model.config
    if cfg.model_type not in MOE_ARCH:
        raise ExportError(f"model type {cfg.model_type!r} is no mixture of experts this writer knows: one of "
                          f"{', '.join(MOE_ARCH)}")

    def metadata(w: Any) -> None:
        moe_metadata(w, cfg, name or cfg.model_type)
        if vocab is not None:
            vocab.add_to(w)

    return write_gguf(path, MOE_ARCH[cfg.model_type], metadata, moe_tensors(hf_state(model), cfg))


# ---------------------------------------------------------------------------------------------------------------
# Vocabulary

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp's token types
# llama.cpp's BPE loader requires tokenizer.ggml.merges (llama.cpp:2518) and gguf writes no empty array. A tokenizer
# without merges gets this one: its left side has two characters, so no symbol ever equals it (symbols start as single
# characters and only merges join them), and it never applies: tokenization is that of no merges.
NEVER_MERGE = "\u0100\u0100 \u0100\u0100"


@dataclass
class Vocab:
    """A tokenizer as llama.cpp's GGUF keys hold it. `model`: "llama" (SentencePiece-style: "▁" for spaces, <0xXX>
    byte tokens, scores rank merges; llama.cpp adds BOS and a leading space) or "gpt2" (byte-level BPE: merges)."""

    model: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] = field(default_factory=list)
    bos: int | None = None
    eos: int | None = None
    unk: int | None = None
    pad: int | None = None

    def add_to(self, w: Any) -> None:
        w.add_tokenizer_model(self.model)
        w.add_token_list(self.tokens)
        w.add_token_types(self.types)
        if self.scores is not None:
            w.add_token_scores(self.scores)
        if self.model == "gpt2":
            w.add_token_merges(self.merges or [NEVER_MERGE])
        for key, v in (("bos", self.bos), ("eos", self.eos), ("unk", self.unk), ("pad", self.pad)):
            if v is not None:
                getattr(w, f"add_{key}_token_id")(v)


def placeholder_vocab(n: int) -> Vocab:
    """A SentencePiece-style vocabulary of `n` tokens with the 256 byte tokens llama.cpp needs and made-up names for
    the rest: for benchmark models whose text is never read."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"t{i}" for i in range(n - len(tokens))]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * (n - 259)
    return Vocab("llama", tokens[:n], types[:n], [0.0] * n, bos=1, eos=2, unk=0)


def _has(spec: Any, kind: str) -> bool:
    """Whether a tokenizer.json section (pre-tokenizer, decoder: possibly a Sequence) has a part of type `kind`."""
    if isinstance(spec, dict):
        return spec.get("type") == kind or any(_has(v, kind) for v in spec.values())
    if isinstance(spec, list):
        return any(_has(v, kind) for v in spec)
    return False


def vocab_from_tokenizer(tok: Any, vocab_size: int) -> Vocab:
    """The GGUF vocabulary of an HF fast tokenizer: byte-level BPE (GPT-2 style) -> "gpt2"; BPE with byte fallback
    (LLaMA's) -> "llama", scores from the merge ranks. `vocab_size`: the model's embedding rows; rows past the
    tokenizer's ids get unused placeholder tokens."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise ExportError(f"tokenizer {type(tok).__name__} is not a fast (tokenizer.json) tokenizer: save the model "
                          f"with a tokenizer.json")
    spec = json.loads(backend.to_str())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise ExportError(f"tokenizer model {model.get('type')} cannot be written for llama.cpp's loader of "
                          f"Dec 2023 (it reads BPE vocabularies: gpt2 or llama): use a model with a BPE tokenizer")
    ids: dict[int, str] = {i: t for t, i in model["vocab"].items()}
    special = {a["id"] for a in spec.get("added_tokens", []) if a.get("special")}
    for a in spec.get("added_tokens", []):
        ids[a["id"]] = a["content"]
    if max(ids) >= vocab_size:
        raise ExportError(f"the tokenizer has token id {max(ids)} but the model only {vocab_size} embedding rows: "
                          f"use the tokenizer saved with the model")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    byte_level = _has(spec.get("pre_tokenizer"), "ByteLevel") or _has(spec.get("decoder"), "ByteLevel")
    if not byte_level and not model.get("byte_fallback"):
        raise ExportError("the tokenizer is BPE without byte-level encoding or byte fallback: llama.cpp's loader "
                          "reads gpt2 (byte-level) or llama (byte-fallback) vocabularies only")
    tokens, types = [], []
    base = set(model["vocab"].values())
    rank = {m.replace(" ", "", 1): r for r, m in enumerate(merges)}  # merged token -> the rank of its merge
    for i in range(vocab_size):
        t = ids.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
            continue
        tokens.append(t)
        if i in special:
            types.append(UNKNOWN if i == tok.unk_token_id else CONTROL)
        elif not byte_level and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            types.append(BYTE)
        else:
            types.append(NORMAL if i in base else USER_DEFINED)
    seen: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if not t:
            raise ExportError(f"token {i} is the empty string, which llama.cpp's loader refuses: fix the tokenizer")
        if t in seen:
            raise ExportError(f"tokens {seen[t]} and {i} are both {t!r}; llama.cpp's loader needs unique tokens: fix "
                              f"the tokenizer")
        seen[t] = i
    # llama.cpp's SentencePiece tokenizer joins the adjacent pair whose join has the highest score: -rank replays BPE
    scores = None if byte_level else [-float(rank[t]) if t in rank else 0.0 for t in tokens]
    return Vocab("gpt2" if byte_level else "llama", tokens, types, scores, merges if byte_level else [],
                 bos=tok.bos_token_id, eos=tok.eos_token_id, unk=tok.unk_token_id, pad=tok.pad_token_id)
