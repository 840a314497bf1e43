"""Training-free sparsity of gated FFNs (common/gating.py): thresholds, pass counts, masks and pi-eval's criteria on a
tiny random SwiGLU LLaMA, against float64 numpy references."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from hotneurons.artifacts.profile import ProfileMeta
from hotneurons.common.corpus import iter_texts, token_batches
from hotneurons.common.gate_masks import channel_pass, column_norms, neuron_pass
from hotneurons.common.gating import GATE_H_GATE_SHARE, SPARSITIES, LayerTaus, key
from hotneurons.models.family import load_model
from hotneurons.predictors.answers import agreement, greedy_answers
from hotneurons.predictors.cli import eval_main
from hotneurons.predictors.evaluate import evaluate
from hotneurons.predictors.gated_eval import GatedMasks
from hotneurons.profiler.cli import main as profile_cli
from hotneurons.profiler.gated import read_passes
from hotneurons.profiler.profile import ProfileConfig, profile_model
from test_predictor_form import reference_nll

NAME = "llama-swiglu"
EPS = 1e-9  # float64: a value this close to a threshold may round either way between two computations of it
EVAL = dict(tokens=300, seq_len=40, batch_size=2, progress=False)
CRITERIA = ("h", "gate", "gate-h", "input", "wina")


def cfg(model_dir, corpus, **kw) -> ProfileConfig:
    # calibration on the very tokens counted: the pass shares then measure how well the thresholds hit their targets
    base = dict(model=str(model_dir), dataset=str(corpus), tokens=720, seq_len=48, batch_size=3,
                calibration_tokens=720, samples_per_layer=150, dtype="float64")
    return ProfileConfig(**{**base, **kw})


def hf(model_dir):
    lm = load_model(str(model_dir), dtype="float64")
    lm.model.set_attn_implementation("eager")  # float32 softmax, as our decoder's (tests/test_streamed.py)
    return lm


@pytest.fixture(scope="module")
def runs(tiny_model_dir, text_corpus, tmp_path_factory):
    """One profile per --criterion (h, gate-h) of the tiny SwiGLU model, transformers path."""
    root, lm = tmp_path_factory.mktemp("gated"), hf(tiny_model_dir(NAME))
    out = {}
    for crit in ("h", "gate-h"):
        meta = profile_model(cfg(tiny_model_dir(NAME), text_corpus, criterion=crit), root / crit, lm=lm,
                             progress=False)
        out[crit] = (root / crit, meta)
    return lm, out


def ffn_parts(lm, ids) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per layer (x, act(g), h) in float64 numpy, the FFN recomputed from its input with explicit matmuls."""
    xs: dict[int, torch.Tensor] = {}
    handles = [layer.mlp.register_forward_pre_hook(
        lambda m, a, i=i: xs.__setitem__(i, a[0].reshape(-1, a[0].shape[-1]))) for i, layer in enumerate(lm.layers)]
    with torch.no_grad():
        lm.model(input_ids=ids)
    for h in handles:
        h.remove()
    out = []
    for i, layer in enumerate(lm.layers):
        x = xs[i].numpy()
        g, u = x @ layer.mlp.gate_proj.weight.detach().numpy().T, x @ layer.mlp.up_proj.weight.detach().numpy().T
        a = g / (1 + np.exp(-g))  # silu
        out.append((x, a, a * u))
    return out


def ref_pass(crit, x, a, h, t, norm):
    """Float64 numpy reference of each criterion's pass test (strict >)."""
    if crit == "h":
        return np.abs(h) > t["h"]
    if crit == "gate":
        return np.abs(a) > t["gate"]
    if crit == "gate-h":
        return (np.abs(a) > t["gate"]) & (np.abs(h) > t["h"])
    return (np.abs(x) * (norm if crit == "wina" else 1.0)) > t["x"]


def entry(gated, crit, s, i) -> dict:
    return {k: v[i] for k, v in gated["taus"][crit][key(s)].items()}


