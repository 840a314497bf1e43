"""`StaticDecoder`: batch-1 decode steps of a transformers LLaMA-family model (LLaMA, Mistral, Qwen2, Qwen3) as CUDA
graphs (runtime/graph_steps.py runs them; this is the model's part of each step).

Through HF, a decode step is dozens of small kernel launches per decoder layer (norms, projections, RoPE, cache,
attention), and in hybrid mode the CPU kernel cannot start before they are launched. Here each layer's GPU work reads
static buffers and a static KV cache:

  pre[i]:  h = previous layer's h2 + hot + cold sums (layer 0: the token's embedding, an untied one's row looked up
           on the host and copied in; and the step's rotary cos/sin and attention mask, which every layer shares);
           attention with the cache; h2[i] = h + attn; x[i] = post-attention norm; the predictor (on x[i], or on
           h2[i] for the powerinfer form); x and the cold mask written to the host
  final:   h = last h2 + hot + cold; norm; lm_head -> logits

The same functions run eagerly without CUDA (tests check them there against HF). The prompt is prefilled through HF
(dense) and its keys/values copied into the static cache.
"""

from __future__ import annotations

import torch
from hotneurons.kernels.ops import rms_eps, rms_norm
from hotneurons.runtime.graph_steps import GraphSteps
from hotneurons.runtime.hybrid_ffn import HybridFFN
from hotneurons.runtime.offload import OnCPUEmbedding
from torch import nn

CAPACITY = 4096  # static KV cache length (tokens); longer generations fall back to HF's decode


