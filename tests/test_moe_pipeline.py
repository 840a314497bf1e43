"""A mixture of experts through the CLI as a user runs it: a tiny Qwen3-MoE written as an F16 GGUF -> pi-profile ->
pi-solve (a VRAM budget that holds about half the experts) -> pi-generate --run RUN --json, whose greedy tokens equal
transformers' on the weights the file holds and whose stats report decode's GPU share of routed expert work beside the
placement's; pi-serve on the run; the stages that do not apply to experts (pi-train-predictors, pi-eval's masking
modes) and placements the runtime cannot run (neuron groups inside experts, another model's) refused in one line.
"""

from __future__ import annotations

import json
import shutil

import pytest
import tiny
import torch
from click.testing import CliRunner

PROMPT = "The quick brown fox"
NEW = 8
CTX = 256  # pi-solve --ctx: the runtime's KV cache comes from the placement's flags


def _gguf(hf, path):
    """write_moe_gguf's file with the byte tokenizer's vocabulary, so that the runtime reads the file's own
    tokenizer, as a user's."""
    from hotneurons.export import gguf_model as gm

    gm.write_moe_gguf(hf, path, gm.vocab_from_tokenizer(tiny.byte_tokenizer(), tiny.VOCAB))
    return path


def _ok(res):
    assert res.exit_code == 0, res.output
    return res


@pytest.fixture(scope="module")
def pipeline(tiny_model_dir, text_corpus, tmp_path_factory):
    """(run dir, GGUF path, HF model with the file's fp16-rounded weights, solve summary)."""
    from hotneurons.models import ModelConfig
    from hotneurons.profiler.cli import main as profile
    from hotneurons.solver.cli import main as solve
    from test_models_moe import _fp16_reference
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen3-moe"), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    root = tmp_path_factory.mktemp("moe-pipeline")
    path, run = _gguf(hf, root / "m.gguf"), root / "run"
    _ok(CliRunner().invoke(profile, ["--model", str(path), "--dataset", str(text_corpus), "--tokens", "400",
                                     "--seq-len", "32", "--batch-size", "2", "--calibration-tokens", "64",
                                     "--out", str(run), "--quiet"]))

    def solved(vram):
        res = _ok(CliRunner().invoke(solve, ["--run", str(run), "--hardware", "rtx4090", "--vram", vram,
                                             "--reserve", "0", "--ctx", str(CTX), "--time-limit", "20", "--json"]))
        return json.loads(res.stdout)

    full = solved("10MB")  # every expert fits: the memory beside the experts, and one expert's bytes
    gpu = full["memory"]["gpu"]
    # room for 3.5 of the 2 x 4 experts: about half, the layers split unevenly (the measured share then depends on
    # which experts the tokens pick)
    half = gpu["total"] - gpu["experts"] + int(full["experts"]["expert_bytes"][0] * 3.5)
    return run, path, _fp16_reference(hf, ModelConfig.from_hf(hf.config)), solved(f"{half}B")


def _hf_greedy(hf, ids):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=NEW, do_sample=False)
    return out[0, len(ids):].tolist()


def _prompt_ids(path):
    from hotneurons.weights.gguf_source import GGUFSource

    with GGUFSource(path) as src:
        ids = list(src.tokenizer()(PROMPT)["input_ids"])
    assert ids == list(tiny.byte_tokenizer()(PROMPT)["input_ids"])
    return ids


