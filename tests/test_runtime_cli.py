"""pi-generate from a run directory: --json output, modes, and refusals of bad inputs."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tiny
from click.testing import CliRunner
from hotneurons.common import artifacts
from hotneurons.models.family import load_model
from hotneurons.runtime.cli import SHARE_WARN_STEPS, format_stats, main, share_warning


def make_run(run, folder, family="opt", threshold=-1e30, predictors=True):
    """RUN/placement (half the neurons per layer on the device) and RUN/predictors (firing everywhere with the
    default threshold), written by hand so the test needs no profiling or training."""
    lm = load_model(str(folder), device="cpu", dtype="float32", activation=tiny.ACTIVATION_OVERRIDE.get(family))
    info, L, n = lm.info, lm.info["n_layers"], lm.info["n_neurons"]
    rng = np.random.default_rng(0)
    rows = [(i, j, bool(g)) for i in range(L) for j, g in enumerate(rng.random(n) < 0.5)]
    (run / "placement").mkdir(parents=True)
    pd.DataFrame(rows, columns=["layer", "neuron", "gpu"]).to_parquet(run / "placement" / "placement.parquet")
    artifacts.write_json(run / "placement" / "meta.json", {**artifacts.base_meta("placement"), "model": info})
    if predictors:
        tiny.write_predictors(run, info, threshold)
    return run


def write_summary(run, **changes):
    """RUN/placement/summary.json as pi-solve writes it (schema and all), solved for a small synthetic profile in a
    folder of its own, with `changes` (flags: ctx=...; or top-level fields) applied: the runtime reads only a few of
    its figures, and refuses a summary that breaks the schema."""
    import dataclasses

    from hotneurons.artifacts.placement import PlacementSummary
    from hotneurons.common.hardware import get_hardware
    from hotneurons.solver.place import solve_placement
    from hotneurons.solver.synthetic import write_synthetic_profile

    other = run.parent / (run.name + "-solved")
    write_synthetic_profile(other, "llama-7b", tokens=1000, n_layers=2)
    s = solve_placement(other, get_hardware("rtx4090"), vram_bytes=8 * 10**9, ctx=64, write=False)
    if "ctx" in changes:
        s.flags = dataclasses.replace(s.flags, ctx=changes.pop("ctx"))
    for k, v in changes.items():
        setattr(s, k, v)
    s.save(run / "placement" / "summary.json")
    return PlacementSummary.load(run / "placement" / "summary.json")


def invoke(*args):
    return CliRunner().invoke(main, ["--device", "cpu", "-n", "6", "--prompt", "The quick brown fox", *map(str, args)])


@pytest.fixture(scope="module")
def opt_run(tiny_model_dir, tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("run") / "opt", tiny_model_dir("opt"))


def test_json_output_and_modes_agree(opt_run):
    out = {}
    for name, extra in {"hybrid": [], "nopred": ["--no-predictor"], "oracle": ["--oracle"],
                        "split": ["--mode", "layer-split", "--gpu-layers", "1"]}.items():
        r = invoke("--run", opt_run, "--json", *extra)
        assert r.exit_code == 0, r.output
        out[name] = json.loads(r.stdout.strip().splitlines()[-1])
    s = out["hybrid"]["stats"]
    assert set(s) >= {"prefill_tokens_per_s", "decode_tokens_per_s", "ffn_sparsity", "gpu_activation_share",
                      "bytes_gpu", "bytes_cpu", "mode"}
    assert s["mode"] == "hybrid" and s["ffn_sparsity"] == 0.0 and s["bytes_cpu"] > 0
    assert out["nopred"]["stats"]["mode"] == "dense" and out["oracle"]["stats"]["mode"] == "oracle"
    assert out["split"]["stats"]["mode"] == "layer-split"
    # same bf16 cold rows everywhere; ReLU oracle skipping is lossless; a predictor firing everywhere is dense
    assert out["hybrid"]["token_ids"] == out["nopred"]["token_ids"] == out["oracle"]["token_ids"]
    assert len(out["hybrid"]["token_ids"]) == 6 and isinstance(out["hybrid"]["text"], str)


def test_text_streams_then_stats(opt_run):
    r = invoke("--run", opt_run, "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "3")
    assert r.exit_code == 0, r.output
    assert "decode" in r.output and "tok/s" in r.output


def test_refuses_artifacts_of_another_model(opt_run, tiny_model_dir, tmp_path):
    other = make_run(tmp_path / "other", tiny_model_dir("llama-reglu"), "llama-reglu")
    for stage in ("placement", "predictors"):
        meta = artifacts.read_json(opt_run / stage / "meta.json")
        artifacts.write_json(other / stage / "meta.json", {**artifacts.read_json(other / stage / "meta.json"),
                                                            "model": meta["model"]})
        r = invoke("--run", other, "--model", str(tiny_model_dir("llama-reglu")))
        assert r.exit_code != 0 and "was made for model" in r.output, r.output
        meta_other = artifacts.read_json(tmp_path / "other" / stage / "meta.json")
        meta_other["model"] = load_model(str(tiny_model_dir("llama-reglu")), device="cpu").info
        artifacts.write_json(other / stage / "meta.json", meta_other)


def test_missing_predictors(tiny_model_dir, tmp_path):
    run = make_run(tmp_path / "run", tiny_model_dir("falcon-relu"), "falcon-relu", predictors=False)
    r = invoke("--run", run)
    assert r.exit_code != 0 and "pi-train-predictors" in r.output and "--no-predictor" in r.output
    r = invoke("--run", run, "--no-predictor", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout.strip().splitlines()[-1])["stats"]["mode"] == "dense"


def test_budget_too_small_names_the_numbers(opt_run):
    r = invoke("--run", opt_run, "--vram", "1kB")
    assert r.exit_code != 0 and "the layout needs" in r.output and "1,000 B" in r.output, r.output
    r = invoke("--run", opt_run, "--mode", "layer-split")
    assert r.exit_code != 0 and "--vram" in r.output


def test_prompt_longer_than_context(opt_run):
    r = CliRunner().invoke(main, ["--device", "cpu", "--run", str(opt_run), "--prompt", "x" * 400])
    assert r.exit_code != 0 and "context is 256" in r.output, r.output


def test_no_run_no_model():
    r = CliRunner().invoke(main, ["--prompt", "hi"])
    assert r.exit_code != 0 and "--run" in r.output


def test_interactive_chat_keeps_the_conversation(opt_run, monkeypatch):
    """-i: each line is a user turn; the prompt of turn 2 holds turn 1 and its answer; an empty line ends."""
    import hotneurons.runtime.generate as gen

    prompts = []
    real = gen.prompt_ids

    def spy(rt, prompt, chat=False):
        prompts.append((prompt if isinstance(prompt, str) else [dict(m) for m in prompt], chat))
        return real(rt, prompt, chat)

    monkeypatch.setattr(gen, "prompt_ids", spy)
    r = CliRunner().invoke(main, ["--run", str(opt_run), "--device", "cpu", "-n", "4", "-i"],
                           input="Hello there\nAnd again\n\nnot read\n")
    assert r.exit_code == 0, r.output
    assert r.output.count("decode") == 2  # one stats line per turn
    assert [c for _, c in prompts] == [True, True]
    first, second = prompts[0][0], prompts[1][0]
    assert first == [{"role": "user", "content": "Hello there"}]
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    assert second[0] == first[0] and second[2]["content"] == "And again"


def test_decode_path_flags_give_the_same_tokens(tiny_model_dir, tmp_path):
    """--hf-decode (HF decoder layers) and --no-cuda-graphs (eager) against the default static decoder."""
    run = make_run(tmp_path / "llama", tiny_model_dir("llama-reglu"), family="llama-reglu")
    out = {}
    for name, extra in {"static": [], "hf": ["--hf-decode"], "eager": ["--no-cuda-graphs"]}.items():
        r = invoke("--run", run, "--json", *extra)
        assert r.exit_code == 0, r.output
        out[name] = json.loads(r.stdout.strip().splitlines()[-1])["token_ids"]
    assert out["static"] == out["hf"] == out["eager"] and len(out["static"]) == 6


def test_static_cache_holds_the_solvers_ctx_and_counts_in_the_budget(tiny_model_dir, tmp_path):
    """The static decoder's KV cache holds the tokens pi-solve reserved room for (--ctx in the placement's summary),
    or --ctx; --vram counts it, and a budget that holds the weights but not the cache names it."""
    run = make_run(tmp_path / "llama", tiny_model_dir("llama-reglu"), family="llama-reglu")
    write_summary(run, ctx=32)
    stats = {}
    for name, extra in {"solved": [], "flag": ["--ctx", 16]}.items():  # a prompt and answer within 16 tokens
        r = invoke("--run", run, "--json", "--prompt", "fox", *extra)
        assert r.exit_code == 0, r.output
        stats[name] = json.loads(r.stdout.strip().splitlines()[-1])["stats"]
    assert stats["solved"]["static_ctx"] == 32 and stats["flag"]["static_ctx"] == 16
    cfg = load_model(str(tiny_model_dir("llama-reglu")), device="cpu", dtype="float32").model.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    hd = cfg.hidden_size // cfg.num_attention_heads
    # per position: RoPE's cos and sin rows (float32), the cache slot's number (int64) and the fused step's mask slot
    tables = 2 * hd * 4 + 8 + 4
    assert stats["solved"]["bytes_gpu"] - stats["flag"]["bytes_gpu"] == 16 * (per_token + tables)  # float32, CPU
    weights = stats["flag"]["bytes_gpu"] - 16 * per_token
    r = invoke("--run", run, "--vram", f"{weights + 8 * per_token}B", "--ctx", 16, "--prompt", "fox")
    assert r.exit_code != 0 and "static KV cache of 16 tokens" in r.output, r.output
    r = invoke("--run", run, "--ctx", 0)
    assert r.exit_code != 0 and "--ctx 0" in r.output, r.output


def test_stats_compare_decode_gpu_share_with_the_profile(opt_run, tmp_path):
    """With pi-solve's summary in the run, stats carry the profile's GPU share of activations, and the text output
    warns when decode's falls well below it (the profiled corpus fires other neurons than this text)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(opt_run, run)
    r = invoke("--run", run, "--json")
    assert json.loads(r.stdout.strip().splitlines()[-1])["stats"]["profile_gpu_activation_share"] is None
    write_summary(run, gpu_activation_share=0.99)
    r = CliRunner().invoke(main, ["--device", "cpu", "-n", "20", "--prompt", "The quick brown fox", "--run", str(run)])
    assert r.exit_code == 0, r.output
    # half the neurons on the device and a predictor firing everywhere: decode's share is ~0.5
    assert "(the profile's: 0.990)" in r.output and "warning: decode put" in r.output and "pi-profile" in r.output


