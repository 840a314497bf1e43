"""Stages run layer by layer from the model's file (models/streamed.py) against the transformers path on tiny models.

The reference model runs eager attention where transformers lets it switch (all but Falcon): its softmax is float32,
as our decoder's; SDPA's is float64 in these float64 tests, and a value within float32 rounding of tau would flip.
With that, counts and thresholds are exactly equal, samples equal to float16 rounding, masks equal.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import tiny
import torch
from click.testing import CliRunner
from hotneurons.common import artifacts
from hotneurons.common.prenorm import ffn_norms
from hotneurons.models import ModelConfig, build_model, dense_ffn
from hotneurons.models.family import load_model
from hotneurons.models.stream_memory import StreamMemoryError, profile_need
from hotneurons.models.streamed import open_streamed
from hotneurons.predictors import fit
from hotneurons.predictors.evaluate import evaluate
from hotneurons.predictors.train import preset, train_predictors
from hotneurons.profiler.cli import main as profile_cli
from hotneurons.profiler.profile import ProfileConfig, profile_model
from hotneurons.weights.source import open_source

COMPARED = ["opt", "llama-reglu", "llama-swiglu", "falcon-relu", "gemma-geglu", "mistral-drelu"]
EVAL = dict(tokens=300, seq_len=40, batch_size=2, progress=False)


def small_cfg(model, corpus, name, **kw) -> ProfileConfig:
    base = dict(model=str(model), dataset=str(corpus), tokens=700, seq_len=48, batch_size=3, calibration_tokens=200,
                samples_per_layer=150, dtype="float64", activation=tiny.ACTIVATION_OVERRIDE.get(name))
    return ProfileConfig(**{**base, **kw})


def hf_model(name, model, dtype="float64"):
    """The transformers path's model, eager attention where it can switch (see the module's docstring)."""
    lm = load_model(str(model), dtype=dtype, activation=tiny.ACTIVATION_OVERRIDE.get(name))
    if name == "mistral-drelu":
        tiny.make_drelu(lm)
    if lm.adapter.name != "falcon":  # Falcon's attention cannot switch (its SDPA is exact enough for ReLU signs)
        lm.model.set_attn_implementation("eager")
    return lm


def no_transformers_model(monkeypatch):
    """Make any build of a transformers model fail: the streamed path must not need one."""
    def refuse(*a, **k):
        raise AssertionError("the transformers model was loaded")

    monkeypatch.setattr("hotneurons.models.family.load_model", refuse)
    monkeypatch.setattr("hotneurons.profiler.profile.load_model", refuse)


def counts(run) -> np.ndarray:
    return pd.read_parquet(run / "profile" / "neurons.parquet")["count"].to_numpy()


def assert_same_profile(a_run, b_run, a, b, n_layers):
    assert a["model"] == b["model"]  # the whole meta.json "model" section: fingerprint, shapes, parameters
    assert a["taus"] == b["taus"] and a["tokens"] == b["tokens"]
    np.testing.assert_array_equal(counts(a_run), counts(b_run))
    assert a["samples"]["count"] == b["samples"]["count"] > 0
    sa, sb = a_run / "profile" / "samples", b_run / "profile" / "samples"
    for i in range(n_layers):
        xa, xb = np.load(sa / f"layer_{i:03d}.x.npy"), np.load(sb / f"layer_{i:03d}.x.npy")
        np.testing.assert_allclose(xa.astype(np.float64), xb.astype(np.float64), rtol=1e-3, atol=1e-3)  # fp16
        np.testing.assert_array_equal(np.load(sa / f"layer_{i:03d}.mask.npy"), np.load(sb / f"layer_{i:03d}.mask.npy"))
        if (sb / f"layer_{i:03d}.rms.npy").exists():
            np.testing.assert_allclose(np.load(sa / f"layer_{i:03d}.rms.npy"), np.load(sb / f"layer_{i:03d}.rms.npy"),
                                       rtol=1e-6)
        else:
            assert not (sa / f"layer_{i:03d}.rms.npy").exists()


# ---------------------------------------------------------------------------------------------------------------
# models/: lazy layers


@pytest.mark.parametrize("name", tiny.FAMILIES)
def test_lazy_decoder_equals_whole(name, tiny_model_dir):
    """build_model(layers=False) holds no layer and a one-layer cache; its forward, loading and dropping each layer
    in turn, gives the whole model's logits exactly."""
    with open_source(tiny_model_dir(name)) as src:
        cfg = ModelConfig.from_hf(src.config, tiny.ACTIVATION_OVERRIDE.get(name))
        get = lambda n: src.get(n) if n in src.infos else None  # noqa: E731
        whole = build_model(cfg, get, "cpu", torch.float64, 32)
        lazy = build_model(cfg, get, "cpu", torch.float64, 32, layers=False)
        ffns = [dense_ffn(get, cfg, i, dtype=torch.float64) for i in range(cfg.n_layers)]
        assert lazy.layers == [None] * cfg.n_layers and lazy.k_cache.shape[0] == 1 and lazy.lazy
        tokens = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(0))
        got = lazy.forward(tokens, 0, lambda i, x: ffns[i](x))
        assert torch.equal(got, whole.forward(tokens, 0, lambda i, x: ffns[i](x)))
        assert lazy.layers == [None] * cfg.n_layers
        lazy.load_layer(1)
        assert lazy.layers[1] is not None and lazy.layers[0] is None
        lazy.drop_layer(1)
        with pytest.raises(ValueError, match="built with all its layers"):
            whole.drop_layer(0)


