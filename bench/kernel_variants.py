"""The cold kernel against variants on one LLaMA-2-70B-shaped layer (d 8192, 28672 neurons), bf16 and int8 rows.
Writes OUT/kernel_variants.json.

  bf16 scratch   the kernel before the fused widening: each row widened into a per-thread scratch row, then dot/axpy
  bf16 fused     runtime/kernels.py (the widening inside the dot and axpy loops; four neurons' gate and up rows at
                 once, then their down rows)
  int8 slice     int8 groups of 64 through a loop over slices of unknown length (the kernel's general path)
  int8 const     runtime/kernels.py: the group loop with a constant trip count
  * pf4          the kernel + software prefetch of the next neuron's rows (4 cache lines per 4 KiB page), with one
                 fixed contiguous share of the active list per thread
  * static       the kernel with one fixed contiguous share per thread (its form before dynamic sharing)
  * single       one neuron at a time, 4 from the shared counter at once (the kernel before it read four at once)
  * dyn16        one neuron at a time, 16 from the shared counter at once
  * c4, c16      the kernel's four rows at once, 4 or 16 neurons from the shared counter at once (the kernel: CHUNK 8)
  int8 const-8rows  eight neurons' rows at once, 8 from the shared counter (int8 rows are half as long as bf16's)
  int8 const-inline  the kernel on rows that carry their own scales: one (3, n, d + 4 groups) int8 array, each row's
                 float32 group scales right after its d weights, so a neuron reads three streams instead of six
                 (its scale rows, 512 bytes each at d 8192, are otherwise random reads of their own)
  * reads        the kernel's reads without its arithmetic (rows xor-ed, one vector op per 64 bytes), the same
                 claims and the same sum of partial rows: how fast a kernel with free arithmetic reads the same rows
  int8 const-noscale  the kernel with every neuron's scales one (3, 1, groups) row broadcast, always in cache: a bound
                 on what the scale rows' reads cost (its sums differ; not checked against the others)
  * -tl          timeline: the kernel's claims (fused-tl, const-tl), or 8 (guided-tl) or 16 (guided16-tl) at a time
                 and the last 8 per thread 4 at a time, each thread's start and end read from the time-stamp
                 counter: `timeline_us_median` splits a call into the threads' start, their claims, the tail (the
                 last thread's end after the mean end) and the partial rows' sum and return
  (pair, pair8, two neurons' rows in one pass: development-host figures in bench/NOTES.md, commit 4d4e9b0; removed)
  (quad8 in results/2026-11-22-h100-four-rows-ab: the runtime's four-row kernel's bf16-only prototype, since removed)
  (pagesL: a software prefetch of each 4 KiB page's first lines of the rows the next phase reads, commit 1d3b273;
  two-pass and pipe12, the kernel's gate and up rows in one pass, and also a group's down rows in the next group's
  pass, commit 7e503b5: results/2026-11-23-h100-kernel-passes.json and bench/NOTES.md; removed)
Densities include 16 rows (one a thread: the call's fixed cost), 2-3.5% and 6.5% (~600-1,880 rows, what decode marks per
layer).

Active rows are drawn among neurons whose gate is positive for x, so each reads its gate, up and down rows. Each
variant draws its own sets, and 2 GiB of other memory is read before each call (decode reads the other layers' rows
between two calls of a layer): results from before that (bench/results up to 2026-11-22 night) let a large L3 hold
rows of the previous variant's or set's call.
Results from an earlier form of this script (torch vs numpy row memory, prefetch of 1 line): results/2026-11-22-h100-
kernel-variants.json, commit 16d962e.
  other          with --other-kernels FILE: that file's kernel (another version of runtime/kernels.py, e.g. from
                 `git show REV:runtime/kernels.py > FILE`), for an A/B of a change to the kernel; its gated_ffn
                 where it has no cold_ffn
With --cached the calls read rows that the call before read (their rate as far as the caches hold the rows).
With --rounds R the variants are timed R times in turn at each density (A, B, A, B, ...), so that a drift of the
machine's speed does not fall on one of them.
Usage: python bench/kernel_variants.py OUT [n d] [--reps 8] [--rounds 1] [--variants fused,fused-dyn4,...]
       [--other-kernels FILE]"""

from __future__ import annotations