def test_stats_say_where_the_device_bytes_are_and_the_plan():
    s = {"mode": "hybrid", "decode_steps": 4, "gpu_activation_share": 0.2, "profile_gpu_activation_share": 0.2,
         "device": "cpu", "dtype": "float32", "cold_dtype": "bf16", "threads": 2, "prefill_tokens_per_s": 1.0,
         "decode_tokens_per_s": 2.0, "ffn_sparsity": 0.2, "bytes_gpu": 496_100_000, "bytes_cpu": 128_000_000,
         "plan_bytes_gpu": 261_075_072, "plan_dtype": "fp16"}
    assert ("496.1 MB on the CPU device in float32 (the plan counts 261.1 MB in fp16: 2 bytes a weight, not 4), "
            "128.0 MB cold in CPU RAM") in format_stats(s)
    cuda = format_stats({**s, "device": "cuda:0", "dtype": "float16", "bytes_gpu": 260_000_000})
    assert "260.0 MB on the cuda:0 device in float16 (the plan counts 261.1 MB in fp16)," in cuda
    assert "MB on the CPU device in float32, 128.0 MB" in format_stats({**s, "plan_bytes_gpu": None})


def test_share_warning_rule():
    s = {"mode": "hybrid", "decode_steps": SHARE_WARN_STEPS, "gpu_activation_share": 0.5,
         "profile_gpu_activation_share": 0.7, "device": "cpu", "dtype": "float32", "cold_dtype": "bf16",
         "threads": 2, "prefill_tokens_per_s": 1.0, "decode_tokens_per_s": 2.0, "ffn_sparsity": 0.9,
         "bytes_gpu": 0, "bytes_cpu": 0}
    assert "50%" in share_warning(s) and "70%" in share_warning(s) and "warning:" in format_stats(s)
    assert share_warning({**s, "gpu_activation_share": 0.57}) is None  # above 0.8 of the profile's
    assert share_warning({**s, "decode_steps": SHARE_WARN_STEPS - 1}) is None  # too few tokens to say
    assert share_warning({**s, "mode": "dense"}) is None
    assert share_warning({**s, "profile_gpu_activation_share": None}) is None
    assert "warning" not in format_stats({**s, "profile_gpu_activation_share": None})


