"""common/memory.process_memory (the kernel's own counts from /proc/self/status) and pi-generate's host memory
summary: its peak RSS and the part held before the model loaded (interpreter and libraries)."""

from __future__ import annotations

import json
import mmap
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from hotneurons.common.memory import process_memory
from hotneurons.runtime.cli import format_stats, host_memory, main

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status is Linux's")
MB = 1 << 20


def test_counts_follow_anonymous_and_file_pages(tmp_path):
    m0 = process_memory()
    assert 0 < m0.rss <= m0.peak and m0.anon + m0.file <= m0.rss
    a = np.ones(64 * MB, dtype=np.uint8)  # 64 MiB of heap, every page touched
    m1 = process_memory()
    assert 60 * MB < m1.anon - m0.anon < 72 * MB and m1.peak >= m1.rss >= m0.rss + 60 * MB
    path = tmp_path / "f.bin"
    path.write_bytes(b"\1" * (32 * MB))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        assert sum(mm[i] for i in range(0, len(mm), 4096)) == 32 * MB // 4096  # every page read
        m2 = process_memory()
        assert 28 * MB < m2.file - m1.file < 36 * MB
    del a
    # the high-water mark stays: the kernel folds rss into it as pages are unmapped (its per-thread counts a few
    # pages stale)
    assert process_memory().peak >= m2.rss - MB


def test_generate_reports_its_host_memory(tiny_model_dir):
    args = ["--model", str(tiny_model_dir("llama-swiglu")), "--mode", "dense", "--device", "cpu", "-n", "4",
            "--prompt", "The quick brown fox"]
    r = CliRunner().invoke(main, [*args, "--json"])
    assert r.exit_code == 0, r.output
    m = json.loads(r.stdout)["stats"]["host_memory"]
    assert 0 < m["before_model_bytes"] <= m["peak_rss_bytes"] and m["rss_bytes"] <= m["peak_rss_bytes"]
    assert m["since_bytes"] == m["peak_rss_bytes"] - m["before_model_bytes"]
    assert m["anon_bytes"] + m["file_bytes"] <= m["rss_bytes"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0 and "host RSS peak" in r.output and "before the model" in r.output, r.output


def test_summary_text():
    start = process_memory()
    end = type(start)(rss=900 * 10**6, peak=1_080 * 10**6, anon=500 * 10**6, file=400 * 10**6)
    m = host_memory(type(start)(rss=470 * 10**6, peak=470 * 10**6, anon=0, file=0), end)
    assert m["since_bytes"] == 610 * 10**6
    s = {"mode": "dense", "device": "cpu", "dtype": "float32", "cold_dtype": "q4_0", "threads": 2,
         "prefill_tokens_per_s": 1.0, "decode_tokens_per_s": 2.0, "ffn_sparsity": 0.0, "gpu_activation_share": 1.0,
         "bytes_gpu": 1e6, "bytes_cpu": 0, "host_memory": m}
    assert "host RSS peak 1080 MB: 470 MB before the model (interpreter and libraries), 610 MB since" in format_stats(s)
    assert host_memory(None, end) is None and "host RSS" not in format_stats({**s, "host_memory": None})
