"""Batched decoding: B sequences, each in its own KV cache slot (models/common.Decoder.add_slots) at its own position,
one step for all (`step_batch`, eager), or the batch-1 step for each in turn (`step_each`: on CUDA its graphs, each
sequence's cache moved into the model's own tensors first); `batch_step` picks one. `generate_batch` decodes several
prompts together, for tests and notebooks; pi-serve's continuous batching builds on the same steps.

A step, layer by layer: the norms and projections of attention once over the B tokens, the cache write and the
attention itself per sequence over its slot (its cache and position are its own: Decoder.rows); the FFN once for
the B tokens. A mixture of experts' FFN routes each token on its own (HybridMoE's call over B tokens: the GPU experts'
pairs in one grouped product). A dense hybrid FFN computes its hot rows as one product over the B tokens on the
device (`ffn_batch`), and each token's cold part with its own batch-1 mask (predictor, gate, dense or oracle).
Predictor masks: the CPU reads each cold row in the union of the B masks once, for all the tokens that mark it
(kernels/cold_batch.py); the other masks go token by token through batch 1's path. So each sequence computes the
same neurons as it would alone: its greedy tokens are its batch-1 run's (tests/test_batch.py), up to the rounding of
one product over B rows against B products of one.

Not yet: the predictor over the B tokens in one launch (a launch a token now, one wait), the device's share of the
cold rows read in place (mapped_rows: a batch's CPU reads them all), CUDA graphs per batch size.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from hotneurons.common.kinds import BatchStep
from hotneurons.kernels.cold_batch import union
from hotneurons.runtime.generate import sync
from hotneurons.runtime.hybrid_ffn import HybridFFN
from hotneurons.runtime.sampling import Sampling, sample


def ffn_rows_batch(activation: str, xs: np.ndarray, idx: np.ndarray, member: np.ndarray, rows: Any,
                   out: np.ndarray, part: np.ndarray | None = None) -> np.ndarray:
    """CPU backend, B tokens: out (B, d) float32 = for each token b, the sum over the positions idx[q] whose member[q]
    has bit b of h_j(x_b) * down_t[j] (kernels/cold_batch.py: each row of the union read once). The batch-1 twin:
    runtime/cold_rows.ffn_rows."""
    import numba
    from hotneurons.kernels.cold import ACT_CODE
    from hotneurons.kernels.cold_batch import cold_ffn_batch, cold_ffn_batch_q

    if xs.shape[0] == 1:  # one token: the union is its mask, and batch 1's kernel reads it as it would alone
        from hotneurons.runtime.cold_rows import ffn_rows

        ffn_rows(activation, xs[0], idx, rows, out[0])
        return out
    if part is None:
        part = np.empty((numba.get_num_threads(), *xs.shape), np.float32)
    if rows.fmt:
        cold_ffn_batch_q(xs, idx, member, rows.gate_arg, rows.up, rows.b_up, rows.down_t, part, out,
                         ACT_CODE[activation], fmt=rows.code)
    else:
        cold_ffn_batch(xs, idx, member, rows.gate_arg, rows.up, rows.b_up, rows.down_t, rows.scale, rows.group, part,
                       out, ACT_CODE[activation])
    return out


_BITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # HybridFFN -> (host bits, device view): its batch


def _masks(f: HybridFFN, x: torch.Tensor, residual: torch.Tensor) -> np.ndarray:
    """(B, n_cold) bool: each token's cold mask from the predictor, launched token by token as batch 1 launches it
    (the same op on the same input: the same bits) into a row of buffers of its own, then one wait for all."""
    from hotneurons.kernels.cold import mask_bytes
    from hotneurons.kernels.ops import predict
    from hotneurons.runtime.cold_rows import host_mapped

    B, n = x.shape[0], f.n_cold
    if f not in _BITS or _BITS[f][0].shape[0] < B:
        pin = x.device.type == "cuda"  # written by the device, read by the CPU
        host = torch.zeros((max(B, 8), mask_bytes(n)), dtype=torch.uint8, pin_memory=pin).numpy()  # (rows, bytes)
        _BITS[f] = host, host_mapped(host, host, x.device, register=False)
    host, dev = _BITS[f]
    src = residual if f.prenorm else x  # what the predictor reads (the powerinfer form: the residual)
    for b in range(B):
        predict(src[b].to(f.pred_dtype), f.pred_fc1, f.pred_fc2, f.pred_threshold, f.fired, None, dev[b], n)
    sync(x.device)
    return np.unpackbits(host[:B], axis=1, bitorder="little")[:, :n].astype(bool)


@dataclass
class UnionStats:
    """Per batch size B: decode steps, the cold rows the CPU read (the union of the B masks) and the rows the B masks
    marked, summed over the layers of each step (predictor masks): how much a batch shares its cold reads."""

    rows: dict[int, list[int]] = field(default_factory=dict)  # B -> [steps, union rows, marked rows]

    def add(self, B: int, union: int, marked: int, step: bool) -> None:
        r = self.rows.setdefault(B, [0, 0, 0])
        r[0] += int(step)
        r[1] += union
        r[2] += marked

    def summary(self) -> dict[str, dict[str, float]]:
        """B -> steps, cold rows read per token a step, rows marked per token, and the union's share of the marks."""
        return {str(B): {"steps": s, "union_rows_per_token": u / s / B, "marked_rows_per_token": m / s / B,
                         "union_over_marked": u / m if m else 1.0}
                for B, (s, u, m) in sorted(self.rows.items()) if s}


