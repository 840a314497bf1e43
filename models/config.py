"""`ModelConfig`: everything a model definition needs to know about an architecture, read once from a transformers
config. The model classes read only this, never the HF config, so a model loaded from GGUF (whose config the weight
source builds) and one loaded from safetensors run the same code."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from hotneurons.common import sparse_act
from hotneurons.common.kinds import Activation
from hotneurons.common.model_info import attention_heads
from hotneurons.common.model_source import text_config
from hotneurons.models.family import adapter_for


@dataclass(frozen=True)
class Rope:
    """Rotary position embedding: its base and frequency scaling (HF's `rope_parameters`)."""

    theta: float
    scaling: str = "none"  # none | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_positions: int = 8192  # llama3 only

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """(head_dim / 2,) float32 rotation frequencies, computed as transformers does (so the tables match)."""
        inv = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        if self.scaling == "linear":
            return inv / self.factor
        if self.scaling == "llama3":  # low frequencies / factor, high ones kept, a smooth blend between
            low_wavelen = self.original_max_positions / self.low_freq_factor
            high_wavelen = self.original_max_positions / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = ((self.original_max_positions / wavelen - self.low_freq_factor)
                      / (self.high_freq_factor - self.low_freq_factor))
            blended = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            return torch.where(medium, blended, scaled)
        return inv


@dataclass(frozen=True)
class ModelConfig:
    """How to run a model: what our decoders compute with (norms, rope, fused projections, experts). Not the meta.json
    "model" section (common/model_info.ModelInfo), which records what a model is (shapes, parameter counts, identity)
    for the stages to check and price, and is also written for models no decoder here runs (transformers' path)."""

    family: str  # which model class runs it: llama (LLaMA, Mistral, Qwen2/3, Gemma 1/2/3), opt, falcon,
    #              moe (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE: LLaMA's attention, models/moe.py's FFN)
    model_type: str  # HF's model_type, for messages
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_ff: int  # FFN neurons per layer (a mixture of experts: per expert, n_ff_exp)
    vocab: int
    activation: Activation  # the FFN's kind (common/kinds.py)
    act_fn: str  # the elementwise function it applies: relu, silu, gelu (erf), gelu_tanh
    norm: str  # rms | rms_gemma (x * (1 + w), computed in float32) | layer
    norm_eps: float
    max_positions: int
    rope: Rope | None  # None: learned absolute positions (OPT)
    fat_threshold: float = 0.0  # FATReLU: gate counts where gate > threshold
    rope_local: Rope | None = None  # the sliding-window layers' rope where it differs (Gemma3)
    windows: tuple[int, ...] = ()  # per layer: sliding attention window in tokens, 0 = full attention
    tied_embeddings: bool = False  # no output.weight: the head is token_embd
    attn_bias: bool = False  # q, k, v biases
    out_bias: bool = False  # attention output bias
    ffn_bias: bool = False
    qk_norm: bool = False  # per-head RMS norms of q and k before rope (Qwen3, Gemma3)
    qk_norm_whole: bool = False  # OLMoE: those norms span the whole projection (H * hd, K * hd), not one head
    clip_qkv: float = 0.0  # OLMoE: q, k, v clamped to [-clip, clip] after the norms; 0: none
    post_norms: bool = False  # Gemma2/3: a norm on the attention's and the FFN's output before each residual add
    attn_scale: float = 0.0  # softmax scale of q.k (Gemma2/3: query_pre_attn_scalar ** -0.5); 0: head_dim ** -0.5
    attn_softcap: float = 0.0  # Gemma2: scores = cap * tanh(scores / cap); 0: none
    final_softcap: float = 0.0  # Gemma2: the same on the logits
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(d_model)
    # OPT
    pre_norm: bool = True  # False: layer norms after each residual add (OPT-350m)
    final_norm: bool = True  # OPT checkpoints from before transformers 4.20 have none
    d_embed: int = 0  # word embedding width where it differs from d_model (project_in / project_out); 0: d_model
    # Falcon
    qkv: str = "separate"  # separate | fused_mq (H q heads, 1 k, 1 v) | fused_grouped (per kv head: G q, k, v)
    #                        | fused_heads (per head: q, k, v)
    parallel_attn: bool = False  # the FFN reads the layer's input, not the residual after attention
    parallel_norms: int = 1  # parallel blocks: 1 norm shared by attention and FFN, or 2 (ln_attn, ln_mlp)
    # Mixture of experts (models/moe.py): per token a router picks n_experts_used of n_experts gated FFNs
    n_experts: int = 0  # 0: a dense FFN
    n_experts_used: int = 0  # top-k
    norm_topk: bool = False  # the top-k softmax probabilities renormalised to sum 1 (Mixtral always; else the config)
    n_ff_exp: int = 0  # neurons per expert
    n_ff_shexp: int = 0  # Qwen2-MoE: neurons of the shared expert every token also runs, sigmoid-gated; 0: none

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim ** -0.5

    @property
    def gated(self) -> bool:
        return self.activation not in (Activation.RELU, Activation.GELU)

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    def window(self, i: int) -> int:
        return self.windows[i] if self.windows else 0

    @classmethod
    def from_hf(cls, config: Any, activation: str | None = None) -> ModelConfig:
        """From a transformers config (a multimodal one's text part). `activation` overrides the config's (dReLU
        models, whose config says relu)."""
        config = text_config(config)
        adapter = adapter_for(config, experts=True)
        act = adapter.activation(config, activation)
        raw = next((str(getattr(config, k)) for k in adapter.act_config_keys if getattr(config, k, None)), "")
        d, H = config.hidden_size, config.num_attention_heads
        common = dict(
            family=adapter.name, model_type=config.model_type, n_layers=config.num_hidden_layers, d_model=d,
            n_heads=H, vocab=config.vocab_size, activation=act, act_fn=_act_fn(act, raw.lower()),
            fat_threshold=sparse_act.config_activation(config)[1], max_positions=config.max_position_embeddings,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)))
        if adapter.name == "opt":
            return cls(**common, **_opt(config))
        if adapter.name == "falcon":
            return cls(**common, **_falcon(config))
        if adapter.experts:
            return cls(**common, **{**_llama(config, gemma=False), **_moe(config)})
        return cls(**common, **_llama(config, gemma=adapter.name == "gemma"))


