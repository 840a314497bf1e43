"""Falcon: one fused query_key_value projection, rotary positions, layer norms, an ungated FFN.

Parallel blocks (7B, 40B, 180B): attention and FFN both read the layer input, h_next = h + attn(.) + ffn(.). The old
architecture (7B) has one norm for both and multi-query attention; the new one (40B, 180B) norms the two apart
(ln_attn = attn_norm_2, ln_mlp = attn_norm, as llama.cpp names them) and has grouped kv heads. Sequential blocks
(parallel_attn false): h2 = h + attn(attn_norm(h)); x = ffn_norm(h2) (post_attention_layernorm).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from hotneurons.models.common import (
    Decoder,
    Loader,
    Norm,
    Weight,
    WeightFn,
    _linear,
    apply_rope,
    embed_rows,
    load_embedding,
    load_head,
    load_norm,
    rope_tables,
)
from hotneurons.models.config import ModelConfig
from hotneurons.weights.names import layer_name


@dataclass(frozen=True)
class _Layer:
    attn_norm: Norm  # input_layernorm, or ln_mlp where there are two
    attn_norm_2: Norm | None  # ln_attn (new architecture)
    ffn_norm: Norm | None  # post_attention_layernorm (sequential blocks)
    wqkv: Weight  # (rows, d) in HF's fused layout (ModelConfig.qkv)
    bqkv: torch.Tensor | None
    wo: Weight  # (d, d)
    bo: torch.Tensor | None


class Falcon(Decoder):
    def __init__(self, cfg: ModelConfig, weights: WeightFn, device: torch.device | str, dtype: torch.dtype, ctx: int,
                 release: Callable[[str], None] | None = None, layers: bool = True):
        super().__init__(cfg, device, dtype, ctx, kv_layers=None if layers else 1)
        load = Loader(weights, device, dtype, release)
        self.tok_embd = load_embedding(load, cfg)  # (vocab, d)
        self.layers = self._load_layers(load, layers)
        self.norm = load_norm(load, cfg, "output_norm")
        self.output = load_head(load, cfg, self.tok_embd)  # (vocab, d)
        self.cos, self.sin = rope_tables(cfg.rope, cfg.head_dim, ctx, self.device, dtype)  # (ctx, hd) each

    def _load_layer(self, load: Loader, i: int) -> _Layer:
        cfg, p = self.cfg, layer_name(i)
        return _Layer(
            attn_norm=load_norm(load, cfg, p + "attn_norm"),
            attn_norm_2=load_norm(load, cfg, p + "attn_norm_2") if cfg.parallel_norms == 2 else None,
            ffn_norm=None if cfg.parallel_attn else load_norm(load, cfg, p + "ffn_norm"),
            wqkv=load.matrix(p + "attn_qkv.weight"),
            bqkv=load.tensor(p + "attn_qkv.bias") if cfg.attn_bias else None,
            wo=load.matrix(p + "attn_output.weight"),
            bo=load.tensor(p + "attn_output.bias") if cfg.out_bias else None)

    def _split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (T, H, hd), k, v (T, K, hd) from the fused projection's output, by HF's layout of its rows."""
        cfg = self.cfg
        T, H, K, hd = qkv.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        if cfg.qkv == "fused_grouped":  # per kv head: its G query heads, then its key, then its value
            g = qkv.view(T, K, H // K + 2, hd)
            return g[:, :, :-2].reshape(T, H, hd), g[:, :, -2], g[:, :, -1]
        if cfg.qkv == "fused_mq":  # all query heads, one key, one value
            g = qkv.view(T, H + 2, hd)
            return g[:, :H], g[:, H:H + 1], g[:, H + 1:]
        g = qkv.view(T, H, 3, hd)  # fused_heads: per head q, k, v
        return g[:, :, 0], g[:, :, 1], g[:, :, 2]

    def embed(self, tokens: torch.Tensor, pos0: int | torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        return embed_rows(self.tok_embd, tokens, self.dtype) if rows is None else rows  # (T, d)

    def attention(self, i: int, h: torch.Tensor, pos0: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[i]
        pos = self.positions(h.shape[0], pos0)  # (T,)
        r = (layer.attn_norm_2 if layer.attn_norm_2 is not None else layer.attn_norm)(h)
        q, k, v = self._split(_linear(r, layer.wqkv, layer.bqkv))
        cos, sin = self.cos[pos], self.sin[pos]  # (T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        h2 = h + _linear(self.cached_attention(i, q, k, v, pos, pos0), layer.wo, layer.bo)  # (T, d)
        if layer.ffn_norm is not None:  # sequential block
            return h2, layer.ffn_norm(h2)
        # parallel: the FFN reads the layer input h (its own norm where there are two)
        return h2, layer.attn_norm(h) if layer.attn_norm_2 is not None else r

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h, self.norm, self.output)
