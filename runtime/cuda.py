"""CUDA plumbing of the decode step: graph capture (`warm_up`, `capture`) and flags in pinned host memory that
captured graphs wait for and set (`HostFlags`, the driver's stream memory operations through ctypes); host memory
page-locked in place for the device's copies (`LockedHost`)."""

from __future__ import annotations

import ctypes
import mmap
import weakref
from typing import Any, Callable, Sequence

import numpy as np
import torch

_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for copies that overlap the main stream's work (made once: a stream per call
    would leave the allocator's cross-stream bookkeeping with ever new streams)."""
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]


def warm_up(device: torch.device, fn: Callable[[], Any], times: int = 2) -> None:
    """Run `fn` on a side stream and wait for it: what CUDA-graph capture needs first (lazy inits, autotuning)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(times):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)


def capture(device: torch.device, pieces: Sequence[Callable[[], Any]], keep: Sequence[torch.Tensor] = (),
            warm: Callable[[], Any] | None = None) -> tuple[list[torch.cuda.CUDAGraph], list[Any]]:
    """Each piece captured as a CUDA graph, in order, all in one memory pool (a graph may read what an earlier one
    wrote), after a warm-up that runs `warm` (default: the pieces in order). The warm-up and the capture run the
    pieces for nothing, so the tensors in `keep` (counts, caches they write) get their values back, also when either
    fails. Returns the graphs and what each piece returned (static outputs, which each replay overwrites)."""
    saved = [t.clone() for t in keep]
    try:
        warm_up(device, warm or (lambda: [piece() for piece in pieces]))
        graphs, outputs, pool = [], [], None
        for piece in pieces:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                outputs.append(piece())
            pool = g.pool()
            graphs.append(g)
    finally:
        for t, c in zip(keep, saved):
            t.copy_(c)
    return graphs, outputs


class HostFlags:
    """Flags in pinned host memory, both ways between the CPU and captured graphs. `wait(i)`, recorded into a graph,
    holds the stream until flag i is 1 and then sets it back to 0; `release(i)` (the CPU) sets it to 1. `signal(i)`,
    recorded into a graph, sets ready[i] to 1 once the work before it is done and its writes are visible to the host
    (the driver's default memory barrier); the CPU spins on it (cold.cold_layer) and resets it. Uses the driver's
    stream memory operations (cuStreamWaitValue32 / cuStreamWriteValue32) through ctypes. `open` returns None where
    they are missing or fail a probe (a captured wait released by the host, then a captured signal)."""

    EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ

    def __init__(self, n: int, lib: ctypes.CDLL):
        self.n = n
        self.flags = torch.zeros(n + 1, dtype=torch.int32, pin_memory=True)  # (n + 1,) CPU -> GPU; the last: probe
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
        addr = ctypes.c_uint64(self.dev + 4 * i)  # int32 flags: 4 bytes apart
        _check(self._wait(self._stream(), addr, 1, self.EQ))
        _check(self._write(self._stream(), addr, 0, 0))

    def signal(self, i: int) -> None:
        _check(self._write(self._stream(), ctypes.c_uint64(self.ready_dev + 4 * i), 1, 0))

    def release(self, i: int) -> None:
        self.host[i] = 1


class LockedHost:
    """Host arrays page-locked where they are (the driver's cuMemHostRegister, read-only: a file's mapping opened 'r'
    qualifies), so that copies from them to the device run at PCIe's rate and asynchronously; a pageable copy is
    staged by the driver through a small buffer at a fraction of it. The views' pages are rounded out to whole pages
    and overlapping ranges merged (the driver refuses a page registered twice). Pinned pages stay resident: they
    count in the process's RSS as the file's pages it has read. Unregistered when this object is freed; it keeps the
    views (and so their mapping) alive until then. The driver API leaves the runtime's last error alone, which torch
    checks after its launches."""

    READ_ONLY = 0x08  # CU_MEMHOSTREGISTER_READ_ONLY

    def __init__(self, views: Sequence[np.ndarray]):
        merged = page_spans(views)
        self.views = list(views)
        self.nbytes = sum(b - a for a, b in merged)  # bytes locked
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        done: list[int] = []
        weakref.finalize(self, _unregister, lib, done)
        for a, b in merged:
            err = lib.cuMemHostRegister_v2(ctypes.c_void_p(a), b - a, self.READ_ONLY)
            if err:
                raise RuntimeError(f"page-locking {b - a:,} B of host rows failed (CUDA driver error {err}; "
                                   f"{self.nbytes:,} B asked in all): raise the locked-memory limit (ulimit -l) or "
                                   f"free host RAM; copies run pageable meanwhile")
            done.append(a)


def page_spans(views: Sequence[np.ndarray], page: int = mmap.PAGESIZE) -> list[tuple[int, int]]:
    """The address ranges [a, b) of whole pages that cover the (C-contiguous) views, overlapping or touching ranges
    merged, ascending."""
    spans = sorted((v.ctypes.data // page * page, -(-(v.ctypes.data + v.nbytes) // page) * page)
                   for v in views if v.nbytes)
    merged: list[tuple[int, int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _unregister(lib: ctypes.CDLL, ptrs: list[int]) -> None:
    for a in ptrs:
        lib.cuMemHostUnregister(ctypes.c_void_p(a))


def _check(code: int) -> None:
    if code != 0:
        raise RuntimeError(f"CUDA driver error {code}")
