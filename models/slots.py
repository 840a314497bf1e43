"""A decoder's KV cache slots (models/common.Decoder), for decoding several sequences (runtime/batch.py).

Slot 0 is the sequence in the decoder's own cache tensors: those a decode step's CUDA graphs were captured over
(runtime/source_steps.py). Slots 1.. are other sequences' caches (`add`). A slot names a sequence, not a tensor:
`resident(b)` moves slot b's sequence into the own tensors, so that the batch-1 step (graphs and all) can decode it,
by exchanging its keys and values with those of the sequence there now, over the positions either has written; the
two swap their tensors' names, and nothing moves while the same sequence stays resident.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

SWAP_BYTES = 64 << 20  # the spare room an exchange takes (a 70B's 4,096 positions are 1.3 GB a cache)


class Slots:
    def __init__(self, dec):
        self.dec = dec
        self.extra: list[tuple[torch.Tensor, torch.Tensor]] = []  # physical caches 1.. (k, v), each as the own
        self.where = [0]  # slot -> physical cache (0: the decoder's own tensors)
        self.filled = [0]  # physical cache -> positions written (an upper bound)
        self.bound = 0  # the physical cache the decoder's k_cache / v_cache name now
        self.rows: tuple[list[int], list[int], torch.Tensor] | None = None  # batch_rows: slots, positions, (T,)
        self.version = 0  # moves at every write or move of any cache: what a reuse of cached keys checks (generate)

    def __len__(self) -> int:
        return len(self.where)

    def add(self, n: int) -> None:
        """Hold `n` sequences' caches (keeping those made before; fewer only while slots and caches match)."""
        dec = self.dec
        if n < len(self) and self.where != list(range(len(self))):
            raise ValueError("slots cannot be dropped while a sequence lives in another slot's cache: reset first")
        self.extra = self.extra[:n - 1] + [(torch.zeros_like(dec.k_cache), torch.zeros_like(dec.v_cache))
                                           for _ in range(n - 1 - len(self.extra))]
        # growing keeps where each sequence lives (resident() may have moved them); shrinking happens only unmoved
        self.where = self.where[:n] + list(range(len(self.where), n))
        self.filled = self.filled[:n] + [0] * (n - len(self.filled))

    def check(self, b: int) -> None:
        if not 0 <= b < len(self):
            raise ValueError(f"slot {b} does not exist: the model holds {len(self)} (add_slots)")

    @contextmanager
    def bind(self, b: int):
        """Within: the decoder's k_cache / v_cache are slot b's; the own tensors again after."""
        self.check(b)
        p, dec = self.where[b], self.dec
        if p == 0:
            yield
            return
        own = (dec.k_cache, dec.v_cache)
        dec.k_cache, dec.v_cache = self.extra[p - 1]
        self.bound = p
        try:
            yield
        finally:
            dec.k_cache, dec.v_cache = own
            self.bound = 0

    def wrote(self, n: int) -> None:
        """The bound cache holds positions up to n - 1 (prefill, eager attention, a graph step)."""
        self.filled[self.bound] = max(self.filled[self.bound], n)
        self.version += 1

    def reset(self) -> None:
        self.filled[self.bound] = 0
        self.version += 1

    def free(self, b: int) -> None:
        """Slot b's sequence has ended: its positions need not move with the next exchange."""
        self.check(b)
        self.filled[self.where[b]] = 0

    def resident(self, b: int) -> None:
        """Slot b's sequence into the decoder's own tensors (see the module's docstring)."""
        self.check(b)
        if self.bound != 0:
            raise RuntimeError("resident() inside slot(): call it where the decoder's own cache is bound")
        p = self.where[b]
        if p == 0:
            return
        a = self.where.index(0)  # the slot whose sequence is there now
        n = max(self.filled[0], self.filled[p])
        dec = self.dec
        for own, other in zip((dec.k_cache, dec.v_cache), self.extra[p - 1]):  # (layers, kv heads, ctx, hd) each
            per_layer = own[0, :, :n].numel() * own.element_size()  # bytes
            step = max(1, SWAP_BYTES // max(1, per_layer))  # layers a copy: its spare room stays small
            for a0 in range(0, own.shape[0], step):
                mine, theirs = own[a0:a0 + step, :, :n], other[a0:a0 + step, :, :n]
                kept = mine.clone()
                mine.copy_(theirs)
                theirs.copy_(kept)
        self.filled[0], self.filled[p] = self.filled[p], self.filled[0]
        self.version += 1
        self.where[a], self.where[b] = p, 0

    @contextmanager
    def batch_rows(self, slots: list[int], positions: list[int]):
        """Within: the decoder's calls take T rows, row b sequence slots[b]'s token at positions[b] (Decoder.rows)."""
        for b, p in zip(slots, positions):
            self.check(b)
            if not 0 <= p < self.dec.ctx:
                raise ValueError(f"position {p} is past the KV cache of {self.dec.ctx} tokens: build the model with a "
                                 f"larger ctx")
        self.rows = (list(slots), list(positions), torch.tensor(positions, device=self.dec.device))
        try:
            yield
        finally:
            self.rows = None

    def each_row(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                 scale: float | None) -> torch.Tensor:
        """Layer i's cached attention of each row in its own slot -> (T, H * hd)."""
        out = []
        for b, (s, p) in enumerate(zip(*self.rows[:2])):
            with self.bind(s):
                out.append(self.dec._cached(i, q[b:b + 1], k[b:b + 1], v[b:b + 1], pos[b:b + 1], p, scale))
        return torch.cat(out)