import argparse
import importlib.util
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
import bench_ceilings as ceil  # noqa: E402
import pi_bench  # noqa: E402,F401  (imports powerinfer.* from this checkout)
from hotneurons.runtime import cold_rows as C  # noqa: E402
from hotneurons.runtime import kernels as K  # noqa: E402

REGLU = K.ACT_CODE["reglu"]


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


@njit(nogil=True, fastmath=True, inline="always")
def _reglu_row(x, j, gate, up, down_t, scale, group, acc):  # acc += neuron j's ReGLU output, the runtime's _dot/_axpy
    g = K._dot(x, gate[j], scale[0, j], group)
    if g > 0:
        K._axpy(g * K._dot(x, up[j], scale[1, j], group), down_t[j], scale[2, j], group, acc)


G = K.INT8_GROUP


@njit(nogil=True, fastmath=True)
def _dot8_int8(x, m, j, scale, s):  # s (8,) = the dots of x with rows m[j[0..7]] (int8, groups of G), read at once
    s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7] = K._dot8(
        x, m[j[0]], m[j[1]], m[j[2]], m[j[3]], m[j[4]], m[j[5]], m[j[6]], m[j[7]], scale[j[0]], scale[j[1]],
        scale[j[2]], scale[j[3]], scale[j[4]], scale[j[5]], scale[j[6]], scale[j[7]], G)


