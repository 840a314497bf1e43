"""bench_70b's baselines on the same file: llama.cpp's `llama-bench` (the most layers that fit the budget, all layers
on the GPU, the CPU alone) and PowerInfer's `main` on the run exported by pi-export (its format, our placement as
its split, the same predictors). Each runs alone; host memory from /proc, GPU memory the driver's per process."""

from __future__ import annotations

import json
import os
import re
import resource
import time
from pathlib import Path


def llama_bench(binary: str, gguf: Path, ngl: int, threads: int, gen: str, prompt: int, env: dict | None = None,
                timeout: float = 400, extra: tuple[str, ...] = ()) -> dict:
    """One `llama-bench` process (every layer past the first `ngl` on the CPU; `extra` flags, e.g. --n-cpu-moe N),
    its tokens/s per test and its peak host and GPU memory."""
    from bench.memory_probe import GpuMemory, Monitor

    argv = [binary, "-m", str(gguf), "-ngl", str(ngl), *extra, "-p", str(prompt), "-n", gen, "-r", "1", "-t",
            str(threads), "-o", "json"]
    with Monitor(argv, env=env) as m, GpuMemory(m.proc.pid) as g:
        res = m.wait(timeout)
    row = {"command": " ".join(argv), "ngl": ngl, "exit_code": res.exit_code, "seconds": res.wall_s,
           "host_peak_rss_bytes": res.peak_rss_bytes, "gpu_peak_bytes": g.peak}
    if res.exit_code != 0:
        return {**row, "error": res.stderr_tail[-2000:]}
    tests = json.loads(m.out.buf.decode())
    row["decode_tok_s"] = {str(t["n_gen"]): t["avg_ts"] for t in tests if t["n_gen"]}
    row["prefill_tok_s"] = next((t["avg_ts"] for t in tests if t["n_prompt"]), None)
    row["build_commit"] = tests[0].get("build_commit")
    return row


def batched_bench(binary: str, gguf: Path, ngl: int, threads: int, batches: str = "1,2,4,8", prompt: int = 128,
                  gen: int = 128, timeout: float = 500, extra: tuple[str, ...] = ()) -> dict:
    """One `llama-batched-bench` process (-npl `batches` sequences, each its own prompt of `prompt` tokens and `gen`
    new ones, every layer past the first `ngl` on the CPU): per batch size its aggregate decode tokens/s (S_TG =
    B gen / T_TG) and prefill tokens/s, and the process's peak host and GPU memory. `extra`: e.g. --n-cpu-moe N."""
    from bench.memory_probe import GpuMemory, Monitor

    n_kv = max(int(b) for b in batches.split(",")) * (prompt + gen)
    argv = [binary, "-m", str(gguf), "-ngl", str(ngl), *extra, "-c", str(n_kv), "-b", "2048", "-ub", "512",
            "-npp", str(prompt), "-ntg", str(gen), "-npl", batches, "-t", str(threads), "--output-format", "jsonl"]
    with Monitor(argv) as m, GpuMemory(m.proc.pid) as g:
        res = m.wait(timeout)
    row = {"command": " ".join(argv), "ngl": ngl, "exit_code": res.exit_code, "seconds": res.wall_s,
           "host_peak_rss_bytes": res.peak_rss_bytes, "gpu_peak_bytes": g.peak}
    if res.exit_code != 0:
        return {**row, "error": res.stderr_tail[-2000:]}
    text = m.out.buf.decode() + "\n" + m.err.buf.decode(errors="replace")  # LOG: stdout or stderr by the build
    lines = [json.loads(ln) for ln in text.splitlines() if ln.startswith("{") and '"speed_tg"' in ln]
    row["batches"] = {str(r["pl"]): {"decode_tok_s": r["speed_tg"], "prefill_tok_s": r["speed_pp"],
                                     "decode_s": r["t_tg"], "prefill_s": r["t_pp"]} for r in lines}
    return row


def kv_bytes(gguf: Path, ctx: int) -> int:
    """The fp16 KV cache of `ctx` tokens for the model in `gguf` (what our runtime holds and pi-solve reserves)."""
    from hotneurons.models.open import open_model

    _, _, cfg, _ = open_model(str(gguf))
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * ctx * 2


def stage_llamacpp(a) -> dict:
    """llama.cpp on the same file: the most layers on the GPU whose measured memory, plus the KV cache our runtime
    holds for --ctx tokens (llama-bench's holds only its prompt and generation), fits --vram; all on the GPU; the CPU
    alone."""
    from hotneurons.common.units import parse_bytes

    from bench import bench_llamacpp as lcpp
    from bench import bench_model as bm

    gguf = a.work / "model.gguf"
    cuda = a.device == "cuda"
    built = lcpp.build(a.work, cuda, os.cpu_count() or 4) if a.llama_bench is None else {"binary": a.llama_bench}
    binary, threads = built["binary"], os.cpu_count() or 4
    budget = parse_bytes(a.vram) - kv_bytes(gguf, a.ctx)
    rows: dict = {"build": built, "budget_for_weights_bytes": budget}
    if cuda:
        probe = {}  # ngl -> its run: a short one to find the most layers that fit
        ngl = bm.gpu_layers_for(budget, a.shape, a.layers, size=18 / 32)
        while 0 < ngl and ngl not in probe:
            probe[ngl] = llama_bench(binary, gguf, ngl, threads, "8", 0)
            fits = "error" not in probe[ngl] and probe[ngl]["gpu_peak_bytes"] <= budget
            if fits and ngl + 1 <= a.layers and ngl + 1 not in probe:
                ngl += 1
            elif not fits:
                ngl -= 1
            else:
                break
        ngl = max([n for n, r in probe.items() if "error" not in r and r["gpu_peak_bytes"] <= budget], default=0)
        rows["ngl_probes"] = probe
        rows[f"llama.cpp -ngl {ngl}"] = llama_bench(binary, gguf, ngl, threads, "32,256", 512)
        rows["llama.cpp all layers on the GPU"] = llama_bench(binary, gguf, 99, threads, "32,256", 512)
    cpu_env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    rows["llama.cpp CPU only"] = llama_bench(binary, gguf, 0, threads, "32", 512 if not cuda else 64, env=cpu_env)
    for name, row in rows.items():
        if name.startswith("llama.cpp") and "error" not in row:
            row["load_to_first_token_s"] = first_token_s(binary, gguf, row["ngl"], threads,
                                                         cpu_env if row["ngl"] == 0 else None)
    return rows


