"""pi-bench's stages on the tiny shape on the CPU (bench/pi_bench.py, bench/bench_stages.py): end to end, stopped
midway or within the interleaved rounds (what was measured is kept), the interleaved hybrids; and every bench module
importing as a package."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import bench_report as report
from bench import record


def test_pi_bench_tiny_cpu_end_to_end(tmp_path):
    from bench import pi_bench

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
    from bench import bench_stages, pi_bench

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
    from bench import bench_llamacpp as lcpp
    from bench import pi_bench
    from bench.bench_build import model_key

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
    from bench import bench_llamacpp as lcpp
    from bench import pi_bench
    from bench.bench_build import model_key

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


CHECKOUT = Path(__file__).resolve().parents[1]  # the repository's root: the package's rooms, bench/ and tests/


def test_bench_modules_import_as_a_package():
    """Every bench module imports as bench.X in a fresh interpreter started at the checkout's root (no sys.path
    edits, PYTHONPATH cleared), and pi-bench's --help runs as a module there."""
    names = sorted(p.stem for p in (CHECKOUT / "bench").glob("*.py") if p.stem != "__init__")
    code = "import importlib, sys\nfor n in sys.argv[1:]: importlib.import_module('bench.' + n)"
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=300, env=env,
                       cwd=CHECKOUT)
    assert p.returncode == 0, p.stderr[-2000:]
    p = subprocess.run([sys.executable, "-m", "bench.pi_bench", "--help"], capture_output=True, text=True,
                       timeout=120, cwd=CHECKOUT, env=env)
    assert p.returncode == 0 and "--machine-kind" in p.stdout


def test_launcher_runs_the_checkouts_bench_from_anywhere(tmp_path):
    """pi-bench's console script (common/cli.bench_main) finds bench/ beside the package's own files, which in an
    editable install are the checkout: from another directory, with no PYTHONPATH, --help runs."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "from hotneurons.common.cli import bench_main\nbench_main()"
    p = subprocess.run([sys.executable, "-c", code, "--help"], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, env=env)
    assert p.returncode == 0 and "--machine-kind" in p.stdout, p.stderr[-2000:]


def test_launcher_without_bench_says_so_in_one_line(tmp_path, capsys):
    """A root without bench/ (a wheel's package folder): one line naming the fix, exit code 1, nothing run."""
    from hotneurons.common.cli import bench_main

    (tmp_path / "common").mkdir()
    with pytest.raises(SystemExit) as e:
        bench_main(tmp_path)
    msg = str(e.value.code)
    assert msg == (f"pi-bench runs from a checkout of the repository (clone it, then `pip install -e .` in it): "
                   f"bench/ is not in the wheel, and {tmp_path.resolve()} holds none")
    assert "\n" not in msg and capsys.readouterr().out == ""
    p = subprocess.run([sys.executable, "-c", f"from hotneurons.common.cli import bench_main\n"
                        f"bench_main({str(tmp_path)!r})"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stderr.strip() == msg and p.stdout == ""


def test_systems_table_parses_names_and_refuses_unknown_ones():
    from hotneurons.runtime.config import RuntimeConfig

    from bench import systems as sy

    assert sy.parse("hybrid, llama.cpp,all-gpu") == {"hybrid", "llama.cpp", "all-gpu"}
    assert set(sy.DEFAULT) <= set(sy.SYSTEMS)
    with pytest.raises(ValueError, match="unknown system 'hybrid-event-wait': choose one of hybrid, layer-split"):
        sy.parse("hybrid,hybrid-event-wait")
    for s in sy.SYSTEMS.values():  # every field a row sets is one RuntimeConfig has
        RuntimeConfig(**s.fields)
        assert s.name in sy.help_text()