@njit(nogil=True, fastmath=True)
def _axpy8_int8(h, m, j, scale, acc):  # acc += sum over the 8 rows m[j[q]] x h[q] (int8, groups of G), read at once
    r0, r1, r2, r3, r4, r5, r6, r7 = m[j[0]], m[j[1]], m[j[2]], m[j[3]], m[j[4]], m[j[5]], m[j[6]], m[j[7]]
    for i in range(acc.shape[0] // G):
        lo = i * G
        a0, a1, a2, a3 = h[0] * scale[j[0], i], h[1] * scale[j[1], i], h[2] * scale[j[2], i], h[3] * scale[j[3], i]
        a4, a5, a6, a7 = h[4] * scale[j[4], i], h[5] * scale[j[5], i], h[6] * scale[j[6], i], h[7] * scale[j[7], i]
        for k in range(G):
            acc[lo + k] += (a0 * np.float32(r0[lo + k]) + a1 * np.float32(r1[lo + k]) + a2 * np.float32(r2[lo + k])
                            + a3 * np.float32(r3[lo + k]) + a4 * np.float32(r4[lo + k]) + a5 * np.float32(r5[lo + k])
                            + a6 * np.float32(r6[lo + k]) + a7 * np.float32(r7[lo + k]))


@intrinsic
def _cycles(typingctx):
    """The CPU's time-stamp counter (llvm.readcyclecounter: rdtsc on x86)."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])

    return types.int64(), codegen


@njit(nogil=True)
def cycles():
    return _cycles()


@intrinsic
def _store_nt4(typingctx, dst, src, i):
    """dst[i:i + 4] = src[i:i + 4] (float32) as one non-temporal 16-byte store (MOVNTPS: to memory, past the caches;
    dst 16-byte aligned, as numpy's arrays are). LLVM does not vectorise a loop of scalar non-temporal stores."""
    def codegen(context, builder, sig, args):
        vec = ir.VectorType(ir.FloatType(), 4)
        d = context.make_array(sig.args[0])(context, builder, args[0])
        s = context.make_array(sig.args[1])(context, builder, args[1])
        v = builder.load(builder.bitcast(builder.gep(s.data, [args[2]]), vec.as_pointer()), align=4)
        st = builder.store(v, builder.bitcast(builder.gep(d.data, [args[2]]), vec.as_pointer()), align=16)
        st.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()

    return types.none(dst, src, types.int64), codegen


SUMS = ("none", "sum", "nt")  # dynamic's `sums`: what follows the claims (see there)


def ticks_per_us(seconds: float = 0.2) -> float:
    """The time-stamp counter's rate, against time.perf_counter over a spin of `seconds`."""
    c0, t0 = cycles(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pass
    return (cycles() - c0) / (1e6 * (time.perf_counter() - t0))


NO_STAMPS = np.zeros((0, 2), np.int64)
NO_ROWS = np.zeros((0, 1), np.float32)
NO_OWN, NO_OWN_N = np.zeros((0, 1), np.int64), np.zeros(0, np.int64)


@njit(parallel=True, nogil=True, fastmath=True)
def dynamic(x, idx, gate, up, down_t, scale, group, part, out, counter, chunk, width, tail=0, stamps=NO_STAMPS,
            sums=1, spare=NO_ROWS, own=NO_OWN, own_n=NO_OWN_N):
    """Threads take `chunk` neurons at a time from a shared counter and read the rows of `width` neurons at once:
    1 (one row at a time), 4 (the runtime's _gated4) or 8 (int8 rows in groups of G only: _dot8_int8, chunk 8); a
    group with a gate <= 0, and the claim's tail, go through the one-neuron path.

    tail > 0: the last `tail` positions are claimed 4 at a time (the counter then counts claims), so that the threads
    end closer together. stamps (T, 2): each thread's time-stamp counter when it starts and when its claims end.
    sums (SUMS' index): after the claims, 0 no sum (the partial rows left in `part`, for a reader elsewhere); 1 the
    partial rows summed by all threads, one slice of d each (cold_ffn's); 2 each thread copies its row into spare
    (T, d) with non-temporal stores, and the sum reads spare (CLDEMOTE, the other way out of the core's caches, needs
    inline assembly, which Numba's LLVM cannot assemble).
    own (T, m) int64, own_n (T,): thread t first computes the positions own[t, :own_n[t]] (rows it read into its own
    caches before, cold_layer_timeline.warm_rows), four at a time, then claims from idx."""
    d, k = x.shape[0], idx.shape[0]
    T = K._n_chunks(k, part.shape[0])
    counter[0] = 0
    head = max(0, k - tail) // chunk * chunk  # positions claimed `chunk` at a time
    for t in prange(T):
        if stamps.shape[0] > 0:
            stamps[t, 0] = _cycles()
        acc = part[t]
        acc[:] = 0.0
        g, u = np.empty(8, np.float32), np.empty(8, np.float32)
        if t < own_n.shape[0]:
            mine = own[t, :own_n[t]]
            q = 0
            while q + 4 <= mine.shape[0]:
                K._gated4(x, mine[q], mine[q + 1], mine[q + 2], mine[q + 3], gate, up, down_t, scale, group, acc, REGLU)
                q += 4
            for r in range(q, mine.shape[0]):
                _reglu_row(x, mine[r], gate, up, down_t, scale, group, acc)
        while True:
            if tail > 0:
                q0, q1 = K._claim(K._fetch_add(counter, 1), k, head, chunk)
            else:
                q0 = K._fetch_add(counter, chunk)
                q1 = min(q0 + chunk, k)
            if q0 >= k:
                break
            q = q0
            while width == 4 and q + 4 <= q1:  # the runtime's four-at-once path, with another claim size
                K._gated4(x, idx[q], idx[q + 1], idx[q + 2], idx[q + 3], gate, up, down_t, scale, group, acc, REGLU)
                q += 4
            if width == 8 and q + 8 <= q1:
                j = idx[q:q + 8]
                _dot8_int8(x, gate, j, scale[0], g)
                if g.min() > 0:
                    _dot8_int8(x, up, j, scale[1], u)
                    _axpy8_int8(g * u, down_t, j, scale[2], acc)
                    q += 8
            for r in range(q, q1):
                _reglu_row(x, idx[r], gate, up, down_t, scale, group, acc)
        if stamps.shape[0] > 0:
            stamps[t, 1] = _cycles()
        if sums == 2:
            for i in range(0, d - d % 4, 4):  # d % 4 == 0 in the bench's shapes; a rest would go by plain stores
                _store_nt4(spare[t], acc, i)
            for i in range(d - d % 4, d):
                spare[t, i] = acc[i]
    if sums > 0:
        rows = spare if sums == 2 else part
        for c in prange(T):
            K._sum_rows(rows, T, out, c * d // T, (c + 1) * d // T)


@njit(nogil=True, fastmath=True)
def _xor_rows(r0, r1, r2, r3, r4, r5, r6, r7):  # the rows' elements xor-ed together: one vector op per 64 bytes of row
    s = r0[0] ^ r0[0]
    for k in range(r0.shape[0]):
        s ^= r0[k] ^ r1[k] ^ r2[k] ^ r3[k] ^ r4[k] ^ r5[k] ^ r6[k] ^ r7[k]
    return s


@njit(nogil=True, fastmath=True)
def _xor4(r0, r1, r2, r3):  # as _xor_rows; each row passed once (a row xor-ed with itself would fold to no read)
    s = r0[0] ^ r0[0]
    for k in range(r0.shape[0]):
        s ^= r0[k] ^ r1[k] ^ r2[k] ^ r3[k]
    return s


@njit(nogil=True, fastmath=True)
def _xor3(r0, r1, r2):
    s = r0[0] ^ r0[0]
    for k in range(r0.shape[0]):
        s ^= r0[k] ^ r1[k] ^ r2[k]
    return s


@njit(parallel=True, nogil=True, fastmath=True)
def reads_only(idx, gate, up, down_t, part, out, counter):
    """The kernel's reads without its arithmetic: the same claims (the kernel's CHUNK, TAIL and _claim), each claim's
    gate and up rows four neurons at once, then their down rows, xor-ed together (one vector op per 64 bytes instead
    of a widening and a multiply-add per 16 weights), then the partial rows' sum over threads. What is left of a
    call's time is its reads, its threads' start and end and the sum: the rate a kernel with free arithmetic reads."""
    d, k = part.shape[1], idx.shape[0]
    T = K._n_chunks(k, part.shape[0])
    head = max(0, k - K.TAIL * T) // K.CHUNK * K.CHUNK
    counter[0] = 0
    for t in prange(T):
        acc = part[t]
        acc[:] = 0.0
        s = 0
        while True:
            q0, q1 = K._claim(K._fetch_add(counter, 1), k, head)
            if q0 >= k:
                break
            for q in range(q0, q1 - 3, 4):
                j0, j1, j2, j3 = idx[q], idx[q + 1], idx[q + 2], idx[q + 3]
                s ^= int(_xor_rows(gate[j0], gate[j1], gate[j2], gate[j3], up[j0], up[j1], up[j2], up[j3]))
                s ^= int(_xor4(down_t[j0], down_t[j1], down_t[j2], down_t[j3]))
            for q in range(q0 + (q1 - q0) // 4 * 4, q1):
                j = idx[q]
                s ^= int(_xor3(gate[j], up[j], down_t[j]))
        acc[0] = s
    for c in prange(T):
        K._sum_rows(part, T, out, c * d // T, (c + 1) * d // T)


@njit(parallel=True, nogil=True, fastmath=True)
def static_shares(x, idx, gate, up, down_t, scale, group, part, out):  # ReGLU only
    d, k = x.shape[0], idx.shape[0]
    T = K._n_chunks(k, part.shape[0])
    for t in prange(T):
        acc = part[t]
        acc[:] = 0.0
        for q in range(t * k // T, (t + 1) * k // T):
            _reglu_row(x, idx[q], gate, up, down_t, scale, group, acc)
    for c in prange(T):
        K._sum_rows(part, T, out, c * d // T, (c + 1) * d // T)


@njit(nogil=True, fastmath=True)
def _scratch_widen(row, scratch):  # (d,) bf16 bits -> (d,) uint32 whose float32 view is the value
    for k in range(row.shape[0]):
        scratch[k] = np.uint32(row[k]) << np.uint32(16)
    return scratch.view(np.float32)


@njit(parallel=True, nogil=True, fastmath=True)
def bf16_scratch(x, idx, gate, up, down_t, part, out):  # ReGLU only
    d, k = x.shape[0], idx.shape[0]
    T = K._n_chunks(k, part.shape[0])
    scratch = np.empty((T, d), np.uint32)
    for t in prange(T):
        part[t] = 0
        for q in range(t * k // T, (t + 1) * k // T):
            j = idx[q]
            f = _scratch_widen(gate[j], scratch[t])
            g = np.float32(0.0)
            for i in range(d):
                g += x[i] * f[i]
            if g <= 0:
                continue
            f = _scratch_widen(up[j], scratch[t])
            u = np.float32(0.0)
            for i in range(d):
                u += x[i] * f[i]
            f = _scratch_widen(down_t[j], scratch[t])
            for i in range(d):
                part[t, i] += g * u * f[i]
    K._sum_rows(part, T, out, 0, d)


@njit(nogil=True, fastmath=True, inline="always")
def _dot_slices(x, row, sc, group):  # the kernel's general group loop, whatever the group
    d, s = x.shape[0], np.float32(0.0)
    for i in range(sc.shape[0]):
        lo = i * group
        xs, rs = x[lo:min(lo + group, d)], row[lo:min(lo + group, d)]
        p = np.float32(0.0)
        for k in range(xs.shape[0]):
            p += xs[k] * K._widen(rs[k])
        s += sc[i] * p
    return s


@njit(nogil=True, fastmath=True, inline="always")
def _axpy_slices(h, row, sc, group, acc):
    d = acc.shape[0]
    for i in range(sc.shape[0]):
        lo = i * group
        a, rs = acc[lo:min(lo + group, d)], row[lo:min(lo + group, d)]
        hs = h * sc[i]
        for k in range(a.shape[0]):
            a[k] += hs * K._widen(rs[k])


@njit(parallel=True, nogil=True, fastmath=True)
def int8_slices(x, idx, gate, up, down_t, scale, group, part, out):  # ReGLU only
    d, k = x.shape[0], idx.shape[0]
    T = K._n_chunks(k, part.shape[0])
    for t in prange(T):
        part[t] = 0
        for q in range(t * k // T, (t + 1) * k // T):
            j = idx[q]
            g = _dot_slices(x, gate[j], scale[0, j], group)
            if g <= 0:
                continue
            _axpy_slices(g * _dot_slices(x, up[j], scale[1, j], group), down_t[j], scale[2, j], group, part[t])
    K._sum_rows(part, T, out, 0, d)


@njit(parallel=True, nogil=True, fastmath=True)
def prefetched(x, idx, gate, up, down_t, scale, group, part, out, lines):  # ReGLU only; the runtime's _dot/_axpy
    d, k = x.shape[0], idx.shape[0]
    T = K._n_chunks(k, part.shape[0])
    page = 4096 // gate.itemsize  # elements per 4 KiB
    line = 64 // gate.itemsize
    for t in prange(T):
        part[t] = 0
        lo, hi = t * k // T, (t + 1) * k // T
        for q in range(lo, hi):
            if q + 1 < hi:
                jn = idx[q + 1]
                for off in range(0, d, page):
                    for m in range(lines):
                        _prefetch(gate[jn], off + line * m)
                        _prefetch(up[jn], off + line * m)
                        _prefetch(down_t[jn], off + line * m)
            _reglu_row(x, idx[q], gate, up, down_t, scale, group, part[t])
    K._sum_rows(part, T, out, 0, d)


def inline_scales(R: C.ColdRows) -> C.ColdRows:
    """int8 rows R with each row's float32 group scales stored right after its d weights, in one (3, n, d + 4 groups)
    int8 array; `scale` is a float32 view into it (3, n, groups), so the kernel runs unchanged (d is x's length)."""
    n, d = R.up.shape
    ng = R.scale.shape[2]
    comb = np.empty((3, n, d + 4 * ng), np.int8)
    for i, a in enumerate((R.gate, R.up, R.down_t)):
        comb[i, :, :d] = a
    sc = comb.view(np.float32)[:, :, d // 4:]  # (3, n, groups), each row inside its weights' row
    sc[:] = R.scale
    return C.ColdRows(comb[0], comb[1], comb[2], R.b_up, sc, R.group)


def broadcast_scales(R: C.ColdRows) -> C.ColdRows:
    """R with every neuron's scales those of neuron 0 (a stride-0 view): the scale reads always hit the cache."""
    return C.ColdRows(R.gate, R.up, R.down_t, R.b_up, np.broadcast_to(R.scale[:, :1], R.scale.shape), R.group)


def _other_kernel(path: Path):
    """fn(x, idx, R, part, out, act) from another version of runtime/kernels.py at `path`."""
    spec = importlib.util.spec_from_file_location("other_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    if hasattr(mod, "cold_ffn"):
        return lambda x, s, R, part, o, act: mod.cold_ffn(x, s, R.gate, R.up, R.b_up, R.down_t, R.scale, R.group,
                                                          part, o, act)
    return lambda x, s, R, part, o, act: mod.gated_ffn(x, s, R.gate, R.up, R.down_t, R.scale, R.group, part, o, act)


def main(out: Path, n: int = 28672, d: int = 8192, reps: int = 8, only: tuple[str, ...] = (), rounds: int = 1,
         other: Path | None = None, cached: bool = False) -> dict:
    facts = {cmd: subprocess.run(cmd.split(), capture_output=True, text=True).stdout[-3000:]
             for cmd in ("cat /sys/kernel/mm/transparent_hugepage/enabled", "lscpu", "free -g")}
    flush = ceil._dram_array(2 * 2**30)
    res = {"facts": facts, "threads": numba.get_num_threads(), "dram": ceil.dram_read_bw(flush.nbytes),
           "command": "python " + " ".join(sys.argv), "cached": cached}
    g = torch.Generator().manual_seed(0)
    w = {k: torch.randn(n, d, generator=g).mul_(0.02) for k in ("gate", "up", "down_t")}
    rows = {dt: C.ColdRows.from_weights(w["gate"], w["up"], None, w["down_t"], dt) for dt in C.COLD_DTYPES}
    rows_inline, rows_noscale = inline_scales(rows["int8"]), broadcast_scales(rows["int8"])
    x = torch.randn(d, generator=g).numpy()
    positive = np.flatnonzero(w["gate"].numpy() @ x > 0)
    del w
    o = np.zeros(d, np.float32)
    part = np.empty((numba.get_num_threads(), d), np.float32)
    counter = np.zeros(1, np.int64)

    def kernel(R, s):
        K.cold_ffn(x, s, R.gate, R.up, R.b_up, R.down_t, R.scale, R.group, part, o, REGLU)

    stamps = np.zeros((numba.get_num_threads(), 2), np.int64)

    def dyn(chunk: int, width: int, tail: int = 0, stamped: bool = False):  # `dynamic` with `chunk` neurons a claim,
        st = stamps if stamped else NO_STAMPS                                # `width` neurons' rows at once
        return lambda R, s: dynamic(x, s, R.gate, R.up, R.down_t, R.scale, R.group, part, o, counter, chunk, width,
                                    tail, st)

    tail = K.TAIL * len(stamps)  # the kernel's

    variants = {
        ("bf16", "scratch"): lambda R, s: bf16_scratch(x, s, R.gate, R.up, R.down_t, part, o),
        ("bf16", "fused"): kernel,
        ("bf16", "fused-pf4"): lambda R, s: prefetched(x, s, R.gate, R.up, R.down_t, R.scale, R.group, part, o, 4),
        ("bf16", "fused-static"): lambda R, s: static_shares(x, s, R.gate, R.up, R.down_t, R.scale, R.group, part, o),
        ("bf16", "fused-single"): dyn(4, 1),
        ("bf16", "fused-dyn16"): dyn(16, 1),
        ("bf16", "fused-c4"): dyn(4, 4),
        ("bf16", "fused-c16"): dyn(16, 4),
        ("bf16", "fused-tl"): dyn(8, 4, 0, True),
        ("bf16", "guided-tl"): dyn(8, 4, tail, True),
        ("bf16", "guided16-tl"): dyn(16, 4, tail, True),
        ("int8", "slice"): lambda R, s: int8_slices(x, s, R.gate, R.up, R.down_t, R.scale, R.group, part, o),
        ("int8", "const"): kernel,
        ("int8", "const-pf4"): lambda R, s: prefetched(x, s, R.gate, R.up, R.down_t, R.scale, R.group, part, o, 4),
        ("int8", "const-single"): dyn(4, 1),
        ("int8", "const-c4"): dyn(4, 4),
        ("int8", "const-8rows"): dyn(8, 8),
        ("int8", "const-inline"): lambda R, s: kernel(rows_inline, s),
        ("int8", "const-noscale"): lambda R, s: kernel(rows_noscale, s),
        ("bf16", "reads"): lambda R, s: reads_only(s, R.gate, R.up, R.down_t, part, o, counter),
        ("int8", "reads"): lambda R, s: reads_only(s, R.gate, R.up, R.down_t, part, o, counter),
        ("int8", "const-tl"): dyn(8, 4, 0, True),
        ("int8", "guided-tl"): dyn(8, 4, tail, True),
        ("int8", "const-static"): lambda R, s: static_shares(x, s, R.gate, R.up, R.down_t, R.scale, R.group, part, o),
    }
    if other is not None:
        other_fn = _other_kernel(other)
        res["other_kernels"] = str(other)
        variants[("bf16", "other")] = variants[("int8", "other")] = lambda R, s: other_fn(x, s, R, part, o, REGLU)
    if only:
        variants = {key: fn for key, fn in variants.items() if key[1] in only}
    res["tsc_ticks_per_us"] = ticks_per_us()
    tick_us = 1 / res["tsc_ticks_per_us"]  # us per time-stamp tick
    rng = np.random.default_rng(0)
    table, checks = [], {}
    for dens in (16 / n, 0.02, 0.035, 0.05, 0.065, 0.10, 0.20):
        k = int(round(dens * n))
        first = np.sort(rng.choice(positive, k, replace=False)).astype(np.int64)  # every variant's check
        for rnd, ((dt, name), fn) in ((r, v) for r in range(rounds) for v in variants.items()):
            R = rows[dt]
            fn(R, first)
            if rnd == 0 and name not in ("const-noscale", "reads"):
                checks.setdefault((dt, dens), []).append(o.copy())
            # fresh sets for each variant: a set the previous variant just read may still sit in the L3
            sets = [np.sort(rng.choice(positive, k, replace=False)).astype(np.int64) for _ in range(reps)]
            if cached:
                sets = [first] * reps  # read just before: in the caches as far as they hold them
            ts, parts = [], []
            for s in sets:
                if not cached:
                    ceil._sum_rows(flush, numba.get_num_threads())  # the L3 (300 MiB on the H100 host) emptied of rows
                stamps[:] = 0
                c0, t0 = cycles(), time.perf_counter()
                fn(R, s)
                ts.append(time.perf_counter() - t0)
                c1 = cycles()
                used = stamps[stamps[:, 0] > 0]
                if len(used):  # a stamped variant: where the call's time went, in us
                    ends = used[:, 1]
                    parts.append({"start": (used[:, 0].min() - c0) * tick_us,
                                  "work_mean": float((ends - used[:, 0]).mean()) * tick_us,
                                  "tail": (ends.max() - ends.mean()) * tick_us,
                                  "spread": (ends.max() - ends.min()) * tick_us, "after": (c1 - ends.max()) * tick_us})
            nbytes = k * 3 * (d * R.up.itemsize + 4 * R.scale.shape[2])
            table.append({"density": dens, "dtype": dt, "variant": name, "round": rnd, "active_rows": k,
                          "best_ms": 1e3 * min(ts), "median_ms": 1e3 * float(np.median(ts)),
                          "GBps": nbytes / min(ts) / 1e9, "G_weights_per_s": k * 3 * d / min(ts) / 1e9,
                          "share_of_dram": nbytes / min(ts) / res["dram"]["best_bytes_per_s"]})
            if parts:  # medians over the calls: thread start after the call began, a thread's claims, the last
                table[-1]["timeline_us_median"] = {  # thread's end after the mean end, first to last end, then
                    key: float(np.median([p[key] for p in parts])) for key in parts[0]}  # the sum and return
            print(table[-1], flush=True)
    # every variant of a dtype computes the same sum (float32, another order)
    res["max_rel_diff_within_dtype"] = float(max((np.abs(a - v[0]).max() / np.abs(v[0]).max()
                                                 for v in checks.values() for a in v[1:]), default=0.0))
    res["rows"] = table
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_variants.json").write_text(json.dumps(res, indent=1))
    return res


def layer_parser(doc: str) -> argparse.ArgumentParser:
    """A script's parser with OUT and one layer's neurons n and width d (a LLaMA-2-70B layer's by default)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("n", type=int, nargs="?", default=28672)
    ap.add_argument("d", type=int, nargs="?", default=8192)
    return ap


if __name__ == "__main__":
    ap = layer_parser(__doc__)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--variants", default="", help="comma list of variant names (default: all)")
    ap.add_argument("--rounds", type=int, default=1, help="times each variant is timed in turn at each density")
    ap.add_argument("--other-kernels", type=Path, help="another version of runtime/kernels.py: variant 'other'")
    ap.add_argument("--cached", action="store_true",
                    help="each call reads the rows of the call before (no 2 GiB read between): the variants' rate with "
                         "the rows in the caches as far as they fit (the L2s hold 2 MiB each, the L3 300 MiB)")
    a = ap.parse_args()
    main(a.out, a.n, a.d, a.reps, tuple(v for v in a.variants.split(",") if v), a.rounds, a.other_kernels, a.cached)