def first_token_s(binary: str, gguf: Path, ngl: int, threads: int, env: dict | None) -> float | None:
    """llama-bench prints no load time: the wall time of `llama-bench -p 0 -n 1 -r 1` (load, a warm-up token, one
    timed token, exit), a bound from above on its load to the first token."""
    row = llama_bench(binary, gguf, ngl, threads, "1", 0, env=env)
    return None if "error" in row else round(row["seconds"], 2)


def stage_powerinfer(a) -> dict:
    """PowerInfer's CUDA `main` (built from the shared tarball) on WORK/run exported by pi-export into --pwri-dir
    (threshold 0: PowerInfer applies one threshold, and the run's are per layer; pi-export keeps them), with
    --vram-budget at --vram: decode of 256 tokens past the 16-token prompt at every core and at 2 threads (where its
    tokens are right: its CPU down-projection races at more, bench_powerinfer's docstring), and a 512-token prompt.
    GPU memory: the driver's, over this process's children; host: the largest child's peak RSS (getrusage)."""
    from hotneurons.common.units import parse_bytes
    from hotneurons.export import export_run

    from bench.bench_powerinfer import default_source, run_main
    from bench.memory_probe import GpuMemory
    from bench.powerinfer_check import build

    out = Path(a.pwri_dir)
    res: dict = {"build": build(Path(a.powerinfer_src or default_source()), a.work / "powerinfer", cuda=True,
                                jobs=os.cpu_count() or 4)}
    t0 = time.perf_counter()
    if (out / "export.json").exists():
        res["export"] = {**json.loads((out / "export.json").read_text()), "reused": True}
    else:
        res["export"] = export_run(a.work / "run", out, threshold=0.0, force=True)
    res["export_s"] = round(time.perf_counter() - t0, 1)
    gguf, binary = out / res["export"]["files"]["model"], Path(res["build"]["binary"])
    budget = parse_bytes(a.vram) / 2**30  # GiB, as --vram-budget takes it
    threads = os.cpu_count() or 4
    runs = [(f"decode, {threads} threads", 256, threads, None)]
    if threads != 2:
        runs.append(("decode, 2 threads", 64, 2, None))
    runs.append(("prompt of 512 tokens", 2, threads, "a" * 511))  # byte tokens: one a letter
    for label, n, t, prompt in runs:
        with GpuMemory(os.getpid()) as g:
            row = run_main(binary, gguf, budget, t, n, timeout=540, logdir=out / "logs" / label.replace(" ", "_"),
                           **({} if prompt is None else {"prompt": prompt}))
        row.pop("tokens", None), row.pop("prompt_ids", None)
        res[label] = {**row, "gpu_peak_bytes": g.peak, "threads": t, "new_tokens": n}
        print(label, row.get("decode_tokens_per_s"), row.get("prefill_tokens_per_s"), row.get("error", ""), flush=True)
    res["host_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB -> bytes
    return res


def main_first_token_s(timings: list[str]) -> float | None:
    """Load to the first token from main's llama_print_timings lines: its load time, then its prompt's evaluation
    (whose logits give the first token). None without both lines."""
    ms = {}
    for line in timings:
        m = re.match(r"llama_print_timings:\s+(load|prompt eval) time =\s+([0-9.]+) ms", line)
        if m:
            ms[m.group(1)] = float(m.group(2))
    return round((ms["load"] + ms["prompt eval"]) / 1e3, 2) if len(ms) == 2 else None


def powerinfer_systems(stage: dict) -> dict[str, dict]:
    """The powerinfer stage's runs as report() systems: `powerinfer` at every core, `powerinfer, 2 threads`."""
    prompt = stage.get("prompt of 512 tokens", {})
    out = {}
    for key, row in stage.items():
        if not key.startswith("decode, ") or "decode_tokens_per_s" not in row:
            continue
        name = "powerinfer" if row["threads"] != 2 else "powerinfer, 2 threads"
        out[name] = {"decode_tok_s": {str(row["new_tokens"]): row["decode_tokens_per_s"]},
                     "prefill_tok_s": prompt.get("prefill_tokens_per_s") if name == "powerinfer" else None,
                     "load_to_first_token_s": main_first_token_s(row.get("timings", [])),
                     "host_peak_rss_bytes": stage.get("host_peak_rss_bytes"),
                     "gpu_peak_bytes": max(row["gpu_peak_bytes"], prompt.get("gpu_peak_bytes", 0))}
    return out
