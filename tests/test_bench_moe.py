"""bench/bench_moe.py on the CPU: a tiny Qwen3-MoE-shaped model (2 layers, 8 experts, d 128) through every stage
that needs no GPU or llama.cpp (build, pipeline, ours, report with a recorded llama.cpp stage), the file read by our
reader and gguf-py, the router's skew within tolerance of its target; llama.cpp's --n-cpu-moe probe on a recorder."""

import json

import numpy as np
import pytest


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from bench import bench_moe

    w = tmp_path_factory.mktemp("moe")
    common = ["--shape", "tiny", "--device", "cpu", "--work", str(w), "--ctx", "1024", "--profile-tokens", "2048"]
    bench_moe.main(["--stage", "build", *common, "--calibration-tokens", "1024", "--seq", "128"])
    bench_moe.main(["--stage", "pipeline", *common, "--reserve", "0"])
    bench_moe.main(["--stage", "ours", *common])
    return w / "tiny-calibrated"


def test_build_file_is_readable_and_routes_as_calibrated(work):
    import gguf
    from hotneurons.models.open import open_model

    from bench.moe_gguf import SHAPES, tensor_plan

    build = json.loads((work / "build.json").read_text())["figures"]
    r = gguf.GGUFReader(str(work / "model.gguf"))
    assert [t.name for t in r.tensors] == [n for n, _, _ in tensor_plan(SHAPES["tiny"])]
    assert int(r.fields["qwen3moe.expert_count"].parts[-1][0]) == 8
    src, _, cfg, act = open_model(str(work / "model.gguf"))
    assert (cfg.n_experts, cfg.n_experts_used, cfg.n_ff_exp, cfg.head_dim, str(act)) == (8, 2, 64, 32, "swiglu")
    cal = build["calibration"]
    assert cal["mean_top_share"] == pytest.approx(build["target_top"]["share"], abs=0.03)
    assert all(row["max_abs_error"] < 0.06 for row in cal["layers"])  # picks a token: 2; per expert within 0.06


def test_pipeline_places_between_a_third_and_half_of_the_experts(work):
    pipe = json.loads((work / "pipeline.json").read_text())["figures"]
    assert 1 / 3 <= pipe["gpu_expert_fraction"] <= 1 / 2
    ex = pipe["solve"]["summary"]["experts"]
    assert ex["gpu_share_routed"] > pipe["gpu_expert_fraction"]  # the skew: hot experts placed
    assert {"n_cpu_moe", "uniform"} <= set(ex["baselines"])
    assert np.asarray(pipe["routed_shares"]).shape == (2, 8)


def test_ours_measures_speed_memory_and_the_routed_share(work):
    ours = json.loads((work / "ours.json").read_text())["figures"]
    assert ours["decode_tok_s"]["256"] > 0 and ours["prefill_tok_s"] > 0
    assert ours["host_peak_rss_bytes"] > 0 and ours["load_to_first_token_s"] > 0
    planned = json.loads((work / "pipeline.json").read_text())["figures"]["solve"]["summary"]["experts"]
    assert ours["gpu_share_routed_measured"] == pytest.approx(planned["gpu_share_routed"], abs=0.15)


