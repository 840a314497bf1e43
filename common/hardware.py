"""What a machine can do, in the few numbers the placement cost model and the runtime need.

Presets carry published figures (vendor spec sheets; host figures are the theoretical peak of the memory
configuration named in `host`), so they are upper bounds: `measure_hardware()` (kernels/measure.py) replaces
them with this machine's measured values.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from dataclasses import dataclass

GiB = 2**30

# A single core streams roughly this much from DRAM; the CPU side of a layer cannot go faster than
# min(DRAM bandwidth, cores * this). Order of magnitude of one modern x86 core's read bandwidth.
PER_CORE_DRAM_BW = 12e9  # bytes/s


def openmp_wait_policy() -> str:
    """Choose OMP_WAIT_POLICY, unless the user set it; call before torch loads (libgomp reads it once). Returns it.

    torch and Numba each run a pool of OpenMP threads. Without a GPU they take turns on the same cores at every
    layer, and threads of one pool spinning after their work starve the other: PASSIVE (sleep at once), or CPU
    decode runs many times slower. With an NVIDIA GPU the CPU runs little besides the cold kernel, once per layer
    with sub-millisecond gaps, and waking sleeping threads at every layer costs more than the kernel saves
    (docs/history.md has the measurements). So ACTIVE, with the spin bounded (GOMP_SPINCOUNT) so that idle
    threads still go to sleep."""
    gpu = os.path.exists("/proc/driver/nvidia/version") and os.environ.get("CUDA_VISIBLE_DEVICES") not in ("", "-1")
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "ACTIVE" if gpu else "PASSIVE"
        if gpu:
            os.environ.setdefault("GOMP_SPINCOUNT", "10000000")
    spin = os.environ.get("GOMP_SPINCOUNT")
    return os.environ["OMP_WAIT_POLICY"] + (f", GOMP_SPINCOUNT={spin}" if spin else "")


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    vram_bytes: int  # bytes of GPU memory (0: no GPU)
    pcie_bw: float  # bytes/s, host <-> GPU
    gpu_bw: float  # bytes/s, GPU memory (HBM / GDDR)
    cpu_bw: float  # bytes/s, host DRAM read bandwidth (pi-solve --measure: the cold kernel's own rate)
    cores: int  # CPU cores the runtime computes cold neurons on
    sync_latency_s: float  # s, per layer: one small GPU->CPU + CPU->GPU round trip and the wait
    reserve_bytes: int  # bytes of VRAM kept for the CUDA context, cuBLAS workspace, allocator slack
    host: str = ""  # which host the CPU figures describe
    # bytes/s of one long streaming read of host DRAM (0: cpu_bw): what a layer split's CPU layers read at, where
    # cpu_bw became the cold kernel's slower rate on scattered rows (kernels/measure.measure_cold_rate)
    dram_bw: float = 0.0

    @property
    def has_gpu(self) -> bool:
        return self.vram_bytes > 0 and self.gpu_bw > 0

    @property
    def effective_cpu_bw(self) -> float:
        """bytes/s the CPU side can read: DRAM bandwidth, unless too few cores to saturate it."""
        return min(self.cpu_bw, self.cores * PER_CORE_DRAM_BW)

    @property
    def stream_bw(self) -> float:
        """bytes/s the CPU side reads whole matrices at (the layer split's CPU layers): DRAM, unless too few cores."""
        return min(self.dram_bw or self.cpu_bw, self.cores * PER_CORE_DRAM_BW)

    def replace(self, **changes) -> "HardwareSpec":
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def describe(self) -> str:
        gpu = f"{self.vram_bytes / GiB:.0f} GiB, {self.gpu_bw / 1e9:.0f} GB/s" if self.has_gpu else "no GPU"
        return (f"{self.name}: GPU {gpu}; PCIe {self.pcie_bw / 1e9:.1f} GB/s; DRAM {self.cpu_bw / 1e9:.1f} GB/s, "
                f"{self.cores} cores; sync {self.sync_latency_s * 1e6:.0f} us; "
                f"reserve {self.reserve_bytes / GiB:.2f} GiB")


_SYNC = 30e-6  # s: a small device-to-host plus host-to-device round trip over PCIe takes a few tens of us
_DESKTOP_DDR5 = dict(cpu_bw=76.8e9, cores=8, host="desktop, 2-channel DDR5-4800, 8 performance cores")
_DESKTOP_DDR4 = dict(cpu_bw=51.2e9, cores=8, host="desktop, 2-channel DDR4-3200, 8 performance cores")
_SERVER_DDR4 = dict(cpu_bw=204.8e9, cores=32, host="server socket, 8-channel DDR4-3200, 32 cores")
_SERVER_DDR5 = dict(cpu_bw=307.2e9, cores=32, host="server socket, 8-channel DDR5-4800, 32 cores")

_GPU = dict(sync_latency_s=_SYNC, reserve_bytes=GiB)  # every GPU preset: the same sync latency and reserve

HARDWARE: dict[str, HardwareSpec] = {
    "rtx4090": HardwareSpec("rtx4090", 24 * GiB, 32e9, 1008e9, **_GPU, **_DESKTOP_DDR5),
    "rtx3090": HardwareSpec("rtx3090", 24 * GiB, 32e9, 936e9, **_GPU, **_DESKTOP_DDR5),
    "rtx2080ti": HardwareSpec("rtx2080ti", 11 * GiB, 16e9, 616e9, **_GPU, **_DESKTOP_DDR4),
    "a100-40g": HardwareSpec("a100-40g", 40 * GiB, 32e9, 1555e9, **_GPU, **_SERVER_DDR4),
    "a100-80g": HardwareSpec("a100-80g", 80 * GiB, 32e9, 2039e9, **_GPU, **_SERVER_DDR4),
    "h100": HardwareSpec("h100", 80 * GiB, 64e9, 3350e9, **_GPU, **_SERVER_DDR5),
    "cpu-only": HardwareSpec("cpu-only", 0, 0.0, 0.0, sync_latency_s=0.0, reserve_bytes=0, **_DESKTOP_DDR5),
}


class UnknownHardware(ValueError):
    pass


def get_hardware(name: str) -> HardwareSpec:
    key = name.strip().lower()
    if key not in HARDWARE:
        raise UnknownHardware(f"unknown hardware {name!r}: known presets are {', '.join(HARDWARE)}")
    return HARDWARE[key]


def presets_table() -> str:
    rows = [f"{'name':<10} {'VRAM':>8} {'GPU BW':>10} {'PCIe':>9} {'DRAM':>10} {'cores':>5}  host"]
    for h in HARDWARE.values():
        rows.append(f"{h.name:<10} {h.vram_bytes / GiB:>4.0f} GiB {h.gpu_bw / 1e9:>5.0f} GB/s "
                    f"{h.pcie_bw / 1e9:>4.0f} GB/s {h.cpu_bw / 1e9:>5.1f} GB/s {h.cores:>5}  {h.host}")
    return "\n".join(rows)


def machine_info(*packages: str) -> dict:
    """What a results file records about the machine it was measured on, plus the versions of `packages`."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    info = {"nproc": os.cpu_count(), "cpu_model": cpu, "platform": platform.platform(),
            "python": platform.python_version(), "numa_nodes": len(glob.glob("/sys/devices/system/node/node[0-9]*"))}
    try:  # hyperthreads: 16 CPUs as 8 cores x 2 share each core's memory queues
        with open("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list") as f:
            info["threads_per_core"] = sum(len(range(int(a), int(b) + 1)) if b else 1
                                           for a, _, b in (r.partition("-") for r in f.read().strip().split(",")))
    except (OSError, ValueError):
        pass
    try:  # the kernel's huge-page policy: it decides whether large host arrays (cold rows) get 2 MiB pages
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            info["transparent_hugepage"] = f.read().strip()
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        info["gpu"] = None
    for name in packages:
        try:
            info[name] = version(name)
        except PackageNotFoundError:
            info[name] = None
    return info
