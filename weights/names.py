"""Canonical tensor names, and the conversions between a file's tensors and HF's values.

The canonical names are llama.cpp's GGUF names (`token_embd.weight`, `blk.{i}.ffn_up.weight`, ...), the values and
layouts HF's: shapes in torch order (Linear.weight is (out, in)), Q/K rows in HF's order, Gemma's norm weights as HF
stores them, Falcon's fused QKV in HF's grouped layout. A safetensors checkpoint is mapped by name only
(`canonical_name`); a GGUF needs the reverse of what llama.cpp's converter did to the values (`GGUF_*` below,
applied by weights/gguf_source.py), as transformers' own GGUF loader does (modeling_gguf_pytorch_utils.py).

The activation a file records: our key `hotneurons.activation` (export/gguf_model.py writes it); else PowerInfer's
arch in a PWRI file (llama: ReLU(gate)*up, bamboo: ReLU(gate)*ReLU(up), opt and falcon: ReLU); else the one
llama.cpp computes for the arch (llama: SwiGLU, ...).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
from hotneurons.common.kinds import Activation

ACTIVATION_KEY = "hotneurons.activation"  # string, an Activation value
FAT_THRESHOLD_KEY = "hotneurons.fat_threshold"  # float32, with activation fatrelu
SPARSE_THRESHOLD_KEY = "powerinfer.sparse_threshold"  # float32, PowerInfer's predictor cutoff (llama.cpp:362)

# what PowerInfer's sparse path computes per arch (llama.cpp:5028-5054; OPT and Falcon models it runs are ReLU ones)
POWERINFER_ACTIVATION = {"llama": Activation.REGLU, "bamboo": Activation.DRELU, "opt": Activation.RELU,
                         "falcon": Activation.RELU}
# what llama.cpp computes per arch (a plain GGUF without our key)
LLAMACPP_ACTIVATION = {"llama": Activation.SWIGLU, "qwen2": Activation.SWIGLU, "qwen3": Activation.SWIGLU,
                       "gemma": Activation.GEGLU, "gemma2": Activation.GEGLU, "gemma3": Activation.GEGLU,
                       "falcon": Activation.GELU}

# GGUF arch -> transformers model_type (bamboo, PowerInfer's dReLU Mistral, is LLaMA-shaped; opt is PowerInfer's)
GGUF_MODEL_TYPE = {"llama": "llama", "bamboo": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma",
                   "gemma2": "gemma2", "gemma3": "gemma3_text", "falcon": "falcon", "opt": "opt"}
# llama.cpp's converter interleaves the rope halves of these archs' Q/K rows (PowerInfer's convert.py too)
GGUF_PERMUTED_QK = frozenset({"llama", "bamboo"})
# ... adds 1 to every `*norm.weight` of these (convert_hf_to_gguf.py, GemmaModel and its successors)
GGUF_NORM_SHIFT = frozenset({"gemma", "gemma2", "gemma3"})
# ... regroups Falcon's fused QKV rows as all Q, all K, all V ("jploski" layout)
GGUF_FALCON_QKV = frozenset({"falcon"})

_TYPE_ARCH = {"llama": "LLAMA", "mistral": "LLAMA", "mixtral_dense": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3",
              "gemma": "GEMMA", "gemma2": "GEMMA2", "gemma3": "GEMMA3", "gemma3_text": "GEMMA3", "falcon": "FALCON"}
# OPT has no llama.cpp arch: PowerInfer's gguf-py names (its tensor_mapping.py "# opt" lines), written out here
_OPT = {"decoder.embed_tokens": "token_embd", "decoder.embed_positions": "position_embd",
        "decoder.final_layer_norm": "output_norm", "lm_head": "output"}
_OPT_LAYER = {"self_attn_layer_norm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_output", "final_layer_norm": "ffn_norm",
              "fc1": "ffn_up", "fc2": "ffn_down"}
_OPT_RE = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
# multimodal wrappers keep the text model under another prefix
_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
             ("language_model.lm_head.", "lm_head."))


def supported_model_types() -> tuple[str, ...]:
    return (*_TYPE_ARCH, "opt")


class NameMap:
    """HF checkpoint names -> canonical names for one model type; `None` for tensors the decoder does not read
    (rotary buffers, vision towers)."""

    def __init__(self, model_type: str, n_layers: int):
        import gguf

        if model_type != "opt" and model_type not in _TYPE_ARCH:
            raise ValueError(f"model type {model_type!r} has no tensor name map: supported are "
                             f"{', '.join(supported_model_types())}")
        self.model_type = model_type
        self._map = None if model_type == "opt" else gguf.get_tensor_name_map(
            getattr(gguf.MODEL_ARCH, _TYPE_ARCH[model_type]), n_layers)

    def __call__(self, hf_name: str) -> str | None:
        for old, new in _PREFIXES:
            if hf_name.startswith(old):
                hf_name = new + hf_name[len(old):]
        if self._map is None:
            return _opt_name(hf_name)
        return self._map.get_name(hf_name, try_suffixes=(".weight", ".bias"))


def _opt_name(hf_name: str) -> str | None:
    base, dot, suffix = hf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    base = base.removeprefix("model.")  # OPTForCausalLM saves model.decoder.*, facebook/opt-* decoder.*
    if base in _OPT:
        return f"{_OPT[base]}.{suffix}"
    m = _OPT_RE.fullmatch(base)
    if m and m.group(2) in _OPT_LAYER:
        return f"blk.{m.group(1)}.{_OPT_LAYER[m.group(2)]}.{suffix}"
    return None


# ---------------------------------------------------------------------------------------------------------------
# Row orders: index arrays `idx` with hf_rows = gguf_rows[idx] (a gather, so it works on quantized rows too)


def unpermute_qk_rows(rows: int, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K rows (each head's rope pairs adjacent) -> HF's (each head's halves apart): the inverse of
    export/gguf_model.permute_qk, as transformers' LlamaTensorProcessor._reverse_permute_weights."""
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} Q/K rows are not {n_heads} heads of an even head dim: the GGUF's head counts do not "
                         f"fit its attention tensors")
    return np.arange(rows).reshape(n_heads, rows // n_heads // 2, 2).transpose(0, 2, 1).reshape(-1)


def falcon_qkv_rows(n_head: int, n_kv: int, head_dim: int) -> np.ndarray:
    """llama.cpp's Falcon QKV rows (all Q heads, all K, all V) -> HF's (n_kv groups of n_head/n_kv Q heads, one K,
    one V): the inverse of convert_hf_to_gguf.py's FalconModel regrouping."""
    per = n_head // n_kv
    q = np.arange(n_head * head_dim).reshape(n_kv, per, head_dim)
    k = n_head * head_dim + np.arange(n_kv * head_dim).reshape(n_kv, 1, head_dim)
    v = (n_head + n_kv) * head_dim + np.arange(n_kv * head_dim).reshape(n_kv, 1, head_dim)
    return np.concatenate((q, k, v), axis=1).reshape(-1)


# ---------------------------------------------------------------------------------------------------------------
# Activation <-> config


def config_activation(config: Any, activation: Activation, fat_threshold: float = 0.0) -> None:
    """Set the config's activation attribute so that common/models.py's adapter reads `activation` from it (the
    GGUF's config, which llama.cpp's keys leave at transformers' default)."""
    mt = getattr(config, "model_type", "")
    act = Activation(activation)
    if mt == "opt":
        config.activation_function = {Activation.RELU: "relu"}.get(act, "gelu")
    elif mt == "falcon":
        config.activation = {Activation.RELU: "relu"}.get(act, "gelu")
    elif act in (Activation.DRELU, Activation.FATRELU):  # common/sparse_act.py's markers
        config.hidden_act = act.value
        if act == Activation.FATRELU:
            config.fat_threshold = float(fat_threshold)
    else:
        names = {Activation.REGLU: "relu", Activation.SWIGLU: "silu", Activation.GEGLU: "gelu_pytorch_tanh"}
        if act not in names:
            raise ValueError(f"activation {act} does not fit a gated {mt} model: record one of "
                             f"{', '.join(a.value for a in (*names, Activation.DRELU, Activation.FATRELU))}")
        if act == Activation.GEGLU and hasattr(config, "hidden_activation"):  # Gemma reads this one first
            config.hidden_activation = names[act]
        config.hidden_act = names[act]
