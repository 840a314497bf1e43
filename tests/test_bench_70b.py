"""bench/bench_70b.py's report: the stages' figures as one record with systems keyed by name and the goals' ratios."""

import json

import pytest


def stages():
    ours = {"decode_tok_s": {"32": 10.0, "256": 12.0}, "prefill_tok_s": 150.0, "load_to_first_token_s": 90.0,
            "host_peak_rss_bytes": 30e9, "gpu_peak_bytes": 23e9, "gguf_bytes": 38.8e9, "gpu_activation_share": 0.77,
            "ffn_sparsity": 0.9}
    lc = {"budget_for_weights_bytes": 24e9,
          "llama.cpp -ngl 50": {"decode_tok_s": {"32": 3.0, "256": 3.0}, "prefill_tok_s": 170.0,
                                "host_peak_rss_bytes": 40e9, "gpu_peak_bytes": 24e9},
          "llama.cpp all layers on the GPU": {"decode_tok_s": {"32": 50.0, "256": 48.0}, "prefill_tok_s": 1400.0,
                                              "host_peak_rss_bytes": 2e9, "gpu_peak_bytes": 40e9},
          "llama.cpp CPU only": {"error": "out of memory"}}
    timings = ["llama_print_timings:        load time =    9001.27 ms",
               "llama_print_timings: prompt eval time =     489.88 ms /    15 tokens (   32.66 ms per token)"]
    pw = {"decode, 16 threads": {"decode_tokens_per_s": 4.0, "threads": 16, "new_tokens": 256, "gpu_peak_bytes": 25e9,
                                 "timings": timings},
          "decode, 2 threads": {"decode_tokens_per_s": 1.0, "threads": 2, "new_tokens": 64, "gpu_peak_bytes": 25e9},
          "prompt of 512 tokens": {"prefill_tokens_per_s": 100.0, "gpu_peak_bytes": 26e9},
          "host_peak_rss_bytes": 41e9}
    return {"build": {"shape": "llama-2-70b", "layers": 80, "calibration": {"mean_fired_as_stored": 0.1}},
            "pipeline": {"predictors": {"bytes": 6e9}, "solve": {"summary": SOLVED}}, "ours": ours, "llamacpp": lc,
            "powerinfer": pw}


# pi-solve's summary, the parts the floor reads: 1 GB of attention and predictors a token at 1e12 B/s (1 ms), 80
# syncs of 10 us (0.8 ms), LM head 0.1 GB (0.1 ms)
SOLVED = {"hardware": {"gpu_bw": 1e12, "cpu_bw": 50e9, "sync_latency_s": 1e-5}, "flags": {"vram_bytes": 25769803776},
          "memory": {"gpu": {"attention": 0.6e9, "predictors": 0.4e9, "lm_head": 0.1e9}, "bytes_per_neuron": 10000},
          "layers": [{"neurons": 1000}] * 80}


def test_report_keys_systems_and_goals():
    from bench.bench_70b import SYSTEM_KEYS, markdown, report

    fig = report(stages())
    assert list(fig["systems"]) == ["hybrid", "llama.cpp -ngl 50", "llama.cpp all layers on the GPU",  # CPU: failed
                                    "powerinfer", "powerinfer, 2 threads"]
    assert fig["systems"]["powerinfer"] == {"decode_tok_s": {"256": 4.0}, "prefill_tok_s": 100.0,
                                            "load_to_first_token_s": 9.49, "host_peak_rss_bytes": 41e9,
                                            "gpu_peak_bytes": 26e9}
    assert all(set(SYSTEM_KEYS) <= set(r) for r in fig["systems"].values())
    g = fig["goals"]
    assert g["decode_vs_layer_split"] == pytest.approx(4.0) and g["decode_vs_all_gpu"] == pytest.approx(0.25)
    assert g["decode_vs_powerinfer"] == pytest.approx(3.0)
    assert g["prefill_vs_layer_split"] == pytest.approx(150 / 170) and g["host_rss_vs_file"] == pytest.approx(30 / 38.8)
    # cold rows: 0.1 x 1000 neurons x 80 layers x 0.23 left to the CPU x 10 kB = 18.4 MB at 50 GB/s = 0.368 ms
    f = fig["serial_floor"]
    assert f["cold_rows_ms"] == pytest.approx(0.368) and f["ms"] == pytest.approx(1 + 0.8 + 0.368 + 0.1)
    assert g["decode_vs_serial_floor"] == pytest.approx(12.0 / (1e3 / 2.268))
    md = markdown(fig)
    assert "Serial floor 440.9 tok/s (2.27 ms a token" in md
    assert "| llama.cpp -ngl 50 | 3.00 / 3.00 | 170 |" in md and "decode_vs_layer_split 4.00" in md
    assert "| powerinfer, 2 threads | - / - (1.00 over 64) | - |" in md
    assert fig["gpu_budget_bytes"] == 25769803776 and fig["llamacpp_weights_budget_bytes"] == 24e9
    assert f["run_cold_rate_bytes_s"] is None and f["cold_rate_bytes_s"] == 50e9


