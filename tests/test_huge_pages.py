"""kernels/dram.huge_empty: the cold rows' memory is advised for 2 MiB pages (THP), and holds what is written."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kib(addr: int) -> int | None:
    """AnonHugePages (KiB) of the mapping holding addr, from /proc/self/smaps."""
    span = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            span = (int(m.group(1), 16), int(m.group(2), 16))
        elif span and span[0] <= addr < span[1] and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return None


def test_huge_empty_holds_rows_and_small_arrays_stay_plain():
    from hotneurons.kernels.dram import HUGE_PAGE, huge_empty

    a = huge_empty((3 * HUGE_PAGE // 4608 + 1, 4608), np.uint8)
    assert a.shape == (3 * HUGE_PAGE // 4608 + 1, 4608) and a.dtype == np.uint8 and a.flags.c_contiguous
    src = np.random.default_rng(0).integers(0, 256, a.shape, dtype=np.uint8)
    torch.from_numpy(a).copy_(torch.from_numpy(src))  # as ColdRows fills it
    assert np.array_equal(a, src)
    b = huge_empty((4, 5), np.float32)
    assert b.shape == (4, 5) and b.base is None  # np.empty's own


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_huge_empty_gets_huge_pages():
    from hotneurons.kernels.dram import HUGE_PAGE, huge_empty

    a = huge_empty((16 * HUGE_PAGE,), np.uint8)
    a[:] = 1  # first touch: the faults take 2 MiB pages
    kib = _huge_kib(a.ctypes.data)
    assert kib is not None and kib >= HUGE_PAGE // 1024, kib  # at least one (memory too fragmented for all)
