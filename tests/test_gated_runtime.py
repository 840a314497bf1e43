"""Mask 'gate' (common/gating.py): a gated model's neurons skipped by their own gates, no predictor.

The CPU's gate-first kernel (kernels/cold_experts_sparse.sparse_layer with thresholds, over a dense layer's cold rows
as one expert) against float64 numpy on the weights the rows hold; and the runtime's decode (hot rows masked on the
device, cold ones gate-first on the CPU, prefill masked alike) against HF's model with each FFN masked by the same
rule (a float32 torch reference).

Masks are compared exactly: the thresholds sit at midpoints between the test tokens' sorted scores, far (relative to
float32 rounding) from every score, so the kernel's float32 dots and numpy's float64 ones decide alike. Tolerances:
|out - ref| <= 1e-4 * max|ref| (float32 sums over d terms, as test_cold_experts_sparse.py); logits within 1e-4 of the
reference (the same weights, other summation orders, as test_runtime.py).
"""

from __future__ import annotations

import copy
import json

import numba
import numpy as np
import pytest
import tiny
import torch
from hotneurons.kernels import cold_experts_sparse as KS
from hotneurons.kernels.cold import ACT_CODE, NO_FLAGS
from hotneurons.kernels.cold_experts import CODE
from hotneurons.kernels.ops import gate_act, gated_values
from hotneurons.runtime.generate import RuntimeConfig, generate
from hotneurons.runtime.load import build_runtime
from test_kernels_experts import _stored  # the rows as stored, and the float64 weights they hold
from test_runtime import make_placement

D, N = 256, 384
SILU = {"swiglu": lambda g: g / (1 + np.exp(-g)),
        "geglu": lambda g: 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))}


def _midpoint(scores: np.ndarray, q: float) -> float:
    """A float32 threshold between the two sorted scores around quantile q: no score lies near it."""
    s = np.sort(scores.ravel())
    k = int(q * len(s))
    return float(np.float32((s[k - 1] + s[k]) / 2))


