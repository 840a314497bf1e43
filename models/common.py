"""What the model definitions share: pulling weights from a source, norms, rope, attention over a static KV cache,
the reference dense FFN, and `Decoder`, the base that owns the cache and runs the engine's loop.

Shapes are batch 1 throughout: hidden states are (T, d) for T tokens. Positions come as `pos0`, an int (eager: the
attention reads only the filled part of the cache) or a 0-d long tensor on the device (CUDA graphs: every shape is
static, the attention reads the whole cache under a mask, and the position is a value the graph reads).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hotneurons.common.kinds import Activation
from hotneurons.kernels import qlinear
from hotneurons.models.config import ModelConfig, Rope
from hotneurons.models.slots import Slots
from hotneurons.weights.formats import FORMATS, kernel_format
from hotneurons.weights.qtensor import QTensor, convert

Weight = torch.Tensor | QTensor | qlinear.GpuQ
WeightFn = Callable[[str], Weight | None]  # a canonical name -> its tensor, None where the model has none
FFN = Callable[[int, torch.Tensor], torch.Tensor]  # (layer, x (T, d)) -> y (T, d)


def _linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., k) @ w.T (+ bias) -> (..., n) for a float, QTensor or GpuQ weight (kernels/qlinear.py: a Triton GEMV
    on CUDA for packed Q4_0/Q8_0, chunks of de-quantized rows otherwise)."""
    return qlinear.linear(x, w, bias)


def _pack(w: QTensor, device: torch.device) -> Weight:
    """A quantized weight as the device's GEMV reads it: in its stored format where the device's kernels read it
    (weights/formats.py), else converted at load into the nearest format they read (a Q5_0 matrix to q8_0, ...: one
    tensor at a time, on the device); on CUDA then as qlinear packs it, on the CPU the blocks themselves."""
    w = _readable(w, device)
    if not isinstance(w, QTensor):  # a float64 matrix, widened to float32
        return w.to(device)
    if device.type == "cuda" and FORMATS[w.fmt].gpu_kernel:
        return qlinear.pack(w, device)
    return w.to(device)


def _readable(w: QTensor, device: torch.device) -> QTensor | torch.Tensor:
    """w, or its conversion into kernel_format(w.fmt, device) on `device` (weights/qtensor.convert: a chunk of rows at
    a time, so the float temporaries stay a chunk's)."""
    to = kernel_format(w.fmt, device.type)
    return w if to == w.fmt else convert(w, to, device)


class Loader:
    """Pulls weights by canonical name, one at a time: float ones to (device, dtype), QTensors kept in their blocks
    (packed for the device), and after each tells the source (`release`) that it will not ask for that name again.
    A source may then drop its own references; a tensor it handed out must stay valid."""

    def __init__(self, weights: WeightFn, device: torch.device | str, dtype: torch.dtype,
                 release: Callable[[str], None] | None = None):
        self.weights, self.device, self.dtype, self.release = weights, torch.device(device), dtype, release

    def _get(self, name: str, required: bool) -> Weight | None:
        w = self.weights(name)
        if w is None and required:
            raise KeyError(f"the weights have no tensor '{name}', which this model's config needs: check that the "
                           f"file matches config.json")
        return w

    def _done(self, name: str) -> None:
        if self.release is not None:
            self.release(name)

    def tensor(self, name: str, required: bool = True) -> torch.Tensor | None:
        """A norm weight, bias or position table: always a float tensor (a quantized one is de-quantized)."""
        w = self._get(name, required)
        if w is not None:
            w = w.dequantize(self.dtype) if isinstance(w, QTensor) else w
            w = w.to(device=self.device, dtype=self.dtype)
        self._done(name)
        return w

    def matrix(self, name: str, required: bool = True, pack: bool = True) -> Weight | None:
        """A linear layer's (out, in) weight, kept quantized if it is (pack=False: as a QTensor whose rows can be
        looked up, for embeddings)."""
        w = self._get(name, required)
        if isinstance(w, QTensor):
            w = _readable(w, self.device)
        if isinstance(w, QTensor):
            w = _pack(w, self.device) if pack else w.to(self.device)
        elif w is not None:
            w = self._float(w)
        self._done(name)
        return w

    def _float(self, w: torch.Tensor) -> torch.Tensor:
        """A float matrix on the device in the compute dtype; on the CPU as stored (a bf16 file stays bf16, often a
        view of the file: a float32 copy would double the host memory; the GEMM casts per call)."""
        if self.device.type == "cpu":
            return w.to(self.device)
        return w.to(device=self.device, dtype=self.dtype)

    def fused(self, names: list[str], biases: bool) -> tuple[Weight, torch.Tensor | None]:
        """The weights of `names` stacked by rows into one (so one GEMV reads q, k and v), and their biases (zeros
        where one has none). Quantized weights of different formats stay apart: a list, each its own GEMV."""
        ws = [self._get(n, True) for n in names]
        if all(isinstance(w, QTensor) and w.fmt == ws[0].fmt for w in ws) and self.device.type != "cpu":
            data = torch.cat([w.data.to(self.device) for w in ws])  # (rows, row bytes) uint8
            w = _pack(QTensor(data, ws[0].fmt, (data.shape[0], ws[0].shape[1])), self.device)
        elif not any(isinstance(w, QTensor) for w in ws) and self.device.type != "cpu":
            w = torch.cat([self._float(w) for w in ws])  # on the CPU the parts stay apart: views of the file
        else:
            w = [_pack(w, self.device) if isinstance(w, QTensor) else self._float(w) for w in ws]
        for n in names:
            self._done(n)
        b = None
        if biases:
            bs = [self.tensor(n.replace(".weight", ".bias"), required=False) for n in names]
            b = torch.cat([bias if bias is not None else torch.zeros(part.shape[0], device=self.device,
                                                                      dtype=self.dtype)
                           for bias, part in zip(bs, ws)])
        return w, b


