"""Expert predictors: a ReLU-family mixture of experts' cold experts computing only the neurons a low-rank predictor
marks (kernels/cold_experts_sparse.sparse_layer_predicted), against float64.

A predictor p of expert e: neuron j marked iff (pb[p] @ (pa[p] @ x))_j > pt[p, j]; of the marked neurons, the ones
that fire are computed exactly; the unmarked ones are dropped. The float64 reference applies the same rule. Thresholds
are moved away from every tested token's score by 1e-3 of the scores' scale, so that float32's rounding of the
kernel's scores (r d products, relative error ~1e-6) cannot flip a mark. Output tolerance as
tests/test_cold_experts_sparse.py's: |out - ref| <= 1e-4 * max|ref|.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
from hotneurons.kernels import cold_experts_sparse as KS
from hotneurons.kernels.cold import ACT_CODE, NO_FLAGS
from hotneurons.kernels.cold_experts import CODE
from test_cold_experts_sparse import D, E, K, N, _call, _kernel_case, _reference

R = 8  # the predictors' rank


def _predictors(rng: np.random.Generator, xs: np.ndarray, dt_of: np.ndarray, keep: float = 0.35):
    """pa (P, R, D), pb (P, N, R), pt (P, N) float32 for every cold expert but the last (pid_of -1: whole gate rows),
    thresholds marking about `keep` of the neurons for the tokens xs, none within 1e-3 of the scores' scale of any
    token's score."""
    cold = np.flatnonzero(dt_of >= 0)
    with_pred = cold[:-1]
    P = len(with_pred)
    pa = (rng.standard_normal((P, R, D)) * 0.1).astype(np.float32)
    pb = (rng.standard_normal((P, N, R)) * 0.1).astype(np.float32)
    scores = np.einsum("pnr,prd,td->ptn", pb.astype(np.float64), pa.astype(np.float64), xs.astype(np.float64))
    scale = float(np.abs(scores).max())
    pt = np.quantile(scores, 1 - keep, axis=1)  # (P, N)
    for _ in range(100):
        near = (np.abs(scores - pt[:, None]) < 1e-3 * scale).any(1)
        if not near.any():
            break
        pt = np.where(near, pt + 2.5e-3 * scale, pt)
    pid_of = np.full(E, -1, np.int64)
    pid_of[with_pred] = np.arange(P)
    return pa, pb, pt.astype(np.float32), pid_of


def _call_predicted(x, ids, wts, rows, cold_of, dt_of, act, fmt, out, pred, xq=False):
    gs, us, ds = rows
    idx, hs, cnt = KS.scratch(len(ids), N)
    f = CODE.get(fmt, -1)
    z = np.empty((len(ids), R), np.float32)
    return KS.sparse_layer_predicted(NO_FLAGS, NO_FLAGS, -1, x, ids, wts, cold_of, dt_of, gs, us, ds, idx, hs, cnt,
                                     np.empty((numba.get_num_threads(), D), np.float32), out, ACT_CODE[act], f, f,
                                     *pred, z, xq)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "f32"])
@pytest.mark.parametrize("act", ["drelu", "reglu"])
def test_predicted_kernel_equals_float64(fmt, act):
    xs, rows, w64, cold_of, dt_of = _kernel_case(fmt, act, seed=20 + ACT_CODE[act])
    rng = np.random.default_rng(5)
    pred = _predictors(rng, xs, dt_of)
    shares = []
    for t, ids in enumerate(([1, 2], [4, 6], [0, 5], [3, 7])):  # both cold, both cold (6: no predictor), one, none
        ids = np.array(ids, np.int64)
        wts = rng.random(K).astype(np.float32)
        out = np.full(D, np.nan, np.float32)
        k = _call_predicted(xs[t], ids, wts, rows, cold_of, dt_of, act, fmt, out, pred)
        ref, fired = _reference(act, xs[t], ids, wts, w64, dt_of, pred)
        assert k == fired
        np.testing.assert_allclose(out, ref, rtol=0, atol=1e-4 * max(1e-3, float(np.abs(ref).max())))
        whole = np.full(D, np.nan, np.float32)
        k_whole = _call(xs[t], ids, wts, rows, cold_of, dt_of, act, fmt, whole)
        if (pred[3][ids] >= 0).any():
            shares.append(k / max(1, k_whole))
    assert 0.1 < min(shares) and max(shares) < 0.9  # the predictors dropped some firing neurons, not all


