"""kernels/fused.py's Triton kernels against ops.py's torch ops (the reference) and float64, on fresh random inputs.

Without CUDA they run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), on CUDA as compiled kernels: the
same checks either way. Tolerances: outputs that torch rounds at the same points as the kernels (residual sums, RoPE,
cache writes) are equal; sums over a row (the norm, the softmax) may add in another order: one or two units of the
dtype's rounding. Triton's interpreter rounds float32 to bfloat16 by truncation (compiled kernels round to
nearest even, as torch does): there bfloat16 outputs are held to two units instead of equality."""

import math

import pytest
import torch
from hotneurons.kernels import ops

triton = pytest.importorskip("triton")
fused = pytest.importorskip("hotneurons.kernels.fused")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal, or (bfloat16 in the interpreter, which truncates) within two units of bfloat16's rounding of the
    largest value (a sum that cancels keeps its operands' rounding)."""
    if a.dtype == torch.bfloat16 and DEVICE == "cpu":
        torch.testing.assert_close(a, b, atol=2 ** -6 * float(b.abs().max()), rtol=2 ** -6)
    else:
        assert torch.equal(a, b)


def rand(g: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(DEVICE, dtype)


def rms64(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = h.double()
    return w.double() * h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [96, 257])  # a power of two's fraction, and one that leaves most of a block masked
@pytest.mark.parametrize("with_cold", [True, False])
def test_residual_norm_equals_torch(dtype, d, with_cold):
    g = torch.Generator().manual_seed(d + 7 * with_cold + DTYPES.index(dtype))
    h2, hot, w = rand(g, 1, 1, d, dtype=dtype), rand(g, 1, d, dtype=dtype, scale=0.3), rand(g, d, dtype=dtype)
    cold = rand(g, d, dtype=torch.float32, scale=0.1) if with_cold else None  # the CPU's sum is float32
    out_ref, out = (torch.full((1, 1, d), float("nan"), dtype=dtype, device=DEVICE) for _ in range(2))
    r_ref = ops.residual_norm(h2, hot, cold, w, 1e-5, out_ref)
    r = fused.residual_norm(h2, hot, cold, w, 1e-5, out)
    same(out, out_ref)  # the residual: the same two roundings
    torch.testing.assert_close(r, r_ref, **TOL[dtype])
    torch.testing.assert_close(r.double(), rms64(out, w, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_weighted_rms_by_rows_equals_torch(dtype):
    """Qwen3's per-head norms: (1, heads, 1, hd) rows under one weight of hd; into out or a new tensor."""
    g = torch.Generator().manual_seed(11 + DTYPES.index(dtype))
    h, w = rand(g, 1, 6, 1, 16, dtype=dtype, scale=3.0), rand(g, 16, dtype=dtype)
    ref = ops.weighted_rms(h, w, 1e-6)
    torch.testing.assert_close(fused.weighted_rms(h, w, 1e-6), ref, **TOL[dtype])
    out = torch.empty_like(h)
    assert fused.weighted_rms(h, w, 1e-6, out) is out
    torch.testing.assert_close(out.double(), rms64(h, w, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv,hd", [(4, 2, 8), (9, 3, 64), (8, 8, 16)])
def test_rope_cache_equals_torch(dtype, heads, kv, hd):
    g = torch.Generator().manual_seed(heads * 100 + hd + DTYPES.index(dtype))
    cap, pos = 20, torch.tensor([13], device=DEVICE)
    qkv = rand(g, 1, heads + 2 * kv, 1, hd, dtype=dtype)
    qk, v = qkv[:, :heads + kv], qkv[:, heads + kv:]
    cos, sin = rand(g, 1, heads + kv, 1, hd, dtype=dtype), rand(g, 1, heads + kv, 1, hd, dtype=dtype)
    caches = [rand(g, 1, kv, cap, hd, dtype=dtype) for _ in range(2)]
    kc_ref, vc_ref = (c.clone() for c in caches)
    q_ref = ops.rope_cache(qk, v, cos, sin, kc_ref, vc_ref, pos)
    q = fused.rope_cache(qk, v, cos, sin, *caches, pos)
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    torch.testing.assert_close(caches[0], kc_ref, **TOL[dtype])
    assert torch.equal(caches[1], vc_ref)  # v is copied, not rotated
    others = torch.arange(cap, device=DEVICE) != pos
    assert torch.equal(caches[0][:, :, others], kc_ref[:, :, others])  # only slot pos is written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv,G,hd,cap,pos", [(2, 2, 8, 20, 0), (2, 2, 8, 20, 19), (3, 3, 64, 300, 150),
                                             (1, 8, 16, 2000, 1700)])
def test_attend_reads_only_the_filled_slots(dtype, kv, G, hd, cap, pos):
    """The slots past pos hold NaN: the kernel must not read them. Against torch's op over the filled slots and a
    float64 softmax; the long cache spreads over several splits (fused.SPLITS)."""
    g = torch.Generator().manual_seed(cap + pos + hd + DTYPES.index(dtype))
    q = rand(g, 1, kv, G, hd, dtype=dtype, scale=1 / math.sqrt(hd))
    keys, values = rand(g, 1, kv, cap, hd, dtype=dtype), rand(g, 1, kv, cap, hd, dtype=dtype)
    keys[:, :, pos + 1:] = values[:, :, pos + 1:] = float("nan")
    o = fused.attend(q, keys, values, None, torch.tensor([pos], device=DEVICE))
    n = pos + 1
    ref = ops.attend(q, keys[:, :, :n], values[:, :, :n], None)
    torch.testing.assert_close(o, ref, **TOL[dtype])
    s = torch.matmul(q.double(), keys[:, :, :n].double().transpose(-1, -2))
    ref64 = torch.matmul(torch.softmax(s, -1), values[:, :, :n].double())
    torch.testing.assert_close(o.double(), ref64, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,hidden,rows,n_cold,where,thr", [
    (2500, 48, 3000, 2100, "both", 0.1234567),  # fc1 over three blocks of columns, the last one part full
    (2500, 48, 3000, 2100, "host", 0.0),  # rows of zeros give logits on the threshold: ties fire
    (96, 33, 700, 0, "none", 0.1234567),
    (257, 64, 1500, 1500, "device", 0.0),
    (300, 2100, 517, 203, "host", 0.1234567)])  # fc2 of over 2048 columns: 8 rows a program, not gemv_config's 2
def test_predict_equals_torch_and_float64(dtype, d, hidden, rows, n_cold, where, thr):
    """The predictor's GEMVs and decision (fc2's rows cold first): every row whose float64 logit is clear of the
    threshold by the rounding bound decides as float64 says; firings += the decisions; the masks are the first n_cold
    decisions, the device's as bools, the host's packed as bits (np.packbits' little bit order: bit b of byte i =
    row 8 i + b), the bits past n_cold zero and the buffer's bytes past them left alone. The bound: the dtype's
    rounding of h and of the logit (its unit, eps), each GEMV's float32 sum, and the interpreter's bfloat16
    truncation (two units)."""
    import numpy as np
    from hotneurons.kernels.cold import mask_bytes

    g = torch.Generator().manual_seed(d + hidden + n_cold + DTYPES.index(dtype))
    x, fc1 = rand(g, d, dtype=dtype), rand(g, hidden, d, dtype=dtype, scale=d ** -0.5)
    fc2 = rand(g, rows, hidden, dtype=dtype, scale=hidden ** -0.5)
    fc2[::9] = 0  # logit 0
    threshold = torch.tensor([thr], device=DEVICE)  # float32, as Predictor's buffer; 0.1234567 rounds in each dtype
    h64 = torch.relu(fc1.double() @ x.double())  # (hidden,)
    logit64 = fc2.double() @ h64  # (rows,)
    eps = 2 * torch.finfo(dtype).eps  # two units: the interpreter truncates bfloat16
    bound = eps * (fc2.double().abs() @ (h64 + eps * (fc1.double().abs() @ x.double().abs()))) + 1e-6
    thr64 = float(threshold.to(dtype))
    clear = ((logit64 - thr64).abs() > bound) | (fc2 == 0).all(1)  # (rows,)
    fired0 = torch.randint(0, 5, (rows,), generator=g, dtype=torch.int32).to(DEVICE)
    for op in (ops.predict, fused.predict):
        fired = fired0.clone()
        m_dev = torch.zeros(n_cold, dtype=torch.bool, device=DEVICE) if where in ("both", "device") else None
        nb = -(-n_cold // 8)  # bytes the host's bits take; the buffer's are whole uint64 words
        m_host = None
        if where in ("both", "host"):  # stale bits (the last token's) in the bytes written, padding after them
            m_host = torch.full((mask_bytes(n_cold),), 0xA5, dtype=torch.uint8, device=DEVICE)
        op(x, fc1, fc2, threshold, fired, m_dev, m_host, n_cold)
        fire = fired - fired0
        assert set(fire.unique().tolist()) <= {0, 1}
        assert torch.equal(fire.bool()[clear], (logit64 >= thr64)[clear]), op.__module__
        assert bool(fire.bool()[::9].all()) == (thr <= 0)  # the zero rows: ties fire
        assert m_dev is None or torch.equal(m_dev, fire[:n_cold].bool())
        if m_host is not None:
            bits = np.packbits(fire[:n_cold].bool().cpu().numpy(), bitorder="little")  # (nb,) uint8
            np.testing.assert_array_equal(m_host[:nb].cpu().numpy(), bits, err_msg=op.__module__)
            assert bool((m_host[nb:] == 0xA5).all()), op.__module__
    assert int(clear.sum()) > (0.9 if hidden < 2048 else 0.6) * rows  # the bound grows as sqrt(hidden) (bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols,bias", [(40, 2500, False), (300, 96, True), (33, 4100, True)])
@pytest.mark.parametrize("add", [False, True])
def test_linear_equals_torch_and_float64(dtype, rows, cols, bias, add):
    """One token's GEMV (the q/k/v projection, the LM head; add: o_proj adding into the residual), over one and
    several blocks of columns and rows, with and without a bias: within the dtype's rounding of torch's result and of
    the float64 one (the sums' order differs: one unit, two in the interpreter, which truncates bfloat16)."""
    g = torch.Generator().manual_seed(rows + cols + 2 * bias + add + 7 * DTYPES.index(dtype))
    x, w = rand(g, 1, 1, cols, dtype=dtype), rand(g, rows, cols, dtype=dtype, scale=cols ** -0.5)
    b = rand(g, rows, dtype=dtype) if bias else None
    h = rand(g, 1, 1, rows, dtype=dtype)
    y64 = w.double() @ x.double().flatten() + (0 if b is None else b.double())  # (rows,)
    if add:
        ref, out = h.clone(), h.clone()
        ops.add_linear(ref, x.view(1, cols), w, b)
        fused.add_linear(out, x.view(1, cols), w, b)
        y64 = y64 + h.double().flatten()
    else:
        ref, out = torch.nn.functional.linear(x, w, b), fused.linear(x, w, b)
    assert out.shape == ref.shape == (1, 1, rows) and out.dtype == dtype
    eps = 2 * torch.finfo(dtype).eps
    scale = (w.double().abs() @ x.double().abs().flatten() + h.double().abs().flatten() * add + (
        0 if b is None else b.double().abs()))  # (rows,) the bound's magnitude
    for got in (ref, out):
        assert bool(((got.double().flatten() - y64).abs() <= 2 * eps * scale + 1e-6).all())
    assert bool(((out.double() - ref.double()).abs().flatten() <= 2 * eps * scale + 1e-6).all())


def test_linear_takes_one_token():
    w = torch.zeros(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="a GEMV of one token: expected contiguous x of 16 and out of 8 elements, got "
                                         r"\(2, 16\)"):
        fused.linear(torch.zeros(2, 16, device=DEVICE), w, None)


def test_ops_by_name():
    assert ops.Ops.named("torch") == ops.Ops()
    assert ops.Ops.named("triton").attend is fused.attend
    assert ops.Ops.named("triton").predict is fused.predict
    assert ops.Ops.named("triton").add_linear is fused.add_linear
    with pytest.raises(ValueError, match="unknown ops 'cutlass': choose one of torch, compile, triton"):
        ops.Ops.named("cutlass")
    assert ops.default_ops(torch.device("cpu")) == "torch"


def test_rows_must_be_contiguous():
    keys = torch.zeros(1, 2, 10, 8)
    with pytest.raises(ValueError, match=r"contiguous tensor of rows of 8, got shape \(1, 2, 5, 8\)"):
        fused.attend(torch.zeros(1, 2, 2, 8), keys[:, :, :5], keys[:, :, :5], None, torch.tensor([3]))
