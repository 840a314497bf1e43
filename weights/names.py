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
from collections.abc import Mapping
from dataclasses import dataclass
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
                       "falcon": Activation.GELU, "qwen2moe": Activation.SWIGLU, "qwen3moe": Activation.SWIGLU,
                       "olmoe": Activation.SWIGLU}

# GGUF arch -> transformers model_type (bamboo, PowerInfer's dReLU Mistral, is LLaMA-shaped; opt is PowerInfer's)
GGUF_MODEL_TYPE = {"llama": "llama", "bamboo": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma",
                   "gemma2": "gemma2", "gemma3": "gemma3_text", "falcon": "falcon", "opt": "opt",
                   "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "olmoe": "olmoe"}
# mixtures of experts: arch -> model_type where the file has {arch}.expert_count (Mixtral is a llama with experts)
GGUF_MOE_TYPE = {"llama": "mixtral", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "olmoe": "olmoe"}
# ... of which llama.cpp renormalises the top-k weights (its build_moe_ffn norm_w per arch), where no key says
GGUF_MOE_NORM_TOPK = frozenset({"llama", "qwen3moe"})
# llama.cpp's converter interleaves the rope halves of these archs' Q/K rows (PowerInfer's convert.py too)
GGUF_PERMUTED_QK = frozenset({"llama", "bamboo"})
# ... adds 1 to every `*norm.weight` of these (convert_hf_to_gguf.py, GemmaModel and its successors)
GGUF_NORM_SHIFT = frozenset({"gemma", "gemma2", "gemma3"})
# ... regroups Falcon's fused QKV rows as all Q, all K, all V ("jploski" layout)
GGUF_FALCON_QKV = frozenset({"falcon"})

_TYPE_ARCH = {"llama": "LLAMA", "mistral": "LLAMA", "mixtral_dense": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3",
              "gemma": "GEMMA", "gemma2": "GEMMA2", "gemma3": "GEMMA3", "gemma3_text": "GEMMA3", "falcon": "FALCON",
              # mixtures of experts (llama.cpp converts Mixtral as a llama with experts)
              "mixtral": "LLAMA", "qwen2_moe": "QWEN2MOE", "qwen3_moe": "QWEN3MOE", "olmoe": "OLMOE"}
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


# Experts: llama.cpp stores each projection's experts as one tensor, (E, out, in) in torch order (its converter
# stacks the per-expert ones): blk.N.ffn_{gate,up,down}_exps.weight, router blk.N.ffn_gate_inp.weight (E, d),
# Qwen2-MoE's shared expert blk.N.ffn_{gate,up,down}_shexp.weight and its gate blk.N.ffn_gate_inp_shexp.weight (1, d).
# HF files, what transformers 5's save_pretrained writes included, hold one tensor per expert
# (mlp.experts.3.gate_proj.weight, Mixtral's block_sparse_moe.experts.3.w1.weight: stacked in expert order);
# transformers 5's modules hold them stacked, gate and up fused (mlp.experts.gate_up_proj (E, 2 n, d): the gate's n
# rows, then the up's; mlp.experts.down_proj (E, d, n)).
_PER_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(.+)")
_GATE_UP = re.compile(r"(.+\.experts)\.gate_up_proj(?:\.weight)?")


@dataclass(frozen=True)
class Part:
    """Where an HF tensor goes: the whole canonical tensor `name`; or its expert `expert` (a per-expert tensor, dim 0
    of the stacked one); or its half `half` of dim 1 (0: gate, 1: up) of a fused (E, 2 n, d) gate_up_proj."""

    name: str
    expert: int | None = None
    half: int | None = None


def layer_name(i: int, tensor: str = "") -> str:
    """The canonical name of layer i's `tensor`: layer_name(3, "ffn_up.weight") is "blk.3.ffn_up.weight", gguf-py's
    TENSOR_NAMES pattern blk.{bid}.* (PowerInfer's fc1, fc2, ffn_down_t and gpu_idx likewise); with no tensor, the
    start every name of the layer's has ("blk.3.")."""
    return f"blk.{i}.{tensor}"


def supported_model_types() -> tuple[str, ...]:
    return (*_TYPE_ARCH, "opt")


class NameMap:
    """HF checkpoint names -> canonical names for one model type; `None` for tensors the decoder does not read
    (rotary buffers, vision towers). Experts' tensors map to parts of canonical ones: `parts`, `tensors`."""

    def __init__(self, model_type: str, n_layers: int):
        import gguf

        if model_type != "opt" and model_type not in _TYPE_ARCH:
            raise ValueError(f"model type {model_type!r} has no tensor name map: supported are "
                             f"{', '.join(supported_model_types())}")
        self.model_type = model_type
        self._map = None if model_type == "opt" else gguf.get_tensor_name_map(
            getattr(gguf.MODEL_ARCH, _TYPE_ARCH[model_type]), n_layers)

    def __call__(self, hf_name: str) -> str | None:
        """The canonical name of a tensor that maps whole; None for the rest, experts' parts included (`parts`)."""
        parts = self.parts(hf_name)
        return parts[0].name if len(parts) == 1 and parts[0] == Part(parts[0].name) else None

    def _name(self, hf_name: str) -> str | None:
        for old, new in _PREFIXES:
            if hf_name.startswith(old):
                hf_name = new + hf_name[len(old):]
        if self._map is None:
            return _opt_name(hf_name)
        name = self._map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        return name + ".weight" if name is not None and name.endswith("_exps") else name  # a stacked down_proj

    def parts(self, hf_name: str) -> list[Part]:
        """Where the HF tensor goes: [] for none, one Part, or two (a fused gate_up_proj: gate, up)."""
        m = _GATE_UP.fullmatch(hf_name)
        if m:
            names = [self._name(f"{m[1]}.{proj}.weight") for proj in ("gate_proj", "up_proj")]
            return [Part(n, half=h) for h, n in enumerate(names) if n is not None]
        m = _PER_EXPERT.fullmatch(hf_name)
        name = self._name(f"{m[1]}.{m[3]}" if m else hf_name)
        return [] if name is None else [Part(name, expert=int(m[2]) if m else None)]

    def tensors(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """HF tensors (a state dict) under canonical names: per-expert ones stacked (E, out, in) in expert order (a
        copy), a fused gate_up_proj split into two views; tensors with no canonical name left out."""
        import torch

        out, experts = {}, {}
        for hf_name, t in state.items():
            for part in self.parts(hf_name):
                if part.expert is not None:
                    experts.setdefault(part.name, {})[part.expert] = t
                elif part.half is not None:
                    out[part.name] = t.chunk(2, dim=1)[part.half]  # (E, n, d)
                else:
                    out[part.name] = t
        for name, per in experts.items():
            out[name] = torch.stack([per[e] for e in expert_order(name, per)])
        return out


def expert_order(name: str, per: Mapping[int, Any]) -> range:
    """0..E-1, the experts a stacked tensor's parts must cover."""
    if sorted(per) != list(range(len(per))):
        missing = sorted(set(range(max(per) + 1)) - set(per))
        raise ValueError(f"{name}: the file has no tensor of expert {missing[0]} of {max(per) + 1}: re-save the model "
                         f"whole")
    return range(len(per))


def gguf_expert_config(arch: str, key: Any, need: Any) -> dict[str, Any]:
    """The HF config fields of a GGUF mixture of experts from its `{arch}.*` keys (key(k, default), need(k)):
    expert counts; the per-expert size (expert_feed_forward_length, else feed_forward_length: Mixtral, OLMoE);
    top-k renormalisation (expert_weights_norm, else llama.cpp's per arch); Qwen2-MoE's shared expert (0: none, not
    transformers' default); OLMoE's clip_qkv (attention.clamp_kqv)."""
    out = {"num_local_experts" if arch == "llama" else "num_experts": need("expert_count"),
           "num_experts_per_tok": need("expert_used_count")}
    if arch == "llama":
        return out  # Mixtral always renormalises
    out["norm_topk_prob"] = bool(key("expert_weights_norm", arch in GGUF_MOE_NORM_TOPK))
    if key("expert_feed_forward_length") is not None:
        out["moe_intermediate_size"] = int(key("expert_feed_forward_length"))
    if arch == "qwen2moe":
        out["shared_expert_intermediate_size"] = int(key("expert_shared_feed_forward_length", 0))
    if arch == "olmoe" and key("attention.clamp_kqv") is not None:
        out["clip_qkv"] = float(key("attention.clamp_kqv"))
    return out


def _opt_name(hf_name: str) -> str | None:
    base, dot, suffix = hf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    base = base.removeprefix("model.")  # OPTForCausalLM saves model.decoder.*, facebook/opt-* decoder.*
    if base in _OPT:
        return f"{_OPT[base]}.{suffix}"
    m = _OPT_RE.fullmatch(base)
    if m and m.group(2) in _OPT_LAYER:
        return layer_name(int(m.group(1)), f"{_OPT_LAYER[m.group(2)]}.{suffix}")
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
    """Set the config's activation attribute so that models/family.py's adapter reads `activation` from it (the
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