def test_serial_floor_takes_the_runs_own_cold_rate_where_faster():
    from bench.bench_70b import serial_floor

    # two balancing rounds: the CPU's rows 0.75 x 400 = 300 neurons of 10 kB in a median 0.05 ms (60 GB/s), then
    # 400 in 0.1 ms (40 GB/s): the best, 60 GB/s, beats pi-solve's 50 and prices the floor's cold rows
    rounds = [{"share": 0.25, "marked": 400, "cold_ms_median": 0.05}, {"share": 0.0, "marked": 400,
                                                                       "cold_ms_median": 0.1}]
    ours = {"ffn_sparsity": 0.9, "gpu_activation_share": 0.77, "runs": {"decode_256": {"pcie_balance": rounds}}}
    f = serial_floor({"solve": {"summary": SOLVED}}, ours, 80)
    assert f["run_cold_rate_bytes_s"] == pytest.approx(60e9) and f["cold_rate_bytes_s"] == pytest.approx(60e9)
    assert f["cold_rows_ms"] == pytest.approx(18.4e6 / 60e9 * 1e3)
    slow = [{"share": 0.0, "marked": 400, "cold_ms_median": 0.2}]  # 20 GB/s: pi-solve's 50 stays
    ours["runs"]["decode_256"]["pcie_balance"] = slow
    assert serial_floor({"solve": {"summary": SOLVED}}, ours, 80)["cold_rate_bytes_s"] == 50e9


def test_main_first_token_needs_both_lines():
    from bench.bench_70b_baselines import main_first_token_s

    assert main_first_token_s(["llama_print_timings:        load time =    8000.00 ms",
                               "llama_print_timings: prompt eval time =     500.00 ms /    15 tokens"]) == 8.5
    assert main_first_token_s(["llama_print_timings:        load time =    8000.00 ms"]) is None


def test_llamacpp_stage_finds_the_most_layers_that_fit_and_times_loads(tmp_path, monkeypatch):
    """llama-bench replaced by a recorder whose GPU memory grows 0.5 GB a layer: the probes stop at the most layers
    under the budget less the KV cache, and each system gets a load run (-p 0 -n 1) on its own layers."""
    import argparse

    from bench import bench_70b_baselines as b

    calls = []

    def bench(binary, gguf, ngl, threads, gen, prompt, env=None, timeout=400):
        calls.append((ngl, gen, prompt, env is not None))
        gpu = 0 if ngl == 0 else 0.5e9 * min(ngl, 80)
        return {"ngl": ngl, "seconds": 10.0 + ngl / 10, "gpu_peak_bytes": gpu, "decode_tok_s": {"32": 1.0}}

    monkeypatch.setattr(b, "llama_bench", bench)
    monkeypatch.setattr(b, "kv_bytes", lambda gguf, ctx: 1e9)
    a = argparse.Namespace(work=tmp_path, device="cuda", llama_bench="/bin/llama-bench", vram="21GB", ctx=4096,
                           shape="llama-2-70b", layers=80)
    rows = b.stage_llamacpp(a)
    assert "llama.cpp -ngl 40" in rows  # 40 x 0.5 GB = 20 GB = 21 GB - the 1 GB cache
    assert rows["llama.cpp -ngl 40"]["load_to_first_token_s"] == pytest.approx(14.0)
    assert rows["llama.cpp CPU only"]["load_to_first_token_s"] == pytest.approx(10.0)
    assert (0, "1", 0, True) in calls and (99, "1", 0, False) in calls


