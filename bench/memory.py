"""The memory benchmark: peak host memory of every pipeline stage on models written for it, against the model file.

    pi-bench --stage memory --preset small          # or: python -m bench.memory --preset small
    pi-bench --stage memory --preset full --models /root/memory-bench/models --runs /root/memory-bench/runs

For each model preset (bench/memory_models.py: random ReLU LLaMAs, 1.7 GB and 3.1 GB in bf16, "small" for tests) and
format (hf: a folder with bf16 safetensors; gguf: Q4_0 in llama.cpp's conventions), the stages run in the README's
pipeline order on a run directory of their own, each a process of its own, under bench/memory_probe.Monitor (the
process tree's VmRSS, RssAnon and RssFile from /proc every 25 ms, peaks kept). pi-generate's first token is the time
to its first text on stdout; pi-serve gets `requests` small completions and its memory is read after the first and
after the last (growth: what each request leaves behind). Everything runs on the CPU: pi-solve's budget only sets
the layout (`gpu_share` of the FFN neurons "on the GPU").

The stages' command lines are one table, STAGES: a flag that changes is one edit there. A stage whose `needs` word
is missing from its tool's --help (a flag not written yet) is recorded as skipped; a stage that fails is recorded
with its exit code and the tail of its stderr, and the run goes on. Results: a JSON record (bench/record.py) and a
Markdown table beside it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import click

from bench import ROOT, record
from bench import memory_models as mm
from bench.memory_probe import Monitor


@dataclass(frozen=True)
class Stage:
    """One pipeline command. `argv`: its words, `{name}` filled from the run (see `values`); `first_output`: a
    regex whose first match on the `first_output_on` streams is timed (the first token on stdout; pi-serve's URL,
    its first group, which it logs on stderr); `needs`: a word its --help must show, else the stage is skipped (a
    flag not written yet); `requests`: pi-serve only."""

    argv: tuple[str, ...]
    first_output: str | None = None
    first_output_on: tuple[str, ...] = ("stdout",)  # the streams it is looked for on
    needs: str | None = None
    requests: bool = False


_GEN = ("pi-generate", "--run", "{run}", "--prompt", "{prompt}", "-n", "{new_tokens}", "--device", "{device}")
STAGES: dict[str, Stage] = {
    "profile": Stage(("pi-profile", "--model", "{model}", "--out", "{run}", "--tokens", "{profile_tokens}",
                      "--seq-len", "{seq_len}", "--dataset", "{corpus}", "--activation", "reglu",
                      "--device", "{device}", "--force", "--quiet")),
    "solve": Stage(("pi-solve", "--run", "{run}", "--vram", "{vram}", "--reserve", "0", "--ctx", "{ctx}")),
    "train-predictors": Stage(("pi-train-predictors", "--run", "{run}", "--preset", "fast", "--device", "{device}",
                               "--force", "--quiet")),
    "eval": Stage(("pi-eval", "--run", "{run}", "--tokens", "{eval_tokens}", "--seq-len", "{seq_len}", "--dataset",
                   "{corpus}", "--device", "{device}", "--mode", "dense", "--mode", "predictor", "--quiet")),
    "generate-bf16": Stage((*_GEN, "--cold-dtype", "bf16"), first_output=r"(?s)."),
    "generate-int8": Stage((*_GEN, "--cold-dtype", "int8"), first_output=r"(?s)."),
    # the 4-bit path: cold rows kept in the file's Q4_0 blocks (weights/formats.py); skipped until the flag exists
    "generate-q4": Stage((*_GEN, "--cold-dtype", "q4_0"), first_output=r"(?s).", needs="q4_0"),
    "generate-auto": Stage((*_GEN, "--cold-dtype", "auto"), first_output=r"(?s)."),  # the file's own formats
    "serve": Stage(("pi-serve", "--run", "{run}", "--device", "{device}", "--port", "0", "--max-tokens",
                    "{serve_tokens}", "-q"), first_output=r"(https?://\S+?)/v1", first_output_on=("stdout", "stderr"),
                   requests=True),
}


@dataclass(frozen=True)
class Settings:
    """One benchmark run: which models, formats and stages, and the sizes of the work each stage does."""

    shapes: tuple[str, ...]
    formats: tuple[str, ...] = ("hf", "gguf")
    stages: tuple[str, ...] = tuple(STAGES)
    profile_tokens: int = 512
    eval_tokens: int = 256
    seq_len: int = 128
    new_tokens: int = 16
    requests: int = 100
    serve_tokens: int = 4  # per request: the figure is memory after the 1st and the last, not decode speed
    gpu_share: float = 0.2  # of FFN neurons placed "on the GPU" by pi-solve's budget
    ctx: int = 512
    prompt: str = "The capital of France is"
    interval_s: float = 0.025
    stage_timeout_s: float = 3600.0
    device: str = "cpu"  # every stage's --device (cuda on a GPU machine: the device's memory is not sampled here)
    gguf_cache: str = "off"  # HOTNEURONS_CACHE of the stages: off = every GGUF load de-quantizes (no disk cache)
    seed: int = 0


PRESETS: dict[str, Settings] = {
    "small": Settings(shapes=("small",), stage_timeout_s=600.0),
    "full": Settings(shapes=("1.7GB", "3.1GB")),
    "1.7GB": Settings(shapes=("1.7GB",)),
}


# What every stage holds before any model: the interpreter and the libraries the stages import. Measured once per
# run; "above floor" figures subtract it (on a 4 MB model they are the only meaningful ones).
FLOOR = ("python", "-c", "import numba, torch, transformers")


def tool(name: str) -> str:
    """This environment's python, or a console script beside it, else one on PATH."""
    if name == "python":
        return sys.executable
    here = Path(sys.executable).with_name(name)
    return str(here) if here.exists() else (shutil.which(name) or name)


