"""pi-bench: our systems (hybrid, layer-split, all-GPU) against llama.cpp and HF accelerate on one LLaMA-2-70B-shaped
model, with the cost floor from ceilings measured in the same run. docs/benchmarks.md says how to run it.

The model has RANDOM weights (bench_model.py): LLaMA-2-70B layer shapes with grouped-query attention, a ReLU-gated
FFN, per-neuron firing probabilities calibrated to a power law (mean 10% active, the top 20% of neurons covering 80%
of firings), gate columns of rank 511. The predictor is EXACT (bench_model.exact_predictor): an MLP of a trained
predictor's size (d/8 hidden) whose logits are the gate pre-activations, so it marks the neurons that fire. Speed
only, not quality.

Stages (each a separate run; they share files through --work, so run them on one machine):
  prepare  where PyPI is reachable: llama.cpp source tarball into .llamacpp/, the wheels a GPU image may lack
           (pulp, highspy, gguf, pi-serve's fastapi/uvicorn stack) into .whl/
           (for a GPU machine without a package index: copy both folders there)
  build    GPU: build llama-bench (CUDA sm_90), build + calibrate the model, write its GGUF into --work
  bench    GPU: our systems in a child process (ceilings, profile, solve, our systems, llama-bench paired in rounds
           with that process stopped meanwhile), then each baseline standalone (llama-bench; accelerate in its own
           process), the paired and standalone runs side by side (fair.py says why)
  powerinfer  GPU, after bench: PowerInfer's CUDA main from its source tarball (--powerinfer-src) on the same
           model, budget and placement (bench_powerinfer.py), run alone
  report   anywhere: merge stage JSONs (--inputs) into bench/results/<date>-<machine kind>-pi-bench.{json,md}
  all      build, then bench, in one run
  memory   anywhere, no GPU needed: peak host RSS of every pipeline stage on random ReLU LLaMAs written for it (HF
           bf16 and Q4_0 GGUF) against the model file; its own flags: pi-bench --stage memory --help (bench/memory.py)
  parity   anywhere, CPU: the same GGUF in our runtime and llama.cpp (llama-cpp-python): ids, greedy tokens, logits,
           perplexity, decode time and peak RSS; its own flags: pi-bench --stage parity --help (bench/parity.py)
CPU smoke test: pi-bench --stage all --device cpu --shape tiny --layers 2 --ctx 64 --work /tmp/pib --out /tmp/pib/out
This module is the command line (parse, main); the stages live in bench_build.py (build), bench_stages.py (bench:
the child process, fairness, our systems through bench_pipeline.py and bench_systems.py), bench_powerinfer.py
(powerinfer), bench_llamacpp.py (prepare) and bench_report.py (report); bench_openmp.py sets OpenMP's wait policy.
"""

from __future__ import annotations

# first: bench_openmp sets OpenMP's wait policy at import, before torch loads
from bench.bench_openmp import OMP_WAIT_POLICY

