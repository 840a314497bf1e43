"""The whole LLaMA-2-70B-shaped model at 4 bits in a 24 GiB GPU budget: our pipeline as a user runs it, against
llama.cpp on the same Q4_0 GGUF. RANDOM weights with calibrated firing (bench_gguf.py: 10% of FFN neurons active per
token, the top 20% covering 80% of firings) and exact predictors: speed and memory, not quality.

Stages, each within one 10-minute call on the GPU machine, sharing --work (local disk) while the machine stays up:
  build     the model into WORK/model.gguf layer by layer (bench_gguf.write_model) and a text corpus
  pipeline  pi-profile (layer by layer, no samples), the exact predictors installed into WORK/run, pi-solve --vram
  ours      pi-generate's runtime in a child process: load to the first token, prefill of a 512-token prompt, decode
            over 32 and 256 tokens; the child's peak host memory (/proc) and GPU memory (the driver's, per process)
  llamacpp  llama.cpp built from .llamacpp/ (CUDA), llama-bench on the same file: the most layers that fit the budget
            (found by measuring), every layer on the GPU, the CPU alone
  report    the stage files (--inputs) into bench/results/<date>-<kind>-llama70b.{json,md}
CPU smoke run: --device cpu --shape tiny --layers 2 (stages build, pipeline, ours).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

PROMPT_SHORT, PROMPT_LONG = 16, 512  # tokens: the decode runs' prompt, the prefill run's


def _tool(name: str) -> str:
    from hotneurons.bench.memory import tool

    return tool(name)


def _run(cmd: list[str], timeout: float) -> dict:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    row = {"command": " ".join(cmd), "seconds": round(time.perf_counter() - t0, 2), "returncode": r.returncode}
    if r.returncode:
        raise SystemExit(f"{cmd[0]} failed ({r.returncode}):\n{(r.stderr or r.stdout)[-3000:]}")
    return {**row, "stdout": r.stdout}


class GpuMemory:
    """The driver's figure of GPU memory used by a process tree (nvidia-smi's compute apps, context included), sampled
    in a thread; the peak in bytes."""

    def __init__(self, root_pid: int, interval: float = 0.25):
        self.root, self.interval, self.peak, self._stop = root_pid, interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> GpuMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        from hotneurons.bench.memory_probe import tree_pids

        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                      "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
                pids = set(tree_pids(self.root))
                used = sum(int(m) for p, m in (line.split(",") for line in out.stdout.splitlines() if "," in line)
                           if int(p) in pids)
                self.peak = max(self.peak, used << 20)  # MiB
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
            self._stop.wait(self.interval)


def measured(argv: list[str], timeout: float, pattern: str | None = None) -> dict:
    """Run argv with its host memory (bench/memory_probe.Monitor) and GPU memory (GpuMemory) sampled."""
    from hotneurons.bench.memory_probe import Monitor

    with Monitor(argv, first_output=pattern) as m, GpuMemory(m.proc.pid) as g:
        res = m.wait(timeout)
    return {**res.to_dict(), "gpu_peak_bytes": g.peak}


# ---------------------------------------------------------------------------------------------------------------
# Stages


def stage_build(a) -> dict:
    from hotneurons.bench import memory_models as mm
    from hotneurons.bench.bench_gguf import write_model

    t0 = time.perf_counter()
    info = write_model(a.shape, a.layers, a.work / "model.gguf", a.device, seed=a.seed,
                       calibration_tokens=a.calibration_tokens)
    mm.write_corpus(a.work / "corpus.txt", 8 * a.profile_tokens)
    return {**info, "build_s": round(time.perf_counter() - t0, 1)}


def install_predictors(run: Path, gguf: Path) -> dict:
    """The exact predictors written beside the model (bench_gguf) as RUN/predictors, for RUN's model and profile."""
    from hotneurons.common import artifacts, tiny
    from hotneurons.common.models import adapter_for
    from hotneurons.runtime.engine import model_info, open_model
    from safetensors.torch import load_file

    source, sid, _, act = open_model(str(gguf))
    ad = adapter_for(source.config)
    info = model_info(source, sid, act, ad.name, ad.gated)
    tensors = load_file(str(gguf.with_suffix(".predictors.safetensors")))
    tiny.write_predictors(run, info, 0.0, artifacts.sha256_file(run / "profile" / "meta.json"), tensors=tensors)
    return {"bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "hidden": int(tensors["layers.0.fc1.weight"].shape[0])}


def stage_pipeline(a) -> dict:
    import shutil

    run, gguf = a.work / "run", a.work / "model.gguf"
    shutil.rmtree(run, ignore_errors=True)
    rows = {"profile": _run([_tool("pi-profile"), "--model", str(gguf), "--out", str(run), "--dataset",
                             str(a.work / "corpus.txt"), "--tokens", str(a.profile_tokens), "--seq-len", "512",
                             "--samples-per-layer", "0", "--device", a.device, "--quiet"], 560)}
    rows["predictors"] = install_predictors(run, gguf)
    solve = _run([_tool("pi-solve"), "--run", str(run), "--vram", a.vram, "--dtype", "q4_0", "--cold-dtype", "q4_0",
                  "--ctx", str(a.ctx), "--hardware", a.hardware, "--json"], 300)
    rows["solve"] = {**solve, "summary": json.loads(solve.pop("stdout"))}
    rows["profile"].pop("stdout")
    return rows


def stage_ours(a) -> dict:
    argv = [sys.executable, "-m", "hotneurons.bench.bench_70b", "--stage", "ours-child", "--work", str(a.work),
            "--device", a.device, "--vram", a.vram, "--ctx", str(a.ctx)]
    res = measured(argv, 560, pattern=r"first token")
    if res["exit_code"] != 0:
        raise SystemExit(f"the runtime's child failed:\n{res['stderr_tail'][-3000:]}")
    child = json.loads((a.work / "ours-child.json").read_text())
    return {**child, "load_to_first_token_s": res["first_output_s"], "host_peak_rss_bytes": res["peak_rss_bytes"],
            "host_peak_anon_bytes": res["peak_anon_bytes"], "gpu_peak_bytes": res["gpu_peak_bytes"],
            "gguf_bytes": (a.work / "model.gguf").stat().st_size}


def ours_child(a) -> None:
    """In its own process (what stage_ours measures): the runtime as pi-generate loads it, then its runs."""
    from hotneurons.common.units import parse_bytes
    from hotneurons.runtime.generate import RuntimeConfig, generate
    from hotneurons.runtime.load import load_runtime

    rt = load_runtime(a.work / "run", RuntimeConfig(device=a.device, vram=parse_bytes(a.vram), ctx=a.ctx))
    import numpy as np

    ids = np.random.default_rng(0).integers(0, rt.lm.info["vocab_size"], PROMPT_LONG).tolist()  # random tokens
    short = ids[:PROMPT_SHORT]
    first = generate(rt, short, 1, stop_at_eos=False)
    print("first token", flush=True)
    rows = {"first": first.stats}
    for n in (32, 256):
        rows[f"decode_{n}"] = generate(rt, short, n, stop_at_eos=False).stats
    rows["prefill_512"] = generate(rt, ids, 2, stop_at_eos=False).stats
    out = {"decode_tok_s": {str(n): rows[f"decode_{n}"]["decode_tokens_per_s"] for n in (32, 256)},
           "prefill_tok_s": rows["prefill_512"]["prefill_tokens_per_s"],
           "gpu_activation_share": rows["decode_256"]["gpu_activation_share"],
           "ffn_sparsity": rows["decode_256"]["ffn_sparsity"], "bytes_gpu": rt.bytes_gpu, "bytes_cpu": rt.bytes_cpu,
           "runs": rows}
    (a.work / "ours-child.json").write_text(json.dumps(out))


STAGES = {"build": stage_build, "pipeline": stage_pipeline, "ours": stage_ours}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", required=True, choices=[*STAGES, "ours-child"])
    p.add_argument("--work", type=Path, default=Path("/root/llama70b"), help="Local disk for the model and run.")
    p.add_argument("--out", type=Path, default=None, help="The stage's JSON.")
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="llama-2-70b", help="bench_model.SHAPES preset.")
    p.add_argument("--layers", type=int, default=80)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calibration-tokens", type=int, default=2048)
    p.add_argument("--profile-tokens", type=int, default=4096)
    p.add_argument("--vram", default="24GiB", help="The GPU budget of pi-solve and the runtime.")
    p.add_argument("--ctx", type=int, default=4096, help="KV cache tokens pi-solve reserves and the runtime holds.")
    p.add_argument("--hardware", default="h100", help="pi-solve's hardware preset (bandwidths of the cost model).")
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    if a.stage == "ours-child":
        ours_child(a)
        return
    from hotneurons.bench import record

    figures = {"stage": a.stage, "shape": a.shape, "layers": a.layers, **STAGES[a.stage](a)}
    out = a.out or a.work / f"{a.stage}.json"
    record.write_result(out, figures, machine_info=record.machine("torch", "transformers", "gguf"))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