def test_predictors_marking_all_or_none():
    """Thresholds of -inf: the sparse_layer's output and count exactly (the same sums in the same order); +inf: the
    experts with predictors contribute nothing, the one without (6) as sparse_layer."""
    xs, rows, w64, cold_of, dt_of = _kernel_case("q4_0", "drelu", seed=31)
    pa, pb, pt, pid_of = _predictors(np.random.default_rng(2), xs, dt_of)
    ids, wts = np.array([4, 6], np.int64), np.array([0.55, 0.45], np.float32)
    whole = np.full(D, np.nan, np.float32)
    k_whole = _call(xs[0], ids, wts, rows, cold_of, dt_of, "drelu", "q4_0", whole)
    out = np.full(D, np.nan, np.float32)
    k = _call_predicted(xs[0], ids, wts, rows, cold_of, dt_of, "drelu", "q4_0", out,
                        (pa, pb, np.full_like(pt, -np.inf), pid_of))
    assert k == k_whole
    np.testing.assert_allclose(out, whole, rtol=0, atol=1e-6 * float(np.abs(whole).max()))
    only6 = np.full(D, np.nan, np.float32)
    k6 = _call(xs[0], ids[1:], wts[1:], rows, cold_of, dt_of, "drelu", "q4_0", only6)
    k = _call_predicted(xs[0], ids, wts, rows, cold_of, dt_of, "drelu", "q4_0", out,
                        (pa, pb, np.full_like(pt, np.inf), pid_of))
    assert k == k6
    np.testing.assert_allclose(out, only6, rtol=0, atol=1e-6 * float(np.abs(only6).max()))


def test_predictors_refused_for_ungated_experts():
    xs, rows, w64, cold_of, dt_of = _kernel_case("q4_0", "relu", seed=3)
    pred = _predictors(np.random.default_rng(0), xs, dt_of)
    with pytest.raises(ValueError, match="gated activation"):
        _call_predicted(xs[0], np.array([1, 2], np.int64), np.ones(K, np.float32), rows, cold_of, dt_of, "relu",
                        "q4_0", np.empty(D, np.float32), pred)


# ---------------------------------------------------------------------------------------------------------------
# The file and HybridMoE


def _layer_file(tmp_path, ffn, t_value=None, rng=None, r=R):
    from hotneurons.artifacts import expert_predictors as EF

    rng = rng or np.random.default_rng(0)
    cold = np.flatnonzero(~ffn.gpu)
    P = len(cold)
    parts = {"ids": cold, "a": rng.standard_normal((P, r, D)).astype(np.float32) * 0.1,
             "b": rng.standard_normal((P, N, r)).astype(np.float32) * 0.1,
             "t": np.full((P, N), -np.inf if t_value is None else t_value, np.float32)}
    return EF.save(tmp_path / "predictors" / EF.FILE, {0: parts}), parts


def test_hybrid_moe_with_expert_predictors(tmp_path):
    """A saved file attached to a HybridMoE layer: with thresholds of -inf every firing neuron is marked, so decode
    equals the layer without predictors (same count of firing cold neurons); with +inf the cold experts add nothing
    (no neuron fires on the CPU) and the summary counts the predictors and their bytes."""
    import torch
    from hotneurons.common.kinds import Activation
    from hotneurons.runtime import expert_predictors as EP
    from hotneurons.runtime.moe_ffn import HybridMoE
    from test_cold_experts_sparse import GPU, _cfg, _moe_weights, _tokens

    xs = _tokens(np.random.default_rng(3), 4)
    cfg = _cfg(Activation.DRELU)
    w = _moe_weights("q4_0", xs, seed=9)
    plain = HybridMoE(0, cfg, w.get, GPU, "cpu", torch.float32)
    ffn = HybridMoE(0, cfg, w.get, GPU, "cpu", torch.float32)
    path, parts = _layer_file(tmp_path, ffn)
    summary = EP.attach([ffn], path)
    assert summary["layers"] == 1 and summary["predictors"] == int((~GPU).sum()) and summary["rank"] == R
    assert summary["bytes"] == sum(parts[k].nbytes for k in ("a", "b", "t"))
    assert ffn.cold_bytes() == plain.cold_bytes() + summary["bytes"]
    x = torch.from_numpy(xs)
    for t in range(4):
        torch.testing.assert_close(ffn(x[t:t + 1]), plain(x[t:t + 1]), rtol=0, atol=1e-6)
    assert ffn.cold_active == plain.cold_active > 0
    relu = HybridMoE(0, _cfg(Activation.RELU), _moe_weights("q4_0", xs, seed=9).get, GPU, "cpu", torch.float32)
    with pytest.raises(ValueError, match="use relu, which has none"):
        EP.attach([relu], path)  # an ungated expert has no gate to mark by
    none, _ = _layer_file(tmp_path / "none", ffn, t_value=np.inf)
    EP.attach([ffn], none)
    ffn.reset_counts()
    for t in range(4):
        ffn(x[t:t + 1])
    assert ffn.cold_active == 0


