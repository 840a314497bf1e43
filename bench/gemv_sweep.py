"""A decode step's GEMVs on the GPU, cuBLAS against runtime/fused.py's Triton GEMV. First the predictor
(runtime/layout.py predict and fused.py's Triton twin): all --layers layers' predictors at the LLaMA-2-70B shape
(d 8192, 28672 neurons, a 1024-wide hidden layer, --cold of them cold), random fp16 weights, each layer its own (so
that no layer reads another's from L2), as one CUDA graph; GPU time per replay (CUDA events, median). Variants:
"torch" (cuBLAS GEMVs and torch's decision kernels), "compile" (the same through torch.compile), "triton"
(fused.predict at gemv_config's blocks). Then each GEMV alone (the predictor's, the attention's q/k/v and o
projections; the LM head at one config), cuBLAS and Triton over a grid of (BLOCK_R, BLOCK_K, num_warps), as a share
of the HBM rate measured here as pi-solve --measure does.

Usage: python bench/gemv_sweep.py OUT.json [--layers 12] [--reps 100]"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from hotneurons.common.hardware import _measure_cuda
from hotneurons.runtime import fused
from hotneurons.runtime.cold_rows import host_mapped
from hotneurons.runtime.kernels import mask_bytes
from hotneurons.runtime.layout import predict
from pre_compile import replay_us

D, KV, HIDDEN, N, VOCAB = 8192, 1024, 1024, 28672, 32000  # d_model, kv heads x head dim, predictor width, neurons


def gpu_us(fn, reps: int) -> float:
    """Median GPU time (us) of fn captured as one CUDA graph."""
    us, _ = replay_us(fn, reps)
    return us[len(us) // 2]


def main(out: Path, layers: int, n_cold: int, reps: int) -> dict:
    dev, dt = torch.device("cuda"), torch.float16
    g = torch.Generator(device=dev).manual_seed(0)
    fc1 = [(torch.randn(HIDDEN, D, generator=g, device=dev) * D ** -0.5).to(dt) for _ in range(layers)]
    fc2 = [(torch.randn(N, HIDDEN, generator=g, device=dev) * HIDDEN ** -0.5).to(dt) for _ in range(layers)]
    x = torch.randn(D, generator=g, device=dev).to(dt)
    thr = torch.full((1,), 0.5, device=dev)
    fired = torch.zeros(N, dtype=torch.int32, device=dev)
    m_dev = torch.zeros(n_cold, dtype=torch.bool, device=dev)
    m_host = torch.zeros(mask_bytes(n_cold), dtype=torch.uint8, pin_memory=True)  # the host mask's bits
    m_np = m_host.numpy()
    m_mapped = host_mapped(m_np, m_np, dev, register=False)  # what the runtime writes: page-locked host memory
    bytes_per_layer = 2 * HIDDEN * (D + N)
    hbm = _measure_cuda()["gpu_bw"]  # bytes/s, as the solver and pi_bench measure it (a device copy, best of 5)
    res = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__,
           "triton": __import__("triton").__version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "layers": layers, "shape": {"d": D, "hidden": HIDDEN, "neurons": N, "cold": n_cold},
           "bytes_per_layer": bytes_per_layer, "hbm_bytes_per_s": hbm, "variants": {}, "gemv": {}}

    def step(op) -> None:
        for i in range(layers):
            op(x, fc1[i], fc2[i], thr, fired, m_dev, m_mapped, n_cold)

    ref = None
    for name, op in (("torch", predict), ("compile", torch.compile(predict)), ("triton", fused.predict)):
        us = gpu_us(lambda: step(op), reps)
        fired.zero_()
        op(x, fc1[-1], fc2[-1], thr, fired, m_dev, m_mapped, n_cold)
        torch.cuda.synchronize()
        got = (fired.clone(), m_host.clone())
        ref = ref or got
        res["variants"][name] = {"us_per_layer": us / layers, "ms_per_token": us / 1e3,
                                 "share_of_hbm": bytes_per_layer * layers / (us * 1e-6) / hbm,
                                 "decisions_differing_from_torch": int((got[0] != ref[0]).sum()),
                                 "cold_mask_equals_first_decisions": bool(np.array_equal(
                                     np.unpackbits(got[1].numpy(), bitorder="little")[:n_cold],
                                     got[0][:n_cold].bool().cpu().numpy()))}
        print(name, res["variants"][name], flush=True)
    h = torch.empty(HIDDEN, dtype=dt, device=dev)
    qkv = [(torch.randn(D + 2 * KV, D, generator=g, device=dev) * D ** -0.5).to(dt) for _ in range(layers)]
    o = [(torch.randn(D, D, generator=g, device=dev) * D ** -0.5).to(dt) for _ in range(layers)]
    head = [(torch.randn(VOCAB, D, generator=g, device=dev) * D ** -0.5).to(dt) for _ in range(2)]
    y = torch.empty(VOCAB, dtype=dt, device=dev)
    for which, w, v in (("fc1", fc1, x), ("fc2", fc2, h), ("qkv_proj", qkv, x), ("o_proj", o, x), ("lm_head", head, x)):
        rows, cols = w[0].shape
        row = {"rows": rows, "cols": cols}
        us = gpu_us(lambda: [F.linear(v, wi) for wi in w], reps) / len(w)
        row["cublas"] = {"us": us, "share_of_hbm": 2 * rows * cols / (us * 1e-6) / hbm}
        grid = []
        wide = cols >= 4096  # few rows of many columns, or the reverse
        for br, bk, nw in itertools.product((1, 2, 4, 8) if wide else (4, 8, 16, 32),
                                            (512, 1024, 2048) if wide else (256, 512, 1024), (2, 4, 8)):
            if bk > max(256, cols) or br * bk > 32768 or (which == "lm_head" and (br, bk, nw) != (2, 2048, 8)):
                continue
            cfg = (br, bk, nw)

            def run(cfg=cfg) -> None:
                for wi in w:
                    fused._gemv(v, wi, None, fired if which == "fc2" else y[:rows], relu=which == "fc1",
                                decide=(thr, fired, None, None, 0) if which == "fc2" else None, config=cfg)

            us = gpu_us(run, reps // 2) / len(w)
            grid.append({"block_r": br, "block_k": bk, "num_warps": nw, "us": us,
                         "share_of_hbm": 2 * rows * cols / (us * 1e-6) / hbm})
        grid.sort(key=lambda r: r["us"])
        row["triton_best"], row["triton_grid"] = grid[0], grid
        row["default"] = dict(zip(("block_r", "block_k", "num_warps"), fused.gemv_config(rows, cols)))
        res["gemv"][which] = row
        print(which, row["cublas"], grid[:3], flush=True)
    out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--cold", type=int, default=25000, help="cold neurons of the 28672")
    ap.add_argument("--reps", type=int, default=100)
    a = ap.parse_args()
    main(a.out, a.layers, a.cold, a.reps)
