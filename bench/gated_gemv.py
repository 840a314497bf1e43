"""The sparse gated FFN's speed on the GPU (kernels/gated.py) against the dense one, one token: time and bandwidth.

dense:  g = gate . x, u = up . x (kernels/qlinear.linear: qgemv's GEMV, cuBLAS for fp16), h = act(g) * u, y = down . h
        with down (d, n) as the model stores it
sparse: gated.gated_ffn at a pass rate: tau_g the (1 - rate) quantile of |act(g)| (the gate criterion, tau_h 0), so
        that `rate` of the neurons pass both tests; rows of down as down_t (n, d)
gate:   the dense gate GEMV alone, the sparse path's floor

Timing: CUDA events around the replay of a CUDA graph of `copies` calls, each on another copy of the layer's weights
(>= ROTATE_BYTES in all: no call finds its weights in the 50-60 MB L2, as a decode step's layers do not), median over
`repeats`, divided by copies. Bandwidth: the bytes a call must read / time: dense all three matrices; sparse the gate
and the passing neurons' rows of up and down (their share of the matrices' bytes, block-major scale sectors that
gathered rows touch beyond that not counted: what a perfect gather would read). Weights: random valid blocks (fp16
scales ~ N(0, 0.02)) or fp16 ~ N(0, 0.02); x ~ N(0, 1) fp16.

Usage (GPU machine): python -m bench.gated_gemv [--shapes 4096x14336,8192x28672] [--rates 0.3,0.5,0.7]
[--formats q4_0,q8_0,f16] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from hotneurons.kernels import gated
from hotneurons.kernels.gated_ref import gated_ffn_torch
from hotneurons.kernels.ops import act_torch, gate_act
from hotneurons.kernels.qlinear import GpuQ, linear
from hotneurons.weights.formats import row_bytes

ROTATE_BYTES = 512 << 20  # weights a timed graph cycles through: >> any L2
BLOCK_BYTES = {"q4_0": (2, 16), "q4_1": (4, 16), "q8_0": (2, 32)}  # a file block: head (scale, min), quants


def _random(n: int, k: int, fmt: str, seed: int) -> GpuQ | torch.Tensor:
    """An (n, k) weight on the GPU: fp16 ~ N(0, 0.02), or random valid blocks packed (weights' spread ~0.02, Q4_1's
    mins near -7.5 |scale|)."""
    from hotneurons.kernels.qlinear import pack
    from hotneurons.weights.qtensor import QTensor

    g = torch.Generator(device="cuda").manual_seed(seed)
    if fmt == "f16":
        return (0.02 * torch.randn((n, k), generator=g, device="cuda")).half()
    head, bb = BLOCK_BYTES[fmt]
    blocks = torch.randint(0, 256, (n, k // 32, head + bb), generator=g, device="cuda", dtype=torch.uint8)
    q_std = 74.0 if fmt == "q8_0" else 4.6  # the quants' spread: weights ~ N(0, 0.02), so sums stay in fp16's range
    scales = (0.02 / q_std * torch.randn((n, k // 32, 1), generator=g, device="cuda")).half()
    blocks[:, :, :2] = scales.view(torch.uint8)
    if fmt == "q4_1":
        blocks[:, :, 2:4] = (-7.5 * scales.float().abs()).half().view(torch.uint8)
    return pack(QTensor(blocks.view(n, -1), fmt, (n, k)), "cuda")


def _nbytes(w: GpuQ | torch.Tensor) -> int:
    return w.nbytes if isinstance(w, GpuQ) else w.numel() * w.element_size()


def _timed(step, repeats: int) -> float:
    """Median seconds of one replay of a CUDA graph of step() (compiled and warmed up first)."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def bench_gated(d: int, n: int, pass_rate: float, fmt: str, activation: str = "swiglu", repeats: int = 50,
                splits: int | None = None, stages: bool = False) -> dict:
    """Dense and sparse microseconds and GB/s of one token's gated FFN (module docstring), d model width, n neurons,
    fmt q4_0 | q4_1 | q8_0 | f16; also the measured pass rate and the sparse result's largest error against the
    torch reference, relative to the largest |y| (a sanity figure). stages: also each of gated.STAGES's time (the
    graph of the first k stages minus that of the first k - 1)."""
    layer_bytes = 4 * row_bytes(fmt, d) * n
    copies = max(2, -(-ROTATE_BYTES // layer_bytes))
    layers = []
    for c in range(copies):  # gate, up (n, d); down (d, n) for the dense FFN; down_t (n, d) for the sparse one
        layers.append([_random(n, d, fmt, 4 * c), _random(n, d, fmt, 4 * c + 1), _random(d, n, fmt, 4 * c + 2),
                       _random(n, d, fmt, 4 * c + 3)])
    x = torch.randn((1, d), device="cuda").half()
    taus = []
    for gate, *_ in layers:  # each copy's own quantile: `pass_rate` of its neurons pass
        a = gate_act(activation, linear(x, gate).float()).half().float().abs()
        k = min(n, max(0, round((1 - pass_rate) * n)))  # neurons that fail: |a| at most the k-th smallest
        tau = float(a.sort().values[0, k - 1]) if k else -1.0
        taus.append(torch.tensor(tau, dtype=torch.float32, device="cuda"))
    tau_h = torch.zeros((), dtype=torch.float32, device="cuda")
    ws = gated.GatedWorkspace.make(n, d, "cuda", torch.float16, splits)
    g, u, y = (torch.empty((1, m), device="cuda", dtype=torch.float16) for m in (n, n, d))

    def dense():
        for gate, up, down, _ in layers:
            linear(x, gate, out=g)
            linear(x, up, out=u)
            linear(act_torch(activation, g, u), down, out=y)

    layers = [[gate, up, down, gated.DownRows.of(down_t) if isinstance(down_t, GpuQ) else down_t]
              for gate, up, down, down_t in layers]  # down_t as the runtime keeps it

    def sparse():
        for (gate, up, _, down_t), tau in zip(layers, taus):
            gated.gated_ffn(activation, x, gate, up, down_t, tau, tau_h, ws)

    def gate_only():
        for gate, *_ in layers:
            linear(x, gate, out=g)

    counts = []
    for (gate, up, _, down_t), tau in zip(layers, taus):
        gated.gated_ffn(activation, x, gate, up, down_t, tau, tau_h, ws)
        counts.append(int(ws.count))
    gate, up, _, down_t = layers[-1]
    ref = gated_ffn_torch(activation, x, gate, up, down_t, taus[-1], tau_h).float()
    err = float((ws.y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    rate = sum(counts) / (len(counts) * n)
    mat = _nbytes(layers[0][0])
    t_dense, t_sparse, t_gate = (_timed(f, repeats) / copies for f in (dense, sparse, gate_only))
    dense_bytes, sparse_bytes = 3 * mat, mat * (1 + 2 * rate)
    per_stage = {}
    if stages:
        def first(k):
            def run():
                for (gate, up, _, down_t), tau in zip(layers, taus):
                    for stage in gated.STAGES[:k]:
                        stage(activation, x, gate, up, down_t, tau, tau_h, ws)
            return run
        prefix = [0.0] + [_timed(first(k), repeats) / copies for k in range(1, len(gated.STAGES) + 1)]
        per_stage = {f"{st.__name__.strip('_')}_us": (prefix[k + 1] - prefix[k]) * 1e6
                     for k, st in enumerate(gated.STAGES)}
    return {**per_stage, "d": d, "n": n, "format": fmt, "activation": activation, "pass_rate": rate, "copies": copies,
            "splits": ws.part.shape[0], "dense_us": t_dense * 1e6, "sparse_us": t_sparse * 1e6,
            "gate_us": t_gate * 1e6, "dense_gbs": dense_bytes / t_dense / 1e9,
            "sparse_gbs": sparse_bytes / t_sparse / 1e9, "speedup": t_dense / t_sparse, "rel_err": err}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="4096x14336,8192x28672", help="d x n, comma separated")
    ap.add_argument("--rates", default="0.3,0.5,0.7,1.0", help="pass rates, comma separated")
    ap.add_argument("--formats", default="q4_0,q8_0,f16")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--stages", action="store_true", help="also time each stage of the sparse call")
    ap.add_argument("--sweep", default=None, help="configurations of the sparse call, ';' separated, each "
                    "rows,map_rows,splits_per_sm (kernels/gated.py's ROWS, MAP_Q4_ROWS, GatedWorkspace splits)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gated_gemv.py needs CUDA", file=sys.stderr)
        return 2
    rows = []
    for shape in a.shapes.split(","):
        d, n = (int(v) for v in shape.lower().split("x"))
        for fmt in a.formats.split(","):
            for rate in (float(r) for r in a.rates.split(",")):
                for conf in (a.sweep.split(";") if a.sweep else [None]):
                    splits = None
                    if conf:
                        rr, mr, sp = (int(v) for v in conf.split(","))
                        gated.ROWS, gated.MAP_Q4_ROWS = rr, mr
                        splits = sp * torch.cuda.get_device_properties(0).multi_processor_count
                    r = bench_gated(d, n, rate, fmt, repeats=a.repeats, splits=splits, stages=a.stages)
                    r.update(rows=gated.ROWS, map_rows=gated.MAP_Q4_ROWS)
                    st = " ".join(f"{k[:-3]} {v:.1f}" for k, v in r.items() if k.endswith("stage_us"))
                    print(f"{fmt:>5} d={d} n={n} pass {r['pass_rate']:.2f} [{conf or 'default'}]: dense "
                          f"{r['dense_us']:7.1f} us {r['dense_gbs']:6.0f} GB/s, sparse {r['sparse_us']:7.1f} us "
                          f"{r['sparse_gbs']:6.0f} GB/s, gate {r['gate_us']:6.1f} us, x{r['speedup']:.2f}, "
                          f"err {r['rel_err']:.1e} {st}", flush=True)
                    rows.append(r)
                    torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
