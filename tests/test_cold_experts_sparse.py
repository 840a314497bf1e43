"""A ReLU-family mixture of experts' decode over its firing cold neurons only (kernels/cold_experts_sparse.py, the
neuron-major down_t of runtime/moe_down_t.py, their use in runtime/moe_ffn.HybridMoE).

Experts are random, their gate rows (up rows for ungated relu) shifted so that about 85% of each expert's neurons are
off for the test's tokens (TurboSparse-Mixtral's dReLU rate), stored as gguf-py writes Q4_0 / Q8_0 rows, or float32.

Tolerances: the kernel sums float32 products of the exact de-quantized weights (every Q4_0 / Q8_0 weight d * q is
exact in float32), so against float64 it differs by float32 rounding only: the gate / up dots over d terms, then the
firing neurons' axpys; |out - ref| <= 1e-4 * max|ref| (a few hundred terms of unit-order products, float32 epsilon
1.2e-7 each). HybridMoE against models/moe.moe_ffn (float32, other summation orders) on the weights the kernel
reads (cold experts' down de-quantized from down_t): tests/test_runtime_moe.py's rtol 1e-4, atol 2e-5 x the output's
scale.
"""

from __future__ import annotations

import types

import gguf
import numba
import numpy as np
import pytest
import torch
from hotneurons.common.kinds import Activation
from hotneurons.kernels import cold_experts_sparse as KS
from hotneurons.kernels.cold import ACT_CODE, NO_FLAGS
from hotneurons.kernels.cold_experts import CODE
from hotneurons.models import ModelConfig, moe
from hotneurons.runtime import moe_down_t
from hotneurons.runtime.moe_ffn import HybridMoE
from hotneurons.runtime.moe_load import expert_stats
from hotneurons.runtime.moe_rows import PROJ, unread_rows
from hotneurons.weights.qtensor import QTensor
from hotneurons.weights.source import drop_range, map_file
from test_kernels_experts import _stored  # the rows as stored, and the float64 weights they hold

E, K, D, N = 8, 2, 256, 512
OFF = 0.85  # the share of neurons whose gate (ungated: up) the shift turns off
QTYPE = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
         "q4_1": gguf.GGMLQuantizationType.Q4_1}
GPU = np.array([True, False, False, True, False, False, False, True])  # experts 1, 2, 4, 5, 6 cold



def _shifted(rng: np.random.Generator, xs: np.ndarray, rows: int) -> np.ndarray:
    """(rows, D) float32 random rows, each minus a multiple of the tokens' mean direction so that its pre-activation
    is > 0 for about 1 - OFF of the tokens xs (T, D)."""
    w = rng.standard_normal((rows, D)).astype(np.float32) * 0.1
    u = xs.mean(0)
    u = u / (u @ u)  # w - t u moves every token's pre-activation by about -t (the tokens share most of their direction)
    t = np.quantile(w @ xs.T, OFF, axis=1)  # (rows,)
    return (w - t[:, None] * u[None]).astype(np.float32)


def _tokens(rng: np.random.Generator, T: int) -> np.ndarray:
    """(T, D) float32 tokens sharing a common direction (as a layer's normalised inputs do), so that one shift sets
    the sparsity for all of them."""
    base = rng.standard_normal(D).astype(np.float32)
    return (base[None] + 0.3 * rng.standard_normal((T, D))).astype(np.float32)


def _act(act: str, g: np.ndarray, u: np.ndarray) -> np.ndarray:
    return {"relu": lambda: np.maximum(u, 0), "reglu": lambda: np.maximum(g, 0) * u,
            "drelu": lambda: np.maximum(g, 0) * np.maximum(u, 0)}[act]()


# ---------------------------------------------------------------------------------------------------------------
# The kernel against float64


