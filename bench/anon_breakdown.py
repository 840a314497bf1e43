"""Where a pi-generate process's anonymous host memory goes: RssAnon of this process (/proc/self/status) after each
step of loading and running the in-place engine on the memory benchmark's Q4_0 GGUF (bench/engine_decode.setup), in
one process, beside what the layout itself counts (the cold rows, the predictors' host copies, the pinned buffers).

  python -m bench.anon_breakdown --models /root/models --out bench/results/<date>-<kind>-anon-breakdown.json
"""

from __future__ import annotations

import time


def rss_anon() -> int:
    """Bytes of this process's resident anonymous memory."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def layout_bytes(rt) -> dict:
    """What the runtime's own host-side structures take, counted from their arrays."""
    import numpy as np
    import torch

    def nbytes(*arrays) -> int:
        return int(sum(a.nbytes for a in arrays if isinstance(a, np.ndarray)))

    io = [f.io for f in rt.ffns if f.io is not None]
    return {"cold_rows": int(sum(f.cold_bytes() for f in rt.ffns)),
            "host_io_pinned": int(sum(nbytes(b.x_np, b.mask_words, b.part, b.out, b.idx) for b in io)),
            # the predictors' tensors left on the host (q8_0 blocks, --predictor-dtype, live on the device)
            "predictors_on_host": int(sum(t.numel() * t.element_size() for f in rt.ffns
                                          for t in (f.pred_fc1, f.pred_fc2)
                                          if isinstance(t, torch.Tensor) and not t.is_cuda))}


def main(a) -> dict:
    steps: list[dict] = []
    t0 = time.perf_counter()

    def mark(name: str) -> None:
        steps.append({"after": name, "rss_anon_bytes": rss_anon(), "t_s": round(time.perf_counter() - t0, 2)})
        print(f"{name}: {steps[-1]['rss_anon_bytes'] / 1e9:.3f} GB", flush=True)

    mark("interpreter")
    import numba  # noqa: F401
    import torch
    import transformers  # noqa: F401

    mark("import numba, torch, transformers")
    from hotneurons.runtime.generate import RuntimeConfig, generate
    from hotneurons.runtime.load import load_source_runtime

    from bench.engine_decode import setup

    files, run, placement = setup(a.models, a.shape, a.threshold, a.hot_share)
    mark("the benchmark model written or found")
    if a.device == "cuda":
        torch.zeros(1, device="cuda")
        mark("CUDA context")
        import triton  # noqa: F401

        mark("import triton")
    prompt = list(range(300, 316))
    if a.warm_shape:  # the libraries' one-time host state (kernels loaded, compiled), paid on a small model first
        import gc

        wf, wrun, wplace = setup(a.models, a.warm_shape, a.threshold, a.hot_share)
        w = load_source_runtime(wrun, None, RuntimeConfig(device=a.device, cold_dtype=a.cold_dtype),
                                model=wf["gguf"]["model"], placement=wplace)
        generate(w, prompt[:4], 8, stop_at_eos=False)
        w.fast.reset_graphs()
        del w
        gc.collect()
        mark(f"the {a.warm_shape} model loaded, 8 tokens, freed")
    rt = load_source_runtime(run, None, RuntimeConfig(device=a.device, cold_dtype=a.cold_dtype),
                             model=files["gguf"]["model"], placement=placement)
    mark("runtime loaded")
    generate(rt, prompt, 1, stop_at_eos=False)
    mark("first token (prefill)")
    generate(rt, prompt, 8, stop_at_eos=False)
    mark("8 tokens (graphs captured, kernels compiled)")
    generate(rt, prompt, 64, stop_at_eos=False)
    mark("64 more tokens")
    return {"shape": a.shape, "device": a.device, "cold_dtype": rt.cfg.cold_dtype, "gpu_dtype": rt.cfg.gpu_dtype,
            "gguf_bytes": files["gguf"]["file_bytes"], "layout_bytes": layout_bytes(rt),
            "pcie_share": rt.pcie_share, "warm_shape": a.warm_shape, "steps": steps}


def cli() -> None:
    from bench import record
    from bench.engine_decode import parser

    p = parser(__doc__)
    p.add_argument("--warm-shape", default=None,
                   help="Load and run this SHAPES preset first (the libraries' one-time state), e.g. small.")
    p.add_argument("--cold-dtype", default="auto", help="The cold rows' format (auto: the file's).")
    p.add_argument("--out", default=None, help="Results file (default: bench/results/, dated).")
    a = p.parse_args()
    record.write_dated("anon-breakdown", main(a), path=a.out)


if __name__ == "__main__":
    cli()
