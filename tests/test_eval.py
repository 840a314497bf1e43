"""pi-eval on tiny random models: hook-masked perplexity against an explicit-matmul reference FFN."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import tiny
import torch
from click.testing import CliRunner
from hotneurons.artifacts.predictor_file import load_predictors
from hotneurons.artifacts.profile import read_profile
from hotneurons.common import artifacts
from hotneurons.common.artifacts import ArtifactError
from hotneurons.common.corpus import iter_texts
from hotneurons.models.family import load_model
from hotneurons.predictors.cli import eval_main
from hotneurons.predictors.evaluate import evaluate, perplexity
from hotneurons.predictors.train import preset, train_predictors
from hotneurons.profiler.profile import ProfileConfig, profile_model, token_batches

EVAL = dict(tokens=300, seq_len=40, batch_size=2, progress=False)


def load(name, model_dir):
    lm = load_model(str(model_dir), dtype="float64", activation=tiny.ACTIVATION_OVERRIDE.get(name))
    if name == "mistral-drelu":
        tiny.make_drelu(lm)
    return lm


def make_run(name, model_dir, corpus, tmp_path, predictors=False):
    lm = load(name, model_dir)
    cfg = ProfileConfig(model=str(model_dir), dataset=str(corpus), tokens=700, seq_len=48, batch_size=3,
                        calibration_tokens=200, samples_per_layer=150, dtype="float64",
                        activation=tiny.ACTIVATION_OVERRIDE.get(name))
    run = tmp_path / "run"
    profile_model(cfg, run, progress=False, lm=lm)
    if predictors:
        train_predictors(run, preset("fast"), device="cpu", progress=False, lm=lm)
    return lm, run


@pytest.mark.parametrize("name", ["opt", "llama-reglu", "mistral-drelu", "falcon-relu"])
def test_relu_oracle_equals_dense(name, tiny_model_dir, text_corpus, tmp_path):
    """ReLU family: the oracle zeroes only exact zeros, so perplexity is bit-identical to dense."""
    lm, run = make_run(name, tiny_model_dir(name), text_corpus, tmp_path)
    rep = evaluate(run, modes=["dense", "oracle"], dataset=str(text_corpus), lm=lm, **EVAL)
    d, o = rep["modes"]["dense"], rep["modes"]["oracle"]
    assert o["perplexity"] == d["perplexity"]
    assert o["ffn_sparsity"] > 0.2 and d["ffn_sparsity"] == 0.0
    assert o["recall"] == 1.0 and d["recall"] == 1.0
    assert (run / "eval" / "eval.json").exists()


def reference_ppl(lm, run, corpus, mode, preds=None, gpu=None) -> float:
    """Perplexity with each layer's FFN replaced by explicit matmuls and an explicit mask (float64)."""
    _, pmeta = read_profile(run)
    taus = pmeta["taus"]
    originals = []
    for i, layer in enumerate(lm.layers):
        mlp = layer.mlp
        originals.append(mlp.forward)

        def fwd(x, mlp=mlp, i=i):
            g = x @ mlp.gate_proj.weight.T  # (b, s, n)
            u = x @ mlp.up_proj.weight.T
            h = torch.nn.functional.silu(g) * u
            if mode == "oracle":
                h = torch.where(h.abs() > taus[i], h, torch.zeros_like(h))
            elif mode in ("predictor", "placement"):
                p = preds.layers[i]
                logits = torch.relu(x @ p.fc1.weight.T) @ p.fc2.weight.T
                m = logits >= float(p.threshold)
                if mode == "placement":
                    m = m | gpu[i]
                h = h * m
            return h @ mlp.down_proj.weight.T
        mlp.forward = fwd
    try:
        batches = list(token_batches(lm.tokenizer, iter_texts(str(corpus)), EVAL["seq_len"], EVAL["batch_size"],
                                     EVAL["tokens"]))
        nll, n = 0.0, 0
        with torch.no_grad():
            for ids in batches:
                logits = lm.model(input_ids=ids).logits
                lp = torch.log_softmax(logits[:, :-1].double(), -1)
                nll -= float(lp.gather(-1, ids[:, 1:, None]).sum())
                n += ids[:, 1:].numel()
    finally:
        for layer, f in zip(lm.layers, originals):
            layer.mlp.forward = f
    return math.exp(nll / n)


