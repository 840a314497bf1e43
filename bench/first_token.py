"""Load to first token, side by side: llama.cpp and pi-generate on the same Q4_0 GGUF, each a process of its own, timed
from its start to its first generated token on stdout.

    python -m bench.first_token                  # 16- and 32-layer models; CPU, and CUDA where a GPU is
    python -m bench.first_token --shape 1.7GB --reps 3 --work /root/first-token --out $OUT/

llama.cpp is `llama-completion` (its plain completion tool: -n 1 -no-cnv prints the one token and exits), built with
cmake and ninja from the tarball pi-bench carries (.llamacpp/llama.cpp.tar.gz, bench/bench_llamacpp.py) into --work,
with CUDA where nvcc is found and a GPU is present; the build runs in the background while the models are written.
The models are the memory benchmark's random ReLU LLaMAs in Q4_0 (bench/memory_models.py: d 2048, FFN 5632, GQA 32:4,
vocab 32,000; 16 layers 0.47 GB, 32 layers 0.87 GB), written once into --models and reused.

Per model the file is read whole first (a warm page cache: neither side pays the disk). Per mode (cpu: `-ngl 0` and
`--device cpu`, the GPUs hidden from both; cuda: `-ngl 99` and `--device cuda`) each tool makes one untimed first run
(it pays one-time costs: Numba's and Triton's compiles into their caches, CUDA's module loading; recorded apart), then
`--reps` timed runs, the two tools alternating; the median is reported. Both get the same prompt, greedy sampling, one
new token and the same thread count. Ours runs dense (every neuron on the device side, as llama.cpp computes them).
Then, unless --no-phases, one more run of ours under bench/first_token_phases.py says where its time went.
Results: bench/results/<date>-<machine kind>-first-token.json and .md (rewritten after each model and mode, so a run
stopped by --budget-s or a kill keeps what it measured).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import click

from bench import ROOT, record
from bench import memory_models as mm

PROMPT = "The capital of France is"
TARGET = "llama-completion"


def log(msg: str) -> None:
    click.echo(f"[{time.strftime('%H:%M:%S')}] {msg}", err=True)


def gpu_present() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    r = subprocess.run([smi, "-L"], capture_output=True, text=True)
    return r.returncode == 0 and "GPU" in r.stdout


def nvcc() -> str | None:
    return shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if Path(p).exists()), None)


def start_build(work: Path, cuda: bool, jobs: int) -> dict:
    """Configure llama.cpp (in the foreground: seconds) and start building TARGET in the background. Returns the
    binary's path, the cmake flags and the running build (None where the binary is there already)."""
    from bench.bench_llamacpp import CMAKE_FLAGS, source_dir

    missing = [t for t in ("cmake", "ninja") if shutil.which(t) is None]
    if missing:
        raise SystemExit(f"cannot build llama.cpp: {' and '.join(missing)} not found on PATH (pip install cmake "
                         f"ninja, or apt-get install cmake ninja-build), or pass --llama-completion PATH")
    out = work / ("build-cuda" if cuda else "build-cpu")
    binary = out / "bin" / TARGET
    flags = CMAKE_FLAGS + (["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", f"-DCMAKE_CUDA_COMPILER={nvcc()}"]
                           if cuda else ["-DGGML_CUDA=OFF"])
    row = {"binary": str(binary), "cmake_flags": flags, "cuda": cuda, "log": str(work / f"{out.name}.log")}
    if binary.exists():
        return {**row, "proc": None, "cached": True, "t0": time.perf_counter()}
    src = source_dir(work)
    t0 = time.perf_counter()
    with open(row["log"], "w") as logf:  # the child keeps its own descriptor
        if subprocess.run(["cmake", "-G", "Ninja", "-S", str(src), "-B", str(out), *flags], stdout=logf,
                          stderr=subprocess.STDOUT).returncode != 0:
            failed(row["log"], "configure")
        proc = subprocess.Popen(["cmake", "--build", str(out), "--target", TARGET, "-j", str(jobs)], stdout=logf,
                                stderr=subprocess.STDOUT)
    return {**row, "proc": proc, "cached": False, "t0": t0}


def failed(log_path: str, step: str) -> None:
    tail = Path(log_path).read_text(errors="replace")[-3000:]
    raise SystemExit(f"llama.cpp's {step} failed (log {log_path}):\n{tail}")