def test_report_with_a_recorded_llamacpp_stage(work, tmp_path):
    from bench import bench_moe, record

    lc = {"budget_for_weights_bytes": 1e6, "n_cpu_moe": 1, "gpu_share_routed": 0.4,
          "llama.cpp -ngl 99 --n-cpu-moe 1": {"decode_tok_s": {"32": 100.0, "256": 100.0}, "prefill_tok_s": 1e3,
                                              "load_to_first_token_s": 1.0, "host_peak_rss_bytes": 1e6,
                                              "gpu_peak_bytes": 1e6},
          "llama.cpp all on the GPU": {"error": "out of memory"}}
    record.write_result(work / "llamacpp.json", lc, machine_info=record.machine())
    out = tmp_path / "r.json"
    bench_moe.main(["--stage", "report", "--shape", "tiny", "--work", str(work.parent), "--out", str(out)])
    fig = record.read(out)["figures"]
    assert list(fig["systems"]) == ["hybrid", "llama.cpp -ngl 99 --n-cpu-moe 1"]
    ours = json.loads((work / "ours.json").read_text())["figures"]
    g = fig["goals"]
    assert g["decode_vs_n_cpu_moe"] == pytest.approx(ours["decode_tok_s"]["256"] / 100.0)
    assert g["gpu_share_vs_n_cpu_moe"] == pytest.approx(fig["gpu_share_routed"]["ours_measured_decode"] / 0.4)
    assert g["host_rss_vs_file"] == pytest.approx(ours["host_peak_rss_bytes"] / ours["gguf_bytes"])
    assert "| llama.cpp -ngl 99 --n-cpu-moe 1 | 100.00 / 100.00 | 1000 |" in out.with_suffix(".md").read_text()
    # another run of ours kept as ours.<label>.json: a row of its own; the goals stay ours.json's
    other = json.loads((work / "ours.json").read_text())
    other["figures"]["decode_tok_s"] = {"32": 7.0, "256": 8.0}
    (work / "ours.no-expert-predictors.json").write_text(json.dumps(other))
    try:
        bench_moe.main(["--stage", "report", "--shape", "tiny", "--work", str(work.parent), "--out", str(out)])
    finally:
        (work / "ours.no-expert-predictors.json").unlink()
    fig2 = record.read(out)["figures"]
    assert list(fig2["systems"])[-1] == "hybrid, no expert predictors"
    assert fig2["systems"]["hybrid, no expert predictors"]["decode_tok_s"] == {"32": 7.0, "256": 8.0}
    assert fig2["goals"]["decode_vs_n_cpu_moe"] == pytest.approx(g["decode_vs_n_cpu_moe"])
    assert "| hybrid, no expert predictors | 7.00 / 8.00 |" in out.with_suffix(".md").read_text()


def test_n_cpu_moe_probe_finds_the_smallest_n_that_fits():
    from bench.bench_moe import n_cpu_moe_share, smallest_fitting

    probe = lambda n: {"gpu_peak_bytes": 10e9 - 0.5e9 * n}  # noqa: E731  each layer's experts 0.5 GB
    assert smallest_fitting(probe, 3, 48, 6e9)[0] == 8  # from below the answer: walks up
    n, runs = smallest_fitting(probe, 20, 48, 6e9)  # from above: walks down
    assert n == 8 and 7 in runs
    assert smallest_fitting(lambda n: {"error": "x"}, 3, 4, 6e9)[0] is None
    shares = np.full((4, 8), 1 / 8)
    assert n_cpu_moe_share(shares, 1) == pytest.approx(0.75)


def test_sparse_mixtral_build_fires_near_turbosparse(tmp_path):
    """The dReLU variant, arch llama with experts: our reader sees drelu, ~15% of a routed expert's neurons fire."""
    from hotneurons.models.open import open_model

    from bench.moe_gguf import DRELU_ACTIVE, write_model

    info = write_model("tiny-mixtral", tmp_path / "m.gguf", "cpu", sparse=True, calibration_tokens=512, seq=128,
                       predictor_rank=8, log=lambda *_: None)
    assert info["calibration"]["mean_fired"] == pytest.approx(DRELU_ACTIVE, abs=0.04)
    _, _, cfg, act = open_model(str(tmp_path / "m.gguf"))
    assert (cfg.model_type, str(act), cfg.n_experts) == ("mixtral", "drelu", 8)
    # the exact expert predictors beside it: nearly every firing gate marked, well under all neurons
    pred = info["expert_predictors"]
    assert pred["rank"] == 9 and pred["recall"] > 0.99 and pred["marked"] < 0.6


def test_sparse_mixtral_decodes_with_its_expert_predictors(tmp_path):
    """The runtime with the build's predictors attached (as bench_moe's ours stage and a run's
    predictors/expert_predictors.safetensors attach them) computes nearly all the firing cold neurons it computes
    without them (recall > 0.99 at build), and says so in its stats."""
    import numpy as np
    from hotneurons.runtime.config import RuntimeConfig
    from hotneurons.runtime.expert_predictors import attach
    from hotneurons.runtime.generate import generate
    from hotneurons.runtime.load import load_source_runtime

    from bench.moe_gguf import predictors_path, write_model

    gguf = tmp_path / "m.gguf"
    write_model("tiny-mixtral", gguf, "cpu", sparse=True, calibration_tokens=512, seq=128, predictor_rank=8,
                log=lambda *_: None)
    mask = np.zeros((2, 8), bool)
    mask[:, :3] = True  # experts 3.. cold
    prompt = list(range(5, 21))
    active = {}
    for with_pred in (False, True):
        rt = load_source_runtime(None, None, RuntimeConfig(device="cpu", ctx=256), model=str(gguf), placement=mask)
        if with_pred:
            rt.expert_predictors = attach(rt.ffns, predictors_path(gguf))
        stats = generate(rt, prompt, 12, stop_at_eos=False).stats
        active[with_pred] = sum(f.cold_active for f in rt.ffns)
        assert stats["experts"]["expert_predictors"] == rt.expert_predictors
    assert rt.expert_predictors["layers"] == 2 and rt.expert_predictors["predictors"] == 16
    assert 0.98 * active[False] <= active[True] <= active[False]
    # a run's predictors/expert_predictors.safetensors is found by the loader (pi-generate, pi-serve); off by config
    from hotneurons.artifacts.expert_predictors import path_in

    path_in(tmp_path / "run").parent.mkdir(parents=True)
    predictors_path(gguf).rename(path_in(tmp_path / "run"))
    for use in (True, False):
        rt = load_source_runtime(tmp_path / "run", None, RuntimeConfig(device="cpu", ctx=256, expert_predictors=use),
                                 model=str(gguf), placement=mask)
        assert (rt.expert_predictors is not None) == use and (rt.ffns[0].expert_predictors is not None) == use


