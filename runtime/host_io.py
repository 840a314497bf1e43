"""`HostIO`: one hybrid FFN layer's buffers between the compute device and the CPU's cold kernel
(runtime/hybrid_ffn.py): the FFN input x and the cold mask that the device writes for the CPU, and the CPU's sums that
the device reads back.

On CUDA they are pinned and also seen as device tensors (mapped), so that GPU kernels write x and the mask and read
the CPU's sums over PCIe themselves: no copy nodes and no dtype casts around them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch
from hotneurons.kernels.cold import mask_bytes
from hotneurons.runtime.cold_rows import host_mapped


@dataclass(frozen=True)
class HostIO:
    """One token's buffers between the device and the CPU's kernel, made at the first decode (`make`)."""

    x: torch.Tensor  # (d,) float32 the FFN input on the host
    x_np: np.ndarray  # (d,) float32 x's memory, as the kernel reads it
    mask_words: np.ndarray  # (ceil(n_cold / 64),) uint64 the cold mask as bits, bit j of word w = neuron 64 w + j
    part: np.ndarray  # (threads, d) float32 the kernel's per-thread partial sums
    out: np.ndarray  # (d,) float32 their sum; (0,) on CUDA, where the GPU adds `part` up itself
    x_dev: torch.Tensor  # (d,) float32 x's memory on the device, which a kernel writes
    mask_dev_bits: torch.Tensor  # (mask_bytes(n_cold),) uint8 the mask's memory on the device, which predict writes
    sums_dev: torch.Tensor  # (rows, d) float32 `part`, or `out` as one row, on the device: cold_sum adds the rows
    idx: np.ndarray  # (n_cold,) int64 scratch: a token's active cold positions, the first k
    mask_dev: torch.Tensor  # (n_cold,) bool the cold mask on the device, which its PCIe share reads

    @classmethod
    def make(cls, d_model: int, n_cold: int, device: torch.device) -> HostIO:
        """The buffers for a layer of width d_model with n_cold cold neurons, its compute device `device`."""
        pin = device.type == "cuda"
        x = torch.empty(d_model, dtype=torch.float32, pin_memory=pin)  # (d,)
        # (mask_bytes(n_cold),) bit b of byte i = cold neuron 8 i + b, zero padded to whole uint64 words; the GPU
        # writes the first ceil(n_cold / 8) bytes, the padding stays zero
        bits = torch.zeros(mask_bytes(n_cold), dtype=torch.uint8, pin_memory=pin).numpy()
        part = torch.zeros((numba.get_num_threads(), d_model), dtype=torch.float32, pin_memory=pin).numpy()
        out = torch.empty(0 if pin else d_model, dtype=torch.float32, pin_memory=pin).numpy()  # (d,) or (0,)
        x_np, sums = x.numpy(), (part if pin else out[None])  # the numpy views hold the pinned tensors alive
        return cls(x, x_np, bits.view(np.uint64), part, out,
                   host_mapped(x_np, x_np, device, register=False),
                   host_mapped(bits, bits, device, register=False),
                   host_mapped(sums, sums, device, register=False), np.empty(n_cold, np.int64),
                   torch.ones(n_cold, dtype=torch.bool, device=device))

    def cold_sum(self) -> torch.Tensor:
        """(d,) float32 on the compute device: the CPU's cold rows' sum for the token (CUDA: the GPU reads the
        threads' partial sums over PCIe and adds them up here)."""
        c = self.sums_dev  # (rows, d)
        return c[0] if c.shape[0] == 1 else c.sum(0)


@dataclass(frozen=True)
class MoEHostIO:
    """A mixture of experts layer's buffers for one decode token (runtime/moe_ffn.py): the FFN input, the routed
    experts and their weights, which the device writes for the CPU, and the cold experts' sum, which the device reads
    back. Pinned and mapped on CUDA (kernels write and read them over PCIe, as HostIO's); plain memory elsewhere."""

    x_np: np.ndarray  # (d,) float32 the FFN input
    ids: np.ndarray  # (k,) int64 the routed experts
    w: np.ndarray  # (k,) float32 their routing weights
    out: np.ndarray  # (1, d) float32 the cold experts' weighted sum
    x_dev: torch.Tensor  # the same four memories as device tensors
    ids_dev: torch.Tensor
    w_dev: torch.Tensor
    out_dev: torch.Tensor

    @classmethod
    def make(cls, d_model: int, k: int, device: torch.device) -> MoEHostIO:
        pin = device.type == "cuda"
        arrays = [torch.zeros(shape, dtype=dt, pin_memory=pin).numpy()
                  for shape, dt in (((d_model,), torch.float32), ((k,), torch.int64), ((k,), torch.float32),
                                    ((1, d_model), torch.float32))]
        return cls(*arrays, *(host_mapped(a, a, device, register=False) for a in arrays))