# isort: split
import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench import ROOT, record
from bench import bench_llamacpp as lcpp
from bench import shapes as bm
from bench import systems as sy
from bench.bench_report import goals, markdown, write_results


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="pi-bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", choices=("prepare", "build", "bench", "powerinfer", "report", "all", "memory",
                                                 "parity"),
                    required=True, help="memory: bench/memory.py, with its own flags (pi-bench --stage memory --help)")
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "hotneurons" / "pi-bench",
                    help="local disk: build, GGUF, run dir")
    ap.add_argument("--out", type=Path, default=None, help="where the stage's JSON goes (on the device: $OUT)")
    ap.add_argument("--inputs", type=Path, nargs="*", default=[], help="report: stage JSON files or folders")
    ap.add_argument("--label", default=None, help="report: a suffix of the results file name (a second run that day)")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results", help="report: output folder")
    ap.add_argument("--machine-kind", default=None,
                    help="the results' machine kind, e.g. nvidia-h200 (default: from the GPU's name and count)")
    ap.add_argument("--commit", default=None,
                    help="the commit measured (wins over the checkout's .git, which a copied tree may hold stale)")
    ap.add_argument("--in-process", action="store_true",
                    help="bench: our systems and the baselines in this one process (tests, CPU smoke runs); paired "
                         "baselines then share the CPU with our threads: not a fair comparison")
    ap.add_argument("--part", choices=("ours", "accelerate"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--shape", default="llama-2-70b", choices=list(bm.SHAPES))
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-share", type=float, default=0.30, help="GPU budget as a share of the model's bytes")
    ap.add_argument("--ctx", type=int, default=512, help="KV cache the solver reserves and our systems hold (tokens)")
    ap.add_argument("--calibration-tokens", type=int, default=2048)
    ap.add_argument("--embed-std", type=float, default=bm.EMBED_STD,
                    help="token embeddings' std (0.02: the bench model before, whose statistics moved with position)")
    ap.add_argument("--profile-tokens", type=int, default=4096)
    ap.add_argument("--predictor-hidden", type=int, default=None,
                    help="default d_model/8 (1024 at d=8192); sets the gate rank")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens of the fast systems")
    ap.add_argument("--reps", type=int, default=7,
                    help="timed generations of each fast system (the median is reported)")
    ap.add_argument("--slow-tokens", type=int, default=8, help="decode tokens of layer-split, dense, accelerate")
    ap.add_argument("--llama-tokens", type=int, default=32)
    ap.add_argument("--llama-reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: all cores)")
    ap.add_argument("--systems", default=",".join(sy.DEFAULT), help=sy.help_text())
    ap.add_argument("--pcie-share", type=float, default=None,
                    help="the share of marked cold rows the GPU reads over PCIe, fixed for every hybrid system "
                         "(default: "
                         "measured, then balanced in decode; an A/B in rounds fixes it so that the balancing's spread "
                         "between two builds does not decide it)")
    ap.add_argument("--share-sweep", type=lambda v: [float(x) for x in v.split(",")], default=[],
                    help="comma list of PCIe shares: after hybrid's timed generations, the same runtime at the "
                         "balanced share and at each of these in rounds (bench_systems.share_sweep)")
    ap.add_argument("--interleave", action="store_true",
                    help="build the hybrid systems of --systems side by side and time them in rounds, one generation "
                         "of each a round (an A/B whose pairs share the machine's DRAM bandwidth of the moment); each "
                         "holds its cold rows in RAM at once: at the 70B shape two bf16 hybrids fit in 128 GiB, "
                         "three did not; "
                         "with llama.cpp in --systems and built, llama-bench -ngl at the budget "
                         "runs once after each round, "
                         "so that hybrid's ratio to it is paired too")
    ap.add_argument("--dram-bytes", type=int, default=2 * 2**30)
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--time-limit", type=float, default=540, help="seconds; later systems are skipped past it")
    ap.add_argument("--powerinfer-src", type=Path, default=None,
                    help="powerinfer stage: PowerInfer's source tarball (default: ../shared/vendor/PowerInfer-src.tgz)")
    ap.add_argument("--cpu-llamacpp", action="store_true", help="build a CPU llama-bench when --device cpu")
    ap.add_argument("--python-version", default=None,
                    help="prepare: the device's Python for the wheels (default: this one)")
    args = ap.parse_args(argv)
    bad = [v for v in args.share_sweep if not 0 <= v < 1]
    if bad:
        ap.error(f"--share-sweep {bad[0]:g}: give shares in [0, 1), e.g. 0.1,0.2,0.3")
    try:
        args.systems = sy.parse(args.systems)
    except ValueError as e:
        ap.error(f"--systems: {e}")
    args.ours_time_limit = args.time_limit
    args.predictor_hidden = args.predictor_hidden or max(16, bm.SHAPES[args.shape][0] // 8)
    args.gate_rank = max(1, (args.predictor_hidden - 2) // 2)  # the exact predictor's hidden size is 2 * rank + 2
    args.estimates = {n: s.estimate_s for n, s in sy.SYSTEMS.items()} | {"llama.cpp round": sy.LLAMA_ROUND_S}
    if args.device == "cpu" or args.shape == "tiny":
        args.estimates = {k: 1 for k in args.estimates}
    return args


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    memory = _memory_argv(argv)
    if memory is not None:  # its own click command: none of the flags below apply to it
        from bench.memory import main as memory_main

        return memory_main(args=memory, prog_name="pi-bench --stage memory", standalone_mode=False)
    parity = _memory_argv(argv, "parity")
    if parity is not None:  # its own argparse command too
        from bench.parity import main as parity_main

        return parity_main(parity, prog="pi-bench --stage parity")
    args = parse(argv)
    args.argv = [a for a in argv]  # what a child process of the bench stage runs again, with --part
    if args.stage == "prepare":
        info = lcpp.prepare(args.python_version)
        print(json.dumps(info, indent=1))
        return info
    if args.stage == "report":
        return write_results(args.inputs, args.results, kind=args.machine_kind, commit=args.commit, label=args.label)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: pass --device cpu for a smoke test")
    import numba

    args.work.mkdir(parents=True, exist_ok=True)
    out = args.out or args.work
    out.mkdir(parents=True, exist_ok=True)
    info = record.machine("numba", "transformers", "accelerate", "pulp", "highspy", "gguf")
    header = {"machine_info": info, "kind": args.machine_kind, "commit": args.commit or record.git_commit(),
              "command": record.command_line(argv), "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    common = {"numba_threads": numba.get_num_threads(), "omp_wait_policy": OMP_WAIT_POLICY,
              "args": {k: (sorted(v) if isinstance(v, set) else str(v)) for k, v in vars(args).items()}}
    done = {}
    if args.part:
        stages = [args.part]
    else:
        stages = ["build", "bench"] if args.stage == "all" else [args.stage]
    for stage in stages:
        t0 = time.perf_counter()
        path = out / f"pi_bench_{stage}.json"

        def save(res: dict, path: Path = path, t0: float = t0) -> dict:  # atomic: never a half-written file
            rec = record.make({**common, **res, "stage_seconds": time.perf_counter() - t0}, **header)
            record.write(path, rec)
            return rec

        args.save = save if stage in ("bench", "ours") else None
        from bench.bench_build import _free, stage_build  # torch: after the arguments are read
        from bench.bench_stages import stage_accelerate, stage_bench, stage_ours

        if stage == "build":
            res = stage_build(args, args.work)
        elif stage == "bench":
            res = stage_bench(args, args.work, out)
        elif stage == "ours":
            res = stage_ours(args, args.work)
        elif stage == "powerinfer":
            from bench.bench_powerinfer import stage_powerinfer

            res = stage_powerinfer(args, args.work)
        else:
            res = stage_accelerate(args, args.work)
        res.pop("partial", None)
        if stage == "bench":
            res["goals"] = goals({**res, **common})
        rec = save(res)
        print("wrote", path, flush=True)
        done[stage] = record.flat(rec)
        _free(args.device)
    if "bench" in done:
        print(markdown(done["bench"]))
    return done


def _memory_argv(argv: list[str], stage: str = "memory") -> list[str] | None:
    """The arguments other than `--stage STAGE` when that is the stage asked for, else None."""
    for i, a in enumerate(argv):
        if a == "--stage" and argv[i + 1:i + 2] == [stage]:
            return argv[:i] + argv[i + 2:]
        if a == f"--stage={stage}":
            return argv[:i] + argv[i + 1:]
    return None


def cli() -> None:
    """The pi-bench console script."""
    main()


if __name__ == "__main__":
    main()
