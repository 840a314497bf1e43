"""bench/bench_gated70b.py on its CPU smoke shape: the SwiGLU model calibrated to its pass rates, the pipeline with
the gate criterion (no predictors), the runtime's gate and dense variants, the report's systems and goals."""

import json

import numpy as np
import pytest


@pytest.mark.slow
def test_smoke_stages_end_to_end(tmp_path):
    from bench import bench_gated70b as g

    rates = tmp_path / "rates.json"
    rng = np.random.default_rng(0)
    rates.write_text(json.dumps({"rates": np.clip(rng.beta(2, 2, 500), 0.01, 0.99).tolist()}))
    common = ["--device", "cpu", "--shape", "tiny", "--layers", "2", "--ctx", "1024", "--vram", "1100MiB", "--work",
              str(tmp_path / "w"), "--profile-tokens", "1024", "--calibration-tokens", "512", "--reserve", "0",
              "--hardware", "rtx4090", "--rates", str(rates), "--no-measure"]
    for stage in ("build", "pipeline"):
        g.main(["--stage", stage, *common])
    build = json.loads((tmp_path / "w" / "build.json").read_text())["figures"]
    for row in build["calibration"]["layers"]:  # the gate passes its shift as often as the rates say
        assert row["fired_as_stored"] == pytest.approx(row["target_mean"], abs=0.03)
    meta = json.loads((tmp_path / "w" / "run" / "profile" / "meta.json").read_text())
    assert meta["model"]["activation"] == "swiglu" and meta["gated"]["criterion"] == "gate"
    g.main(["--stage", "ours", "--variants", "gate,gate@h,dense", *common])
    g.main(["--stage", "report", "--out", str(tmp_path / "r.json"), *common])
    fig = json.loads((tmp_path / "r.json").read_text())["figures"]
    assert set(fig["systems"]) == {"ours gate", "ours gate@h", "ours dense"}
    assert fig["systems"]["ours gate"]["ffn_sparsity"] == pytest.approx(0.5, abs=0.1)
    assert fig["systems"]["ours dense"]["ffn_sparsity"] == 0.0
    assert fig["goals"]["gate_vs_sparsity_off"] > 0 and fig["goals"]["gate@h_vs_sparsity_off"] > 0
    assert "| ours gate |" in (tmp_path / "r.md").read_text()


def test_report_ratios():
    from bench.bench_gated70b import markdown, report

    def ours(tok_s, sp):
        return {"decode_tok_s": {"32": tok_s, "256": tok_s}, "prefill_tok_s": 100.0, "ffn_sparsity": sp,
                "gpu_activation_share": 0.6, "bytes_gpu": 1, "bytes_cpu": 2, "gguf_bytes": 40e9,
                "load_to_first_token_s": 50.0, "host_peak_rss_bytes": 20e9, "gpu_peak_bytes": 24e9}
    stages = {"build": {"shape": "llama-3-70b", "layers": 80, "calibration": {}, "rates": None},
              "pipeline": {"solve": {"summary": {"flags": {"vram_bytes": 25769803776}}}, "skew": {}},
              "ours": {"stage": "ours", "gate": ours(9.0, 0.5), "dense": ours(6.0, 0.0), "gpu-gate": ours(30.0, 0.5),
                       "gpu-dense": ours(20.0, 0.0)},
              "llamacpp": {"llama.cpp -ngl 40": {"decode_tok_s": {"32": 3.0, "256": 3.0}},
                           "llama.cpp all layers on the GPU": {"decode_tok_s": {"32": 24.0, "256": 24.0}}}}
    fig = report(stages)
    goals = fig["goals"]
    assert goals["gate_vs_layer_split"] == pytest.approx(3.0)
    assert goals["gate_vs_sparsity_off"] == pytest.approx(1.5)
    assert goals["gpu-gate_vs_gpu_dense"] == pytest.approx(1.5)
    assert "| ours gate | 9.00 / 9.00 | 100 | 50.0% |" in markdown(fig)