def test_dtype_choices_are_the_formats_the_kernels_read():
    """--cold-dtype and --gpu-dtype offer what the CPU and GPU kernels read (weights/formats.py), Q4_1 on both."""
    from hotneurons.kernels.names import COLD_DTYPES
    from hotneurons.weights.formats import FORMATS

    choices = {p.name: set(p.type.choices) for p in main.params if p.name in ("cold_dtype", "gpu_dtype")}
    assert choices["gpu_dtype"] == {"auto"} | {str(f) for f, s in FORMATS.items() if s.gpu_kernel}
    assert choices["cold_dtype"] == {"auto", *COLD_DTYPES}
    assert set(COLD_DTYPES) == {str(f) for f, s in FORMATS.items() if s.cpu_kernel}
    assert "q4_1" in choices["gpu_dtype"] and "q4_1" in choices["cold_dtype"]


@pytest.mark.parametrize("module,command", [
    ("hotneurons.runtime.cli", "main"), ("hotneurons.server.cli", "main"), ("hotneurons.profiler.cli", "main"),
    ("hotneurons.solver.cli", "main"), ("hotneurons.predictors.cli", "train_main"),
    ("hotneurons.predictors.cli", "eval_main"), ("hotneurons.relufy.cli", "main"), ("hotneurons.export.cli", "main")])
def test_help_imports_no_torch(module, command):
    """Every stage's CLI parses its flags before torch, numba or transformers load: --help answers at once."""
    import subprocess
    import sys

    code = (f"import sys; from {module} import {command} as main; main(['--help'], standalone_mode=False); "
            f"print(sorted(m for m in ('torch', 'numba', 'transformers', 'uvicorn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]", out


def test_pi_bench_help_imports_no_torch():
    """pi-bench (argparse) reads its flags before torch loads: its stages import their modules when they run."""
    import subprocess
    import sys

    code = ("import sys\nfrom bench.pi_bench import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n"
            "    pass\nprint(sorted(m for m in ('torch', 'numba', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout  # the checkout's root: bench imports there
    assert out.strip().splitlines()[-1] == "[]", out
