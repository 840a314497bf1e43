"""A prompt's latency by its length: the runtime's prefill (one pass over the T tokens; for a mixture of experts at
each --offload-tokens, runtime/moe_prefill.OFFLOAD_TOKENS: from how many tokens a layer's cold experts are computed on
the device) against the same T tokens through the decode step one at a time (CUDA graphs where the runtime has
them). What a chat turn waits for its first token, and from what length one pass pays: a dense hybrid's prefill
streams every cold row to the GPU whatever T, where the decode step reads a token's marked cold rows only.

    python -m bench.prompt_latency --run RUN --device cuda --vram 24GiB --lengths 1,8,16,32,64,128 --out r.json
    python -m bench.prompt_latency --moe-dir WORK/qwen3-30b-a3b-calibrated --offload-tokens 64,16,1 --out r.json

Each figure is the median of --reps timed runs after one untimed run of the same length (compiles, warms). The
last token's logits of the two paths are compared (max |difference|): exact paths agree to rounding; a predictor's
masks (dense hybrid decode) are an approximation of the prefill's dense FFN.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np


def _timed(fn, reps: int, device) -> tuple[float, object]:
    """Median seconds of `reps` calls of fn after one untimed call, and the last call's result."""
    from hotneurons.runtime.generate import sync

    out = fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), out


def measure(rt, lengths: list[int], offload_tokens: list[int] | None = None, reps: int = 3, seed: int = 0) -> dict:
    """Per prompt length T: seconds of the runtime's prefill (per OFFLOAD_TOKENS value where given) and of T decode
    steps, the max |logit difference| between them, and the shortest T from which the one pass is faster."""
    import torch
    from hotneurons.runtime import moe_prefill
    from hotneurons.runtime.balance import TUNING_TOKENS
    from hotneurons.runtime.generate import generate

    lm = rt.lm
    rng = np.random.default_rng(seed)
    step = rt.fast.step if rt.fast is not None else (lambda t, p: lm.step(rt, t, p))  # (token, pos) -> (vocab,)
    keep = moe_prefill.OFFLOAD_TOKENS
    # the runtime's own tuning (the PCIe share's balancing, graph captures) over its first decode steps, untimed
    generate(rt, rng.integers(0, lm.vocab, 8).tolist(), TUNING_TOKENS + 8, stop_at_eos=False)
    rows: dict[str, dict] = {}
    try:
        for T in lengths:
            ids = rng.integers(0, lm.vocab, T).tolist()

            def stepped() -> torch.Tensor:  # each step writes its position's keys and values, as a pass would
                for p, t in enumerate(ids):
                    lg = step(t, p)
                return lg.float().clone()  # (vocab,)

            with torch.inference_mode():
                t_step, lg_step = _timed(stepped, reps, rt.device)
                passes = {}
                for k in offload_tokens or [keep]:
                    moe_prefill.OFFLOAD_TOKENS = k
                    t_pass, lg_pass = _timed(lambda: lm.prefill(rt, ids).float(), reps, rt.device)
                    passes[str(k)] = {"prefill_s": t_pass,
                                      "max_abs_logit_diff": float((lg_pass - lg_step).abs().max())}
            best = min(v["prefill_s"] for v in passes.values())
            rows[str(T)] = {"steps_s": t_step, "prefill": passes, "one_pass_faster": best < t_step}
            print(f"T={T}: steps {1e3 * t_step:.1f} ms, prefill " + ", ".join(
                f"{1e3 * v['prefill_s']:.1f} ms (offload from {k})" for k, v in passes.items()), flush=True)
    finally:
        moe_prefill.OFFLOAD_TOKENS = keep
    faster = [int(T) for T, r in rows.items() if r["one_pass_faster"]]
    return {"lengths": rows, "reps": reps, "offload_tokens_default": keep, "graphs": rt.fast is not None and
            bool(rt.fast.graphs), "one_pass_faster_from": min(faster) if faster else None}


def main(argv: list[str] | None = None) -> dict:
    from bench.batch_decode import load, runtime_args
    from bench.record import write_result

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    runtime_args(ap)
    ap.add_argument("--lengths", default="1,4,8,16,32,64,128,256")
    ap.add_argument("--offload-tokens", default=None, help="comma-separated OFFLOAD_TOKENS values to time the "
                    "prefill at (a mixture of experts; default: the runtime's own)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--commit", default=None, help="the checkout's commit, where its .git is stale or missing")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    lengths = [int(t) for t in a.lengths.split(",")]
    if min(lengths) < 1 or max(lengths) >= a.ctx:
        raise SystemExit(f"--lengths {a.lengths}: each from 1 to below --ctx {a.ctx}")
    rt = load(a)
    offload = [int(k) for k in a.offload_tokens.split(",")] if a.offload_tokens else None
    figures = {**measure(rt, lengths, offload, a.reps), "run": str(a.run), "moe_dir": str(a.moe_dir),
               "model": a.model, "device": a.device, "vram": a.vram, "ctx": a.ctx}
    write_result(a.out, figures, commit=a.commit)
    return figures


if __name__ == "__main__":
    main()
