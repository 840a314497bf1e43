"""What a first run of the pi-* commands meets: artifacts of another model left in a run folder, a stage run again
over its own output, Ctrl-C in a command's first seconds, a generation longer than the context, the decode rate's
warm-up, the server's offline pages, and predictors trained on too little. Each as a user runs it (a subprocess,
or click's runner where a fault must be injected)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
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
