"""What a first run of the pi-* commands meets: artifacts of another model left in a run folder, a stage run again
over its own output, Ctrl-C in a command's first seconds, a generation longer than the context, the decode rate's
warm-up, the server's offline pages, and predictors trained on too little. Each as a user runs it (a subprocess,
or click's runner where a fault must be injected)."""

import json
import os
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from click.testing import CliRunner
from hotneurons.predictors.train import preset, train_predictors
from hotneurons.profiler.profile import ProfileConfig, profile_model

BIN = Path(sys.executable).parent


def pi(tool: str, *args, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([str(BIN / tool), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=env, **kw)


def one_error(r: subprocess.CompletedProcess, code: int = 1) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == code and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    return lines[0]


def make_run(model: Path, corpus: Path, run: Path, tokens: int = 600) -> Path:
    cfg = ProfileConfig(model=str(model), dataset=str(corpus), tokens=tokens, seq_len=32, batch_size=4,
                        samples_per_layer=200, dtype="float32")
    profile_model(cfg, run, device="cpu", progress=False)
    train_predictors(run, preset("fast", magnitude_weight=0), device="cpu", progress=False)
    return run


@pytest.fixture(scope="module")
def runs(tiny_model_dir, text_corpus, tmp_path_factory):
    """Two real tiny runs of two models: llama-reglu and llama-swiglu (same shapes, other weights)."""
    root = tmp_path_factory.mktemp("stages")
    return {name: make_run(tiny_model_dir(name), text_corpus, root / name) for name in ("llama-reglu", "llama-swiglu")}


@pytest.fixture
def run(runs, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(runs["llama-reglu"], dst)
    return dst


# ---------------------------------------------------------------------------------------------------------------
# pi-solve: predictors of another model left in the run


def test_solve_refuses_another_models_predictors(run, runs):
    shutil.rmtree(run / "predictors")
    shutil.copytree(runs["llama-swiglu"] / "predictors", run / "predictors")
    line = one_error(pi("pi-solve", "--run", run, "--ctx", 16, "--json"))
    assert "another model" in line and "llama-swiglu" in line and "llama-reglu" in line, line
    assert "pi-train-predictors" in line and "--force" in line and str(run / "predictors") in line, line
    before = sorted(p.name for p in run.iterdir())
    # a shape that differs is named too
    meta = json.loads((run / "predictors" / "meta.json").read_text())
    meta["model"]["n_layers"] = 5
    (run / "predictors" / "meta.json").write_text(json.dumps(meta))
    assert "layers 5, the profile's 2" in one_error(pi("pi-solve", "--run", run, "--ctx", 16))
    assert sorted(p.name for p in run.iterdir()) == before  # nothing solved or written
    shutil.rmtree(run / "predictors")  # the fix the line gives: the estimate is used again
    r = pi("pi-solve", "--run", run, "--ctx", 16, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["memory"]["predictors_source"].startswith("estimate"), r.stderr


def test_solve_takes_its_own_models_predictors(run):
    r = pi("pi-solve", "--run", run, "--ctx", 16, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["memory"]["predictors_source"].startswith("measured from"), r.stdout


# ---------------------------------------------------------------------------------------------------------------
# pi-profile over a run that already has a profile


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_profile_refuses_to_replace_a_profile_without_force(run, tiny_model_dir, text_corpus):
    args = ["--model", tiny_model_dir("llama-reglu"), "--dataset", text_corpus, "--tokens", 200, "--seq-len", 32,
            "--samples-per-layer", 20, "--out", run, "--quiet", "--device", "cpu"]
    before = tree(run)
    line = one_error(pi("pi-profile", *args))
    assert str(run / "profile") in line and "--force" in line, line
    assert tree(run) == before  # nothing replaced
    r = pi("pi-profile", *args, "--force")
    assert r.returncode == 0, r.stderr
    assert json.loads((run / "profile" / "meta.json").read_text())["tokens"] == 200


# ---------------------------------------------------------------------------------------------------------------
# Ctrl-C in a command's first seconds (in-process: a KeyboardInterrupt raised where the signal would land)


class Interrupting(types.ModuleType):
    """A module whose import, as `from M import x` reads it, is interrupted: Ctrl-C while torch & co. import."""

    def __getattr__(self, name):
        raise KeyboardInterrupt


def interrupted_line(res) -> str:
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 130 and "Aborted" not in res.output and "Traceback" not in res.output, res.output
    assert lines[-1].startswith("interrupted: "), res.output
    return lines[-1]


@pytest.mark.parametrize("tool,module", [
    ("pi-profile", "hotneurons.profiler.profile"),
    ("pi-solve", "hotneurons.solver.place"),
    ("pi-train-predictors", "hotneurons.predictors.train"),
    ("pi-eval", "hotneurons.common.gating"),
    ("pi-generate", "hotneurons.runtime.sampling"),
])
def test_interrupt_while_importing_exits_130(run, tiny_model_dir, text_corpus, tmp_path, monkeypatch, tool, module):
    from hotneurons.predictors.cli import eval_main, train_main
    from hotneurons.profiler.cli import main as profile_main
    from hotneurons.runtime.cli import main as generate_main
    from hotneurons.solver.cli import main as solve_main

    main, args = {
        "pi-profile": (profile_main, ["--model", tiny_model_dir("llama-reglu"), "--dataset", text_corpus,
                                      "--out", tmp_path / "new" / "r"]),
        "pi-solve": (solve_main, ["--run", run, "--ctx", 16]),
        "pi-train-predictors": (train_main, ["--run", run, "--force"]),
        "pi-eval": (eval_main, ["--run", run, "--criterion", "gate"]),
        "pi-generate": (generate_main, ["--run", run, "--prompt", "hi", "-n", 2]),
    }[tool]
    before = tree(run)
    package, _, name = module.rpartition(".")
    fake = Interrupting(module)
    monkeypatch.setitem(sys.modules, module, fake)
    monkeypatch.setattr(sys.modules[package], name, fake, raising=False)
    line = interrupted_line(CliRunner().invoke(main, [str(a) for a in args]))
    assert "nothing was written" in line and "run the same command again" in line, line
    assert tree(run) == before and not (tmp_path / "new").exists()


def test_interrupt_while_serve_loads_exits_130(run, monkeypatch):
    from hotneurons.server import cli as serve_cli

    monkeypatch.setattr(serve_cli, "open_runtime", lambda req: (_ for _ in ()).throw(KeyboardInterrupt))
    line = interrupted_line(CliRunner().invoke(serve_cli.main, ["--run", str(run), "--port", "0"]))
    assert "pi-serve stopped" in line or "stopped before" in line, line


def profile_until_interrupted(model, corpus, out, monkeypatch):
    """pi-profile into `out`, interrupted at its first forward pass (before the first checkpoint)."""
    from hotneurons.profiler import profile as profile_mod
    from hotneurons.profiler.cli import main as profile_main

    real = profile_mod.forward

    def forward(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(profile_mod, "forward", forward)
    try:
        return interrupted_line(CliRunner().invoke(profile_main, [
            "--model", str(model), "--dataset", str(corpus), "--tokens", "200", "--seq-len", "32",
            "--samples-per-layer", "20", "--out", str(out), "--quiet", "--device", "cpu"]))
    finally:
        monkeypatch.setattr(profile_mod, "forward", real)


def test_interrupt_removes_the_empty_run_folder_it_made(tiny_model_dir, text_corpus, tmp_path, monkeypatch):
    model = tiny_model_dir("llama-reglu")
    line = profile_until_interrupted(model, text_corpus, tmp_path / "runs" / "a" / "r", monkeypatch)
    assert "nothing was kept" in line and not (tmp_path / "runs").exists(), line  # all it made, parents too
    (tmp_path / "mine").mkdir()  # an empty folder of the user's: kept
    profile_until_interrupted(model, text_corpus, tmp_path / "mine", monkeypatch)
    assert (tmp_path / "mine").is_dir() and not list((tmp_path / "mine").iterdir())
    (tmp_path / "runs").mkdir()  # an existing parent: kept, its new child goes
    profile_until_interrupted(model, text_corpus, tmp_path / "runs" / "r", monkeypatch)
    assert (tmp_path / "runs").is_dir() and not (tmp_path / "runs" / "r").exists()


# ---------------------------------------------------------------------------------------------------------------
# pi-generate -n past the context


def test_generate_refuses_n_past_the_context(run):
    args = ["--run", run, "--prompt", "hi", "--device", "cpu", "--mode", "dense", "--json"]
    line = one_error(pi("pi-generate", *args, "-n", 100_000))
    # the tiny models' context: 256 positions; "hi" is 2 byte tokens
    assert "the prompt's 2 tokens and -n 100,000 make 100,002, past the model's context of 256 tokens" in line, line
    assert "pass -n 254 or less" in line and "--ctx 100002" in line, line
    r = pi("pi-generate", *args, "-n", 254, "--temperature", 1, "--seed", 3)
    assert r.returncode == 0, r.stderr
    assert 1 <= len(json.loads(r.stdout)["token_ids"]) <= 254


# ---------------------------------------------------------------------------------------------------------------
# pi-generate's decode rate: the steady state's


def test_decode_rate_leaves_the_first_step_out(run, monkeypatch):
    """The first decode step stalls a second (as a first run compiles the cold kernels there): the rate printed is
    the later steps', and the line says what was left out."""
    from hotneurons.runtime import generate as gen
    from hotneurons.runtime.cli import main as generate_main

    real, calls = gen.tune_mapped_rows, [0]

    def stalled(*a, **kw):  # runs at the end of each decode step
        calls[0] += 1
        if calls[0] == 1:
            time.sleep(1.0)
        return real(*a, **kw)

    monkeypatch.setattr(gen, "tune_mapped_rows", stalled)
    args = ["--run", str(run), "--mode", "dense", "--device", "cpu", "--prompt", "The quick", "-n", "12",
            "--temperature", "1", "--seed", "1"]
    res = CliRunner().invoke(generate_main, [*args, "--json"])
    assert res.exit_code == 0, res.output
    s = json.loads(res.output.strip().splitlines()[-1])["stats"]
    assert calls[0] >= 3 and s["decode_steps"] == calls[0] and s["decode_warmup_steps"] == 1, s
    assert s["decode_warmup_s"] >= 1.0
    # the stall counted would hold the rate under (steps) / 1 s; the steps after it take milliseconds
    assert s["decode_tokens_per_s"] > 2 * s["decode_steps"], s
    calls[0] = 0
    res = CliRunner().invoke(generate_main, args)
    assert res.exit_code == 0 and "tok/s (a first step of 1." in res.output and "s left out)" in res.output, res.output


def test_serve_help_names_the_openapi_document():
    r = pi("pi-serve", "--help")
    assert r.returncode == 0 and "/openapi.json" in r.stdout and "offline" in r.stdout, r.stdout


# ---------------------------------------------------------------------------------------------------------------
# pi-eval on a mixture of experts


def test_eval_on_a_mixture_of_experts_says_what_runs(tiny_model_dir, text_corpus, tmp_path):
    r = pi("pi-profile", "--model", tiny_model_dir("mixtral"), "--dataset", text_corpus, "--tokens", 200,
           "--seq-len", 32, "--out", tmp_path / "moe", "--quiet", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    r = pi("pi-eval", "--run", tmp_path / "moe", "--mode", "dense", "--dataset", text_corpus, "--device", "cpu",
           "--tokens", 200, "--seq-len", 32, "--quiet", "--json")
    assert r.returncode == 0, r.stderr
    assert list(json.loads(r.stdout)["modes"]) == ["dense"]  # its perplexity: tests/test_eval_moe.py
    line = one_error(pi("pi-eval", "--run", tmp_path / "moe", "--mode", "oracle", "--dataset", text_corpus,
                        "--device", "cpu"))
    assert "mixture of experts: pi-eval runs it dense only" in line and "--mode dense" in line, line
    assert f"pi-solve --run {tmp_path / 'moe'}" in line and "pi-generate" in line and "only the decoder" not in line


# ---------------------------------------------------------------------------------------------------------------
# pi-train-predictors on too small a profile


def test_train_warns_on_a_small_profile(run):
    r = pi("pi-train-predictors", "--run", run, "--force", "--preset", "plain", "--device", "cpu", "--quiet")
    assert r.returncode == 0, r.stderr
    warn = [ln for ln in r.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warn) == 1 and "the profile holds 200 samples a layer, fewer than the 4,096" in warn[0], r.stderr
    assert "pi-profile with more --tokens" in warn[0] and "--force" in warn[0], warn[0]


def test_training_warning_rules(run):
    """On the run's real summary: quiet when every layer meets the target with enough samples; one line naming the
    worst layer and --preset when a layer's held-out recall is more than 5 points under the target."""
    import dataclasses

    from hotneurons.artifacts.predictors import PredictorsSummary
    from hotneurons.predictors.train import MIN_SAMPLES, training_warning

    s = PredictorsSummary.load(run / "predictors" / "summary.json")
    target = s.config["target_recall"]
    good = dataclasses.replace(s, samples_per_layer=MIN_SAMPLES,
                               layers=[dataclasses.replace(r, recall=target - 0.04) for r in s.layers])
    assert training_warning(good) is None
    low = dataclasses.replace(good, layers=[dataclasses.replace(r, recall=0.8 if r.layer == 1 else r.recall)
                                            for r in good.layers])
    line = training_warning(low)
    assert line.startswith("warning: 1 of 2 layers catch under") and "(layer 1: 0.800, target 0.95)" in line, line
    assert "--preset thorough" in line and "samples a layer" not in line and "\n" not in line, line


def test_q8_0_predictors_from_solve_to_generate(run):
    """pi-solve --predictor-dtype q8_0 counts 17/32 of the predictors' fp16 bytes and records it; pi-generate then
    makes Q8_0 predictors by default (the placement's storage: fewer bytes on the device than auto's placement gives)
    and the same tokens as with --predictor-dtype q8_0 said."""
    base = ["--run", run, "--ctx", 64, "--json"]
    gen = ["--run", run, "--prompt", "The quick", "-n", 8, "--device", "cpu", "--json", "--temperature", 0]

    def solve(*extra) -> dict:
        r = pi("pi-solve", *base, *extra)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def generate(*extra) -> dict:
        r = pi("pi-generate", *gen, *extra)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    auto = solve()
    as_trained = generate()
    q = solve("--predictor-dtype", "q8_0")
    assert q["memory"]["gpu"]["predictors"] == auto["memory"]["gpu"]["predictors"] * 17 // 32
    assert q["flags"]["predictor_dtype"] == "q8_0" and "Q8_0" in q["memory"]["predictors_source"]
    by_placement, said = generate(), generate("--predictor-dtype", "q8_0")
    assert by_placement["token_ids"] == said["token_ids"]
    assert by_placement["stats"]["bytes_gpu"] == said["stats"]["bytes_gpu"] < as_trained["stats"]["bytes_gpu"]
