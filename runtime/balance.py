"""The PCIe share: how many of each layer's marked cold neurons the GPU computes from the cold rows in page-locked
host RAM (read over PCIe) while the CPU reads the rest from DRAM, and its balancing in decode.

The share is measured at start (each side alone, on one layer's rows) and, on CUDA graphs, then moved by timed
rounds of decode steps (`tune_mapped_rows`, called by `generate.generate` after each step) to where the GPU's part of
a layer ends with the CPU's; re-checked every RECHECK_TOKENS steps. docs/runtime.md explains the rule and its
measurements.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numba
import numpy as np
import torch
from hotneurons.runtime.cold_rows import ffn_rows, ffn_rows_mapped

if TYPE_CHECKING:
    from hotneurons.runtime.generate import Runtime
    from hotneurons.runtime.hybrid_ffn import HybridFFN


CALIBRATION_TOKENS = 16  # decoded tokens without a share: each FFN's mean marked cold neurons, the step without it
BALANCE_ROUNDS = 3  # then (share measured, CUDA graphs) rounds that move the share to where the GPU's part ends with
BALANCE_TOKENS = 4  # the CPU's; each times this many tokens after one that captures the graphs again
TUNING_TOKENS = CALIBRATION_TOKENS + BALANCE_ROUNDS * (BALANCE_TOKENS + 1)
OVERRUN_TOL_MS = 0.02  # a layer's wait this much past its wait without a share: the GPU's part ended after the CPU's
MIN_OVERRUNS = 3  # samples of a round that must show it before the GPU part's time is read from them
STALL_X = 3.0  # a CPU part over this many times the round's median is counted at that: a stall (a page fault, the OS)
#                does not shrink with the rows the CPU keeps, and a single one in a round drove the share to its cap
RECHECK_TOKENS = 512  # then every this many decode steps one timed round at the share kept (a runtime lives long, e.g.
#                       pi-serve's, and a share balanced badly or on a machine whose load has changed need not stay)
RECHECK_GAIN = 0.05  # a re-check whose proposal would shorten the layer's time by this much starts new rounds from it


@dataclass
class ShareBalance:
    """The share's balancing rounds (tune_mapped_rows). The share measured at start times the GPU and the CPU each
    alone, but in decode the GPU's part also holds the hot rows and the two share DRAM, so the GPU's part can end well
    after the CPU's (docs/history.md). So the decode steps themselves are timed (StaticDecoder.timing, on while
    balancing)."""
    device_rows_per_ms: float  # the GPU's rate over PCIe, measured at start
    base_ms: np.ndarray | None = None  # (layers + 1,) ms: each wait for `pre` and the final graph's, without a share
    ceiling: float | None = None  # the lowest share seen to run past the CPU (in this series of rounds)
    start: int = 0  # StaticDecoder.timing index where this round's steps begin
    rounds: list[dict] = field(default_factory=list)
    series: int = 0  # index in `rounds` of the current series' first round (the first series, or a re-check's)
    since: int = 0  # decode steps since the last series ended or re-check passed
    clock: list | None = None  # the StaticDecoder.timing list a re-check turned on (another one is not its own)


def pcie_share(rt: Runtime, mask: str) -> float:
    """The share of marked cold neurons the device computes from mapped rows (0: none); maps the rows if any. A
    measured share on CUDA graphs is balanced in decode (rt.pcie_balance). Mask 'gate' shares none: which cold
    neurons pass is known only once the CPU has read their gate rows; its rows are mapped all the same on CUDA, where
    prefill's copies of them to the device run at the page-locked rate (pageable ones are staged by the driver at a
    fraction of it, and prefill is bound by those copies)."""
    cold = [f for f in rt.ffns if f.n_cold]
    gate = mask == "gate" and rt.device.type == "cuda"
    if rt.fast is None or mask in ("oracle", "gate") and not gate or not cold or rt.cfg.pcie_share == 0 and not gate:
        return 0.0
    if rt.cfg.pcie_share is None and rt.device.type != "cuda":
        return 0.0  # no PCIe to share: the CPU reads everything
    try:
        for f in cold:
            f.map_cold(rt.device)
    except RuntimeError as e:
        warnings.warn(str(e), stacklevel=2)
        return 0.0
    if gate:
        return 0.0
    if rt.cfg.pcie_share is not None:
        return rt.cfg.pcie_share
    device_rate, cpu_rate = measure_pcie_rates(max(cold, key=lambda f: f.n_cold))  # rows/s
    if rt.fast.graphs and BALANCE_ROUNDS > 0 and rt.cfg.pcie_balance:
        rt.pcie_balance = ShareBalance(device_rate / 1e3)
        rt.fast.timing = []
    return device_rate / (device_rate + cpu_rate)


def next_share(share: float, marked: float, device_rows_per_ms: float, overrun_ms: np.ndarray, cold_ms: np.ndarray,
               ceiling: float | None = None) -> tuple[float, float]:
    """The share for the next round, from one at `share` (K = share x marked rows a layer on the GPU): per (step,
    layer) sample, the CPU's cold part `cold_ms` and how long the layer's GPU part (hot rows, then the K rows) ran past
    it, `overrun_ms` (<= OVERRUN_TOL_MS: it ended first, by a margin the host clock cannot see).

    Each sample that overran times the GPU's part: G = cold + overrun. With MIN_OVERRUNS of them, G is their median and
    the next K minimises the mean over the samples of max(G + dK / g, cold x (marked - K - dK) / (marked - K)) (g =
    device_rows_per_ms): the CPU's times keep their spread from layer to layer and token to token, so the best split
    lets the GPU overrun now and then rather than never. With fewer, the GPU ended first: K rises by the most that
    could balance the mean, as if the hot rows took no time, to no more than halfway to `ceiling` (the lowest share
    seen to overrun); the next round corrects an overshoot. CPU samples over STALL_X times their median count at
    that (stalls, which moving rows does not shorten).

    Returns (the share, gain): the share of the layer's mean time that the model says the move saves (without
    overruns an upper bound: the hot rows counted as taking no time)."""
    k = share * marked  # rows
    cold_ms = np.minimum(cold_ms, STALL_X * float(np.median(cold_ms)))
    cpu_rows = max(marked - k, 1.0)
    over = overrun_ms > OVERRUN_TOL_MS
    if over.sum() >= MIN_OVERRUNS:
        gpu_ms = float(np.median(cold_ms[over] + overrun_ms[over]))
        dk = np.linspace(-k, cpu_rows, 257)[:, None]  # (candidates, 1) rows moved to the GPU
        step = np.maximum(gpu_ms + dk / device_rows_per_ms, cold_ms.ravel() * (cpu_rows - dk) / cpu_rows)  # ms
        best = int(np.argmin(step.mean(axis=1)))
        new = min(max((k + float(dk[best, 0])) / marked, 0.0), 0.95)
        gain = 1 - float(step[best].mean()) / float(np.maximum(gpu_ms, cold_ms).mean())
    else:
        cold = float(np.mean(cold_ms))
        slope = 1 / device_rows_per_ms + cold / cpu_rows  # ms of difference per row moved
        new = (k + max(0.0, cold - k / device_rows_per_ms) / slope) / marked
        if ceiling is not None:
            new = min(new, (share + ceiling) / 2)
        new = min(max(new, 0.0), 0.95)
        moved = new * marked - k  # rows
        gain = 1 - max(new * marked / device_rows_per_ms, cold * (cpu_rows - moved) / cpu_rows) / cold if cold else 0.0
    return float(new), max(float(gain), 0.0)


def set_pcie_share(rt: Runtime, share: float) -> None:
    """Each FFN's mapped_rows = share x its mean marked cold neurons a token (seen so far); graphs captured again at
    the next step."""
    rt.fast.reset_graphs()  # waits for the GPU: no graph runs while any is dropped
    rt.pcie_share = share
    for f in rt.ffns:
        f.mapped_rows = int(round(share * f.cold_marks[1] / f.cold_marks[0])) if f.mapped is not None else 0
        f.reset_graphs()


def tune_mapped_rows(rt: Runtime) -> bool:
    """Called after each decode step. Once every FFN has seen CALIBRATION_TOKENS tokens: sets mapped_rows from the
    share. With rt.pcie_balance, then a series of BALANCE_ROUNDS timed rounds moves the share (next_share); the last
    round's proposal is taken where the GPU overran in it (it comes from that round's own times), else its share
    stays. After that, every RECHECK_TOKENS steps one timed round at the share kept: where its proposal would save
    RECHECK_GAIN of a layer's time, a new series starts from it. True when mapped_rows changed."""
    if rt.pcie_share <= 0 or min(f.cold_marks[0] for f in rt.ffns) < CALIBRATION_TOKENS:
        return False
    b = rt.pcie_balance
    if rt.pcie_tuned:
        return _recheck(rt) if b is not None and rt.cfg.pcie_recheck else False
    timing = rt.fast.timing
    if b is None or timing is None:  # a given share, or no host clock: set once
        set_pcie_share(rt, rt.pcie_share)
        rt.pcie_tuned = True
        return True
    steps = timing[b.start:]
    if b.base_ms is None:  # the calibration tokens: no share yet
        b.base_ms = np.median(_waits(steps[len(steps) // 2:]), axis=0)  # the later half: the first replays warm up
        share = rt.pcie_share
    else:
        if len(steps) < BALANCE_TOKENS + 1:
            return False
        share, _, overran = _timed_round(rt, steps[1:], b.ceiling)  # the first step of a round captured the graphs
        if len(b.rounds) - b.series == BALANCE_ROUNDS:
            rt.pcie_tuned, rt.fast.timing, b.since = True, None, 0
            if not overran:  # the GPU ended first: no unmeasured step up at the end
                return False
    set_pcie_share(rt, share)
    b.start = len(timing)
    return True


def _waits(steps: list[dict]) -> np.ndarray:
    """(steps, layers + 1) ms: each wait for `pre`, then the final graph's."""
    return np.array([s["wait_pre_ms"] + [s["final_ms"]] for s in steps])


def _timed_round(rt: Runtime, steps: list[dict], ceiling: float | None, **note) -> tuple[float, float, bool]:
    """One round's proposal from its timed steps (next_share), recorded in rt.pcie_balance.rounds with `note`;
    lowers the series' ceiling where the GPU overran. Returns (share, gain, overran)."""
    b = rt.pcie_balance
    marked = float(np.mean([f.cold_marks[1] / f.cold_marks[0] for f in rt.ffns if f.mapped is not None]))
    over = (_waits(steps) - b.base_ms)[:, 1:]  # (steps, layers): layer i's GPU part delays what comes after it
    cold = np.array([s["cold_ms"] for s in steps])  # (steps, layers)
    share, gain = next_share(rt.pcie_share, marked, b.device_rows_per_ms, over, cold, ceiling)
    n_over = int((over > OVERRUN_TOL_MS).sum())
    b.rounds.append({"share": rt.pcie_share, "marked": marked, "cold_ms": float(cold.mean()),
                     "cold_ms_median": float(np.median(cold)), "cold_ms_max": float(cold.max()),  # stalls show
                     "overrun_ms": float(np.maximum(over, 0).mean()), "overruns": n_over / over.size,
                     "proposed": share, "gain": gain, **note})
    overran = n_over >= MIN_OVERRUNS
    if overran:
        b.ceiling = min(b.ceiling or 1.0, rt.pcie_share)
    return share, gain, overran


def _recheck(rt: Runtime) -> bool:
    """After a series of rounds: every RECHECK_TOKENS steps, BALANCE_TOKENS timed steps at the share kept (no new
    graphs), and a new series from its proposal where that would save RECHECK_GAIN. The host clock is left alone
    while another timeline uses it (bench diagnostics). True when mapped_rows changed."""
    b, fast = rt.pcie_balance, rt.fast
    b.since += 1
    if b.since < RECHECK_TOKENS:
        return False
    if b.since == RECHECK_TOKENS:
        if fast.timing is None:
            fast.timing = b.clock = []
            b.start = 0
        else:  # someone else's timeline: try again at the next step
            b.since -= 1
        return False
    if fast.timing is not b.clock:  # another timeline took the clock over: start again once it is done
        b.since = RECHECK_TOKENS - 1
        return False
    steps = fast.timing[b.start:]
    if len(steps) < BALANCE_TOKENS:
        return False
    b.ceiling = None  # the machine may have changed since the series' overruns
    share, gain, _ = _timed_round(rt, steps, None, recheck=True)
    if gain < RECHECK_GAIN:
        fast.timing, b.since = None, 0
        return False
    rt.pcie_tuned, b.series = False, len(b.rounds) - 1  # the re-check is the new series' first round
    set_pcie_share(rt, share)
    b.start = len(fast.timing)
    return True


def measure_pcie_rates(f: HybridFFN, rows: int = 2048, reps: int = 5) -> tuple[float, float]:
    """Cold rows/s of f that the device reads in place (over PCIe) and that the CPU reads from DRAM, each timed alone
    on fresh random rows (the best of `reps`: a single CPU call now and then stalls many times over). Needs
    f.map_cold first. Both read every row of a neuron here (SwiGLU, GELU: no zero gate skips a row)."""
    device = f.mapped["b_up"].device
    k = min(rows, f.n_cold)
    act = "swiglu" if f.gated else "gelu"
    rng = np.random.default_rng(0)
    sets = [np.sort(rng.choice(f.n_cold, k, replace=False)).astype(np.int64) for _ in range(2 * reps + 2)]
    x = torch.randn(1, f.d_model, generator=torch.Generator().manual_seed(0))  # (1, d)
    xd, valid = x.to(device), torch.ones(k, dtype=torch.bool, device=device)
    out, part = np.zeros(f.d_model, np.float32), np.empty((numba.get_num_threads(), f.d_model), np.float32)

    def device_call(ids: np.ndarray) -> None:
        ffn_rows_mapped(act, xd, torch.from_numpy(ids).to(device), valid, f.mapped)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def cpu_call(ids: np.ndarray) -> None:
        ffn_rows(act, x[0].numpy(), ids, f.cold, out, part)

    def timed(fn, ids: np.ndarray) -> float:  # s
        t = time.perf_counter()
        fn(ids)
        return time.perf_counter() - t

    device_call(sets[0])  # warm up (CUDA kernels, Numba compilation)
    cpu_call(sets[1])
    device_s = min(timed(device_call, s) for s in sets[2:2 + reps])  # s
    cpu_s = min(timed(cpu_call, s) for s in sets[2 + reps:])  # s
    return k / device_s, k / cpu_s
