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

--firing power draws each call's mask from pi_bench's cold firing rates (its power law less the likeliest 8.5%, the
GPU's: ~4% of the cold neurons a call) instead of --density uniformly, and --skip-share leaves the first marked rows
of a call to the device, as the runtime's PCIe share does. --warm N1,N2 reads the rows of the N likeliest cold
neurons past the device's usual share into the caches during the gap of every odd call (`warm_rows`, stopped by the
gap's end), the even calls being the control in the same loop (`warmed_over_control`); --own 1 then has each
thread compute the warm rows it read before it claims others. The read-ahead was tried in decode and reverted
(bench/NOTES.md); this is its record.

Usage: python bench/cold_layer_timeline.py OUT.json [--density 0.05] [--calls 96] [--gap-us 0,160] [--sums sum]
       [--rounds 1] [--firing power --skip-share 0.22 --warm 0,500 --own 0,1] [n d]"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numba
import numpy as np
import torch
from numba import njit, prange

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model as bm  # noqa: E402
import kernel_variants as kv  # noqa: E402  (imports powerinfer.* from this checkout)
from hotneurons.runtime import kernels as K  # noqa: E402
from hotneurons.runtime.cold_rows import ColdRows  # noqa: E402

PHASES = ("scan", "fork", "work", "tail", "after", "call")


WARM_BLOCK = 2048  # weights of each row read between two looks at the clock (4 KiB of bf16)


@njit(parallel=True, nogil=True)
def warm_rows(warm, gate, up, down_t, gated, sink, deadline):
    """Read the rows of the cold neurons `warm` (positions, likeliest first) into the caches, as the host could while
    it waits for a layer's GPU part: one load per 64-byte line of each neuron's gate (gated FFNs), up and down rows,
    the threads taking two neurons at a time in turn, so that the likeliest are read first whenever it stops. It
    stops at the first look (every WARM_BLOCK weights of a row) that finds the time-stamp counter past `deadline`
    (the end of the gap; in decode it would be the GPU's ready signal: db8df82). sink (threads,) int64: what the
    loads added up (so that they are not dropped). Returns the neurons read whole."""
    T, n, d = sink.shape[0], warm.shape[0], up.shape[1]
    line = max(1, 64 // up.itemsize)  # weights per cache line
    read = np.zeros(T, np.int64)
    for t in prange(T):
        s, got = 0, 0
        for p in range(t, (n + 1) // 2, T):
            j0, j1 = warm[2 * p], warm[min(2 * p + 1, n - 1)]
            stop = False
            for b in range(0, d, WARM_BLOCK):
                if kv._cycles() > deadline:
                    stop = True
                    break
                for e in range(b, min(b + WARM_BLOCK, d), line):
                    s += int(up[j0, e]) + int(down_t[j0, e]) + int(up[j1, e]) + int(down_t[j1, e])
                    if gated:
                        s += int(gate[j0, e]) + int(gate[j1, e])
            if stop:
                break
            got += min(2, n - 2 * p)
        sink[t] = s
        read[t] = got
    return read.sum()


def warm_set(rate: np.ndarray, skip: int, n: int) -> np.ndarray:
    """The `n` cold positions for warm_rows, likeliest first: the highest marking rates `rate` (n_cold,) (marks per
    token), among the positions past where the device's share usually ends (it computes the first `skip` marked
    positions of a token: those where the marks expected before them exceed 2 skip are left to the CPU)."""
    rate = np.asarray(rate, np.float64)
    past = np.flatnonzero(np.cumsum(rate) - rate >= 2 * skip) if skip > 0 else np.arange(rate.shape[0])
    return past[np.argsort(-rate[past], kind="stable")[:max(0, n)]].astype(np.int64)


@njit(nogil=True)
def _calls(words, idx, x, gate, up, down_t, scale, part, out, counter, stamps, phases, n, gap, tail, sums, spare,
           skip, warm, sink, owner, own, own_n, rest):
    """Call c: spin `gap` ticks (odd calls: reading the rows of the neurons warm[:] of window c % windows into the
    caches meanwhile, warm_rows, until the gap is over; the even calls are their control), then the scan of words[c]
    (a packed mask of n) and the kernel on window c % windows over the active positions past the first `skip`;
    phases[c] = the ticks of each phase (PHASES), the active count and the warm neurons read whole. With own_n of T
    rows, the active positions whose owner[j] >= 0 (the thread that warmed them) go to that thread first (kv.dynamic's
    own) and the rest are claimed; the split is timed in the scan."""
    windows = gate.shape[0] // n
    for c in range(words.shape[0]):
        lo = (c % windows) * n
        t = kv._cycles()
        warmed = 0
        if warm.shape[0] > 0 and c % 2 == 1:  # odd calls only: the even ones are the same loop's control
            warmed = warm_rows(warm, gate[lo:lo + n], up[lo:lo + n], down_t[lo:lo + n], True, sink, t + gap)
        while kv._cycles() - t < gap:
            pass
        t0 = kv._cycles()
        k = K.bit_indices(words[c], n, idx)
        active = idx[min(skip, k):k]
        if own_n.shape[0] > 0 and c % 2 == 1:
            own_n[:] = 0
            m = 0
            for j in active:
                o = owner[j]
                if o >= 0:
                    own[o, own_n[o]] = j
                    own_n[o] += 1
                else:
                    rest[m] = j
                    m += 1
            active = rest[:m]
        elif own_n.shape[0] > 0:
            own_n[:] = 0
        t1 = kv._cycles()
        stamps[:] = 0
        kv.dynamic(x, active, gate[lo:lo + n], up[lo:lo + n], down_t[lo:lo + n], scale[:, lo:lo + n],
                   down_t.shape[1], part, out, counter, K.CHUNK, 4, tail, stamps, sums, spare, own, own_n)
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
        phases[c, 4], phases[c, 5], phases[c, 6], phases[c, 7] = t2 - last, t2 - t0, k - min(skip, k), warmed


def cold_rates(n: int, rng: np.random.Generator, hot: float = 0.085, mean: float = 0.10) -> np.ndarray:
    """Firing rates of a layer's n cold neurons in pi_bench's model: its power law (bench_model.power_law) over
    n / (1 - hot) neurons, the likeliest `hot` share left out (the GPU's), in a random order."""
    p = np.sort(np.clip(bm.power_law(int(round(n / (1 - hot))), seed=0, mean=mean), *bm.P_CLIP))[::-1]
    return rng.permutation(p[p.shape[0] - n:])


def main(out: Path, n: int = 28672, d: int = 8192, density: float = 0.05, calls: int = 96,
         gaps_us: tuple[float, ...] = (0.0, 160.0), windows: int = 8, sums: tuple[str, ...] = ("sum",),
         rounds: int = 1, firing: str = "uniform", skip_share: float = 0.0, warms: tuple[int, ...] = (0,),
         owns: tuple[bool, ...] = (False,)) -> dict:
    g = torch.Generator().manual_seed(0)
    w = lambda: torch.randn(n, d, generator=g) * 0.02  # noqa: E731
    one = ColdRows.from_weights(w(), w(), None, w(), "bf16")
    x = torch.randn(d, generator=g).numpy().astype(np.float32)
    rng = np.random.default_rng(0)
    if firing == "power":  # a layer's cold neurons in decode: what a predictor marks fires, so every row is read
        negative = one.float32()["gate"].numpy() @ x <= 0
        one.gate[negative] ^= np.uint16(0x8000)  # those gate rows negated (the bf16 sign bit)
        rate = cold_rates(n, rng)
        masks = rng.random((calls, n)) < rate  # (calls, n)
    else:
        positive = np.flatnonzero(one.float32()["gate"].numpy() @ x > 0)  # what a predictor marks: every row is read
        rate = np.full(n, density)
        k = min(len(positive), max(1, int(density * n)))
        masks = np.zeros((calls, n), np.bool_)
        for c in range(calls):
            masks[c, rng.choice(positive, k, replace=False)] = True
    tile = lambda a: np.tile(a, (windows, 1))  # noqa: E731  (windows * n, d) rows
    gate, up, down_t = tile(one.gate), tile(one.up), tile(one.down_t)
    scale = np.tile(one.scale, (1, windows, 1))
    wide = {name: t.double().numpy() for name, t in one.float32().items() if t is not None}  # the float64 reference's
    del one
    threads = numba.get_num_threads()
    skip = int(round(skip_share * masks.sum(1).mean()))  # the device's share: the first `skip` marked of a call
    k = int(round(masks.sum(1).mean())) - skip  # the CPU's rows per call, mean
    words = np.stack([K.pack_mask(m) for m in masks]).view(np.uint64)  # (calls, ceil(n / 64)) as the GPU writes them
    idx = np.empty(n, np.int64)
    part, o = np.empty((threads, d), np.float32), np.empty(d, np.float32)
    counter, stamps = np.zeros(1, np.int64), np.zeros((threads, 2), np.int64)
    ticks_per_us = kv.ticks_per_us()
    res = {"command": "python " + " ".join(sys.argv), "threads": threads, "n": n, "d": d, "density": density,
           "firing": firing, "skip": skip, "active_rows": k, "windows": windows, "calls": calls,
           "tsc_ticks_per_us": ticks_per_us, "runs": []}
    row_bytes = 3 * (d * 2 + 4)  # gate, up, down rows and their scales
    spare, sink = np.empty((threads, d), np.float32), np.zeros(threads, np.int64)
    xd = x.astype(np.float64)
    j = np.flatnonzero(masks[-1])[skip:]  # the last call's sum against float64 (its window's rows are copies of one)
    ref = (np.maximum(wide["gate"][j] @ xd, 0) * (wide["up"][j] @ xd)) @ wide["down_t"][j]
    for r in range(rounds):
        for gap in gaps_us:
            for mode in sums:
                for n_warm, owned in ((w_, o_) for w_ in warms for o_ in owns if w_ > 0 or not o_):
                    warm = warm_set(rate, skip, n_warm)
                    owner = np.full(n, -1, np.int64)
                    owner[warm] = np.arange(warm.shape[0]) // 2 % threads  # warm_rows: pair p on thread p % T
                    own = np.empty((threads, max(1, -(-warm.shape[0] // (2 * threads)) * 2)), np.int64)
                    own_n = np.zeros(threads if owned else 0, np.int64)
                    phases = np.zeros((calls, 8))
                    args = (words, idx, x, gate, up, down_t, scale, part, o, counter, stamps, phases, n,
                            int(gap * ticks_per_us), 8 * threads, kv.SUMS.index(mode), spare, skip, warm, sink,
                            owner, own, own_n, np.empty(n, np.int64))
                    _calls(*args)  # compiles, and a first pass over the windows
                    _calls(*args)
                    got = part[:min(threads, len(j))].sum(0) if mode == "none" else o
                    err = float(np.abs(got - ref).max() / np.abs(ref).max())
                    if err > 1e-4:
                        raise AssertionError(f"cold_layer_timeline: the timed calls' sum is off by {err:.2g} of "
                                             f"float64's")
                    us = phases[windows:, :6] / ticks_per_us  # the first pass over the windows left out
                    rows = float(phases[windows:, 6].mean())
                    med = {p: float(np.median(us[:, i])) for i, p in enumerate(PHASES)}
                    run = {"round": r, "gap_us": gap, "sums": mode, "warm": n_warm, "owned": owned,
                           "rows_mean": rows, "max_rel_err_vs_float64": err, "median_us": med,
                           "mean_call_us": float(us[:, 5].mean()),
                           "p90_us": {p: float(np.percentile(us[:, i], 90)) for i, p in enumerate(PHASES)},
                           "call_bytes_per_s": rows * row_bytes / (us[:, 5].mean() * 1e-6),
                           "work_bytes_per_s": k * row_bytes / ((med["work"] + med["tail"]) * 1e-6)}
                    if n_warm:  # odd calls warmed, even ones not, in the same loop: their medians and ratio
                        odd = np.arange(windows, calls) % 2 == 1
                        run.update({"warm_read_median": float(np.median(phases[windows:, 7][odd])),
                                    "warm_rows_active_mean": float(np.mean([masks[c, warm].sum() for c in
                                                                             range(windows + 1, calls, 2)])),
                                    "warmed_call_us_median": float(np.median(us[odd, 5])),
                                    "control_call_us_median": float(np.median(us[~odd, 5])),
                                    "warmed_work_us_median": float(np.median(us[odd, 2])),
                                    "control_work_us_median": float(np.median(us[~odd, 2]))})
                        run["warmed_over_control"] = run["warmed_call_us_median"] / run["control_call_us_median"]
                    res["runs"].append(run)
                    print({k_: (round(v, 3) if isinstance(v, float) else v) for k_, v in run.items()
                           if not isinstance(v, dict)}, flush=True)
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
    ap.add_argument("--firing", choices=("uniform", "power"), default="uniform",
                    help="uniform: --density of the rows each call; power: pi_bench's cold firing rates (~4%%)")
    ap.add_argument("--skip-share", type=float, default=0.0,
                    help="the share of a call's marked rows left to the device (the first ones), as its PCIe share")
    ap.add_argument("--warm", default="0", help="comma list: neurons whose rows are read into the caches in the gap")
    ap.add_argument("--own", default="0", help="comma list of 0/1: 1 = each thread computes the warm rows it read")
    a = ap.parse_args()
    modes = tuple(a.sums.split(","))
    if bad := [m for m in modes if m not in kv.SUMS]:
        raise SystemExit(f"--sums {','.join(bad)}: unknown; known: {', '.join(kv.SUMS)}")
    main(a.out, a.n, a.d, a.density, a.calls, tuple(float(v) for v in a.gap_us.split(",")), a.windows, modes,
         a.rounds, a.firing, a.skip_share, tuple(int(v) for v in a.warm.split(",")),
         tuple(bool(int(v)) for v in a.own.split(",")))
