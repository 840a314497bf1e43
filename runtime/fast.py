"""`StaticDecoder`: batch-1 decode steps of LLaMA-family models (LLaMA, Mistral, Qwen2, Qwen3) as CUDA graphs.

Through HF, a decode step is ~40 small kernel launches per decoder layer (norms, projections, RoPE, cache, attention),
~1 ms of CPU per layer, and in hybrid mode the CPU kernel cannot start before they are launched. Here each layer's
GPU work is replayed from graphs over static buffers and a static KV cache:

  pre[i]:  h = previous layer's h2 + hot + cold sums (layer 0: the token's embedding, an untied one's row looked up
           on the host and copied in; and the step's rotary cos/sin and attention mask, which every layer shares);
           attention with the cache; h2[i] = h + attn; x[i] = post-attention norm; the predictor; x and the cold
           mask copied to the host; an event the CPU waits for
  hot[i]:  the hot FFN rows of x[i]
  CPU:     one Numba call (HybridFFN.cold_rows -> kernels.cold_layer): the active cold rows' per-thread partial sums
           into a pinned host buffer
  final:   h = last h2 + hot + cold; norm; lm_head -> logits

pre[i] and hot[i] are one graph with the event recorded between them (an external event: torch.cuda.Event(
external=True)); torch versions without external events get two graphs per layer. pre[i+1]'s first kernel reads layer
i's partial sums over PCIe and adds them up (HybridFFN.cold_sum), no copy node.

Launching a layer's graph costs the CPU 0.06-0.16 ms (bench/NOTES.md). So that it is not spent between a layer's
cold part and the next layer's GPU work, the graph of layer i+1 is launched before the CPU computes layer i's cold
rows, and its first node waits on the GPU for a flag in pinned host memory (`HostFlags`: the driver's stream memory
operations, cuStreamWaitValue32, captured into the graph) that the CPU sets once the cold sum is written. Where the
driver lacks them, each graph is launched after the previous cold part. With them, each layer's graph also sets a
ready flag after `pre` (cuStreamWriteValue32), which the CPU's Numba call spins on instead of a CUDA event wait. The
same functions run eagerly without CUDA (tests check them there against HF). The prompt is prefilled through HF (dense) and its keys/values copied into the
static cache.
"""

from __future__ import annotations

import ctypes
import gc
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from hotneurons.runtime.layout import HybridFFN, OnCPUEmbedding, predict, warm_up
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