def test_forward_holds_one_layer_and_releases_each_tensor(tiny_model_dir):
    sm = open_streamed(str(tiny_model_dir("llama-swiglu")), dtype=torch.float64, ctx=16)
    released: list[str] = []
    real = sm.source.release
    sm.source.release = lambda n: (released.append(n), real(n))[1]

    class Probe:
        live: list = []

        def wants_x(self):
            return True

        def on_pre_norm(self, i, x_pre):
            assert x_pre.shape == (2, 16, 32)

        def on_ffn(self, i, h, x):
            assert h.shape == (2, 16, 48) and x.shape == (2, 16, 32)
            self.live.append([j for j, layer in enumerate(sm.decoder.layers) if layer is not None])
            return torch.zeros_like(h)  # replaces h, as a hook's return value does

        def end_layer(self, i):
            pass

    probe = Probe()
    sm.attach(probe)
    h = sm.forward(torch.randint(0, 256, (2, 16)))
    assert probe.live == [[0], [1]] and sm.decoder.layers == [None, None]
    assert {n for n in sm.source.infos if n.startswith("blk.")} <= set(released)
    sm.detach(probe)
    assert not torch.equal(h, sm.forward(torch.randint(0, 256, (2, 16))))  # the zeroed FFN did change h


# ---------------------------------------------------------------------------------------------------------------
# pi-profile


@pytest.mark.parametrize("name", COMPARED)
def test_streamed_profile_equals_transformers(name, tiny_model_dir, text_corpus, tmp_path, monkeypatch):
    folder = tiny_model_dir(name)
    cfg = small_cfg(folder, text_corpus, name)
    whole = profile_model(cfg, tmp_path / "whole", progress=False, lm=hf_model(name, folder))
    no_transformers_model(monkeypatch)
    streamed = profile_model(cfg, tmp_path / "streamed", progress=False)  # a local folder: layer by layer
    assert streamed["config"]["layer_by_layer"] and not whole["config"]["layer_by_layer"]
    assert (streamed["taus"] is None) == (name in ("opt", "llama-reglu", "falcon-relu", "mistral-drelu"))
    assert_same_profile(tmp_path / "streamed", tmp_path / "whole", streamed, whole, 2)


def gguf_file(folder, path):
    """The tiny LLaMA as llama.cpp's converter writes it: F16, two FFN matrices in Q8_0."""
    gguf = pytest.importorskip("gguf")
    from test_weights_source import hf_state, write_llamacpp

    state, hcfg = hf_state(folder)
    q8 = gguf.GGMLQuantizationType.Q8_0
    write_llamacpp(path, "llama-swiglu", "llama", state, hcfg, {"blk.0.ffn_gate.weight": q8, "blk.1.ffn_up.weight": q8})
    return path


def test_streamed_gguf_profile_equals_transformers(tiny_model_dir, text_corpus, tmp_path):
    """A GGUF file read in place gives transformers' profile of it. transformers keeps a GGUF's weights packed and
    computes with them in float32 whatever the dtype: float32 here, and counts equal up to float32 rounding (a value
    within it of tau may flip)."""
    path = gguf_file(tiny_model_dir("llama-swiglu"), tmp_path / "llama.gguf")
    cfg = small_cfg(path, text_corpus, "llama-swiglu", dtype="float32")
    streamed = profile_model(cfg, tmp_path / "streamed", progress=False)
    whole = profile_model(cfg, tmp_path / "whole", progress=False, lm=hf_model("llama-swiglu", path, "float32"))
    assert streamed["model"]["source"]["kind"] == "gguf" and streamed["config"]["layer_by_layer"]
    drop = lambda m: {k: v for k, v in m.items() if k != "fingerprint"}  # noqa: E731 (see the test below)
    assert drop(streamed["model"]) == drop(whole["model"])
    np.testing.assert_allclose(streamed["taus"], whole["taus"], rtol=1e-5)
    a, b = counts(tmp_path / "streamed"), counts(tmp_path / "whole")
    assert np.abs(a - b).sum() <= 1e-3 * b.sum()