def finish_build(b: dict) -> dict:
    """Wait for the background build; the build's record (seconds from configure to done)."""
    if b["proc"] is not None and b["proc"].wait() != 0:
        failed(b["log"], "build")
    seconds = 0.0 if b["cached"] else round(time.perf_counter() - b["t0"], 1)
    return {**{k: v for k, v in b.items() if k not in ("proc", "t0")}, "seconds": seconds}


def timed(cmd: list[str], env: dict, timeout: float) -> dict:
    """One process: seconds from its start to its first byte on stdout (the first token: both tools print nothing
    else there) and to its exit."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env, bufsize=0)
        killer = threading.Timer(timeout, p.kill)  # a hung process must not hang the benchmark
        killer.start()
        try:
            first = p.stdout.read(1)
            t_first = time.perf_counter() - t0
            rest = p.stdout.read()
            rc = p.wait()
        finally:
            killer.cancel()
        t_exit = time.perf_counter() - t0
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    row = {"first_token_s": round(t_first, 3), "exit_s": round(t_exit, 3), "returncode": rc,
           "text": (first + rest).decode(errors="replace").strip()}
    if not first:  # a token with no text (an end-of-text token of a random model): the process ends right after it
        row["no_text"] = True
    m = re.search(r"load time =\s*([\d.]+) ms", stderr)  # llama.cpp's own figure of its load, for reference
    if m:
        row["llama_load_ms"] = float(m.group(1))
    if rc != 0:
        row["error"] = stderr[-2000:] or f"exit {rc}"
    return row


def commands(tool: str, binary: str, model: str, mode: str, threads: int) -> list[str]:
    if tool == "llama.cpp":
        return [binary, "-m", model, "-p", PROMPT, "-n", "1", "-no-cnv", "--no-display-prompt", "--temp", "0",
                "--seed", "0", "-t", str(threads), "-ngl", "0" if mode == "cpu" else "99"]
    return [*pi_generate(), "--model", model, "-p", PROMPT, "-n", "1", "--mode", "dense", "--device", mode, "-t",
            str(threads)]


def pi_generate() -> list[str]:
    """The console script beside this Python or on PATH (what a user types), else the same entry point through
    `python -m hotneurons.runtime` (an install whose scripts went elsewhere)."""
    here = Path(sys.executable).with_name("pi-generate")
    found = str(here) if here.exists() else shutil.which("pi-generate")
    return [found] if found else [sys.executable, "-m", "hotneurons.runtime"]


def environment(mode: str) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "HOTNEURONS_CACHE": "off"}  # no disk cache of de-quantized weights: every start reads the file
    if mode == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CUDA build of llama.cpp initializes no GPU either
    return env


def warm(path: Path) -> float:
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass
    return round(time.perf_counter() - t0, 2)


def measure(tool_bins: dict, model: str, mode: str, reps: int, threads: int, timeout: float) -> dict:
    """The first run of each tool, then `reps` alternating timed runs; medians."""
    env = environment(mode)
    out: dict = {}
    for tool, binary in tool_bins.items():
        first = timed(commands(tool, binary, model, mode, threads), env, timeout)
        log(f"  {tool:9s} first run: {first['first_token_s']:.2f} s to the first token"
            + (f" ERROR {first['error'][-300:]}" if "error" in first else ""))
        out[tool] = {"command": " ".join(commands(tool, binary, model, mode, threads)), "first_run": first,
                     "runs": []}
    for _ in range(reps):
        for tool, binary in tool_bins.items():
            out[tool]["runs"].append(timed(commands(tool, binary, model, mode, threads), env, timeout))
    for tool, row in out.items():
        ok = [r for r in row["runs"] if "error" not in r]
        row["median_first_token_s"] = round(statistics.median(r["first_token_s"] for r in ok), 3) if ok else None
        row["median_exit_s"] = round(statistics.median(r["exit_s"] for r in ok), 3) if ok else None
        row["errors"] = [r["error"][-500:] for r in row["runs"] if "error" in r][:2]
        log(f"  {tool:9s} {[r['first_token_s'] for r in row['runs']]} s -> median {row['median_first_token_s']} s"
            f" (exit {row['median_exit_s']} s)")
    texts = {t: r["runs"][0]["text"] if r["runs"] else None for t, r in out.items()}
    out["same_first_token"] = len(set(texts.values())) == 1  # greedy on both: a check, not a requirement
    return out


def phases(model: str, mode: str, threads: int, work: Path, timeout: float) -> dict:
    """One more run of ours under bench/first_token_phases.py: where its time went."""
    path = work / f"phases-{Path(model).stem}-{mode}.json"
    argv = commands("ours", "", model, mode, threads)[len(pi_generate()):]
    cmd = [sys.executable, "-m", "bench.first_token_phases", str(path), "--", *argv]
    r = subprocess.run(cmd, env=environment(mode), capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0 or not path.exists():
        return {"error": r.stderr[-2000:]}
    return json.loads(path.read_text())


def markdown(rec: dict) -> str:
    f, m = rec["figures"], rec["machine"]
    out = [f"# Load to first token ({rec['created'][:10]}, {rec['machine_kind']})", "",
           f"{m.get('cpu_model', '?')}, {m.get('nproc', '?')} CPUs, {m.get('mem_total_gib', '?')} GiB RAM, GPU "
           f"{m.get('gpu') or 'none'}; commit {rec['commit']}. Prompt \"{PROMPT}\", one new token, greedy, "
           f"{f['threads']} threads; median of {f['reps']} runs after an untimed first run, page cache warm. "
           f"llama.cpp: {TARGET} ({'CUDA' if f['build'].get('cuda') else 'CPU'} build); ours: pi-generate --mode "
           f"dense. Seconds from process start to the first token on stdout (to exit in brackets).", "",
           *[f"Note: {n}." for n in f.get("notes", [])], "",
           "| model, file | mode | llama.cpp | ours | ours / llama.cpp | first run: llama.cpp, ours | same token |",
           "|---|---|---|---|---|---|---|"]
    s = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for r in f["rows"]:
        if "skipped" in r:
            out.append(f"| {r['model']} | {r['mode']} | | | | | skipped: {r['skipped']} |")
            continue
        a, b = r["llama.cpp"], r["ours"]
        ratio = (f"{b['median_first_token_s'] / a['median_first_token_s']:.1f}x"
                 if a["median_first_token_s"] and b["median_first_token_s"] else "-")
        out.append(f"| {r['model']}, {r['file_bytes'] / 1e9:.2f} GB | {r['mode']} | {s(a['median_first_token_s'])} "
                   f"({s(a['median_exit_s'])}) | {s(b['median_first_token_s'])} ({s(b['median_exit_s'])}) | {ratio} | "
                   f"{s(a['first_run']['first_token_s'])}, {s(b['first_run']['first_token_s'])} | "
                   f"{'yes' if r['same_first_token'] else 'no'} |")
    ph = [r for r in f["rows"] if r.get("phases", {}).get("rows")]
    if ph:
        out += ["", "Where ours spends it (bench/first_token_phases.py, one more run; wall s, CPU s; rows nest):", ""]
        for r in ph:
            out += [f"{r['model']} {r['mode']}: {r['phases']['total_s']:.2f} s in all", ""]
            for p in r["phases"]["rows"]:
                cpu = "" if p.get("cpu_seconds") is None else f" ({p['cpu_seconds']:.2f} CPU)"
                out.append(f"{'    ' * p['depth']}- {p['label']}: {p['seconds']:.2f}{cpu}"
                           + (f" x{p['calls']}" if p["calls"] > 1 else ""))
            out.append("")
    return "\n".join(out) + "\n"


def write(figures: dict, out: Path | None, kind: str | None, commit: str | None) -> Path:
    info = record.machine("torch", "transformers", "gguf", "numba")
    kind = kind or record.machine_kind(info)
    name = f"{time.strftime('%Y-%m-%d')}-{kind}-first-token.json"
    path = ROOT / "bench" / "results" / name if out is None else (out if out.suffix == ".json" else out / name)
    rec = record.write_result(path, figures, machine_info=info, kind=kind, command=record.command_line(),
                              commit=record.git_commit(commit))
    path.with_suffix(".md").write_text(markdown(rec))
    return path


@click.command(context_settings={"help_option_names": ["-h", "--help"]}, help=__doc__.split("\n\n")[0])
@click.option("--shape", "shapes", multiple=True, type=click.Choice(["1.7GB", "3.1GB", "small"]),
              help="Model(s) of bench/memory_models.py: 1.7GB (16 layers, 0.47 GB Q4_0), 3.1GB (32 layers, 0.87 GB); "
                   "small is for tests [1.7GB and 3.1GB].")
@click.option("--mode", "modes", multiple=True, type=click.Choice(["cpu", "cuda"]),
              help="Repeat for several [cpu, and cuda where a GPU is].")
@click.option("--reps", type=click.IntRange(1), default=3, show_default=True, help="Timed runs per tool.")
@click.option("--threads", type=click.IntRange(1), default=None, help="Both tools' threads [all CPUs].")
@click.option("--work", type=click.Path(path_type=Path), default=Path("runs/first-token"), show_default=True,
              help="llama.cpp's source and builds, the phases' files.")
@click.option("--models", type=click.Path(path_type=Path), default=Path("runs/memory-bench/models"),
              show_default=True, help="Where the models are written (the memory benchmark's, reused).")
@click.option("--llama-completion", "llama_bin", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A built llama-completion instead of building one.")
@click.option("--jobs", type=int, default=None, help="Build jobs [all CPUs].")
@click.option("--phases/--no-phases", "phases_on", default=True, show_default=True,
              help="One more run of ours with timers around its phases.")
@click.option("--budget-s", type=float, default=450.0, show_default=True,
              help="Start no new model or mode after this many seconds (what ran is written).")
@click.option("--timeout", type=float, default=300.0, show_default=True, help="Seconds a run may take.")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Results JSON, or a folder for it [bench/results/DATE-KIND-first-token.json]; .md beside it.")
@click.option("--machine-kind", default=None, help="The results' machine kind [detected].")
@click.option("--commit", default=None, help="The commit measured, where the checkout has no .git (a copied tree).")
def main(shapes, modes, reps, threads, work, models, llama_bin, jobs, phases_on, budget_s, timeout, out,
         machine_kind, commit):
    t_start = time.perf_counter()
    work = work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    threads = threads or os.cpu_count()
    gpu = gpu_present()
    modes = tuple(modes) or (("cpu", "cuda") if gpu else ("cpu",))
    if "cuda" in modes and not gpu:
        raise click.UsageError("--mode cuda: no GPU here (nvidia-smi lists none)")
    notes = ["llama.cpp computes these files as SiLU-gated LLaMAs (its llama architecture has no ReLU variant; the "
             "file's hotneurons.activation key is ours), pi-generate as the ReLU-gated models they are: the first "
             "tokens may differ, the work per token is the same"]
    cuda_build = gpu and "cuda" in modes and nvcc() is not None
    if gpu and "cuda" in modes and not cuda_build:
        notes.append("no nvcc: llama.cpp built for the CPU only; its cuda rows are its CPU build with -ngl 99")
    build = None if llama_bin else start_build(work, cuda_build, jobs or os.cpu_count())
    if build and not build["cached"]:
        log(f"building {TARGET} ({'CUDA' if cuda_build else 'CPU'}) in the background: {build['log']}")
    shapes = tuple(shapes) or ("1.7GB", "3.1GB")
    written = {s: mm.ensure_models(s, models, ("gguf",), log=log)["gguf"] for s in shapes}
    if build:
        build = finish_build(build)
        log(f"llama.cpp built in {build['seconds']} s" + (" (cached)" if build["cached"] else ""))
    binary = llama_bin or build["binary"]
    figures = {"prompt": PROMPT, "reps": reps, "threads": threads, "build": build or {"binary": llama_bin},
               "models": written, "notes": notes, "rows": []}
    path = None
    for shape in shapes:
        model = written[shape]["model"]
        for mode in modes:
            row = {"model": shape, "mode": mode, "file_bytes": written[shape]["file_bytes"]}
            if time.perf_counter() - t_start > budget_s:
                figures["rows"].append({**row, "skipped": f"over --budget-s {budget_s:.0f}"})
                continue
            row["warm_read_s"] = warm(Path(model))
            log(f"{shape} ({row['file_bytes'] / 1e9:.2f} GB) {mode}:")
            row.update(measure({"llama.cpp": binary, "ours": "pi-generate"}, model, mode, reps, threads, timeout))
            if phases_on:
                row["phases"] = phases(model, mode, threads, work, timeout)
            figures["rows"].append(row)
            figures["elapsed_s"] = round(time.perf_counter() - t_start, 1)
            path = write(figures, out, machine_kind, commit)
    path = write(figures, out, machine_kind, commit) if path is None or figures["rows"][-1].get("skipped") else path
    log(f"wrote {path} and {path.with_suffix('.md')} ({time.perf_counter() - t_start:.0f} s)")
    click.echo(path.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