class HostFlags:
    """Flags in pinned host memory, both ways between the CPU and captured graphs. `wait(i)`, recorded into a graph,
    holds the stream until flag i is 1 and then sets it back to 0; `release(i)` (the CPU) sets it to 1. `signal(i)`,
    recorded into a graph, sets ready[i] to 1 once the work before it is done and its writes are visible to the host
    (the driver's default memory barrier); the CPU spins on it (kernels.cold_layer) and resets it. Uses the driver's
    stream memory operations (cuStreamWaitValue32 / cuStreamWriteValue32) through ctypes. `open` returns None where
    they are missing or fail a probe (a captured wait released by the host, then a captured signal)."""

    EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ

    def __init__(self, n: int, lib: ctypes.CDLL):
        self.n = n
        self.flags = torch.zeros(n + 1, dtype=torch.int32, pin_memory=True)  # (n + 1,) the last one for the probe
        self.host = self.flags.numpy()
        self.ready_flags = torch.zeros(n + 1, dtype=torch.int32, pin_memory=True)  # (n + 1,) GPU -> CPU
        self.ready = self.ready_flags.numpy()
        self.dev, self.ready_dev = (self._device_pointer(lib, t) for t in (self.flags, self.ready_flags))
        self._wait = getattr(lib, "cuStreamWaitValue32_v2", None) or lib.cuStreamWaitValue32
        self._write = getattr(lib, "cuStreamWriteValue32_v2", None) or lib.cuStreamWriteValue32
        for fn in (self._wait, self._write):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int

    @staticmethod
    def _device_pointer(lib: ctypes.CDLL, t: torch.Tensor) -> int:
        """The pinned tensor's address as the GPU sees it."""
        ptr = ctypes.c_uint64()
        _check(lib.cuMemHostGetDevicePointer_v2(ctypes.byref(ptr), ctypes.c_void_p(t.data_ptr()), 0))
        return ptr.value

    @classmethod
    def open(cls, n: int, device: torch.device) -> HostFlags | None:
        try:
            flags = cls(n, ctypes.CDLL("libcuda.so.1"))
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                flags.wait(n)
                flags.signal(n)
            flags.release(n)
            g.replay()
            torch.cuda.synchronize(device)
            ok = flags.host[n] == 0 and flags.ready[n] == 1
            flags.ready[n] = 0
            return flags if ok else None
        except (OSError, AttributeError, RuntimeError):
            return None

    def _stream(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

    def wait(self, i: int) -> None:
        addr = ctypes.c_uint64(self.dev + 4 * i)
        _check(self._wait(self._stream(), addr, 1, self.EQ))
        _check(self._write(self._stream(), addr, 0, 0))

    def signal(self, i: int) -> None:
        _check(self._write(self._stream(), ctypes.c_uint64(self.ready_dev + 4 * i), 1, 0))

    def release(self, i: int) -> None:
        self.host[i] = 1


def _check(code: int) -> None:
    if code != 0:
        raise RuntimeError(f"CUDA driver error {code}")


def _rope(t: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """HF's `t * cos + rotate_half(t) * sin` in three kernels instead of six: rotate_half(t) = cat(-b, a) for
    t = cat(a, b), so rotate_half(t) * sin = roll(t) * sin_signed, sin_signed = cat(-sin[:half], sin[half:]) (exact:
    only signs move)."""
    return torch.addcmul(t * cos, t.roll(t.shape[-1] // 2, -1), sin_signed)


def _weighted_rms(h: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """LLaMA's RMSNorm, w * (h / rms(h) in float32, rounded to h's dtype), in two kernels: torch's fused rms_norm
    computes in float32 and rounds once, as HF's module does after its casts."""
    return torch.mul(w, F.rms_norm(h, (h.shape[-1],), eps=eps), out=out)


def _residual_norm(h2_prev: torch.Tensor, hot_prev: torch.Tensor, cold: torch.Tensor | None, w: torch.Tensor,
                   eps: float, out: torch.Tensor) -> torch.Tensor:
    """A layer's input into out: the previous layer's h2 + its hot sum (+ the CPU's float32 cold sum, read where it
    is); returns its RMSNorm (_weighted_rms)."""
    torch.add(h2_prev, hot_prev, out=out)
    if cold is not None:
        out.add_(cold)
    return _weighted_rms(out, w, eps)


def _rms_eps(norm) -> float | None:
    """The epsilon of a LLaMA-form RMSNorm module (weight * x / rms(x)); None for other norms."""
    return getattr(norm, "variance_epsilon", None) if type(norm).__name__ in RMS_NORMS else None


def _rms_norm(norm, h: torch.Tensor, out: torch.Tensor | None = None, weighted=_weighted_rms) -> torch.Tensor:
    """`norm`(h): LLaMA-form RMSNorms through _weighted_rms (or `weighted`, its compiled twin); others as they are."""
    eps = _rms_eps(norm)
    if eps is None:
        y = norm(h)
        return y if out is None else out.copy_(y)
    return weighted(h, norm.weight, eps, out)


RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")  # weight * x / rms(x), HF's form


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


def _rope_cache(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """One RoPE for the q and k heads, qk (1, heads + kv, 1, hd) (q comes out scaled where cos and sin are); k and
    v (1, kv, 1, hd) written into the caches (1, kv, slots, hd) at pos (1,); returns q (1, heads, 1, hd)."""
    H = qk.shape[1] - k_cache.shape[1]
    qk = _rope(qk, cos, sin_signed)
    k_cache.index_copy_(2, pos, qk[:, H:])
    v_cache.index_copy_(2, pos, v)
    return qk[:, :H]


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
            pos: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of a few queries over the cache as two batched matmuls and a softmax (float32 inside, rounded once,
    as HF's eager attention). For one decode token this beats SDPA's fused kernels, which on CUDA split the work only
    over batch x heads (8 blocks for 8 kv heads) and took 0.17 ms per layer on a 4096-slot cache on the H100
    (bench/NOTES.md). q (1, kv, G, hd), already scaled; keys, values (1, kv, slots, hd); mask (1, 1, 1, slots)
    additive (0 or -inf) or None -> (1, kv, G, hd). pos, the query's position, says what the mask says (the slots
    up to it are open); this op reads the mask, fused.attend reads pos."""
    s = torch.matmul(q, keys.transpose(-1, -2))  # (1, kv, G, slots)
    if mask is not None:
        s = s + mask
    return torch.matmul(torch.softmax(s, dim=-1), values)  # half/bf16 softmax: float32 inside, one rounding


def _add_linear(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """h += linear(x, w, b) for one token, into h's memory: without a bias one GEMM that adds into h (beta = 1)."""
    h2 = h.view(1, -1)  # (1, rows)
    if b is None:
        h2.addmm_(x.view(1, -1), w.t())
    else:
        h2.add_(F.linear(x.view(1, -1), w, b))


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


@dataclass(frozen=True)
class Ops:
    """The ops of a decode step's graphs, as functions of tensors, by name in OPS: "torch" (the reference, and what the
    CPU runs); "compile", the small ops through torch.compile, where Inductor fuses each into one or a few kernels
    (the GEMVs stay cuBLAS): 218 -> 181 us a layer's `pre` at the 70B shape on the H100 (bench/pre_compile.py);
    "triton", the hand-written kernels of runtime/fused.py, GEMVs included (one or two kernels each): 159 us."""

    residual_norm: Callable = _residual_norm
    weighted_rms: Callable = _weighted_rms
    rope_cache: Callable = _rope_cache
    attend: Callable = _attend
    predict: Callable = predict
    linear: Callable = F.linear
    add_linear: Callable = _add_linear

    @classmethod
    def named(cls, name: str) -> "Ops":
        if name == "torch":
            return cls()
        if name == "compile":
            return cls(*(torch.compile(f) for f in (_residual_norm, _weighted_rms, _rope_cache, _attend, predict)))
        if name == "triton":
            from hotneurons.runtime import fused

            return cls(fused.residual_norm, fused.weighted_rms, fused.rope_cache, fused.attend, fused.predict,
                       fused.linear, fused.add_linear)
        raise ValueError(f"unknown ops {name!r}: known are {', '.join(OPS)}")


OPS = ("torch", "compile", "triton")


def default_ops(device: torch.device) -> str:
    """"triton" on CUDA where Triton imports (it comes with torch's CUDA builds), else "torch"."""
    if device.type != "cuda":
        return "torch"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "torch"
    return "triton"


class StaticDecoder:
    def __init__(self, lm, ffns: list[HybridFFN], device: torch.device, dtype: torch.dtype, graphs: bool,
                 capacity: int = CAPACITY, ops: str = "torch"):
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
        # an untied embedding in CPU RAM (layout.OnCPUEmbedding): the host looks the token's row up into a pinned
        # buffer, which layer 0's graph copies to the device
        self.emb_cpu = self.inner.embed_tokens if isinstance(self.inner.embed_tokens, OnCPUEmbedding) else None
        self.tok_cpu = torch.zeros((1, 1), dtype=torch.long)  # (1, 1) token id on the host
        self.emb_row = (torch.zeros((1, 1, d), dtype=dtype, pin_memory=device.type == "cuda")  # (1, 1, d) host
                        if self.emb_cpu is not None else None)
        self.pos = torch.zeros((1, 1), dtype=torch.long, device=device)  # (1, 1) its position
        self.slots = torch.arange(self.capacity, device=device)  # (cap,) cache positions
        # h2[i]: layer i's input (the residual), then, after the o_proj GEMM adds into it, its output after attention
        self.h2 = [torch.zeros((1, 1, d), device=device, dtype=dtype) for _ in self.layers]
        self.h_last = torch.zeros((1, 1, d), device=device, dtype=dtype)  # the final norm's input
        self.x = [torch.zeros((1, d), device=device, dtype=dtype) for _ in self.layers]  # FFN inputs
        self.hot = [torch.zeros((1, d), device=device, dtype=dtype) for _ in self.layers]  # hot FFN sums
        # RoPE tables per head, q heads' rows times the attention scale (so the scores need no scaling kernel)
        heads = self.n_heads + self.n_kv
        self.head_scale = torch.ones((1, heads, 1, 1), device=device)  # (1, heads + kv heads, 1, 1) float32
        self.head_scale[:, :self.n_heads] = a0.scaling
        rot = (1, heads, 1, self.head_dim)
        self.cos = torch.zeros(rot, device=device, dtype=dtype)  # (1, heads + kv, 1, hd) the step's rotary cos
        self.sin_signed = torch.zeros(rot, device=device, dtype=dtype)  # the same of its sin, first half negated
        self.mask = torch.zeros((1, 1, 1, self.capacity), device=device, dtype=dtype)  # (1, 1, 1, cap) 0 or -inf
        self.logits: torch.Tensor | None = None
        self._graphs: list[Any] | None = None
        self.flags: HostFlags | None = None  # set at capture where the driver can gate graphs on host flags
        self.prelaunch: bool | None = None  # None: where the driver can; False: each graph after the previous cold part
        self._filled: int | None = None  # eager steps: cache slots in use (None while capturing graphs)
        self.timing: list[dict] | None = None  # set to [] to record each graph step's per-layer host times
        for f in ffns:
            f._host_io(self.x[0])  # host buffers, made before any capture

    # -- the step's pieces (captured as graphs on CUDA) --------------------------------------------------------
    def _residual(self, i: int, out: torch.Tensor) -> torch.Tensor:
        """Layer i's input into out (1, 1, d): layer i-1's h2 + its FFN output (hot + the CPU's cold sum, which the
        kernel reads from the host buffer itself); layer 0: the token's embedding."""
        if i == 0:
            if self.emb_row is not None:
                return out.copy_(self.emb_row, non_blocking=True)  # a host-to-device copy node in the graph
            return out.copy_(self.inner.embed_tokens(self.tok))
        f = self.ffns[i - 1]
        torch.add(self.h2[i - 1], self.hot[i - 1], out=out)
        return out.add_(f.cold_sum()) if f.n_cold else out  # float32 sum, rounded into out once

    def _residual_normed(self, i: int, norm: nn.Module, out: torch.Tensor) -> torch.Tensor:
        """Layer i's input (i = layers: the final norm's) into out, and `norm` of it: the residual sum and a LLaMA-form
        norm in one op."""
        eps = _rms_eps(norm)
        if i > 0 and eps is not None:
            f = self.ffns[i - 1]
            return self.ops.residual_norm(self.h2[i - 1], self.hot[i - 1], f.cold_sum() if f.n_cold else None,
                                          norm.weight, eps, out)
        return _rms_norm(norm, self._residual(i, out), weighted=self.ops.weighted_rms)

    def _position(self) -> None:
        """The step's rotary cos/sin (per head, q's scaled) and additive mask of filled cache slots, which all layers
        share (in layer 0's graph)."""
        cos, sin = self.inner.rotary_emb(self.cos, self.pos)  # (1, 1, hd) each
        half = self.head_dim // 2
        sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), -1)  # (1, 1, hd)
        self.cos.copy_(cos[:, None] * self.head_scale)
        self.sin_signed.copy_(sin_signed[:, None] * self.head_scale)
        self.mask.copy_(torch.where(self.slots <= self.pos[0], 0.0, float("-inf")))

    def _pre(self, i: int) -> None:
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
            qk = torch.cat((_rms_norm(attn.q_norm, qk[:, :H], weighted=ops.weighted_rms),
                            _rms_norm(attn.k_norm, qk[:, H:], weighted=ops.weighted_rms)), 1)
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
        _rms_norm(layer.post_attention_layernorm, self.h2[i], self.x[i].view(1, 1, -1), ops.weighted_rms)
        self.ffns[i]._to_host(self.x[i], ops.predict)

    def _hot(self, i: int) -> None:
        self.hot[i].copy_(self.ffns[i]._device_part(self.x[i]))

    def _final(self) -> torch.Tensor:
        head = self.lm.model.lm_head
        r = self._residual_normed(len(self.layers), self.inner.norm, self.h_last)
        return self.ops.linear(r, head.weight, head.bias)[0, -1]  # (vocab,)

    # -- graphs --------------------------------------------------------------------------------------------------
    def _capture(self) -> list[Any]:
        """Per layer (graphs, event): one graph of pre, the event's record and hot; or (pre, hot) and an event
        recorded between their launches where torch has no external events. Then the final graph. With host flags,
        the graph of layer i > 0 and the final one first wait for flag i - 1 (layer i - 1's cold sum written)."""
        fired = [f._fired.clone() for f in self.ffns]
        k, v = [t.clone() for t in self.k], [t.clone() for t in self.v]

        def step() -> None:
            for i in range(len(self.layers)):
                self._pre(i)
                self._hot(i)
            self._final()

        try:
            warm_up(self.device, step)
        except Exception as e:  # noqa: BLE001 - torch.compile and Triton need a C compiler; plain ops then
            if self.ops_name == "torch":
                raise
            warnings.warn(f"{self.ops_name} ops failed ({type(e).__name__}: {e}); the static decoder runs the torch "
                          f"ops", stacklevel=2)
            self.ops_name, self.ops = "torch", Ops()
            warm_up(self.device, step)
        try:  # an event recorded inside a graph, waited for by the host
            torch.cuda.Event(external=True)
            external = True
        except TypeError:
            external = False
        # prelaunch holds the stream while the CPU computes a cold part, so that part must not use the GPU: the
        # oracle mask (a correctness check) counts hot activations there
        if self.prelaunch is not False and all(f.mask != "oracle" for f in self.ffns):
            # all 0 after a whole step (each graph resets the flag it waited for), so a new capture reuses them
            self.flags = self.flags or HostFlags.open(len(self.layers), self.device)
        self.prelaunch = self.flags is not None

        def wait_for_flag(i: int) -> None:  # the first node of layer i's graph (i == L: the final one)
            if self.prelaunch and i > 0:
                self.flags.wait(i - 1)

        def signal(i: int) -> None:  # after layer i's pre: x and the cold mask are on the host
            if self.prelaunch:
                self.flags.signal(i)

        graphs, pool = [], None
        for i in range(len(self.layers)):
            if external:
                g, done = torch.cuda.CUDAGraph(), torch.cuda.Event(external=True)
                with torch.cuda.graph(g, pool=pool):
                    wait_for_flag(i)
                    self._pre(i)
                    signal(i)
                    done.record()
                    self._hot(i)
                pool = g.pool()
                graphs.append(((g,), done))
                continue
            pre, hot = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(pre, pool=pool):
                wait_for_flag(i)
                self._pre(i)
                signal(i)
            pool = pre.pool()
            with torch.cuda.graph(hot, pool=pool):
                self._hot(i)
            graphs.append(((pre, hot), torch.cuda.Event()))
        final = torch.cuda.CUDAGraph()
        with torch.cuda.graph(final, pool=pool):
            wait_for_flag(len(self.layers))
            self.logits = self._final()
        graphs.append(final)
        for f, c in zip(self.ffns, fired):  # the warm-up and capture wrote nothing that counts
            f._fired.copy_(c)
        for t, c in zip((*self.k, *self.v), (*k, *v)):
            t.copy_(c)
        return graphs

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
                self._pre(i)
                self._hot(i)
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
                f.cold_rows(self.x[i])
            return self._final()
        return self._replay()

    def _launch(self, i: int) -> None:
        """Layer i's graph(s) (i == L: the final graph)."""
        if i == len(self.layers):
            self._graphs[-1].replay()
            return
        gs, done = self._graphs[i]
        gs[0].replay()
        if len(gs) == 2:  # no external events: record between the two launches
            done.record()
            gs[1].replay()  # the GPU computes the hot rows while the CPU computes the cold ones

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
        L, prelaunch = len(self.layers), self.prelaunch
        released = launched = -1  # the last flag released; the last flag a launched graph waits for
        flags = self.flags if prelaunch else None
        if prelaunch:  # signals of graphs replayed alone (replay_alone), which no cold part consumed
            flags.ready[:] = 0
        # no garbage collection while a launched graph waits on the GPU for a host flag: a collection can run the
        # finalizer that unregisters another runtime's page-locked rows (cold_rows.host_mapped), and
        # cudaHostUnregister waits for the device, which waits for this thread's flag: a deadlock (seen in the GPU
        # tests, a Numba compile's garbage collected inside a cold part)
        collecting = gc.isenabled()
        gc.disable()
        try:
            for i, f in enumerate(self.ffns):
                if i == 0 or not prelaunch:
                    self._launch(i)
                if prelaunch:
                    self._launch(i + 1)
                    launched = i
                if clock is not None:
                    clock.append(time.perf_counter())
                if clock is not None or not prelaunch:  # prelaunched: cold_rows waits for the graph's signal
                    self._graphs[i][1].synchronize()
                if clock is not None:
                    clock.append(time.perf_counter())
                f.cold_rows(self.x[i], flags, i)  # prelaunched: waits for ready[i], then releases flag i
                released = i if prelaunch else released
                if clock is not None:
                    clock.append(time.perf_counter())
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
        return self.logits

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
