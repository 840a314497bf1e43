"""K-quant rows (Q4_K, Q5_K, Q6_K: llama.cpp's 256-weight blocks) read in place by the CPU's Numba kernels: the row
math (kernels/cold_k.py through cold_q_ir.rows_dot), the dense cold FFN (cold_q.cold_ffn_q / cold_layer_q, down_t in
q8_0, q4_0 or q4_1), the experts' kernels (cold_experts, cold_experts_sparse), the GEMV (cold_q.gemv_q), the
de-quantizer and the down columns taken out of K rows (weights/quants_cpu.py), and a tiny K-quant GGUF end to end.

Inputs: fresh random blocks (random bytes, their fp16 d / dmin fields small finite values), as a file could hold them.
References: float64 numpy over the weights gguf-py's gguf.quants.dequantize reads from the same bytes.

Tolerance (as tests/test_kernels_q.py's): every weight is gguf-py's float32 value exactly (d sc q, d sc (q - 32) and
dmin m are exact in float32, d sc q - dmin m is rounded once, as gguf-py rounds it), so the kernels differ from float64
only by their float32 sums: |out - ref| <= 1e-4 |ref| + 2e-6 max|ref|. The de-quantizers equal gguf-py's bit for bit.
"""

import zlib

import gguf
import numpy as np
import pytest
import torch
from cold_ref import check_ffn_rows, cold_ffn64, lay_out_ffns
from hotneurons.kernels import cold as K
from hotneurons.kernels import cold_experts as KE
from hotneurons.kernels import cold_experts_sparse as KS
from hotneurons.kernels import cold_q as KQ
from hotneurons.runtime import cold_rows as C
from hotneurons.weights import quants, quants_cpu
from hotneurons.weights.formats import WeightFormat as F
from hotneurons.weights.qtensor import QTensor

KFMTS = ("q4_k", "q5_k", "q6_k")
QTYPE = {f: gguf.GGMLQuantizationType[f.upper()] for f in KFMTS + ("q8_0", "q4_0", "q4_1")}
BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}
FP16_AT = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}  # each block's fp16 fields: d (and dmin)
UNIT = {"q4_k": 1 / 500, "q5_k": 1 / 1000, "q6_k": 1 / 2000}  # d for weights of about 1


def _close(out: np.ndarray, ref: np.ndarray) -> None:
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=2e-6 * max(1.0, float(np.abs(ref).max(initial=0))))


