"""pi-bench's bench stage: our systems in a child process (stage_ours: ceilings, profile, placement, our systems,
llama-bench paired in rounds, kernel rows, floors), then each baseline standalone (llama-bench; accelerate in its own
process, stage_accelerate), the paired and standalone runs side by side (fair.py says why). Also the child-process
runner (run_part), the time limit (Deadline) and the partial JSON written after each system (checkpoint)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench import bench_ceilings as ceil
from bench import bench_llamacpp as lcpp
from bench import bench_model as bm
from bench import bench_timeline as tl
from bench import fair, record
from bench import systems as sy
from bench.bench_build import _free, calibrated_model, llama_binary, llama_ngl, llama_runs
from bench.bench_openmp import OMP_WAIT_POLICY
from bench.bench_pipeline import hardware_spec, place, profile, write_predictors
from bench.bench_systems import run_accelerate, run_interleaved, run_ours, share_sweep


class Deadline:
    def __init__(self, seconds: float):
        self.t0, self.limit = time.perf_counter(), seconds

    def left(self) -> float:
        return self.limit - (time.perf_counter() - self.t0)

    def allows(self, estimate_s: float, what: str, skipped: dict) -> bool:
        if self.left() >= estimate_s:
            return True
        skipped[what] = f"skipped: {self.left():.0f} s left of --time-limit, about {estimate_s:.0f} s needed"
        print(what, skipped[what], flush=True)
        return False


def fairness_probe(rt, prompt: list[int]) -> dict:
    """fair.cpu_probe just after a generation of `rt` (our threads still hot): beside them, then with this process
    stopped as for a paired baseline. The parent adds the probe alone."""
    from hotneurons.runtime.generate import generate

    out = {}
    for key, freeze in (("beside_ours_s", False), ("ours_stopped_s", True)):
        generate(rt, prompt, 4, stop_at_eos=False)
        out[key] = fair.cpu_probe(freeze=freeze)
    print("cpu probe", out, flush=True)
    return out


def stage_bench(args, work: Path, out: Path) -> dict:
    """Our systems in a child process (stage_ours), then every baseline standalone from this process, which has run
    nothing on the CPU meanwhile: llama-bench, and accelerate in a process of its own. The paired and standalone
    llama.cpp figures side by side (`baselines`, flagged beyond fair.TOLERANCE)."""
    dl = Deadline(args.time_limit)
    runs = llama_runs(args, work) if "llama.cpp" in args.systems else []
    reserve = (len(runs) * args.estimates["llama.cpp"]
               + ("accelerate" in args.systems) * args.estimates["accelerate"])
    args.ours_time_limit = max(10.0, args.time_limit - reserve)
    alone = None if args.in_process else fair.cpu_probe()
    if args.in_process:
        res = stage_ours(args, work)
    else:
        res = run_part(args, "ours", out, args.ours_time_limit + 120)
    res["stage"] = "bench"
    systems, skipped = res.setdefault("systems", {}), res.setdefault("skipped", {})
    res["llama_cpp_ngl_at_budget"], res["llama_cpp_q8_0_ngl_at_budget"] = llama_ngl(args)
    if alone is not None:
        res["fairness"] = {"alone_s": alone, **res.get("fairness", {}), "what": (
            "seconds of a CPU-bound job on every core (fair.cpu_probe): alone, just after one of our generations "
            "beside our process, and with our process stopped as for a paired baseline")}
    if "llama.cpp" in args.systems and not runs:
        skipped["llama.cpp"] = f"not built in {work}: run --stage build on this machine first"
    threads = args.threads or os.cpu_count()
    for label, k, path in runs:
        if dl.allows(args.estimates["llama.cpp"], label, skipped):
            systems[label] = lcpp.llama_bench(str(llama_binary(args, work)), path, k, threads, args.llama_tokens,
                                              args.llama_reps, max(30, dl.left()))
            systems[label]["standalone"] = True
            print(label, systems[label].get("decode_tokens_per_s", systems[label].get("error")), flush=True)
            checkpoint(args, res, systems, skipped)
    if "accelerate" in args.systems and dl.allows(args.estimates["accelerate"], "accelerate", skipped):
        if args.in_process:
            row = stage_accelerate(args, work)["systems"]["accelerate offload"]
        else:
            part = run_part(args, "accelerate", out, max(30, dl.left()))
            row = (part.get("systems") or {}).get("accelerate offload") or {"error": part.get("error", "no result")}
        systems["accelerate offload"] = {**row, "standalone": True}
        checkpoint(args, res, systems, skipped)
    paired = {label: [r.get("decode_tokens_per_s") for r in rows]
              for label, rows in ((res.get("interleaved") or {}).get("others") or {}).items()}
    res["baselines"] = {label: fair.compare(_rate_of(systems.get(label)), v) for label, v in paired.items()}
    for label, c in res["baselines"].items():
        if c["flag"]:
            print(f"FLAG: {label} paired {c['paired_median_tokens_per_s']} tok/s, standalone "
                  f"{c['standalone_tokens_per_s']} tok/s", flush=True)
    res["seconds"] = time.perf_counter() - dl.t0
    return res


def _rate_of(row: dict | None) -> float | None:
    return (row or {}).get("decode_tokens_per_s")


def stage_accelerate(args, work: Path) -> dict:
    """HF accelerate's offload of the bench model at the budget, in a process of its own (--part accelerate)."""
    budget = int(args.budget_share * bm.model_bytes(args.shape, args.layers)["total"])
    model = calibrated_model(args, work)
    base = model.lm.model.to("cpu")
    _free(args.device)
    prompt = list(range(100, 100 + args.prompt_tokens))
    try:
        row = run_accelerate(base, budget, args.device, prompt, args.slow_tokens)
    except Exception as e:
        row = {"error": f"{type(e).__name__}: {e}"}
    row["omp_wait_policy"] = OMP_WAIT_POLICY
    return {"stage": "part accelerate", "systems": {"accelerate offload": row}}


