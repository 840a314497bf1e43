"""What fused small ops save on a layer's `pre` (runtime/fast.py): its ops at the LLaMA-2-70B shape (d 8192, 64 heads,
8 KV heads, a --slots cache (512: pi_bench's) filled up to --pos, 28672 neurons, a d/8 predictor), random fp16
weights, as one CUDA graph with torch's kernels (the runtime's ops, in its order: "eager"), the same function through
torch.compile (Inductor fuses the pointwise and norm kernels; the GEMVs stay cuBLAS: "compiled") and with
runtime/fused.py's Triton kernels ("triton"); GPU time per replay (CUDA events, median over the replays). All write
the same outputs, checked against the first.

Usage: python bench/pre_compile.py OUT.json [--slots 512] [--pos 47] [--reps 200]"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from hotneurons.runtime.fast import Ops
from hotneurons.runtime.kernels import mask_bytes

D, H, K, HD, N, R = 8192, 64, 8, 128, 28672, 1024  # d_model, heads, kv heads, head dim, neurons, predictor hidden
N_COLD = N - 1472  # cold neurons: the host mask's bits


def pre(h2_prev, hot_prev, cold, w_in, qkv_w, cos, sin, k_cache, v_cache, pos, mask, o_w, w_post, fc1, fc2, thr,
        h2, x, x_host, m_host, fired, ops=None):
    """runtime/fast.py StaticDecoder._pre for layer i > 0 and HybridFFN._to_host, through `ops` (torch's by default)."""
    ops = ops or Ops()
    r = ops.residual_norm(h2_prev, hot_prev, cold, w_in, 1e-5, h2)
    qkv = ops.linear(r, qkv_w, None).view(1, H + 2 * K, 1, HD)
    q = ops.rope_cache(qkv[:, :H + K], qkv[:, H + K:], cos, sin, k_cache, v_cache, pos)
    o = ops.attend(q.reshape(1, K, -1, HD), k_cache, v_cache, mask, pos).reshape(1, H * HD)
    ops.add_linear(h2, o, o_w, None)
    ops.weighted_rms(h2, w_post, 1e-5, x.view(1, 1, D))
    x_host.copy_(x[0])
    ops.predict(x[0], fc1, fc2, thr, fired, None, m_host, N_COLD)


def main(out: Path, slots: int, pos: int, reps: int) -> dict:
    dev, dt = torch.device("cuda"), torch.float16
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s, scale=0.02: (torch.randn(*s, generator=g, device=dev) * scale).to(dt)  # noqa: E731
    pinned = lambda n, t: torch.empty(n, dtype=t, pin_memory=True)  # noqa: E731
    x_host, m_host = pinned(D, torch.float32), pinned(mask_bytes(N_COLD), torch.uint8)  # the mask as bits
    cold_host = pinned(D, torch.float32)
    cold_host.normal_()
    as_dev = lambda t: torch.as_tensor(_View(t), device=dev)  # noqa: E731  (UVA: pinned memory seen by the GPU)
    mask = torch.zeros(1, 1, 1, slots, device=dev, dtype=dt)
    mask[..., pos + 1:] = float("-inf")
    args = dict(h2_prev=r(1, 1, D, scale=1), hot_prev=r(1, D, scale=1), cold=as_dev(cold_host), w_in=r(D, scale=1),
                qkv_w=r((H + 2 * K) * HD, D), cos=r(1, H + K, 1, HD, scale=1), sin=r(1, H + K, 1, HD, scale=1),
                k_cache=r(1, K, slots, HD, scale=1), v_cache=r(1, K, slots, HD, scale=1),
                pos=torch.tensor([pos], device=dev), mask=mask, o_w=r(D, H * HD), w_post=r(D, scale=1),
                fc1=r(R, D), fc2=r(N, R), thr=torch.zeros(1, device=dev),
                h2=r(1, 1, D), x=r(1, D),
                x_host=as_dev(x_host), m_host=as_dev(m_host), fired=torch.zeros(N, dtype=torch.int32, device=dev))
    res = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(), "slots": slots, "pos": pos,
           "torch": torch.__version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    outs = {}
    triton_ops = Ops.named("triton")
    variants = (("eager", pre), ("compiled", torch.compile(pre)), ("triton", lambda **a: pre(**a, ops=triton_ops)))
    for name, fn in variants:
        def call(fn=fn) -> None:
            with torch.inference_mode():
                fn(**args)

        us, warm_s = replay_us(call, reps, warm=3)
        outs[name] = (args["x"].clone(), m_host.clone(), args["h2"].clone())
        res[name] = {"median_us": us[len(us) // 2], "p10_us": us[len(us) // 10],
                     "warm_up_and_compile_s": warm_s}
        print(name, res[name], flush=True)
    xe, me, he = outs["eager"]
    for name in ("compiled", "triton"):
        xc, mc, hc = outs[name]
        res[name]["max_abs_diff_x"] = float((xe.float() - xc.float()).abs().max())
        res[name]["max_abs_diff_h2"] = float((he.float() - hc.float()).abs().max())
        bits = lambda m: np.unpackbits(m.numpy(), bitorder="little")[:N_COLD]  # noqa: E731  (N_COLD,) decisions
        res[name]["mask_disagreement"] = float((bits(me) != bits(mc)).mean())
        res[name]["saved_us_per_layer"] = res["eager"]["median_us"] - res[name]["median_us"]
    out.write_text(json.dumps(res, indent=1))
    return res


def replay_us(fn, reps: int, warm: int = 2) -> tuple[list[float], float]:
    """GPU times (us, sorted) of `reps` replays of fn captured as one CUDA graph, after `warm` calls on a side stream
    (lazy inits, autotuning, compiles); and the seconds those took."""
    t0 = time.perf_counter()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warm):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    us = []
    for _ in range(reps):
        torch.cuda._sleep(1_000_000)  # the stream stays busy while the host launches: the events time the GPU
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        us.append(1e3 * a.elapsed_time(b))
    return sorted(us), warm_s


class _View:
    """A pinned CPU tensor's memory described as CUDA memory (its host pointer is valid on the GPU under UVA)."""

    def __init__(self, t: torch.Tensor):
        self.t = t
        typestr = {torch.float32: "<f4", torch.uint8: "|u1"}[t.dtype]
        self.__cuda_array_interface__ = {"shape": tuple(t.shape), "typestr": typestr, "data": (t.data_ptr(), False),
                                         "version": 3, "strides": None}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--slots", type=int, default=512)
    ap.add_argument("--pos", type=int, default=47, help="the query's position: the slots up to it are filled")
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    main(a.out, a.slots, a.pos, a.reps)