def _kernel_case(fmt: str, act: str, seed: int):
    """Stacked cold rows (gate, up: all E experts, as read in place; down_t: the cold ones), float64 twins, tokens."""
    rng = np.random.default_rng(seed)
    xs = _tokens(rng, 4)
    gated = act != "relu"
    g = _shifted(rng, xs, E * N) if gated else rng.standard_normal((E * N, D)).astype(np.float32) * 0.1
    u = _shifted(rng, xs, E * N) if not gated else rng.standard_normal((E * N, D)).astype(np.float32) * 0.1
    cold = np.flatnonzero(~GPU)
    dt = rng.standard_normal((len(cold) * N, D)).astype(np.float32) * 0.1
    (gs, g64), (us, u64), (ds, d64) = _stored(g, fmt), _stored(u, fmt), _stored(dt, fmt)
    dt_of = np.full(E, -1, np.int64)
    dt_of[cold] = np.arange(len(cold))
    return xs, (gs, us, ds), (g64, u64, d64), np.where(GPU, -1, np.arange(E)), dt_of


def _reference(act, x, ids, wts, w64, dt_of, pred=None) -> tuple[np.ndarray, int]:
    """float64: sum over the routed cold experts of w_e * down_t_e^T h_e(x); and the firing neurons' count. pred
    (pa, pb, pt, pid_of): an expert with a predictor keeps only its marked neurons (tests/test_expert_predictors.py)."""
    g64, u64, d64 = w64
    y, fired = np.zeros(D), 0
    x = x.astype(np.float64)
    for e, w in zip(ids, wts):
        c = dt_of[e]
        if c < 0:
            continue
        h = _act(act, g64[e * N:(e + 1) * N] @ x, u64[e * N:(e + 1) * N] @ x)  # (N,)
        if pred is not None and pred[3][e] >= 0:
            pa, pb, pt, p = *pred[:3], pred[3][e]
            h = np.where(pb[p].astype(np.float64) @ (pa[p].astype(np.float64) @ x) > pt[p], h, 0.0)
        fired += int((h != 0).sum())
        y += float(w) * (d64[c * N:(c + 1) * N].T @ h)
    return y, fired


def _call(x, ids, wts, rows, cold_of, dt_of, act, fmt, out, ready=NO_FLAGS, release=NO_FLAGS, i=-1):
    gs, us, ds = rows
    code = ACT_CODE[act]
    idx, hs, cnt = KS.scratch(len(ids), N)
    part = np.empty((numba.get_num_threads(), D), np.float32)
    f = CODE.get(fmt, -1)
    return KS.sparse_layer(ready, release, i, x, ids, wts, cold_of, dt_of, gs if code >= 2 else us, us, ds, idx, hs,
                           cnt, part, out, code, f, f)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "f32"])