def gpu_budget(run: Path, share: float, ctx: int) -> str:
    """pi-solve's --vram that leaves `share` of the FFN neurons' fp16 bytes after what the GPU holds first (the
    solver's own memory_items for the profiled shape, predictors at the solver's estimate)."""
    from hotneurons.common.model_info import ModelInfo
    from hotneurons.common.units import format_size_arg
    from hotneurons.solver.cost import estimate_predictor_params, memory_items

    meta = json.loads((run / "profile" / "meta.json").read_text())
    shape = ModelInfo.from_meta(meta["model"])
    fixed = sum(memory_items(shape, 2.0, ctx, 0, estimate_predictor_params(shape) * 2).values())
    ffn = shape.n_layers * shape.n_neurons * shape.neuron_params * 2.0
    return format_size_arg(fixed + share * ffn)


def values(s: Settings, model: str, run: Path, corpus: Path) -> dict[str, str]:
    return {"model": model, "run": str(run), "corpus": str(corpus), "prompt": s.prompt, "ctx": str(s.ctx),
            "profile_tokens": str(s.profile_tokens), "eval_tokens": str(s.eval_tokens), "seq_len": str(s.seq_len),
            "new_tokens": str(s.new_tokens), "serve_tokens": str(s.serve_tokens), "device": s.device}