def k_rows(rng, fmt: str, n: int, d: int, scale: float = 1.0, bits: bool = False) -> np.ndarray:
    """(n, d / 256 * block bytes) uint8 rows of `fmt`: random bytes, the fp16 fields uniform in +-scale * UNIT (bits:
    any finite fp16 pattern instead, subnormals and zeros of both signs included)."""
    b = rng.integers(0, 256, (n, d // 256, BYTES[fmt]), dtype=np.uint8)
    for at in FP16_AT[fmt]:
        if bits:
            h = rng.integers(0, 1 << 16, b.shape[:2], dtype=np.uint16)
            h = np.where(h & 0x7C00 == 0x7C00, h ^ 0x0400, h).astype(np.uint16)  # no inf, no NaN
        else:
            h = (rng.uniform(-1, 1, b.shape[:2]) * scale * UNIT[fmt]).astype(np.float16).view(np.uint16)
        b[..., at:at + 2] = h[..., None].view(np.uint8)
    return b.reshape(n, -1)


def w64(rows: np.ndarray, fmt: str) -> np.ndarray:
    """Block rows -> the float64 weights gguf-py reads from them."""
    return gguf.quants.dequantize(rows, QTYPE[fmt]).astype(np.float64)


def q_rows(rng, fmt: str, n: int, d: int) -> np.ndarray:
    """(n, row bytes) rows of a 32-weight format, quantized by gguf-py from random weights of about 1."""
    return gguf.quants.quantize(rng.standard_normal((n, d)).astype(np.float32), QTYPE[fmt])


def _seed(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


# ---------------------------------------------------------------------------------------------------------------
# De-quantization, and the down projection's columns out of K rows


@pytest.mark.parametrize("fmt", KFMTS + ("q4_1",))
def test_dequantizer_equals_gguf_py_bit_for_bit(fmt, monkeypatch):
    """quants_cpu.dequantize_q and weights/quants.dequantize on the CPU (its Numba path, then its torch path) equal
    gguf-py's de-quantizer: any finite fp16 scales, odd row counts."""
    rng = _seed("deq", fmt)
    rows = k_rows(rng, fmt, 7, 512, bits=True) if fmt in KFMTS else q_rows(rng, fmt, 7, 512)
    ref = gguf.quants.dequantize(rows, QTYPE[fmt])  # (7, 512) float32
    bw, bb = quants_cpu.BLOCKS[fmt]
    out = np.full((7 * 512 // bw, bw), np.nan, np.float32)
    quants_cpu.dequantize_q(rows.reshape(-1, bb), fmt, out)
    np.testing.assert_array_equal(out.reshape(7, 512), ref)
    np.testing.assert_array_equal(quants.dequantize(torch.from_numpy(rows), fmt, 512).numpy(), ref)
    monkeypatch.setattr(quants, "CPU_KERNELS", False)
    np.testing.assert_array_equal(quants.dequantize(torch.from_numpy(rows), fmt, 512).numpy(), ref)


def test_q4_1_quantizer_equals_gguf_py():
    """quants_cpu's Q4_1 (the down_t format of Q4_K downs) writes gguf-py's bytes, over many magnitudes, constant
    blocks (d 0) and halves; blocks with inf / NaN go to torch's path."""
    rng = _seed("q41")
    x = (rng.standard_normal((64, 32)) * 10.0 ** rng.uniform(-30, 6, (64, 1))).astype(np.float32)
    x[3] = 0.5
    x[4, ::2], x[4, 1::2] = -1.0, 2.0
    out = np.empty((64, 20), np.uint8)
    assert quants_cpu.quantize_q(x, "q4_1", out)
    with np.errstate(over="ignore"):  # scales past fp16's largest: inf, on both sides
        np.testing.assert_array_equal(out, gguf.quants.quantize(x, QTYPE["q4_1"]))
    x[5, 7] = np.inf
    assert not quants_cpu.quantize_q(x, "q4_1", out)


@pytest.mark.parametrize("fmt", KFMTS)
@pytest.mark.parametrize("dst", ["f32", "q8_0", "q4_0", "q4_1"])
def test_columns_of_k_rows(fmt, dst, monkeypatch):
    """columns_as_rows / columns_reblocked over a K-quant (d, n) matrix: f32 columns equal gguf-py's de-quantized
    ones; block ones equal weights/quants.quantize of them (torch's kernels), byte for byte; down_t_rows through the
    Numba kernels equals its torch path."""
    from hotneurons.models.ffn_weights import FFNWeights, down_t_rows

    rng = _seed("cols", fmt, dst)
    d, n = 96, 512
    src = k_rows(rng, fmt, d, n)  # (d, n) down: rows of n weights
    idx = np.sort(rng.choice(n, 40, replace=False)).astype(np.int64)
    cols = gguf.quants.dequantize(src, QTYPE[fmt])[:, idx].T.copy()  # (40, d) float32
    got = quants_cpu.columns_as_rows(src, fmt, idx, dst)
    monkeypatch.setattr(quants, "CPU_KERNELS", False)
    want = cols if dst == "f32" else quants.quantize(torch.from_numpy(cols), dst).numpy()
    np.testing.assert_array_equal(got, want)
    if dst != "f32":
        re = quants_cpu.columns_reblocked(src, fmt, idx, 64, dst)  # columns padded to 64, blocked along them
        padded = np.zeros((d, 64), np.float32)
        padded[:, :40] = cols.T
        np.testing.assert_array_equal(re, quants.quantize(torch.from_numpy(padded), dst).numpy())
    w = FFNWeights(up=torch.zeros(n, d), down=QTensor(torch.from_numpy(src), fmt, (d, n)))
    slow = down_t_rows(w, torch.from_numpy(idx), F(dst))
    monkeypatch.setattr(quants, "CPU_KERNELS", True)
    fast = down_t_rows(w, torch.from_numpy(idx), F(dst))
    if dst == "f32":
        np.testing.assert_array_equal(fast.numpy(), slow.numpy())
    else:
        assert fast.fmt == slow.fmt == F(dst) and torch.equal(fast.data, slow.data)


# ---------------------------------------------------------------------------------------------------------------
# Row math: the GEMV, the dense cold FFN


@pytest.mark.parametrize("fmt", KFMTS)
@pytest.mark.parametrize("d,n", [(256, 1), (768, 13), (4096, 64)])
def test_gemv_q_matches_float64(fmt, d, n):
    """gemv_q over K rows (groups of eight rows, the last short) against float64; xq asks for the int route in vain."""
    rng = _seed("gemv", fmt, d, n)
    rows = k_rows(rng, fmt, n, d)
    x = rng.standard_normal(d).astype(np.float32)
    ref = w64(rows, fmt) @ x.astype(np.float64)
    _close(KQ.gemv_q(x, rows, np.full(n, np.nan, np.float32), fmt), ref)
    _close(KQ.gemv_q(x, rows, np.full(n, np.nan, np.float32), F(fmt), xq=True), ref)


def reference(act: str, x: np.ndarray, idx: np.ndarray, rows: C.ColdRows) -> np.ndarray:
    """float64: sum over j in idx of h_j(x) * down_t[j] (tests/cold_ref.py on gguf-py's weights)."""
    gate = w64(rows.gate, rows.fmt) if rows.gate is not None else None
    return cold_ffn64(act, x, idx, gate, w64(rows.up, rows.fmt), rows.b_up, w64(rows.down_t, rows.down_fmt))


def k_cold_rows(rng, act: str, fmt: str, dfmt: str, n: int, d: int) -> C.ColdRows:
    """ColdRows of K gate / up rows (taken as they are) and down_t rows in dfmt, quantized by gguf-py."""
    def q(rows: np.ndarray, f: str) -> QTensor:
        return QTensor(torch.from_numpy(rows), f, (n, d))

    gated = act in K.GATED
    b_up = None if gated else torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 0.1)
    up = q(k_rows(rng, fmt, n, d, 4 / np.sqrt(d)), fmt)
    gate = q(k_rows(rng, fmt, n, d, 4 / np.sqrt(d)), fmt) if gated else None
    return C.ColdRows.from_blocks(gate, up, b_up, q(q_rows(rng, dfmt, n, d), dfmt))


@pytest.mark.parametrize("fmt", KFMTS)
@pytest.mark.parametrize("dfmt", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("act", list(K.ACT_CODE))
def test_cold_ffn_matches_float64(fmt, dfmt, act):
    """ffn_rows (cold_ffn_q, the format named by ColdRows) over K gate / up rows and down_t in dfmt: no neuron, one,
    a random odd count, all; the sum in out, and left in part's rows; the device's mapped reads (torch's
    de-quantizers) of the same rows."""
    rng = _seed("ffn", fmt, dfmt, act)
    d, n = 512, 37
    rows = k_cold_rows(rng, act, fmt, dfmt, n, d)
    assert rows.dtype == fmt and rows.down_fmt == dfmt and rows.d == d and rows.code == KQ.FORMAT_CODE[fmt]
    x = rng.standard_normal(d).astype(np.float32)
    some = np.flatnonzero(rng.random(n) < 0.5)
    for idx in (np.zeros(0), np.array([n - 1]), some[:len(some) - 1 + len(some) % 2], np.arange(n)):  # odd count
        idx = idx.astype(np.int64)
        check_ffn_rows(act, x, idx, rows, reference(act, x, idx, rows), _close)
    wide = rows.float32()  # prefill's widening: the K de-quantizer for gate / up, dfmt's for down_t
    np.testing.assert_array_equal(wide["up"].numpy(), w64(rows.up, fmt).astype(np.float32))
    np.testing.assert_array_equal(wide["down_t"].numpy(), w64(rows.down_t, dfmt).astype(np.float32))


@pytest.mark.parametrize("fmt", KFMTS)
def test_cold_layer_q_with_the_format(fmt):
    """cold_layer_q (a packed mask, the first `skip` positions left out) over K rows, the format passed as fmt."""
    rng = _seed("layer", fmt)
    d, n = 768, 70
    rows = k_cold_rows(rng, "reglu", fmt, "q8_0", n, d)
    x = rng.standard_normal(d).astype(np.float32)
    m = rng.random(n) < 0.4
    want = np.flatnonzero(m)
    out, marks = np.full(d, np.nan, np.float32), np.zeros(2, np.int64)
    idx = np.full(n, -1, np.int64)
    k = KQ.cold_layer_q(K.NO_FLAGS, K.NO_FLAGS, -1, K.pack_mask(m).view(np.uint64), idx, 2, x, rows.gate, rows.up,
                        rows.b_up, rows.down_t, np.empty((2, d), np.float32), out, K.ACT_CODE["reglu"], marks,
                        fmt=rows.code)
    assert k == len(want) and list(marks) == [1, len(want)] and np.array_equal(idx[:k], want)
    _close(out, reference("reglu", x, want[2:], rows))


def test_formats_are_named_not_guessed():
    """Q4_K rows are exactly as wide as Q4_0's (0.5625 bytes a weight): the kernels take a K-quant's format as an
    argument, never from the width; wrong or missing names are refused with the fix."""
    rng = _seed("names")
    d, n = 512, 8
    q4k = k_rows(rng, "q4_k", n, d)
    assert q4k.shape[1] == d // 32 * 18 and KQ._format(d, q4k.shape[1]) == KQ.Q4_0  # the collision
    assert KQ._format(d, q4k.shape[1], KQ.Q4_K) == KQ.Q4_K and KQ._format(d, q4k.shape[1], KQ.Q5_K) == -1
    x = rng.standard_normal(d).astype(np.float32)
    ref = w64(q4k, "q4_k") @ x
    assert not np.allclose(KQ.gemv_q(x, q4k, np.empty(n, np.float32), "q4_0"), ref, rtol=1e-2)  # read as Q4_0
    _close(KQ.gemv_q(x, q4k, np.empty(n, np.float32), "q4_k"), ref)
    with pytest.raises(ValueError, match=r"not q5_k rows of x's 512 weights.*\(n, 512 / 256 \* 176\)"):
        KQ.gemv_q(x, q4k, np.empty(n, np.float32), "q5_k")
    with pytest.raises(ValueError, match="multiple of 256"):
        KQ.gemv_q(x[:96], k_rows(rng, "q6_k", n, 256)[:, :105], np.empty(n, np.float32), "q6_k")
    q6 = k_rows(rng, "q6_k", n, d)
    dt = QTensor(torch.from_numpy(q_rows(rng, "q8_0", n, d)), "q8_0", (n, d))
    rows = C.ColdRows.from_blocks(None, QTensor(torch.from_numpy(q6), "q6_k", (n, d)), None, dt)
    with pytest.raises(ValueError, match="nor the K-quant named"):  # the width alone: no 32-weight format has it
        KQ.cold_ffn_q(x, np.arange(n), rows.up, rows.up, rows.b_up, rows.down_t, np.empty((1, d), np.float32),
                      np.empty(d, np.float32), K.ACT_CODE["relu"])
    with pytest.raises(ValueError, match="K-quant rows are kept as a GGUF file stores them"):
        C.ColdRows.from_weights(None, torch.randn(4, 256), None, torch.randn(4, 256), "q4_k")
    with pytest.raises(ValueError, match="down_t of a K-quant's in one of q8_0, q4_0, q4_1"):
        C.ColdRows.from_blocks(None, QTensor(torch.from_numpy(q6), "q6_k", (n, d)), None,
                               QTensor(torch.from_numpy(q6), "q6_k", (n, d)))
    with pytest.raises(ValueError, match="rows .* are not 512-weight rows of Q4_0 / Q4_1 / Q8_0"):
        KE.row_format(q6, d)
    assert KE.row_format(q4k, d) == "q4_0" and KE.row_format(q4k, d, "q4_k") == "q4_k"


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_cold_call_rate_of_k_rows(fmt):
    """kernels/dram.cold_call_bw (pi-solve --measure's CPU rate) times K-quant rows as the runtime lays them out: gate
    and up in fmt, down_t in its nearest."""
    from hotneurons.kernels.dram import cold_call_bw, random_blocks

    b = random_blocks(np.random.default_rng(0), 4, 512, fmt)
    assert np.isfinite(w64(b, fmt)).all() and np.abs(w64(b, fmt)).max() > 0
    assert cold_call_bw(512, fmt, True, 32, table_bytes=2**22, calls=8) > 1e7


def test_cold_formats():
    """models/ffn_weights.cold_formats: K-quant gate and up as stored, down_t in the down's 32-weight format or its
    nearest (never a K-quant); other block formats all in the one asked for."""
    from hotneurons.models.ffn_weights import cold_formats

    assert cold_formats(F.Q4_K, F.Q4_K, F.Q4_K, F.Q6_K) == (F.Q4_K, F.Q8_0)  # a Q4_K_M layer
    assert cold_formats(F.Q4_K, F.Q4_K, F.Q4_K, F.Q4_K) == (F.Q4_K, F.Q4_1)
    assert cold_formats(F.Q5_K, F.Q5_K, None, F.Q5_K) == (F.Q5_K, F.Q8_0)
    assert cold_formats(F.Q4_K, F.Q4_K, F.Q4_K, F.Q4_0) == (F.Q4_K, F.Q4_0)
    assert cold_formats(F.Q6_K, F.Q6_K, F.Q6_K, F.F16) == (F.Q6_K, F.Q8_0)
    assert cold_formats(F.Q4_K, F.Q4_K, F.Q4_K, F.Q3_K) == (F.Q4_K, F.Q4_0)
    assert cold_formats(F.Q4_K, F.Q4_0, F.Q4_0, F.Q6_K) == (F.Q4_1, F.Q4_1)  # rows not stored in it: its nearest
    assert cold_formats(F.Q4_0, F.Q4_K, F.Q4_K, F.Q6_K) == (F.Q4_0, F.Q4_0)


# ---------------------------------------------------------------------------------------------------------------
# Mixtures of experts: experts_ffn, experts_layer_q, sparse_layer


def experts_ref(X, tokens, experts, wts, G, U, Dn, act: str) -> np.ndarray:
    """float64 (T, d): each pair's weighted expert FFN; G, U (E, n, d), Dn (E, d, n) float64."""
    Y = np.zeros(X.shape, np.float64)
    for t, e, w in zip(tokens, experts, wts):
        g, u = G[e] @ X[t].astype(np.float64), U[e] @ X[t].astype(np.float64)
        h = {"swiglu": g / (1 + np.exp(-g)) * u, "reglu": np.maximum(g, 0) * u, "relu": np.maximum(u, 0)}[act]
        Y[t] += w * (Dn[e] @ h)
    return Y


@pytest.mark.parametrize("fmt,dfmt", [("q4_k", "q6_k"), ("q5_k", "q5_k"), ("q6_k", "q4_1")])
def test_experts_match_float64(fmt, dfmt):
    """experts_ffn / expert_ffn / experts_layer_q over K gate / up rows and the file's down rows (K or not), the
    formats named (fmts, the codes)."""
    rng = _seed("experts", fmt, dfmt)
    E, n, d, T = 5, 256, 512, 6
    gate, up = (k_rows(rng, fmt, E * n, d, 4 / np.sqrt(d)) for _ in range(2))
    down = k_rows(rng, dfmt, E * d, n, 2 / np.sqrt(n)) if dfmt in KFMTS else q_rows(rng, dfmt, E * d, n)
    G, U = w64(gate, fmt).reshape(E, n, d), w64(up, fmt).reshape(E, n, d)
    Dn = w64(down, dfmt).reshape(E, d, n)
    X = rng.standard_normal((T, d)).astype(np.float32)
    tokens, experts = np.repeat(np.arange(T), 2), rng.integers(0, E, 2 * T)
    experts[1::2] = (experts[::2] + 1) % E  # two distinct experts a token
    wts = rng.random(2 * T).astype(np.float32)
    ref = experts_ref(X, tokens, experts, wts, G, U, Dn, "swiglu")
    _close(KE.experts_ffn(X, tokens, experts, wts, gate, up, down, "swiglu", fmts=(fmt, dfmt)), ref)
    _close(KE.expert_ffn(X[2], experts[4:6], wts[4:6], gate, up, down, "swiglu", fmts=(fmt, dfmt)), ref[2])
    H, Y = np.empty((2, n), np.float32), np.full((1, d), np.nan, np.float32)
    cold_of = np.arange(E, dtype=np.int64)
    m = KE.experts_layer_q(K.NO_FLAGS, K.NO_FLAGS, -1, X[2:3], experts[4:6].astype(np.int64), wts[4:6], cold_of,
                           gate, up, down, H, Y, K.ACT_CODE["swiglu"], KE.CODE[fmt], KE.CODE[dfmt], True)
    assert m == 2
    _close(Y[0], ref[2])
    if fmt == "q4_k":  # not named, the Q4_K rows would pass for Q4_0 (as wide); the Q6_K down is refused
        with pytest.raises(ValueError, match="are not 256-weight rows of Q4_0 / Q4_1 / Q8_0"):
            KE.experts_ffn(X, tokens, experts, wts, gate, up, down, "swiglu")


@pytest.mark.parametrize("fmt", KFMTS)
@pytest.mark.parametrize("act", KS.SPARSE_ACTS)
def test_sparse_layer_matches_float64(fmt, act):
    """sparse_layer (the firing neurons only) over K gate / up rows and down_t rows in q8_0, the ReLU family."""
    rng = _seed("sparse", fmt, act)
    E, n, d = 4, 96, 256
    gate, up = (k_rows(rng, fmt, E * n, d, 4 / np.sqrt(d)) for _ in range(2))
    dt = q_rows(rng, "q8_0", E * n, d)  # (E * n, d): expert c's neuron j at row c * n + j
    G, U, DT = (w64(gate, fmt).reshape(E, n, d), w64(up, fmt).reshape(E, n, d),
                w64(dt, "q8_0").reshape(E, n, d))
    x = rng.standard_normal(d).astype(np.float32)
    ids, wts = np.array([3, 1], np.int64), np.array([0.7, 0.4], np.float32)
    cold_of = dt_of = np.arange(E, dtype=np.int64)
    ref = experts_ref(x[None], [0, 0], ids, wts, G, U, DT.transpose(0, 2, 1), act if act != "drelu" else "reglu")
    if act == "drelu":  # both gate and up through ReLU
        ref = sum(w * (np.maximum(G[e] @ x, 0) * np.maximum(U[e] @ x, 0)) @ DT[e] for e, w in zip(ids, wts))[None]
    idx, hs, cnt = KS.scratch(2, n)
    out = np.full(d, np.nan, np.float32)
    k = KS.sparse_layer(K.NO_FLAGS, K.NO_FLAGS, -1, x, ids, wts, cold_of, dt_of, gate if act != "relu" else up, up,
                        dt, idx, hs, cnt, np.empty((2, d), np.float32), out, K.ACT_CODE[act], KE.CODE[fmt],
                        KE.CODE["q8_0"])
    assert 0 < k < 2 * n
    _close(out, ref[0])


@pytest.mark.parametrize("act", ["swiglu", "reglu"])
def test_moe_layer_reads_k_experts_in_place(act):
    """runtime/moe_ffn.HybridMoE over Q4_K gate / up and Q6_K down experts (a Q4_K_M MoE's): kept in place (views of
    the stored rows, their formats named), half the experts cold; prefill, decode and the graph steps' pieces equal
    the reference MoE (models/moe.py on the de-quantized weights). ReGLU's cold experts decode through down_t (the
    firing neurons only), re-blocked in q8_0 (Q6_K's nearest): within q8_0's rounding of the down weights there."""
    from hotneurons.common.kinds import Activation
    from hotneurons.models import ModelConfig, moe
    from hotneurons.runtime.moe_ffn import HybridMoE

    E, k, d, n = 6, 2, 256, 256
    cfg = ModelConfig(family="moe", model_type="mixtral", n_layers=1, d_model=d, n_heads=4, n_kv_heads=4,
                      head_dim=64, n_ff=n, vocab=16, activation=Activation(act),
                      act_fn="silu" if act == "swiglu" else "relu", norm="rms", norm_eps=1e-6, max_positions=64,
                      rope=None, n_experts=E, n_experts_used=k, norm_topk=True, n_ff_exp=n, n_ff_shexp=0)
    rng = _seed("moe", act)
    w = {"blk.0.ffn_gate_inp.weight": torch.from_numpy(rng.standard_normal((E, d)).astype(np.float32))}
    for proj, fmt, shape in (("gate", "q4_k", (n, d)), ("up", "q4_k", (n, d)), ("down", "q6_k", (d, n))):
        rows = k_rows(rng, fmt, E * shape[0], shape[1], 4 / np.sqrt(shape[1]))
        w[f"blk.0.ffn_{proj}_exps.weight"] = QTensor(torch.from_numpy(rows), fmt, (E * shape[0], shape[1]))
    ref = moe.moe_ffn(w.get, cfg, 0)
    gpu = np.array([True, False, True, False, False, True])
    ffn = HybridMoE(0, cfg, w.get, gpu, "cpu", torch.float32)
    assert ffn.in_place and ffn.cold_fmts == ("q4_k", "q4_k", "q6_k")
    assert np.shares_memory(ffn.cold[1], w["blk.0.ffn_up_exps.weight"].data.numpy())
    assert (ffn.down_t is not None) == (act == "reglu")
    x = torch.from_numpy(rng.standard_normal((5, d)).astype(np.float32))

    def close(got, want):
        tol = 2e-5 if act == "swiglu" else 1e-2  # down_t: q8_0's rounding of the down weights
        torch.testing.assert_close(got, want, rtol=1e-4, atol=tol * float(want.abs().max()))

    close(ffn(x), ref(x))  # prefill
    for t in range(2):  # decode
        close(ffn(x[t:t + 1]), ref(x[t:t + 1]))
    ffn.host_io(torch.device("cpu"))
    for t in range(2, 5):  # the graph steps' pieces: experts_layer_q (swiglu), sparse_layer (reglu)
        ffn.to_host(x[t:t + 1])
        y = ffn.device_part(x[t:t + 1])
        ffn.cold_rows(x[t:t + 1])
        close(y + ffn.cold_sum(), ref(x[t:t + 1]))


# ---------------------------------------------------------------------------------------------------------------
# A tiny K-quant GGUF end to end

# Q4_K_M's pattern: Q4_K matrices, Q6_K where it spends more bits (attn_v, output, half the layers' ffn_down)
MIX = {"attn_v": "q6_k", "output": "q6_k", "blk.0.ffn_down": "q6_k"}


def write_k_model(path):
    """A SwiGLU LLaMA (d 256, 512 neurons: every row whole 256-blocks, 2 layers, vocab 1024, byte tokenizer) of
    random K-quant blocks in MIX's types (Q4_K elsewhere; weights of std ~0.05, the embedding's ~1), norms F32."""
    from hotneurons.export.gguf_model import llama_metadata, vocab_from_tokenizer

    from bench import memory_models as mm

    s = mm.Shape(d_model=256, n_neurons=512, n_heads=4, n_kv_heads=2, n_layers=2, vocab=1024)
    tok = mm.tokenizer(s.vocab)
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    llama_metadata(w, mm.config(s, tok, "silu"), path.stem, activation="swiglu")
    vocab_from_tokenizer(tok, s.vocab).add_to(w)
    for t in mm.tensor_plan(s):
        if t.norm:
            w.add_tensor(t.gguf, (1 + 0.1 * rng.standard_normal(t.shape)).astype(np.float32))
            continue
        fmt = next((f for k, f in MIX.items() if t.gguf.startswith(k + ".") or f".{k}." in t.gguf), "q4_k")
        rows = k_rows(rng, fmt, t.shape[0], t.shape[1], 20.0 if t.gguf == "token_embd.weight" else 0.5)
        w.add_tensor(t.gguf, rows, raw_dtype=QTYPE[fmt])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("mask", ["dense", "predictor"])
def test_k_quant_gguf_runs_hybrid_on_the_cpu(mask, tmp_path):
    """The file read with no format flag, half of each layer's neurons hot: the cold gate and up rows kept Q4_K, the
    file's bytes (down_t in q8_0 from Q6_K, q4_1 from Q4_K); attention read as stored by the K GEMV. Prefill and two
    decode steps (the cold kernel: ffn_rows under the dense mask, cold_layer_q under predictors that mark every
    neuron) give the logits of transformers' model on gguf-py's de-quantized file with each FFN's weights replaced by
    the layout's (the down_t rows, re-blocked, differ from the file's by their rounding)."""
    import copy

    from hotneurons.artifacts.placement import Placement
    from hotneurons.models.family import load_model
    from hotneurons.models.open import model_info, open_model
    from hotneurons.runtime.config import RuntimeConfig
    from hotneurons.runtime.generate import generate
    from hotneurons.runtime.load import load_source_runtime
    from hotneurons.weights.source import open_source
    from tiny import write_predictors

    path = write_k_model(tmp_path / "tiny-q4_k_m.gguf")
    lm = load_model(str(path), device="cpu", dtype="float32", cache=False)
    L, n = lm.info["n_layers"], lm.info["n_neurons"]
    placement = Placement(tuple(np.random.default_rng(i).random(n) < 0.5 for i in range(L)))
    run = None
    if mask == "predictor":
        run = tmp_path / "run"
        run.mkdir()
        source, sid, _, act = open_model(str(path))
        write_predictors(run, model_info(source, sid, act, lm.adapter.name, lm.adapter.gated), -1e30)
    cfg = RuntimeConfig(mode="dense", device="cpu") if mask == "dense" else RuntimeConfig(device="cpu")
    rt = load_source_runtime(run, None, cfg, model=str(path), placement=placement)
    assert rt.cfg.cold_dtype == "q4_k" and rt.cfg.gpu_dtype == "q4_k"
    assert [(f.cold.fmt, f.cold.down_fmt) for f in rt.ffns] == [("q4_k", "q8_0"), ("q4_k", "q4_1")]
    with open_source(path) as src:
        for i, f in enumerate(rt.ffns):
            cold = np.flatnonzero(~placement.gpu[i])
            for name in ("gate", "up"):  # the file's rows, byte for byte
                np.testing.assert_array_equal(getattr(f.cold, name), src.get(f"blk.{i}.ffn_{name}.weight").data[cold])
    ids = list(lm.tokenizer("The quick brown fox")["input_ids"])
    g = generate(rt, ids, 3, stop_at_eos=False, keep_logits=True)
    ref = copy.deepcopy(lm)
    lay_out_ffns(ref.layers, ref.adapter, rt.ffns, placement)
    with torch.no_grad():
        for k, logits in enumerate(g.logits):  # the prompt's, then two decode steps'
            want = ref.model(torch.tensor([ids + g.token_ids[:k]])).logits[0, -1].float()
            assert torch.isfinite(want).all()
            torch.testing.assert_close(logits.float(), want, rtol=0, atol=2e-4 * float(want.abs().max()))
        file_logits = lm.model(torch.tensor([ids])).logits[0, -1].float()  # the file's own down weights
    corr = float(torch.corrcoef(torch.stack([g.logits[0].float(), file_logits]))[0, 1])
    assert corr > 0.99, corr
