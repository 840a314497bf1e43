"""This machine's figures for the cost model (common/hardware.HardwareSpec), measured: DRAM read bandwidth as the cold
kernels read it (kernels/dram.py), the GPU's memory, PCIe and round trip, and the cold kernels' own rates."""

from __future__ import annotations

import dataclasses
import os
import time

from hotneurons.common.hardware import GiB, HardwareSpec


def _measure_dram_bw(cores: int, nbytes: int = 2**30, repeats: int = 3) -> float:
    """Read bandwidth over a buffer far larger than the caches (server L3s reach 300 MiB), one thread per core: the
    best of sequential numpy sums (numpy releases the GIL inside the reduction) and the cold kernels' own pattern
    (kernels.dram.row_gather_bw: rows in random order, 4 at once per thread), which keeps more reads in flight and
    so can read several times faster than the sums on a server."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    from hotneurons.kernels.dram import row_gather_bw

    a = np.ones(nbytes // 4, dtype=np.float32)  # (n,) 4 bytes each
    chunks = np.array_split(a, cores)
    best = float("inf")
    with ThreadPoolExecutor(cores) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(np.sum, chunks))
            best = min(best, time.perf_counter() - t0)
    return max(a.nbytes / best, row_gather_bw(a, cores, repeats))


def _measure_cuda() -> dict:
    import torch

    dev = torch.device("cuda")
    free, total = torch.cuda.mem_get_info()
    n = 256 * 2**20  # bytes per transfer
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(n, dtype=torch.uint8, device=dev)
    big = torch.empty(4 * n, dtype=torch.uint8, device=dev)
    big2 = torch.empty_like(big)

    def timed(fn, repeats=5) -> float:
        fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best

    pcie = n / timed(lambda: gpu.copy_(host, non_blocking=True))
    hbm = 2 * big.numel() / timed(lambda: big2.copy_(big))  # a copy reads and writes every byte
    small_h = torch.zeros(4096, dtype=torch.float32, pin_memory=True)
    small_d = torch.zeros(4096, dtype=torch.float32, device=dev)

    def round_trip():
        small_h.copy_(small_d)
        small_d.copy_(small_h)

    sync = min(timed(round_trip, repeats=20) for _ in range(3))
    return dict(vram_bytes=int(total), pcie_bw=pcie, gpu_bw=hbm, sync_latency_s=sync)


def measure_hardware(base: HardwareSpec) -> tuple[HardwareSpec, list[str]]:
    """Measure this machine. DRAM bandwidth and cores always; VRAM, PCIe and GPU memory bandwidth and the
    sync round trip only when CUDA is available (else the preset's values stay, and the notes say so)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    dram = _measure_dram_bw(cores)
    changes: dict = dict(cores=cores, cpu_bw=dram, dram_bw=dram, host=f"measured on this machine ({cores} cores)")
    notes = [f"measured DRAM read bandwidth {changes['cpu_bw'] / 1e9:.1f} GB/s with {cores} threads"]
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if cuda:
        measured = _measure_cuda()
        changes.update(measured)
        notes.append(f"measured GPU: {measured['vram_bytes'] / GiB:.1f} GiB, HBM {measured['gpu_bw'] / 1e9:.0f} GB/s, "
                     f"PCIe {measured['pcie_bw'] / 1e9:.1f} GB/s, round trip {measured['sync_latency_s'] * 1e6:.0f} us")
    else:
        notes.append(f"no CUDA device: VRAM, PCIe and GPU bandwidth and sync latency keep the '{base.name}' "
                     f"preset's values")
    return dataclasses.replace(base, name=f"{base.name}+measured", **changes), notes


def measure_cold_rate(hw: HardwareSpec, model: dict, sparsity: float | None, cold_dtype: str
                      ) -> tuple[HardwareSpec, str]:
    """hw with cpu_bw set to the rate of the cold kernels themselves (kernels.dram.cold_call_bw) on this machine, for
    rows of `cold_dtype` of the profiled `model` (its dict in the profile's meta) at about a fifth of a token's active
    neurons a call (a placement's usual cold share; `sparsity`: the profile's mean, None: 0.9). The solver prices an
    active cold neuron at cpu_bw: a DRAM figure (one long pass) would price it several times too cheap, and the
    budget would be left unused for hot rows; the note gives both."""
    from hotneurons.kernels.cold import set_threads
    from hotneurons.kernels.dram import cold_call_bw

    set_threads(None)  # the runtime's default threads
    active = (1.0 - (0.9 if sparsity is None else sparsity)) * int(model["n_neurons"])  # neurons a token
    rows = max(16, round(0.2 * active))
    rate = cold_call_bw(int(model["d_model"]), cold_dtype, bool(model["gated"]), rows)
    note = (f"measured the {cold_dtype} cold kernel at {rate / 1e9:.1f} GB/s on calls of {rows} neurons (DRAM "
            f"{hw.cpu_bw / 1e9:.1f} GB/s): the cost model's CPU rate")
    return hw.replace(cpu_bw=rate), note


def measure_expert_rate(hw: HardwareSpec, d_model: int, n_ff_exp: int, k: int, cold_dtype: str
                        ) -> tuple[HardwareSpec, str]:
    """hw with cpu_bw set to the rate of the cold experts' kernel (kernels.dram.expert_call_bw) on this machine, for
    experts of the profiled shape in `cold_dtype` blocks, about a quarter of the k routed experts a call (a
    placement's usual cold share); the dense cold kernel's rate on a handful of neurons says nothing of it."""
    from hotneurons.kernels.cold import set_threads
    from hotneurons.kernels.dram import expert_call_bw

    set_threads(None)  # the runtime's default threads
    per = max(1, round(k / 4))
    cold_dtype = cold_dtype if cold_dtype in ("q4_0", "q4_1", "q8_0") else "q8_0"  # float experts: about q8_0's bytes
    rate = expert_call_bw(d_model, n_ff_exp, cold_dtype, per)
    note = (f"measured the {cold_dtype} cold experts' kernel at {rate / 1e9:.1f} GB/s on calls of {per} experts "
            f"(DRAM {hw.cpu_bw / 1e9:.1f} GB/s): the cost model's CPU rate")
    return hw.replace(cpu_bw=rate), note
