"""The pure parts of pi-bench (hotneurons.bench), its result writer, its fair baselines, and its tiny-shape CPU path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hotneurons.bench import bench_ceilings as ceil
from hotneurons.bench import bench_model as bm
from hotneurons.bench import bench_report as report
from hotneurons.bench import fair, record


def test_power_law_targets():
    p = bm.power_law(28672, seed=3)
    assert abs(p.mean() - 0.10) < 0.002
    assert abs(bm.share_of_top(p) - 0.80) < 0.01


def test_calibration_hits_power_law_targets():
    torch.manual_seed(0)
    lm = bm.build_model("tiny", 2, "cpu", seed=1)
    model = bm.calibrate(lm, "tiny", tokens=1024, seq=128, seed=1)
    freq = bm.realised(lm, "tiny", tokens=2048, seq=128, seed=5)  # fresh tokens
    for f, target in zip(freq, model.targets):
        assert abs(f.mean() - 0.10) < 0.01
        assert abs(bm.share_of_top(f) - 0.80) < 0.03
        assert np.corrcoef(f, target)[0, 1] > 0.98
    # the constant channel: nothing writes to residual channel 0, so every layer sees it
    for layer in lm.layers:
        assert float(layer.mlp.down_proj.weight.detach()[0].abs().max()) == 0.0
        assert float(layer.self_attn.o_proj.weight.detach()[0].abs().max()) == 0.0


def test_firing_statistics_hold_at_every_position(monkeypatch):
    """A shape wide enough that random attention outputs (~0.02^2 * d / sqrt(position) a channel) would swamp
    std-0.02 embeddings at early positions: calibrated over positions 0-255, the model fires ~10% of its neurons
    at the first positions too (where pi_bench decodes), not only on average."""
    monkeypatch.setitem(bm.SHAPES, "wide", (1024, 2816, 8, 2, 512))
    torch.manual_seed(0)
    lm = bm.build_model("wide", 2, "cpu", seed=3)
    bm.calibrate(lm, "wide", tokens=1024, seq=256, seed=3)
    rows = bm.active_by_position(lm, "wide", edges=(0, 16, 64, 256), seqs=4)
    assert [r["positions"] for r in rows] == ["0-16", "16-64", "64-256"]
    for r in rows:
        assert abs(r["mean_active"] - 0.10) < 0.012, rows


def test_exact_predictor_marks_the_neurons_that_fire():
    lm = bm.build_model("tiny", 2, "cpu", seed=2, gate_rank=7)
    model = bm.calibrate(lm, "tiny", tokens=512, seq=128, seed=2)
    ids = torch.randint(0, 320, (1, 64), generator=torch.Generator().manual_seed(9))
    for i in range(2):
        p = bm.exact_predictor(lm, "tiny", i, seed=2, rank=7).float()
        assert p.fc1.weight.shape == (16, 128)  # 2 * rank + 2 hidden units
        x = bm._ffn_input(lm, i, ids)  # (64, d) float32
        with torch.no_grad():
            gate = x.double() @ lm.layers[i].mlp.gate_proj.weight.double().T  # float64 reference
            logits = p(x)
        assert torch.allclose(logits.double(), gate, atol=2e-3 * float(gate.abs().max()))
        agree = (p.mask(x) == (gate > 0)).float().mean()
        assert agree > 0.995
    assert abs(bm.realised(lm, "tiny", tokens=1024, seq=128)[0].mean() - 0.10) < 0.015  # calibration still holds
    assert model.targets[0].shape == (1536,)


def test_floor_arithmetic():
    layers = [{"gpu_bytes": 3e9, "cold_bytes": 1e9}, {"gpu_bytes": 1e9, "cold_bytes": 2e9},
              {"gpu_bytes": 2e9, "cold_bytes": 0}]
    f = ceil.floor(layers, hbm_bw=2e12, dram_bw=1e11, sync_s=30e-6, outside_gpu_bytes=1e9)
    # layer 0: max(1.5 ms, 10 ms) + 30 us; layer 1: max(0.5 ms, 20 ms) + 30 us; layer 2: 1 ms, no sync; head 0.5 ms
    want = (10e-3 + 30e-6) + (20e-3 + 30e-6) + 1e-3 + 0.5e-3
    assert f["seconds_per_token"] == pytest.approx(want)
    assert f["tokens_per_s"] == pytest.approx(1 / want)
    assert f["gpu_bound_layers"] == 1
    assert f["serial_seconds_per_token"] == pytest.approx(want)  # no serial bytes: the same floor
    # serial: layer 0 reads 2e9 of its 3e9 GPU bytes before its FFN: 1 ms + max(0.5 ms, 10 ms) + 30 us
    layers[0]["serial_gpu_bytes"] = 2e9
    layers[2]["serial_gpu_bytes"] = 2e9  # all of it: 1 ms + max(0, 0)
    f = ceil.floor(layers, hbm_bw=2e12, dram_bw=1e11, sync_s=30e-6, outside_gpu_bytes=1e9)
    assert f["seconds_per_token"] == pytest.approx(want)
    assert f["serial_seconds_per_token"] == pytest.approx(want + 1e-3)


def test_dram_ceiling_is_at_least_what_the_cold_kernel_read():
    """A row gather that read less than the cold kernel in the same run is no ceiling: the floors and the kernel's
    shares take the kernel's best rate (the per-generation floors too), and the read kernels' figure is kept."""
    hybrid = {"cold_dtype": "bf16", "pcie_share": 0.0, "decode_tokens_per_s_reps": [100.0],
              "per_layer_counts": [{"tokens": 10, "n_hot": 64, "active_cold": 1000}],
              "dram_around_bytes_per_s": {"before": 90e9, "after": 110e9, "per_rep": [100e9]}}

    def run(kernel_rate):
        c = {"dram": {"best_bytes_per_s": 120e9, "best": "gather"}, "hbm_bytes_per_s": 3e12}
        res = {"systems": {"hybrid": hybrid}, "kernel": {"rows": [{"density": 0.05, "bytes_per_s": kernel_rate}]}}
        ceil.add_floors(res, c, "tiny", 1, 0)
        return res, c

    res, c = run(100e9)  # below the gather: the ceilings stand
    assert c["dram"]["best_bytes_per_s"] == 120e9 and res["kernel"]["rows"][0]["share_of_dram_bw"] == 100 / 120
    assert res["floor_per_rep"]["dram_bytes_per_s"] == [100e9]
    low = res["floor"]["tokens_per_s"]
    res, c = run(130e9)
    assert c["dram"]["best_bytes_per_s"] == 130e9 and c["dram"]["read_kernels_best_bytes_per_s"] == 120e9
    assert res["kernel"]["rows"][0]["share_of_dram_bw"] == 1.0 and res["floor"]["tokens_per_s"] > low
    assert res["floor"]["inputs"]["dram_bytes_per_s"] == 130e9
    assert res["floor_around_run"]["inputs"]["dram_bytes_per_s"] == 130e9  # the around-run mean, 100e9, raised
    assert res["floor_per_rep"]["floor_tokens_per_s"] == [res["floor"]["tokens_per_s"]]


def test_gpu_layers_for_budget():
    b = bm.model_bytes("llama-2-70b", 12)
    assert b["total"] == pytest.approx(21.6e9, rel=0.01)  # the 21.6 GB
    assert bm.gpu_layers_for(int(0.3 * b["total"]), "llama-2-70b", 12) == 3  # the issue's -ngl 3


def test_floor_bound_reads_cold_rows_at_the_kernels_rate():
    """floor_bound: the serial floor with the cold rows at the sparsest kernel row's rate; the rate that the goal
    needs puts the serial floor at 0.7 of the floor (by hand from floor()); none where even endless DRAM cannot."""
    d = bm.SHAPES["tiny"][0]
    hybrid = {"cold_dtype": "bf16", "pcie_share": 0.0,
              "per_layer_counts": [{"tokens": 4, "n_hot": 64, "active_cold": 4000}] * 2}
    c = {"dram": {"best_bytes_per_s": 100e9}, "hbm_bytes_per_s": 2e12, "sync_round_trip_s": 20e-6}
    kern = [{"density": 0.2, "bytes_per_s": 95e9}, {"density": 0.05, "bytes_per_s": 80e9}]
    floor = ceil.floor_from_hybrid(hybrid, c, "tiny", 2, 1000)
    b = ceil.floor_bound(hybrid, c, "tiny", 2, 1000, kern, floor["tokens_per_s"])
    assert b["kernel_density"] == 0.05 and b["kernel_share_of_dram"] == pytest.approx(0.8)
    at80 = ceil.floor_from_hybrid(hybrid, c, "tiny", 2, 1000, 80e9)
    assert b["serial_tokens_per_s"] == pytest.approx(at80["serial_tokens_per_s"])
    assert b["share_of_floor"] == pytest.approx(at80["serial_tokens_per_s"] / floor["tokens_per_s"])
    rows, outside = at80["inputs"]["layers"], at80["inputs"]["lm_head_bytes"] + 2 * d
    need = ceil.floor(rows, 2e12, b["kernel_share_needed"] * 100e9, 20e-6, outside)["serial_tokens_per_s"]
    assert need == pytest.approx(0.7 * floor["tokens_per_s"], rel=1e-6)
    assert ceil.floor_bound(hybrid, c, "tiny", 2, 1000, kern, 1e9)["kernel_share_needed"] == float("inf")


def test_goals_and_table():
    res = {"systems": {"hybrid": {"decode_tokens_per_s": 80.0, "ffn_sparsity": 0.9, "gpu_activation_share": 0.7,
                                  "dram_around_bytes_per_s": {"before": 1.2e11, "after": 1.4e11,
                                                              "per_rep": [1.25e11, 1.31e11]}},
                       "all-gpu": {"decode_tokens_per_s": 110.0},
                       "powerinfer": {"decode_tokens_per_s": 40.0},
                       "llama.cpp -ngl 3": {"decode_tokens_per_s": 3.2, "n_gpu_layers": 3,
                                            "dram_around_bytes_per_s": {"before": 1.5e11, "after": 1.5e11}},
                       "accelerate offload": {"decode_tokens_per_s": 1.0}},
           "floor": {"tokens_per_s": 100.0},
           "kernel": {"rows": [{"density": 0.05, "bytes_per_s": 1, "share_of_dram_bw": 0.7},
                               {"density": 0.2, "bytes_per_s": 1, "share_of_dram_bw": 0.9}]},
           "predictor_time": {"ms_per_token": 0.5}, "floor_per_rep": {"median_share": 0.65},
           "floor_bound": {"kernel_density": 0.05, "kernel_bytes_per_s": 1.1e11, "kernel_share_of_dram": 0.85,
                           "serial_tokens_per_s": 66.0, "share_of_floor": 0.66, "kernel_share_needed": 0.93}}
    g = report.goals(res)
    assert g["bound_floor_share_at_kernel_rate"]["value"] == 0.66 and not g["bound_floor_share_at_kernel_rate"]["met"]
    assert g["hybrid_share_of_floor_dram_around_each_rep"]["met"] is False
    assert g["hybrid_vs_llamacpp_layer_split"]["value"] == 25 and g["hybrid_vs_llamacpp_layer_split"]["met"]
    assert g["hybrid_vs_powerinfer"]["value"] == 2 and g["hybrid_vs_powerinfer"]["met"]
    assert g["hybrid_share_of_our_all_gpu"]["value"] == pytest.approx(80 / 110)
    assert g["hybrid_share_of_our_all_gpu"]["met"] is False
    assert g["hybrid_vs_accelerate_offload"]["met"] is False
    assert g["hybrid_share_of_floor"]["value"] == pytest.approx(0.8) and g["hybrid_share_of_floor"]["met"]
    assert g["cpu_kernel_share_of_dram_bw"]["value"] == 0.7 and g["cpu_kernel_share_of_dram_bw"]["met"] is False
    assert g["predictor_share_of_decode"]["value"] == pytest.approx(0.04) and g["predictor_share_of_decode"]["met"]
    md = report.markdown({**res, "goals": g})
    assert "| hybrid | 80.00 | 25.00 | 0.80 |" in md and "NOT met" in md
    assert "| powerinfer | 40.00 | 12.50 | 0.40 | GPU share of activations" in md
    assert ("| serial floor, the cold rows at the cold kernel's own rate at 5% density (110.0 GB/s), the rest at its "
            "floor | 66.00 | 20.62 | 0.66 | 0.7 of the floor needs the cold rows at 0.93 of the DRAM ceiling") in md
    assert "DRAM around it 125-131 GB/s" in md and "3 layers on the GPU, DRAM around it 150 GB/s" in md


def test_gguf_round_trip(tmp_path):
    gguf = pytest.importorskip("gguf")
    from hotneurons.bench import bench_llamacpp as lcpp

    lm = bm.build_model("tiny", 2, "cpu", seed=2)
    path = tmp_path / "tiny.gguf"
    info = lcpp.write_gguf(lm.model, path, gguf)
    r = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == 2 * 9 + 3
    assert info["tensor_bytes"] == sum(int(t.n_bytes) for t in r.tensors)
    w = lm.model.model.layers[1].mlp.gate_proj.weight.detach().numpy()
    got = np.asarray(tensors["blk.1.ffn_gate.weight"].data).reshape(w.shape)
    assert np.array_equal(got, w)
    assert tensors["blk.0.attn_k.weight"].data.shape[0] == 2 * 32  # kv heads x head dim (GQA)
    block_count = r.fields["llama.block_count"]
    assert int(block_count.parts[block_count.data[0]][0]) == 2


def test_pi_bench_tiny_cpu_end_to_end(tmp_path):
    from hotneurons.bench import pi_bench

    t0 = time.perf_counter()
    work, out = tmp_path / "work", tmp_path / "out"
    common = ["--device", "cpu", "--shape", "tiny", "--layers", "2", "--work", str(work), "--out", str(out),
              "--dram-bytes", str(16 * 2**20), "--ctx", "64", "--tokens", "4", "--reps", "1", "--slow-tokens", "2",
              "--profile-tokens", "1024", "--calibration-tokens", "512",
              "--systems", "hybrid,layer-split,all-gpu,llama.cpp,accelerate", "--share-sweep", "0.2"]
    done = pi_bench.main(["--stage", "all", *common])  # our systems and accelerate each in a child process
    res = done["bench"]
    assert set(res["systems"]) == {"hybrid", "layer-split", "all-gpu", "accelerate offload"}
    assert res["systems"]["accelerate offload"]["standalone"] and res["machine_kind"] == "cpu"
    assert set(res["fairness"]) == {"alone_s", "beside_ours_s", "ours_stopped_s", "what"}
    assert all(res["fairness"][k] > 0 for k in ("alone_s", "beside_ours_s", "ours_stopped_s"))
    assert all(r.get("decode_tokens_per_s", 0) > 0 for r in res["systems"].values())
    assert "llama.cpp" in res["skipped"]  # no CPU llama-bench built without --cpu-llamacpp
    assert abs(res["profile"]["mean_active"] - 0.10) < 0.01
    # the exact predictor marks what the decoded tokens fire: about 90% inactive, as calibrated (a greedy random
    # model repeats a few tokens, so the share moves with their patterns)
    assert 0.8 < res["systems"]["hybrid"]["ffn_sparsity"] < 0.97
    assert res["predictors"]["agreement_with_gate"]["recall"] > 0.99
    assert res["floor"]["tokens_per_s"] > 0 and len(res["kernel"]["rows"]) == 3
    f = res["floor"]
    assert 0 < res["floor_bound"]["share_of_floor"] <= f["serial_tokens_per_s"] / f["tokens_per_s"]
    # the predictor timed as the hybrid runtime's static decoder runs it (its op: GEMVs and decision)
    assert res["predictor_time"]["what"] == "the decoder's predict op (torch ops)"
    assert res["predictor_time"]["ms_per_token"] > 0 and res["predictor_time"]["layers"] == 2
    per_rep = res["floor_per_rep"]  # each timed generation against the DRAM ceiling measured around it
    assert len(per_rep["share"]) == 1 and per_rep["median_share"] == pytest.approx(
        res["systems"]["hybrid"]["decode_tokens_per_s"] / per_rep["floor_tokens_per_s"][0])
    with pytest.raises(SystemExit):  # a share out of [0, 1) is refused before anything runs
        pi_bench.parse(["--stage", "bench", "--share-sweep", "0.2,1.5"])
    # the share sweep: the balanced share (none on a CPU) and 0.2 in rounds, ratios to the balanced one
    sw = res["share_sweep"]
    assert sw["shares"] == {"balanced": 0.0, "0.2": 0.2} and sw["median_ratio"]["balanced"] == 1.0
    assert [len(v) for v in sw["decode_tokens_per_s_reps"].values()] == [1, 1]
    if "gguf" in done["build"]:
        assert Path(done["build"]["gguf"]["path"]).exists()
    merged = report.write_results([out], tmp_path / "results")
    files = sorted(p.name for p in (tmp_path / "results").iterdir())
    assert len(files) == 2 and files[0].endswith("-cpu-pi-bench.json")
    saved = json.loads((tmp_path / "results" / files[0]).read_text())
    assert saved["schema_version"] == record.SCHEMA_VERSION and saved["machine_kind"] == "cpu"
    assert saved["figures"]["goals"] == merged["goals"] and saved["command"].endswith("--stage all " + " ".join(common))
    assert "Firing by position" in (tmp_path / "results" / files[1]).read_text()
    assert "PCIe shares in rounds within the hybrid runtime (1 rounds): balanced 0.000" in (
        tmp_path / "results" / files[1]).read_text()
    # the calibration is saved in --work and reused: a second bench gives the model the same weights
    assert any(work.glob("calibration-*.safetensors"))
    assert time.perf_counter() - t0 < 150


def test_pi_bench_stopped_midway_keeps_what_it_measured(tmp_path, monkeypatch):
    """The bench stage writes its JSON after each system (a temp file, then a rename), marked partial: a run that a
    timeout stops keeps the systems measured before it, and the report says it is partial."""
    from hotneurons.bench import bench_stages, pi_bench

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt("the device's timeout")

    monkeypatch.setattr(bench_stages, "run_accelerate", stopped)
    out = tmp_path / "out"
    argv = ["--stage", "bench", "--device", "cpu", "--shape", "tiny", "--layers", "2", "--work", str(tmp_path / "work"),
            "--out", str(out), "--dram-bytes", str(16 * 2**20), "--ctx", "64", "--tokens", "3", "--reps", "1",
            "--profile-tokens", "512", "--calibration-tokens", "256", "--systems", "hybrid,accelerate", "--in-process"]
    with pytest.raises(KeyboardInterrupt):
        pi_bench.main(argv)
    assert sorted(p.name for p in out.iterdir()) == ["pi_bench_bench.json"]  # no temp file left
    res = json.loads((out / "pi_bench_bench.json").read_text())["figures"]
    assert res["partial"] and res["systems"]["hybrid"]["decode_tokens_per_s"] > 0 and "accelerate offload" not in \
        res["systems"]
    merged = report.write_results([out], tmp_path / "results")
    assert report.markdown(merged).splitlines()[2].startswith("PARTIAL: the bench stage stopped")


def test_pi_bench_stopped_within_the_rounds_keeps_them(tmp_path, monkeypatch):
    """--interleave writes the rounds so far after each round: a timeout inside the second round's llama-bench keeps
    the first round's generations and llama-bench row, and the report lists them."""
    from hotneurons.bench import bench_llamacpp as lcpp
    from hotneurons.bench import pi_bench
    from hotneurons.bench.bench_build import model_key

    calls = []

    def fake_llama_bench(binary, path, ngl, threads, tokens, reps, timeout, freeze=False):
        calls.append(ngl)
        if len(calls) == 2:
            raise KeyboardInterrupt("the device's timeout")
        return {"decode_tokens_per_s": 4.0, "n_gpu_layers": ngl}

    monkeypatch.setattr(lcpp, "llama_bench", fake_llama_bench)
    work, out = tmp_path / "work", tmp_path / "out"
    argv = ["--device", "cpu", "--shape", "tiny", "--layers", "2", "--work", str(work), "--out", str(out),
            "--dram-bytes", str(16 * 2**20), "--ctx", "64", "--tokens", "3", "--reps", "3", "--profile-tokens", "512",
            "--calibration-tokens", "256", "--systems", "hybrid,llama.cpp", "--interleave", "--in-process"]
    (work / "build-cpu" / "bin").mkdir(parents=True)
    (work / "build-cpu" / "bin" / "llama-bench").write_text("")
    (work / f"model-{model_key(pi_bench.parse(['--stage', 'bench', *argv]))}.gguf").write_text("")
    with pytest.raises(KeyboardInterrupt):
        pi_bench.main(["--stage", "bench", *argv])
    res = json.loads((out / "pi_bench_bench.json").read_text())["figures"]
    partial = res["interleaved"]["partial"]
    assert res["partial"] and partial["rounds_done"] == 1 and len(partial["decode_tokens_per_s"]["hybrid"]) == 1
    assert partial["decode_tokens_per_s"]["hybrid"][0] > 0
    assert partial["others"] == {f"llama.cpp -ngl {calls[0]}": [{"decode_tokens_per_s": 4.0, "n_gpu_layers": calls[0]}]}
    merged = report.write_results([out], tmp_path / "results")
    assert "Interleaved, stopped after 1 rounds: tok/s per round hybrid " in report.markdown(merged)


