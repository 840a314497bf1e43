"""Start time of `pi-generate --run runs/demo -n 8`: seconds from the command to its first token on stdout, with an
empty GGUF cache (the GGUF is de-quantized and the cache entry written), then with the entry (common/gguf_cache.py),
and with the cache off (every start de-quantizes: the behaviour before the cache).

    python -m bench.start_time [--run runs/demo] [--repeats 3] [--out bench/results/DATE-cpu-start-time.json]

The run comes first (the `make demo` steps):
    pi-profile --out runs/demo --tokens 30000 --samples-per-layer 4096 --force
    pi-solve --run runs/demo --vram 262MB --reserve 0
    pi-train-predictors --run runs/demo --preset fast
Each start is a new process, so imports (about 3 s here) count, as they do for a user.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import record

PROMPT = "The capital of France is"


def start(run: str, cache: str, tokens: int) -> dict:
    """One pi-generate process: seconds to its first byte on stdout (the first token) and to its exit."""
    exe = Path(sys.executable).with_name("pi-generate")
    cmd = [str(exe), "--run", run, "-n", str(tokens), "--prompt", PROMPT]
    env = {**os.environ, "HOTNEURONS_CACHE": cache}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, bufsize=0)
    first = proc.stdout.read(1)
    t_first = time.perf_counter() - t0
    out, err = proc.communicate()
    t_end = time.perf_counter() - t0
    if proc.returncode != 0 or not first:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {err.decode()[-2000:]}")
    return {"first_token_s": round(t_first, 2), "exit_s": round(t_end, 2),
            "text": (first + out).decode(errors="replace").strip()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default="runs/demo")
    ap.add_argument("--tokens", "-n", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="starts of each kind after the first (median reported)")
    ap.add_argument("--out", default=None, help="[bench/results/DATE-cpu-start-time.json]")
    args = ap.parse_args()
    if not (Path(args.run) / "predictors").is_dir():
        raise SystemExit(f"no run at {args.run}: make it first (see `python {sys.argv[0]} --help`)")
    with tempfile.TemporaryDirectory(prefix="hotneurons-start-") as cache:
        first = start(args.run, cache, args.tokens)  # empty cache: de-quantize, write the entry
        print(f"first start (empty cache): {first['first_token_s']:.2f} s to the first token", file=sys.stderr)
        cached = [start(args.run, cache, args.tokens) for _ in range(args.repeats)]
        print(f"later starts (cached): {[c['first_token_s'] for c in cached]} s", file=sys.stderr)
        entry_bytes = sum(p.stat().st_size for p in Path(cache).rglob("*") if p.is_file())
    off = [start(args.run, "off", args.tokens) for _ in range(args.repeats)]
    print(f"cache off: {[c['first_token_s'] for c in off]} s", file=sys.stderr)
    med = lambda xs, k: round(statistics.median(x[k] for x in xs), 2)  # noqa: E731
    figures = {
        "command": f"pi-generate --run {args.run} -n {args.tokens} --prompt '{PROMPT}'",
        "first_start_first_token_s": first["first_token_s"],
        "cached_start_first_token_s": med(cached, "first_token_s"),
        "cache_off_first_token_s": med(off, "first_token_s"),
        "first_start_exit_s": first["exit_s"],
        "cached_start_exit_s": med(cached, "exit_s"),
        "cache_off_exit_s": med(off, "exit_s"),
        "starts": {"first": first, "cached": cached, "cache_off": off},
        "cache_entry_bytes": entry_bytes,
        "cpu_threads": os.cpu_count(),
        "text": first["text"],
    }
    out = args.out or str(record.ROOT / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}-cpu-start-time.json")
    record.write_result(out, figures, kind="cpu")
    print(f"{out}: first start {figures['first_start_first_token_s']} s, cached {figures['cached_start_first_token_s']}"
          f" s, cache off {figures['cache_off_first_token_s']} s to the first token", file=sys.stderr)


if __name__ == "__main__":
    main()
