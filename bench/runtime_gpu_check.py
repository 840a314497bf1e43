"""pi-generate on a CUDA machine: (a) equality with HF `generate` under real CUDA placement, (b) hybrid vs dense vs
layer-split decode tokens/s on a model larger than a VRAM budget, (c) per-layer timing of CPU/GPU overlap.

Usage: python -m bench.runtime_gpu_check OUT_DIR [--layers 8] [--shape llama-2-7b] [--tokens 64]
Writes OUT_DIR/runtime_gpu_check.json. Needs torch with CUDA, transformers, numba; no downloads.

(b) and (c) use RANDOM weights with LLaMA-2 layer shapes (ReLU-gated, fewer layers) built and calibrated as pi_bench's
(bench/bench_model.py): per-neuron firing probabilities p_j from a power law (mean ~10%, i.e. ~90% FFN sparsity;
~20% of neurons cover ~80% of activations, as published for ReLU models), the hottest neurons by p_j on the GPU, and
an EXACT predictor of a trained predictor's size (d/8 hidden) that marks the neurons whose gate is positive. They
measure speed, not quality.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hotneurons.common.hardware import openmp_wait_policy

OMP_WAIT_POLICY = openmp_wait_policy()  # before torch loads (common/hardware.py says why)

import argparse  # noqa: E402
import copy  # noqa: E402
import functools  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from hotneurons.artifacts.placement import Placement  # noqa: E402
from hotneurons.runtime.generate import RuntimeConfig, generate  # noqa: E402
from hotneurons.runtime.load import build_runtime, layer_split_count  # noqa: E402
from hotneurons.runtime.static_decoder import cache_bytes  # noqa: E402

from bench import bench_ceilings, record  # noqa: E402
from bench import bench_model as bm  # noqa: E402
from tests import tiny  # noqa: E402

DEV = "cuda"
LOGIT_ATOL = 1e-3  # float32 on CUDA (TF32 off) vs HF; the CPU tests use 1e-4


# ---------------------------------------------------------------------------------------------------------------
# (a) equality


def equality_checks(n_new: int = 12) -> list[dict]:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cases = [(f, "hybrid", w) for f in ("opt", "llama-reglu", "mistral-drelu", "falcon-relu")
             for w in ("gpu", "cpu", "mixed")]
    cases += [(f, "dense", "mixed") for f in ("llama-swiglu", "qwen2-swiglu", "gemma-geglu", "falcon-gelu")]
    cases += [(f, "layer-split", None) for f in ("opt", "llama-swiglu")]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for family, mode, where in cases:
            folder = Path(tmp) / family
            if not folder.exists():
                tiny.build(family, folder)
            lm = tiny.load_rounded(folder, family)
            ref = copy.deepcopy(lm).model.to("cuda")
            ids = list(lm.tokenizer("The quick brown fox")["input_ids"])
            hf = ref.generate(torch.tensor([ids], device="cuda"), max_new_tokens=n_new, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)
            want = hf.sequences[0, len(ids):].tolist()
            n_layers, n = len(lm.layers), lm.info["n_neurons"]
            rng = np.random.default_rng(0)
            placement = (None if where is None else Placement.uniform(n_layers, n, where == "gpu") if where != "mixed"
                         else Placement(tuple(rng.random(n) < 0.5 for _ in range(n_layers))))
            cfg = RuntimeConfig(mode=mode, oracle=mode == "hybrid", device="cuda", dtype="float32",
                                gpu_layers=1 if mode == "layer-split" else None)
            rt = build_runtime(lm, cfg, placement)
            g = generate(rt, ids, n_new, keep_logits=True)
            diff = max(float((a - b[0].float().cpu()).abs().max()) for a, b in zip(g.logits, hf.logits))
            row = {"family": family, "mode": rt.mode, "placement": where, "tokens_equal": g.token_ids == want,
                   "max_logit_diff": diff, "ok": g.token_ids == want and diff < LOGIT_ATOL,
                   "ffn_sparsity": g.stats["ffn_sparsity"], "bytes_gpu": g.stats["bytes_gpu"],
                   "bytes_cpu": g.stats["bytes_cpu"]}
            print("equality", row, flush=True)
            out.append(row)
            del rt, lm, ref
            torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------------------------
# (b, c) speed on a model over budget


def speed(shape: str, n_layers: int, tokens: int, hot_share: float, reps: int = 3, seed: int = 0) -> dict:
    d = bm.SHAPES[shape][0]
    rank = max(1, (max(16, d // 8) - 2) // 2)  # the exact predictor's hidden size 2 * rank + 2 = d / 8
    model = bm.calibrate(bm.build_model(shape, n_layers, DEV, seed, gate_rank=rank), shape, seed=seed)
    pred_layers = {i: bm.exact_predictor(model.lm, shape, i, seed, rank).cpu() for i in range(n_layers)}
    base = model.lm
    base.model.to("cpu")
    if DEV == "cuda":
        torch.cuda.empty_cache()
    info = base.info
    n, L = info["n_neurons"], n_layers
    probs = model.targets  # (n,) per layer: the calibrated firing probabilities
    k = int(hot_share * n)
    gpu = tuple(np.isin(np.arange(n), np.argsort(-p)[:k]) for p in probs)  # hottest k neurons per layer
    size = 2  # fp16
    fixed = (info["params"]["total"] - sum(info["params"]["ffn_per_layer"])) * size
    ffn = sum(info["params"]["ffn_per_layer"]) * size
    pred_bytes = sum(t.numel() * size for p in pred_layers.values() for t in p.parameters())
    # + predictors, the hot/cold neuron id lists (int64) and 1 MB for small buffers (RoPE)
    prompt = list(range(100, 116))
    ctx = len(prompt) + tokens + 1  # the static KV cache: the prompt and the new tokens
    vram = int(fixed + hot_share * ffn + pred_bytes + L * n * 8 + 1e6 + cache_bytes(base, ctx, torch.float16))
    all_bytes = info["params"]["total"] * size
    res = {"shape": shape, "layers": L, "d_model": info["d_model"], "n_neurons": n, "dtype": "float16",
           "vram_budget_bytes": vram, "model_bytes_fp16": all_bytes, "hot_share_of_neurons": hot_share,
           "target_mean_active": float(np.mean([p.mean() for p in probs])), "predictor_hidden": 2 * rank + 2,
           "gpu_share_of_activations_expected": float(np.mean([p[g].sum() / p.sum() for p, g in zip(probs, gpu)])),
           "calibration": model.calibration,
           "note": "random weights, calibrated power-law firing; hottest neurons on the GPU; "
                    "exact predictors: speed only",
           "modes": {}, "timing": None}
    C = functools.partial(RuntimeConfig, device=DEV, dtype="float16", ctx=ctx)
    runs = {"hybrid": C(vram=vram), "hybrid-eager": C(vram=vram, cuda_graphs=False),
            "hybrid-hf-layers": C(vram=vram, static_decode=False), "dense": C(mode="dense", vram=vram),
            "layer-split": C(mode="layer-split", vram=vram), "all-gpu": C(mode="dense")}
    for name, cfg in runs.items():
        lm = copy.deepcopy(base)
        preds = None
        if name.startswith("hybrid"):
            preds = type("P", (), {"layers": pred_layers})()
        placement = None if name in ("layer-split", "all-gpu") else Placement(gpu)
        t0 = time.perf_counter()
        rt = build_runtime(lm, cfg, placement, preds)
        build_s = time.perf_counter() - t0
        generate(rt, prompt, 8, stop_at_eos=False)  # warm-up: Numba load, CUDA kernels, pinned buffers
        # rep 0 decodes KV lengths never seen before (as users do); later reps repeat them (any per-shape plan
        # caching would show as rep 0 slower than the rest)
        gens = [generate(rt, prompt, tokens, stop_at_eos=False) for _ in range(reps)]
        rates = [x.stats["decode_tokens_per_s"] for x in gens]
        g = gens[0]
        row = {**g.stats, "build_s": build_s, "decode_tokens_per_s_reps": rates,
               "decode_tokens_per_s": float(np.median(rates))}
        if name == "layer-split":
            row["gpu_layers"] = layer_split_count(base, vram, None, torch.float16)
        print("speed", name, {k: row[k] for k in ("decode_tokens_per_s", "ffn_sparsity", "gpu_activation_share",
                                                   "bytes_gpu", "bytes_cpu")}, flush=True)
        res["modes"][name] = row
        if name == "hybrid":
            res["timing"] = timing(rt, prompt, min(tokens, 16))
            f = rt.ffns[0]  # the cold kernel on this layer's rows (0.0: the parallel region's fixed cost)
            res["kernel"] = bench_ceilings.kernel_bench(f.d_model, f.n_cold, (0.0, 0.05, 0.10, 0.20), rows=f.cold,
                                                        activation=f.activation)
        del rt, lm
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return res


class FFNTimeline:
    """A HybridFFN.probe: per decode call of an FFN, ms from its start (a common zero for the host clock and CUDA
    events: the GPU is synced first), the CPU kernel's interval and the GPU hot part's, their overlap, the FFN wall,
    and the cold rows the CPU computed."""

    def __init__(self):
        self.rows: dict[int, list[dict]] = {}  # per layer, one row a call
        self._t: dict[str, float] = {}  # host clock at each mark, s
        self._ev: dict[str, torch.cuda.Event] = {}  # CUDA events at the marks
        self._marked = 0.0  # the FFN's marked cold neurons at cpu_start

    def __call__(self, f, mark: str) -> None:
        cuda = f.fired.device.type == "cuda"
        if mark == "start":
            self._t, self._ev = {}, {}
            if cuda:
                self._ev[mark] = torch.cuda.Event(enable_timing=True)
                self._ev[mark].record()
                self._ev[mark].synchronize()
        elif mark in ("hot_start", "hot_end") and cuda:
            self._ev[mark] = torch.cuda.Event(enable_timing=True)
            self._ev[mark].record()
        elif mark == "cpu_start":
            self._marked = f.cold_marks[1]
        elif mark == "end" and cuda:
            torch.cuda.synchronize(f.fired.device)
        self._t[mark] = time.perf_counter()
        if mark == "end":
            self.rows.setdefault(f.layer, []).append(self._row(f))

    def _row(self, f) -> dict:
        t, ev = self._t, self._ev
        ms = {k: 1e3 * (v - t["start"]) for k, v in t.items()}
        # the CPU's rows: the token's marked cold neurons less the device's share of them (mapped_rows)
        active = max(0, int(f.cold_marks[1] - self._marked) - f.mapped_rows) if f.n_cold else 0
        row = {"layer": f.layer, "active_cold": active, "cpu_start_ms": ms["cpu_start"], "cpu_end_ms": ms["cpu_end"],
               "ffn_ms": ms["end"], "gpu_hot_start_ms": None, "gpu_hot_end_ms": None, "overlap_ms": 0.0}
        if "hot_end" in ev:
            row["gpu_hot_start_ms"] = ev["start"].elapsed_time(ev["hot_start"])
            row["gpu_hot_end_ms"] = ev["start"].elapsed_time(ev["hot_end"])
            row["overlap_ms"] = max(0.0, min(row["cpu_end_ms"], row["gpu_hot_end_ms"])
                                    - max(row["cpu_start_ms"], row["gpu_hot_start_ms"]))
        return row


def timing(rt, prompt, tokens: int) -> dict:
    """Per layer, mean over decode tokens, in ms from the FFN's start: when the CPU kernel starts (after the predictor
    and the copy of x and the mask) and ends, when the GPU hot part runs (CUDA events), their overlap, the FFN wall.

    Timing syncs the GPU at the start and end of each FFN (a common zero for both clocks), so this pass is slower
    than the plain run; `timeline` is one token's layers, for a figure."""
    probe = FFNTimeline()
    for f in rt.ffns:
        f.probe = probe  # generate decodes through HF's layers while a probe is set
    try:
        generate(rt, prompt, tokens, stop_at_eos=False)
    finally:
        for f in rt.ffns:
            f.probe = None
    keys = ("active_cold", "cpu_start_ms", "cpu_end_ms", "gpu_hot_start_ms", "gpu_hot_end_ms", "overlap_ms", "ffn_ms")
    rows, timeline = [], []
    for f in rt.ffns:
        t = probe.rows.get(f.layer, [])[1:]  # the prefill is dense and not recorded; drop the first decode step
        if not t:
            continue
        row = {"layer": f.layer, **{k: float(np.mean([np.nan if r[k] is None else r[k] for r in t])) for k in keys}}
        row["cpu_kernel_ms"] = row["cpu_end_ms"] - row["cpu_start_ms"]
        row["gpu_hot_ms"] = row["gpu_hot_end_ms"] - row["gpu_hot_start_ms"]
        rows.append(row)
        timeline.append(t[len(t) // 2])
    return {"per_layer": rows, "timeline_one_token": timeline, "tokens": tokens,
            "sum_ffn_ms": sum(r["ffn_ms"] for r in rows), "sum_cpu_kernel_ms": sum(r["cpu_kernel_ms"] for r in rows),
            "sum_gpu_hot_ms": sum(r["gpu_hot_ms"] for r in rows), "sum_overlap_ms": sum(r["overlap_ms"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--shape", choices=list(bm.SHAPES), default="llama-2-7b")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--hot-share", type=float, default=0.2, help="share of each layer's neurons on the GPU")
    ap.add_argument("--reps", type=int, default=3, help="timed generations per mode (the median is reported)")
    ap.add_argument("--skip-equality", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test this script")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    if DEV == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: this script checks the runtime on a GPU")
    import numba

    args.out.mkdir(parents=True, exist_ok=True)
    from hotneurons.common.hardware import machine_info

    report = {"machine": machine_info("numba", "transformers"), "numba_threads": numba.get_num_threads(),
              "command": "python " + " ".join(sys.argv), "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    t0 = time.perf_counter()
    if not args.skip_equality:
        report["equality"] = equality_checks()
        report["equality_all_ok"] = all(r["ok"] for r in report["equality"])
    report["speed"] = speed(args.shape, args.layers, args.tokens, args.hot_share, args.reps)
    report["seconds"] = time.perf_counter() - t0
    path = args.out / "runtime_gpu_check.json"
    record.write_flat(path, report)
    print("wrote", path)


if __name__ == "__main__":
    main()
