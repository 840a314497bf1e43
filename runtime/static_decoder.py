"""`StaticDecoder`: batch-1 decode steps of LLaMA-family models (LLaMA, Mistral, Qwen2, Qwen3) as CUDA graphs.

Through HF, a decode step is dozens of small kernel launches per decoder layer (norms, projections, RoPE, cache,
attention), and in hybrid mode the CPU kernel cannot start before they are launched. Here each layer's GPU work is
replayed from graphs over static buffers and a static KV cache:

  pre[i]:  h = previous layer's h2 + hot + cold sums (layer 0: the token's embedding, an untied one's row looked up
           on the host and copied in; and the step's rotary cos/sin and attention mask, which every layer shares);
           attention with the cache; h2[i] = h + attn; x[i] = post-attention norm; the predictor (on x[i], or on
           h2[i] for the powerinfer form); x and the cold mask written to the host; a signal the CPU waits for
  hot[i]:  the hot FFN rows of x[i]
  CPU:     one Numba call (HybridFFN.cold_rows -> kernels.cold_layer): the active cold rows' per-thread partial sums
           into a pinned host buffer
  final:   h = last h2 + hot + cold; norm; lm_head -> logits

pre[i] and hot[i] are one graph with an event recorded between them (torch.cuda.Event(external=True)); torch versions
without external events get two graphs per layer. pre[i+1]'s first kernel reads layer i's partial sums over PCIe and
adds them up (HybridFFN.cold_sum), no copy node.

Prelaunch: launching a layer's graph costs the CPU time (bench/NOTES.md). So that it is not spent between a layer's
cold part and the next layer's GPU work, the graph of layer i+1 is launched before the CPU computes layer i's cold
rows, and its first node waits on the GPU for a flag in pinned host memory (cuda.HostFlags) that the CPU sets once the
cold sum is written. Each graph also sets a ready flag after `pre`, which the CPU's Numba call spins on instead of a
CUDA event wait. Where the driver lacks the stream memory operations (or RuntimeConfig.prelaunch is off), each graph
is launched after the previous cold part. The same functions run eagerly without CUDA (tests check them there against
HF). The prompt is prefilled through HF (dense) and its keys/values copied into the static cache.
"""

from __future__ import annotations

import gc
import time
import warnings
from dataclasses import dataclass
from functools import partial

import torch
from hotneurons.runtime.cuda import HostFlags, capture
from hotneurons.runtime.hybrid_ffn import HybridFFN
from hotneurons.runtime.offload import OnCPUEmbedding
from hotneurons.runtime.ops import Ops, rms_eps, rms_norm
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


@dataclass(frozen=True)
class _LayerGraphs:
    graphs: tuple[torch.cuda.CUDAGraph, ...]  # (pre and hot,), or (pre, hot) where torch has no external events
    done: torch.cuda.Event  # after pre: x and the cold mask are on the host


@dataclass(frozen=True)
class _Graphs:
    layers: list[_LayerGraphs]
    final: torch.cuda.CUDAGraph
    logits: torch.Tensor  # (vocab,) the final graph's static output


