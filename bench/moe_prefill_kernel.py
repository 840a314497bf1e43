"""One mixture-of-experts layer's prefill on the device, all experts there: runtime/moe_ffn.HybridMoE's per-expert
loop (index_select, three `linear`s of de-quantized chunks and cuBLAS, index_add, for every expert) against its
grouped path (kernels/grouped.py: gate, up and down one launch each over all the routed pairs). Qwen3-30B-A3B's layer
by default: 128 experts of n_ff 768, d 2048, top-8 routing (renormalised) of 512 random tokens, random Q4_0 experts
(valid blocks: fp16 scales ~ N(0, 0.02), uniform quants), fp16 activations.

Timing: the layer's whole call (routing, the host's wait and grouping, the launches), CUDA events, median of --reps
after a warm-up call (Triton's compile); and the grouped path's expert part alone (runtime/moe_prefill.grouped_ffn on
the call's routing: the tile table, three launches, the activation, the index_add). The equivalent dense rate: 6 P d n
floating-point operations for P = tokens x top-k routed pairs (gate, up and down, each 2 P d n), / time. --sweep
also times the gate projection's grouped launch alone over (BLOCK_M, BLOCK_N, BLOCK_K, num_warps) alternatives: the
data to tune grouped_linear's defaults.

On the CPU (a smoke test at tiny sizes, e.g. --experts 8 --n-ff 64 --d-model 64 --tokens 12 --dtype float32) the
device's stacks are packed as CUDA's and the grouped path runs grouped_linear's torch reference.

Usage (GPU machine): python -m bench.moe_prefill_kernel [--sweep]
    [--out bench/results/<date>-<kind>-moe-prefill-kernel.json]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from hotneurons.common.kinds import Activation
from hotneurons.kernels import grouped
from hotneurons.kernels.qlinear import linear, pack
from hotneurons.models import ModelConfig
from hotneurons.models.moe import route
from hotneurons.runtime import moe_ffn
from hotneurons.runtime.moe_ffn import HybridMoE
from hotneurons.runtime.moe_prefill import grouped_ffn
from hotneurons.runtime.moe_rows import PROJ
from hotneurons.weights.formats import row_bytes, spec
from hotneurons.weights.qtensor import QTensor

from bench import record

HEAD = {"q4_0": 2, "q8_0": 2}  # bytes before a block's quants: the fp16 scale
SWEEP = [(bn, bk, w) for bn in (32, 64, 128) for bk in (64, 128, 256) for w in (4, 8)]


def random_rows(n: int, k: int, fmt: str, rng: np.random.Generator) -> QTensor:
    """(n, k) random valid blocks of fmt on the host, as a file's stacked experts."""
    nb, bb = k // spec(fmt).block, spec(fmt).block_bytes
    blocks = rng.integers(0, 256, (n, nb, bb), dtype=np.uint8)
    blocks[:, :, :HEAD[fmt]] = (0.02 * rng.standard_normal((n, nb, 1))).astype(np.float16).view(np.uint8)
    return QTensor(torch.from_numpy(blocks.reshape(n, row_bytes(fmt, k))), fmt, (n, k))


def config(a: argparse.Namespace) -> ModelConfig:
    return ModelConfig(family="moe", model_type="qwen3-moe", n_layers=1, d_model=a.d_model, n_heads=4, n_kv_heads=4,
                       head_dim=16, n_ff=a.n_ff, vocab=16, activation=Activation.SWIGLU, act_fn="silu", norm="rms",
                       norm_eps=1e-6, max_positions=64, rope=None, n_experts=a.experts, n_experts_used=a.top_k,
                       norm_topk=True, n_ff_exp=a.n_ff, n_ff_shexp=0)


def timed(fn, reps: int, cuda: bool) -> float:
    """Median seconds of fn() over reps, after one warm-up call (CUDA events on CUDA, perf_counter elsewhere)."""
    fn()
    if cuda:
        torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def routing(ffn: HybridMoE, x: torch.Tensor) -> tuple:
    """The layer's routing of x as its forward makes it: pairs (P,) sorted by expert, starts (G + 1,), stack ids
    (G,), the routing weights (T k,) on the device."""
    w, idx = route(ffn.cfg, linear(x, ffn.router))  # (T, k) each
    ih = idx.cpu().numpy()
    pairs = np.argsort(ih.ravel(), kind="stable")  # (P,) grouped per expert
    experts = ih.ravel()[pairs]
    starts = np.array([0, *(np.flatnonzero(np.diff(experts)) + 1), len(pairs)])
    return pairs, starts, ffn.lut_np[experts[starts[:-1]]], w.reshape(-1)