@pytest.fixture(scope="module")
def swiglu_run(tiny_model_dir, text_corpus, tmp_path_factory):
    lm, run = make_run("llama-swiglu", tiny_model_dir("llama-swiglu"), text_corpus,
                       tmp_path_factory.mktemp("sw"), predictors=True)
    return lm, run


def write_placement(run, info, seed=0):
    rng = np.random.default_rng(seed)
    L, n = info["n_layers"], info["n_neurons"]
    gpu = rng.random((L, n)) < 0.3
    df = pd.DataFrame({"layer": np.repeat(np.arange(L, dtype=np.int32), n),
                       "neuron": np.tile(np.arange(n, dtype=np.int32), L), "gpu": gpu.reshape(-1)})
    artifacts.write_parquet(run / "placement" / "placement.parquet", df)
    meta = artifacts.base_meta("placement", {})
    meta["model"] = info
    artifacts.write_json(run / "placement" / "meta.json", meta)
    return {i: torch.from_numpy(gpu[i]) for i in range(L)}


def test_modes_match_reference(swiglu_run, text_corpus):
    """SwiGLU: every mode's hook-masked perplexity equals the explicit reference to 1e-9 (float64)."""
    lm, run = swiglu_run
    gpu = write_placement(run, lm.info)
    rep = evaluate(run, dataset=str(text_corpus), lm=lm, **EVAL)
    assert list(rep["modes"]) == ["dense", "oracle", "predictor", "placement"]
    preds = load_predictors(run, lm.info, dtype=torch.float64)
    for mode in ("dense", "oracle", "predictor", "placement"):
        ref = reference_ppl(lm, run, text_corpus, mode, preds, gpu)
        assert rep["modes"][mode]["perplexity"] == pytest.approx(ref, rel=1e-9), mode
    m = rep["modes"]
    assert 0.4 < m["oracle"]["ffn_sparsity"] < 0.6  # calibrated to 0.5 on the profile's text
    assert m["placement"]["ffn_sparsity"] <= m["predictor"]["ffn_sparsity"]  # hot neurons are always computed
    assert m["placement"]["recall"] >= m["predictor"]["recall"]
    assert m["placement"]["gpu_neuron_share"] == pytest.approx(float(torch.stack(list(gpu.values())).double().mean()))
    assert m["dense"]["ppl_vs_dense"] == 0.0
    # a direct check of the counts: the predictor mode's computed share is the mean of its masks
    per = m["predictor"]["per_layer"]["computed_share"]
    assert m["predictor"]["ffn_sparsity"] == pytest.approx(1 - np.mean(per), abs=1e-5)


