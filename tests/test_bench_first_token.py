"""bench/first_token.py's pieces: the timing of one process, the results' markdown, and the phases' child
(bench/first_token_phases.py) on the small Q4_0 model."""

import json
import os
import subprocess
import sys
from pathlib import Path

from bench import first_token as ft


def test_timed_takes_the_first_byte_and_the_exit():
    code = "import sys, time; sys.stdout.write('t1'); sys.stdout.flush(); time.sleep(0.5)"
    row = ft.timed([sys.executable, "-c", code], {}, timeout=60)
    assert row["text"] == "t1" and row["returncode"] == 0 and "error" not in row
    assert row["first_token_s"] < row["exit_s"] - 0.3


def test_timed_a_token_without_text_and_a_failure():
    row = ft.timed([sys.executable, "-c", "pass"], {}, timeout=60)
    assert row["no_text"] and "error" not in row and row["first_token_s"] <= row["exit_s"]
    row = ft.timed([sys.executable, "-c", "import sys; sys.exit('boom')"], {}, timeout=60)
    assert row["returncode"] == 1 and "boom" in row["error"]


def test_commands_are_the_same_run_for_both_tools():
    llama = ft.commands("llama.cpp", "/x/llama-completion", "m.gguf", "cpu", 4)
    ours = ft.commands("ours", "", "m.gguf", "cuda", 4)
    assert llama[llama.index("-ngl") + 1] == "0" and ft.PROMPT in llama and "-n" in llama
    assert ours[ours.index("--device") + 1] == "cuda" and ours[ours.index("--mode") + 1] == "dense"
    assert ft.environment("cpu")["CUDA_VISIBLE_DEVICES"] == ""  # a CUDA build of llama.cpp sees no GPU either
    assert ft.environment("cuda").get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")


def test_markdown_of_a_record():
    run = {"first_token_s": 1.0, "exit_s": 1.1}
    side = lambda s: {"median_first_token_s": s, "median_exit_s": s + 0.1, "first_run": run}  # noqa: E731
    rec = {"created": "2026-11-26T00:00:00", "machine_kind": "cpu", "commit": "abc", "machine": {"nproc": 2},
           "figures": {"reps": 3, "threads": 2, "build": {"cuda": False}, "notes": ["a note"], "rows": [
               {"model": "1.7GB", "mode": "cpu", "file_bytes": 470934048, "llama.cpp": side(0.5), "ours": side(2.0),
                "same_first_token": False},
               {"model": "3.1GB", "mode": "cpu", "file_bytes": 0, "skipped": "over --budget-s 450"}]}}
    md = ft.markdown(rec)
    assert "| 1.7GB, 0.47 GB | cpu | 0.50 (0.60) | 2.00 (2.10) | 4.0x | 1.00, 1.00 | no |" in md
    assert "skipped: over --budget-s 450" in md and "Note: a note." in md


def test_phases_child_on_the_small_model(tmp_path):
    from bench.memory_models import SHAPES, write_gguf_q4

    model = write_gguf_q4(SHAPES["small"], tmp_path / "m.gguf")
    out = tmp_path / "phases.json"
    r = subprocess.run([sys.executable, "-m", "bench.first_token_phases", str(out), "--", "--model",
                        str(model), "-p", "hello", "-n", "1", "--mode", "dense", "--device", "cpu"],
                       capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    rows = {row["name"]: row for row in res["rows"]}
    assert rows["hotneurons.runtime.load.load_source_runtime"]["calls"] == 1
    assert rows["hotneurons.runtime.hybrid_ffn.HybridFFN.__init__"]["calls"] == SHAPES["small"].n_layers
    assert rows["hotneurons.runtime.generate.generate"]["seconds"] > 0 and res["total_s"] > rows["imports"]["seconds"]