def _act_fn(act: Activation, raw: str) -> str:
    if act in (Activation.RELU, Activation.REGLU, Activation.DRELU, Activation.FATRELU):
        return "relu"
    if act is Activation.SWIGLU or raw in ("silu", "swish"):
        return "silu"
    if raw == "gelu":
        return "gelu"
    if raw in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return "gelu_tanh"
    raise ValueError(f"activation function '{raw}' is not supported: the model definitions compute relu, silu, "
                     f"gelu and gelu_pytorch_tanh")


def _rope(params: dict[str, Any] | None, head_dim: int, model_type: str) -> Rope:
    """A Rope from one HF rope_parameters dict (transformers 5) or rope_scaling + rope_theta (4)."""
    p = dict(params or {})
    kind = p.get("rope_type", p.get("type", "default"))
    if p.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{model_type}: partial rotary embeddings (partial_rotary_factor "
                         f"{p['partial_rotary_factor']}) are not supported: use a model that rotates whole heads")
    theta = float(p.get("rope_theta", 10000.0))
    if kind == "default":
        return Rope(theta)
    if kind == "linear":
        return Rope(theta, "linear", float(p["factor"]))
    if kind == "llama3":
        return Rope(theta, "llama3", float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"]),
                    int(p["original_max_position_embeddings"]))
    raise ValueError(f"{model_type}: rope scaling '{kind}' is not supported: the model definitions read none, linear "
                     f"and llama3 (set rope_scaling to one of those, or to null for the model's trained context)")


