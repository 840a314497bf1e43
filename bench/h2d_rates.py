"""Host -> GPU copy rates of the sources a long prefill copies cold rows from: anonymous pageable memory, a file's
read-only mapping (the GGUF's rows, as the runtime reads them; page cache warm), the same mapping registered with
CUDA (cudaHostRegister, read-only flag: page-locked in place), and torch's pinned memory. Each copy of `--mb` MB in
`--pieces` equal pieces (a layer's cold experts arrive as runs of consecutive experts),
timed by CUDA events, median of --reps.

    python -m bench.h2d_rates --out results.json [--mb 256 --pieces 1,16,96]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: the pages may be mapped without write access (a file opened 'r')


def rate(src: np.ndarray, dst, pieces: int, reps: int) -> float:
    """GB/s of copying src (bytes) to the device tensor dst in `pieces` equal copies."""
    import torch

    step = len(src) // pieces
    parts = [torch.from_numpy(src[i * step:(i + 1) * step]) for i in range(pieces)]
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for i, p in enumerate(parts):
            dst[i * step:(i + 1) * step].copy_(p, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return step * pieces / float(np.median(times)) / 1e9


def main(argv: list[str] | None = None) -> dict:
    import torch

    from bench.record import write_result

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--pieces", default="1,16,96")
    p.add_argument("--reps", type=int, default=7)
    a = p.parse_args(argv)
    n = a.mb << 20
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    anon = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pinned.copy_(torch.from_numpy(anon))
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        path = Path(tmp) / "rows.bin"
        anon.tofile(path)
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
        _ = int(mapped.sum(dtype=np.uint64))  # page cache warm, pages mapped
        figures: dict = {"mb": a.mb, "reps": a.reps, "gb_s": {}}
        for pieces in map(int, a.pieces.split(",")):
            row = {"anonymous_pageable": rate(anon, dst, pieces, a.reps),
                   "file_mapping_pageable": rate(mapped, dst, pieces, a.reps),
                   "pinned": rate(pinned.numpy(), dst, pieces, a.reps)}
            figures["gb_s"][str(pieces)] = row
        cudart = torch.cuda.cudart()
        t0 = time.perf_counter()
        err = int(cudart.cudaHostRegister(mapped.ctypes.data, n, REGISTER_READ_ONLY))
        figures["register_s"] = round(time.perf_counter() - t0, 4)
        figures["register_error"] = err
        if not err:
            for pieces in map(int, a.pieces.split(",")):
                figures["gb_s"][str(pieces)]["file_mapping_registered"] = rate(mapped, dst, pieces, a.reps)
            cudart.cudaHostUnregister(mapped.ctypes.data)
        del mapped
    for k, row in figures["gb_s"].items():
        print(k, {m: round(v, 1) for m, v in row.items()})
    print({k: v for k, v in figures.items() if k != "gb_s"})
    write_result(a.out, figures)
    return figures


if __name__ == "__main__":
    main()