def test_gated_section_layout_and_targets(runs):
    """Every criterion x sparsity is tabulated; on the calibration tokens themselves the measured pass shares hit
    1 - sparsity (gate-h's gate filter 1 - 0.6 s), and the profile's count is its criterion's passes."""
    _, out = runs
    run, meta = out["gate-h"]
    g = meta.gated
    assert g["criterion"] == "gate-h" and g["sparsity"] == 0.5 and g["sparsities"] == list(SPARSITIES)
    assert g["calibration_tokens"] == 720
    assert set(g["taus"]) == set(g["pass_share"]) == set(g["top20_share"]) == set(CRITERIA)
    shapes = {"h": {"h"}, "gate": {"gate"}, "gate-h": {"gate", "h"}, "input": {"x"}, "wina": {"x"}}
    passes = read_passes(run)
    for c in CRITERIA:
        for s in SPARSITIES:
            assert set(g["taus"][c][key(s)]) == shapes[c]
            counts = passes[f"{c}@{key(s)}"]
            assert counts.dtype == np.int32 and counts.shape == (2, 48 if c in ("h", "gate", "gate-h") else 32)
            share = counts.sum(1) / (meta.tokens * counts.shape[1])
            np.testing.assert_allclose(share, 1 - s, atol=0.01, err_msg=f"{c}@{s}")
            np.testing.assert_allclose(g["pass_share"][c][key(s)], share, atol=1e-6)
            assert all(0.2 <= v <= 1 for v in g["top20_share"][c][key(s)])
    # the profile's own count, rule and thresholds are gate-h's at 0.5
    counts = pd.read_parquet(run / "profile" / "neurons.parquet")["count"].to_numpy().reshape(2, 48)
    np.testing.assert_array_equal(counts, passes["gate-h@0.5"])
    assert meta.rule == "gate>tau,abs>tau"
    assert meta.taus == g["taus"]["gate-h"]["0.5"]["h"] and meta.gate_taus == g["taus"]["gate-h"]["0.5"]["gate"]
    loaded = ProfileMeta.load(run / "profile" / "meta.json")
    assert loaded.neuron_taus == [LayerTaus(gate=a, h=b) for a, b in zip(meta.gate_taus, meta.taus)]
    # gate-h's gate filter alone passes 1 - 0.6 s: recount it with gate's test at gate-h's tau_g
    h_meta = out["h"][1]
    assert h_meta.rule == "abs>tau" and h_meta.taus == h_meta.gated["taus"]["h"]["0.5"]["h"]
    assert "gate_taus" not in h_meta.to_dict()


def test_passes_equal_a_brute_force_recount(runs, text_corpus):
    """passes.safetensors against a float64 numpy recount from explicit matmuls, every criterion and sparsity; and the
    gate-h filter's own share against GATE_H_GATE_SHARE."""
    lm, out = runs
    run, meta = out["gate-h"]
    g, passes = meta.gated, read_passes(run)
    norms = [column_norms(layer.mlp.gate_proj.weight).detach().numpy() for layer in lm.layers]
    lo = {k: np.zeros_like(v, dtype=np.int64) for k, v in passes.items()}
    hi = {k: np.zeros_like(v, dtype=np.int64) for k, v in passes.items()}
    gate_filter = np.zeros(2)
    for ids in token_batches(lm.tokenizer, iter_texts(str(text_corpus)), 48, 3, 720):
        for i, (x, a, h) in enumerate(ffn_parts(lm, ids)):
            for c in CRITERIA:
                for s in SPARSITIES:
                    t = entry(g, c, s, i)
                    k = f"{c}@{key(s)}"
                    lo[k][i] += ref_pass(c, x, a, h, {n: v + EPS for n, v in t.items()}, norms[i]).sum(0)
                    hi[k][i] += ref_pass(c, x, a, h, {n: v - EPS for n, v in t.items()}, norms[i]).sum(0)
            gate_filter[i] += (np.abs(a) > entry(g, "gate-h", 0.5, i)["gate"]).sum()
    for k in passes:
        assert (lo[k] <= passes[k]).all() and (passes[k] <= hi[k]).all(), k
        assert (hi[k] - lo[k]).sum() <= 0.001 * passes[k].sum(), k
    np.testing.assert_allclose(gate_filter / (720 * 48), 1 - GATE_H_GATE_SHARE * 0.5, atol=0.01)