def test_powerinfer_stage_exports_once_and_runs_main_three_ways(tmp_path, monkeypatch):
    """The stage's wiring, PowerInfer's build, pi-export and `main` replaced by recorders: the run exported at threshold
    0 into --pwri-dir (reused when there), main at every core, at 2 threads and on a 512-token prompt, each with the
    budget in GiB and its GPU peak."""
    import argparse

    from hotneurons import export

    from bench import bench_70b_baselines as b
    from bench import bench_powerinfer, powerinfer_check

    calls = []
    monkeypatch.setattr(powerinfer_check, "build", lambda *a, **k: {"binary": "/bin/main"})
    monkeypatch.setattr(export, "export_run", lambda run, out, **k: calls.append(("export", k)) or {
        "files": {"model": "m.powerinfer.gguf"}})

    def main(binary, gguf, budget, threads, n, **k):
        calls.append(("main", budget, threads, n, len(k.get("prompt", "x" * 16))))
        return {"decode_tokens_per_s": 5.0, "prefill_tokens_per_s": 50.0, "tokens": [1], "prompt_ids": [1]}

    monkeypatch.setattr(bench_powerinfer, "run_main", main)
    monkeypatch.setattr(b.os, "cpu_count", lambda: 16)
    a = argparse.Namespace(pwri_dir=tmp_path / "pwri", powerinfer_src=None, work=tmp_path, vram="24GiB")
    res = b.stage_powerinfer(a)
    assert calls[0] == ("export", {"threshold": 0.0, "force": True})
    mains = [c for c in calls if c[0] == "main"]
    assert [c[2:] for c in mains] == [(16, 256, 16), (2, 64, 16), (16, 2, 511)]
    assert all(c[1] == pytest.approx(24.0) for c in mains)
    assert "tokens" not in res["decode, 2 threads"] and res["decode, 2 threads"]["new_tokens"] == 64
    assert set(b.powerinfer_systems(res)) == {"powerinfer", "powerinfer, 2 threads"}


def test_batched_bench_reads_the_jsonl(tmp_path):
    """bench_70b_baselines.batched_bench against a stand-in binary that prints llama-batched-bench's JSONL (one line
    per batch size, among its log lines): aggregate decode and prefill rates per B, the argv it was given."""
    from bench.bench_70b_baselines import batched_bench

    fake = tmp_path / "llama-batched-bench"
    rows = [{"pp": 128, "tg": 128, "pl": b, "n_kv": b * 256, "t_pp": 0.1 * b, "speed_pp": 1280.0, "t_tg": 2.0,
             "speed_tg": 64.0 * b, "t": 2.1, "speed": 1.0} for b in (1, 2, 4)]
    body = "\n".join(["main: n_kv_max = 1024"] + [json.dumps(r) for r in rows])
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/argv\nprintf '%s\\n' '{body}'\n")
    fake.chmod(0o755)
    got = batched_bench(str(fake), tmp_path / "m.gguf", 40, 4, "1,2,4")
    assert got["exit_code"] == 0, got
    assert got["batches"]["4"]["decode_tok_s"] == 256.0 and got["batches"]["1"]["prefill_tok_s"] == 1280.0
    argv = (tmp_path / "argv").read_text().split()
    assert argv[argv.index("-ngl") + 1] == "40" and argv[argv.index("-c") + 1] == str(4 * 256)
    assert argv[argv.index("-npl") + 1] == "1,2,4" and "jsonl" in argv