def sweep(ffn: HybridMoE, x: torch.Tensor, reps: int) -> list[dict]:
    """The gate projection's grouped launch alone, per (BLOCK_M, BLOCK_N, BLOCK_K, num_warps), on x's routing."""
    pairs, starts, ids, _ = routing(ffn, x)
    tok = torch.from_numpy(pairs // ffn.cfg.n_experts_used).to(x.device)
    rows = []
    for bm in (16, 32, 64, 128):
        tiles = grouped.tile_table(ids, starts, bm, x.device)
        for cfg in SWEEP:
            s = timed(lambda: grouped.grouped_linear(x, ffn.stacks["gate"], ffn.n_ff, ids, starts, tok, tiles, cfg),
                      reps, True)
            rows.append({"block_m": bm, "block_n": cfg[0], "block_k": cfg[1], "warps": cfg[2], "ms": s * 1e3,
                         "tflops": 2 * len(pairs) * ffn.d_model * ffn.n_ff / s / 1e12})
    return sorted(rows, key=lambda r: r["ms"])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--n-ff", type=int, default=768, help="an expert's hidden width")
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--fmt", default="q4_0", choices=sorted(HEAD))
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also time the gate launch's block sizes (CUDA)")
    ap.add_argument("--out", default=None, help="results JSON (default bench/results/<date>-<kind>-moe-prefill-"
                                                "kernel.json)")
    a = ap.parse_args(argv)
    dev, dtype, cuda = torch.device(a.device), getattr(torch, a.dtype), a.device.startswith("cuda")
    cfg = config(a)
    rng = np.random.default_rng(0)
    outs = {"gate": a.n_ff, "up": a.n_ff, "down": a.d_model}
    ins = {"gate": a.d_model, "up": a.d_model, "down": a.n_ff}
    w = {f"blk.0.ffn_{p}_exps.weight": random_rows(a.experts * outs[p], ins[p], a.fmt, rng) for p in PROJ}
    w["blk.0.ffn_gate_inp.weight"] = torch.from_numpy(rng.standard_normal((a.experts, a.d_model), np.float32))
    ffn = HybridMoE(0, cfg, w.get, np.ones(a.experts, bool), dev, dtype)
    if not cuda:  # a CPU run's stacks are the file's rows: packed as CUDA's, so that the grouped path applies
        ffn.stacks = {p: pack(ffn.stacks[p], dev) for p in PROJ}
    x = torch.from_numpy(rng.standard_normal((a.tokens, a.d_model), np.float32)).to(dev, dtype)
    old = moe_ffn.GROUPED_DEVICES
    res = {}
    try:
        for name, devices in (("loop", ()), ("grouped", (dev.type,))):
            moe_ffn.GROUPED_DEVICES = devices
            res[name] = ffn(x).float()
            res[name + "_s"] = timed(lambda: ffn(x), a.reps, cuda)
    finally:
        moe_ffn.GROUPED_DEVICES = old
    pairs, starts, ids, wflat = routing(ffn, x)  # the experts' part alone: three launches, the act, the index_add
    stacks = [ffn.stacks[p] for p in PROJ]
    experts_s = timed(lambda: grouped_ffn(ffn, x, stacks, ids, starts, pairs, wflat, torch.zeros_like(x)), a.reps,
                      cuda)
    flops = 6.0 * a.tokens * a.top_k * a.d_model * a.n_ff
    diff = float((res["loop"] - res["grouped"]).abs().max() / res["loop"].abs().max().clamp_min(1e-30))
    figures = {"shape": {"experts": a.experts, "n_ff": a.n_ff, "d_model": a.d_model, "top_k": a.top_k,
                         "tokens": a.tokens, "fmt": a.fmt, "dtype": a.dtype, "device": a.device},
               "reps": a.reps, "loop_ms": res["loop_s"] * 1e3, "grouped_ms": res["grouped_s"] * 1e3,
               "speedup": res["loop_s"] / res["grouped_s"], "dense_flops": flops,
               "loop_tflops": flops / res["loop_s"] / 1e12, "grouped_tflops": flops / res["grouped_s"] / 1e12,
               "grouped_experts_ms": experts_s * 1e3, "grouped_experts_tflops": flops / experts_s / 1e12,
               "max_rel_diff": diff, "kernel": grouped.applies(ffn.stacks["gate"], x)}
    if a.sweep and cuda:
        figures["sweep_gate"] = sweep(ffn, x, a.reps)
    print(f"{a.experts} experts x n_ff {a.n_ff}, d {a.d_model}, top-{a.top_k}, {a.tokens} tokens ({a.fmt}, "
          f"{a.dtype}, {a.device}): loop {figures['loop_ms']:.2f} ms, grouped {figures['grouped_ms']:.2f} ms "
          f"({figures['speedup']:.1f}x; {figures['grouped_tflops']:.1f} dense TFLOP/s), max rel diff {diff:.2e}")
    record.write_dated("moe-prefill-kernel", figures, path=a.out)
    return figures


if __name__ == "__main__":
    main()