def _routed_share(hf, ids, steps, placed):
    """HF's own router on the decode steps' inputs (the last `steps` of `ids`): the share of their (token, expert)
    pairs whose expert the placement (layers, experts) puts on the GPU."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids]), output_router_logits=True).router_logits  # per layer (T, E)
    picks = [lg.reshape(len(ids), -1)[-steps:].topk(2, dim=-1).indices for lg in logits]  # per layer (steps, k)
    return sum(int(placed[i][p].sum()) for i, p in enumerate(picks)) / sum(p.numel() for p in picks)


def test_pi_generate_reads_the_expert_placement(pipeline):
    from hotneurons.artifacts.experts import read_expert_placement
    from hotneurons.runtime.cli import main as generate

    run, path, hf, summary = pipeline
    x = summary["experts"]
    assert x["mode"] == "whole experts" and 0 < sum(x["gpu_experts_per_layer"]) < 8
    res = _ok(CliRunner().invoke(generate, ["--run", str(run), "--device", "cpu", "--prompt", PROMPT, "-n", str(NEW),
                                            "--json"]))
    out = json.loads(res.stdout)
    ids = _prompt_ids(path)
    assert out["token_ids"] == _hf_greedy(hf, ids) and len(out["token_ids"]) == NEW
    s = out["stats"]
    info = json.loads((run / "placement" / "meta.json").read_text())["model"]
    placed = torch.from_numpy(read_expert_placement(run, info).gpu)  # (layers, experts)
    e = s["experts"]
    assert e["gpu_experts"] == placed.sum() == sum(x["gpu_experts_per_layer"]) and e["experts"] == 8
    assert e["placement"] == str(run / "placement") and e["routed_pairs"] == s["decode_steps"] * 2 * 2  # k=2, L=2
    assert e["plan_gpu_share_routed"] == pytest.approx(x["gpu_share_routed"])
    steps = s["decode_steps"]  # the generated tokens fed back, all but the last
    want = _routed_share(hf, ids + out["token_ids"][:steps], steps, placed)
    assert e["gpu_share_routed"] == pytest.approx(want) and s["gpu_activation_share"] == pytest.approx(want)
    assert s["profile_gpu_activation_share"] == pytest.approx(x["gpu_share_routed"])
    assert s["static_ctx"] == CTX and s["mode"] == "hybrid"  # no predictors asked for
    res = _ok(CliRunner().invoke(generate, ["--run", str(run), "--device", "cpu", "--prompt", PROMPT, "-n", "4"]))
    assert "GPU share of routed expert work" in res.stderr and "(the placement's: " in res.stderr


def test_pi_serve_on_the_run(pipeline):
    """pi-serve's loader (runtime/cli.open_runtime, as pi-generate's) on the run; a completion equal to generate's."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from hotneurons.runtime.cli import open_runtime, runtime_request
    from hotneurons.runtime.generate import generate
    from hotneurons.server.cli import main as serve_main
    from hotneurons.server.serve import ServeConfig, Server
    from test_serve import request

    run, path, _, _ = pipeline
    flags = serve_main.make_context("pi-serve", ["--run", str(run), "--device", "cpu", "--port", "0"]).params
    rt = open_runtime(runtime_request(flags))  # as server/cli.main loads it
    assert rt.expert_placement == str(run / "placement")
    want = generate(rt, _prompt_ids(path), NEW).text
    with Server(rt, ServeConfig(port=0)) as s:
        status, body = request(s, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": NEW, "temperature": 0})
    assert status == 200, body
    assert want and body["choices"][0]["text"] == want and body["usage"]["completion_tokens"] > 0


def _one_line_error(res, *parts):
    assert res.exit_code == 1, res.output
    msg = res.output.strip()
    assert "\n" not in msg and all(p in msg for p in parts), msg


def test_refusals(pipeline, text_corpus, tmp_path):
    from hotneurons.predictors.cli import eval_main, train_main
    from hotneurons.runtime.cli import main as generate

    run, _, _, _ = pipeline
    _one_line_error(CliRunner().invoke(train_main, ["--run", str(run)]), "mixture of experts", "no predictors",
                    "pi-generate --run")
    _one_line_error(CliRunner().invoke(eval_main, ["--run", str(run), "--dataset", str(text_corpus), "--mode",
                                                   "oracle"]), "mixture of experts", "pi-generate --run")
    args = ["--device", "cpu", "--prompt", PROMPT, "-n", "2"]
    groups = tmp_path / "groups"
    shutil.copytree(run, groups)
    meta = json.loads((groups / "placement/meta.json").read_text())
    meta["experts"]["mode"] = "neuron groups"
    (groups / "placement/meta.json").write_text(json.dumps(meta))
    _one_line_error(CliRunner().invoke(generate, ["--run", str(groups), *args]), "neuron groups inside experts",
                    "--expert-neurons off")
    other = tmp_path / "other"
    shutil.copytree(run, other)
    meta = json.loads((other / "placement/meta.json").read_text())
    meta["model"]["fingerprint"] = "0" * 64
    (other / "placement/meta.json").write_text(json.dumps(meta))
    _one_line_error(CliRunner().invoke(generate, ["--run", str(other), "--model", str(run.parent / "m.gguf"), *args]),
                    "use artifacts of one model")
    bare = tmp_path / "bare"  # a profile alone: every expert that fits on the device, with a warning
    shutil.copytree(run / "profile", bare / "profile")
    with pytest.warns(UserWarning, match="holds no expert placement"):
        res = _ok(CliRunner().invoke(generate, ["--run", str(bare), *args, "--json"]))
    assert json.loads(res.stdout)["stats"]["experts"]["placement"] == "default"
