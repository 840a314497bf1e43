"""The powerinfer predictor form: the profile's pre-norm divisors, the fold into one threshold, training and pi-eval,
each against a plain reference (HF forwards with hooks, float64 matmuls, brute-force decisions)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hotneurons.artifacts.predictor_file import load_predictors
from hotneurons.artifacts.predictors import PredictorForm
from hotneurons.common import artifacts
from hotneurons.common.corpus import iter_texts
from hotneurons.models.family import load_model
from hotneurons.predictors.cli import train_main
from hotneurons.predictors.evaluate import evaluate
from hotneurons.predictors.fit import metrics
from hotneurons.predictors.form import single_threshold
from hotneurons.predictors.train import preset, split_indices, train_predictors
from hotneurons.profiler.profile import ProfileConfig, _merge_samples, profile_model, token_batches
from safetensors.torch import load_file

FAMILY = "llama-reglu"
EVAL = dict(tokens=300, seq_len=40, batch_size=2, progress=False)


def small_cfg(model_dir, corpus, **kw) -> ProfileConfig:
    base = dict(model=str(model_dir), dataset=str(corpus), tokens=700, seq_len=48, batch_size=3,
                calibration_tokens=200, samples_per_layer=700, dtype="float64")
    return ProfileConfig(**{**base, **kw})


def with_random_gammas(lm, seed: int = 0):
    """Norm weights of both signs away from 1 (a tiny model's are all 1): a gamma dropped or applied twice shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lm.layers:
            w = layer.post_attention_layernorm.weight
            sign = torch.where(torch.rand(w.shape, generator=g) < 0.2, -1.0, 1.0)
            w.copy_(sign * (0.3 + 1.4 * torch.rand(w.shape, generator=g)))
    return lm


def load_lm(model_dir, dtype="float64"):
    return with_random_gammas(load_model(str(model_dir), dtype=dtype))


@torch.no_grad()
def stream_inputs(lm, cfg) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, (tokens, d) of the residual entering post_attention_layernorm and of the MLP's input, for every
    token of the profile's stream in order, from hooks on HF's own modules."""
    pre = [[] for _ in lm.layers]
    post = [[] for _ in lm.layers]
    handles = []
    for i, layer in enumerate(lm.layers):
        handles.append(layer.post_attention_layernorm.register_forward_pre_hook(
            lambda m, a, i=i: pre[i].append(a[0].reshape(-1, a[0].shape[-1]))))
        handles.append(layer.mlp.register_forward_pre_hook(
            lambda m, a, i=i: post[i].append(a[0].reshape(-1, a[0].shape[-1]))))
    try:
        for ids in token_batches(lm.tokenizer, iter_texts(cfg.dataset), cfg.seq_len, cfg.batch_size, cfg.tokens):
            lm.model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    return [torch.cat(p) for p in pre], [torch.cat(p) for p in post]


# ---------------------------------------------------------------------------------------------------------------
# The profile


def test_samples_keep_the_pre_norm_divisor(tiny_model_dir, text_corpus, tmp_path):
    """samples/layer_XXX.rms.npy row k = sqrt(mean(x_pre^2) + eps) of the token whose x_post is x.npy row k; and
    x_post = gamma * x_pre / r, the identity the powerinfer form is trained through (float64 model)."""
    src = tiny_model_dir(FAMILY)
    lm = load_lm(src)
    cfg = small_cfg(src, text_corpus)  # capacity = tokens: row k is the stream's token k
    meta = profile_model(cfg, tmp_path / "run", lm=lm, progress=False)
    assert meta.samples.count == 700 and "rms" in meta.samples.rms
    pre, post = stream_inputs(lm, cfg)
    eps = lm.model.config.rms_norm_eps
    for i, layer in enumerate(lm.layers):
        r_ref = (pre[i].pow(2).mean(-1) + eps).sqrt()  # (tokens,) float64
        gamma = layer.post_attention_layernorm.weight.detach()
        torch.testing.assert_close(post[i], gamma * pre[i] / r_ref[:, None], rtol=1e-6, atol=1e-9)
        r = np.load(tmp_path / "run/profile/samples" / f"layer_{i:03d}.rms.npy")
        assert r.dtype == np.float32 and r.shape == (700,)
        np.testing.assert_allclose(r, r_ref.numpy(), rtol=1e-6)
        x = np.load(tmp_path / "run/profile/samples" / f"layer_{i:03d}.x.npy").astype(np.float64)
        np.testing.assert_allclose(x, post[i].numpy(), rtol=2e-3, atol=1e-4)  # float16 storage


def test_families_without_an_rms_pre_ffn_norm_store_none(tiny_model_dir, text_corpus, tmp_path):
    src = tiny_model_dir("opt")
    meta = profile_model(small_cfg(src, text_corpus, samples_per_layer=50), tmp_path / "run", progress=False)
    assert meta.samples.rms is None and "rms" not in meta.to_dict()["samples"]
    assert not list((tmp_path / "run/profile/samples").glob("*.rms.npy"))


def test_resume_writes_the_divisors_of_an_uninterrupted_run(tiny_model_dir, text_corpus, tmp_path):
    """Reservoir replacement past the capacity (scattered writes) and a resume keep r beside its row."""
    src = tiny_model_dir(FAMILY)
    cfg = small_cfg(src, text_corpus, samples_per_layer=40, tokens=900)
    profile_model(cfg, tmp_path / "a", progress=False, checkpoint_every=1)
    with pytest.raises(KeyboardInterrupt):
        profile_model(cfg, tmp_path / "b", progress=False, checkpoint_every=1, _stop_after=3)
    profile_model(cfg, tmp_path / "b", resume=True, progress=False, checkpoint_every=1)
    for i in range(2):
        for kind in ("rms", "x"):
            f = f"layer_{i:03d}.{kind}.npy"
            np.testing.assert_array_equal(np.load(tmp_path / "a/profile/samples" / f),
                                          np.load(tmp_path / "b/profile/samples" / f))


def test_merge_of_ranks_keeps_the_divisors(tmp_path):
    rng = np.random.default_rng(0)
    filled, capacity = [3, 2], 4
    parts = []
    for r, f in enumerate(filled):
        folder = tmp_path / f"samples.rank{r}"
        folder.mkdir()
        arrays = {"x": rng.standard_normal((capacity, 5)).astype(np.float16),
                  "mask": rng.integers(0, 255, (capacity, 2), dtype=np.uint8),
                  "rms": rng.random(capacity).astype(np.float32)}
        for kind, a in arrays.items():
            np.save(folder / f"layer_000.{kind}.npy", a)
        parts.append(arrays)
    _merge_samples(tmp_path, 1, filled, capacity, 2, True)
    for kind in ("x", "mask", "rms"):
        want = np.concatenate([p[kind][:f] for p, f in zip(parts, filled)])
        np.testing.assert_array_equal(np.load(tmp_path / "samples" / f"layer_000.{kind}.npy"), want)


# ---------------------------------------------------------------------------------------------------------------
# One threshold


@pytest.mark.parametrize("signs", ["+", "-", "mixed", "zero"])
def test_fold_keeps_every_decision_or_only_adds_neurons(signs):
    """Brute force over random logits: an exactly folded layer decides as before, a moved one computes a superset;
    every layer's threshold becomes the one T."""
    rng = np.random.default_rng(1)
    t = {"+": [0.3, 2.0, 0.01], "-": [-0.3, -2.0, -0.01], "mixed": [0.4, -0.2, -1.5], "zero": [0.0, 0.5, 0.2]}[signs]
    logits = [rng.standard_normal(4000) * s for s in (1.0, 3.0, 0.1)]
    lowered = [-float(np.median(np.abs(lg))) / 256 for lg in logits]
    fold = single_threshold(t, lowered)
    assert (fold.threshold > 0) == (signs == "+")
    for lg, tl, c, moved in zip(logits, t, fold.scales, fold.moved):
        assert c > 0
        before, after = lg >= tl, (lg * c).astype(np.float32) >= np.float32(fold.threshold)
        if moved:
            assert tl * fold.threshold <= 0 and (after | ~before).all() and after.sum() >= before.sum()
        else:
            assert (before == after).mean() > 0.999  # float32 rounding of logits at the threshold only
    assert sum(fold.moved) == {"+": 0, "-": 0, "mixed": 1, "zero": 3}[signs]


# ---------------------------------------------------------------------------------------------------------------
# Training and pi-eval


@pytest.fixture(scope="module")
def trained(tiny_model_dir, text_corpus, tmp_path_factory):
    src = tiny_model_dir(FAMILY)
    lm = load_lm(src)
    run = tmp_path_factory.mktemp("form") / "run"
    profile_model(small_cfg(src, text_corpus, tokens=1400, samples_per_layer=1400), run, lm=lm, progress=False)
    cfg = preset("fast", form="powerinfer")
    summary = train_predictors(run, cfg, device="cpu", progress=False, lm=lm)
    return lm, run, cfg, summary


def test_form_and_one_threshold_are_recorded(trained):
    lm, run, cfg, summary = trained
    meta = json.loads((run / "predictors/meta.json").read_text())
    assert meta["config"]["form"] == summary.config["form"] == "powerinfer" == summary.form
    T = summary.totals.global_threshold
    tensors = load_file(str(run / "predictors/predictors.safetensors"))
    key = f"{cfg.target_recall:g}"
    for row in summary.layers:
        assert float(tensors[f"layers.{row.layer}.threshold"][0]) == row.threshold == T
        assert row.thresholds_by_recall[key] == T and row.fold_scale > 0
        assert row.threshold_moved == (row.threshold_before_fold * T <= 0)
        assert not any(f"layers.{row.layer}.{b}" in tensors for b in ("fc1.bias", "fc2.bias"))
    assert load_predictors(run, lm.info).form == PredictorForm.POWERINFER


def stored_x_pre(run, layer: int, gamma: torch.Tensor) -> torch.Tensor:
    """(count, d) float64 x_pre = x_post * r / gamma from the profile's samples."""
    s = run / "profile/samples"
    x = torch.from_numpy(np.load(s / f"layer_{layer:03d}.x.npy").astype(np.float64))
    r = torch.from_numpy(np.load(s / f"layer_{layer:03d}.rms.npy").astype(np.float64))
    return x * r[:, None] / gamma.double()


def test_stored_predictors_on_x_pre_give_the_reported_metrics(trained):
    """The saved fc1 (gamma folded in), fc2 (scaled) and T, applied in float64 to x_pre: the test split's recall and
    predicted sparsity are the summary's (after the fold), and every tabulated threshold reaches its recall on val."""
    lm, run, cfg, summary = trained
    tensors = load_file(str(run / "predictors/predictors.safetensors"))
    count = summary.samples_per_layer
    _, va, te = split_indices(count, cfg)
    for row in summary.layers:
        i = row.layer
        x_pre = stored_x_pre(run, i, lm.layers[i].post_attention_layernorm.weight.detach())
        w1, w2 = tensors[f"layers.{i}.fc1.weight"].double(), tensors[f"layers.{i}.fc2.weight"].double()
        logits = torch.relu(x_pre @ w1.T) @ w2.T  # (count, n)
        packed = np.load(run / "profile/samples" / f"layer_{i:03d}.mask.npy")
        mask = torch.from_numpy(np.unpackbits(packed, axis=1)[:, :lm.info["n_neurons"]].astype(bool))
        m = metrics(logits[te], mask[te], row.threshold)
        pairs = mask[te].numel()
        assert abs(m["predicted_sparsity"] - row.predicted_sparsity) * pairs <= 1
        assert abs(m["recall"] - row.recall) * int(mask[te].sum()) <= 1
        for r, t in row.thresholds_by_recall.items():
            assert metrics(logits[va], mask[va], t)["recall"] >= float(r) - 1 / int(mask[va].sum())


def reference_ppl(lm, corpus, preds, prenorm: bool) -> float:
    """Perplexity with every layer's FFN as explicit float64 matmuls, masked where fc2 relu(fc1 v) >= threshold, v
    the residual entering post_attention_layernorm (prenorm) or the MLP's input."""
    pre, originals = {}, []
    handles = [layer.post_attention_layernorm.register_forward_pre_hook(
        lambda m, a, i=i: pre.__setitem__(i, a[0])) for i, layer in enumerate(lm.layers)]
    for i, layer in enumerate(lm.layers):
        mlp = layer.mlp
        originals.append(mlp.forward)

        def fwd(x, mlp=mlp, i=i):
            h = torch.relu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T)  # (b, s, n) ReGLU
            p = preds.layers[i]
            v = pre[i] if prenorm else x
            h = h * (torch.relu(v @ p.fc1.weight.T) @ p.fc2.weight.T >= float(p.threshold))
            return h @ mlp.down_proj.weight.T
        mlp.forward = fwd
    try:
        nll, n = reference_nll(lm, corpus, EVAL)
    finally:
        for h in handles:
            h.remove()
        for layer, f in zip(lm.layers, originals):
            layer.mlp.forward = f
    return math.exp(nll / n)


