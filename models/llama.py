"""LLaMA and its kin: Mistral, Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms), Gemma 1/2/3 (norms of 1 + w,
scaled embeddings; 2/3: norms after attention and FFN, sliding-window layers, softcaps; 3: q/k norms and a local rope
on the sliding layers), and the attention of the mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE; OLMoE: q/k norms
over the whole projection and an optional clamp of q, k, v), whose FFN is models/moe.py's. One definition, switched by
ModelConfig.

A layer: h2 = h + attn(attn_norm(h)); x = ffn_norm(h2); h_next = h2 + ffn(x). Gemma2/3 norm the attention's output
(post_attention_norm) and the FFN's (post_ffw_norm) before adding them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from hotneurons.kernels import qlinear
from hotneurons.models.common import (
    Decoder,
    Loader,
    Norm,
    Weight,
    WeightFn,
    _linear,
    apply_rope,
    embed_rows,
    linear,
    load_embedding,
    load_head,
    load_norm,
    rope_tables,
)
from hotneurons.models.config import ModelConfig
from hotneurons.weights.names import layer_name


@dataclass(frozen=True)
class _Layer:
    attn_norm: Norm
    wqkv: Weight | list[Weight]  # ((H + 2K) * hd, d): q, k, v stacked
    bqkv: torch.Tensor | None
    wo: Weight  # (d, H * hd)
    bo: torch.Tensor | None
    ffn_norm: Norm
    q_norm: Norm | None = None  # (hd,) Qwen3, Gemma3; (H * hd,) OLMoE, k_norm (K * hd,)
    k_norm: Norm | None = None
    post_attn_norm: Norm | None = None  # Gemma2/3
    post_ffw_norm: Norm | None = None


class Llama(Decoder):
    def __init__(self, cfg: ModelConfig, weights: WeightFn, device: torch.device | str, dtype: torch.dtype, ctx: int,
                 release: Callable[[str], None] | None = None, layers: bool = True):
        super().__init__(cfg, device, dtype, ctx, kv_layers=None if layers else 1)
        load = Loader(weights, device, dtype, release)
        self.tok_embd = load_embedding(load, cfg)  # (vocab, d)
        self.layers = self._load_layers(load, layers)
        self.norm = load_norm(load, cfg, "output_norm")
        self.output = load_head(load, cfg, self.tok_embd)  # (vocab, d)
        self.cos, self.sin = rope_tables(cfg.rope, cfg.head_dim, ctx, self.device, dtype)  # (ctx, hd) each
        self.cos_local, self.sin_local = (rope_tables(cfg.rope_local, cfg.head_dim, ctx, self.device, dtype)
                                          if cfg.rope_local else (self.cos, self.sin))
        # Gemma: rounded to the weights' dtype first, as transformers does (sqrt(3072) = 55.4256 is 55.5 in bf16)
        self.embed_scale = torch.tensor(cfg.embed_scale, dtype=dtype, device=self.device)
        # a decode step's tables in the fused form (step_begin writes them each step)
        heads = cfg.n_heads + cfg.n_kv_heads
        self._head_scale = torch.ones((1, heads, 1, 1), device=self.device)  # (1, H + K, 1, 1) float32
        self._head_scale[:, :cfg.n_heads] = cfg.scale
        self._step_cos = torch.zeros((1, heads, 1, cfg.head_dim), device=self.device, dtype=dtype)  # (1, H + K, 1, hd)
        self._step_sin = torch.zeros_like(self._step_cos)  # the same of sin, its first half negated
        self._step_mask = torch.zeros((1, 1, 1, ctx), device=self.device, dtype=dtype)  # (1, 1, 1, ctx) 0 or -inf

    def _load_layer(self, load: Loader, i: int) -> _Layer:
        cfg, p = self.cfg, layer_name(i)
        attn_norm = load_norm(load, cfg, p + "attn_norm")
        wqkv, bqkv = load.fused([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], cfg.attn_bias)
        q_norm = load_norm(load, cfg, p + "attn_q_norm") if cfg.qk_norm else None
        k_norm = load_norm(load, cfg, p + "attn_k_norm") if cfg.qk_norm else None
        wo = load.matrix(p + "attn_output.weight")
        bo = load.tensor(p + "attn_output.bias") if cfg.out_bias else None
        post_attn = load_norm(load, cfg, p + "post_attention_norm") if cfg.post_norms else None
        ffn_norm = load_norm(load, cfg, p + "ffn_norm")
        post_ffw = load_norm(load, cfg, p + "post_ffw_norm") if cfg.post_norms else None
        return _Layer(attn_norm, wqkv, bqkv, wo, bo, ffn_norm, q_norm, k_norm, post_attn, post_ffw)

    def embed(self, tokens: torch.Tensor, pos0: int | torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        h = embed_rows(self.tok_embd, tokens, self.dtype) if rows is None else rows  # (T, d)
        return h * self.embed_scale if self.cfg.embed_scale != 1.0 else h

    def attention(self, i: int, h: torch.Tensor, pos0: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, layer = self.cfg, self.layers[i]
        T, H, K, hd = h.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        pos = self.positions(T, pos0)  # (T,)
        qkv = linear(layer.attn_norm(h), layer.wqkv, layer.bqkv)  # (T, (H + 2K) * hd)
        q, k, v = qkv.split([H * hd, K * hd, K * hd], dim=-1)
        if cfg.qk_norm_whole:  # OLMoE: over all heads at once
            q, k = layer.q_norm(q), layer.k_norm(k)
        if cfg.clip_qkv:
            q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        q, k, v = q.view(T, H, hd), k.view(T, K, hd), v.view(T, K, hd)
        if layer.q_norm is not None and not cfg.qk_norm_whole:  # per head, before rope
            q, k = layer.q_norm(q), layer.k_norm(k)
        cos, sin = (self.cos_local, self.sin_local) if cfg.window(i) else (self.cos, self.sin)
        cos, sin = cos[pos], sin[pos]  # (T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        a = _linear(self.cached_attention(i, q, k, v, pos, pos0), layer.wo, layer.bo)  # (T, d)
        if layer.post_attn_norm is not None:
            a = layer.post_attn_norm(a)
        h2 = h + a
        return h2, layer.ffn_norm(h2)

    # -- a decode token's layer in the fused form (runtime/source_steps.py's graphs) ------------------------------
    def step_supported(self) -> str | None:
        cfg = self.cfg
        if cfg.norm != "rms":
            return f"{cfg.norm} norms"
        if cfg.post_norms or cfg.clip_qkv or cfg.attn_softcap:
            return "norms after attention, clamped q/k/v or an attention softcap"
        if any(0 < cfg.window(i) < self.ctx for i in range(cfg.n_layers)):
            return "sliding-window layers"
        return None if not self.lazy else "a lazy model"

    def step_begin(self, pos: torch.Tensor) -> None:
        """The step's rotary rows per head (the q heads' times the attention scale, so that the scores need no
        scaling) and its additive mask of the filled slots, which every layer's step reads; pos (1,) on the device."""
        hd = self.cfg.head_dim
        cos, sin = self.cos[pos], self.sin[pos]  # (1, hd) each
        sin_signed = torch.cat((-sin[:, :hd // 2], sin[:, hd // 2:]), -1)  # rotate_half's signs, as ops._rope
        self._step_cos.copy_(cos[:, None, None] * self._head_scale)
        self._step_sin.copy_(sin_signed[:, None, None] * self._head_scale)
        self._step_mask.copy_(torch.where(self.slots <= pos, 0.0, float("-inf")))

    def step_layer(self, i: int, prev: torch.Tensor | tuple, pos: torch.Tensor, ops, h2: torch.Tensor,
                   x: torch.Tensor, filled: int | None = None) -> None:
        """One decode token through layer i up to its FFN's input, through `ops` (kernels/ops.Ops: the torch ops or
        their fused Triton twins), after step_begin. prev: the layer's input, the embedding (1, d) for layer 0, else
        layer i-1's (h2, FFN device sum (1, d), the CPU's float32 cold sum (d,) or None), added here. Writes h2 (1, d),
        the residual after attention, and x (1, d), the FFN's input. filled: eager steps attend over the first
        `filled` slots; graphs (None) over the whole cache, the slots past pos masked (or skipped by fused kernels)."""
        cfg, layer = self.cfg, self.layers[i]
        H, K, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        an = layer.attn_norm
        if isinstance(prev, tuple):  # h2 = the layer's input, until the output projection adds into it
            r = ops.residual_norm(*prev, an.weight, an.eps, h2)
        else:
            r = ops.weighted_rms(h2.copy_(prev), an.weight, an.eps)
        qkv = linear(r, layer.wqkv, layer.bqkv).view(1, H + 2 * K, 1, hd)  # one GEMV for q, k, v
        qk, v = qkv[:, :H + K], qkv[:, H + K:]  # (1, H + K, 1, hd), (1, K, 1, hd)
        if layer.q_norm is not None:  # per head (Qwen3), or over all heads (OLMoE: the norm's weight is H * hd wide)
            normed = torch.empty_like(qk)
            for part, norm, out in ((qk[:, :H], layer.q_norm, normed[:, :H]), (qk[:, H:], layer.k_norm, normed[:, H:])):
                n = norm.weight.numel()
                ops.weighted_rms(part.reshape(-1, n), norm.weight, norm.eps, out.view(-1, n))
            qk = normed
        c = i % len(self.k_cache)
        k_cache, v_cache = self.k_cache[c][None], self.v_cache[c][None]  # (1, K, ctx, hd) each
        q = ops.rope_cache(qk, v, self._step_cos, self._step_sin, k_cache, v_cache, pos)  # (1, H, 1, hd) scaled
        qg = q.reshape(1, K, H // K, hd)  # a kv head's query heads together (grouped-query, no repeated cache)
        if filled is None:
            o = ops.attend(qg, k_cache, v_cache, self._step_mask, pos)  # (1, K, G, hd)
        else:
            o = ops.attend(qg, k_cache[:, :, :filled], v_cache[:, :, :filled], None, pos)
        qlinear.add_linear(h2, o.reshape(1, H * hd), layer.wo, layer.bo)  # h2 += o W_o.T (+ b)
        fn = layer.ffn_norm
        ops.weighted_rms(h2, fn.weight, fn.eps, x)

    def after_ffn(self, i: int, h2: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        norm = self.layers[i].post_ffw_norm
        return h2 + (norm(y) if norm is not None else y)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h, self.norm, self.output)
