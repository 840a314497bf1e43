"""Diagnostics of the hybrid decode step for pi_bench: its host-clock timeline (waits for each layer's `pre` graph,
the CPU's cold part), the decode-vs-replay question on the CPU's own calls, each layer's graph timed alone on the GPU
with a profile of `pre`, and the predictors' time per token."""

from __future__ import annotations

import time

import numpy as np
import torch

from bench.bench_ceilings import _spin


def step_timeline(rt, prompt: list[int], tokens: int) -> dict:
    """One more generation with the static decoder's host clock on: per layer, the mean over decode steps (the first
    dropped) of the wait for the `pre` graph and of the CPU cold part, in ms; the step's total."""
    from hotneurons.runtime.generate import generate

    rt.fast.timing = []
    generate(rt, prompt, tokens, stop_at_eos=False)
    steps, rt.fast.timing = rt.fast.timing[1:], None
    mean = lambda key: np.mean([s[key] for s in steps], axis=0)  # noqa: E731
    wait, cold, launch = mean("wait_pre_ms"), mean("cold_ms"), mean("launch_ms")
    return {**graph_times(rt.fast), "steps": len(steps), "step_ms": float(mean("step_ms")),
            "final_ms": float(mean("final_ms")),
            "sum_wait_pre_ms": float(wait.sum()), "sum_cold_ms": float(cold.sum()),
            "sum_launch_ms": float(launch.sum()),
            "wait_pre_ms": wait.tolist(), "launch_ms": launch.tolist(), "cold_ms": cold.tolist(),
            "graph_prelaunch": bool(rt.fast.prelaunch),
            "cold_replay": cold_replay(rt, prompt, tokens, float(wait.mean())),
            "note": "host clock; wait_pre: from the end of layer i-1's cold part until layer i's pre graph finished on "
                    "the GPU (it queues behind layer i-1's hot rows), of which launch: the CPU's graph launches before "
                    "the wait (prelaunched: layer i+1's, which overlap layer i's GPU work; else layer i's); cold: "
                    "HybridFFN.cold_rows (one Numba call: the wait for the GPU's ready signal, "
                    "mask -> indices, kernel; "
                    "with the host clock on, the wait is taken first, in wait_pre)"}


def cold_replay(rt, prompt: list[int], tokens: int, gap_ms: float) -> dict:
    """The decode-vs-bench question on the run's own work: one more generation records each CPU cold part's inputs
    (the layer, the indices left to the CPU, x) and time (the one Numba call of HybridFFN.cold_rows: the mask ->
    indices and the kernel, timed once the GPU's ready signal is seen); then the same rows run again through the
    kernel alone, in the same order, three ways: back to back with the GPU idle (`replay`); with the host spinning
    `gap_ms` before each, as it waits for `pre` in decode (`replay_gap`); and after the layer's own graph (`pre`, then
    the hot rows and the GPU's share of the cold ones, which run during the call) launched and its `pre` waited for,
    as in decode (`replay_gpu`). decode = replay puts the gap in the work (rows, indices); decode = replay_gpu >
    replay in what the GPU does meanwhile; decode > replay_gpu in the mask -> indices and what else decode's call
    does around the kernel. Per call decode / replay ratios tell a uniform slowdown from a few stalled calls."""
    from hotneurons.runtime.cold_rows import ffn_rows
    from hotneurons.runtime.generate import generate

    calls: list[tuple] = []  # (layer, ffn, indices, x, decode ms)
    for i, f in enumerate(rt.ffns):
        def record(x, flags=None, layer=-1, i=i, f=f, cold_rows=f.cold_rows):
            while flags is not None and flags.ready[layer] == 0:  # the GPU's part, outside the timed call
                pass
            t = time.perf_counter()
            idx = cold_rows(x, flags, layer)
            calls.append((i, f, idx.copy(), f.io.x_np.copy(), 1e3 * (time.perf_counter() - t)))
            return idx
        f.cold_rows = record
    try:
        generate(rt, prompt, tokens, stop_at_eos=False)
    finally:
        for f in rt.ffns:  # the class's method again
            del f.cold_rows
    fast = rt.fast

    def spin(i: int) -> None:
        _spin(gap_ms / 1e3)

    def gpu(i: int) -> None:
        fast.replay_alone(i)
        fast.wait_pre(i)

    def run(before=None) -> np.ndarray:  # (calls,) ms
        ms = []
        for i, f, idx, x, *_ in calls:
            if before is not None:
                before(i)
            t = time.perf_counter()
            ffn_rows(f.activation, x, idx, f.cold, f.io.out, f.io.part)
            ms.append(1e3 * (time.perf_counter() - t))
        torch.cuda.synchronize()
        return np.array(ms)

    replay, replay_gap, replay_gpu = run(), run(spin), run(gpu)
    decode = np.array([c[4] for c in calls])  # (calls,) ms
    n_steps = len(calls) / max(len(rt.ffns), 1)
    ratio = decode / replay
    layer = np.array([c[0] for c in calls])
    per_layer = lambda ms: [float(ms[layer == i].mean()) for i in range(len(rt.ffns))]  # noqa: E731
    return {"decode_ms_per_step": float(decode.sum() / n_steps),
            "replay_ms_per_step": float(replay.sum() / n_steps),
            "replay_gap_ms_per_step": float(replay_gap.sum() / n_steps),
            "replay_gpu_ms_per_step": float(replay_gpu.sum() / n_steps), "gap_ms": gap_ms,
            "cpu_rows_per_step": sum(len(c[2]) for c in calls) / n_steps, "steps": n_steps,
            "per_call_decode_over_replay": {q: float(np.percentile(ratio, p)) for q, p in
                                            (("p10", 10), ("median", 50), ("p90", 90), ("max", 100))},
            "excess_ms_per_step_in_calls_over_1_5x": float((decode - replay)[ratio > 1.5].sum() / n_steps),
            "per_layer_ms": {"decode": per_layer(decode), "replay": per_layer(replay),
                             "replay_gpu": per_layer(replay_gpu)}}


