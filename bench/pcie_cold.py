"""Can the GPU compute some active cold neurons from rows in pinned host RAM, read over PCIe, while the CPU computes
the others from DRAM, and do the two reads add up?

A 70B-shaped layer's cold rows (27,200 neurons x 8192, bf16; gate, up and down_t) copied into 12 layers (16 GB, as
the hybrid run holds), registered with CUDA (page-locked, mapped into the GPU's address space). Per layer ~1,880
active neurons drawn among those whose gate is positive, as an exact predictor marks them. Cases:

  cpu               the Numba kernel on all active rows, 12 layers in turn (decode's cold part today)
  gpu-K             the GPU alone: K active neurons a layer gathered from the mapped rows (torch index_select over
                    PCIe) and computed there, 12 layers in turn
  dma+dram          reference ceilings: a copy-engine H2D copy of a contiguous pinned buffer while the CPU runs its DRAM
                    reduction, each alone and both at once
  pads-R-of-1024    1024 rows of which only R are distinct (the rest row 0 again): does padding cost PCIe reads?
  embedding-bag-R   y = sum_j h_j down_t[j] by F.embedding_bag with padding rows, against a gather and a product
  graph-split       the GPU part in a CUDA graph (mask on the device, its first 40% of marked rows, padding to
                    1024), the CPU the rest, per layer
  zc+cpu            zero-copy gathers while the CPU runs its cold kernel, then its DRAM reduction (16B-: 16-byte loads)
  split-K           decode-like: per layer the GPU takes K of the active neurons and the CPU the rest, at once; the
                    layer's time is until both are done (eager launches; 16B-: 16-byte loads)

Usage: python bench/pcie_cold.py OUT [--steps 10] [--layers 12] [--ks 256,512,...]. Writes OUT/pcie_cold.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_ceilings as ceil  # noqa: E402
import numba  # noqa: E402
import numpy as np  # noqa: E402
import pi_bench  # noqa: E402,F401  (sets the OpenMP policy, imports powerinfer.* from this checkout)
import torch  # noqa: E402
from decode_cpu_side import active_sets, layer_args, layer_copies  # noqa: E402
from hotneurons.common.hardware import machine_info  # noqa: E402
from hotneurons.runtime import cold_rows as C  # noqa: E402
from hotneurons.runtime import kernels as K  # noqa: E402


class _Mapped:
    """A numpy array registered with CUDA, seen by torch as a CUDA tensor (its host pointer is valid on the GPU)."""

    def __init__(self, a: np.ndarray):
        self.a = a
        self.__cuda_array_interface__ = {"shape": a.shape, "typestr": a.dtype.str, "data": (a.ctypes.data, False),
                                         "version": 3, "strides": None}


def mapped(a: np.ndarray) -> torch.Tensor:
    err = torch.cuda.cudart().cudaHostRegister(a.ctypes.data, a.nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {err}")
    return torch.as_tensor(_Mapped(a.view(np.int64)), device="cuda")  # (n, d / 4) int64: 8-byte loads


def wide(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.complex128)  # (n, d / 8): 16-byte loads


def gpu_cold(x: torch.Tensor, idx: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down_t: torch.Tensor):
    """(d,) bf16 x; (K,) rows; mapped (n, d / 4) int64 views -> (d,) float32 sum of relu(g) * u * down_t rows."""
    g = gate.index_select(0, idx).view(torch.bfloat16)  # (K, d) read over PCIe
    u = up.index_select(0, idx).view(torch.bfloat16)
    h = torch.relu(g @ x) * (u @ x)  # (K,)
    dn = down_t.index_select(0, idx).view(torch.bfloat16)  # (K, d)
    return (h @ dn).float()


def reglu_reference(base: C.ColdRows, s: np.ndarray, x: torch.Tensor) -> np.ndarray:
    """float64 numpy: sum over rows s of relu(gate . x) * (up . x) * down_t."""
    w = {k: C.from_bf16_bits(getattr(base, k)[s]).double().numpy() for k in ("gate", "up", "down_t")}
    xb = x.double().cpu().numpy()
    return (np.maximum(w["gate"] @ xb, 0) * (w["up"] @ xb)) @ w["down_t"]


def split_times(steps: int, layers: int, gpu_part, cpu_part, before=None) -> dict:
    """Each layer i of each step (the first step dropped): `before(step, i)` (untimed), then gpu_part(step, i)
    queued between two CUDA events, cpu_part(step, i) on the host, and a wait for the events. Mean ms of the layer,
    of the CPU part and of the GPU part."""
    ev0, ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    lay, cpu_ms, gpu_ms = [], [], []
    for si in range(steps):
        for i in range(layers):
            if before is not None:
                before(si, i)
            t = time.perf_counter()
            ev0.record()
            gpu_part(si, i)
            ev.record()
            t1 = time.perf_counter()
            cpu_part(si, i)
            t2 = time.perf_counter()
            ev.synchronize()
            if si:
                lay.append(1e3 * (time.perf_counter() - t))
                cpu_ms.append(1e3 * (t2 - t1))
                gpu_ms.append(ev0.elapsed_time(ev))
    return {"layer_ms": float(np.mean(lay)), "cpu_ms": float(np.mean(cpu_ms)), "gpu_ms": float(np.mean(gpu_ms))}


def main() -> dict:
    ap = layer_args(__doc__, steps=10)
    ap.add_argument("--ks", default="256,512,768,1024,1536")
    ap.add_argument("--splits", default="400,600,800,1000")
    args = ap.parse_args()
    n, d, L = args.n, args.d, args.layers
    res = {"what": __doc__.splitlines()[0], "command": "python " + " ".join(sys.argv),
           "args": vars(args) | {"out": str(args.out)}, "machine": machine_info("numba"),
           "threads": numba.get_num_threads(), "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "cases": {}}
    g = torch.Generator().manual_seed(0)
    base = C.ColdRows.from_weights(*(torch.randn(n, d, generator=g) * 0.02 for _ in range(2)), None,
                                   torch.randn(n, d, generator=g) * 0.02)
    layers = layer_copies(base, L)
    t0 = time.perf_counter()
    dev = [tuple(mapped(a) for a in (r.gate, r.up, r.down_t)) for r in layers]
    res["register_s"] = time.perf_counter() - t0
    print("registered", res["register_s"], flush=True)
    x = torch.randn(d, generator=g).numpy()
    xd = torch.from_numpy(x).cuda().bfloat16()
    sets = active_sets(base, x, args.active, L, args.steps + 1)
    out = np.zeros(d, np.float32)
    part = np.empty((numba.get_num_threads(), d), np.float32)
    row_bytes = 3 * d * 2

    # correctness of the GPU path against float64 numpy
    s = sets[0][0][:300]
    ref = reglu_reference(base, s, xd)
    got = gpu_cold(xd, torch.from_numpy(s).cuda(), *dev[0]).double().cpu().numpy()
    res["gpu_max_rel_err"] = float(np.abs(got - ref).max() / np.abs(ref).max())

    def cpu_call(i, s):
        K.ffn_rows("reglu", x, s, layers[i], out, part)

    cpu_call(0, sets[0][0])
    ms = []
    for step in sets[1:]:
        for i, s in enumerate(step):
            t = time.perf_counter()
            cpu_call(i, s)
            ms.append(1e3 * (time.perf_counter() - t))
    res["cases"]["cpu"] = {"rows": args.active, "mean_ms": float(np.mean(ms)), "median_ms": float(np.median(ms)),
                           "GBps": args.active * row_bytes / np.mean(ms) / 1e6}
    print("cpu", res["cases"]["cpu"], flush=True)

    idx_dev = [[torch.from_numpy(s).cuda() for s in step] for step in sets]
    for k in [int(v) for v in args.ks.split(",")]:
        gpu_cold(xd, idx_dev[0][0][:k], *dev[0])
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for step in idx_dev[1:]:
            for i, s in enumerate(step):
                gpu_cold(xd, s[:k], *dev[i])
        e1.record()
        e1.synchronize()
        per = e0.elapsed_time(e1) / (args.steps * L)
        res["cases"][f"gpu-{k}"] = {"rows": k, "ms_per_layer": per, "GBps": k * row_bytes / per / 1e6}
        print(f"gpu-{k}", res["cases"][f"gpu-{k}"], flush=True)

    # pads: K rows of which only `real` are distinct, the rest row 0 again (cached on the GPU, or read again?)
    def timed_gpu(fn, reps=20):
        fn()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            fn()
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1) / reps

    s0 = idx_dev[1][0]
    for real in (256, 512, 1024):
        padded = torch.cat([s0[:real], torch.zeros(1024 - real, dtype=torch.long, device="cuda")])
        res["cases"][f"pads-{real}-of-1024"] = {
            "padded_ms": timed_gpu(lambda: gpu_cold(xd, padded, *dev[0])),
            "real_only_ms": timed_gpu(lambda: gpu_cold(xd, s0[:real], *dev[0]))}
        print(f"pads-{real}", res["cases"][f"pads-{real}-of-1024"], flush=True)
    # embedding_bag: y = sum_j h_j down_t[j] without gathering, padding rows skipped?
    down_bf = torch.as_tensor(_Mapped(layers[0].down_t.view(np.int16)), device="cuda").view(torch.bfloat16)  # (n, d)
    hvec = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    for real in (256, 512, 1024):
        ids = torch.cat([s0[:real], torch.full((1024 - real,), n - 1, dtype=torch.long, device="cuda")])
        off = torch.zeros(1, dtype=torch.long, device="cuda")
        f = lambda: torch.nn.functional.embedding_bag(ids, down_bf, off, mode="sum", per_sample_weights=hvec,
                                                      padding_idx=n - 1)
        ref = (hvec[:real].double() @ down_bf.index_select(0, s0[:real]).double()).float()
        res["cases"][f"embedding-bag-{real}-of-1024"] = {
            "ms": timed_gpu(f), "gather_ms": timed_gpu(lambda: hvec[:real] @ down_bf.index_select(0, s0[:real])),
            "max_rel_err": float((f()[0].float() - ref).abs().max() / ref.abs().max())}
        print(f"ebag-{real}", res["cases"][f"embedding-bag-{real}-of-1024"], flush=True)
    # the whole GPU part in a CUDA graph: mask on the device, the first k = c * share active rows, pads to row 0
    m_dev = torch.zeros(n, dtype=torch.bool, device="cuda")
    cap, num = 1024, 410
    ar = torch.arange(cap, device="cuda")
    out_g = torch.zeros(d, device="cuda")

    def graph_part(i):
        k = torch.clamp(m_dev.sum() * num // 1024, max=cap)
        ids = torch.nonzero_static(m_dev, size=cap, fill_value=0)[:, 0]
        valid = ar < k
        ids = torch.where(valid, ids, 0)
        gg = dev[i][0].index_select(0, ids).view(torch.bfloat16).float()
        uu = dev[i][1].index_select(0, ids).view(torch.bfloat16).float()
        h = torch.relu(gg @ xd.float()) * (uu @ xd.float()) * valid
        out_g.copy_(h @ dev[i][2].index_select(0, ids).view(torch.bfloat16).float())

    try:
        m_dev[sets[1][0]] = True
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            graph_part(0)
        torch.cuda.current_stream().wait_stream(side)
        graphs = []
        for i in range(L):
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                graph_part(i)
            graphs.append(gr)
        ks = int(len(sets[1][0]) * num // 1024)
        ref = reglu_reference(base, sets[1][0][:ks], xd)
        graphs[0].replay()
        got = out_g.double().cpu().numpy()

        def set_mask(si, i):
            m_dev.zero_()
            m_dev[idx_dev[si][i]] = True
            torch.cuda.synchronize()

        def cpu_rest(si, i):
            s = sets[si][i]
            cpu_call(i, s[min(len(s) * num // 1024, cap):])

        t = split_times(len(sets), L, lambda si, i: graphs[i].replay(), cpu_rest, before=set_mask)
        res["cases"]["graph-split"] = {"share": num / 1024, "cap": cap, "max_rel_err": float(np.abs(got - ref).max() /
                                                                                       np.abs(ref).max()),
                                       **t, "GBps": args.active * row_bytes / t["layer_ms"] / 1e6}
    except Exception as e:  # noqa: BLE001
        res["cases"]["graph-split"] = {"error": repr(e)}
    print("graph-split", res["cases"]["graph-split"], flush=True)

    # copy engine and DRAM reduction, alone and at once
    nb = 2 * 2**30
    a = ceil._dram_array(nb)
    ceil._sum_blocks(a[:1024], 64, numba.get_num_threads())
    host = torch.empty(nb, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    devbuf = torch.empty(nb, dtype=torch.uint8, device="cuda")

    def dram():
        t = time.perf_counter()
        ceil._sum_blocks(a, 65536, numba.get_num_threads())
        return a.nbytes / (time.perf_counter() - t) / 1e9

    def dma(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            devbuf.copy_(host, non_blocking=True)
        e1.record()
        return e0, e1

    alone_dram = max(dram() for _ in range(3))
    e0, e1 = dma(3)
    e1.synchronize()
    alone_dma = 3 * nb / e0.elapsed_time(e1) / 1e6
    e0, e1 = dma(12)  # ~0.5 s of copies queued; the reductions run meanwhile
    both_dram = [dram() for _ in range(4)]
    done_early = e1.query()
    e1.synchronize()
    both_dma = 12 * nb / e0.elapsed_time(e1) / 1e6
    res["cases"]["dma+dram"] = {"dram_alone_GBps": alone_dram, "dma_alone_GBps": alone_dma,
                                "dram_during_dma_GBps": both_dram, "dma_during_dram_GBps": both_dma,
                                "dma_done_before_dram_ended": bool(done_early)}
    print("dma+dram", res["cases"]["dma+dram"], flush=True)
    del host, devbuf

    # zero-copy gathers (8- and 16-byte loads) while the CPU runs its cold kernel or the DRAM reduction
    for view, dv in (("", dev), ("16B-", [tuple(wide(t) for t in lay) for lay in dev])):
        k = 1024

        def zc(reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for r in range(reps):
                for i in range(L):
                    gpu_cold(xd, idx_dev[1 + r % args.steps][i][:k], *dv[i])
            e1.record()
            return e0, e1

        e0, e1 = zc(2)
        e1.synchronize()
        alone = 2 * L * k * row_bytes / e0.elapsed_time(e1) / 1e6
        e0, e1 = zc(40)  # ~1 s of gathers queued
        t = time.perf_counter()
        calls = 0
        while not e1.query() and calls < 2000:
            cpu_call(calls % L, sets[1 + calls // L % args.steps][calls % L])
            calls += 1
        cpu_s = time.perf_counter() - t
        e1.synchronize()
        zc_during_cpu = 40 * L * k * row_bytes / e0.elapsed_time(e1) / 1e6
        e0, e1 = zc(40)
        during = [dram()]
        while not e1.query():
            during.append(dram())
        e1.synchronize()
        zc_during_dram = 40 * L * k * row_bytes / e0.elapsed_time(e1) / 1e6
        res["cases"][f"{view}zc+cpu"] = {"zc_alone_GBps": alone, "zc_during_cpu_GBps": zc_during_cpu,
                                         "cpu_during_zc_GBps": calls * args.active * row_bytes / cpu_s / 1e9,
                                         "zc_during_dram_GBps": zc_during_dram, "dram_during_zc_GBps": during}
        print(f"{view}zc+cpu", res["cases"][f"{view}zc+cpu"], flush=True)

    # decode-like split: the GPU's share launched first (async), then the CPU's; wait for both
    dev16 = [tuple(wide(t) for t in lay) for lay in dev]
    for view, dv, k in [(view, dv, int(k)) for view, dv in (("", dev), ("16B-", dev16))
                        for k in args.splits.split(",")]:
        t = split_times(len(sets), L, lambda si, i: gpu_cold(xd, idx_dev[si][i][:k], *dv[i]),
                        lambda si, i: cpu_call(i, sets[si][i][k:]))
        res["cases"][f"{view}split-{k}"] = {"gpu_rows": k, "cpu_rows": args.active - k, **t,
                                            "GBps": args.active * row_bytes / t["layer_ms"] / 1e6}
        print(f"{view}split-{k}", res["cases"][f"{view}split-{k}"], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pcie_cold.json").write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