def test_masks_are_exact_at_the_thresholds():
    """A score equal to its threshold does not pass; every criterion against its float64 numpy reference, in float64,
    float32 and float16 inputs (half compared in float32)."""
    rng = np.random.default_rng(0)
    x, a, u = rng.normal(size=(64, 16)), rng.normal(size=(64, 24)), rng.normal(size=(64, 24))
    h, norm = a * u, np.abs(rng.normal(size=16)) + 0.1
    t = {"gate": float(np.float32(np.abs(a[3, 5]))), "h": float(np.float32(np.abs(h[7, 2]))),
         "x": float(np.float32(np.abs(x[1, 1])))}
    a[3, 5], h[7, 2], x[1, 1] = t["gate"], t["h"], t["x"]  # exactly at the thresholds
    taus = LayerTaus(gate=t["gate"], h=t["h"])
    for dtype in (torch.float64, torch.float32):
        ta, th, tx = (torch.tensor(v, dtype=dtype) for v in (a, h, x))
        for c in ("h", "gate", "gate-h"):
            got = neuron_pass(c, ta, th, taus).numpy()
            np.testing.assert_array_equal(got, ref_pass(c, x, a, h, t, None), err_msg=f"{c} {dtype}")
        np.testing.assert_array_equal(channel_pass("input", tx, t["x"]).numpy(), ref_pass("input", x, a, h, t, None))
        assert not neuron_pass("gate", ta, th, taus)[3, 5] and not neuron_pass("h", ta, th, taus)[7, 2]
        assert not channel_pass("input", tx, t["x"])[1, 1]
    tx, tn = torch.tensor(x), torch.tensor(norm)
    tw = float(np.float32(np.abs(x[4, 3]) * norm[3]))
    np.testing.assert_array_equal(channel_pass("wina", tx, tw, tn).numpy(), np.abs(x) * norm > tw)
    half = torch.tensor(h, dtype=torch.float16)
    np.testing.assert_array_equal(neuron_pass("h", None, half, taus).numpy(),
                                  np.abs(half.float().numpy()) > np.float32(t["h"]))
    # gate-h degenerates: tau_h = 0 is gate (no u is exactly 0 here), tau_g = 0 is h
    ta, th = torch.tensor(a), torch.tensor(h)
    assert torch.equal(neuron_pass("gate-h", ta, th, LayerTaus(gate=t["gate"], h=0.0)),
                       neuron_pass("gate", ta, th, LayerTaus(gate=t["gate"])))
    assert torch.equal(neuron_pass("gate-h", ta, th, LayerTaus(gate=0.0, h=t["h"])),
                       neuron_pass("h", ta, th, LayerTaus(h=t["h"])))


def test_streamed_path_equals_transformers(runs, tiny_model_dir, text_corpus, tmp_path, monkeypatch):
    """Layer by layer from the file: the same thresholds, pass counts and count as the transformers path."""
    _, out = runs
    run, meta = out["gate-h"]

    def refuse(*a, **k):
        raise AssertionError("the transformers model was loaded")

    monkeypatch.setattr("hotneurons.profiler.profile.load_model", refuse)
    streamed = profile_model(cfg(tiny_model_dir(NAME), text_corpus, criterion="gate-h"), tmp_path / "s",
                             progress=False)
    assert streamed["config"]["layer_by_layer"]
    assert streamed.gated == meta.gated and streamed.taus == meta.taus and streamed.gate_taus == meta.gate_taus
    a, b = read_passes(tmp_path / "s"), read_passes(run)
    assert set(a) == set(b) and all((a[k] == b[k]).all() for k in a)
    for f in ("neurons.parquet", "samples/layer_001.mask.npy"):
        ra, rb = tmp_path / "s" / "profile" / f, run / "profile" / f
        if f.endswith(".npy"):
            np.testing.assert_array_equal(np.load(ra), np.load(rb))
        else:
            pd.testing.assert_frame_equal(pd.read_parquet(ra), pd.read_parquet(rb))