def test_expert_predictor_file_errors(tmp_path):
    from hotneurons.artifacts import expert_predictors as EF
    from safetensors.numpy import save_file

    with pytest.raises(ValueError, match="lack"):
        EF.save(tmp_path / "p.safetensors", {0: {"ids": np.zeros(1, np.int64)}})
    save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not an expert predictors file"):
        EF.read(tmp_path / "other.safetensors", E, D, N)
    parts = {"ids": np.array([1, 1]), "a": np.zeros((2, R, D)), "b": np.zeros((2, N, R)), "t": np.zeros((2, N))}
    EF.save(tmp_path / "dup.safetensors", {0: parts})
    with pytest.raises(ValueError, match="not distinct ids"):
        EF.read(tmp_path / "dup.safetensors", E, D, N)
    EF.save(tmp_path / "shape.safetensors", {0: {**parts, "ids": np.array([1, 2]), "b": np.zeros((2, N + 1, R))}})
    with pytest.raises(ValueError, match=r"shapes ids \(2,\)"):
        EF.read(tmp_path / "shape.safetensors", E, D, N)
    assert not list(tmp_path.glob("*.partial"))


def test_expert_predictor_bytes_bench():
    """bench/expert_predictor_bytes.py at a small shape: the build's exact predictor keeps the stored gate's firings
    on held-out inputs and reads fewer bytes than every gate row."""
    from bench.expert_predictor_bytes import measure

    fig = measure(n=1024, d=256, rank=8, tokens=256)
    assert fig["held_out"]["recall"] > 0.99 and fig["held_out"]["marked"] < 0.5
    b = fig["bytes_per_token"]
    assert b["with_predictor"] < b["gate_rows_whole"] < b["expert_dense"] and fig["fewer_bytes"] > 1.2


# ---------------------------------------------------------------------------------------------------------------
# pi-train-predictors on a mixture of sparse experts (predictors/experts_fit.py)


def test_fit_expert_is_exact_at_full_rank_and_keeps_recall_below_it():
    """At the gate's own rank the fitted predictor reproduces the pre-activations (threshold 0: marked = fires);
    at a lower rank the threshold widens until the held-out recall reaches the target."""
    import torch
    from hotneurons.predictors.experts_fit import fit_expert

    g = torch.Generator().manual_seed(0)
    n, d = 256, 64
    gate = torch.randn((n, 16), generator=g) @ torch.randn((16, d), generator=g) / 4
    gate[:, 0] = -1.0  # with x[:, 0] = 1: fires for about a third of the tokens; the gate's rank is 17
    x = torch.randn((600, d), generator=g)
    x[:, 0] = 1.0
    full = fit_expert(gate, x, rank=17, recall=0.99)
    # threshold 0: only the neurons whose gate sits within float32 rounding of 0 can differ
    assert full["k"] == 0.0 and full["recall"] >= 0.99 and abs(full["marked"] - full["fires"]) < 0.01
    np.testing.assert_allclose(full["b"] @ full["a"], gate.numpy(), atol=1e-4)
    low = fit_expert(gate, x, rank=4, recall=0.95)
    assert low["recall"] >= 0.95 and low["k"] > 0 and low["fires"] < low["marked"] < 1.0
    assert low["a"].shape == (4, d) and low["b"].shape == (n, 4) and low["t"].shape == (n,)