@pytest.mark.parametrize("act", ["drelu", "reglu", "relu"])
def test_kernel_equals_float64(fmt, act):
    xs, rows, w64, cold_of, dt_of = _kernel_case(fmt, act, seed=ACT_CODE[act])
    rng = np.random.default_rng(7)
    fired_share = []
    for t, ids in enumerate(([1, 2], [4, 6], [0, 5], [3, 7])):  # both cold, both cold, one cold, none cold
        ids = np.array(ids, np.int64)
        wts = rng.random(K).astype(np.float32)
        out = np.full(D, np.nan, np.float32)
        k = _call(xs[t], ids, wts, rows, cold_of, dt_of, act, fmt, out)
        ref, fired = _reference(act, xs[t], ids, wts, w64, dt_of)
        assert k == fired
        np.testing.assert_allclose(out, ref, rtol=0, atol=1e-4 * max(1e-3, float(np.abs(ref).max())))
        n_cold = int((dt_of[ids] >= 0).sum())
        if n_cold:
            fired_share.append(fired / (n_cold * N))
    assert max(fired_share) < (0.3 if act != "drelu" else 0.2)  # the sparsity the test means to exercise
    assert min(fired_share) > 0.02


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("act", ["drelu", "relu"])
def test_kernel_int_route_equals_float64_on_quantized_x(fmt, act):
    """xq=True: pass A's dots on cold_q's int route (x quantized once to Q8_0, cold_q.quantize_x). Against float64 on
    x as quantized: the same firing neurons and the same sum to float32 sums, so the route ran and added only x's
    rounding (the float route, xq=False, against float64 on x itself)."""
    from hotneurons.kernels.cold_q import XQ_OK, quantize_x

    if not XQ_OK:
        pytest.skip("the int route needs AVX-512 VNNI on this CPU")
    xs, rows, w64, cold_of, dt_of = _kernel_case(fmt, act, seed=40 + ACT_CODE[act])
    ids, wts = np.array([1, 2], np.int64), np.array([0.6, 0.4], np.float32)
    gs, us, ds = rows
    code, f = ACT_CODE[act], CODE[fmt]
    for t in range(2):
        q, dx = np.zeros(D, np.int8), np.zeros(D // 32, np.float32)
        quantize_x(xs[t], q, dx)
        xq = (np.repeat(dx, 32) * q).astype(np.float32)  # (D,) x as the int route sees it
        out = {}
        for route in (True, False):
            idx, hs, cnt = KS.scratch(K, N)
            out[route] = np.full(D, np.nan, np.float32)
            k = KS.sparse_layer(NO_FLAGS, NO_FLAGS, -1, xs[t], ids, wts, cold_of, dt_of, gs if code >= 2 else us, us,
                                ds, idx, hs, cnt, np.empty((numba.get_num_threads(), D), np.float32), out[route], code,
                                f, f, route)
            ref, fired = _reference(act, xq if route else xs[t], ids, wts, w64, dt_of)
            assert k == fired
            np.testing.assert_allclose(out[route], ref, rtol=0, atol=1e-4 * float(np.abs(ref).max()))
        assert not np.allclose(out[True], out[False], rtol=1e-6, atol=0)


def test_kernel_ready_and_release_flags():
    """With flags: waits for ready[i] (then reset), releases flag i after writing out; without a signal: -1, nothing
    written, nothing released."""
    xs, rows, w64, cold_of, dt_of = _kernel_case("q4_0", "drelu", seed=11)
    ids, wts = np.array([2, 6], np.int64), np.array([0.7, 0.3], np.float32)
    ready, release = np.zeros(2, np.int32), np.zeros(2, np.int32)
    ready[1] = 1
    out = np.full(D, np.nan, np.float32)
    k = _call(xs[0], ids, wts, rows, cold_of, dt_of, "drelu", "q4_0", out, ready, release, 1)
    ref, fired = _reference("drelu", xs[0], ids, wts, w64, dt_of)
    assert k == fired and ready[1] == 0 and release[1] == 1
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-4 * float(np.abs(ref).max()))
    out[:] = 7.0
    assert _call(xs[0], ids, wts, rows, cold_of, dt_of, "drelu", "q4_0", out, ready, release, 0) == -1
    assert (out == 7.0).all() and release[0] == 0


# ---------------------------------------------------------------------------------------------------------------
# down_t from the file's down