def reference_ppl(lm, corpus, crit, taus, norms) -> tuple[float, float]:
    """(perplexity, share skipped) with each FFN replaced by explicit float64 matmuls masked by the criterion."""
    originals, seen, passed = [], [0], [0]
    for i, layer in enumerate(lm.layers):
        mlp = layer.mlp
        originals.append(mlp.forward)

        def fwd(x, mlp=mlp, i=i):
            if crit in ("input", "wina"):
                s = x.abs() * (norms[i] if crit == "wina" else 1.0)
                m = s > taus[i]
                x = torch.where(m, x, torch.zeros_like(x))
            g, u = x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T
            a = torch.nn.functional.silu(g)
            h = a * u
            if crit == "h":
                m = h.abs() > taus[i].h
            elif crit == "gate":
                m = a.abs() > taus[i].gate
            elif crit == "gate-h":
                m = (a.abs() > taus[i].gate) & (h.abs() > taus[i].h)
            if crit in ("h", "gate", "gate-h"):
                h = torch.where(m, h, torch.zeros_like(h))
            seen[0] += m.numel()
            passed[0] += int(m.sum())
            return h @ mlp.down_proj.weight.T
        mlp.forward = fwd
    try:
        nll, n = reference_nll(lm, corpus, EVAL)
    finally:
        for layer, f in zip(lm.layers, originals):
            layer.mlp.forward = f
    return math.exp(nll / n), 1 - passed[0] / seen[0]


def test_eval_criteria_match_the_reference(runs, text_corpus):
    """pi-eval's masking per criterion: perplexity and measured sparsity equal an explicit float64 reference; bytes read
    follow from the measured shares; the gate-h profile's oracle mode is its criterion at its target."""
    lm, out = runs
    run, meta = out["gate-h"]
    rep = evaluate(run, criteria=",".join(CRITERIA), sparsities=[0.4, 0.65], dataset=str(text_corpus), lm=lm,
                   **EVAL)
    assert list(rep.modes) == ["dense"] and len(rep.gated) == 10
    g = meta.gated
    norms = [column_norms(layer.mlp.gate_proj.weight) for layer in lm.layers]
    for r in rep.gated:
        t = g["taus"][r.criterion.value][key(r.sparsity)]
        if "x" in t:
            taus = t["x"]
        else:
            taus = [LayerTaus(gate=t.get("gate", [0.0, 0.0])[i], h=t.get("h", [0.0, 0.0])[i]) for i in range(2)]
        ppl, skipped = reference_ppl(lm, text_corpus, r.criterion.value, taus, norms)
        assert r.perplexity == pytest.approx(ppl, rel=1e-9), r.criterion
        assert r.ffn_sparsity == pytest.approx(skipped, abs=1e-12)
        assert r.ppl_vs_dense == pytest.approx(r.perplexity / rep.modes["dense"].perplexity - 1)
        assert r.skips == ("neurons" if r.criterion.per_neuron else "channels")
        p = r.pass_share
        want = {"h": (2 + p) / 3, "gate": (1 + 2 * p) / 3, "input": (1 + 2 * p) / 3, "wina": (1 + 2 * p) / 3,
                "gate-h": (1 + (r.gate_pass_share or 0) + p) / 3}[r.criterion.value]
        assert r.bytes_read_share == pytest.approx(want)
        assert (r.gate_pass_share is not None) == (r.criterion.value == "gate-h")
    saved = json.loads((run / "eval" / "eval.json").read_text())
    assert [x["criterion"] for x in saved["gated"]][:2] == ["h", "h"]
    # the oracle of a gate-h profile masks by gate-h at the profile's target, as the gated result at 0.5 does
    both = evaluate(run, modes=["oracle"], criteria="gate-h", sparsities=[0.5], dataset=str(text_corpus), lm=lm,
                    write=False, **EVAL)
    assert both.modes["oracle"].perplexity == both.gated[0].perplexity
    assert both.modes["oracle"].ffn_sparsity == pytest.approx(both.gated[0].ffn_sparsity)


