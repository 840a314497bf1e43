"""Forward hooks that count which FFN neurons fire, and a reservoir of (FFN input, mask) samples on disk.

No model code is edited: per decoder layer, one forward pre-hook on the down projection sees the per-neuron
activation values h (what `fc2` / `down_proj` multiplies), and, only on batches that feed the reservoir, one
pre-hook on the up projection sees the FFN input x.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from powerinfer.models import RELU_FAMILY, LoadedModel


def activation_rule(activation: str) -> str:
    """ReLU-family: a neuron is active iff its value is nonzero (exact). Others: iff |h| > tau_l."""
    return "nonzero" if activation in RELU_FAMILY else "abs>tau"


def active_mask(h: torch.Tensor, tau: float | None) -> torch.Tensor:
    """(tokens, neurons) activation values -> bool mask of active neurons."""
    return h != 0 if tau is None else h.abs() > tau


class SampleReservoir:
    """Uniform reservoir sample of token rows, shared by all layers, stored as .npy memory maps.

    Per layer: `layer_{i:03d}.x.npy` float16 (capacity, d_model) and `layer_{i:03d}.mask.npy` uint8
    (capacity, ceil(n_neurons / 8)), the mask bit-packed along neurons (np.packbits, big bit order).
    Which rows a batch writes depends only on (seed, rank, batch index, tokens seen), so a resumed run
    writes exactly what an uninterrupted one does.
    """

    def __init__(self, folder: Path, capacity: int, n_layers: int, d_model: int, n_neurons: int,
                 seed: int, rank: int = 0, resume: bool = False):
        self.folder, self.capacity, self.seed, self.rank = folder, capacity, seed, rank
        folder.mkdir(parents=True, exist_ok=True)
        mode = "r+" if resume else "w+"
        nbytes = (n_neurons + 7) // 8
        self.x = [self._open(f"layer_{i:03d}.x.npy", mode, np.float16, (capacity, d_model)) for i in range(n_layers)]
        self.mask = [self._open(f"layer_{i:03d}.mask.npy", mode, np.uint8, (capacity, nbytes))
                     for i in range(n_layers)]
        self.pos: torch.Tensor | None = None  # flat token positions of the current batch to store
        self.slot: np.ndarray | None = None  # their reservoir slots

    def _open(self, name: str, mode: str, dtype, shape) -> np.memmap:
        path = self.folder / name
        if mode == "r+":
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

    def write(self, layer: int, x: torch.Tensor | None, mask: torch.Tensor) -> None:
        if self.pos is None:
            return
        if x is not None:
            self.x[layer][self.slot] = x[self.pos].to(torch.float16).cpu().numpy()
        self.mask[layer][self.slot] = np.packbits(mask[self.pos].cpu().numpy(), axis=1)

    def flush(self) -> None:
        for arr in (*self.x, *self.mask):
            arr.flush()


class ActivationCounter:
    """Installs the hooks on a loaded model; `counts` accumulates (layers, neurons) int64 on the model's device."""

    def __init__(self, lm: LoadedModel, taus: list[float] | None, reservoir: SampleReservoir | None = None):
        info = lm.info
        self.lm, self.taus, self.reservoir = lm, taus, reservoir
        device = next(lm.model.parameters()).device
        self.counts = torch.zeros(info["n_layers"], info["n_neurons"], dtype=torch.int64, device=device)
        self._x: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def __enter__(self) -> "ActivationCounter":
        for i, layer in enumerate(self.lm.layers):
            ffn = self.lm.adapter.layer_ffn(layer)
            self._handles.append(ffn["up"].register_forward_pre_hook(self._up_hook(i)))
            self._handles.append(ffn["down"].register_forward_pre_hook(self._down_hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _up_hook(self, i: int):
        def hook(_mod, args):
            if self.reservoir is not None and self.reservoir.pos is not None:
                self._x[i] = args[0].reshape(-1, args[0].shape[-1])  # (tokens, d_model)
        return hook

    def _down_hook(self, i: int):
        def hook(_mod, args):
            h = args[0].reshape(-1, args[0].shape[-1])  # (tokens, neurons)
            mask = active_mask(h, None if self.taus is None else self.taus[i])
            self.counts[i] += mask.sum(0)
            if self.reservoir is not None:
                self.reservoir.write(i, self._x.pop(i, None), mask)
        return hook


class MagnitudeCollector:
    """Calibration hooks: keep a random subset of |h| per layer, to set tau_l at a target sparsity."""

    def __init__(self, lm: LoadedModel, per_batch: int = 1 << 18, seed: int = 0):
        self.lm, self.per_batch = lm, per_batch
        self.values: list[list[torch.Tensor]] = [[] for _ in range(lm.info["n_layers"])]
        self.gen = torch.Generator().manual_seed(seed)
        self._handles: list = []

    def __enter__(self) -> "MagnitudeCollector":
        for i, layer in enumerate(self.lm.layers):
            down = self.lm.adapter.layer_ffn(layer)["down"]
            self._handles.append(down.register_forward_pre_hook(self._hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()

    def _hook(self, i: int):
        def hook(_mod, args):
            a = args[0].detach().abs().flatten().float().cpu()
            if a.numel() > self.per_batch:
                a = a[torch.randint(0, a.numel(), (self.per_batch,), generator=self.gen)]
            self.values[i].append(a)
        return hook

    def taus(self, target_sparsity: float) -> list[float]:
        """tau_l = the target_sparsity quantile of |h| in layer l: that share of (token, neuron) pairs is <= tau."""
        out = []
        for vals in self.values:
            v = torch.sort(torch.cat(vals)).values
            k = min(len(v) - 1, max(0, int(round(target_sparsity * len(v))) - 1))
            out.append(float(v[k]))
        return out