def _down(fmt: str, seed: int = 3) -> tuple[QTensor | torch.Tensor, np.ndarray, np.ndarray]:
    """The stacked down as HybridMoE gets it (QTensor (E * D, N) rows; f32 / f16: (E, D, N) tensors), its host rows,
    its float64 weights (E * D, N)."""
    w = np.random.default_rng(seed).standard_normal((E * D, N)).astype(np.float32) * 0.1
    rows, w64 = _stored(w, fmt)
    if fmt in QTYPE:
        return QTensor(torch.from_numpy(rows), fmt, (E * D, N)), rows, w64
    t = torch.from_numpy(w).reshape(E, D, N)
    t = t.half() if fmt == "f16" else t
    return t, (t.reshape(-1, N).view(torch.int16).numpy().view(np.uint16) if fmt == "f16" else rows), w64


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q4_1", "f32", "f16"])
def test_down_t_is_the_requantized_transpose(fmt, monkeypatch):
    """Block formats: each cold expert's down de-quantized, transposed, quantized again (gguf-py's bytes); floats:
    the transpose, bit for bit. Built a few columns at a time or all at once alike."""
    down, rows, w64 = _down(fmt)
    cold = np.flatnonzero(~GPU)
    got = moe_down_t.build_down_t(down, rows, cold, D, N)
    for c, e in enumerate(cold):
        block = w64[e * D:(e + 1) * D].T.astype(np.float32)  # (N, D)
        want = np.ascontiguousarray(gguf.quants.quantize(block, QTYPE[fmt])) if fmt in QTYPE else \
            np.ascontiguousarray(rows[e * D:(e + 1) * D].T)
        np.testing.assert_array_equal(got[c * N:(c + 1) * N], want)
    monkeypatch.setattr(moe_down_t, "COLS", 64)
    np.testing.assert_array_equal(moe_down_t.build_down_t(down, rows, cold, D, N), got)


def test_down_t_only_for_relu_family_kernel_rows():
    _, rows, _ = _down("q4_0")
    assert moe_down_t.wants_down_t("drelu", rows, D, N) and moe_down_t.wants_down_t("relu", rows, D, N)
    assert not moe_down_t.wants_down_t("swiglu", rows, D, N) and not moe_down_t.wants_down_t("drelu", None, D, N)
    assert not moe_down_t.wants_down_t("reglu", rows, 48, N)  # block rows of d weights need d a multiple of 32


# ---------------------------------------------------------------------------------------------------------------
# HybridMoE: decode through the graph steps' pieces and forward, prefill token by token


def _cfg(act: Activation) -> ModelConfig:
    return ModelConfig(family="moe", model_type="mixtral", n_layers=1, d_model=D, n_heads=4, n_kv_heads=4,
                       head_dim=64, n_ff=N, vocab=16, activation=act, act_fn="relu", norm="rms", norm_eps=1e-6,
                       max_positions=64, rope=None, n_experts=E, n_experts_used=K, norm_topk=True, n_ff_exp=N,
                       n_ff_shexp=0)


def _moe_weights(fmt: str, xs: np.ndarray, seed: int) -> dict:
    """Layer 0's tensors: the experts in `fmt` (block: QTensors of (E * out, in) rows; f32: (E, out, in)), their gate
    rows shifted for ~85% of neurons off on xs, the router float32."""
    rng = np.random.default_rng(seed)
    mats = {"gate_exps": _shifted(rng, xs, E * N), "up_exps": rng.standard_normal((E * N, D)).astype(np.float32) * 0.1,
            "down_exps": rng.standard_normal((E * D, N)).astype(np.float32) * 0.1}
    w = {"blk.0.ffn_gate_inp.weight": torch.from_numpy(rng.standard_normal((E, D)).astype(np.float32) * 0.1)}
    for k, m in mats.items():
        out = N if k != "down_exps" else D
        w[f"blk.0.ffn_{k}.weight"] = (QTensor(torch.from_numpy(_stored(m, fmt)[0]), fmt, m.shape) if fmt in QTYPE
                                      else torch.from_numpy(m).reshape(E, out, -1))
    return w