def test_gguf_fingerprint_equals_transformers(tiny_model_dir, tmp_path):
    path = gguf_file(tiny_model_dir("llama-swiglu"), tmp_path / "llama.gguf")
    sm = open_streamed(str(path))
    assert sm.info["fingerprint"] == load_model(str(path)).info["fingerprint"]


def test_layer_by_layer_can_be_declined(tiny_model_dir, text_corpus, tmp_path):
    cfg = small_cfg(tiny_model_dir("opt"), text_corpus, "opt", tokens=200)
    res = CliRunner().invoke(profile_cli, ["--model", cfg.model, "--dataset", cfg.dataset, "--tokens", "200",
                                           "--seq-len", "48", "--whole-model", "--json", "--quiet",
                                           "--out", str(tmp_path / "run")])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output[res.output.index("{"):])["config"]["layer_by_layer"] is False


# ---------------------------------------------------------------------------------------------------------------
# pi-eval and pi-train-predictors


def write_placement(run, info):
    L, n = info["n_layers"], info["n_neurons"]
    gpu = np.random.default_rng(0).random((L, n)) < 0.3
    df = pd.DataFrame({"layer": np.repeat(np.arange(L, dtype=np.int32), n),
                       "neuron": np.tile(np.arange(n, dtype=np.int32), L), "gpu": gpu.reshape(-1)})
    artifacts.write_parquet(run / "placement" / "placement.parquet", df)
    artifacts.write_json(run / "placement" / "meta.json", {**artifacts.base_meta("placement", {}), "model": info})


@pytest.mark.parametrize("name, form", [("opt", "normed"), ("llama-swiglu", "normed"),
                                        ("llama-swiglu", "powerinfer")])
def test_streamed_eval_equals_transformers(name, form, tiny_model_dir, text_corpus, tmp_path, monkeypatch):
    """Every mode's perplexity and mask statistics as the transformers path's (the contract is 1e-4 relative; float32
    softmaxes rounding apart leave ~1e-9). The powerinfer form reads the residual before the pre-FFN norm: on_pre_norm
    in both paths."""
    folder = tiny_model_dir(name)
    run = tmp_path / "run"
    meta = profile_model(small_cfg(folder, text_corpus, name), run, progress=False)
    tiny.write_predictors(run, meta["model"], 0.0)
    if form == "powerinfer":
        pmeta = json.loads((run / "predictors" / "meta.json").read_text())
        artifacts.write_json(run / "predictors" / "meta.json", {**pmeta, "config": {"form": "powerinfer"}})
    write_placement(run, meta["model"])
    whole = evaluate(run, dataset=str(text_corpus), lm=hf_model(name, folder), write=False, **EVAL)
    no_transformers_model(monkeypatch)
    streamed = evaluate(run, dataset=str(text_corpus), dtype="float64", **EVAL)
    assert list(streamed["modes"]) == ["dense", "oracle", "predictor", "placement"]
    assert streamed["fingerprint"] == whole["fingerprint"] and streamed["dtype"] == whole["dtype"]
    for mode, w in whole["modes"].items():
        s = streamed["modes"][mode]
        assert s["perplexity"] == pytest.approx(w["perplexity"], rel=1e-7), mode
        assert s["tokens"] == w["tokens"] and s["per_layer"] == w["per_layer"], mode
    assert 0 < streamed["modes"]["predictor"]["ffn_sparsity"] < 1


def test_train_reads_norms_and_ffn_values_from_the_file(tiny_model_dir, text_corpus, tmp_path, monkeypatch):
    name = "llama-swiglu"
    folder = tiny_model_dir(name)
    run = tmp_path / "run"
    profile_model(small_cfg(folder, text_corpus, name, samples_per_layer=300), run, progress=False)
    sm, lm = open_streamed(str(folder), dtype=torch.float64), hf_model(name, folder)
    x = torch.randn(37, 32, dtype=torch.float64)
    for i in range(2):
        torch.testing.assert_close(sm.ffn_values(i, x, chunk=10), fit.ffn_values(lm, i, x, chunk=10), rtol=1e-6,
                                   atol=1e-7)
    for a, b in zip(sm.ffn_norms(required=True), ffn_norms(lm)):
        assert torch.equal(a.gamma(), b.gamma()) and a.eps == b.eps
    no_transformers_model(monkeypatch)
    summary = train_predictors(run, preset("fast", form="powerinfer", magnitude_weight=1.0), device="cpu",
                               progress=False)
    assert summary["totals"]["recomputed_mask_agreement_min"] > 0.99  # the file's values give the stored masks
    assert summary["totals"]["global_threshold"] is not None


