"""Where pi-generate's time to its first token goes: pi-generate run in this process with wall-clock timers around
the phases of its load (runtime/load.load_source_runtime) and of its first forward, and Numba's JIT compiles.

    python -m bench.first_token_phases OUT.json -- --model FILE.gguf -p "The capital of France is" -n 1

The arguments after `--` are pi-generate's. bench/first_token.py runs this as a process of its own (`--phases`), so
the imports are timed as a user's start pays them. Timers are inclusive and nest (the `depth` of each row); a function
that is not there (an older or newer checkout) is left out. Not a replacement for the side-by-side timing: the
wrappers cost microseconds a call, and the rows' sum is not the process's wall time (the rest is `other`).
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
import time

T0 = time.perf_counter()

# (module, attribute path, depth, label): the phases, in the order a load meets them
TIMED = (
    ("hotneurons.runtime.load", "load_source_runtime", 0, "load (all of runtime/load.load_source_runtime)"),
    ("hotneurons.models.open", "open_model", 1, "open the file, its config (transformers)"),
    ("hotneurons.artifacts.predictor_file", "load_predictors", 1, "predictors (a run's)"),
    ("hotneurons.models", "build_model", 1, "decoder: attention, norms, embeddings, head"),
    ("hotneurons.models.ffn_weights", "FFNWeights.from_source", 1, "FFN weights from the file (views)"),
    ("hotneurons.runtime.hybrid_ffn", "HybridFFN.__init__", 1, "FFN layers laid out (HybridFFN)"),
    ("hotneurons.runtime.hybrid_ffn", "hot_blocks", 2, "hot rows (ffn_weights.hot_blocks)"),
    ("hotneurons.runtime.hybrid_ffn", "cold_rows_of", 2, "cold rows (cold_rows.cold_rows_of)"),
    ("hotneurons.models.ffn_weights", "down_t_rows", 3, "down columns as rows, re-quantized (down_t_rows)"),
    ("hotneurons.kernels.qlinear", "pack", 3, "hot rows split for the kernels (qlinear.pack)"),
    ("hotneurons.weights.gguf_source", "GGUFSource.tokenizer", 1, "tokenizer"),
    ("hotneurons.runtime.balance", "pcie_share", 1, "PCIe share measured at start"),
    ("hotneurons.runtime.generate", "generate", 0, "generate: prefill and the first token"),
    ("hotneurons.runtime.hybrid_ffn", "HybridFFN.forward", 1, "FFNs (HybridFFN.forward)"),
)


class Timers:
    def __init__(self):
        self.rows: dict[str, dict] = {}

    def wrap(self, module: str, path: str, depth: int, label: str) -> None:
        try:
            owner = importlib.import_module(module)
            *parents, name = path.split(".")
            for p in parents:
                owner = getattr(owner, p)
            fn = getattr(owner, name)
        except (ImportError, AttributeError):
            return
        row = self.rows.setdefault(f"{module}.{path}", {"label": label, "depth": depth, "calls": 0, "seconds": 0.0,
                                                         "cpu_seconds": 0.0})
        active = [0]  # a recursive or re-entrant call is counted once, by its outermost frame

        @functools.wraps(fn)
        def timed(*args, **kw):
            active[0] += 1
            t, c = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kw)
            finally:
                active[0] -= 1
                if not active[0]:
                    row["calls"] += 1
                    row["seconds"] += time.perf_counter() - t
                    row["cpu_seconds"] += time.process_time() - c

        setattr(owner, name, timed)


def process_age() -> float | None:
    """Seconds since this process started (Linux /proc; 10 ms resolution), None elsewhere."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        with open("/proc/self/stat") as f:
            start = int(f.read().rsplit(")", 1)[1].split()[19]) / ticks
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - start
    except (OSError, ValueError, IndexError):
        return None


def run(argv: list[str]) -> dict:
    """pi-generate `argv` in this process under the timers; the phases as a dict (wall and CPU seconds: on a machine
    shared with other work the CPU seconds say more about the work itself)."""
    before = (process_age() or 0.0) - (time.perf_counter() - T0)  # interpreter start, before this module ran
    t, c = time.perf_counter(), time.process_time()
    import numba.core.event as ev
    from hotneurons.runtime import cli

    imports, imports_cpu = time.perf_counter() - t, time.process_time() - c
    timers = Timers()
    for spec in TIMED:
        timers.wrap(*spec)
    compiles: list[str] = []

    class Compiles(ev.Listener):  # what Numba compiled (cache misses): their time is in the numba:compile timer
        def on_start(self, event):
            f = getattr((event.data or {}).get("dispatcher"), "py_func", None)
            compiles.append(f"{f.__module__}.{f.__qualname__}" if f is not None else "?")

        def on_end(self, event):
            pass

    jit = [0.0]
    t, c = time.perf_counter(), time.process_time()
    with ev.install_listener("numba:compile", Compiles()), \
            ev.install_timer("numba:compile", lambda s: jit.__setitem__(0, s)):
        try:
            cli.main(args=argv, standalone_mode=False)
        finally:
            sys.stdout.flush()
    main_s, main_cpu = time.perf_counter() - t, time.process_time() - c
    rows = [{"name": "interpreter start", "label": "python starts, until this module runs", "depth": 0,
             "calls": 1, "seconds": before, "cpu_seconds": None},
            {"name": "imports", "label": "import the engine's modules (torch, numba, ours)", "depth": 0,
             "calls": 1, "seconds": imports, "cpu_seconds": imports_cpu}]
    rows += [{"name": k, **v} for k, v in timers.rows.items() if v["calls"]]
    top = [r for r in rows if r["depth"] == 0 and r["name"] not in ("interpreter start", "imports")]
    rows.append({"name": "other", "label": "the rest of pi-generate (flags, runtime checks, output)", "depth": 0,
                 "calls": 1, "seconds": main_s - sum(r["seconds"] for r in top),
                 "cpu_seconds": main_cpu - sum(r["cpu_seconds"] for r in top)})
    rows.append({"name": "numba:compile", "label": "Numba JIT compiles (cache misses; inside the rows above)",
                 "depth": 1, "calls": len(compiles), "seconds": jit[0], "cpu_seconds": None})
    return {"argv": argv, "total_s": before + imports + main_s, "cpu_s": time.process_time(), "rows": rows,
            "numba_compiled": compiles[:50]}


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        raise SystemExit(__doc__.split("\n\n")[1].strip())
    out, argv = sys.argv[1], sys.argv[3:]
    res = run(argv)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
