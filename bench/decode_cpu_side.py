"""Why the cold part of a decode step reads slower than the kernel bench: the CPU side of decode, piece by piece.

A 70B-shaped layer's cold rows (27,200 neurons x 8192, bf16), copied into 12 layers (16 GB, as the hybrid run holds),
and per layer call ~1,880 active neurons drawn among those whose gate is positive (each reads its 3 rows), as the
exact predictor marks them. Each case runs `steps` decode-like steps of 12 calls and reports ms per call:

  one-layer        every call on layer 0's rows (what the kernel bench does)
  12-layers        the calls cycle through the 12 layers, back to back
  12-layers-wait   and before each call a GPU wait as in decode: a ~0.35 ms CUDA sleep kernel, then an event sync
  12-layers-poll-host    and during each call a graph waits on the GPU for a flag in pinned host memory, which the
                         CPU sets after the call (runtime/fast.py's prelaunch: the GPU polls host RAM meanwhile)
  12-layers-poll-device  the same with the flag in GPU memory, set by the CPU through a write on a side stream;
                         `release_ms`: from the CPU's release to the graph's end
  int8-*           the same with int8 rows (--cold-dtype int8)
  bundled-*        a neuron's gate, up and down rows adjacent in one (3 n, d) array: one 48 KB stream per neuron
                   instead of three 16 KB ones

Usage: python bench/decode_cpu_side.py OUT [--steps 20] [--layers 12] [--passes 1] [--cases a,b]. Writes
OUT/decode_cpu_side.json; with several passes the cases run in turn, pass after pass (the VMs' DRAM drifts).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_ceilings as ceil  # noqa: E402
import numba  # noqa: E402
import numpy as np  # noqa: E402
import pi_bench  # noqa: E402  (sets the OpenMP policy, imports powerinfer.* from this checkout)
import torch  # noqa: E402
from hotneurons.common.hardware import machine_info  # noqa: E402
from hotneurons.runtime import cold_rows as C  # noqa: E402
from hotneurons.runtime import kernels as K  # noqa: E402
from hotneurons.runtime.fast import HostFlags  # noqa: E402
from numba import njit, prange  # noqa: E402


@njit(parallel=True, nogil=True, fastmath=True)
def bundled_reglu(x, idx, rows, part, out):
    """ReGLU over a (3 n, d) array: neuron j's gate, up and down rows are rows 3j, 3j+1, 3j+2."""
    d, k = x.shape[0], idx.shape[0]
    T = K._n_chunks(k, part.shape[0])
    one = np.ones(1, np.float32)
    for t in prange(T):
        acc = part[t]
        acc[:] = 0.0
        for q in range(t * k // T, (t + 1) * k // T):
            j = 3 * idx[q]
            g = K._dot(x, rows[j], one, d)
            if g <= 0:
                continue
            K._axpy(g * K._dot(x, rows[j + 1], one, d), rows[j + 2], one, d, acc)
    for c in prange(T):
        K._sum_rows(part, T, out, c * d // T, (c + 1) * d // T)


def layer_copies(rows: C.ColdRows, layers: int) -> list[C.ColdRows]:
    """`rows` and layers - 1 copies in their own memory (a token reads one per layer, across GBs as decode does)."""
    return [rows] + [C.ColdRows(rows.gate.copy(), rows.up.copy(), rows.down_t.copy(), rows.b_up, rows.scale,
                                rows.group) for _ in range(layers - 1)]


def active_sets(base: C.ColdRows, x: np.ndarray, active: int, layers: int, steps: int) -> list[list[np.ndarray]]:
    """steps x layers sorted sets of `active` neurons among those whose gate is positive for x, as an exact
    predictor marks them."""
    positive = np.flatnonzero(C.from_bf16_bits(base.gate).numpy() @ x > 0)
    rng = np.random.default_rng(0)
    return [[np.sort(rng.choice(positive, active, replace=False)).astype(np.int64) for _ in range(layers)]
            for _ in range(steps)]


def layer_args(doc: str, steps: int) -> argparse.ArgumentParser:
    """The arguments this script and pcie_cold.py share: OUT and the 70B-shaped cold layer (copies, active neurons)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--n", type=int, default=27200)
    ap.add_argument("--d", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--active", type=int, default=1880)
    ap.add_argument("--steps", type=int, default=steps)
    return ap


def main() -> dict:
    ap = layer_args(__doc__, steps=20)
    ap.add_argument("--wait-ms", type=float, default=0.35)
    ap.add_argument("--passes", type=int, default=1)
    ap.add_argument("--cases", default=None, help="comma list of cases (default: all)")
    args = ap.parse_args()
    n, d, L = args.n, args.d, args.layers
    cuda = torch.cuda.is_available()
    res = {"what": __doc__.splitlines()[0], "command": "python " + " ".join(sys.argv),
           "args": vars(args) | {"out": str(args.out)}, "machine": machine_info("numba"),
           "omp_wait_policy": pi_bench.OMP_WAIT_POLICY, "threads": numba.get_num_threads(),
           "dram": ceil.dram_read_bw(2 * 2**30), "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "cases": {}}
    g = torch.Generator().manual_seed(0)
    base = C.ColdRows.from_weights(*(torch.randn(n, d, generator=g) * 0.02 for _ in range(2)), None,
                                   torch.randn(n, d, generator=g) * 0.02)
    layers = layer_copies(base, L)
    w = [C.from_bf16_bits(a) for a in (base.gate, base.up, base.down_t)]
    int8 = layer_copies(C.ColdRows.from_weights(w[0], w[1], None, w[2], "int8"), L)
    del w
    bundled = []
    for r in layers:
        b = np.empty((n, 3, d), np.uint16)
        b[:, 0], b[:, 1], b[:, 2] = r.gate, r.up, r.down_t
        bundled.append(b.reshape(3 * n, d))
    x = torch.randn(d, generator=g).numpy()
    sets = active_sets(base, x, args.active, L, args.steps + 1)
    out = np.zeros(d, np.float32)
    part = np.empty((numba.get_num_threads(), d), np.float32)
    nbytes = args.active * 3 * d * 2

    def gpu_wait():
        torch.cuda._sleep(int(args.wait_ms * 1.4e6))  # ~cycles at ~1.4-1.9 GHz; the wait is measured below
        ev = torch.cuda.Event()
        ev.record()
        ev.synchronize()

    cases = {
        "one-layer": (lambda i, s: K.ffn_rows("reglu", x, s, layers[0], out, part), False),
        "12-layers": (lambda i, s: K.ffn_rows("reglu", x, s, layers[i], out, part), False),
        "bundled-12-layers": (lambda i, s: bundled_reglu(x, s, bundled[i], part, out), False),
    }
    cases["int8-12-layers"] = (lambda i, s: K.ffn_rows("reglu", x, s, int8[i], out, part), False)
    polls = {}
    if cuda:
        gpu_wait()  # CUDA's first use out of the timed waits
        cases["12-layers-wait"] = (cases["12-layers"][0], "wait")
        cases["int8-12-layers-wait"] = (cases["int8-12-layers"][0], "wait")
        cases["bundled-12-layers-wait"] = (cases["bundled-12-layers"][0], "wait")
        flags = HostFlags.open(1, torch.device("cuda"))
        if flags is not None:
            dflag = torch.zeros(1, dtype=torch.int32, device="cuda")  # a flag in GPU memory
            side = torch.cuda.Stream()
            for where, addr in (("host", flags.dev), ("device", dflag.data_ptr())):
                gr = torch.cuda.CUDAGraph()
                with torch.cuda.graph(gr):
                    stream = torch.cuda.current_stream().cuda_stream
                    flags._wait(stream, addr, 1, HostFlags.EQ)
                    flags._write(stream, addr, 0, 0)
                    dflag.add_(0)
                release = flags.release if where == "host" else \
                    lambda _, a=addr: flags._write(side.cuda_stream, a, 1, 0)
                polls[where] = (gr, release)
                cases[f"12-layers-poll-{where}"] = (cases["12-layers"][0], where)
    names = args.cases.split(",") if args.cases else list(cases)
    for name in names:
        cases[name][0](0, sets[0][0])  # compile
    for p in range(args.passes):
        for name in names:
            call, mode = cases[name]
            ms, waits, rel = [], [], []
            end = torch.cuda.Event() if cuda else None
            for step in sets[1:]:
                for i, s in enumerate(step):
                    if mode:
                        t = time.perf_counter()
                        gpu_wait()
                        waits.append(1e3 * (time.perf_counter() - t))
                    if mode in polls:
                        polls[mode][0].replay()  # the GPU now waits for the flag
                    t0 = time.perf_counter()
                    call(i, s)
                    ms.append(1e3 * (time.perf_counter() - t0))
                    if mode in polls:
                        t1 = time.perf_counter()
                        polls[mode][1](0)
                        end.record()
                        end.synchronize()
                        rel.append(1e3 * (time.perf_counter() - t1))
            ms = np.array(ms)
            row = {"pass": p, "mean_ms": float(ms.mean()), "median_ms": float(np.median(ms)),
                   "p90_ms": float(np.quantile(ms, 0.9)),
                   "GBps_at_mean": float(nbytes * (int8[0].nbytes() / base.nbytes() if name.startswith("int8") else 1)
                                         / ms.mean() / 1e6),
                   "wait_ms_mean": float(np.mean(waits)) if waits else None,
                   "release_ms_mean": float(np.mean(rel)) if rel else None}
            res["cases"][name if args.passes == 1 else f"{name}#{p}"] = row
            print(name, row, flush=True)
    a = K.ffn_rows("reglu", x, sets[1][0], layers[0], np.zeros(d, np.float32), part).copy()
    bundled_reglu(x, sets[1][0], bundled[0], part, out)
    res["max_abs_diff_bundled"] = float(np.abs(a - out).max())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_cpu_side.json").write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
