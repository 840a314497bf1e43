"""The quantized GEMV's speed on the GPU (kernels/qgemv.py; K-quants: kernels/qgemv_k.py): time and effective
bandwidth (bytes of the weight as stored / time) for Q4_0, Q8_0, Q4_K, Q5_K, Q6_K (--formats) and fp16 (cuBLAS
through F.linear, and kernels/fused.py's Triton GEMV) on LLaMA-2-70B's shapes, against two ceilings measured in the
same run: a device-to-device copy of a 1 GiB buffer (bytes moved, read + written, / time: the HBM figure
kernels/measure.py measures; its bytes read / time too) and a read-only reduction (torch.sum of a 1 GiB fp16 buffer).

Timing: CUDA events, median over --repeats. "graph": a CUDA graph of --calls GEMVs, replayed (how the static decoder
runs them), time / calls; "eager": --calls GEMVs launched from Python between two events (the CPU's launch cost shows
where it exceeds the kernel's). Each call reads another copy of the weight (copies of >= 512 MB in all), so that no
call finds its weight in the L2 cache (50-60 MB), as a decode step, whose layers read different weights, does not.
Weights are random bytes (valid blocks: random quants, fp16 scales ~ N(0, 0.02); K-quants: random bytes but d, dmin ~
|N(0, 0.002)|, packed as the loader packs a file's blocks); x ~ N(0, 1) in --dtype.

--sweep also times the (BLOCK_N, BLOCK_B, num_warps) alternatives around gemv_config's choice (graph timing) and
reports the best: the data to retune gemv_config with.

Usage (GPU machine): python -m bench.qgemv --out bench/results/<date>-<kind>-qgemv.json [--sweep] [--tokens 1,2,4,8]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from hotneurons.kernels import qgemv, qgemv_k
from hotneurons.kernels.qlayout_k import K_FORMATS
from hotneurons.kernels.qlinear import GpuQ, pack
from hotneurons.weights.formats import row_bytes, spec, weight_format
from hotneurons.weights.qtensor import QTensor

from bench import record

SHAPES = [(8192, 8192), (28672, 8192), (8192, 28672)]  # (n, k): q/o projections, gate/up, down
ROTATE_BYTES = 512 << 20  # weight copies a timing cycles through: >> any L2


def timed(fn, repeats: int, calls: int, graph: bool) -> float:
    """Median seconds of one call of fn(i) (i: the call's index in a run of `calls`), CUDA events."""
    def run():
        for i in range(calls):
            fn(i)

    run()  # compile, warm up
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        step = g.replay
    else:
        step = run
    step()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / calls)
    return statistics.median(times)


def ceilings(repeats: int) -> dict:
    nbytes = 1 << 30
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    t_copy = timed(lambda i: dst.copy_(src), repeats, 1, graph=False)
    half = src.view(torch.float16).random_(0, 8)  # finite values
    acc = torch.empty((), dtype=torch.float32, device="cuda")
    t_sum = timed(lambda i: torch.sum(half, dim=0, dtype=torch.float32, out=acc), repeats, 1, graph=False)
    return {"buffer_bytes": nbytes, "copy_s": t_copy, "copy_moved_bytes_per_s": 2 * nbytes / t_copy,
            "copy_read_bytes_per_s": nbytes / t_copy, "sum_s": t_sum, "read_bytes_per_s": nbytes / t_sum}