def test_pi_bench_interleaved_hybrids_tiny_cpu(tmp_path, monkeypatch):
    """--interleave: the hybrid systems built side by side, timed in rounds, each with its own row and the per-round
    ratios to the first; llama-bench (here a stand-in) once after each round, paired with them."""
    from hotneurons.bench import bench_llamacpp as lcpp
    from hotneurons.bench import pi_bench
    from hotneurons.bench.bench_build import model_key

    calls = []

    def fake_llama_bench(binary, path, ngl, threads, tokens, reps, timeout, freeze=False):
        calls.append((ngl, reps))
        if len(calls) == 2:  # a failed run drops its round from the paired ratios
            return {"error": "llama-bench failed"}
        return {"decode_tokens_per_s": 2.0 + len(calls), "n_gpu_layers": ngl}

    monkeypatch.setattr(lcpp, "llama_bench", fake_llama_bench)
    work = tmp_path / "work"
    argv = ["--device", "cpu", "--shape", "tiny", "--layers", "2", "--work", str(work), "--out", str(tmp_path / "out"),
            "--dram-bytes", str(16 * 2**20), "--ctx", "64", "--tokens", "3", "--reps", "3", "--profile-tokens", "512",
            "--calibration-tokens", "256", "--systems", "hybrid,hybrid-no-recheck,all-gpu,llama.cpp", "--interleave",
            "--in-process"]
    (work / "build-cpu" / "bin").mkdir(parents=True)
    (work / "build-cpu" / "bin" / "llama-bench").write_text("")  # "built": the stand-in above runs instead
    (work / f"model-{model_key(pi_bench.parse(['--stage', 'bench', *argv]))}.gguf").write_text("")
    res = pi_bench.main(["--stage", "bench", *argv])["bench"]
    assert list(res["systems"])[:3] == ["hybrid", "hybrid-no-recheck", "all-gpu"]
    il = res["interleaved"]
    assert il["systems"] == ["hybrid", "hybrid-no-recheck"] and il["ratio_to"] == "hybrid" and il["reps"] == 3
    for name in il["systems"]:
        row = res["systems"][name]
        assert len(row["decode_tokens_per_s_reps"]) == 3 and len(row["dram_around_bytes_per_s"]["per_rep"]) == 3
        assert il["ratios_per_round"][name] == pytest.approx(
            [a / b for a, b in zip(row["decode_tokens_per_s_reps"],
            res["systems"]["hybrid"]["decode_tokens_per_s_reps"])])
    assert il["median_ratio"]["hybrid"] == 1.0 and il["rounds_above_1"]["hybrid"] == 0
    # the same ratios from each generation's median step
    assert il["median_step_ratio"]["hybrid"] == 1.0 and len(il["step_ratios_per_round"]["hybrid-no-recheck"]) == 3
    assert all(r > 0 for r in il["step_ratios_per_round"]["hybrid-no-recheck"])
    steps = [res["systems"][k]["decode_step_ms_median_reps"] for k in ("hybrid", "hybrid-no-recheck")]
    assert il["step_ratios_per_round"]["hybrid-no-recheck"] == pytest.approx([a / b for a, b in zip(*steps)])
    assert "dram_around_bytes_per_s" not in res["systems"]["all-gpu"]  # timed on its own, as before
    # llama-bench once a round (one repetition each), then once more for each of its usual rows
    label = f"llama.cpp -ngl {res['llama_cpp_ngl_at_budget']}"
    assert calls[:3] == [(res["llama_cpp_ngl_at_budget"], 1)] * 3
    assert [x.get("decode_tokens_per_s") for x in il["others"][label]] == [3.0, None, 5.0]
    hybrid = res["systems"]["hybrid"]["decode_tokens_per_s_reps"]
    assert il["median_ratio_to_others"][label]["hybrid"] == pytest.approx((hybrid[0] / 3.0 + hybrid[2] / 5.0) / 2)
    assert res["goals"]["hybrid_vs_llamacpp_layer_split_paired"]["value"] \
        == il["median_ratio_to_others"][label]["hybrid"]
    # the standalone run beside the paired ones: 6 tok/s against a median of 3 and 5, flagged
    b = res["baselines"][label]
    assert res["systems"][label]["decode_tokens_per_s"] == 6.0 and res["systems"][label]["standalone"]
    assert b["paired_median_tokens_per_s"] == 4.0 and b["paired_rounds"] == 2 and b["flag"]
    assert b["paired_over_standalone"] == pytest.approx(4 / 6)
    md = report.markdown(res)
    assert "Interleaved: hybrid, hybrid-no-recheck timed in 3 rounds" in md \
        and f"Paired with {label} run after each round" in md
    assert "the same from each generation's median step: hybrid-no-recheck " in md
    assert f"| {label} | 6.00 | 4.00 (2 rounds) | 0.67 | FLAG: more than 10% apart |" in md


