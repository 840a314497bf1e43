"""pi-eval --mode dense on a mixture of experts: a tiny MoE (Qwen3-MoE; Qwen2-MoE with its shared expert) written as
an F16 GGUF, profiled with pi-profile, evaluated layer by layer from the file (models/streamed_experts.ExpertsModel);
its perplexity equals the one computed from transformers' logits on the weights the file holds (float32 both, other
orders of summation: relative 1e-5). The modes that mask neurons are refused in one line naming what to run.
"""

from __future__ import annotations

import json
import math

import pytest
import tiny
import torch
from click.testing import CliRunner
from hotneurons.common.corpus import iter_texts, token_batches

ARGS = dict(tokens=300, seq_len=40, batch_size=2)


def _ok(res):
    assert res.exit_code == 0, res.output
    return res


@pytest.fixture(scope="module", params=["qwen3-moe", "qwen2-moe"])
def moe_run(request, tiny_model_dir, text_corpus, tmp_path_factory):
    """(run dir, HF model with the file's fp16-rounded weights)."""
    from hotneurons.export import gguf_model as gm
    from hotneurons.models import ModelConfig
    from hotneurons.profiler.cli import main as profile
    from test_models_moe import _fp16_reference
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir(request.param), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    root = tmp_path_factory.mktemp(request.param)
    path, run = root / "m.gguf", root / "run"
    gm.write_moe_gguf(hf, path, gm.vocab_from_tokenizer(tiny.byte_tokenizer(), tiny.VOCAB))
    _ok(CliRunner().invoke(profile, ["--model", str(path), "--dataset", str(text_corpus), "--tokens", "300",
                                     "--seq-len", "32", "--batch-size", "2", "--calibration-tokens", "64",
                                     "--out", str(run), "--quiet"]))
    return run, _fp16_reference(hf, ModelConfig.from_hf(hf.config))


def _hf_ppl(hf, corpus) -> tuple[float, int]:
    """Perplexity from transformers' logits, log-softmax in float64, over the batches pi-eval reads."""
    batches = list(token_batches(tiny.byte_tokenizer(), iter_texts(str(corpus)), ARGS["seq_len"],
                                 ARGS["batch_size"], ARGS["tokens"]))
    nll, n = 0.0, 0
    with torch.no_grad():
        for ids in batches:
            lp = torch.log_softmax(hf(input_ids=ids).logits[:, :-1].double(), -1)  # (b, s - 1, vocab)
            nll -= float(lp.gather(-1, ids[:, 1:, None]).sum())
            n += ids[:, 1:].numel()
    return math.exp(nll / n), n


def test_dense_perplexity_equals_transformers(moe_run, text_corpus):
    from hotneurons.predictors.cli import eval_main

    run, hf = moe_run
    res = _ok(CliRunner().invoke(eval_main, ["--run", str(run), "--dataset", str(text_corpus), "--device", "cpu",
                                             "--tokens", str(ARGS["tokens"]), "--seq-len", str(ARGS["seq_len"]),
                                             "--batch-size", str(ARGS["batch_size"]), "--json", "--quiet"]))
    rep = json.loads(res.stdout)
    assert list(rep["modes"]) == ["dense"]  # the default on a mixture of experts
    d = rep["modes"]["dense"]
    ref, n = _hf_ppl(hf, text_corpus)
    assert d["tokens"] == n
    assert d["perplexity"] == pytest.approx(ref, rel=1e-5)
    # nothing masked; the true sparsity counts the routed experts' values at the profile's taus
    assert d["ffn_sparsity"] == 0.0 and d["recall"] == 1.0 and 0.0 < d["true_sparsity"] < 1.0
    assert len(d["per_layer"]["computed_share"]) == hf.config.num_hidden_layers
    assert json.loads((run / "eval" / "eval.json").read_text())["modes"]["dense"]["perplexity"] == d["perplexity"]


@pytest.mark.parametrize("args, named", [(["--mode", "oracle"], "oracle"),
                                         (["--mode", "dense", "--mode", "predictor"], "predictor"),
                                         (["--row-format", "q8_0"], "--row-format"),
                                         (["--criterion", "h"], "--criterion")])
def test_masking_modes_refused_in_one_line(moe_run, text_corpus, args, named):
    from hotneurons.predictors.cli import eval_main

    run, _ = moe_run
    res = CliRunner().invoke(eval_main, ["--run", str(run), "--dataset", str(text_corpus), *args])
    msg = res.output.strip()
    assert res.exit_code == 1 and "\n" not in msg, msg
    assert all(p in msg for p in ("mixture of experts", named, "--mode dense", "pi-generate --run")), msg
    assert not (run / "eval" / "eval.json").exists() or "oracle" not in (run / "eval" / "eval.json").read_text()


def test_whole_model_refused(moe_run, text_corpus):
    from hotneurons.predictors.cli import eval_main

    run, _ = moe_run
    res = CliRunner().invoke(eval_main, ["--run", str(run), "--dataset", str(text_corpus), "--whole-model"])
    assert res.exit_code == 1 and "drop --whole-model" in res.output and "\n" not in res.output.strip()