def test_eval_feeds_the_pre_norm_residual(trained, text_corpus):
    """pi-eval's predictor mode on powerinfer predictors equals the explicit reference fed x_pre (float64, 1e-9), and
    not the one fed the FFN input."""
    lm, run, _, _ = trained
    rep = evaluate(run, modes=["dense", "predictor"], dataset=str(text_corpus), lm=lm, **EVAL)
    preds = load_predictors(run, lm.info, dtype=torch.float64)
    want = reference_ppl(lm, text_corpus, preds, prenorm=True)
    got = rep.modes["predictor"].perplexity
    assert got == pytest.approx(want, rel=1e-9)
    assert abs(reference_ppl(lm, text_corpus, preds, prenorm=False) - want) > 1e-6 * want
    assert 0 < rep.modes["predictor"].ffn_sparsity < 1


def test_normed_stays_the_default_and_old_files_read_as_normed(trained):
    assert preset("default").form == "normed"
    assert PredictorForm.of({}) == PredictorForm.of(None) == PredictorForm.NORMED
    assert PredictorForm.of({"form": "powerinfer"}) == PredictorForm.POWERINFER


# ---------------------------------------------------------------------------------------------------------------
# One-line refusals


def test_cli_refusals(trained, tiny_model_dir, text_corpus, tmp_path):
    runner = CliRunner()
    _, run, _, _ = trained
    res = runner.invoke(train_main, ["--run", str(run), "--form", "bogus", "--quiet"])
    assert res.exit_code == 1 and "unknown predictor form 'bogus': choose one of normed, powerinfer (--form)" in \
        res.output
    opt = tmp_path / "opt"
    profile_model(small_cfg(tiny_model_dir("opt"), text_corpus, samples_per_layer=50), opt, progress=False)
    res = runner.invoke(train_main, ["--run", str(opt), "--form", "powerinfer", "--quiet"])
    assert res.exit_code == 1 and "opt models do not have: use the normed form (--form)" in res.output
    assert len(res.output.strip().splitlines()) == 1
    old = tmp_path / "old"
    profile_model(small_cfg(tiny_model_dir(FAMILY), text_corpus, samples_per_layer=50), old, progress=False)
    for f in (old / "profile/samples").glob("*.rms.npy"):
        f.unlink()  # a profile of a version that stored no divisors
    res = runner.invoke(train_main, ["--run", str(old), "--form", "powerinfer", "--quiet"])
    assert res.exit_code == 1 and "stores no pre-norm scales" in res.output and "re-run pi-profile" in res.output
    meta = artifacts.read_json(old / "profile/meta.json")
    assert meta["samples"]["count"] == 50


def reference_nll(lm, corpus, ev: dict) -> tuple[float, int]:
    """(summed next-token NLL in float64, predicted tokens) of lm's HF forward over the eval batches of `corpus`
    (ev: tokens, seq_len, batch_size): the plain loop pi-eval's masked modes are checked against."""
    nll, n = 0.0, 0
    with torch.no_grad():
        for ids in token_batches(lm.tokenizer, iter_texts(str(corpus)), ev["seq_len"], ev["batch_size"], ev["tokens"]):
            lp = torch.log_softmax(lm.model(input_ids=ids).logits[:, :-1].double(), -1)
            nll -= float(lp.gather(-1, ids[:, 1:, None]).sum())
            n += ids[:, 1:].numel()
    return nll, n
