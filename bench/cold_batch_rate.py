"""The batched cold kernel (kernels/cold_batch.py) against the batch-1 kernel run token by token: one layer's cold rows
of a 70B shape (Q4_0, d 8192, 20,000 cold neurons: 276 MB), B tokens whose masks mark `--density` of the rows each,
drawn with a skew (the union of B masks grows as 1 - (1 - p)^B per row). Per B: ms for the B tokens both ways, the
rows the union holds against the rows marked, and the bytes a step reads / its time. Medians of --reps.

    python -m bench.cold_batch_rate --out results.json [--neurons 20000 --d 8192 --batches 1,2,4,8]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np


def measure(neurons: int, d: int, batches: list[int], density: float, reps: int, seed: int = 0) -> dict:
    import torch
    from hotneurons.kernels.cold_batch import union
    from hotneurons.runtime import cold_rows as C
    from hotneurons.runtime.batch import ffn_rows_batch
    from hotneurons.solver.synthetic import powerlaw_probs

    rng = np.random.default_rng(seed)

    def w() -> torch.Tensor:
        return torch.from_numpy(rng.standard_normal((neurons, d), dtype=np.float32) / np.sqrt(d))

    rows = C.ColdRows.from_weights(w(), w(), None, w(), "q4_0")
    p = rng.permutation(powerlaw_probs(neurons, 1.0, density))  # (neurons,) each row's firing probability
    row_bytes = rows.up.shape[1] * 3  # gate, up and down_t rows of a neuron
    out: dict = {"neurons": neurons, "d": d, "density": density, "format": "q4_0", "reps": reps, "batches": {}}
    for B in batches:
        xs = rng.standard_normal((B, d), dtype=np.float32)
        masks = rng.random((B, neurons)) < p  # (B, neurons)
        idx, member = union(masks)
        each = [np.flatnonzero(m).astype(np.int64) for m in masks]
        ob, o1 = np.empty((B, d), np.float32), np.empty(d, np.float32)
        ffn_rows_batch("swiglu", xs, idx, member, rows, ob)  # compiled and warm
        for b in range(B):
            C.ffn_rows("swiglu", xs[b], each[b], rows, o1)
        tb, t1 = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            ffn_rows_batch("swiglu", xs, idx, member, rows, ob)
            tb.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for b in range(B):
                C.ffn_rows("swiglu", xs[b], each[b], rows, o1)
            t1.append(time.perf_counter() - t0)
        mb, m1 = float(np.median(tb)), float(np.median(t1))
        out["batches"][str(B)] = {"batched_ms": mb * 1e3, "token_by_token_ms": m1 * 1e3, "speedup": m1 / mb,
                                  "union_rows": int(len(idx)), "marked_rows": int(masks.sum()),
                                  "batched_gb_s": len(idx) * row_bytes / mb / 1e9,
                                  "token_by_token_gb_s": int(masks.sum()) * row_bytes / m1 / 1e9}
    return out


def main(argv: list[str] | None = None) -> dict:
    from bench.record import write_result

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--neurons", type=int, default=20000)
    ap.add_argument("--d", type=int, default=8192)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--density", type=float, default=0.1, help="mean share of rows a token marks")
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args(argv)
    figures = measure(a.neurons, a.d, [int(b) for b in a.batches.split(",")], a.density, a.reps)
    for B, r in figures["batches"].items():
        print(f"B={B}: batched {r['batched_ms']:.2f} ms ({r['batched_gb_s']:.1f} GB/s of the union) against "
              f"{r['token_by_token_ms']:.2f} ms token by token: {r['speedup']:.2f}x; union {r['union_rows']} of "
              f"{r['marked_rows']} marked rows")
    write_result(a.out, figures)
    return figures


if __name__ == "__main__":
    main()