def _has_flag(exe: str, word: str, env: dict) -> bool:
    r = subprocess.run([exe, "--help"], capture_output=True, text=True, env=env, timeout=300)
    return word in r.stdout


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def serve_requests(mon: Monitor, s: Settings) -> dict:
    """Send `s.requests` completions once pi-serve listens; its tree's memory after the first and the last."""
    url = mon.wait_for_output(s.stage_timeout_s)
    if url is None:
        return {"requests_ok": 0, "serve_error": "pi-serve printed no URL"}
    times, errors, in_a_row = [], [], 0
    for i in range(s.requests):
        t0 = time.perf_counter()
        try:
            _post(f"{url}/v1/completions", {"prompt": s.prompt, "max_tokens": s.serve_tokens, "temperature": 0}, 600)
            times.append(time.perf_counter() - t0)
            in_a_row = 0
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}"[:300])
            in_a_row += 1
            if in_a_row == 3:  # a server that died or hangs: no point in the rest
                break
        if i in (0, s.requests - 1):
            mon.snapshot(f"after_{i + 1}")
    snaps = mon.snapshots
    first, last = snaps.get("after_1"), snaps.get(f"after_{s.requests}")
    out = {"requests": s.requests, "requests_ok": len(times), "request_errors": errors[:5],
           "request_median_s": round(sorted(times)[len(times) // 2], 3) if times else None}
    if first and last:
        out.update(rss_after_first_bytes=first.rss, rss_after_last_bytes=last.rss,
                   rss_growth_bytes=last.rss - first.rss)
    return out


def run_stage(name: str, s: Settings, vals: dict[str, str], env: dict) -> dict:
    """One stage under the Monitor: its measurement (or why it was skipped) as a dict."""
    st = STAGES[name]
    exe = tool(st.argv[0])
    if st.needs and not _has_flag(exe, st.needs, env):
        return {"status": "skipped", "reason": f"{st.argv[0]} --help has no '{st.needs}' yet"}
    argv = [exe, *(a.format(**vals) for a in st.argv[1:])]
    with Monitor(argv, env=env, interval=s.interval_s, first_output=st.first_output,
                 first_output_on=st.first_output_on) as mon:
        extra = serve_requests(mon, s) if st.requests else {}
        m = mon.stop() if st.requests else mon.wait(s.stage_timeout_s)
    rec = {**m.to_dict(), **extra}
    rec["command"] = rec["command"].replace(str(Path(exe).parent) + "/", "")  # pi-x as a user types it
    if st.requests:  # a server ends when stopped: its requests say whether it worked
        ok = extra.get("requests_ok") == s.requests
    else:
        ok = m.exit_code == 0
    rec["status"] = "ok" if ok else ("timeout" if m.timed_out else "failed")
    if st.first_output and not st.requests:
        rec["first_token_s"] = rec["first_output_s"]
    return rec


def _line(row: dict) -> str:
    if row["status"] == "skipped":
        return f"{row['model']:>6} {row['format']:<4} {row['stage']:<16} skipped: {row['reason']}"
    gb = 1e9
    txt = (f"{row['model']:>6} {row['format']:<4} {row['stage']:<16} {row['status']:<7} peak "
           f"{row['peak_rss_bytes'] / gb:6.3f} GB ({row['ratio_to_file']:.2f}x file, {row['ratio_above_floor']:.2f}x "
           f"above the floor; anon "
           f"{row['peak_anon_bytes'] / gb:.3f}, file-backed {row['peak_file_bytes'] / gb:.3f}) {row['wall_s']:.1f} s")
    if row.get("first_token_s") is not None:
        txt += f", first token {row['first_token_s']:.2f} s"
    if row.get("rss_growth_bytes") is not None:
        txt += f", {row['requests_ok']}/{row['requests']} requests, growth {row['rss_growth_bytes'] / 2**20:+.1f} MiB"
    if row["status"] != "ok":
        txt += f"\n        exit {row['exit_code']}: {row['stderr_tail'].strip().splitlines()[-1:] or ''}"
    return txt


def run_bench(s: Settings, models: Path, runs: Path, log=print) -> dict:
    """Write (or reuse) the models, run every stage on each model x format; the figures of the results record."""
    env = {**os.environ, "HOTNEURONS_CACHE": s.gguf_cache, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    corpus = mm.write_corpus(models / "corpus.txt", 4 * (s.profile_tokens + s.eval_tokens) + 65536, s.seed)
    floor = Monitor([tool(FLOOR[0]), *FLOOR[1:]], env=env, interval=s.interval_s).start().wait(600).to_dict()
    log(f"floor (python -c '{FLOOR[2]}'): {floor['peak_rss_bytes'] / 1e9:.3f} GB")
    rows, files = [], {}
    for shape in s.shapes:
        written = mm.ensure_models(shape, models, s.formats, s.seed, log=log)
        files[shape] = written
        for fmt in s.formats:
            model, file_bytes = written[fmt]["model"], written[fmt]["file_bytes"]
            run = runs / f"{shape}-{fmt}"
            vals = values(s, model, run, corpus)
            for name in s.stages:
                base = {"model": shape, "format": fmt, "stage": name, "file_bytes": file_bytes}
                if name == "solve":
                    try:
                        vals["vram"] = gpu_budget(run, s.gpu_share, s.ctx)
                    except Exception as e:
                        rows.append({**base, "status": "skipped", "reason": f"no GPU budget: {e}"[:300]})
                        log(_line(rows[-1]))
                        continue
                rec = {**base, **run_stage(name, s, vals, env)}
                if "peak_rss_bytes" in rec:
                    rec["ratio_to_file"] = round(rec["peak_rss_bytes"] / file_bytes, 3)
                    rec["peak_above_floor_bytes"] = rec["peak_rss_bytes"] - floor["peak_rss_bytes"]
                    rec["ratio_above_floor"] = round(rec["peak_above_floor_bytes"] / file_bytes, 3)
                rows.append(rec)
                log(_line(rec))
    return {"settings": asdict(s), "models": files, "corpus": str(corpus), "floor": floor, "rows": rows}


def markdown(rec: dict) -> str:
    """The results as a docs-ready table."""
    f, m = rec["figures"], rec["machine"]
    gb = lambda n: f"{n / 1e9:.2f}"  # noqa: E731
    out = [f"# Host memory per stage ({rec['created'][:10]}, {rec['machine_kind']})", "",
           f"{m.get('cpu_model', '?')}, {m.get('nproc', '?')} cores, {m.get('mem_total_gib', '?')} GiB RAM; commit "
           f"{rec['commit']}. Random-weight ReLU LLaMAs (bench/memory_models.py), every stage with "
           f"--device {f['settings'].get('device', 'cpu')}; host memory only: peaks of "
           f"the stage's process tree sampled every {f['settings']['interval_s'] * 1000:.0f} ms from /proc. "
           f"GB = 10^9 bytes.", "",
           f"Floor (`python -c '{FLOOR[2]}'`): {gb(f['floor']['peak_rss_bytes'])} GB; \"above floor\" "
           f"subtracts it.", "",
           "| model | format | file GB | stage | peak RSS GB | x file | above floor, x file | anon GB | "
           "file-backed GB | wall s | first token s | status |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in f["rows"]:
        if r["status"] == "skipped":
            out.append(f"| {r['model']} | {r['format']} | {gb(r['file_bytes'])} | {r['stage']} | | | | | | | | "
                       f"skipped: {r['reason']} |")
            continue
        ft = "" if r.get("first_token_s") is None else f"{r['first_token_s']:.2f}"
        status = r["status"] if r["status"] == "ok" else f"{r['status']} (exit {r['exit_code']})"
        if r.get("rss_growth_bytes") is not None:
            status += (f"; {r['requests_ok']}/{r['requests']} requests, RSS {gb(r['rss_after_first_bytes'])} after "
                       f"the 1st, {gb(r['rss_after_last_bytes'])} after the last")
        out.append(f"| {r['model']} | {r['format']} | {gb(r['file_bytes'])} | {r['stage']} | {gb(r['peak_rss_bytes'])} "
                   f"| {r['ratio_to_file']:.2f} | {r['ratio_above_floor']:.2f} | {gb(r['peak_anon_bytes'])} | "
                   f"{gb(r['peak_file_bytes'])} | "
                   f"{r['wall_s']:.1f} | {ft} | {status} |")
    return "\n".join(out) + "\n"


def write(figures: dict, out: Path | None, kind: str | None = None, command: str | None = None) -> tuple[Path, dict]:
    info = record.machine("torch", "transformers", "gguf")
    kind = kind or record.machine_kind(info)
    out = out or ROOT / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}-{kind}-memory.json"
    rec = record.write_result(out, figures, machine_info=info, kind=kind, command=command)
    out.with_suffix(".md").write_text(markdown(rec))
    return out, rec


@click.command(context_settings={"help_option_names": ["-h", "--help"]}, help=__doc__.split("\n\n")[0])
@click.option("--preset", type=click.Choice(list(PRESETS)), default="small", show_default=True,
              help="Models and sizes: small (4 MB, minutes on 2 cores), 1.7GB, full (1.7GB and 3.1GB).")
@click.option("--shape", "shapes", multiple=True, type=click.Choice(list(mm.SHAPES)),
              help="Model preset(s) instead of the preset's (repeat).")
@click.option("--format", "formats", multiple=True, type=click.Choice(mm.FORMATS),
              help="hf (bf16 safetensors folder), gguf (Q4_0), gguf-k (Q4_K_M, by llama-cpp-python's "
                   "quantizer); repeat [hf, gguf].")
@click.option("--stages", default=None, help=f"Comma list, in order [{','.join(STAGES)}].")
@click.option("--models", type=click.Path(path_type=Path), default=Path("runs/memory-bench/models"),
              show_default=True, help="Where the models are written (and reused when their manifest matches).")
@click.option("--runs", type=click.Path(path_type=Path), default=Path("runs/memory-bench/runs"), show_default=True,
              help="Run directories, one per model and format.")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Results JSON (a .md beside it) [bench/results/DATE-KIND-memory.json].")
@click.option("--profile-tokens", type=int, default=None, help="pi-profile --tokens [preset: 512].")
@click.option("--requests", type=int, default=None, help="pi-serve requests [preset: 100].")
@click.option("--interval-ms", type=float, default=None, help="Sampling period [preset: 25].")
@click.option("--gguf-cache", default=None, help="HOTNEURONS_CACHE of the stages: off, or a folder [preset: off].")
@click.option("--machine-kind", default=None, help="The results' machine kind [detected: cpu, nvidia-h200, ...].")
@click.option("--device", default=None, help="Every stage's --device [preset: cpu].")
@click.option("--write-only", is_flag=True, help="Write the models and stop.")
def main(preset, shapes, formats, stages, models, runs, out, profile_tokens, requests, interval_ms, gguf_cache,
         machine_kind, device, write_only):
    s = PRESETS[preset]
    given = {"shapes": tuple(shapes) or None, "formats": tuple(formats) or None, "profile_tokens": profile_tokens,
             "stages": tuple(stages.split(",")) if stages else None, "requests": requests, "gguf_cache": gguf_cache,
             "interval_s": None if interval_ms is None else interval_ms / 1000, "device": device}
    s = replace(s, **{k: v for k, v in given.items() if v is not None})
    bad = [x for x in s.stages if x not in STAGES]
    if bad:
        raise click.UsageError(f"--stages: unknown stage {bad[0]!r}; choose from {', '.join(STAGES)}")
    if write_only:
        for shape in s.shapes:
            click.echo(json.dumps(mm.ensure_models(shape, models, s.formats, s.seed, log=click.echo), indent=1))
        return
    figures = run_bench(s, models, runs, log=lambda t: click.echo(t, err=False))
    path, rec = write(figures, out, machine_kind, command=record.command_line())
    click.echo(f"wrote {path} and {path.with_suffix('.md')}")


def cli(argv: list[str] | None = None) -> None:
    main(args=argv)


if __name__ == "__main__":
    main()
