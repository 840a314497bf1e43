"""The cold experts' kernels (kernels/cold_experts.py) against float64 numpy over the weights gguf-py's own
de-quantizer reads from the same bytes, the experts stacked as a GGUF stores them: gate / up (E * n, d) rows, down
(E * d, n) rows.

Tolerance: as tests/test_kernels_q.py's. The kernels sum float32 products of the exact de-quantized weights (Q4_0, Q8_0:
every d * q exact in float32), so they differ from float64 only by float32 rounding: the neuron values over d terms,
then the down dots over n terms of them: |out - ref| <= 1e-4 |ref| + 1e-5 * max|ref|.
"""

from math import erf

import gguf
import numpy as np
import pytest
from hotneurons.kernels import cold_experts as KE

QTYPE = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
         "q4_1": gguf.GGMLQuantizationType.Q4_1}
E, N, D = 5, 64, 96  # experts, neurons an expert (n), d: both multiples of 32 (rows of blocks either way)


def _stored(w: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) float32 -> (the rows as the kernels take them, the float64 weights they hold)."""
    if fmt in QTYPE:
        rows = np.ascontiguousarray(gguf.quants.quantize(w, QTYPE[fmt]))
        return rows, gguf.quants.dequantize(rows, QTYPE[fmt]).astype(np.float64)
    if fmt == "f16":
        h = w.astype(np.float16)
        return h.view(np.uint16), h.astype(np.float64)
    if fmt == "bf16":
        bits = (w.view(np.uint32) >> 16).astype(np.uint16)  # truncated: exact bf16 values
        return bits.view(np.int16), (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return w, w.astype(np.float64)


def _experts(fmt: str, down_fmt: str | None = None, seed: int = 0):
    """Stacked random experts: stored (gate, up, down) and their float64 weights (E, n, d), (E, n, d), (E, d, n)."""
    rng = np.random.default_rng(seed)
    g, u = (rng.standard_normal((E * N, D)).astype(np.float32) * 0.2 for _ in range(2))
    dn = rng.standard_normal((E * D, N)).astype(np.float32) * 0.2
    (gs, g64), (us, u64), (ds, d64) = _stored(g, fmt), _stored(u, fmt), _stored(dn, down_fmt or fmt)
    return (gs, us, ds), (g64.reshape(E, N, D), u64.reshape(E, N, D), d64.reshape(E, D, N))


def _act(act: str, g: np.ndarray | None, u: np.ndarray) -> np.ndarray:
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    gelu_tanh = lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))  # noqa: E731
    return {"relu": lambda: np.maximum(u, 0),
            "gelu": lambda: 0.5 * u * (1 + np.vectorize(erf, otypes=[np.float64])(u / np.sqrt(2))),
            "reglu": lambda: np.maximum(g, 0) * u, "drelu": lambda: np.maximum(g, 0) * np.maximum(u, 0),
            "swiglu": lambda: silu(g) * u, "geglu": lambda: gelu_tanh(g) * u}[act]()


def reference(act, X, tokens, experts, weights, w64) -> np.ndarray:
    """float64, pair by pair."""
    g64, u64, d64 = w64
    Y = np.zeros(X.shape, np.float64)
    for t, e, w in zip(tokens, experts, weights):
        x = X[t].astype(np.float64)
        Y[t] += float(w) * (d64[e] @ _act(act, g64[e] @ x, u64[e] @ x))
    return Y


def _close(out: np.ndarray, ref: np.ndarray) -> None:
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(ref).max(initial=0))))


def _pairs(T: int, k: int, seed: int):
    """Each of T tokens routed to k distinct experts with random weights: (tokens, experts, weights) (T k,) each."""
    rng = np.random.default_rng(seed)
    experts = np.stack([rng.permutation(E)[:k] for _ in range(T)]).ravel()
    return np.repeat(np.arange(T), k), experts, rng.random(T * k).astype(np.float32)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q4_1", "f32", "f16", "bf16"])
def test_one_token_equals_float64(fmt):
    rows, w64 = _experts(fmt)
    x = np.random.default_rng(1).standard_normal(D).astype(np.float32)
    for experts in ([2], [4, 0, 3], []):
        wts = np.linspace(0.2, 0.9, len(experts)).astype(np.float32)
        y = KE.expert_ffn(x, np.array(experts, np.int64), wts, *rows, "swiglu")
        _close(y, reference("swiglu", x[None], [0] * len(experts), experts, wts, w64)[0])


@pytest.mark.parametrize("act", ["relu", "gelu", "reglu", "drelu", "swiglu", "geglu"])
def test_activations(act):
    rows, w64 = _experts("q4_0", seed=2)
    X = np.random.default_rng(3).standard_normal((3, D)).astype(np.float32)
    tokens, experts, weights = _pairs(3, 2, seed=4)
    _close(KE.experts_ffn(X, tokens, experts, weights, *rows, act),
           reference(act, X, tokens, experts, weights, w64))


@pytest.mark.parametrize("fmt, down_fmt", [("q4_0", "q4_0"), ("q8_0", "q8_0"), ("q4_0", "q8_0"), ("f32", "q4_0"),
                                           ("q8_0", "f16")])
def test_batched_tokens_grouped_per_expert(fmt, down_fmt, monkeypatch):
    """Prefill: tokens of uneven routing (some experts many tokens, some none; a token with no pair gets zeros),
    in one call and in chunks of H."""
    rows, w64 = _experts(fmt, down_fmt, seed=5)
    T = 7
    X = np.random.default_rng(6).standard_normal((T, D)).astype(np.float32)
    tokens, experts, weights = _pairs(T, 3, seed=7)
    keep = tokens != 4  # token 4: all its experts elsewhere (the GPU's)
    tokens, experts, weights = tokens[keep], experts[keep], weights[keep]
    ref = reference("swiglu", X, tokens, experts, weights, w64)
    _close(KE.experts_ffn(X, tokens, experts, weights, *rows, "swiglu"), ref)
    assert not KE.experts_ffn(X, tokens, experts, weights, *rows, "swiglu")[4].any()
    monkeypatch.setattr(KE, "MAX_H_BYTES", 4 * N * 3 * 2)  # two tokens' pairs at a time
    out = np.full((T, D), np.nan, np.float32)
    _close(KE.experts_ffn(X, tokens, experts, weights, *rows, "swiglu", out=out), ref)


def test_rows_are_read_in_place():
    """The kernels read the stacked rows given (views of a file's bytes): no copy, and an expert is its rows."""
    (g, u, d), w64 = _experts("q4_0", seed=8)
    big = np.zeros((2, *u.shape), np.uint8)
    big[1] = u
    view = big[1]  # a view into a larger buffer, as the mmapped file's rows
    x = np.random.default_rng(9).standard_normal(D).astype(np.float32)
    y = KE.expert_ffn(x, np.array([3]), np.ones(1, np.float32), g, view, d, "swiglu")
    _close(y, reference("swiglu", x[None], [0], [3], [1.0], w64)[0])


def test_refusals():
    (g, u, d), _ = _experts("q4_0")
    x = np.zeros(D, np.float32)
    with pytest.raises(ValueError, match="expert ids .* outside the 5 experts"):
        KE.expert_ffn(x, np.array([5]), np.ones(1, np.float32), g, u, d, "swiglu")
    with pytest.raises(ValueError, match="not 96-weight rows"):
        KE.expert_ffn(x, np.array([0]), np.ones(1, np.float32), g, u[:, :-1].copy(), d, "swiglu")
    with pytest.raises(ValueError, match="differ in format"):
        KE.expert_ffn(x, np.array([0]), np.ones(1, np.float32), _stored(np.zeros((E * N, D), np.float32),
                                                                          "q8_0")[0], u, d, "swiglu")


@pytest.mark.parametrize("fmt, down_fmt", [("q4_0", "q4_0"), ("q8_0", "q4_1")])
def test_decode_layer_in_one_call(fmt, down_fmt):
    """experts_layer_q, a decode token's cold experts in one call (the graph steps' CPU part): the routed slots whose
    expert is cold, against float64; with flags it waits for ready[i] (reset), releases flag i after writing Y; without
    a signal it returns -1 and writes nothing."""
    from hotneurons.kernels.cold import ACT_CODE

    rows, w64 = _experts(fmt, down_fmt, seed=6)
    rng = np.random.default_rng(7)
    X = rng.standard_normal((1, D)).astype(np.float32)
    H = np.empty((3, N), np.float32)
    gpu = np.array([True, False, False, True, False, True, False, True][:E])
    cold_of = np.where(gpu, -1, np.arange(E))  # in place: a cold expert is its own row range
    ready, release = np.zeros(2, np.int32), np.zeros(2, np.int32)
    for ids in ([1, 3, 6], [0, 3, 5], [2, 4, 0]):
        ids = np.array(ids, np.int64) % E
        wts = rng.random(3).astype(np.float32)
        Y = np.full((1, D), np.nan, np.float32)
        ready[1], release[1] = 1, 0
        m = KE.experts_layer_q(ready, release, 1, X, ids, wts, cold_of, rows[0], rows[1], rows[2], H, Y,
                               ACT_CODE["swiglu"], KE.CODE[fmt], KE.CODE[down_fmt])
        cold = ~gpu[ids]
        assert m == cold.sum() and ready[1] == 0 and release[1] == 1
        _close(Y[0], reference("swiglu", X, [0] * int(m), ids[cold], wts[cold], w64)[0])
    Y[:] = 7.0
    assert KE.experts_layer_q(ready, release, 0, X, ids, wts, cold_of, rows[0], rows[1], rows[2], H, Y,
                              ACT_CODE["swiglu"], KE.CODE[fmt], KE.CODE[down_fmt]) == -1
    assert (Y == 7.0).all() and release[0] == 0


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_decode_layer_on_the_int_route(fmt):
    """experts_layer_q with xq: the gate and up dots with x quantized to Q8_0 (cold_q's int route). Against float64
    on the weights and on x as quantized (cold_q.quantize_x): equal to float32 sums, so the int route ran and
    added only x's rounding; the float route's answer differs from it by about that rounding."""
    from hotneurons.kernels.cold import ACT_CODE
    from hotneurons.kernels.cold_q import quantize_x
    from hotneurons.kernels.cold_q_ir import XQ_OK

    if not XQ_OK:
        pytest.skip("the int route needs AVX-512 VNNI on this CPU")
    rows, w64 = _experts(fmt, "q4_0", seed=8)
    rng = np.random.default_rng(9)
    X = rng.standard_normal((1, D)).astype(np.float32)
    q, dx = np.zeros(D, np.int8), np.zeros(D // 32, np.float32)
    quantize_x(X[0], q, dx)  # the route's Q8_0 of x (float32 scales; a file's Q8_0 rounds them to fp16)
    Xq = (np.repeat(dx, 32) * q)[None].astype(np.float32)  # (1, D) x as the route sees it
    cold_of = np.arange(E)
    ids, wts = np.array([1, 3], np.int64), np.array([0.7, 0.3], np.float32)
    out = {}
    for xq in (True, False):
        Y, H = np.full((1, D), np.nan, np.float32), np.empty((2, N), np.float32)
        KE.experts_layer_q(np.zeros(1, np.int32), np.zeros(1, np.int32), -1, X, ids, wts, cold_of, rows[0], rows[1],
                           rows[2], H, Y, ACT_CODE["swiglu"], KE.CODE[fmt], KE.CODE["q4_0"], xq)
        out[xq] = Y[0]
    _close(out[True], reference("swiglu", Xq, [0, 0], ids, wts, w64)[0])
    _close(out[False], reference("swiglu", X, [0, 0], ids, wts, w64)[0])
    assert not np.allclose(out[True], out[False], rtol=1e-6, atol=0)
