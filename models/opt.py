"""OPT: learned absolute positions, layer norms with biases, biases everywhere, a ReLU FFN (fc1, fc2).

A layer (pre-norm, 125m and 1.3b and up): h2 = h + attn(attn_norm(h)); x = ffn_norm(h2); h_next = h2 + ffn(x).
Post-norm (350m): h2 = attn_norm(h + attn(h)); x = h2; h_next = ffn_norm(h2 + ffn(x)). 350m also embeds words in a
narrower width (project_in to d_model, project_out back before the head).
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
    embed_rows,
    linear,
    load_embedding,
    load_head,
    load_norm,
)
from hotneurons.models.config import ModelConfig
from hotneurons.weights.names import layer_name

POSITION_OFFSET = 2  # OPT's position table starts at row 2 (a fairseq leftover kept in HF's weights)


@dataclass(frozen=True)
class _Layer:
    attn_norm: Norm  # self_attn_layer_norm
    wqkv: Weight | list[Weight]  # (3 * d, d): q, k, v stacked
    bqkv: torch.Tensor | None
    wo: Weight  # (d, d)
    bo: torch.Tensor | None
    ffn_norm: Norm  # the layer's final_layer_norm


class OPT(Decoder):
    def __init__(self, cfg: ModelConfig, weights: WeightFn, device: torch.device | str, dtype: torch.dtype, ctx: int,
                 release: Callable[[str], None] | None = None, layers: bool = True):
        super().__init__(cfg, device, dtype, ctx, kv_layers=None if layers else 1)
        load = Loader(weights, device, dtype, release)
        self.tok_embd = load_embedding(load, cfg)  # (vocab, d_embed)
        self.pos_embd = load.tensor("position_embd.weight")  # (max positions + 2, d)
        self.project_in = load.matrix("project_in.weight") if cfg.d_embed else None  # (d, d_embed)
        self.layers = self._load_layers(load, layers)
        self.norm = load_norm(load, cfg, "output_norm") if cfg.final_norm else None
        self.project_out = load.matrix("project_out.weight") if cfg.d_embed else None  # (d_embed, d)
        self.output = load_head(load, cfg, self.tok_embd)  # (vocab, d_embed)

    def _load_layer(self, load: Loader, i: int) -> _Layer:
        cfg, p = self.cfg, layer_name(i)
        attn_norm = load_norm(load, cfg, p + "attn_norm")
        wqkv, bqkv = load.fused([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], cfg.attn_bias)
        wo = load.matrix(p + "attn_output.weight")
        bo = load.tensor(p + "attn_output.bias") if cfg.out_bias else None
        return _Layer(attn_norm, wqkv, bqkv, wo, bo, load_norm(load, cfg, p + "ffn_norm"))

    def embed(self, tokens: torch.Tensor, pos0: int | torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        pos = self.positions(tokens.shape[0], pos0)  # (T,)
        h = embed_rows(self.tok_embd, tokens, self.dtype) if rows is None else rows  # (T, d_embed)
        if self.project_in is not None:
            h = _linear(h, self.project_in)  # (T, d)
        return h + self.pos_embd[pos + POSITION_OFFSET]

    def attention(self, i: int, h: torch.Tensor, pos0: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, layer = self.cfg, self.layers[i]
        T, H, hd = h.shape[0], cfg.n_heads, cfg.head_dim
        pos = self.positions(T, pos0)  # (T,)
        r = layer.attn_norm(h) if cfg.pre_norm else h
        q, k, v = linear(r, layer.wqkv, layer.bqkv).view(T, 3, H, hd).unbind(1)  # (T, H, hd) each
        # q scaled before the product, as OPT does: the scores of the big models overflow fp16 otherwise
        a = _linear(self.cached_attention(i, q * cfg.scale, k, v, pos, pos0, scale=1.0), layer.wo, layer.bo)
        if not cfg.pre_norm:  # post-norm: the FFN reads the normed residual itself
            h2 = layer.attn_norm(h + a)
            return h2, h2
        h2 = h + a
        return h2, layer.ffn_norm(h2)

    def after_ffn(self, i: int, h2: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return h2 + y if self.cfg.pre_norm else self.layers[i].ffn_norm(h2 + y)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            h = self.norm(h)
        if self.project_out is not None:
            h = _linear(h, self.project_out)  # (T, d_embed)
        return self.head(h, None, self.output)