def test_frozen_baseline_stops_the_caller_until_it_ends(tmp_path):
    """fair.run(freeze=True) in a child process: every thread of the caller is stopped (state T in /proc) while the
    command runs, and it runs on once the command has ended, also when the command overran its timeout."""
    code = """if True:
        import os, sys, time
        from hotneurons.bench import fair
        rc, out, _, _ = fair.run(["sh", "-c", f"cat /proc/{os.getpid()}/stat"], 30, freeze=True)
        state = out.rsplit(")", 1)[1].split()[0]
        t0 = time.perf_counter()
        rc2, _, _, s = fair.run(["sleep", "30"], 1, freeze=True)
        print(rc, state, rc2, round(s))
    """
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["0", "T", "124", "1"]


def test_baseline_env_drops_our_openmp_settings(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000000")
    monkeypatch.setenv(fair.OURS_ENV, "OMP_WAIT_POLICY,GOMP_SPINCOUNT")
    env = fair.baseline_env()
    assert "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env and env[fair.BASELINE_PROCESS] == "1"
    monkeypatch.setenv(fair.OURS_ENV, "")  # the user's own settings stay
    assert fair.baseline_env()["OMP_WAIT_POLICY"] == "ACTIVE"
    assert fair.cpu_probe(procs=1, iters=1000) > 0


def test_compare_flags_a_disagreement_over_ten_percent():
    assert fair.compare(10.0, [9.5, 9.2, None, 9.8])["flag"] is False
    c = fair.compare(4.37, [0.79, 0.8, 0.78])
    assert c["flag"] and c["paired_median_tokens_per_s"] == 0.79 and c["paired_rounds"] == 3
    assert fair.compare(None, [1.0])["flag"] is None and fair.compare(1.0, [])["paired_median_tokens_per_s"] is None


def test_result_record_schema(tmp_path):
    info = {"hostname": "h", "gpu": "NVIDIA H200", "gpu_count": 1, "nproc": 16}
    assert record.machine_kind(info) == "nvidia-h200"
    assert record.machine_kind({**info, "gpu_count": 2}) == "nvidia-h200-x2"
    assert record.machine_kind({**info, "gpu": "NVIDIA H100 80GB HBM3"}) == "nvidia-h100"
    assert record.machine_kind({"gpu": None}) == "cpu"
    rec = record.write_result(tmp_path / "r.json", {"tok_s": 1.5}, machine_info=info, commit="abc1234",
                              command="pi-bench --stage bench")
    back = json.loads((tmp_path / "r.json").read_text())
    assert back == rec and set(back) == {*record.HEADER, "figures"} and back["machine_kind"] == "nvidia-h200"
    assert back["figures"] == {"tok_s": 1.5} and record.read(tmp_path / "r.json") == back
    assert record.flat(back)["tok_s"] == 1.5 and record.flat(back)["commit"] == "abc1234"
    with pytest.raises(ValueError):
        record.write(tmp_path / "bad.json", {"figures": {}})
    # a file from before the schema: its flat keys become figures, its header keys the header
    (tmp_path / "old.json").write_text(json.dumps({"machine": info, "command": "python x", "created": "2026-01-01",
                                                   "systems": {}}))
    old = record.read(tmp_path / "old.json")
    assert old["machine_kind"] == "nvidia-h200" and old["figures"] == {"systems": {}} and old["commit"] == "unknown"
    assert record.make({}, machine_info=info)["commit"] != ""  # this checkout's commit (or "unknown")


def test_bench_modules_import_as_a_package():
    """Every bench module imports as hotneurons.bench.X in a fresh interpreter (no sys.path edits), and pi-bench's
    --help runs as a module."""
    root = Path(__file__).resolve().parents[1] / "bench"
    names = sorted(p.stem for p in root.glob("*.py") if p.stem != "__init__")
    code = "import importlib, sys\nfor n in sys.argv[1:]: importlib.import_module('hotneurons.bench.' + n)"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=300, env=env,
                       cwd="/")
    assert p.returncode == 0, p.stderr[-2000:]
    p = subprocess.run([sys.executable, "-m", "hotneurons.bench.pi_bench", "--help"], capture_output=True, text=True,
                       timeout=120, cwd="/")
    assert p.returncode == 0 and "--machine-kind" in p.stdout