def test_eval_cli_and_errors(swiglu_run, text_corpus, tmp_path):
    lm, run = swiglu_run
    res = CliRunner().invoke(eval_main, ["--run", str(run), "--mode", "dense", "--mode", "predictor", "--dataset",
                                         str(text_corpus), "--tokens", "120", "--seq-len", "40", "--json",
                                         "--quiet", "--recall", "0.8", "--dtype", "float64", "--recall-sweep",
                                         "0.95,0.5"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert set(rep["modes"]) == {"dense", "predictor"} and rep["threshold_recall"] == 0.8
    at = {r["threshold_recall"]: r for r in rep["recall_sweep"]}
    assert set(at) == {0.95, 0.5}
    # layer 0 sees the same inputs in every mode: a lower recall target skips at least as many neurons there
    share0 = lambda r: r["per_layer"]["computed_share"][0]  # noqa: E731
    assert share0(at[0.5]) <= share0(rep["modes"]["predictor"]) <= share0(at[0.95])
    assert at[0.5]["ppl_vs_dense"] == pytest.approx(at[0.5]["perplexity"] / rep["modes"]["dense"]["perplexity"] - 1)
    res = CliRunner().invoke(eval_main, ["--run", str(run), "--recall-sweep", "a,b", "--quiet"])
    assert res.exit_code != 0 and "--recall-sweep" in res.output
    # predictors of another model are refused
    other = {**lm.info, "name": "other", "fingerprint": "0" * 64}
    with pytest.raises(ArtifactError, match="made for model"):
        load_predictors(run, other)
    # no predictors, predictor mode asked for
    import shutil
    bare = tmp_path / "bare"
    shutil.copytree(run / "profile", bare / "profile")
    with pytest.raises(ArtifactError, match="pi-train-predictors"):
        evaluate(bare, modes=["predictor"], dataset=str(text_corpus), lm=lm, **EVAL)
    rep = evaluate(bare, dataset=str(text_corpus), lm=lm, **EVAL)
    assert list(rep["modes"]) == ["dense", "oracle"]


def test_perplexity_matches_log_softmax(tiny_model_dir, text_corpus):
    lm = load("opt", tiny_model_dir("opt"))
    batches = list(token_batches(lm.tokenizer, iter_texts(str(text_corpus)), 32, 2, 200))
    nll, n = perplexity(lm, batches)
    ref = 0.0
    with torch.no_grad():
        for ids in batches:
            lp = torch.log_softmax(lm.model(input_ids=ids).logits.double(), -1)
            for b in range(ids.shape[0]):
                for t in range(ids.shape[1] - 1):
                    ref -= float(lp[b, t, ids[b, t + 1]])
    assert n == sum(ids[:, 1:].numel() for ids in batches)
    assert nll == pytest.approx(ref, rel=1e-10)


@pytest.mark.parametrize("name", ["opt", "llama-swiglu", "falcon-relu", "mistral-drelu"])
def test_ffn_values_match_explicit(name, tiny_model_dir):
    """The values the magnitude weighting uses equal an explicit recomputation from the weights."""
    from hotneurons.predictors.train import ffn_values

    lm = load(name, tiny_model_dir(name))
    x = torch.randn(37, 32, dtype=torch.float64)
    for i, layer in enumerate(lm.layers):
        ffn = lm.adapter.layer_ffn(layer)
        lin = lambda m, v: v @ m.weight.T + (m.bias if m.bias is not None else 0)  # noqa: E731
        if name == "llama-swiglu":
            ref = torch.nn.functional.silu(lin(ffn["gate"], x)) * lin(ffn["up"], x)
        elif name == "mistral-drelu":
            ref = torch.relu(lin(ffn["gate"], x)) * torch.relu(lin(ffn["up"], x))
        else:
            ref = torch.relu(lin(ffn["up"], x))
        torch.testing.assert_close(ffn_values(lm, i, x, chunk=10).double(), ref.float().double(), rtol=1e-5,
                                   atol=1e-6)


def test_magnitude_weighted_training(swiglu_run):
    lm, run = swiglu_run
    summary = train_predictors(run, preset("fast", magnitude_weight=1.0), device="cpu", progress=False, lm=lm,
                               force=True)
    assert summary["config"]["magnitude_weight"] == 1.0
    assert summary["totals"]["recomputed_mask_agreement_min"] > 0.99
    assert load_predictors(run, lm.info).layers[0].fc1.weight.shape[1] == 32


def test_results_file(swiglu_run, text_corpus, tmp_path):
    """The results collector copies figures from summary.json and eval.json, and judges the goals from them."""
    from hotneurons.predictors.results import collect

    lm, run = swiglu_run
    rep = evaluate(run, dataset=str(text_corpus), lm=lm, modes=["dense", "oracle", "predictor"], **EVAL)
    out = collect(run, ["cmd a"], {"again": str(run / "eval" / "eval.json")}, {"same run": str(run)})
    summary = json.loads((run / "predictors" / "summary.json").read_text())
    assert out["command"] == ["cmd a"] and out["machine"]["nproc"] >= 1
    assert out["training"]["mean_recall_test"] == summary["totals"]["mean_recall"]
    assert out["eval"]["modes"]["predictor"]["perplexity"] == rep["modes"]["predictor"]["perplexity"]
    assert out["goal_met"]["predictor_ppl_vs_dense"] == (rep["modes"]["predictor"]["ppl_vs_dense"] <= 0.06)
    assert out["other_evals"]["again"]["modes"]["dense"]["perplexity"] == rep["modes"]["dense"]["perplexity"]
    assert len(out["per_layer"]) == len(summary["layers"])
    row = out["sweep"][0]  # a sweep row: the run's own commands, totals, eval figures and goals
    assert row["label"] == "same run" and len(row["commands"]) == 3
    assert row["commands"][0] == json.loads((run / "profile" / "meta.json").read_text())["command"]
    assert row["training"]["mean_predicted_sparsity"] == summary["totals"]["mean_predicted_sparsity"]
    assert row["eval"]["modes"]["oracle"]["perplexity"] == rep["modes"]["oracle"]["perplexity"]
    assert row["goal_met"] == out["goal_met"]
    assert row["config"] == {"name": "fast", "epochs": 4, "patience": 1, "max_steps": 1}
