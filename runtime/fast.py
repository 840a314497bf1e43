"""`StaticDecoder`: batch-1 decode steps of LLaMA-family models (LLaMA, Mistral, Qwen2, Qwen3) as CUDA graphs.

Through HF, a decode step is ~40 small kernel launches per decoder layer (norms, projections, RoPE, cache, attention),
~1 ms of CPU per layer, and in hybrid mode the CPU kernel cannot start before they are launched. Here each layer's
GPU work is two graphs over static buffers and a static KV cache:

  pre[i]:  h = previous layer's h2 + hot + cold sums (layer 0: the token's embedding); attention with the cache;
           h2[i] = h + attn; x[i] = post-attention norm; the predictor; x and the cold mask copied to the host;
           an event the CPU waits for
  hot[i]:  the hot FFN rows of x[i]
  CPU:     the Numba kernel over the active cold rows (HybridFFN.cold_rows), writing a pinned host buffer
  final:   h = last h2 + hot + cold; norm; lm_head -> logits

pre[i] and hot[i] are one graph with the event recorded between them (an external event: torch.cuda.Event(
external=True)), so a step is L+1 graph launches, L waits for the event and L kernel calls; torch versions without
external events get two graphs per layer. Launches are CPU time between a layer's predecessor's cold part and its
own GPU work: 0.06 ms a layer for one graph, 0.105 for two, on the H100 machine (bench/NOTES.md). The cold partial sum of layer i is copied
to the device as the first node of pre[i+1]. The same functions run eagerly without CUDA (tests check them there
against HF). The prompt is prefilled through HF (dense) and its keys/values copied into the static cache.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from powerinfer.runtime.layout import HybridFFN, warm_up

CAPACITY = 4096  # static KV cache length (tokens); longer generations fall back to HF's decode


def supported(lm, ffns: list[HybridFFN]) -> str | None:
    """None if `lm` can decode through StaticDecoder, else why not."""
    cfg = lm.model.config
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


def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    """Attention of a few queries over the cache as two batched matmuls and a float32 softmax. For one decode token
    this beats SDPA's fused kernels, which on CUDA split the work only over batch x heads (8 blocks for 8 kv heads) and
    took 0.17 ms per layer on a 4096-slot cache on the H100 (bench/NOTES.md).
    q (1, kv, G, hd); keys, values (1, kv, slots, hd); mask (1, 1, 1, slots) bool or None -> (1, kv, G, hd)."""
    s = torch.matmul(q * scale, keys.transpose(-1, -2)).float()  # (1, kv, G, slots)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1).to(values.dtype), values)


class StaticDecoder:
    def __init__(self, lm, ffns: list[HybridFFN], device: torch.device, dtype: torch.dtype, graphs: bool,
                 capacity: int = CAPACITY):
        self.lm, self.ffns, self.device, self.dtype = lm, ffns, device, dtype
        self.layers = list(lm.layers)
        self.inner = lm.model.model
        cfg = lm.model.config
        a0 = self.layers[0].self_attn
        self.n_kv = cfg.num_key_value_heads
        self.n_heads, self.head_dim = cfg.num_attention_heads, a0.head_dim
        self.capacity = min(capacity, int(getattr(cfg, "max_position_embeddings", capacity) or capacity))
        window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        if window:  # positions below the window see every earlier token: full attention is exact there
            self.capacity = min(self.capacity, int(window))
        self.graphs = graphs and device.type == "cuda"
        kv = (1, self.n_kv, self.capacity, self.head_dim)
        self.k = [torch.zeros(kv, device=device, dtype=dtype) for _ in self.layers]  # (1, kv heads, cap, hd)
        self.v = [torch.zeros(kv, device=device, dtype=dtype) for _ in self.layers]
        d = cfg.hidden_size
        self.tok = torch.zeros((1, 1), dtype=torch.long, device=device)  # (1, 1) token id
        self.pos = torch.zeros((1, 1), dtype=torch.long, device=device)  # (1, 1) its position
        self.slots = torch.arange(self.capacity, device=device)  # (cap,) cache positions
        self.h2 = [torch.zeros((1, 1, d), device=device, dtype=dtype) for _ in self.layers]  # after attention
        self.x = [torch.zeros((1, d), device=device, dtype=dtype) for _ in self.layers]  # FFN inputs
        self.hot = [torch.zeros((1, d), device=device, dtype=dtype) for _ in self.layers]  # hot FFN sums
        self.logits: torch.Tensor | None = None
        self._graphs: list[Any] | None = None
        self._filled: int | None = None  # eager steps: cache slots in use (None while capturing graphs)
        self.timing: list[dict] | None = None  # set to [] to record each graph step's per-layer host times
        for f in ffns:
            f._host_io(self.x[0])  # host buffers, made before any capture

    # -- the step's pieces (captured as graphs on CUDA) --------------------------------------------------------
    def _residual(self, i: int) -> torch.Tensor:
        """Layer i's input: layer i-1's h2 + its FFN output (hot + cold); layer 0: the token's embedding."""
        if i == 0:
            return self.inner.embed_tokens(self.tok)  # (1, 1, d)
        f = self.ffns[i - 1]
        y = self.hot[i - 1]
        if f.n_cold:
            y = y + f._io["out"].to(self.device, non_blocking=True).to(self.dtype)
        return self.h2[i - 1] + y[None]

    def _pre(self, i: int) -> None:
        layer, attn = self.layers[i], self.layers[i].self_attn
        h = self._residual(i)  # (1, 1, d)
        r = layer.input_layernorm(h)
        q = attn.q_proj(r).view(1, 1, -1, self.head_dim).transpose(1, 2)  # (1, heads, 1, hd)
        k = attn.k_proj(r).view(1, 1, -1, self.head_dim).transpose(1, 2)  # (1, kv heads, 1, hd)
        v = attn.v_proj(r).view(1, 1, -1, self.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head norms before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = self.inner.rotary_emb(r, self.pos)  # (1, 1, hd) each
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        self.k[i].index_copy_(2, self.pos[0], k)
        self.v[i].index_copy_(2, self.pos[0], v)
        # grouped-query attention without repeating the cache: query head kv*G+g attends to kv head kv, so the G
        # query heads of one kv head go in the query-length dimension
        qg = q.reshape(1, self.n_kv, -1, self.head_dim)  # (1, kv heads, G, hd)
        if self._filled is None:  # graphs: static shapes, so the whole cache with a mask of the filled slots
            mask = (self.slots <= self.pos[0])[None, None, None]  # (1, 1, 1, cap)
            keys, values = self.k[i], self.v[i]
        else:  # eager: only the filled slots (on a CPU, reading the whole cache would cost more than the rest)
            mask, keys, values = None, self.k[i][:, :, :self._filled], self.v[i][:, :, :self._filled]
        o = _attend(qg, keys, values, mask, attn.scaling)  # (1, kv heads, G, hd)
        o = attn.o_proj(o.reshape(1, 1, self.n_heads * self.head_dim))
        self.h2[i].copy_(h + o)
        self.x[i].copy_(layer.post_attention_layernorm(self.h2[i])[0])
        self.ffns[i]._to_host(self.x[i])

    def _hot(self, i: int) -> None:
        self.hot[i].copy_(self.ffns[i]._hot(self.x[i]))

    def _final(self) -> torch.Tensor:
        h = self._residual(len(self.layers))
        return self.lm.model.lm_head(self.inner.norm(h))[0, -1]  # (vocab,)

    # -- graphs --------------------------------------------------------------------------------------------------
    def _capture(self) -> list[Any]:
        """Per layer (graphs, event): one graph of pre, the event's record and hot; or (pre, hot) and an event
        recorded between their launches where torch has no external events. Then the final graph."""
        fired = [f._fired.clone() for f in self.ffns]
        k, v = [t.clone() for t in self.k], [t.clone() for t in self.v]

        def step() -> None:
            for i in range(len(self.layers)):
                self._pre(i)
                self._hot(i)
            self._final()

        warm_up(self.device, step)
        try:  # an event recorded inside a graph, waited for by the host
            torch.cuda.Event(external=True)
            external = True
        except TypeError:
            external = False
        graphs, pool = [], None
        for i in range(len(self.layers)):
            if external:
                g, done = torch.cuda.CUDAGraph(), torch.cuda.Event(external=True)
                with torch.cuda.graph(g, pool=pool):
                    self._pre(i)
                    done.record()
                    self._hot(i)
                pool = g.pool()
                graphs.append(((g,), done))
                continue
            pre, hot = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(pre, pool=pool):
                self._pre(i)
            pool = pre.pool()
            with torch.cuda.graph(hot, pool=pool):
                self._hot(i)
            graphs.append(((pre, hot), torch.cuda.Event()))
        final = torch.cuda.CUDAGraph()
        with torch.cuda.graph(final, pool=pool):
            self.logits = self._final()
        graphs.append(final)
        for f, c in zip(self.ffns, fired):  # the warm-up and capture wrote nothing that counts
            f._fired.copy_(c)
        for t, c in zip((*self.k, *self.v), (*k, *v)):
            t.copy_(c)
        return graphs

    # -- use ---------------------------------------------------------------------------------------------------
    def load_prefill(self, cache, n: int) -> None:
        """Copy the keys/values of a prefill of n tokens (an HF cache) into the static cache."""
        for i in range(len(self.layers)):
            lay = cache.layers[i] if hasattr(cache, "layers") else None
            keys, values = (lay.keys, lay.values) if lay is not None else (cache.key_cache[i], cache.value_cache[i])
            self.k[i][:, :, :n].copy_(keys[:, :, :n])
            self.v[i][:, :, :n].copy_(values[:, :, :n])

    @torch.inference_mode()
    def step(self, token: int, position: int) -> torch.Tensor:
        """Logits (vocab,) after `token` at `position` (all earlier positions in the cache)."""
        if position >= self.capacity:
            raise ValueError(f"position {position} is past the static cache ({self.capacity} tokens)")
        self.tok.fill_(token)
        self.pos.fill_(position)
        if self.graphs and self._graphs is None:
            self._graphs = self._capture()
        if self._graphs is None:  # eager: the same pieces
            self._filled = position + 1
            for i, f in enumerate(self.ffns):
                self._pre(i)
                self._hot(i)
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
                f.cold_rows(self.x[i])
            return self._final()
        clock = [time.perf_counter()] if self.timing is not None else None
        for i, f in enumerate(self.ffns):
            gs, done = self._graphs[i]
            gs[0].replay()
            if len(gs) == 2:  # no external events: record between the two launches
                done.record()
                gs[1].replay()  # the GPU computes the hot rows while the CPU computes the cold ones
            if clock is not None:
                clock.append(time.perf_counter())
            done.synchronize()
            if clock is not None:
                clock.append(time.perf_counter())
            f.cold_rows(self.x[i])
            if clock is not None:
                clock.append(time.perf_counter())
        self._graphs[-1].replay()
        if clock is not None:
            self._record(clock)
        return self.logits

    def _record(self, clock: list[float]) -> None:
        """One step's host timeline, in ms: per layer, the wait for `pre` (its launch and GPU time, behind the previous
        layer's `hot` on the stream), split into the two graph launches and the sync after them, and the CPU cold
        part; the final graph's GPU time after a sync."""
        torch.cuda.synchronize(self.device)
        end = time.perf_counter()
        ms = [1e3 * (b - a) for a, b in zip(clock, clock[1:])]
        launch, sync, cold = ms[0::3], ms[1::3], ms[2::3]
        self.timing.append({"wait_pre_ms": [a + b for a, b in zip(launch, sync)], "launch_ms": launch,
                            "cold_ms": cold, "final_ms": 1e3 * (end - clock[-1]), "step_ms": 1e3 * (end - clock[0])})


def build(lm, ffns: list[HybridFFN], device: torch.device, dtype: torch.dtype, graphs: bool) -> StaticDecoder | None:
    return None if supported(lm, ffns) is not None else StaticDecoder(lm, ffns, device, dtype, graphs)

