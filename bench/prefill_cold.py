"""Prefill's cold rows: computed where the prompt's activations are (their stored blocks cross PCIe a chunk at a time
and are widened on the GPU: what the runtime does) or on the CPU (the activations cross instead, the blocks are
widened there). Times one layer's cold part per prompt length, on a model file read in place.

  python -m bench.prefill_cold --model M.gguf --out bench/results/<date>-<kind>-prefill-cold.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file or safetensors folder")
    ap.add_argument("--cold-dtype", default="auto")
    ap.add_argument("--hot-share", type=float, default=0.2)
    ap.add_argument("--tokens", default="1,8,32,128,512")
    ap.add_argument("--layers", type=int, default=4, help="layers timed (the first N)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import numpy as np
    import torch
    from hotneurons.artifacts.placement import Placement
    from hotneurons.runtime.generate import RuntimeConfig
    from hotneurons.runtime.load import load_source_runtime
    from hotneurons.weights.source import open_source

    src = open_source(a.model)
    n, L = src.infos["blk.0.ffn_up.weight"].shape[0], int(src.config.num_hidden_layers)
    src.close()
    rng = np.random.default_rng(0)
    placement = Placement(tuple(rng.random(n) < a.hot_share for _ in range(L)))
    rt = load_source_runtime(None, None, RuntimeConfig(device="cuda", mode="dense", cold_dtype=a.cold_dtype),
                             model=a.model, placement=placement)
    d = rt.lm.info["d_model"]
    rows = []

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    for T in map(int, a.tokens.split(",")):
        x = torch.randn((T, d), device="cuda", dtype=torch.float16)
        for f in rt.ffns[:a.layers]:
            gpu = timed(lambda: f._cold_dense(x))
            cpu = timed(lambda: f._cold_dense(x.cpu()).to(x.device))
            rows.append({"tokens": T, "layer": f.layer, "cold_rows": f.n_cold, "gpu_s": gpu, "cpu_s": cpu})
        g = np.median([r["gpu_s"] for r in rows if r["tokens"] == T])
        c = np.median([r["cpu_s"] for r in rows if r["tokens"] == T])
        print(f"T={T:4d}: streamed to the GPU {1e3 * g:8.2f} ms, on the CPU {1e3 * c:8.2f} ms per layer", flush=True)
    res = {"model": a.model, "cold_dtype": rt.cfg.cold_dtype, "hot_share": a.hot_share, "rows": rows,
           "gpu": torch.cuda.get_device_name(), "cpu": platform.processor() or platform.machine(),
           "threads": rt.threads,
           "note": "one layer's cold part of a prompt of T tokens: its stored rows streamed to the GPU and widened "
                   "there (the runtime's prefill) vs computed on the CPU (chunks widened to float32, the prompt's "
                   "activations moved instead); median of 3 after a warm-up"}
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
