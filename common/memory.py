"""Host memory as every plan counts it: what the machine has available (`available_host`), the slack a process keeps
beyond what a plan counts, and the one-line refusal of a plan that would not fit. The runtime's layout
(runtime/memory.py) and the layer-by-layer stages (models/stream_memory.py) both check against it. And what this
process holds (`process_memory`: resident, peak, anonymous and file-backed), which pi-generate reports.

HOTNEURONS_HOST_MEMORY (a size such as 16GB) replaces the host memory the checks see as available: to plan for
another machine, or to test the refusal.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hotneurons.common.units import parse_bytes

SLACK = 256 << 20  # bytes: interpreter, kernels' scratch, small buffers


class MemoryPlanError(ValueError):
    """A layout that would not fit: one line naming what it needs, what there is, and the fix."""


def available_host() -> int:
    env = os.environ.get("HOTNEURONS_HOST_MEMORY")
    if env:
        return parse_bytes(env)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: no check


@dataclass(frozen=True)
class ProcessMemory:
    """This process's resident memory, in bytes, as the kernel counts it (/proc/self/status)."""

    rss: int  # VmRSS: resident now
    peak: int  # VmHWM: the largest rss so far (the kernel's high-water mark)
    anon: int  # RssAnon: heap, tensors, compiled kernels
    file: int  # RssFile: pages of mapped files: the libraries' code, a model read in place


def process_memory() -> ProcessMemory | None:
    """This process's memory now; None where /proc is missing (not Linux)."""
    keys = {"VmRSS": "rss", "VmHWM": "peak", "RssAnon": "anon", "RssFile": "file"}
    got: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:  # "VmRSS:\t  1788 kB"
                key, _, value = line.partition(":")
                if key in keys:
                    got[keys[key]] = int(value.split()[0]) * 1024
    except OSError:
        return None
    return ProcessMemory(**got) if len(got) == len(keys) else None