def test_sparse_variant_stages_with_expert_predictors(tmp_path):
    """bench_moe --sparse on the CPU: the pipeline puts the build's exact expert predictors in the run, ours runs
    with them (or without: --no-expert-predictors), fit-predictors replaces them by pi-train-predictors' fit on the
    experts' inputs (held-out recall at its 0.99 target), and ours runs with those."""
    from bench import bench_moe

    common = ["--shape", "tiny-mixtral", "--sparse", "--device", "cpu", "--work", str(tmp_path), "--ctx", "1024",
              "--profile-tokens", "1024", "--predictor-rank", "8"]
    d = tmp_path / "tiny-mixtral-calibrated-sparse"

    def figures(stage):
        return json.loads((d / f"{stage}.json").read_text())["figures"]

    bench_moe.main(["--stage", "build", *common, "--calibration-tokens", "512", "--seq", "128"])
    bench_moe.main(["--stage", "pipeline", *common, "--reserve", "0"])
    assert (d / "run" / "predictors" / "expert_predictors.safetensors").exists()
    bench_moe.main(["--stage", "ours", *common, "--no-expert-predictors"])
    assert figures("ours")["expert_predictors"] is None
    bench_moe.main(["--stage", "ours", *common])
    assert figures("ours")["expert_predictors"]["rank"] == 9  # the build's exact ones
    bench_moe.main(["--stage", "fit-predictors", *common])
    fit = figures("fit-predictors")["summary"]
    assert fit["predictors"] == 16 and fit["min_recall"] >= 0.99 and fit["mean_marked"] < 0.6
    bench_moe.main(["--stage", "ours", *common])
    ours = figures("ours")
    assert ours["expert_predictors"]["rank"] == 8 and 0 < ours["cold_firing_share"] < 0.3


def test_prompt_latency_bench_on_the_tiny_moe(work, tmp_path, monkeypatch):
    """bench/prompt_latency.py on the tiny variant (CPU, the device path allowed there): per length the steps' and
    each threshold's prefill times; both paths' last logits agree (routed experts exact either way, up to the cold
    experts' Q8_0 rounding of x at decode); the runtime's threshold is left as it was."""
    from hotneurons.runtime import moe_prefill

    from bench import prompt_latency

    monkeypatch.setattr(moe_prefill, "DEVICE_TYPES", ("cuda", "cpu"))
    keep = moe_prefill.OFFLOAD_TOKENS
    calls = []
    real = moe_prefill.cold_on_device
    monkeypatch.setattr(moe_prefill, "cold_on_device", lambda *a: calls.append(1) or real(*a))
    fig = prompt_latency.main(["--moe-dir", str(work), "--device", "cpu", "--ctx", "256", "--lengths", "1,3,6",
                               "--offload-tokens", "64,2", "--reps", "1", "--out", str(tmp_path / "p.json")])
    assert moe_prefill.OFFLOAD_TOKENS == keep and calls  # the device path ran (T >= 2 at threshold 2)
    assert set(fig["lengths"]) == {"1", "3", "6"}
    for T, row in fig["lengths"].items():
        assert row["steps_s"] > 0 and set(row["prefill"]) == {"64", "2"}
        for k, p in row["prefill"].items():
            assert p["prefill_s"] > 0
            assert p["max_abs_logit_diff"] < 1e-3, (T, k, p)
    assert json.loads((tmp_path / "p.json").read_text())["figures"]["ctx"] == 256