def test_opt_has_no_pre_norm_for_the_powerinfer_form(tiny_model_dir):
    sm = open_streamed(str(tiny_model_dir("opt")))
    assert sm.ffn_norms() is None
    with pytest.raises(ValueError, match="use the normed form"):
        sm.ffn_norms(required=True)


# ---------------------------------------------------------------------------------------------------------------
# Memory


def test_memory_refusals_name_both_figures_and_the_fix(tiny_model_dir, text_corpus, tmp_path, monkeypatch):
    folder = tiny_model_dir("llama-swiglu")
    sm = open_streamed(str(folder), ctx=48)
    small, big = (sum(profile_need(sm, b, 48, 150, 200, True).device.values()) for b in (1, 8))
    assert big > small  # the batch is a part of it
    monkeypatch.setenv("HOTNEURONS_HOST_MEMORY", "100MB")
    cfg = small_cfg(folder, text_corpus, "llama-swiglu")
    with pytest.raises(StreamMemoryError, match=r"^pi-profile needs \d+\.\d\d GB of host memory \(one layer's weights "
                                                r"in float .*\) but 0\.10 GB is available: use a smaller batch size "
                                                r"or sequence length") as e:
        profile_model(cfg, tmp_path / "run", progress=False)
    assert e.value.params == ("batch_size", "seq_len")
    assert not (tmp_path / "run" / "profile").exists() and not (tmp_path / "run" / ".profile.partial").exists()
    res = CliRunner().invoke(profile_cli, ["--model", str(folder), "--dataset", str(text_corpus), "--quiet",
                                           "--out", str(tmp_path / "run")])
    assert res.exit_code == 1 and res.output.count("\n") == 1, res.output
    assert "but 0.10 GB is available" in res.output and "(--batch-size, --seq-len)" in res.output

    monkeypatch.delenv("HOTNEURONS_HOST_MEMORY")
    profile_model(cfg, tmp_path / "ok", progress=False)
    monkeypatch.setenv("HOTNEURONS_HOST_MEMORY", "100MB")
    with pytest.raises(StreamMemoryError, match=r"^pi-eval needs .* but 0\.10 GB is available"):
        evaluate(tmp_path / "ok", dataset=str(text_corpus), **EVAL)
    with pytest.raises(StreamMemoryError, match=r"^pi-train-predictors needs .* one layer's samples .* re-run "
                                                r"pi-profile with a smaller --samples-per-layer"):
        train_predictors(tmp_path / "ok", preset("fast", magnitude_weight=1.0), device="cpu", progress=False)


def test_device_refusal_names_the_free_memory(tiny_model_dir, monkeypatch):
    """The device branch of the check (CUDA here faked): what a layer, the batch and the samples need against what is
    free."""
    from hotneurons.models.stream_memory import check_memory

    sm = open_streamed(str(tiny_model_dir("opt")), ctx=48)
    need = profile_need(sm, 3, 48, 150, 0, False)
    monkeypatch.setenv("HOTNEURONS_HOST_MEMORY", "1TB")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1_000_000, 80_000_000_000))
    with pytest.raises(StreamMemoryError, match=r"^pi-eval needs \d+\.\d\d GB on cuda:0 \(.*the batch's activations "
                                                r".*\) but 0\.00 GB is free: use a smaller batch size"):
        check_memory(need, "cuda:0", "pi-eval")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80_000_000_000, 80_000_000_000))
    check_memory(need, "cuda:0", "pi-eval")


def test_which_models_stream(tiny_model_dir, tmp_path):
    from hotneurons.models.streamed import streams

    assert streams(str(tiny_model_dir("opt")))  # a local safetensors folder
    assert not streams("some-org/some-model")  # a hub id: transformers
    assert not streams(str(tiny_model_dir("opt")), layer_by_layer=False)
    assert streams("some-org/some-model", layer_by_layer=True)  # asked: open_streamed then refuses a hub id


def test_cuda_counts_compile_without_a_worker_pool(monkeypatch):
    """The counters' torch.compile runs with Inductor's compile_threads = 1, at the first call and at every later one
    (a recompile): Inductor's default pool of one process per core held ~6 GB of host memory on a 16-core machine."""
    from hotneurons.profiler import hooks
    from torch._inductor import config

    seen = []

    def fake_compile(fn, **kw):
        def run(*args):
            seen.append(config.compile_threads)
            return fn(*args)
        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(hooks, "_compiled", None)
    before = config.compile_threads
    h = torch.tensor([[0.0, 1.0, -2.0], [0.5, 0.0, 0.0]])
    for _ in range(2):
        assert hooks._count_cuda(h, torch.tensor(0.75)).tolist() == [0, 1, 1]
    assert seen == [1, 1, 1]  # the warm-up call and two counts
    assert config.compile_threads == before  # the process's setting is left as it was