def supported(lm, ffns: list[HybridFFN]) -> str | None:
    """None if `lm` can decode through StaticDecoder, else why not."""
    if lm.adapter.name != "llama":
        return f"family {lm.adapter.name}"
    if len(ffns) != len(lm.layers) or any(layer.mlp is not f for layer, f in zip(lm.layers, ffns)):
        return "a layer without a hybrid FFN (layer-split)"
    for layer in lm.layers:
        a = layer.self_attn
        if not all(hasattr(a, k) for k in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")):
            return "an attention module of another shape"
    inner = lm.model.model
    if not all(hasattr(inner, k) for k in ("embed_tokens", "rotary_emb", "norm")):
        return "a model body of another shape"
    return None


def static_capacity(model_config, requested: int) -> int:
    """Tokens the static KV cache holds: `requested`, at most the model's context; positions below a sliding window
    see every earlier token, so full attention is exact there and the cache stops at the window."""
    cap = min(requested, int(getattr(model_config, "max_position_embeddings", requested) or requested))
    window = (getattr(model_config, "sliding_window", None) if getattr(model_config, "use_sliding_window", True)
              else None)
    return min(cap, int(window)) if window else cap


def cache_bytes(lm, capacity: int, dtype: torch.dtype) -> int:
    """Bytes of the static KV cache StaticDecoder allocates for `capacity` requested tokens."""
    cfg = lm.model.config
    slots = static_capacity(cfg, capacity)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * len(lm.layers) * cfg.num_key_value_heads * slots * lm.layers[0].self_attn.head_dim * itemsize


def _fuse_qkv(attn) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight ((heads + 2 kv heads) * hd, d) for q, k and v, so that one GEMV reads them: the three Linear
    modules are re-pointed at row slices of it (same bytes, not a copy kept beside them). Biases likewise."""
    lins = (attn.q_proj, attn.k_proj, attn.v_proj)
    w = torch.cat([m.weight.detach() for m in lins])
    b = None
    if any(m.bias is not None for m in lins):
        b = torch.cat([m.bias.detach() if m.bias is not None else w.new_zeros(m.out_features) for m in lins])
    start = 0
    for m in lins:
        rows = slice(start, start + m.out_features)
        m.weight = torch.nn.Parameter(w[rows], requires_grad=False)
        if m.bias is not None:
            m.bias = torch.nn.Parameter(b[rows], requires_grad=False)
        start += m.out_features
    return w, b


class StaticDecoder(GraphSteps):
    def __init__(self, lm, ffns: list[HybridFFN], device: torch.device, dtype: torch.dtype, graphs: bool,
                 capacity: int = CAPACITY, ops: str = "torch", prelaunch: bool = True):
        cfg = lm.model.config
        super().__init__(ffns, device, graphs, static_capacity(cfg, capacity), ops, prelaunch)
        self.lm, self.dtype = lm, dtype
        self.layers = list(lm.layers)
        self.inner = lm.model.model
        a0 = self.layers[0].self_attn
        self.n_kv = cfg.num_key_value_heads
        self.n_heads, self.head_dim = cfg.num_attention_heads, a0.head_dim
        kv = (1, self.n_kv, self.capacity, self.head_dim)
        self.k = [torch.zeros(kv, device=device, dtype=dtype) for _ in self.layers]  # (1, kv heads, cap, hd)
        self.v = [torch.zeros(kv, device=device, dtype=dtype) for _ in self.layers]
        d = cfg.hidden_size
        self.qkv = [_fuse_qkv(layer.self_attn) for layer in self.layers]  # ((heads + 2 kv) * hd, d), bias or None
        self.tok = torch.zeros((1, 1), dtype=torch.long, device=device)  # (1, 1) token id
        # an untied embedding in CPU RAM (offload.OnCPUEmbedding): the host looks the token's row up into a pinned
        # buffer, which layer 0's graph copies to the device
        self.emb_cpu = self.inner.embed_tokens if isinstance(self.inner.embed_tokens, OnCPUEmbedding) else None
        self.tok_cpu = torch.zeros((1, 1), dtype=torch.long)  # (1, 1) token id on the host
        self.emb_row = (torch.zeros((1, 1, d), dtype=dtype, pin_memory=device.type == "cuda")  # (1, 1, d) host
                        if self.emb_cpu is not None else None)
        self.pos = torch.zeros((1, 1), dtype=torch.long, device=device)  # (1, 1) its position
        self.slots = torch.arange(self.capacity, device=device)  # (cap,) cache positions
        # h2[i]: layer i's input (the residual), then, after the o_proj GEMM adds into it, its output after attention
        self.h2 = [torch.zeros((1, 1, d), device=device, dtype=dtype) for _ in self.layers]
        self.h_last = torch.zeros((1, 1, d), device=device, dtype=dtype)  # (1, 1, d) the final norm's input
        self.x = [torch.zeros((1, d), device=device, dtype=dtype) for _ in self.layers]  # (1, d) FFN inputs
        self.hot_sum = [torch.zeros((1, d), device=device, dtype=dtype) for _ in self.layers]  # (1, d) hot FFN sums
        # RoPE tables per head, q heads' rows times the attention scale (so the scores need no scaling kernel)
        heads = self.n_heads + self.n_kv
        self.head_scale = torch.ones((1, heads, 1, 1), device=device)  # (1, heads + kv heads, 1, 1) float32
        self.head_scale[:, :self.n_heads] = a0.scaling
        rot = (1, heads, 1, self.head_dim)
        self.cos = torch.zeros(rot, device=device, dtype=dtype)  # (1, heads + kv, 1, hd) the step's rotary cos
        self.sin_signed = torch.zeros(rot, device=device, dtype=dtype)  # the same of its sin, first half negated
        self.mask = torch.zeros((1, 1, 1, self.capacity), device=device, dtype=dtype)  # (1, 1, 1, cap) 0 or -inf

    # -- the step's pieces (captured as graphs on CUDA) --------------------------------------------------------
    def _residual(self, i: int, out: torch.Tensor) -> torch.Tensor:
        """Layer i's input into out (1, 1, d): layer i-1's h2 + its FFN output (hot + the CPU's cold sum, which the
        kernel reads from the host buffer itself); layer 0: the token's embedding."""
        if i == 0:
            if self.emb_row is not None:
                return out.copy_(self.emb_row, non_blocking=True)  # a host-to-device copy node in the graph
            return out.copy_(self.inner.embed_tokens(self.tok))
        f = self.ffns[i - 1]
        torch.add(self.h2[i - 1], self.hot_sum[i - 1], out=out)
        return out.add_(f.cold_sum()) if f.n_cold else out  # float32 sum, rounded into out once

    def _residual_normed(self, i: int, norm: nn.Module, out: torch.Tensor) -> torch.Tensor:
        """Layer i's input (i = layers: the final norm's) into out, and `norm` of it: the residual sum and a LLaMA-form
        norm in one op."""
        eps = rms_eps(norm)
        if i > 0 and eps is not None:
            f = self.ffns[i - 1]
            return self.ops.residual_norm(self.h2[i - 1], self.hot_sum[i - 1], f.cold_sum() if f.n_cold else None,
                                          norm.weight, eps, out)
        return rms_norm(norm, self._residual(i, out), weighted=self.ops.weighted_rms)

    def _position(self) -> None:
        """The step's rotary cos/sin (per head, q's scaled) and additive mask of filled cache slots, which all layers
        share (in layer 0's graph)."""
        cos, sin = self.inner.rotary_emb(self.cos, self.pos)  # (1, 1, hd) each
        half = self.head_dim // 2
        sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), -1)  # (1, 1, hd)
        self.cos.copy_(cos[:, None] * self.head_scale)
        self.sin_signed.copy_(sin_signed[:, None] * self.head_scale)
        self.mask.copy_(torch.where(self.slots <= self.pos[0], 0.0, float("-inf")))

    def pre(self, i: int) -> None:
        """Layer i's work before its FFN: attention, the FFN's input x[i], the predictor, x and the mask to the host."""
        layer, attn = self.layers[i], self.layers[i].self_attn
        H, K, hd = self.n_heads, self.n_kv, self.head_dim
        if i == 0:
            self._position()
        ops, h = self.ops, self.h2[i]  # h2[i]: the layer's input h until o_proj's GEMM adds into it
        r = self._residual_normed(i, layer.input_layernorm, h)
        w, b = self.qkv[i]
        qkv = ops.linear(r, w, b).view(1, H + 2 * K, 1, hd)  # one GEMV for q, k, v
        qk, v = qkv[:, :H + K], qkv[:, H + K:]  # (1, heads + kv heads, 1, hd), (1, kv heads, 1, hd)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head norms before RoPE
            qk = torch.cat((rms_norm(attn.q_norm, qk[:, :H], weighted=ops.weighted_rms),
                            rms_norm(attn.k_norm, qk[:, H:], weighted=ops.weighted_rms)), 1)
        q = ops.rope_cache(qk, v, self.cos, self.sin_signed, self.k[i], self.v[i], self.pos[0])  # q comes out scaled
        # grouped-query attention without repeating the cache: query head kv*G+g attends to kv head kv, so the G
        # query heads of one kv head go in the query-length dimension
        qg = q.reshape(1, self.n_kv, -1, self.head_dim)  # (1, kv heads, G, hd)
        if self._filled is None:  # graphs: static shapes, so the whole cache with a mask of the filled slots
            mask, keys, values = self.mask, self.k[i], self.v[i]
        else:  # eager: only the filled slots (on a CPU, reading the whole cache would cost more than the rest)
            mask, keys, values = None, self.k[i][:, :, :self._filled], self.v[i][:, :, :self._filled]
        o = ops.attend(qg, keys, values, mask, self.pos[0]).reshape(1, H * hd)  # (1, heads * hd)
        ops.add_linear(h, o, attn.o_proj.weight, attn.o_proj.bias)  # h2[i] = h + o_proj(o), into h's memory
        rms_norm(layer.post_attention_layernorm, self.h2[i], self.x[i].view(1, 1, -1), ops.weighted_rms)
        f = self.ffns[i]  # a powerinfer-form predictor reads h2[i], the norm's input
        f.to_host(self.x[i], ops.predict, self.h2[i].view(1, -1) if f.prenorm else None)

    def _final(self) -> torch.Tensor:
        head = self.lm.model.lm_head
        r = self._residual_normed(len(self.layers), self.inner.norm, self.h_last)
        return self.ops.linear(r, head.weight, head.bias)[0, -1]  # (vocab,)

    # -- use ---------------------------------------------------------------------------------------------------
    def set_input(self, token: int, position: int) -> None:
        if self.emb_row is None:
            self.tok.fill_(token)
        else:  # free to overwrite: each step waits for every layer's `pre`, so layer 0's copy of it is done
            self.tok_cpu.fill_(token)
            self.emb_row.copy_(self.emb_cpu.inner(self.tok_cpu))
        self.pos.fill_(position)

    def cache_tensors(self) -> list[torch.Tensor]:
        return [*self.k, *self.v]

    def load_prefill(self, n: int) -> None:
        """Copy the keys/values of a prefill of n tokens (the HF cache LoadedModel.prefill kept) into the static
        cache."""
        cache = self.lm.cache
        for i in range(len(self.layers)):
            lay = cache.layers[i] if hasattr(cache, "layers") else None
            keys, values = (lay.keys, lay.values) if lay is not None else (cache.key_cache[i], cache.value_cache[i])
            self.k[i][:, :, :n].copy_(keys[:, :, :n])
            self.v[i][:, :, :n].copy_(values[:, :, :n])