def _rope_params(config: Any) -> dict[str, Any]:
    """HF's rope_parameters, or the same built from a transformers-4 config's rope_theta and rope_scaling."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return params
    return {"rope_theta": getattr(config, "rope_theta", 10000.0), **(getattr(config, "rope_scaling", None) or {})}


def _windows(config: Any) -> tuple[int, ...]:
    """Per layer window: layer_types where the config has them (Qwen2/3, Gemma2/3), else Mistral's one window for
    every layer."""
    n, window = config.num_hidden_layers, int(getattr(config, "sliding_window", None) or 0)
    types = getattr(config, "layer_types", None)
    if types:
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"{config.model_type}: attention layer type {unknown[0]} is not supported: the model "
                             f"definitions run full_attention and sliding_attention")
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    if config.model_type in ("mistral", "mixtral", "qwen3_moe"):  # Qwen3-MoE: sliding_window is None unless used
        return (window,) * n
    return (0,) * n


def _llama(config: Any, gemma: bool) -> dict[str, Any]:
    """LLaMA, Mistral, Qwen2/3 and Gemma 1/2/3: one definition with a few switches."""
    mt = config.model_type
    _, n_kv, head_dim = attention_heads(config)
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{mt}: bidirectional attention (use_bidirectional_attention) is not a decoder: set it false")
    params = _rope_params(config)
    nested = "full_attention" in params or "sliding_attention" in params  # Gemma3: one rope per layer type
    if nested:
        rope = _rope(params.get("full_attention"), head_dim, mt)
        rope_local = _rope(params.get("sliding_attention"), head_dim, mt)
    else:
        rope = _rope(params, head_dim, mt)
        local = getattr(config, "rope_local_base_freq", None)  # Gemma3 under transformers 4
        rope_local = Rope(float(local)) if local else None
    bias = bool(getattr(config, "attention_bias", False))
    gemma23 = mt in ("gemma2", "gemma3", "gemma3_text")
    scalar = getattr(config, "query_pre_attn_scalar", None)
    return dict(
        n_kv_heads=n_kv, head_dim=head_dim,
        n_ff=config.intermediate_size, norm="rms_gemma" if gemma else "rms", norm_eps=config.rms_norm_eps,
        rope=rope, rope_local=rope_local, windows=_windows(config),
        attn_bias=bias or mt == "qwen2" or (mt == "qwen2_moe" and bool(getattr(config, "qkv_bias", True))),
        out_bias=bias, ffn_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=mt in ("qwen3", "qwen3_moe", "olmoe", "gemma3", "gemma3_text"), qk_norm_whole=mt == "olmoe",
        clip_qkv=float(getattr(config, "clip_qkv", None) or 0.0), post_norms=gemma23,
        attn_scale=float(scalar) ** -0.5 if gemma23 and scalar else 0.0,
        attn_softcap=float(getattr(config, "attn_logit_softcapping", None) or 0.0),
        final_softcap=float(getattr(config, "final_logit_softcapping", None) or 0.0),
        embed_scale=config.hidden_size ** 0.5 if gemma else 1.0)


def _moe(config: Any) -> dict[str, Any]:
    """The experts of Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE (their attention is _llama's). Every layer must be a
    mixture: Qwen's dense layers (mlp_only_layers, decoder_sparse_step) have no tensors in llama.cpp's qwen2moe and
    qwen3moe archs, whose names we use, and no public checkpoint has them."""
    mt, L = config.model_type, config.num_hidden_layers
    n = int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0)
    step = int(getattr(config, "decoder_sparse_step", None) or 1)
    dense = sorted(set(getattr(config, "mlp_only_layers", None) or []) | {i for i in range(L) if (i + 1) % step})
    if n == 0 or dense:
        raise ValueError(f"{mt}: dense FFN layers ({'all' if n == 0 else dense}: num_experts {n}, mlp_only_layers, "
                         f"decoder_sparse_step {step}) are not supported: every layer must be a mixture of experts")
    n_ff_exp = int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)
    return dict(
        n_ff=n_ff_exp, n_experts=n, n_experts_used=int(config.num_experts_per_tok), n_ff_exp=n_ff_exp,
        norm_topk=mt == "mixtral" or bool(getattr(config, "norm_topk_prob", False)),
        n_ff_shexp=int(getattr(config, "shared_expert_intermediate_size", None) or 0))


def _opt(config: Any) -> dict[str, Any]:
    if not getattr(config, "layer_norm_elementwise_affine", True):
        raise ValueError("opt: layer norms without weights (layer_norm_elementwise_affine false) are not supported")
    d, H = config.hidden_size, config.num_attention_heads
    bias = bool(getattr(config, "enable_bias", True))
    return dict(
        n_kv_heads=H, head_dim=d // H, n_ff=config.ffn_dim, norm="layer", norm_eps=1e-5, rope=None,
        attn_bias=bias, out_bias=bias, ffn_bias=bias, pre_norm=bool(config.do_layer_norm_before),
        final_norm=bool(config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False)),
        d_embed=config.word_embed_proj_dim if config.word_embed_proj_dim != d else 0)


def _falcon(config: Any) -> dict[str, Any]:
    if config.alibi:
        raise ValueError("falcon: ALiBi position biases (alibi true, Falcon-RW) are not supported: use a Falcon with "
                         "rotary embeddings")
    d, H = config.hidden_size, config.num_attention_heads
    new = bool(config.new_decoder_architecture)
    qkv = "fused_grouped" if new else "fused_mq" if config.multi_query else "fused_heads"
    n_kv = attention_heads(config)[1]
    bias = bool(config.bias)
    return dict(
        n_kv_heads=n_kv, head_dim=d // H, n_ff=config.ffn_hidden_size or 4 * d, norm="layer",
        norm_eps=config.layer_norm_epsilon, rope=_rope(_rope_params(config), d // H, "falcon"),
        attn_bias=bias, out_bias=bias, ffn_bias=bias, qkv=qkv, parallel_attn=new or bool(config.parallel_attn),
        parallel_norms=2 if new and (config.num_ln_in_parallel_attn or 2) == 2 else 1)