def test_pi_train_predictors_fits_sparse_experts(tmp_path):
    """A tiny ReLU-gated Mixtral: pi-profile, then pi-train-predictors writes expert predictors (recall at the
    target on held-out inputs); the runtime finds them in the run and uses them for its cold experts. A SwiGLU
    mixture of experts is refused in one line."""
    import json

    from click.testing import CliRunner
    from hotneurons.predictors.cli import train_main
    from hotneurons.profiler.cli import main as profile
    from hotneurons.runtime.config import RuntimeConfig
    from hotneurons.runtime.generate import generate
    from hotneurons.runtime.load import load_source_runtime
    from test_profile_moe import build, random_corpus

    corpus = random_corpus(tmp_path / "c.jsonl", seed=4)
    runs = {}
    for act in ("relu", "silu"):
        folder = build("mixtral", act, tmp_path / act, seed=5)
        runs[act] = tmp_path / f"run-{act}"
        res = CliRunner().invoke(profile, ["--model", str(folder), "--dataset", str(corpus), "--tokens", "600",
                                           "--seq-len", "32", "--batch-size", "2", "--calibration-tokens", "64",
                                           "--out", str(runs[act]), "--quiet"])
        assert res.exit_code == 0, res.output
    res = CliRunner().invoke(train_main, ["--run", str(runs["relu"]), "--expert-rank", "8", "--expert-tokens", "600",
                                          "--device", "cpu", "--quiet", "--json"])
    assert res.exit_code == 0, res.output
    s = json.loads(res.output[res.output.index("{"):])
    assert s["predictors"] == 2 * 4 and s["min_recall"] >= 0.99 and s["mean_marked"] < 1.0
    assert (runs["relu"] / "predictors" / "expert_predictors.json").exists()
    mask = np.array([[True, True, False, False]] * 2)  # experts 2 and 3 cold
    meta = json.loads((runs["relu"] / "profile" / "meta.json").read_text())
    rt = load_source_runtime(runs["relu"], meta, RuntimeConfig(device="cpu", ctx=64), placement=mask)
    assert rt.expert_predictors["layers"] == 2 and rt.expert_predictors["rank"] == 8
    assert all(f.expert_predictors is not None for f in rt.ffns)
    out = generate(rt, list(range(3, 19)), 8, stop_at_eos=False)
    assert len(out.token_ids) == 8 and out.stats["experts"]["expert_predictors"] == rt.expert_predictors
    res = CliRunner().invoke(train_main, ["--run", str(runs["silu"]), "--device", "cpu", "--quiet"])
    assert res.exit_code == 1 and res.output.count("\n") <= 2, res.output
    assert "needs no predictors" in res.output and "pi-solve" in res.output


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_expert_predictors_on_cuda_graphs(tmp_path):
    """On CUDA (the static decoder's graphs, the cold experts' kernel between them with its wait and release): with
    thresholds of -inf the predictors mark every neuron, so greedy tokens equal the run without them; with the fitted
    thresholds the tokens are generated and the stats name the predictors."""
    import json

    from click.testing import CliRunner
    from hotneurons.artifacts import expert_predictors as EF
    from hotneurons.predictors.cli import train_main
    from hotneurons.profiler.cli import main as profile
    from hotneurons.runtime import expert_predictors as EP
    from hotneurons.runtime.config import RuntimeConfig
    from hotneurons.runtime.generate import generate
    from hotneurons.runtime.load import load_source_runtime
    from test_profile_moe import build, random_corpus

    folder = build("mixtral", "relu", tmp_path / "m", seed=6)
    run, corpus = tmp_path / "run", random_corpus(tmp_path / "c.jsonl", 2)
    args = ["--model", str(folder), "--dataset", str(corpus), "--tokens", "600", "--seq-len", "32", "--batch-size",
            "2", "--out", str(run), "--quiet"]
    assert CliRunner().invoke(profile, args).exit_code == 0
    assert CliRunner().invoke(train_main, ["--run", str(run), "--expert-rank", "8", "--expert-tokens", "600",
                                           "--quiet"]).exit_code == 0
    meta = json.loads((run / "profile" / "meta.json").read_text())
    mask = np.array([[True, False, False, True]] * 2)
    prompt = list(range(7, 23))

    def tokens(use: bool) -> tuple[list[int], dict | None]:
        rt = load_source_runtime(run, meta, RuntimeConfig(device="cuda", ctx=64, expert_predictors=use),
                                 placement=mask)
        out = generate(rt, prompt, 10, stop_at_eos=False)
        return out.token_ids, out.stats["experts"]["expert_predictors"]

    fitted, summary = tokens(True)
    assert len(fitted) == 10 and summary["rank"] == 8
    path = EF.path_in(run)
    layers = EP.load(path, 4, 32, 32, 2)
    EF.save(path, {i: {"ids": np.flatnonzero(lp.pid_of >= 0), "a": lp.a, "b": lp.b, "t": np.full_like(lp.t, -np.inf)}
                   for i, lp in layers.items()})
    assert tokens(True)[0] == tokens(False)[0]