def linear(x: torch.Tensor, w: Weight | list[Weight], bias: torch.Tensor | None = None) -> torch.Tensor:
    """_linear, also for a fused weight kept as parts (Loader.fused)."""
    if isinstance(w, list):
        y = torch.cat([_linear(x, part) for part in w], -1)
        return y + bias if bias is not None else y
    return _linear(x, w, bias)


def embed_rows(w: Weight, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `tokens` (T,) of an embedding table (vocab, d) -> (T, d) in `dtype` on the tokens' device; a quantized
    table's rows are de-quantized. The table may live in CPU RAM (an untied one: load_embedding): the rows are looked
    up there and only they cross to the device."""
    where = w.data.device if isinstance(w, QTensor) else w.device
    ids = tokens.to(where)
    rows = w.rows(ids).dequantize(dtype) if isinstance(w, QTensor) else F.embedding(ids, w).to(dtype)  # (T, d)
    return rows.to(tokens.device)


def load_embedding(load: Loader, cfg: ModelConfig) -> Weight:
    """token_embd: on the device where the head shares it (tied); else in CPU RAM as stored (a view of the file
    where it is one), since a token reads one row of it (pi-solve counts it there)."""
    if cfg.tied_embeddings:
        return load.matrix("token_embd.weight", pack=False)
    w = load._get("token_embd.weight", True)
    load._done("token_embd.weight")
    return w


def load_head(load: Loader, cfg: ModelConfig, tok_embd: Weight) -> Weight:
    """output.weight, or the embedding table where the model ties them (packed for GEMVs if quantized)."""
    w = load.matrix("output.weight", required=not cfg.tied_embeddings)
    if w is not None:
        return w
    return _pack(tok_embd, load.device) if isinstance(tok_embd, QTensor) else tok_embd


@dataclass(frozen=True)
class Norm:
    """RMSNorm (LLaMA: normalised in float32, cast back, then times w), Gemma's (x * (1 + w) in float32, then cast)
    or LayerNorm, as transformers computes each."""

    kind: str  # rms | rms_gemma | layer
    weight: torch.Tensor
    bias: torch.Tensor | None
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layer":
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.kind == "rms_gemma":
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def load_norm(load: Loader, cfg: ModelConfig, name: str) -> Norm:
    """The norm `name` (.weight, and .bias for layer norms)."""
    bias = load.tensor(f"{name}.bias") if cfg.norm == "layer" else None
    return Norm(cfg.norm, load.tensor(f"{name}.weight"), bias, cfg.norm_eps)


def rope_tables(rope: Rope, head_dim: int, n: int, device: torch.device, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (n, head_dim) of positions 0..n-1, each frequency twice (the halves layout of HF's rotate_half)."""
    freqs = torch.arange(n, dtype=torch.float)[:, None] * rope.inv_freq(head_dim)[None, :]  # (n, hd / 2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (n, hd)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, hd) rotated by cos, sin (T, hd): the first half of each head pairs with the second."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # (T, heads, hd)
    return x * cos[:, None] + rotated * sin[:, None]


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
           softcap: float = 0.0) -> torch.Tensor:
    """Attention of q (T, H, hd) over keys, values (K, S, hd) where mask (T, S) is True -> (T, H * hd). Query head h
    reads kv head h // (H / K) (grouped-query), without repeating the cache: a kv head's G query heads go together."""
    T, H, hd = q.shape
    K, S = keys.shape[0], keys.shape[1]
    G = H // K
    # batched over kv heads only, a kv head's G query heads and T tokens as the rows of one matmul: a matmul that
    # broadcast the cache over G (keys[:, None]) would first copy it G times (67 MB a layer at 4,096 slots, 64 heads)
    qg = q.transpose(0, 1).reshape(K, G * T, hd)  # (K, G T, hd)
    scores = torch.bmm(qg, keys.transpose(-1, -2)).view(K, G, T, S) * scale  # (K, G, T, S)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # (K, G, T, S)
    out = torch.bmm(p.view(K, G * T, S), values)  # (K, G T, hd)
    return out.view(H, T, hd).transpose(0, 1).reshape(T, H * hd)