def test_answer_agreement(runs, text_corpus, tmp_path):
    """Masks that skip nothing answer as dense; pi-eval --answers reports shares per criterion and the dense answers."""
    lm, out = runs
    prompts = ["What is the capital of France?", "Name three colors.", "Count to five."]
    dense = greedy_answers(lm, prompts, 6)
    assert len(dense) == 3 and all(0 < len(a) <= 6 for a in dense)
    with GatedMasks(lm, "h", [LayerTaus(h=0.0)] * 2):  # |h| > 0: every neuron of these random weights passes
        assert greedy_answers(lm, prompts, 6) == dense
    assert agreement([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]) == (0.5, (1 + 0.5) / 2)
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"prompts": prompts}))
    rep = evaluate(out["h"][0], criteria="gate,input", sparsities=[0.25], dataset=str(text_corpus), lm=lm,
                   answers=path, new_tokens=6, write=False, **EVAL)
    assert rep.answers["prompts"] == 3 and len(rep.answers["dense"]) == 3
    for r in rep.gated:
        assert r.answers.prompts == 3 and r.answers.new_tokens == 6
        assert 0 <= r.answers.identical_share <= r.answers.prefix_share <= 1


def test_errors_name_the_value_and_the_fix(runs, tiny_model_dir, text_corpus, tmp_path):
    _, out = runs
    run = str(out["h"][0])
    res = CliRunner().invoke(eval_main, ["--run", run, "--criterion", "gates", "--dataset", str(text_corpus)])
    assert res.exit_code == 2 and "unknown sparsity criterion 'gates'" in res.output
    assert "choose one of h, gate, gate-h, input, wina" in res.output
    res = CliRunner().invoke(eval_main, ["--run", run, "--criterion", "gate", "--sparsity", "0.3", "--dataset",
                                         str(text_corpus), "--tokens", "100", "--seq-len", "40"])
    line = res.output.strip().splitlines()[-1]
    assert res.exit_code == 1 and len(res.output.strip().splitlines()) == 1, res.output
    assert "gate thresholds at sparsities 0.25, 0.4, 0.5, 0.65, not 0.3" in line and "(--sparsity)" in line
    res = CliRunner().invoke(eval_main, ["--run", run, "--sparsity", "0.3,x"])
    assert res.exit_code == 2 and "'0.3,x' is not a comma list of sparsities" in res.output
    p = tmp_path / "bad.json"
    p.write_text("[1, 2]")
    res = CliRunner().invoke(eval_main, ["--run", run, "--criterion", "gate", "--answers", str(p), "--dataset",
                                         str(text_corpus)])
    assert res.exit_code == 1 and "holds no list of prompt strings" in res.output and "(--answers)" in res.output
    # a ReLU-family model: no gated section, no passes; --criterion gate refused, pi-eval's criteria too
    relu = tiny_model_dir("llama-reglu")
    base = ["--model", str(relu), "--dataset", str(text_corpus), "--tokens", "300", "--seq-len", "48",
            "--calibration-tokens", "100", "--samples-per-layer", "0", "--quiet", "--out", str(tmp_path / "r")]
    res = CliRunner().invoke(profile_cli, [*base, "--criterion", "gate"])
    assert res.exit_code == 1 and "leave the criterion at h (--criterion)" in res.output, res.output
    assert CliRunner().invoke(profile_cli, base).exit_code == 0
    meta = json.loads((tmp_path / "r" / "profile" / "meta.json").read_text())
    assert "gated" not in meta and not (tmp_path / "r" / "profile" / "passes.safetensors").exists()
    res = CliRunner().invoke(eval_main, ["--run", str(tmp_path / "r"), "--criterion", "gate", "--dataset",
                                         str(text_corpus)])
    assert res.exit_code == 1 and "has no thresholds for gated sparsity" in res.output
    res = CliRunner().invoke(profile_cli, [*base, "--criterion", "wina"])
    assert res.exit_code == 2 and "'wina'" in res.output