def random_gpuq(n: int, k: int, fmt: str, seed: int) -> GpuQ:
    g = torch.Generator(device="cuda").manual_seed(seed)
    if weight_format(fmt) in K_FORMATS:  # the file's blocks, packed as the loader packs them
        nb, bb = k // 256, spec(fmt).block_bytes
        blocks = torch.randint(0, 256, (n, nb, bb), generator=g, device="cuda", dtype=torch.uint8)
        at = 208 if fmt == "q6_k" else 0
        dd = (0.002 * torch.randn((n, nb, 1 if fmt == "q6_k" else 2), generator=g, device="cuda")).abs().half()
        blocks[:, :, at:at + dd.shape[2] * 2] = dd.view(torch.uint8)
        return pack(QTensor(blocks.view(n, nb * bb), fmt, (n, k)), "cuda")
    q4 = fmt == "q4_0"
    qs = torch.randint(0, 256, (n, k // 2 if q4 else k), generator=g, device="cuda", dtype=torch.uint8)
    scales = (0.02 * torch.randn((n, k // 32), generator=g, device="cuda")).half()
    return GpuQ(qs if q4 else qs.view(torch.int8), scales, fmt, (n, k))


def copies_for(nbytes: int) -> int:
    return max(2, -(-ROTATE_BYTES // nbytes))


def gemv(x: torch.Tensor, w: GpuQ, out: torch.Tensor, config: tuple | None = None) -> torch.Tensor:
    if w.kquant:
        return qgemv_k.gemv(x, w, None, out, config=config)
    return qgemv.gemv(x, w.qs, w.scales, w.q4, None, out, config=config)


def check_once(w: GpuQ, x: torch.Tensor) -> float:
    """Max |y - ref| / max |ref| of the GEMV against float32 de-quantized weights (a sanity figure)."""
    y = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device="cuda")
    gemv(x, w, y)
    ref = x.float() @ w.dequantize(torch.float32).T
    return float((y.float() - ref).abs().max() / ref.abs().max())


def bench_quant(n: int, k: int, fmt: str, m: int, dtype: torch.dtype, repeats: int, calls: int,
                configs: list | None) -> dict:
    ws = [random_gpuq(n, k, fmt, seed) for seed in range(copies_for(row_bytes(fmt, k) * n))]
    x = torch.randn((m, k), device="cuda").to(dtype)
    out = torch.empty((m, n), dtype=dtype, device="cuda")
    nbytes = ws[0].nbytes

    def call(config):
        return lambda i: gemv(x, ws[i % len(ws)], out, config)

    cfg = qgemv_k.gemv_config(n, k, ws[0].fmt, m) if ws[0].kquant else qgemv.gemv_config(n, k, fmt == "q4_0", m)
    res = {"format": fmt, "n": n, "k": k, "tokens": m, "weight_bytes": nbytes, "copies": len(ws),
           "config": list(cfg), "rel_err_vs_f32": check_once(ws[0], x)}
    for mode in ("graph", "eager"):
        t = timed(call(None), repeats, calls, graph=mode == "graph")
        res[f"{mode}_s"], res[f"{mode}_bytes_per_s"] = t, nbytes / t
    if configs:
        sweep = []
        for c in configs:
            try:
                t = timed(call(c), max(10, repeats // 4), calls, graph=True)
            except Exception as e:  # a config the compiler refuses (registers, shared memory): recorded, skipped
                sweep.append({"config": list(c), "error": str(e).splitlines()[0][:200]})
                continue
            sweep.append({"config": list(c), "graph_s": t, "graph_bytes_per_s": nbytes / t})
        ok = [s for s in sweep if "graph_s" in s]
        res["sweep"] = sweep
        if ok:
            res["sweep_best"] = min(ok, key=lambda s: s["graph_s"])
    return res


def bench_fp16(n: int, k: int, m: int, repeats: int, calls: int) -> list[dict]:
    ws = [torch.randn((n, k), device="cuda").half() for _ in range(copies_for(n * k * 2))]
    x = torch.randn((m, k), device="cuda").half()
    out = torch.empty((m, n), dtype=torch.float16, device="cuda")
    rows = []
    kernels = {"fp16_cublas": lambda i: torch.mm(x, ws[i % len(ws)].t(), out=out)}
    if m == 1:
        from hotneurons.kernels import fused

        kernels["fp16_triton"] = lambda i: fused._gemv(x, ws[i % len(ws)], None, out)
    for name, fn in kernels.items():
        res = {"format": name, "n": n, "k": k, "tokens": m, "weight_bytes": n * k * 2, "copies": len(ws)}
        for mode in ("graph", "eager"):
            t = timed(fn, repeats, calls, graph=mode == "graph")
            res[f"{mode}_s"], res[f"{mode}_bytes_per_s"] = t, n * k * 2 / t
        rows.append(res)
    return rows


def sweep_configs(n: int, k: int, fmt: str, m: int) -> list[tuple[int, int, int]]:
    """(BLOCK_N, BLOCK_B | BLOCK_U, num_warps) around gemv_config's: a step's 16-byte units one a thread (the kernels'
    layout: a Q4 block, half a Q8_0 block, a K-quant's 32 weights)."""
    out = []
    for nw in (1, 2, 4):
        bb = 32 * nw // (2 if fmt == "q8_0" else 1)
        if bb > triton_pow2(k // 32):
            continue
        for bn in (2, 4, 8):
            if m * bn <= 32:  # each token's and row's sums are registers
                out.append((bn, bb, nw))
    return sorted(set(out))


def triton_pow2(v: int) -> int:
    import triton

    return triton.next_power_of_2(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="results JSON (bench/record.py's schema)")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="n x k, comma separated")
    ap.add_argument("--tokens", default="1,2,4,8", help="rows of x, comma separated (<= 8: the GEMV)")
    ap.add_argument("--formats", default="q4_0,q8_0,q4_k,q5_k,q6_k", help="block formats, comma separated")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--calls", type=int, default=20, help="GEMVs a timed run (a graph holds this many)")
    ap.add_argument("--sweep", action="store_true", help="also time the alternative block configs")
    a = ap.parse_args(argv)
    formats = [str(weight_format(f)) for f in a.formats.split(",")]
    if any(f not in ("q4_0", "q8_0") and weight_format(f) not in K_FORMATS for f in formats):
        ap.error(f"--formats {a.formats}: choose from q4_0, q8_0, q4_k, q5_k, q6_k")
    if not torch.cuda.is_available():
        print("bench/qgemv.py needs CUDA", file=sys.stderr)
        return 2
    dtype = getattr(torch, a.dtype)
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in a.shapes.split(",")]
    tokens = [int(t) for t in a.tokens.split(",")]
    ceil = ceilings(a.repeats)
    print(f"copy {ceil['copy_moved_bytes_per_s'] / 1e12:.2f} TB/s moved, sum {ceil['read_bytes_per_s'] / 1e12:.2f} "
          f"TB/s read", file=sys.stderr)
    rows = []

    def add(r: dict) -> None:  # ratios to the ceilings, printed as it comes (a stopped run still shows its rows)
        for mode in ("graph", "eager"):
            bw = r[f"{mode}_bytes_per_s"]
            r[f"{mode}_of_copy"] = bw / ceil["copy_moved_bytes_per_s"]
            r[f"{mode}_of_read"] = bw / ceil["read_bytes_per_s"]
        best = r.get("sweep_best")
        print(f"{r['format']:>12} {r['n']:>6}x{r['k']:<6} m={r['tokens']} graph {r['graph_s'] * 1e6:8.1f} us "
              f"{r['graph_bytes_per_s'] / 1e12:5.2f} TB/s = {r['graph_of_copy']:.2f} of copy, "
              f"{r['graph_of_read']:.2f} of read; eager {r['eager_s'] * 1e6:8.1f} us"
              + (f"; sweep best {best['config']} {best['graph_bytes_per_s'] / 1e12:.2f} TB/s" if best else ""),
              file=sys.stderr, flush=True)
        rows.append(r)

    for n, k in shapes:
        for m in tokens:
            for fmt in formats:
                sweep = sweep_configs(n, k, fmt, m) if a.sweep else None
                add(bench_quant(n, k, fmt, m, dtype, a.repeats, a.calls, sweep))
                torch.cuda.empty_cache()  # the last weights' copies (each bench function's locals are gone)
            for r in bench_fp16(n, k, m, a.repeats, a.calls):
                add(r)
            torch.cuda.empty_cache()
    ones = {(r["format"], r["n"], r["k"]): r["graph_s"] for r in rows if r["tokens"] == 1}
    for r in rows:  # m tokens in one call against m calls of one token (<= 1: no slower per token)
        t1 = ones.get((r["format"], r["n"], r["k"]))
        if t1 and r["tokens"] > 1:
            r["graph_s_over_tokens_times_1"] = r["graph_s"] / (r["tokens"] * t1)
    figures = {"ceilings": ceil, "gemv": rows, "dtype": a.dtype, "repeats": a.repeats, "calls": a.calls,
               "weights": "random bytes (valid Q4_0 / Q8_0 blocks), fp16 scales ~ N(0, 0.02) (K-quants: random "
                          "blocks, d and dmin ~ |N(0, 0.002)|, packed); x ~ N(0, 1)",
               "bandwidth": "bytes of the weight as stored (quants + scales) / time; of_copy: over the copy's "
                            "bytes moved (read + written) / time; of_read: over torch.sum's bytes read / time"}
    record.write_result(a.out, figures)
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