def _with_down_t(w: dict, ffn: HybridMoE, fmt: str) -> dict:
    """The weights the decode kernel reads: the cold experts' down de-quantized from down_t (transposed back)."""
    down = w["blk.0.ffn_down_exps.weight"]
    full = (down.dequantize() if isinstance(down, QTensor) else down.reshape(-1, N)).reshape(E, D, N).clone()
    for c, e in enumerate(ffn.cold_ids):
        rows = ffn.down_t[c * N:(c + 1) * N]
        full[e] = torch.from_numpy(gguf.quants.dequantize(rows, QTYPE[fmt]) if fmt in QTYPE else rows).T
    return {**w, "blk.0.ffn_down_exps.weight": full}


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=2e-5 * max(1.0, float(ref.abs().max())))


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "f32"])
@pytest.mark.parametrize("act", [Activation.DRELU, Activation.REGLU])
def test_hybrid_moe_decode_equals_reference(fmt, act):
    """Decode (to_host, device_part, cold_rows, cold_sum; and forward of one token) equals models/moe.moe_ffn on the
    weights down_t holds (f32: the file's own, down_t its transpose); so does prefill, token by token;
    cold_active counts the firing cold neurons, the four counts keep their meaning."""
    rng = np.random.default_rng(21)
    xs = _tokens(rng, 6)
    cfg = _cfg(act)
    w = _moe_weights(fmt, xs, seed=22)
    ffn = HybridMoE(0, cfg, w.get, GPU, "cpu", torch.float32)
    assert ffn.down_t is not None and ffn.down_t.shape[0] == (~GPU).sum() * N
    ref = moe.moe_ffn(_with_down_t(w, ffn, fmt).get, cfg, 0)
    x = torch.from_numpy(xs)
    ffn.host_io(torch.device("cpu"))
    g64, u64 = (w[f"blk.0.ffn_{p}_exps.weight"] for p in ("gate", "up"))
    g64, u64 = ((t.dequantize() if isinstance(t, QTensor) else t.reshape(-1, D)).double().numpy() for t in (g64, u64))
    fired = 0
    for t in range(6):
        _close(ffn(x[t:t + 1]), ref(x[t:t + 1]))  # forward, one token
        _close(_step_pieces(ffn, x[t:t + 1]), ref(x[t:t + 1]))
        for e in ffn.io.ids[~GPU[ffn.io.ids]]:  # the same token's cold experts, twice
            h = _act(str(act), g64[e * N:(e + 1) * N] @ xs[t], u64[e * N:(e + 1) * N] @ xs[t])
            fired += 2 * int((h != 0).sum())
    assert ffn.cold_active == fired
    c = ffn.read_counts()
    assert c[0] == 12 and c[1] == 12 * K * N and c[3] == N * ffn.expert_counts[~GPU].sum()
    assert 0.02 < ffn.cold_active / max(1, c[3]) < 0.3
    stats = expert_stats(types.SimpleNamespace(ffns=[ffn], plan_expert_share=None, expert_placement="given",
                                               expert_predictors=None))
    assert stats["cold_firing_share"] == ffn.cold_active / c[3]  # generate's stats["experts"]
    counted = ffn.cold_active
    _close(ffn(x), ref(x))  # prefill: each token's firing neurons, down_t's weights
    assert ffn.cold_active == counted  # decode's count only
    ffn.reset_counts()
    assert ffn.cold_active == 0


def _step_pieces(ffn: HybridMoE, x: torch.Tensor, flags=None) -> torch.Tensor:
    ffn.to_host(x)
    y = ffn.device_part(x)
    ffn.cold_rows(x, flags)
    return y + ffn.cold_sum().to(y.dtype)


def test_hybrid_moe_flags_and_memory():
    """cold_rows with flags waits for ready[i] and releases flag i; a non-ReLU layer keeps the dense path (no
    down_t); cold_bytes counts down_t on top of the cold experts' stored rows."""
    rng = np.random.default_rng(31)
    xs = _tokens(rng, 2)
    cfg = _cfg(Activation.DRELU)
    w = _moe_weights("q4_0", xs, seed=32)
    ffn = HybridMoE(0, cfg, w.get, np.zeros(E, bool), "cpu", torch.float32)  # all experts cold
    ref = moe.moe_ffn(_with_down_t(w, ffn, "q4_0").get, cfg, 0)
    ffn.host_io(torch.device("cpu"))
    flags = types.SimpleNamespace(ready=np.zeros(3, np.int32), host=np.zeros(3, np.int32))
    flags.ready[2] = 1
    ffn.to_host(torch.from_numpy(xs[:1]))
    ffn.cold_rows(None, flags, 2)
    assert flags.ready[2] == 0 and flags.host[2] == 1 and ffn.cold_active > 0
    _close(ffn.device_part(torch.from_numpy(xs[:1])) + ffn.cold_sum(), ref(torch.from_numpy(xs[:1])))
    stored = sum(w[f"blk.0.ffn_{p}_exps.weight"].data.numel() for p in ("gate", "up", "down"))
    assert ffn.cold_bytes() == stored + ffn.down_t.nbytes and ffn.down_t.nbytes * 3 == stored
    dense = HybridMoE(0, _cfg(Activation.SWIGLU), w.get, np.zeros(E, bool), "cpu", torch.float32)
    assert dense.down_t is None and dense.cold_bytes() == stored