def ffn_batch(f: HybridFFN, x: torch.Tensor, residual: torch.Tensor, stats: UnionStats | None = None,
              first: bool = False) -> torch.Tensor:
    """(B, d) -> (B, d): a dense hybrid FFN over B decode tokens, each with its batch-1 mask. The hot rows: one product
    over the B tokens on the device. Predictor masks: the CPU reads each cold row of the masks' union once for all
    the tokens that mark it (`ffn_rows_batch`); other masks (the gate's, dense, oracle) go token by token through
    batch 1's path. `residual` (B, d): the residual before the pre-FFN norm, which the powerinfer-form predictor
    reads. `stats`: the union's size is added to it (`first`: the step's first such layer counts the step)."""
    from hotneurons.kernels.ops import predict
    from hotneurons.runtime.gated import hot_sparse

    f.host_io(x.device)

    def hot() -> torch.Tensor:  # (B, d), launched asynchronously on CUDA
        if f.gws is not None:  # the gated hot kernel takes one token (static buffers)
            return torch.cat([hot_sparse(f, x[b:b + 1]) for b in range(x.shape[0])])
        return f._hot(x, count=True)  # one product over the B tokens

    if not f.n_cold and f.mask != "oracle":
        return hot()
    if f.mask == "predictor":
        xs = x.float().cpu().numpy()  # (B, d) on the host
        masks = _masks(f, x, residual)  # (B, n_cold), after the device's one wait
        y = hot()  # the device's part while the CPU reads the cold rows below
        idx, member = union(masks)
        out = ffn_rows_batch(f.activation, xs, idx, member, f.cold, np.empty((x.shape[0], f.d_model), np.float32))
        f.counts[0] += x.shape[0]
        f.cold_marks += (x.shape[0], int(masks.sum()))
        if stats is not None:
            stats.add(x.shape[0], len(idx), int(masks.sum()), first)
        return y + torch.from_numpy(out).to(y.device, y.dtype)
    y = hot()
    rows = []
    for b in range(x.shape[0]):
        xb = x[b:b + 1]  # (1, d)
        # waits for the step before (the device reads the CPU's sums from the host buffers this token overwrites)
        sync(x.device)
        f.to_host(xb, predict, residual[b:b + 1] if f.prenorm else None)
        part = f.mapped_part(xb) if f.mapped_rows else None  # (1, d) read in place on the device
        sync(x.device)  # x and the mask on the host
        f.cold_rows(xb)
        s = f.cold_sum()[None].to(y.dtype) if f.n_cold else torch.zeros_like(xb)  # (1, d)
        rows.append((s if part is None else s + part.to(y.dtype)).clone())
    return y + torch.cat(rows)


def _check_rows(tokens: list[int], positions: list[int], slots: list[int]) -> None:
    if not len(tokens) == len(positions) == len(slots) or len(set(slots)) != len(slots):
        raise ValueError(f"a batched step: {len(tokens)} tokens, {len(positions)} positions and slots {slots}: one "
                         f"each, every slot once")


def batch_decoder(rt: Any) -> Any:
    """The runtime's decoder, which holds the slots; a one-line error where the runtime has none."""
    m = getattr(rt.lm, "decoder", None)
    if m is None:
        raise ValueError("batched decoding runs our decoders (a model read in place): this runtime decodes through "
                         "transformers (--hf-decode or a hub id)")
    return m


@torch.inference_mode()
def step_batch(rt: Any, tokens: list[int], positions: list[int], slots: list[int],
               stats: UnionStats | None = None) -> torch.Tensor:
    """Logits (B, vocab) float32: token b at position positions[b] of the sequence in cache slot slots[b], whose
    key and value join that slot. Our decoders (runtime/engine.SourceModel) only. `stats`: the cold rows' union per
    step is counted there (UnionStats)."""
    m = batch_decoder(rt)
    _check_rows(tokens, positions, slots)
    with m.rows(slots, positions):  # each row attends in its own slot; the rest runs once over the B rows
        h = m.embed(torch.tensor(tokens, device=rt.device), 0)  # (B, d)
        for i, f in enumerate(rt.ffns):
            h2, x = m.attention(i, h, 0)  # (B, d) the residual after attention, the FFN's input
            y = ffn_batch(f, x, h2, stats, i == 0) if isinstance(f, HybridFFN) else f(x)
            h = m.after_ffn(i, h2, y)
    return m.logits(h)  # (B, vocab)


