"""Every pi-* command as a user runs it (a subprocess): bad inputs give one error line and exit code 1 or 2 before any
model loads, leaving the run directory as it was; --json prints only JSON on stdout (C code included); Ctrl-C at any
phase of pi-profile leaves a checkpoint that --resume continues, or nothing in the way of a plain run.

Exit codes (common/cli.py): 2 for a malformed command line (click's usage errors), 1 for a value naming something
unusable, 130 for an interrupt."""

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from hotneurons.artifacts.profile import read_profile
from hotneurons.common import artifacts
from hotneurons.predictors.train import preset, train_predictors
from hotneurons.profiler import profile as profile_mod
from hotneurons.profiler.cli import main as profile_cli
from hotneurons.profiler.profile import ProfileConfig, profile_model

BIN = Path(sys.executable).parent
HUB_MISS = "not found locally and the hub is unreachable"


def pi(tool: str, *args, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([str(BIN / tool), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=env, **kw)


def error_lines(stderr: str) -> list[str]:
    """stderr less click's usage banner ("Usage: ...", "Try '... -h' for help.") and blank lines."""
    return [ln for ln in stderr.splitlines()
            if ln.strip() and not ln.startswith(("Usage: ", "Try ")) and "for help." not in ln]


def tree(path: Path) -> dict[str, str]:
    """Every file under `path` (hidden ones included) -> sha256 of its bytes."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def assert_refused(r: subprocess.CompletedProcess, code: int, needle: str) -> str:
    lines = error_lines(r.stderr)
    assert r.returncode == code, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    assert needle in lines[0], lines[0]
    assert r.stdout == "", r.stdout
    return lines[0]


# ---------------------------------------------------------------------------------------------------------------
# Fixtures: a real tiny run (profile with samples, predictors), copied per test and broken by hand


@pytest.fixture(scope="module")
def tiny_run(tiny_model_dir, text_corpus, tmp_path_factory):
    run = tmp_path_factory.mktemp("clirun") / "run"
    cfg = ProfileConfig(model=str(tiny_model_dir("llama-reglu")), dataset=str(text_corpus), tokens=600, seq_len=32,
                        batch_size=4, samples_per_layer=200, dtype="float32")
    profile_model(cfg, run, device="cpu", progress=False)
    train_predictors(run, preset("fast", magnitude_weight=0), device="cpu", progress=False)
    return run


@pytest.fixture
def run(tiny_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(tiny_run, dst)
    return dst


def refused_untouched(run: Path, tool: str, args: list, code: int, needle: str) -> str:
    before = tree(run)
    line = assert_refused(pi(tool, *args), code, needle)
    assert tree(run) == before  # nothing written or damaged
    return line


# ---------------------------------------------------------------------------------------------------------------
# Models


def test_profile_unreachable_hub_id(text_corpus, tmp_path):
    line = assert_refused(pi("pi-profile", "--model", "no-such-org/no-such-model", "--dataset", text_corpus,
                             "--out", tmp_path / "r"), 1, HUB_MISS)
    assert "no-such-org/no-such-model" in line and "--model" in line
    assert not (tmp_path / "r").exists()


def test_generate_unreachable_hub_id():
    assert_refused(pi("pi-generate", "--model", "no-such-org/no-such-model", "--prompt", "hi", "-n", 2), 1, HUB_MISS)


def test_profile_missing_model_folder(text_corpus, tmp_path):
    line = assert_refused(pi("pi-profile", "--model", "./nope/", "--dataset", text_corpus, "--out", tmp_path / "r",
                             cwd=tmp_path), 1, "model folder './nope/' does not exist")
    assert "Repo id" not in line


# ---------------------------------------------------------------------------------------------------------------
# Corpora


@pytest.mark.parametrize("content,needle", [("", "holds no text"), ("  \n\t \n\n   ", "holds no text")])
def test_profile_empty_or_whitespace_corpus(tiny_model_dir, tmp_path, content, needle):
    corpus = tmp_path / "blank.txt"
    corpus.write_text(content)
    assert_refused(pi("pi-profile", "--model", tiny_model_dir("llama-reglu"), "--dataset", corpus,
                      "--out", tmp_path / "r"), 1, needle)
    assert not (tmp_path / "r").exists()


def test_profile_missing_dataset_path(tiny_model_dir, tmp_path):
    line = assert_refused(pi("pi-profile", "--model", tiny_model_dir("llama-reglu"), "--dataset",
                             tmp_path / "no" / "docs.jsonl", "--out", tmp_path / "r"), 1, "does not exist")
    assert "unknown dataset" not in line and "--dataset" in line


def test_eval_missing_dataset_path(run, tmp_path):
    refused_untouched(run, "pi-eval", ["--run", run, "--dataset", tmp_path / "missing.jsonl"], 1, "does not exist")


# ---------------------------------------------------------------------------------------------------------------
# Broken artifacts


@pytest.mark.parametrize("damage", ["empty", "random", "truncated"])
def test_solve_broken_profile_table(run, damage):
    table = run / "profile" / "neurons.parquet"
    data = table.read_bytes()
    table.write_bytes({"empty": b"", "random": os.urandom(4096), "truncated": data[: len(data) // 2]}[damage])
    line = refused_untouched(run, "pi-solve", ["--run", run, "--json"], 1, "is not a readable parquet table")
    assert "neurons.parquet" in line and "pi-profile" in line


def test_generate_empty_predictors(run):
    (run / "predictors" / "predictors.safetensors").write_bytes(b"")
    line = refused_untouched(run, "pi-generate", ["--run", run, "--prompt", "hi", "-n", 2, "--device", "cpu"], 1,
                             "is not a readable safetensors file")
    assert "predictors.safetensors" in line and "pi-train-predictors" in line


@pytest.mark.parametrize("damage,needle", [("empty", "layer_001.x.npy is empty"),
                                           ("truncated", "layer_001.x.npy is truncated")])
def test_train_predictors_broken_samples(run, damage, needle):
    f = run / "profile" / "samples" / "layer_001.x.npy"
    data = f.read_bytes()
    f.write_bytes(b"" if damage == "empty" else data[: len(data) // 2])
    line = refused_untouched(run, "pi-train-predictors", ["--run", run, "--force", "--preset", "plain"], 1, needle)
    assert "pi-profile" in line and "Aborted" not in line


# ---------------------------------------------------------------------------------------------------------------
# Flags, ports


@pytest.mark.parametrize("n", ["0", "-5"])
def test_generate_bad_token_count(run, n):
    line = refused_untouched(run, "pi-generate", ["--run", run, "--prompt", "hi", "-n", n], 2, "-n")
    assert n in line


def test_serve_port_in_use(run):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        t0 = time.perf_counter()
        line = refused_untouched(run, "pi-serve", ["--run", run, "--port", port, "--device", "cpu"], 1, "in use")
        assert str(port) in line and time.perf_counter() - t0 < 20


# ---------------------------------------------------------------------------------------------------------------
# --json: only JSON on stdout


@pytest.mark.parametrize("extra", [[], ["--measure"]])
def test_solve_json_stdout_is_json(run, extra):
    r = pi("pi-solve", "--run", run, "--json", "--ctx", 16, *extra)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["model"]
    assert "HiGHS" in r.stderr or "HiGHS" not in r.stdout  # the banner, where printed, is on stderr


@pytest.mark.slow
def test_every_json_flag_prints_only_json(run, tiny_model_dir, text_corpus, tmp_path):
    model = tiny_model_dir("llama-reglu")
    r = pi("pi-profile", "--model", model, "--dataset", text_corpus, "--tokens", 300, "--seq-len", 32,
           "--samples-per-layer", 200, "--out", tmp_path / "p", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stage"] == "profile"
    r = pi("pi-train-predictors", "--run", run, "--force", "--preset", "plain", "--json", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["layers"]
    r = pi("pi-solve", "--run", run, "--ctx", 16, "--json")
    assert r.returncode == 0, r.stderr
    r = pi("pi-eval", "--run", run, "--dataset", text_corpus, "--tokens", 200, "--seq-len", 32, "--json",
           "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["modes"]
    r = pi("pi-generate", "--run", run, "--prompt", "The quick", "-n", 4, "--json", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["token_ids"]) == 4


# ---------------------------------------------------------------------------------------------------------------
# Ctrl-C in pi-profile, phase by phase (in-process: a KeyboardInterrupt raised inside the phase)


def profile_args(model, corpus, out, *extra):
    return ["--model", str(model), "--dataset", str(corpus), "--tokens", "600", "--seq-len", "32", "--batch-size",
            "2", "--samples-per-layer", "50", "--calibration-tokens", "64", "--checkpoint-every", "1",
            "--out", str(out), "--quiet", "--device", "cpu", *extra]


def raise_on_call(n):
    """A function that raises KeyboardInterrupt on its n-th call and calls `real` otherwise."""
    def wrap(real):
        calls = [0]

        def f(*a, **kw):
            calls[0] += 1
            if calls[0] == n:
                raise KeyboardInterrupt
            return real(*a, **kw)
        return f
    return wrap


def interrupted_line(res) -> str:
    assert res.exit_code == 130, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert lines[-1].startswith("interrupted: ") and "Traceback" not in res.output, res.output
    return lines[-1]


def assert_plain_run_works(args):
    res = CliRunner().invoke(profile_cli, args)
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("phase,family,target,n", [
    ("loading", "llama-reglu", "open_streamed", 1),  # a local folder runs layer by layer
    ("calibration", "llama-swiglu", "calibrate_taus", 1),
    ("counting before the first checkpoint", "llama-reglu", "forward", 1),
])
def test_interrupt_before_a_checkpoint_leaves_nothing(tiny_model_dir, text_corpus, tmp_path, monkeypatch, phase,
                                                      family, target, n):
    args = profile_args(tiny_model_dir(family), text_corpus, tmp_path / "r")
    if target == "forward":
        args[args.index("--checkpoint-every") + 1] = "50"
    monkeypatch.setattr(profile_mod, target, raise_on_call(n)(getattr(profile_mod, target)))
    line = interrupted_line(CliRunner().invoke(profile_cli, args))
    assert "nothing was kept" in line and "run the same command again" in line, (phase, line)
    assert not (tmp_path / "r" / ".profile.partial").exists() and not (tmp_path / "r" / "profile").exists()
    monkeypatch.undo()
    assert_plain_run_works(args)
    res = CliRunner().invoke(profile_cli, [*args, "--resume"])  # nothing to resume: says so in one line
    assert res.exit_code == 1 and "no interrupted profile" in res.output


@pytest.mark.parametrize("phase,target,n", [("counting", "forward", 3), ("writing", "_finalize", 1)])
def test_interrupt_after_a_checkpoint_resumes(tiny_model_dir, text_corpus, tmp_path, monkeypatch, phase, target, n):
    args = profile_args(tiny_model_dir("llama-swiglu"), text_corpus, tmp_path / "r")
    full = profile_args(tiny_model_dir("llama-swiglu"), text_corpus, tmp_path / "full")
    assert_plain_run_works(full)
    monkeypatch.setattr(profile_mod, target, raise_on_call(n)(getattr(profile_mod, target)))
    line = interrupted_line(CliRunner().invoke(profile_cli, args))
    partial = tmp_path / "r" / ".profile.partial"
    assert "continue with --resume" in line and str(partial) in line, (phase, line)
    assert (partial / "state.json").exists() and not (tmp_path / "r" / "profile").exists()
    monkeypatch.undo()
    res = CliRunner().invoke(profile_cli, args)  # a plain run does not silently drop the checkpoint
    assert res.exit_code == 1 and "--resume" in res.output and len(res.output.strip().splitlines()) == 1
    assert_plain_run_works([*args, "--resume"])
    a = read_profile(tmp_path / "full")[0]
    b = read_profile(tmp_path / "r")[0]
    assert a.equals(b) and not partial.exists()


def _default_sigint() -> None:
    """In a child before exec: SIGINT back to its default, which Python then turns into KeyboardInterrupt. A shell
    that starts jobs in the background (`make test &`, nohup) starts them with SIGINT ignored, and a child inherits
    that: the tests would test the shell, not the product."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_sigint_while_writing_waits_for_the_write(tiny_model_dir, text_corpus, tmp_path, monkeypatch):
    """A real SIGINT during the final write: the profile is completed and swapped in first."""
    real = artifacts.write_parquet
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as Python installs it (_default_sigint)

    def signalled(*a, **kw):
        os.kill(os.getpid(), signal.SIGINT)
        return real(*a, **kw)

    monkeypatch.setattr(artifacts, "write_parquet", signalled)
    try:
        line = interrupted_line(CliRunner().invoke(profile_cli, profile_args(tiny_model_dir("llama-reglu"),
                                                                             text_corpus, tmp_path / "r")))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "complete" in line
    assert (tmp_path / "r" / "profile" / "meta.json").exists() and not (tmp_path / "r" / ".profile.partial").exists()


def test_partial_folder_without_checkpoint_does_not_block(tiny_model_dir, text_corpus, tmp_path):
    """An empty .profile.partial (what an interrupt before the first checkpoint used to leave)."""
    (tmp_path / "r" / ".profile.partial").mkdir(parents=True)
    assert_plain_run_works(profile_args(tiny_model_dir("llama-reglu"), text_corpus, tmp_path / "r"))


# ---------------------------------------------------------------------------------------------------------------
# Ctrl-C as a real signal to the process, after its progress line


def sigint_after(marker: str, args: list, wait: float = 0.0, timeout: float = 60) -> tuple[int, str]:
    p = subprocess.Popen([str(BIN / "pi-profile"), *map(str, args)], stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, preexec_fn=_default_sigint)
    buf = bytearray()
    seen = threading.Event()

    def read():
        while chunk := os.read(p.stderr.fileno(), 4096):
            buf.extend(chunk)
            if marker.encode() in buf:
                seen.set()
    t = threading.Thread(target=read, daemon=True)
    t.start()
    assert seen.wait(timeout), bytes(buf).decode(errors="replace")
    time.sleep(wait)
    p.send_signal(signal.SIGINT)
    p.wait(timeout)
    t.join(10)
    return p.returncode, bytes(buf).decode(errors="replace")


@pytest.mark.slow
@pytest.mark.parametrize("marker,wait", [("loading", 0), ("calibrating", 0), ("profiling", 0), ("profiling", 0.5)])
def test_real_sigint_leaves_a_resumable_checkpoint_or_nothing(tiny_model_dir, tmp_path, marker, wait):
    """The phase a real signal lands in depends on timing; what it leaves must hold whatever it was."""
    corpus = tmp_path / "big.jsonl"
    with open(corpus, "w") as f:
        for i in range(400):
            f.write(json.dumps({"text": f"Document {i}. " + "Sparse activations make models fast. " * 60}) + "\n")
    out = tmp_path / "r"
    args = ["--model", tiny_model_dir("llama-swiglu"), "--dataset", corpus, "--tokens", 100_000, "--seq-len", 64,
            "--calibration-tokens", 200_000, "--checkpoint-every", 2, "--samples-per-layer", 100, "--out", out,
            "--device", "cpu"]
    if marker == "profiling":
        args[args.index("--calibration-tokens") + 1] = 256
    if wait:  # one row a batch, short rows: slow enough that the signal lands after a checkpoint, before the end
        args += ["--batch-size", 1]
        args[args.index("--seq-len") + 1] = 16
        args[args.index("--tokens") + 1] = 30_000
    rc, err = sigint_after(marker, args, wait)
    last = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip()][-1]
    assert rc == 130 and last.startswith("interrupted: ") and "Traceback" not in err, err[-2000:]
    if "continue with --resume" in last:
        assert (out / ".profile.partial" / "state.json").exists()
        r = pi("pi-profile", *args, "--resume", "--quiet")
    elif "complete" in last:
        assert (out / "profile" / "meta.json").exists()
        return
    else:
        assert "nothing was kept" in last and not (out / ".profile.partial").exists()
        r = pi("pi-profile", *args, "--quiet")
    assert r.returncode == 0, r.stderr
    assert (out / "profile" / "meta.json").exists() and not (out / ".profile.partial").exists()


def test_solve_says_when_it_replaces_a_placement(run):
    """Re-solving a run (another budget, a new profile) replaces its placement in place, and says so on stderr."""
    copy = run  # a copy of its own
    shutil.rmtree(copy / "placement", ignore_errors=True)
    first = pi("pi-solve", "--run", copy, "--json", "--ctx", 16, "--vram", "2GB")
    assert first.returncode == 0 and "replaced" not in first.stderr, first.stderr
    again = pi("pi-solve", "--run", copy, "--json", "--ctx", 16, "--vram", "3GB")
    assert again.returncode == 0 and json.loads(again.stdout)["budget"]["vram_bytes"] == 3 * 10**9
    assert f"replaced the placement in {copy / 'placement'} (solved before for 2.00 GB" in again.stderr


def test_profile_of_few_tokens_warns(tiny_model_dir, text_corpus, tmp_path):
    """A profile of fewer tokens than MIN_USEFUL_TOKENS is written, with one warning line that names --tokens."""
    from hotneurons.profiler.cli import MIN_USEFUL_TOKENS

    r = pi("pi-profile", "--model", tiny_model_dir("llama-reglu"), "--dataset", text_corpus, "--tokens", 64,
           "--seq-len", 32, "--samples-per-layer", 0, "--out", tmp_path / "r", "--quiet")
    assert r.returncode == 0, r.stderr
    warn = [ln for ln in r.stderr.splitlines() if ln.startswith("warning: only")]
    assert len(warn) == 1 and "--tokens" in warn[0] and f"{MIN_USEFUL_TOKENS:,}" in warn[0]
    assert (tmp_path / "r" / "profile" / "meta.json").exists()