def _mapped(w: dict, tmp_path) -> dict:
    """w's tensors over one file's mapping (weights/source.map_file), as a GGUF source hands them out."""
    blobs, at, out = [], 0, {}
    for name, t in w.items():
        data = t.data if isinstance(t, QTensor) else t
        blobs.append(data.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes() + b"\0" * 64)
    (tmp_path / "w.bin").write_bytes(b"".join(blobs))
    buf = map_file(tmp_path / "w.bin")  # (bytes,) uint8
    for (name, t), blob in zip(w.items(), blobs):
        data = t.data if isinstance(t, QTensor) else t
        view = torch.from_numpy(buf[at:at + data.numel() * data.element_size()]).view(data.dtype).reshape(data.shape)
        out[name] = QTensor(view, t.fmt, t.shape) if isinstance(t, QTensor) else view
        at += len(blob)
    return out


def test_hybrid_moe_drops_the_file_rows_it_no_longer_reads(tmp_path):
    """Loaded from a file's mapping on a CPU run, a down_t layer hands release_rows its cold experts' down rows
    (decode and prefill read down_t) and nothing else; dropped from the process, decode and prefill still equal the
    reference. unread_rows: a device run adds the device experts' rows, a re-quantized layer all cold experts' rows."""
    rng = np.random.default_rng(41)
    xs = _tokens(rng, 4)
    cfg = _cfg(Activation.DRELU)
    w = _moe_weights("q8_0", xs, seed=42)
    mapped = _mapped(w, tmp_path)
    seen = []

    def drop(v: QTensor) -> int:
        seen.append(v)
        return drop_range(v.data.data_ptr(), v.data.numel())

    ffn = HybridMoE(0, cfg, mapped.get, GPU, "cpu", torch.float32, release_rows=drop)
    cold, hot = np.flatnonzero(~GPU), np.flatnonzero(GPU)
    stacked = {k: mapped[f"blk.0.ffn_{k}_exps.weight"] for k in PROJ}
    down = stacked["down"].data  # (E * D, row) uint8
    assert [(v.data.data_ptr(), v.data.shape[0]) for v in seen] == [(down[e * D].data_ptr(), D) for e in cold]
    ref = moe.moe_ffn(_with_down_t(w, ffn, "q8_0").get, cfg, 0)
    x = torch.from_numpy(xs)
    ffn.host_io(torch.device("cpu"))
    _close(ffn(x[:1]), ref(x[:1]))
    _close(_step_pieces(ffn, x[1:2]), ref(x[1:2]))
    _close(ffn(x), ref(x))
    outs = {"gate": N, "up": N, "down": D}
    on_device = unread_rows(stacked, outs, hot, cold, True, True, False)
    assert [(v.data.data_ptr(), v.data.shape[0]) for v in on_device] == [
        (stacked[k].data[e * outs[k]].data_ptr(), outs[k]) for k in PROJ for e in hot]
    assert unread_rows(stacked, outs, hot, cold, False, True, False) == []
    assert len(unread_rows(stacked, outs, hot, cold, False, False, False)) == 3 * len(cold)