def run_part(args, part: str, out: Path, timeout: float) -> dict:
    """`pi-bench --part PART` (this command line) in a child process; its JSON (out/pi_bench_PART.json, partial if
    the child stopped early), or {"error": ...} where it wrote none. accelerate's child gets the baseline environment
    (fair.baseline_env)."""
    path = out / f"pi_bench_{part}.json"
    path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "bench.pi_bench", *args.argv, "--part", part, "--out", str(out)]
    env = fair.baseline_env() if part != "ours" else None
    print("+", " ".join(cmd), flush=True)
    try:
        rc = subprocess.run(cmd, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if not path.exists():
        return {"error": f"the {part} process ended ({rc}) before writing {path.name}"}
    res = record.read(path)["figures"]  # the header is this process's
    if rc != 0:
        res.setdefault("partial", f"the {part} process ended ({rc}) before its end")
    return res


def checkpoint(args, res: dict, systems: dict, skipped: dict) -> None:
    """The bench stage's JSON as it stands (args.save, set by main), marked partial: a run stopped by a timeout keeps
    the systems measured before it."""
    if getattr(args, "save", None) is not None:
        args.save({**res, "systems": systems, "skipped": skipped,
                   "partial": "the bench stage stopped before its end: the systems measured until then"})


def stage_ours(args, work: Path) -> dict:
    """Our systems, in the process that pi-bench's bench stage starts for them (or in-process with --in-process):
    ceilings, model, profile, placement, our systems (with --interleave, llama-bench paired in rounds while this
    process is stopped), the kernel rows and the floors. The standalone baselines run after it (stage_bench)."""
    from hotneurons.artifacts.placement import Placement
    from hotneurons.runtime.generate import RuntimeConfig
    from hotneurons.runtime.load import layer_split_count

    dl = Deadline(args.ours_time_limit)
    skipped: dict = {}
    res: dict = {"stage": "part ours" if args.part == "ours" else "bench", "skipped": skipped}
    cuda = args.device == "cuda"
    c = {"dram": ceil.dram_read_bw(args.dram_bytes)}
    if cuda:
        c.update(ceil.cuda_ceilings())
        try:
            c["zero_copy"] = ceil.zero_copy_read(args.dram_bytes)
        except Exception as e:
            c["zero_copy"] = {"error": f"{type(e).__name__}: {e}"}
    res["ceilings"] = c
    print("ceilings", json.dumps(c, default=float)[:600], flush=True)

    mb = bm.model_bytes(args.shape, args.layers)
    budget = int(args.budget_share * mb["total"])
    res["model"] = {"shape": args.shape, "layers": args.layers, "dims": bm.SHAPES[args.shape], "bytes": mb,
                    "budget_bytes": budget, "budget_share": args.budget_share, "weights": "random, fp16",
                    "embed_std": args.embed_std}
    model = calibrated_model(args, work)
    res["calibration"] = model.calibration
    run = work / f"run-{args.shape}-{args.layers}"
    res["profile"] = profile(args, model, run)
    res["profile"].pop("freq")
    preds = write_predictors(args, run, model)
    res["predictors"] = {k: v for k, v in preds.items() if k != "layers"}
    res["placement"] = place(args, run, hardware_spec(c, budget), budget)
    placement = Placement.from_run(run, model.lm.info)

    base = model.lm
    base.model.to("cpu")
    _free(args.device)
    prompt = list(range(100, 100 + args.prompt_tokens))
    res["prompt_tokens"] = len(prompt)
    P = type("Predictors", (), {"layers": preds["layers"]})()
    dt = "float16"  # the solver counted fp16 bytes; on the CPU too, so the --vram check means the same
    systems = {}
    C = functools.partial(RuntimeConfig, ctx=args.ctx, device=args.device, dtype=dt,  # the solver's --ctx: its KV
                          **({} if args.pcie_share is None else {"pcie_share": args.pcie_share}))
    plan = [(s.name, C(**({"vram": budget} | s.fields)), placement if s.placed else None,
             P if s.fields.get("mode", "hybrid") == "hybrid" else None, *((args.slow_tokens, 1) if s.slow else
                                                                          (args.tokens, args.reps)))
            for s in sy.SYSTEMS.values() if s.runner == "ours" and s.name in args.systems]
    runs = llama_runs(args, work)
    threads = args.threads or os.cpu_count()
    others = {}  # with --interleave: llama-bench once after each round, so that hybrid's ratio to it is paired
    if args.interleave and "llama.cpp" in args.systems and runs:
        label, k, path = runs[0]  # -ngl at the budget; this process is stopped while it runs unless --in-process
        others[label] = functools.partial(lcpp.llama_bench, str(llama_binary(args, work)), path, k, threads,
                                          args.llama_tokens, 1, 120, freeze=not args.in_process)
    together = [p for p in plan if args.interleave and p[0].startswith("hybrid")]
    rounds = len(together) > 1 or (len(together) == 1 and bool(others))  # else nothing to pair
    if rounds:  # one entry that times the hybrid systems in rounds, where the first of them stood
        later = {p[0] for p in together[1:]}
        plan = [p for p in plan if p[0] not in later]
    for name, cfg, pl, pr, n_tok, reps in plan:
        in_rounds = rounds and name == together[0][0]
        group = together if in_rounds else [(name, cfg, pl, pr, n_tok, reps)]
        need = sum(args.estimates.get(g[0], 30) for g in group)
        if in_rounds:  # llama-bench once a round
            need += len(others) * group[0][5] * args.estimates["llama.cpp round"]
        if not dl.allows(need, name, skipped):
            continue
        try:
            if in_rounds:
                def on_round(partial: dict) -> None:  # the rounds so far, kept if a timeout stops the run
                    res["interleaved"] = {"partial": partial}
                    checkpoint(args, res, systems, skipped)

                rows, extra = run_interleaved(group, base, prompt, args.dram_bytes, others, on_round)
                res["interleaved"] = extra.pop("interleaved")
                systems.update(rows)
                row = rows[name]
            else:
                row, extra = run_ours(name, base, cfg, pl, pr, prompt, n_tok, reps,
                                      args.dram_bytes if name.startswith("hybrid") else None)
        except Exception as e:
            row, extra = {"error": f"{type(e).__name__}: {e}"}, {}
            print(name, "failed:", row["error"], flush=True)
        if name == "layer-split" and "error" not in row:
            row["gpu_layers"] = layer_split_count(base, budget, None, torch.float16)
        systems[name] = row
        if "rt" in extra and not args.in_process and "fairness" not in res:
            res["fairness"] = fairness_probe(extra["rt"], prompt)
        if "rt" in extra:
            res["predictor_time"] = tl.predictor_time(P, bm.SHAPES[args.shape][0], args.device, rt=extra["rt"])
            if args.share_sweep:
                res["share_sweep"] = share_sweep(extra["rt"], prompt, n_tok, args.reps, args.share_sweep)
        del extra
        _free(args.device)
        checkpoint(args, res, systems, skipped)

    res["systems"] = systems
    del base, model
    _free(args.device)
    for key, cold_dtype in (("kernel", "bf16"), ("kernel_int8", "int8")):
        if dl.allows(20, key, skipped):
            d, n = bm.SHAPES[args.shape][:2]
            res[key] = ceil.kernel_bench(d, n, dtype=cold_dtype)
    ceil.add_floors(res, c, args.shape, args.layers, preds["bytes"])
    res["seconds"] = time.perf_counter() - dl.t0
    return res
