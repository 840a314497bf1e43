"""Forward hooks that count which FFN neurons fire, and a reservoir of (FFN input, mask) samples on disk.

No model code is edited: per decoder layer, one forward pre-hook on the down projection sees the per-neuron
activation values h (what `fc2` / `down_proj` multiplies), and, only on batches that feed the reservoir, one
pre-hook on the up projection sees the FFN input x (models/ffn_hooks.FFNHooks) and, where the model has a pre-FFN
RMSNorm, one on that norm sees the residual before it, of which each sample keeps the norm's divisor r
(common/prenorm.py: with x, it is what the powerinfer predictor form trains on). The activation rule itself
(active_mask, as_tau) is in common/ffn.py: later stages apply the same one. A model run layer by layer
(models/streamed.py) registers no hooks: its forward hands the same tensors to the same methods
(models/ffn_hooks.StageHooks).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import numba
import numpy as np
import torch
from hotneurons.common.artifacts import ArtifactError
from hotneurons.common.ffn import active_mask, as_tau
from hotneurons.common.prenorm import ffn_norm
from hotneurons.models.family import LoadedModel
from hotneurons.models.ffn_hooks import StageHooks, device_of, gate_column_norms


def count_active(h: torch.Tensor, tau: float | None) -> torch.Tensor:
    """(tokens, neurons) activation values -> (neurons,) int64 count of tokens where each neuron is active.

    Same result as active_mask(h, tau).sum(0). On the CPU (float32/64) a Numba kernel does it in one pass with
    no (tokens, neurons) temporaries: eager abs/compare/sum write three of them, which costs more than the FFN's
    own arithmetic on a CPU with few cores.
    """
    if h.device.type == "cpu" and h.dtype in (torch.float32, torch.float64):
        a = h.detach().contiguous().numpy()
        return torch.from_numpy(_count_cpu(a, as_tau(tau), _chunks(a.shape[0])))
    if h.device.type == "cuda" and h.dtype != torch.float64:
        return _count_cuda(h, _on_device(as_tau(tau), h.device))
    return active_mask(h, tau).sum(0)


def _count_cuda(h: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """One fused reduction kernel (torch.compile): one read of h, where eager abs/compare/sum each read and write a
    (tokens, neurons) tensor. tau is a tensor so that one compiled kernel serves every layer.

    Compiled in this process (Inductor's compile_threads = 1, on every call: a new shape or dtype recompiles there):
    by default Inductor starts a pool of one worker process per core, each importing torch, which held ~6 GB of host
    memory on a 16-core machine (7.05 GB peak RSS of pi-profile on a 1.7 GB model, 1.76 GB without) for one small
    kernel."""
    global _compiled
    with _one_compile_thread():
        if _compiled is None:
            def count(h, tau):
                return (h.float().abs() > tau).sum(0)

            try:
                _compiled = torch.compile(count, dynamic=True)
                _compiled(h[:1], tau)
            except Exception:  # no Triton / compiler on this machine: eager ops give the same counts, slower
                _compiled = count
        return _compiled(h, tau)


def _one_compile_thread():
    """Inductor compiling in this process, no worker pool, for the block (the process's setting is restored after)."""
    try:
        from torch._inductor import config
    except Exception:  # no Inductor in this build: nothing compiles, nothing to limit
        return contextlib.nullcontext()
    return config.patch(compile_threads=1)


_compiled = None


@lru_cache(maxsize=None)
def _on_device(value: float, device: torch.device) -> torch.Tensor:
    """A cached 0-d tensor: building one per call would copy from pageable memory and stall the launch queue."""
    return torch.tensor(value, dtype=torch.float32, device=device)


def _chunks(tokens: int) -> int:
    return max(1, min(numba.get_num_threads() * 4, tokens // 64))


@numba.njit(parallel=True, nogil=True, cache=True)
def _count_cpu(h, tau, n_chunks):  # pragma: no cover - compiled
    tokens, n = h.shape
    partial = np.zeros((n_chunks, n), dtype=np.int64)  # one row of counts per token chunk: no write sharing
    for c in numba.prange(n_chunks):
        for t in range(c * tokens // n_chunks, (c + 1) * tokens // n_chunks):
            row = h[t]
            for j in range(n):
                if abs(row[j]) > tau:  # tau = 0: nonzero (ReLU family)
                    partial[c, j] += 1
    return partial.sum(axis=0)


class SampleReservoir:
    """Uniform reservoir sample of token rows, shared by all layers, stored as .npy memory maps.

    Per layer: `layer_{i:03d}.x.npy` float16 (capacity, d_model), `layer_{i:03d}.mask.npy` uint8
    (capacity, ceil(n_neurons / 8)), the mask bit-packed along neurons (np.packbits, big bit order), and with `rms`
    `layer_{i:03d}.rms.npy` float32 (capacity,), the pre-FFN norm's divisor r of the same token.
    Which rows a batch writes depends only on (seed, rank, batch index, tokens seen), so a resumed run
    writes exactly what an uninterrupted one does.
    """

    def __init__(self, folder: Path, capacity: int, n_layers: int, d_model: int, n_neurons: int,
                 seed: int, rank: int = 0, resume: bool = False, rms: bool = False):
        self.folder, self.capacity, self.seed, self.rank = folder, capacity, seed, rank
        folder.mkdir(parents=True, exist_ok=True)
        mode = "r+" if resume else "w+"
        nbytes = (n_neurons + 7) // 8
        self.x = [self._open(f"layer_{i:03d}.x.npy", mode, np.float16, (capacity, d_model)) for i in range(n_layers)]
        self.mask = [self._open(f"layer_{i:03d}.mask.npy", mode, np.uint8, (capacity, nbytes))
                     for i in range(n_layers)]
        # (capacity, 1) views of the (capacity,) files: scattered like the other files' rows
        self.rms = [self._open(f"layer_{i:03d}.rms.npy", mode, np.float32, (capacity,)).reshape(capacity, 1)
                    for i in range(n_layers)] if rms else None
        self.pos: torch.Tensor | None = None  # flat token positions of the current batch to store
        self.slot: np.ndarray | None = None  # their reservoir slots
        # Rows gathered on the model's device during a forward; copied to the host once after it, and written to
        # the memory maps on a worker thread while the next batch runs (hooks never wait for the disk).
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self._writer = ThreadPoolExecutor(max_workers=1)
        self._inflight: Future | None = None

    def _open(self, name: str, mode: str, dtype, shape) -> np.memmap:
        path = self.folder / name
        if mode == "r+":
            if not path.exists():  # a checkpoint written by a version that stored no pre-norm scales
                raise ArtifactError(f"cannot resume: the interrupted profile in {self.folder.parent} has no {name}: "
                                    f"force a fresh start", params="force")
            return np.load(path, mmap_mode="r+")
        return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)

    def plan(self, batch_index: int, seen: int, n_tokens: int, device: torch.device) -> None:
        """Choose the rows of this batch to keep (algorithm R over the stream of tokens, last write wins)."""
        g = seen + np.arange(n_tokens)  # global token index within this rank's stream
        slots = np.where(g < self.capacity, g, -1)
        late = g >= self.capacity
        if late.any():
            rng = np.random.default_rng([self.seed, self.rank, batch_index])
            j = rng.integers(0, g[late] + 1)  # uniform in [0, g]
            slots[late] = np.where(j < self.capacity, j, -1)
        keep = slots >= 0
        pos, slot = np.nonzero(keep)[0], slots[keep]
        # a slot drawn twice in one batch keeps its last row, as the sequential algorithm would
        _, last = np.unique(slot[::-1], return_index=True)
        idx = np.sort(len(slot) - 1 - last)
        self.pos = torch.from_numpy(pos[idx]).to(device) if len(idx) else None
        self.slot = slot[idx]

    def write(self, layer: int, x: torch.Tensor, mask: torch.Tensor, rms: torch.Tensor | None = None) -> None:
        """From a hook: this batch's chosen rows (x, mask, and r where stored, at self.pos), kept on the device (no
        host sync)."""
        r = None if self.rms is None else rms.to(torch.float32)[:, None]  # (rows, 1)
        self._pending.append((layer, x.to(torch.float16), packbits(mask), r))

    def commit(self) -> None:
        """After a forward: one copy to the host, then the disk writes go to the worker thread."""
        if not self._pending:
            return
        # non_blocking device->host copies land in pinned memory (PyTorch's caching host allocator): several
        # times faster than pageable copies; one stream sync covers them all
        host = [(i, *(None if t is None else t.to("cpu", non_blocking=True) for t in ts))
                for i, *ts in self._pending]
        self._pending = []
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        host = [(i, *(None if t is None else t.numpy() for t in ts)) for i, *ts in host]
        self.wait()
        self._inflight = self._writer.submit(self._store, host, self.slot)

    def _store(self, host: list, slot: np.ndarray) -> None:
        order = np.argsort(slot)  # ascending slots: sequential-ish writes into the memory maps
        slot = slot[order]
        # while the reservoir fills, a batch's slots are one ascending run: one slice copy each
        run = len(slot) > 0 and slot[-1] - slot[0] == len(slot) - 1 and (order == np.arange(len(order))).all()
        for i, x, m, r in host:
            if run:
                self.x[i][slot[0]:slot[-1] + 1] = x
                self.mask[i][slot[0]:slot[-1] + 1] = m
                if r is not None:
                    self.rms[i][slot[0]:slot[-1] + 1] = r
            else:  # Numba copies the scattered rows without the GIL: the next forward's Python runs meanwhile
                _scatter_rows(self.x[i].view(np.ndarray).view(np.uint16), x.view(np.uint16), order, slot)
                _scatter_rows(self.mask[i].view(np.ndarray), m, order, slot)
                if r is not None:
                    _scatter_rows(self.rms[i].view(np.ndarray), r, order, slot)

    def wait(self) -> None:
        if self._inflight is not None:
            self._inflight.result()  # re-raises a failed write (disk full, ...)
            self._inflight = None

    def flush(self) -> None:
        self.wait()
        for arr in (*self.x, *self.mask, *(self.rms or ())):
            arr.flush()  # a (capacity, 1) view flushes the memory map it views


@numba.njit(nogil=True, cache=True)
def _scatter_rows(dst, src, order, slot):  # pragma: no cover - compiled
    for k in range(len(slot)):
        dst[slot[k], :] = src[order[k], :]


@lru_cache(maxsize=None)
def _bits(device: torch.device) -> torch.Tensor:
    return torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=device)


def packbits(mask: torch.Tensor) -> torch.Tensor:
    """(rows, n) bool -> (rows, ceil(n/8)) uint8, bit-identical to np.packbits(mask, axis=1), on mask's device."""
    rows, n = mask.shape
    m = mask.to(torch.uint8)
    if n % 8:
        m = torch.nn.functional.pad(m, (0, 8 - n % 8))
    return (m.view(rows, (n + 7) // 8, 8) * _bits(m.device)).sum(-1, dtype=torch.uint8)


def sample_norms(lm) -> list | None:
    """The pre-FFN RMSNorms whose divisors the samples keep, or None for families without them (OPT, Falcon): a
    LoadedModel's modules (common/prenorm.FFNNorm), or a StreamedModel's read from its file (FileNorm)."""
    if not isinstance(lm, LoadedModel):
        return lm.ffn_norms()
    norms = [ffn_norm(lm.adapter.name, layer) for layer in lm.layers]
    return None if any(n is None for n in norms) else norms


class ActivationCounter(StageHooks):
    """Counts active neurons: `counts` accumulates (layers, neurons) int64 on the model's device.

    `gated` (profiler/gated.GatedCounting, SwiGLU / GeGLU models): the profile's criterion decides what counts as
    active (and what the sample masks hold), and every criterion's passes at every tabulated sparsity are counted
    beside (passes.safetensors)."""

    def __init__(self, lm, taus: list[float] | None, reservoir: SampleReservoir | None = None, gated=None):
        super().__init__(lm)
        self.taus, self.reservoir, self.gated = taus, reservoir, gated
        self.counts = torch.zeros(lm.info["n_layers"], lm.info["n_neurons"], dtype=torch.int64, device=device_of(lm))
        self.pre_norms = sample_norms(lm) if reservoir is not None and reservoir.rms is not None else None
        self._rms: dict[int, torch.Tensor] = {}  # layer -> (rows,) r of the kept rows, from the norm's input
        self._a: dict[int, torch.Tensor] = {}  # layer -> act(gate x) until its on_ffn

    def tensors(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps and torchrun all-reduces."""
        return {"counts": self.counts, **(self.gated.tensors() if self.gated is not None else {})}

    def on_pre_norm(self, i: int, x_pre: torch.Tensor) -> None:
        if self.pre_norms is not None and self._sampling():
            self._rms[i] = self.pre_norms[i].divisor(x_pre.reshape(-1, x_pre.shape[-1])[self.reservoir.pos])  # (rows,)

    def _sampling(self) -> bool:
        return self.reservoir is not None and self.reservoir.pos is not None

    def wants_x(self) -> bool:
        return self._sampling() or (self.gated is not None and self.gated.wants_x)

    def wants_gate(self) -> bool:
        return self.gated is not None

    def on_gate(self, i: int, a: torch.Tensor) -> None:
        self._a[i] = a

    def on_ffn(self, i: int, h: torch.Tensor, x: torch.Tensor | None) -> None:
        h = h.reshape(-1, h.shape[-1])  # (tokens, neurons)
        a = self._a.pop(i).reshape(h.shape) if self.gated is not None else None  # (tokens, neurons)
        tau = None if self.taus is None else self.taus[i]
        if self.gated is not None:
            self.gated.count(i, a, h, None if x is None else x.reshape(-1, x.shape[-1]))
        self.counts[i] += count_active(h, tau) if self.gated is None else self.gated.active_counts(i, a, h)
        if x is not None and self._sampling():  # masks only for the rows kept as samples
            rows = self.reservoir.pos
            mask = active_mask(h[rows], tau) if self.gated is None else self.gated.active(i, a[rows], h[rows])
            self.reservoir.write(i, x.reshape(-1, x.shape[-1])[rows], mask, self._rms.pop(i, None))

    def end_layer(self, i: int) -> None:
        if self.reservoir is not None:  # one layer's rows to the host at a time, not the whole model's
            self.reservoir.commit()


class MagnitudeCollector(StageHooks):
    """Calibration hooks: keep a random subset of |h| per layer, to set tau_l at a target sparsity.

    `gated` (SwiGLU / GeGLU, for the criteria of common/gating.py; profiler/gated.calibrate reads them): also
    |act(gate x)| at the same (token, neuron) pairs as |h| (gate-h's two thresholds are set on their joint sample),
    and per layer a random subset of (token, channel) pairs of the FFN input: |x_i| and the WINA score
    |x_i| * ||W_gate[:, i]|| of the same pairs. Its own generator draws those, so |h|'s sample is a plain run's."""

    def __init__(self, lm, per_batch: int = 1 << 18, seed: int = 0, gated: bool = False):
        super().__init__(lm)
        self.per_batch = per_batch
        L = lm.info["n_layers"]
        self.values: list[list[torch.Tensor]] = [[] for _ in range(L)]
        self.gen = torch.Generator().manual_seed(seed)
        self.gated = gated
        self.gate_values: list[list[torch.Tensor]] = [[] for _ in range(L)]
        self.x_values: list[list[torch.Tensor]] = [[] for _ in range(L)]
        self.wina_values: list[list[torch.Tensor]] = [[] for _ in range(L)]
        self.norms: list[torch.Tensor] | None = None
        self._xgen = torch.Generator().manual_seed(seed + 1)
        self._a: dict[int, torch.Tensor] = {}

    def __enter__(self):
        if self.gated and self.norms is None:
            self.norms = [n.float().cpu() for n in gate_column_norms(self.lm)]  # (d,) per layer
        return super().__enter__()

    def wants_gate(self) -> bool:
        return self.gated

    def wants_x(self) -> bool:
        return self.gated

    def on_gate(self, i: int, a: torch.Tensor) -> None:
        self._a[i] = a

    def on_ffn(self, i: int, h: torch.Tensor, x: torch.Tensor | None) -> None:
        a = h.detach().abs().flatten().float().cpu()
        idx = None
        if a.numel() > self.per_batch:
            idx = torch.randint(0, a.numel(), (self.per_batch,), generator=self.gen)
            a = a[idx]
        self.values[i].append(a)
        if not self.gated:
            return
        g = self._a.pop(i).detach().flatten()  # indexed where it is: only the sample crosses to the host
        self.gate_values[i].append((g if idx is None else g[idx.to(g.device)]).abs().float().cpu())
        xs, d = x.detach().flatten(), x.shape[-1]  # (tokens * d,)
        pick = (torch.randint(0, xs.numel(), (self.per_batch,), generator=self._xgen) if xs.numel() > self.per_batch
                else torch.arange(xs.numel()))
        v = xs[pick.to(xs.device)].abs().float().cpu()
        self.x_values[i].append(v)
        self.wina_values[i].append(v * self.norms[i][pick % d])

    def taus(self, target_sparsity: float) -> list[float]:
        """tau_l = the target_sparsity quantile of |h| in layer l: that share of (token, neuron) pairs is <= tau."""
        return [quantile_tau(torch.sort(torch.cat(vals)).values, target_sparsity) for vals in self.values]


def quantile_tau(v: torch.Tensor, sparsity: float) -> float:
    """The float32 threshold that `sparsity` of the sorted values `v` fall at or below: v[k], k = round(s * len) - 1."""
    if len(v) == 0:
        return 0.0
    k = min(len(v) - 1, max(0, int(round(sparsity * len(v))) - 1))
    return as_tau(float(v[k]))