class Decoder:
    """The base of the model definitions: the static KV cache and the engine's loop. A family defines `embed`,
    `attention`, `after_ffn`, `logits` and `_load_layer` (see forward); the cache holds positions 0..ctx-1 of every
    layer.

    A lazy model (build_model(layers=False)) holds only embeddings, final norm and head: `load_layer(i)` brings layer
    i's attention and norms to the device, `drop_layer(i)` frees them, and its cache holds one layer, which each
    layer overwrites in turn (the stages that run models bigger than the device run one sequence through one layer at
    a time)."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype, ctx: int,
                 kv_layers: int | None = None):
        if ctx > cfg.max_positions:
            raise ValueError(f"ctx {ctx} is past the {cfg.max_positions} positions {cfg.model_type} was trained for: "
                             f"pass ctx <= {cfg.max_positions}")
        self.cfg, self.device, self.dtype, self.ctx = cfg, torch.device(device), dtype, ctx
        kv = (kv_layers or cfg.n_layers, cfg.n_kv_heads, ctx, cfg.head_dim)
        self.k_cache = torch.zeros(kv, device=self.device, dtype=dtype)  # (layers, kv heads, ctx, hd)
        self.v_cache = torch.zeros(kv, device=self.device, dtype=dtype)
        self.slots = torch.arange(ctx, device=self.device)  # (ctx,) cache positions
        self._slots = Slots(self)  # the sequences' caches: slot 0 these tensors (add_slots)
        self._loader: Loader | None = None  # kept by lazy models only: it pulls a layer's weights again
        self.layers: list = []

    def _load_layers(self, load: Loader, all_layers: bool) -> list:
        """Every layer's weights now, or (lazy) none yet: then `load` is kept for load_layer."""
        if all_layers:
            return [self._load_layer(load, i) for i in range(self.cfg.n_layers)]
        self._loader = load
        return [None] * self.cfg.n_layers

    @property
    def lazy(self) -> bool:
        return self._loader is not None

    def load_layer(self, i: int) -> None:
        """Layer i's non-FFN weights (attention, its norms) onto the device, pulled from the weights again (each
        released after, as at construction); a no-op where they are there."""
        if self.layers[i] is None:
            self.layers[i] = self._load_layer(self._loader, i)

    def drop_layer(self, i: int) -> None:
        """Free layer i's weights (a lazy model's: a whole one could not pull them again)."""
        if not self.lazy:
            raise ValueError(f"layer {i} cannot be dropped: this model was built with all its layers; build it with "
                             f"layers=False to load and drop them one at a time")
        self.layers[i] = None

    def _load_layer(self, load: Loader, i: int):
        raise NotImplementedError

    def reset(self) -> None:
        """Forget the cache: the next call starts again at position 0."""
        self.k_cache.zero_()
        self.v_cache.zero_()
        self._slots.reset()

    def add_slots(self, n: int) -> None:
        """Hold the caches of `n` sequences: slot 0 is the model's own cache, slots 1.. are made here (keeping those
        made before). A batched decode step (runtime/batch.py) attends each sequence over its slot, `slot(b)`."""
        if self.lazy:
            raise ValueError("a lazy model's cache holds one layer: build it with its layers for batched decoding")
        self._slots.add(n)

    @property
    def n_slots(self) -> int:
        return len(self._slots)

    def slot(self, b: int):
        """A context: within, the cache is sequence b's (add_slots); the model's own again after."""
        return self._slots.bind(b)

    def resident(self, b: int) -> None:
        """Sequence b's cache into the model's own tensors, which a decode step's graphs read (models/slots.py)."""
        self._slots.resident(b)

    def free_slot(self, b: int) -> None:
        """Sequence b has ended (its cache is left as it is, to be overwritten): resident() moves none of it."""
        self._slots.free(b)

    @property
    def cache_version(self) -> int:
        """Moves at every write to (or move of) any of the caches: equal at two moments, nothing changed them."""
        return self._slots.version

    def wrote(self, n: int) -> None:
        """The cache in use holds positions up to n - 1 (a decode step that writes them where Python does not see)."""
        self._slots.wrote(n)

    def rows(self, slots: list[int], positions: list[int]):
        """A context: within, a call's T rows are T sequences' decode tokens, row b at position positions[b] of cache
        slot slots[b]; each row's cache write and attention in its own slot, every other op once over the T rows
        (runtime/batch.step_batch; models/slots.py)."""
        return self._slots.batch_rows(slots, positions)

    def positions(self, T: int, pos0: int | torch.Tensor) -> torch.Tensor:
        """(T,) positions pos0..pos0+T-1 on the device (within rows(): each row's own)."""
        if self._slots.rows is not None:
            return self._slots.rows[2]
        if isinstance(pos0, int) and pos0 + T > self.ctx:
            raise ValueError(f"positions {pos0}..{pos0 + T - 1} are past the KV cache of {self.ctx} tokens: build the "
                             f"model with a larger ctx")
        return self.slots[:T] + pos0

    def cached_attention(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                         pos0: int | torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Write k, v (T, K, hd) at positions pos (T,) of layer i's cache, then attend q (T, H, hd) causally over the
        cache (within layer i's sliding window) -> (T, H * hd). `scale`: of the scores, if not cfg.scale. Within
        rows(): row b in its own slot, at its own position."""
        if self._slots.rows is not None:
            return self._slots.each_row(i, q, k, v, pos, scale)  # (T, H * hd)
        return self._cached(i, q, k, v, pos, pos0, scale)

    def _cached(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                pos0: int | torch.Tensor, scale: float | None) -> torch.Tensor:
        c = i % len(self.k_cache)  # a lazy model's one-layer cache serves every layer in turn
        self.k_cache[c].index_copy_(1, pos, k.transpose(0, 1))
        self.v_cache[c].index_copy_(1, pos, v.transpose(0, 1))
        if isinstance(pos0, int):  # a graph's step tells its own (wrote)
            self._slots.wrote(pos0 + q.shape[0])
        S = pos0 + q.shape[0] if isinstance(pos0, int) else self.ctx  # eager: only the filled slots
        slots = self.slots[:S]
        mask = slots[None, :] <= pos[:, None]  # (T, S) causal
        window = self.cfg.window(i)
        if window:
            mask &= slots[None, :] > pos[:, None] - window
        scale = self.cfg.scale if scale is None else scale
        return attend(q, self.k_cache[c, :, :S], self.v_cache[c, :, :S], mask, scale, self.cfg.attn_softcap)

    def head(self, h: torch.Tensor, norm: Norm | None, w: Weight) -> torch.Tensor:
        """(T, vocab) float32 logits: final norm, head, softcap."""
        if norm is not None:
            h = norm(h)
        logits = _linear(h, w).float()
        if self.cfg.final_softcap:
            logits = torch.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        return logits

    # the engine's contract, defined by each family
    def embed(self, tokens: torch.Tensor, pos0: int | torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """(T, d) hidden states of tokens (T,) at positions pos0..; rows (T, d_embed): their embedding rows, looked up
        already (a CUDA graph's step, where an untied table lives in CPU RAM: runtime/source_steps.py)."""
        raise NotImplementedError

    def attention(self, i: int, h: torch.Tensor, pos0: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def after_ffn(self, i: int, h2: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return h2 + y

    def step_supported(self) -> str | None:
        """None where decode steps may run step_begin / step_layer (a family's fused form), else why not."""
        return f"{type(self).__name__} has no fused decode step"

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, pos0: int | torch.Tensor, ffn: FFN) -> torch.Tensor:
        """Logits (T, vocab) float32 of tokens (T,) at positions pos0.., whose keys and values join the cache;
        ffn(i, x) is layer i's FFN."""
        h = self.embed(tokens, pos0)  # (T, d)
        for i in range(self.cfg.n_layers):
            if self.lazy:
                self.load_layer(i)
            h2, x = self.attention(i, h, pos0)  # (T, d) residual after attention, (T, d) the FFN's input
            h = self.after_ffn(i, h2, ffn(i, x))
            if self.lazy:
                self.drop_layer(i)
        return self.logits(h)


# ---------------------------------------------------------------------------------------------------------------
# The reference FFN (dense: every neuron), for tests and dense mode

def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "relu":
        return torch.relu(x)
    if name == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if name == "gelu_tanh" else "none")


def ffn_values(cfg: ModelConfig, up: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    """The per-neuron values (T, n) that enter the down projection, from the up (and gate) projections."""
    if gate is None:
        return _act(cfg.act_fn, up)
    if cfg.activation is Activation.DRELU:
        return torch.relu(gate) * torch.relu(up)
    if cfg.activation is Activation.FATRELU:
        return torch.where(gate > cfg.fat_threshold, gate, torch.zeros((), dtype=gate.dtype, device=gate.device)) * up
    return _act(cfg.act_fn, gate) * up


def gate_values(cfg: ModelConfig, gate: torch.Tensor) -> torch.Tensor:
    """act(gate x) (T, n) of a SwiGLU / GeGLU FFN, the factor ffn_values multiplies up by: what the gate sparsity
    criteria read (common/gating.py)."""
    return _act(cfg.act_fn, gate)