@torch.inference_mode()
def graph_times(fast, reps: int = 20) -> dict:
    """GPU ms of each layer's graph(s) replayed alone (median over `reps` replays between CUDA events; `pre` + `hot`,
    and with prelaunch the wait for a flag released just before), and a profile of layer 0's `pre` run eagerly: the
    kernels behind the wait for `pre`."""
    out = {"layer_gpu_ms": []}
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(len(fast.ffns)):
        fast.replay_alone(i)
        torch.cuda.synchronize()
        ms = []
        for _ in range(reps):
            torch.cuda._sleep(1_000_000)  # ~0.5 ms: the stream stays busy while the host launches, so the events
            a.record()                    # time the GPU alone
            fast.replay_alone(i)
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b))
        out["layer_gpu_ms"].append(float(np.median(ms)))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fast.pre(0)
        torch.cuda.synchronize()
    table = prof.key_averages()
    for key in ("device_time_total", "cuda_time_total"):  # the name differs across torch versions
        try:
            out["pre_eager_profile"] = table.table(sort_by=key, row_limit=18, max_name_column_width=60)
            break
        except (KeyError, AttributeError, ValueError):
            continue
    return out


@torch.inference_mode()
def predictor_time(preds, d: int, device: str, reps: int = 50, rt=None) -> dict:
    """ms per token of all layers' predictor masks, for the 'predictor <= 5% of decode' goal. On CUDA, as the runtime
    runs them: replayed inside a CUDA graph (GPU time, no launch cost); `ms_per_token_eager` adds the launches. With
    `rt` (a hybrid runtime on the static decoder), each layer's predictor through the decoder's op (ops.Ops.predict:
    the GEMVs, the firing counts and the cold masks for the device and the host, into scratch copies and the host
    buffer that each step rewrites), as its `pre` runs them; else Predictor.mask alone."""
    x = torch.randn(d, device=device, dtype=torch.float16)
    layers = list(preds.layers.values())
    for p in layers:
        p.to(device)
        p.mask(x)
    ops = rt.fast.ops if rt is not None and rt.fast is not None else None
    if ops is None:
        def masks() -> None:
            for p in layers:
                p.mask(x)
    else:  # the runtime's predictors through its op; its counts and device masks left as they are
        scratch = [(f, torch.zeros_like(f.fired), f.io.mask_dev.clone()) for f in rt.ffns if f.mask == "predictor"]

        def masks() -> None:
            for f, fired, m_dev in scratch:
                f.decide(x, ops.predict, fired, m_dev)

    def timed(run) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            run()
        if device == "cuda":
            torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - t0) / reps

    eager = timed(masks)
    out = {"ms_per_token": eager, "ms_per_token_eager": eager, "layers": len(layers), "in_graph": False,
           "what": f"the decoder's predict op ({rt.fast.ops_name} ops)" if ops is not None
           else "Predictor.mask"}
    if device == "cuda":
        from hotneurons.runtime.cuda import warm_up

        graph = torch.cuda.CUDAGraph()
        warm_up(x.device, masks, times=1)
        with torch.cuda.graph(graph):
            masks()
        out.update(ms_per_token=timed(graph.replay), in_graph=True)
    return out