class StaticDecoder:
    def __init__(self, lm, ffns: list[HybridFFN], device: torch.device, dtype: torch.dtype, graphs: bool,
                 capacity: int = CAPACITY, ops: str = "torch", prelaunch: bool = True):
        self.lm, self.ffns, self.device, self.dtype = lm, ffns, device, dtype
        self.layers = list(lm.layers)
        self.inner = lm.model.model
        cfg = lm.model.config
        a0 = self.layers[0].self_attn
        self.n_kv = cfg.num_key_value_heads
        self.n_heads, self.head_dim = cfg.num_attention_heads, a0.head_dim
        self.capacity = static_capacity(cfg, capacity)
        self.graphs = graphs and device.type == "cuda"
        self.ops_name = ops if self.graphs else "torch"  # eager steps read only the filled slots already
        self.ops = Ops.named(self.ops_name)
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
        self._graphs: _Graphs | None = None
        self.allow_prelaunch = prelaunch  # RuntimeConfig.prelaunch
        self.flags: HostFlags | None = None  # opened at the first capture that may prelaunch
        self.prelaunch: bool | None = None  # whether the captured graphs prelaunch (None: none captured yet)
        self._filled: int | None = None  # eager steps: cache slots in use (None while capturing graphs)
        # set to [] to record each graph step's host timeline (_record); the PCIe share's balancing does
        self.timing: list[dict] | None = None
        for f in ffns:
            f.host_io(device)  # host buffers, made before any capture

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

    def _hot(self, i: int) -> None:
        self.hot_sum[i].copy_(self.ffns[i].device_part(self.x[i]))

    def _final(self) -> torch.Tensor:
        head = self.lm.model.lm_head
        r = self._residual_normed(len(self.layers), self.inner.norm, self.h_last)
        return self.ops.linear(r, head.weight, head.bias)[0, -1]  # (vocab,)

    # -- graphs --------------------------------------------------------------------------------------------------
    def _capture(self) -> _Graphs:
        """Per layer one graph of pre, the event's record and hot; or (pre, hot) with an event recorded between their
        launches where torch has no external events. Then the final graph. Prelaunched, the graph of layer i > 0 and
        the final one first wait for flag i - 1 (layer i - 1's cold sum written), and each signals after pre."""
        # prelaunch holds the stream while the CPU computes a cold part, so that part must not use the GPU: the
        # oracle mask (a correctness check) counts hot activations there
        if self.allow_prelaunch and all(f.mask != "oracle" for f in self.ffns):
            # all 0 after a whole step (each graph resets the flag it waited for), so a new capture reuses them
            self.flags = self.flags or HostFlags.open(len(self.layers), self.device)
        self.prelaunch = prelaunch = self.allow_prelaunch and self.flags is not None
        L = len(self.layers)
        try:  # events recorded inside a graph that the host waits for: pre and hot in one graph
            done, external = [torch.cuda.Event(external=True) for _ in self.layers], True
        except TypeError:  # torch without them: recorded between two graphs' launches
            done, external = [torch.cuda.Event() for _ in self.layers], False

        def wait_for_flag(i: int) -> None:  # the first node of layer i's graph (i == L: the final one)
            if prelaunch and i > 0:
                self.flags.wait(i - 1)  # layer i - 1's cold sum is written

        def pre(i: int) -> None:
            wait_for_flag(i)
            self.pre(i)
            if prelaunch:
                self.flags.signal(i)  # x and the cold mask are on the host

        def layer(i: int) -> None:  # pre and hot in one graph, the host's event recorded between them
            pre(i)
            done[i].record()
            self._hot(i)

        def final() -> torch.Tensor:
            wait_for_flag(L)
            return self._final()

        pieces = []
        for i in range(L):
            pieces += [partial(layer, i)] if external else [partial(pre, i), partial(self._hot, i)]
        pieces.append(final)

        def step() -> None:  # the warm-up: no flags, which nothing would release
            for i in range(L):
                self.pre(i)
                self._hot(i)
            self._final()

        keep = [*(f.fired for f in self.ffns), *self.k, *self.v]  # the warm-up and capture wrote nothing that counts
        try:
            graphs, outputs = capture(self.device, pieces, keep, warm=step)
        except Exception as e:  # noqa: BLE001 - torch.compile and Triton need a C compiler; plain ops then
            if self.ops_name == "torch":
                raise
            warnings.warn(f"{self.ops_name} ops failed ({type(e).__name__}: {e}); the static decoder runs the torch "
                          f"ops", stacklevel=2)
            self.ops_name, self.ops = "torch", Ops()
            graphs, outputs = capture(self.device, pieces, keep, warm=step)
        per = 1 if external else 2
        layers = [_LayerGraphs(tuple(graphs[per * i:per * i + per]), done[i]) for i in range(L)]
        return _Graphs(layers, graphs[-1], outputs[-1])

    def reset_graphs(self) -> None:
        """Drop the captured graphs (e.g. after an FFN's mapped_rows changed): the next step captures them again.
        Waits for the device first, so no graph (this decoder's or an FFN's own) is running when dropped."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._graphs = None

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
        if self.emb_row is None:
            self.tok.fill_(token)
        else:  # free to overwrite: each step waits for every layer's `pre`, so layer 0's copy of it is done
            self.tok_cpu.fill_(token)
            self.emb_row.copy_(self.emb_cpu.inner(self.tok_cpu))
        self.pos.fill_(position)
        if self.graphs and self._graphs is None:
            self._graphs = self._capture()
        if self._graphs is None:  # eager: the same pieces
            self._filled = position + 1
            for i, f in enumerate(self.ffns):
                self.pre(i)
                self._hot(i)
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
                f.cold_rows(self.x[i])
            return self._final()
        return self._replay()

    def _launch(self, i: int) -> None:
        """Layer i's graph(s) (i == L: the final graph)."""
        if i == len(self.layers):
            self._graphs.final.replay()
            return
        g = self._graphs.layers[i]
        g.graphs[0].replay()
        if len(g.graphs) == 2:  # no external events: record between the two launches
            g.done.record()
            g.graphs[1].replay()  # the GPU computes the hot rows while the CPU computes the cold ones

    def wait_pre(self, i: int) -> None:
        """Wait on the host until layer i's `pre` has run (x and the cold mask are on the host)."""
        self._graphs.layers[i].done.synchronize()

    def replay_alone(self, i: int) -> None:
        """Layer i's graph(s) on their own (i == L: the final graph), e.g. to time them: the flag it waits for is
        released first, so no earlier launch of them may still be pending (it would take the release). Its ready
        signal stays set until the next step clears it."""
        if self.prelaunch and i > 0:
            self.flags.release(i - 1)
        self._launch(i)

    def _replay(self) -> torch.Tensor:
        """One step from the graphs. Prelaunched: layer i+1's graph is launched before the wait for layer i's (while the
        GPU runs layer i) and starts when the CPU releases flag i after the cold part; else each graph is launched
        when the previous cold part is done."""
        clock = [time.perf_counter()] if self.timing is not None else None
        tick = (lambda: clock.append(time.perf_counter())) if clock is not None else _no_tick
        L, prelaunch = len(self.layers), self.prelaunch
        released = launched = -1  # the last flag released; the last flag a launched graph waits for
        flags = self.flags if prelaunch else None
        if prelaunch:  # signals of graphs replayed alone (replay_alone), which no cold part consumed
            flags.ready[:] = 0
        # no garbage collection while a launched graph waits on the GPU for a host flag: a collection can run the
        # finalizer that unregisters another runtime's page-locked rows (cold_rows.host_mapped), and
        # cudaHostUnregister waits for the device, which waits for this thread's flag: a deadlock
        collecting = gc.isenabled()
        gc.disable()
        try:
            for i, f in enumerate(self.ffns):
                if i == 0 or not prelaunch:
                    self._launch(i)
                if prelaunch:
                    self._launch(i + 1)
                    launched = i
                tick()
                if clock is not None or not prelaunch:  # prelaunched: cold_rows waits for the graph's signal
                    self.wait_pre(i)
                tick()
                f.cold_rows(self.x[i], flags, i)  # prelaunched: waits for ready[i], then releases flag i
                released = i if prelaunch else released
                tick()
        finally:  # an error in a cold part: let the launched graphs run out, so that the stream does not hang
            for j in range(released + 1, launched + 1):
                self.flags.release(j)
            if launched > released:  # and clear their ready signals, which no cold part will consume
                torch.cuda.synchronize(self.device)
                self.flags.ready[:] = 0
            if collecting:
                gc.enable()
        if not prelaunch:
            self._launch(L)
        if clock is not None:
            self._record(clock)
        return self._graphs.logits

    def _record(self, clock: list[float]) -> None:
        """One step's host timeline, in ms: per layer, the wait for `pre` (its GPU time, behind the previous layer's
        `hot` on the stream), split into the CPU time spent launching graphs before the sync (prelaunched: the next
        layer's, while the GPU runs this one; else this layer's) and the sync; the CPU cold part; the final graph's
        launch (not prelaunched) and GPU time after a sync."""
        torch.cuda.synchronize(self.device)
        end = time.perf_counter()
        ms = [1e3 * (b - a) for a, b in zip(clock, clock[1:])]
        launch, sync, cold = ms[0::3], ms[1::3], ms[2::3]
        self.timing.append({"wait_pre_ms": [a + b for a, b in zip(launch, sync)], "launch_ms": launch,
                            "cold_ms": cold, "final_ms": 1e3 * (end - clock[-1]), "step_ms": 1e3 * (end - clock[0])})


def _no_tick() -> None:
    """The step's clock when no timeline is recorded."""