@torch.inference_mode()
def step_each(rt: Any, tokens: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
    """Logits (B, vocab) float32, as step_batch's, by the batch-1 step (rt.fast: on CUDA its graphs) for each sequence
    in turn, its cache made the model's own first (Decoder.resident: an exchange of the positions written, nothing
    while the same sequence stays). No weight read is shared, but no step launches eagerly: on a GPU whose eager
    step_batch is launch-bound this decodes more tokens a second (docs/serve.md)."""
    m = batch_decoder(rt)
    if rt.fast is None:
        raise ValueError("interleaved decoding steps through the runtime's static decode steps: load it with them "
                         "(static_decode) or decode batched")
    _check_rows(tokens, positions, slots)
    out = []
    for t, p, s in zip(tokens, positions, slots):
        m.resident(s)
        out.append(rt.fast.step(t, p).clone())  # (vocab,): a graph's logits are its static output, which the next
        # sequence's step overwrites (the copy is ordered before that replay on the stream)
    return torch.stack(out)


def step_kind(rt: Any, kind: str = "auto") -> BatchStep:
    """The BatchStep `kind` names, `auto` resolved: interleaved where the runtime replays CUDA graphs (there the eager
    batched step is launch-bound: docs/serve.md), batched elsewhere."""
    kind = BatchStep(kind)
    if kind == BatchStep.AUTO:
        return BatchStep.INTERLEAVED if rt.fast is not None and rt.fast.graphs else BatchStep.BATCHED
    return kind


def batch_step(rt: Any, kind: str = "auto"):
    """(tokens, positions, slots, stats=None) -> logits (B, vocab): step_batch or step_each, as step_kind picks;
    `auto` also takes step_each for a lone sequence, whose batch-1 step is faster than a batch of one."""
    if step_kind(rt, kind) == BatchStep.INTERLEAVED:
        return lambda tokens, positions, slots, stats=None: step_each(rt, tokens, positions, slots)
    if BatchStep(kind) == BatchStep.AUTO and rt.fast is not None:
        return lambda tokens, positions, slots, stats=None: (
            step_each(rt, tokens, positions, slots) if len(tokens) == 1
            else step_batch(rt, tokens, positions, slots, stats))
    return lambda tokens, positions, slots, stats=None: step_batch(rt, tokens, positions, slots, stats)


@dataclass
class Sequence:
    """One sequence of a batch: its prompt, its tokens so far, its slot."""

    prompt: list[int]
    slot: int
    max_new: int
    ids: list[int] = field(default_factory=list)
    done: bool = False


@torch.inference_mode()
def generate_batch(rt: Any, prompts: list[list[int]], max_new_tokens: int = 32, sampling: Sampling = Sampling(),
                   stop_at_eos: bool = True, step: str = "batched") -> list[list[int]]:
    """Each prompt's new token ids, the prompts decoded together (one step a token for all that are not done: a
    BatchStep, batch_step); each prompt prefilled alone into its slot. Greedy sampling gives each its batch-1
    tokens."""
    lm, dec = rt.lm, batch_decoder(rt)
    decode = batch_step(rt, step)
    if not prompts or any(not p for p in prompts):
        raise ValueError("generate_batch: every prompt needs at least one token")
    dec.add_slots(max(dec.n_slots, len(prompts)))
    stop = set(lm.eos) if stop_at_eos else set()
    gens = [torch.Generator().manual_seed(sampling.seed) for _ in prompts]
    seqs, logits = [], []
    for b, p in enumerate(prompts):
        if len(p) >= lm.ctx:
            raise ValueError(f"prompt {b} has {len(p)} tokens but the model's context is {lm.ctx}: shorten it")
        seqs.append(Sequence(p, b, min(max_new_tokens, lm.ctx - len(p))))
        with dec.slot(b):
            logits.append(lm.prefill(rt, p))  # (vocab,)
    for f in rt.ffns:
        f.reset_counts()
    rows = torch.stack(logits)  # (B, vocab)
    while True:
        live = [s for s in seqs if not s.done]
        for s, lg in zip(live, rows):
            nxt = sample(lg, s.prompt + s.ids, sampling, gens[s.slot])
            s.ids.append(nxt)
            s.done = nxt in stop or len(s.ids) >= s.max_new
        live = [s for s in live if not s.done]
        if not live:
            return [s.ids for s in seqs]
        rows = decode([s.ids[-1] for s in live], [len(s.prompt) + len(s.ids) - 1 for s in live],
                      [s.slot for s in live])


def slot_bytes(dec: Any) -> int:
    """Bytes of one more sequence's KV cache slot."""
    return int(np.prod(dec.k_cache.shape)) * dec.k_cache.element_size() * 2


def slots_allowed(rt: Any, cap: int = 4) -> int:
    """How many sequences the runtime can decode at once: 1 where it has no decoder of ours (transformers decodes
    batch 1); else the KV cache slots that fit the device budget beside what is loaded (--vram), at most `cap`;
    `cap` where no budget is set or the device is the CPU. pi-serve's default --parallel."""
    dec = getattr(rt.lm, "decoder", None)
    if dec is None or dec.lazy:
        return 1
    vram = rt.cfg.vram
    if vram is None or rt.device.type == "cpu":
        return cap
    free = max(0, vram - rt.bytes_gpu)  # bytes
    return int(max(1, min(cap, dec.n_slots + free // slot_bytes(dec))))
