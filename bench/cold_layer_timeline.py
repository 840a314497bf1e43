"""Where one decode layer's CPU part spends its time, with no Python between the calls: a compiled loop runs what
kernels.cold_layer runs (the packed cold mask -> positions, serially, then the kernel over those rows) on `windows`
copies of a LLaMA-2-70B-shaped layer taken in turn, a new mask each call, the host spinning `--gap-us` before each
call as it waits for the GPU's `pre` in decode. Each phase is read from the CPU's time-stamp counter (medians over
the calls, us):

  scan   the packed mask -> positions (kernels.bit_indices, serial)
  fork   the scan's end to the first kernel thread's start
  work   a thread's claims, mean over the threads
  tail   the last thread's end after the mean end
  after  the last thread's end to the kernel's return (the partial rows' sum, a second parallel region, the join)
  call   scan to return

--sums picks what follows the claims (kernel_variants.SUMS, timed in turn, --rounds times): `sum` (cold_ffn's: all
threads sum a slice of d of the partial rows each), `none` (the rows left for a reader elsewhere, e.g. the GPU over
PCIe), `nt` (each thread copies its row out of its caches with non-temporal stores, and the sum reads the copies).

The kernel is kernel_variants.dynamic with its stamps, claiming as cold_ffn does (8 neurons at a time, the last 8 per
thread 4 at a time; ReGLU, bf16 rows), so the figures are cold_ffn's as decode calls it, less the ready-flag spin and
the marks tally. The other layers' rows are what evicts a layer's rows between its calls, as in decode (8 copies of a
70B layer: 11 GB at 5%, against the H100 host's 300 MiB L3).

Usage: python bench/cold_layer_timeline.py OUT.json [--density 0.05] [--calls 96] [--gap-us 0,160] [--sums sum]
       [--rounds 1] [n d]"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numba
import numpy as np
import torch
from numba import njit

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_variants as kv  # noqa: E402  (imports powerinfer.* from this checkout)

from powerinfer.runtime import kernels as K  # noqa: E402
from powerinfer.runtime.cold_rows import ColdRows  # noqa: E402

PHASES = ("scan", "fork", "work", "tail", "after", "call")


@njit(nogil=True)
def _calls(words, idx, x, gate, up, down_t, scale, part, out, counter, stamps, phases, n, gap, tail, sums, spare):
    """Call c: spin `gap` ticks, then the scan of words[c] (a packed mask of n) and the kernel on window
    c % windows; phases[c] = the ticks of each phase (PHASES) and the active count."""
    windows = gate.shape[0] // n
    for c in range(words.shape[0]):
        t = kv._cycles()
        while kv._cycles() - t < gap:
            pass
        lo = (c % windows) * n
        t0 = kv._cycles()
        k = K.bit_indices(words[c], n, idx)
        t1 = kv._cycles()
        stamps[:] = 0
        kv.dynamic(x, idx[:k], gate[lo:lo + n], up[lo:lo + n], down_t[lo:lo + n], scale[:, lo:lo + n], down_t.shape[1],
                   part, out, counter, K.CHUNK, 4, tail, stamps, sums, spare)
        t2 = kv._cycles()
        first, last, ends, work, used = t2, t0, 0.0, 0.0, 0
        for r in range(stamps.shape[0]):
            if stamps[r, 0] > 0:
                first, last = min(first, stamps[r, 0]), max(last, stamps[r, 1])
                ends += stamps[r, 1]
                work += stamps[r, 1] - stamps[r, 0]
                used += 1
        used = max(used, 1)
        phases[c, 0], phases[c, 1] = t1 - t0, first - t1
        phases[c, 2], phases[c, 3] = work / used, last - ends / used
        phases[c, 4], phases[c, 5], phases[c, 6] = t2 - last, t2 - t0, k


def main(out: Path, n: int = 28672, d: int = 8192, density: float = 0.05, calls: int = 96,
         gaps_us: tuple[float, ...] = (0.0, 160.0), windows: int = 8, sums: tuple[str, ...] = ("sum",),
         rounds: int = 1) -> dict:
    g = torch.Generator().manual_seed(0)
    w = lambda: torch.randn(n, d, generator=g) * 0.02  # noqa: E731
    one = ColdRows.from_weights(w(), w(), None, w(), "bf16")
    x = torch.randn(d, generator=g).numpy().astype(np.float32)
    positive = np.flatnonzero(one.float32()["gate"].numpy() @ x > 0)  # what a predictor marks: every row is read
    tile = lambda a: np.tile(a, (windows, 1))  # noqa: E731  (windows * n, d) rows
    gate, up, down_t = tile(one.gate), tile(one.up), tile(one.down_t)
    scale = np.tile(one.scale, (1, windows, 1))
    wide = {name: t.double().numpy() for name, t in one.float32().items() if t is not None}  # the float64 reference's
    del one
    threads = numba.get_num_threads()
    k = min(len(positive), max(1, int(density * n)))
    rng = np.random.default_rng(0)
    masks = np.zeros((calls, n), np.bool_)
    for c in range(calls):
        masks[c, rng.choice(positive, k, replace=False)] = True
    words = np.stack([K.pack_mask(m) for m in masks]).view(np.uint64)  # (calls, ceil(n / 64)) as the GPU writes them
    idx = np.empty(n, np.int64)
    part, o = np.empty((threads, d), np.float32), np.empty(d, np.float32)
    counter, stamps = np.zeros(1, np.int64), np.zeros((threads, 2), np.int64)
    ticks_per_us = kv.ticks_per_us()
    res = {"command": "python " + " ".join(sys.argv), "threads": threads, "n": n, "d": d, "density": density,
           "active_rows": k, "windows": windows, "calls": calls, "tsc_ticks_per_us": ticks_per_us, "runs": []}
    row_bytes = 3 * (d * 2 + 4)  # gate, up, down rows and their scales
    spare = np.empty((threads, d), np.float32)
    xd = x.astype(np.float64)
    j = np.flatnonzero(masks[-1])  # the last call's sum against float64 (its window's rows are copies of one)
    ref = (np.maximum(wide["gate"][j] @ xd, 0) * (wide["up"][j] @ xd)) @ wide["down_t"][j]
    for r in range(rounds):
        for gap in gaps_us:
            for mode in sums:
                phases = np.zeros((calls, 7))
                args = (words, idx, x, gate, up, down_t, scale, part, o, counter, stamps, phases, n,
                        int(gap * ticks_per_us), 8 * threads, kv.SUMS.index(mode), spare)
                _calls(*args)  # compiles, and a first pass over the windows
                _calls(*args)
                got = part[:min(threads, k)].sum(0) if mode == "none" else o
                err = float(np.abs(got - ref).max() / np.abs(ref).max())
                if err > 1e-4:
                    raise AssertionError(f"cold_layer_timeline: the timed calls' sum is off by {err:.2g} of float64's")
                us = phases[windows:, :6] / ticks_per_us  # the first pass over the windows left out
                med = {p: float(np.median(us[:, i])) for i, p in enumerate(PHASES)}
                res["runs"].append({"round": r, "gap_us": gap, "sums": mode, "max_rel_err_vs_float64": err,
                                    "median_us": med,
                                    "p90_us": {p: float(np.percentile(us[:, i], 90)) for i, p in enumerate(PHASES)},
                                    "call_bytes_per_s": k * row_bytes / (med["call"] * 1e-6),
                                    "work_bytes_per_s": k * row_bytes / ((med["work"] + med["tail"]) * 1e-6)})
                print({"round": r, "gap_us": gap, "sums": mode, **{p: round(v, 1) for p, v in med.items()}},
                      flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    ap = kv.layer_parser(__doc__)
    ap.add_argument("--density", type=float, default=0.05)
    ap.add_argument("--calls", type=int, default=96)
    ap.add_argument("--gap-us", default="0,160", help="comma list: the host's spin before each call, us")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--sums", default="sum", help=f"comma list of {', '.join(kv.SUMS)}")
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    modes = tuple(a.sums.split(","))
    if bad := [m for m in modes if m not in kv.SUMS]:
        raise SystemExit(f"--sums {','.join(bad)}: unknown; known: {', '.join(kv.SUMS)}")
    main(a.out, a.n, a.d, a.density, a.calls, tuple(float(v) for v in a.gap_us.split(",")), a.windows, modes,
         a.rounds)
