"""The PowerInfer `main` runner (export/roundtrip.powerinfer_tokens) without PowerInfer: its llama_print_timings
parsing on literal lines, and the whole runner against a stand-in `main` that writes the YAML log and the lines the
real one prints; bench_powerinfer.run_main's command (the timed one) through it."""

import stat
import sys
from pathlib import Path

import pytest
from hotneurons.export import roundtrip as rt

from bench.bench_powerinfer import PROMPT, run_main, thread_check

EVAL_LINE = ("llama_print_timings:        eval time =     204.54 ms /    15 runs   (   13.64 ms per token,    "
             "73.34 tokens per second)")
PROMPT_LINE = ("llama_print_timings: prompt eval time =      17.55 ms /     5 tokens (    3.51 ms per token,   "
               "284.82 tokens per second)")

# a stand-in for PowerInfer's main: writes LOGDIR/<timestamp>.yml as main.cpp does, prints a loader line and the
# timings (to stderr, as LOG_TEE does); FAIL in the environment makes it exit 1 without a log
FAKE = f"""#!{sys.executable}
import os, sys, time
a = sys.argv[1:]
if os.environ.get("FAIL"):
    sys.exit(1)
logdir = a[a.index("--logdir") + 1]
with open(logdir + time.strftime("%Y_%m_%d-%H_%M_%S") + f".{{time.time_ns() % 10**9:09d}}.yml", "w") as f:
    f.write("prompt_tokens: [1, 72, 101]\\noutput_tokens: [7, 8, 9]\\n")
print("llm_load_gpu_split: offloaded 0.00 MiB of FFN weights to GPU", file=sys.stderr)
print({EVAL_LINE!r}, file=sys.stderr)
print({PROMPT_LINE!r}, file=sys.stderr)
"""


@pytest.fixture
def fake_main(tmp_path) -> Path:
    p = tmp_path / "main"
    p.write_text(FAKE)
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return p


def test_timing_rates():
    r = rt.timing_rates(f"some line\n{PROMPT_LINE}\n{EVAL_LINE}\n")
    assert r["decode_ms_per_token"] == 13.64 and r["decode_runs"] == 15
    assert r["decode_tokens_per_s"] == pytest.approx(1e3 / 13.64)
    assert r["prefill_tokens_per_s"] == pytest.approx(5e3 / 17.55)
    assert rt.timing_rates(EVAL_LINE)["prefill_tokens_per_s"] is None
    assert rt.timing_rates(PROMPT_LINE) == {}  # "/ N tokens": the prompt line is never taken for the decode line


def test_runner(fake_main, tmp_path):
    gguf = tmp_path / "m.gguf"
    r = rt.powerinfer_tokens(fake_main, gguf, "Hello", 3, 2, logdir=tmp_path / "logs")
    assert r["returncode"] == 0 and "error" not in r
    assert r["prompt_ids"] == [1, 72, 101] and r["tokens"] == [7, 8, 9]
    assert r["decode_runs"] == 15 and r["prefill_tokens_per_s"] == pytest.approx(5e3 / 17.55)
    assert r["loader"] == ["llm_load_gpu_split: offloaded 0.00 MiB of FFN weights to GPU"] and len(r["timings"]) == 2
    cmd = r["command"].split()
    assert cmd[cmd.index("-t") + 1] == "2" and cmd[cmd.index("-c") + 1] == "256"
    assert cmd[cmd.index("--repeat-penalty") + 1] == "1.0"
    # a failed run writes no log: an error, not the previous run's tokens
    failed = rt.powerinfer_tokens(fake_main, gguf, "Hello", 3, 2, logdir=tmp_path / "logs", env={"FAIL": "1"})
    assert failed["returncode"] == 1 and "error" in failed and "tokens" not in failed


def test_run_main_command(fake_main, tmp_path):
    """The timed command: -c 512, --ignore-eos, --vram-budget, main's default repeat penalty; --logdir for the
    token ids."""
    r = run_main(fake_main, tmp_path / "m.gguf", 1.5, 16, 4)
    cmd = r["command"].split()
    assert cmd[cmd.index("-c") + 1] == "512" and cmd[cmd.index("--vram-budget") + 1] == "1.5000"
    assert "--ignore-eos" in cmd and "--repeat-penalty" not in cmd and cmd[cmd.index("-n") + 1] == "4"
    assert cmd[cmd.index("-p") + 1] == PROMPT and (tmp_path / "logs").is_dir()
    assert r["decode_tokens_per_s"] == pytest.approx(1e3 / 13.64) and r["tokens"] == [7, 8, 9]
    greedy = run_main(fake_main, tmp_path / "m.gguf", 1.5, 16, 4, greedy=True)["command"].split()
    assert greedy[greedy.index("--repeat-penalty") + 1] == "1.0"


def test_thread_check(fake_main, tmp_path):
    c = thread_check(fake_main, tmp_path / "m.gguf", 1.5, 16, tmp_path / "check")
    assert [r["threads"] for r in c["runs"]] == [2, 2, 16, 16]
    assert [r["matched_first_2_thread_run"] for r in c["runs"]] == [3] * 4 and c["runs"][0]["tokens"] == [7, 8, 9]


def test_repeated_runs(fake_main, tmp_path):
    rows = rt.repeated_runs(fake_main, tmp_path / "m.gguf", "Hello", 3, 2, 3, tmp_path / "rep", [7, 8, 5])
    assert [r["matched"] for r in rows] == [2, 2, 2] and all(r["tokens"] == [7, 8, 9] for r in rows)
    assert sorted(d.name for d in (tmp_path / "rep").iterdir()) == ["0", "1", "2"]
