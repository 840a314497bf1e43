"""The cold kernel against two variants on one LLaMA-2-70B-shaped layer (d 8192, 28672 neurons), and row memory
from torch (4 KiB pages) vs numpy (2 MiB pages under THP=madvise). Writes OUT/kernel_variants.json.

  scratch   the kernel before the fused widening: each bf16 row widened into a per-thread scratch row, then dot/axpy
  fused     runtime/kernels.py: the widening inside the dot and axpy loops (vectorised)
  pf1, pf4  fused + software prefetch of the next neuron's rows (1 or 4 cache lines per 4 KiB page)

Active rows are drawn among neurons whose gate is positive for x, so each reads its gate, up and down rows.
Usage: python bench/kernel_variants.py OUT [n d]"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pi_bench  # noqa: E402  (imports powerinfer.* from this checkout; host_memory)

import bench_ceilings as ceil  # noqa: E402
from powerinfer.runtime import kernels as K  # noqa: E402


@intrinsic
def _prefetch(typingctx, arr, offset):
    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        fnty = ir.FunctionType(ir.VoidType(), [ptr.type, ir.IntType(32), ir.IntType(32), ir.IntType(32)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch")
        builder.call(fn, [ptr] + [ir.Constant(ir.IntType(32), v) for v in (0, 3, 1)])  # read, keep, data
        return context.get_dummy_value()

    return types.void(arr, types.intp), codegen


@njit(nogil=True, fastmath=True)
def _widen(row, scratch):  # (d,) bf16 bits -> (d,) uint32 whose float32 view is the value
    for k in range(row.shape[0]):
        scratch[k] = np.uint32(row[k]) << np.uint32(16)
    return scratch.view(np.float32)


@njit(parallel=True, nogil=True, fastmath=True)
def gated_scratch(x, idx, gate, up, down_t, out, threads):  # ReGLU only
    d, k = x.shape[0], idx.shape[0]
    T = K._n_chunks(k, threads)
    part = np.zeros((T, d), np.float32)
    scratch = np.empty((T, d), np.uint32)
    for t in prange(T):
        for q in range(t * k // T, (t + 1) * k // T):
            j = idx[q]
            f = _widen(gate[j], scratch[t])
            g = np.float32(0.0)
            for i in range(d):
                g += x[i] * f[i]
            if g <= 0:
                continue
            f = _widen(up[j], scratch[t])
            u = np.float32(0.0)
            for i in range(d):
                u += x[i] * f[i]
            f = _widen(down_t[j], scratch[t])
            for i in range(d):
                part[t, i] += g * u * f[i]
    K._reduce(part, out)


@njit(parallel=True, nogil=True, fastmath=True)
def gated_prefetch(x, idx, gate, up, down_t, out, threads, lines):  # ReGLU only
    d, k = x.shape[0], idx.shape[0]
    T = K._n_chunks(k, threads)
    part = np.zeros((T, d), np.float32)
    for t in prange(T):
        lo, hi = t * k // T, (t + 1) * k // T
        for q in range(lo, hi):
            if q + 1 < hi:
                jn = idx[q + 1]
                for off in range(0, d, 2048):  # 2048 bf16 = one 4 KiB page
                    for line in range(lines):
                        _prefetch(gate[jn], off + 32 * line)
                        _prefetch(up[jn], off + 32 * line)
                        _prefetch(down_t[jn], off + 32 * line)
            j = idx[q]
            g = K._dot(x, gate[j])
            if g <= 0:
                continue
            K._axpy(g * K._dot(x, up[j]), down_t[j], part[t])
    K._reduce(part, out)


def _huge_mb() -> float:
    return 1024 * pi_bench.host_memory()["AnonHugePages"]


def main(out: Path, n: int = 28672, d: int = 8192, reps: int = 8) -> dict:
    facts = {}
    for cmd in ("cat /sys/kernel/mm/transparent_hugepage/enabled", "lscpu", "free -g"):
        facts[cmd] = subprocess.run(cmd.split(), capture_output=True, text=True).stdout[-3000:]
    res = {"facts": facts, "threads": numba.get_num_threads(), "dram": ceil.dram_read_bw(2 * 2**30)}
    g = torch.Generator().manual_seed(0)
    h0 = _huge_mb()
    rows_torch = {k: torch.randn(n, d, generator=g).mul_(0.02).to(torch.bfloat16).view(torch.int16).numpy()
                  .view(np.uint16) for k in ("gate", "up", "down_t")}  # torch-owned memory
    h1 = _huge_mb()
    rows_np = {k: K.to_bf16_bits(torch.from_numpy(v.view(np.int16)).view(torch.bfloat16)) for k, v in rows_torch.items()}
    res.update(torch_alloc_hugepages_mb=h1 - h0, numpy_alloc_hugepages_mb=_huge_mb() - h1)
    x = torch.randn(d, generator=g).numpy()
    positive = np.flatnonzero((rows_np["gate"].astype(np.uint32) << 16).view(np.float32) @ x > 0)
    o = np.zeros(d, np.float32)
    T = numba.get_num_threads()
    ones, part = np.ones((3, n, 1), np.float32), np.empty((T, d), np.float32)  # bf16 rows: one unit scale; scratch
    variants = {
        "scratch": lambda R, s: gated_scratch(x, s, R["gate"], R["up"], R["down_t"], o, T),
        "fused": lambda R, s: K.gated_ffn(x, s, R["gate"], R["up"], R["down_t"], ones, d, part, o, K.ACT_CODE["reglu"]),
        "pf1": lambda R, s: gated_prefetch(x, s, R["gate"], R["up"], R["down_t"], o, T, 1),
        "pf4": lambda R, s: gated_prefetch(x, s, R["gate"], R["up"], R["down_t"], o, T, 4),
    }
    rng = np.random.default_rng(0)
    table = []
    for dens in (0.0, 0.05, 0.10, 0.20):
        k = int(dens * n)
        sets = [np.sort(rng.choice(positive, k, replace=False)).astype(np.int64) for _ in range(reps + 1)]
        for alloc, R in (("torch", rows_torch), ("numpy", rows_np)):
            for name, fn in variants.items():
                fn(R, sets[0])
                ts = []
                for s in sets[1:]:
                    t0 = time.perf_counter()
                    fn(R, s)
                    ts.append(time.perf_counter() - t0)
                nbytes = k * 3 * d * 2
                table.append({"density": dens, "alloc": alloc, "variant": name, "active_rows": k,
                              "best_ms": 1e3 * min(ts), "median_ms": 1e3 * float(np.median(ts)),
                              "GBps": nbytes / min(ts) / 1e9,
                              "share_of_dram": nbytes / min(ts) / res["dram"]["best_bytes_per_s"]})
                print(table[-1], flush=True)
    outs = []
    for fn in variants.values():
        fn(rows_np, sets[1])
        outs.append(o.copy())
    res["max_abs_diff_vs_scratch"] = float(max(np.abs(a - outs[0]).max() for a in outs[1:]))
    res["rows"] = table
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_variants.json").write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main(Path(sys.argv[1]), *map(int, sys.argv[2:4]))