def _bf16_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows as int16 bf16 bit patterns, the float64 weights they hold)."""
    b = torch.from_numpy(w).bfloat16()
    return b.view(torch.int16).numpy().copy(), b.double().numpy()


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "bf16", "f32"])
@pytest.mark.parametrize("act", ["swiglu", "geglu"])
@pytest.mark.parametrize("crit", ["gate", "h", "gate-h"])
def test_gate_first_kernel_equals_float64(fmt, act, crit):
    rng = np.random.default_rng(ACT_CODE[act] + 10 * len(crit))
    g, u, dt = (rng.standard_normal((N, D)).astype(np.float32) * 0.1 for _ in range(3))
    store = _bf16_rows if fmt == "bf16" else (lambda w: _stored(w, fmt))
    (gs, g64), (us, u64), (ds, d64) = store(g), store(u), store(dt)
    xs = rng.standard_normal((3, D)).astype(np.float32)
    a = SILU[act](xs.astype(np.float64) @ g64.T)  # (tokens, N) act(g)
    h = a * (xs.astype(np.float64) @ u64.T)
    tau_g = _midpoint(np.abs(a), 0.3 if crit == "gate-h" else 0.5) if crit != "h" else 0.0
    tau_h = _midpoint(np.abs(h[np.abs(a) > tau_g]), 0.3) if crit != "gate" else 0.0
    one = np.zeros(1, np.int64)
    f = CODE.get(fmt, -1)
    for t in range(len(xs)):
        keep = (np.abs(a[t]) > tau_g) & (np.abs(h[t]) > tau_h)  # (N,) the rule, in float64
        idx, hs, cnt = KS.scratch(1, N)
        part = np.empty((numba.get_num_threads(), D), np.float32)
        out = np.full(D, np.nan, np.float32)
        k = KS.sparse_layer(NO_FLAGS, NO_FLAGS, -1, xs[t], one, np.ones(1, np.float32), one, one, gs, us, ds, idx,
                            hs, cnt, part, out, ACT_CODE[act], f, f, False, tau_g, tau_h)
        assert k == keep.sum() and sorted(idx[:k]) == list(np.flatnonzero(keep))
        ref = d64.T @ (h[t] * keep)
        np.testing.assert_allclose(out, ref, rtol=0, atol=1e-4 * float(np.abs(ref).max()))
        assert 0.2 < keep.mean() < 0.8  # the sparsity the test means to exercise


def test_gate_first_part_rows_hold_the_sum_without_out():
    """On CUDA the dense layer's host buffers have out of shape (0,): the GPU adds part's rows, so rows the kernel did
    not use must be zero."""
    rng = np.random.default_rng(3)
    g, u, dt = (rng.standard_normal((N, D)).astype(np.float32) * 0.1 for _ in range(3))
    x = rng.standard_normal(D).astype(np.float32)
    one = np.zeros(1, np.int64)
    idx, hs, cnt = KS.scratch(1, N)
    args = (one, np.ones(1, np.float32), one, one, g, u, dt, idx, hs, cnt)
    want = np.empty(D, np.float32)
    part = np.empty((numba.get_num_threads(), D), np.float32)
    KS.sparse_layer(NO_FLAGS, NO_FLAGS, -1, x, *args, part, want, ACT_CODE["swiglu"], -1, -1, False, 0.1, 0.0)
    part[:] = np.nan
    KS.sparse_layer(NO_FLAGS, NO_FLAGS, -1, x, *args, part, np.empty(0, np.float32), ACT_CODE["swiglu"], -1, -1,
                    False, 0.1, 0.0)
    np.testing.assert_allclose(part.sum(0), want, rtol=0, atol=1e-5 * float(np.abs(want).max()))


def test_gated_values_rule():
    g = torch.tensor([[-2.0, -0.1, 0.0, 0.3, 2.0]])
    u = torch.tensor([[1.0, 1.0, 5.0, 1.0, 0.01]])
    a = gate_act("swiglu", g)
    tau_g = float(a[0, 3].abs())  # equal to a score: does not pass (>, not >=)
    h = gated_values("swiglu", g, u, (tau_g, 0.0))
    assert (h[0] != 0).tolist() == [True, False, False, False, True]
    h = gated_values("swiglu", g, u, (0.0, 0.1))  # |h| of the last: 1.76 * 0.01 < 0.1
    assert (h[0] != 0).tolist() == [True, False, False, True, False]


# ---------------------------------------------------------------------------------------------------------------
# The runtime against HF's model masked by the same rule


def _gate_scores(lm, ids: list[int]) -> list[np.ndarray]:
    """Per layer |act(g)| (tokens, n) of the prompt through the dense model."""
    out: list[np.ndarray] = []
    hooks = [lm.adapter.layer_ffn(layer)["gate"].register_forward_hook(
        lambda _m, _a, g: out.append(gate_act(lm.activation, g).abs().reshape(-1, g.shape[-1]).numpy()))
        for layer in lm.layers]
    with torch.no_grad():
        lm.model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return out


def _masked_reference(lm, taus: list[tuple[float, float]]):
    """A copy of lm whose FFNs compute down(gated_values(...)): what mask 'gate' computes."""
    ref = copy.deepcopy(lm)
    for layer, t in zip(ref.layers, taus):
        ffn = ref.adapter.layer_ffn(layer)
        layer.mlp.forward = (lambda x, ffn=ffn, t=t: ffn["down"](gated_values(lm.activation, ffn["gate"](x),
                                                                              ffn["up"](x), t)))
    return ref


@pytest.mark.parametrize("family", ["llama-swiglu", "gemma-geglu"])
@pytest.mark.parametrize("where", ["mixed", "cpu"])
def test_gate_mask_equals_masked_hf(family, where, tiny_model_dir):
    lm = tiny.load_rounded(tiny_model_dir(family), family)
    ids = list(lm.tokenizer("The quick brown fox jumps over the lazy dog")["input_ids"])
    scores = _gate_scores(lm, ids)
    taus = [(_midpoint(s, 0.5), 0.0) for s in scores]
    ref = _masked_reference(lm, taus)
    out = ref.model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    want, want_logits = out.sequences[0, len(ids):].tolist(), [lg[0] for lg in out.logits]
    rt = build_runtime(lm, RuntimeConfig(device="cpu", sparsity=0.5), make_placement(lm, where), gate_taus=taus)
    assert all(f.mask == "gate" for f in rt.ffns)
    g = generate(rt, ids, 8, keep_logits=True)
    assert g.token_ids == want
    diff = max(float((a - b).abs().max()) for a, b in zip(g.logits, want_logits))
    assert diff < 1e-4, diff
    assert 0.2 < g.stats["ffn_sparsity"] < 0.8  # decode tokens' measured share of skipped neurons


# ---------------------------------------------------------------------------------------------------------------
# The commands: profile -> solve -> generate / serve on a gated model, no predictors


@pytest.fixture(scope="module")
def gated_run(tiny_model_dir, text_corpus, tmp_path_factory):
    from click.testing import CliRunner
    from hotneurons.profiler.cli import main as profile
    from hotneurons.solver.cli import main as solve

    run = tmp_path_factory.mktemp("gated") / "run"
    folder = tiny_model_dir("llama-swiglu")
    for cmd, args in ((profile, ["--model", str(folder), "--dataset", str(text_corpus), "--tokens", "600",
                                 "--seq-len", "64", "--samples-per-layer", "0", "--criterion", "gate",
                                 "--calibration-tokens", "400", "--out", str(run), "--device", "cpu", "--quiet"]),
                      (solve, ["--run", str(run), "--hardware", "rtx4090", "--vram", "40MB", "--reserve", "0",
                               "--ctx", "128"])):
        res = CliRunner().invoke(cmd, args)
        assert res.exit_code == 0, res.output
    return run, folder


def _generate(run, *flags):
    from click.testing import CliRunner
    from hotneurons.runtime.cli import main

    res = CliRunner().invoke(main, ["--run", str(run), "--device", "cpu", "-n", "6", "--prompt", "The quick brown",
                                    "--json", *flags])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_commands_one_flag_no_predictors(gated_run):
    run, _ = gated_run
    summary = json.loads((run / "placement" / "summary.json").read_text())
    assert any("gate-first" in n for n in summary["hardware"]["notes"])  # priced as the gate mask reads
    assert _generate(run)["stats"]["mask"] == "dense"  # no --sparsity: dense (runtime/gated.py says why)
    for crit in ("gate", "h", "gate-h"):
        s = _generate(run, "--sparsity", "0.5", "--criterion", crit)["stats"]
        assert s["mask"] == "gate" and 0.3 < s["ffn_sparsity"] < 0.7, (crit, s["ffn_sparsity"])


def test_commands_refuse_untabulated_sparsity(gated_run):
    from click.testing import CliRunner
    from hotneurons.runtime.cli import main

    run, _ = gated_run
    res = CliRunner().invoke(main, ["--run", str(run), "--device", "cpu", "--prompt", "x", "--sparsity", "0.3"])
    assert res.exit_code == 1 and "0.25, 0.4, 0.5, 0.65" in res.output and "\n" not in res.output.strip()


def test_serve_loader_takes_the_flag(gated_run):
    from hotneurons.runtime.cli import open_runtime, runtime_request
    from hotneurons.server.cli import main as serve_main

    run, _ = gated_run
    flags = serve_main.make_context("pi-serve", ["--run", str(run), "--device", "cpu", "--port", "0", "--sparsity",
                                                 "0.4"]).params
    rt = open_runtime(runtime_request(flags))
    assert all(f.mask == "gate" for f in rt.ffns) and rt.cfg.sparsity == 0.4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("crit", ["gate", "h"])
def test_cuda_sparse_hot_rows_equal_the_cpu_run(gated_run, crit):
    """On CUDA the gate mask's hot rows go through kernels/gated.gated_ffn (only passing neurons' up and down rows
    read), in CUDA graphs: greedy tokens and the measured sparsity of the CPU run (float32 both, the CPU run checked
    against masked HF above)."""
    from hotneurons.runtime.load import load_runtime

    run, folder = gated_run
    ids = list(tiny.byte_tokenizer()("The quick brown fox")["input_ids"])
    out = {}
    for dev in ("cpu", "cuda"):
        rt = load_runtime(run, RuntimeConfig(device=dev, dtype="float32", sparsity=0.5, criterion=crit))
        assert all(f.mask == "gate" for f in rt.ffns)
        out[dev] = generate(rt, ids, 8, keep_logits=True)
        assert all(f.gws is None for f in rt.ffns if f.n_hot) == (dev == "cpu")  # CUDA: the sparse kernel's buffers
    assert out["cuda"].token_ids == out["cpu"].token_ids
    diff = max(float((a.cpu() - b.cpu()).abs().max()) for a, b in zip(out["cuda"].logits, out["cpu"].logits))
    assert diff < 1e-3, diff
    assert out["cuda"].stats["ffn_sparsity"] == pytest.approx(out["cpu"].stats["ffn_sparsity"], abs=0.02)
