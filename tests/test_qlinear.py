"""kernels/qlinear.py (the dispatcher, pack, the torch paths), kernels/qgemv.py (the Triton GEMV) and dequant_q
(kernels/dequant_gpu.py)
against float64: y = x @ dequantized(w).T + b, the weight de-quantized from its file bytes by this file's own numpy
code (checked against gguf.quants where gguf is installed).

Tolerances, elementwise: |y - ref| <= u_out |ref| + (1e-5 + u_w) (|x| @ |w|.T + |b|) + 1e-6, where u_out is the
output dtype's rounding (float32 2^-23, fp16 2^-10; bfloat16 2^-7, 2^-6 in Triton's interpreter, which truncates),
1e-5 bounds float32 sums over k (their error is ~ 2^-24 sqrt(k) of that bound) and u_w is the rounding of weights
de-quantized to x's dtype on the prefill path (0 where they stay float32: the GEMV and the CPU path). Q4_1 (w = d q +
m) takes |d q| + |m| for |w| in that bound (ref_magnitude): the GEMV sums d (sum q x) + m (sum x), whose float32
rounding scales with those terms, not with their (smaller) sum; float64 is the reference either way.

Without CUDA the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1) on tiny shapes; the tests
marked gpu run them compiled on big ones (70B's shapes, n not a power of two), in CUDA graphs too."""

import numpy as np
import pytest
import torch
from hotneurons.kernels import dequant_gpu, qgemv, qlinear
from hotneurons.kernels.qlinear import GpuQ, add_linear, linear, pack
from hotneurons.weights.formats import row_bytes
from hotneurons.weights.qtensor import QTensor

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
GGML = {"q4_0": 2, "q4_1": 3, "q8_0": 8, "f16": 1, "f32": 0, "bf16": 30}
QFMTS = ["q4_0", "q4_1", "q8_0"]  # the block formats with kernels
HEAD = {"q4_0": 2, "q4_1": 4, "q8_0": 2}  # bytes before a block's quants: fp16 scale (and Q4_1's fp16 min)
U_OUT = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7 if CUDA else 2.0 ** -6}
U_W = {torch.float32: 0.0, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


# ---------------------------------------------------------------------------------------------------------------
# references


def _ref_fields(data: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block QTensor's bytes (rows, row_bytes) -> float64 d (rows, nb, 1), q (rows, nb, 32) (Q4_0: q - 8) and m
    (rows, nb, 1) (zeros but for Q4_1), by llama.cpp's definitions."""
    rows, head = data.shape[0], HEAD[fmt]
    blocks = data.view(rows, -1, head + (32 if fmt == "q8_0" else 16))  # (rows, nb, block bytes)
    d = blocks[:, :, :2].contiguous().view(torch.float16).double()  # (rows, nb, 1)
    m = blocks[:, :, 2:4].contiguous().view(torch.float16).double() if fmt == "q4_1" else torch.zeros_like(d)
    qs = blocks[:, :, head:]
    if fmt == "q8_0":
        q = qs.contiguous().view(torch.int8).double()
    else:
        q = torch.cat([qs & 15, qs >> 4], dim=2).double() - (8 if fmt == "q4_0" else 0)  # weights j, then 16 + j
    return d, q, m


def ref_dequant(data: torch.Tensor, fmt: str) -> torch.Tensor:
    """(rows, cols) float64 from a QTensor's bytes (rows, row_bytes), any device, by llama.cpp's definitions (exact:
    Q4_1's d q + m too, which float32 rounds once)."""
    if fmt in ("f16", "f32", "bf16"):
        return data.view({"f16": torch.float16, "f32": torch.float32, "bf16": torch.bfloat16}[fmt]).double()
    d, q, m = _ref_fields(data, fmt)
    return (d * q + m).reshape(data.shape[0], -1)


def ref_magnitude(data: torch.Tensor, fmt: str) -> torch.Tensor | None:
    """(rows, cols) float64 |d q| + |m| of a Q4_1 QTensor's bytes (the tolerance's |w|, module docstring); None for
    other formats (|w| itself)."""
    if fmt != "q4_1":
        return None
    d, q, m = _ref_fields(data, fmt)
    return ((d * q).abs() + m.abs()).reshape(data.shape[0], -1)


def quantize(w: np.ndarray, fmt: str) -> QTensor:
    """A QTensor of w (rows, cols) float32 by gguf.quants (the file writer's code)."""
    gguf = pytest.importorskip("gguf")
    data = np.ascontiguousarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType(GGML[fmt])))
    return QTensor(torch.from_numpy(data.view(np.uint8).reshape(w.shape[0], -1)), fmt, w.shape)


def random_q(n: int, k: int, fmt: str, device: str, seed: int = 0) -> QTensor:
    """Random valid blocks made on the device (no quantizer: big shapes, and gguf is not on the GPU machine):
    fp16 scales ~ N(0, 0.02), Q4_1's fp16 mins ~ -7.5 |scale| + N(0, 0.1) (as llama.cpp's: near the block's
    smallest weight, with room for either sign), uniform quants."""
    g = torch.Generator(device=device).manual_seed(seed)
    nb, bb, head = k // 32, 32 if fmt == "q8_0" else 16, HEAD[fmt]
    blocks = torch.empty((n, nb, head + bb), dtype=torch.uint8, device=device)
    scales = (0.02 * torch.randn((n, nb, 1), generator=g, device=device)).half()
    blocks[:, :, :2] = scales.view(torch.uint8)
    if fmt == "q4_1":
        mins = -7.5 * scales.float().abs() + 0.1 * torch.randn((n, nb, 1), generator=g, device=device)
        blocks[:, :, 2:4] = mins.half().view(torch.uint8)
    blocks[:, :, head:] = torch.randint(0, 256, (n, nb, bb), generator=g, device=device, dtype=torch.uint8)
    return QTensor(blocks.view(n, nb * (head + bb)), fmt, (n, k))


def check(y: torch.Tensor, x: torch.Tensor, w64: torch.Tensor, b: torch.Tensor | None, u_out: float,
          u_w: float = 0.0, h0: torch.Tensor | None = None, mag: torch.Tensor | None = None) -> None:
    """y (.., n) against x (.., k) @ w64.T + b (+ h0, the tensor added into), float64, within the bound above (mag:
    ref_magnitude's |w| for Q4_1, else |w64|)."""
    x64 = x.double().reshape(-1, x.shape[-1]).to(w64.device)
    ref, bound = x64 @ w64.T, x64.abs() @ (w64.abs() if mag is None else mag.to(w64.device)).T  # (m, n)
    if b is not None:
        ref, bound = ref + b.double().to(w64.device), bound + b.double().abs().to(w64.device)
    scale = ref.abs()
    if h0 is not None:  # added into h: h's value and the linear's own rounding count too
        h64 = h0.double().reshape(ref.shape).to(w64.device)
        scale = scale + (ref + h64).abs()
        ref = ref + h64
    err = (y.double().reshape(ref.shape).to(w64.device) - ref).abs()
    tol = u_out * scale + (1e-5 + u_w) * bound + 1e-6
    worst = int(torch.argmax(err - tol))
    assert bool((err <= tol).all()), (f"{int((err > tol).sum())} of {err.numel()} outside: worst err "
                                      f"{float(err.flatten()[worst]):.3g} > tol {float(tol.flatten()[worst]):.3g}")


def need_kernels():
    """The kernels on CPU tensors need Triton's interpreter (conftest sets it before triton is imported)."""
    import os

    if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA and not in Triton's interpreter")


# ---------------------------------------------------------------------------------------------------------------
# the bytes


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "f16", "f32"])
def test_reference_matches_gguf(fmt):
    """This file's float64 reference is gguf-py's de-quantization (Q4_1: gguf-py's float32 d q + m is the exact value
    rounded once), and so are pack's and the QTensor path's float32 weights."""
    gguf = pytest.importorskip("gguf")
    w = np.random.default_rng(1).standard_normal((24, 96)).astype(np.float32)
    q = quantize(w, fmt)
    want = gguf.quants.dequantize(q.data.numpy(), gguf.GGMLQuantizationType(GGML[fmt])).astype(np.float64)
    ref = ref_dequant(q.data, fmt)
    np.testing.assert_array_equal(ref.float().double().numpy(), want)
    if fmt != "q4_1":
        np.testing.assert_array_equal(ref.numpy(), want)  # exact in float32
    if fmt in QFMTS:
        np.testing.assert_array_equal(pack(q, "cpu").dequantize().double().numpy(), want)
        np.testing.assert_array_equal(qlinear._qtensor_rows(q, 3, 10).double().numpy(), want[3:10])


@pytest.mark.parametrize("fmt", QFMTS)
def test_pack_keeps_the_bytes(fmt):
    n, k = 37, 160
    q = random_q(n, k, fmt, "cpu", seed=3)
    g = pack(q, "cpu")
    assert isinstance(g, GpuQ) and g.shape == (n, k)
    assert g.nbytes == row_bytes(fmt, k) * n == q.nbytes
    assert g.qs.is_contiguous() and g.scales.stride() == (1, n) and g.scales.dtype == torch.float16
    assert torch.equal(g.to_qtensor().data, q.data)
    small = pack(q, "cpu", chunk_bytes=3 * row_bytes(fmt, k) + 5)  # 13 chunks, the last short
    assert torch.equal(small.qs, g.qs) and torch.equal(small.scales, g.scales)
    part = g.rows(slice(5, 12))
    assert part.nbytes == 7 * row_bytes(fmt, k) and part.qs.data_ptr() == g.qs[5].data_ptr()  # a view
    assert torch.equal(part.dequantize(torch.float64), ref_dequant(q.data[5:12], fmt).float().double())
    assert (g.mins is not None) == (fmt == "q4_1") and (part.mins is None or part.mins.stride() == (1, n))


@pytest.mark.parametrize("fmt", QFMTS)
def test_kernel_order_is_the_documented_one(fmt):
    """One block whose quant j is j mod 16 (Q4_0, Q4_1) or j - 16 (Q8_0): the words pack's layout holds, read as
    kernels/qgemv.py documents them (Q4_0, Q4_1: word i, nibble u = weight 4 u + i; Q8_0: word i, byte t = weight
    16 (i // 4) + 4 t + i % 4); Q4_1's min goes to mins."""
    j = np.arange(32)
    if fmt != "q8_0":
        quants = (j[:16] % 16) | ((j[16:] % 16) << 4)  # file: byte j = weight j (low nibble), 16 + j (high)
    else:
        quants = (j - 16).astype(np.int8).view(np.uint8)
    head = np.array([1.0, -2.5] if fmt == "q4_1" else [1.0], np.float16).view(np.uint8)  # d (and m)
    block = np.concatenate([head, quants.astype(np.uint8)])
    g = pack(QTensor(torch.from_numpy(block[None, :].copy()), fmt, (1, 32)), "cpu")
    assert g.mins is None if fmt != "q4_1" else float(g.mins[0, 0]) == -2.5
    words = g.qs.view(torch.int32)[0].numpy().view(np.uint32)  # (4 | 8,)
    for i, word in enumerate(words):
        if fmt != "q8_0":
            assert [(word >> (4 * u)) & 15 for u in range(8)] == [(4 * u + i) % 16 for u in range(8)]
        else:
            got = [int(np.uint8((word >> (8 * t)) & 255).view(np.int8)) for t in range(4)]
            assert got == [16 * (i // 4) + 4 * t + i % 4 - 16 for t in range(4)]
    picked = g.rows(torch.tensor([0, 0]))  # an index tensor: a copy, scales made block-major again
    assert picked.scales.stride(0) == 1 and torch.equal(picked.dequantize()[1], g.dequantize()[0])


def test_pack_float_and_refusals():
    w = torch.randn(8, 64)
    q = QTensor(w.half().view(torch.uint8), "f16", (8, 64))
    assert torch.equal(pack(q, "cpu"), w.half())
    q2k = QTensor(torch.zeros((2, 84), dtype=torch.uint8), "q2_k", (2, 256))  # K-quants: tests/test_qgemv_k.py
    with pytest.raises(ValueError, match="no GPU kernel") as e:
        pack(q2k, "cpu")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="q4_0, q4_1, q8_0, q4_k, q5_k or q6_k"):
        GpuQ(torch.zeros((2, 256), dtype=torch.uint8), torch.zeros((2, 8), dtype=torch.float16), "f16", (2, 256))
    with pytest.raises(ValueError, match="expected"):
        GpuQ(torch.zeros((2, 100), dtype=torch.uint8), torch.zeros((2, 8), dtype=torch.float16), "q4_0", (2, 256))
    qs, sc = torch.zeros((2, 128), dtype=torch.uint8), torch.zeros((2, 8), dtype=torch.float16)
    with pytest.raises(ValueError, match="and mins \\(2, 8\\) float16"):  # Q4_1 without its mins
        GpuQ(qs, sc, "q4_1", (2, 256))
    with pytest.raises(ValueError, match="and no mins"):  # Q4_0 with some
        GpuQ(qs, sc, "q4_0", (2, 256), sc.clone())


# ---------------------------------------------------------------------------------------------------------------
# the CPU paths: torch, float32


@pytest.mark.parametrize("form", ["q4_0", "q4_1", "q8_0", "f16", "f32", "tensor", "packed_q4_0", "packed_q4_1",
                                  "packed_q8_0"])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_linear_cpu(form, m, monkeypatch):
    """m 1, 3: a block QTensor through the Numba GEMV (cold_q.gemv_q); 17: chunks de-quantized by torch."""
    rng = np.random.default_rng(m + 10 * len(form))
    n, k = 45, 96
    w = rng.standard_normal((n, k)).astype(np.float32)
    fmt = form.removeprefix("packed_")
    if form == "tensor":
        weight, w64 = torch.from_numpy(w), torch.from_numpy(w).double()
    else:
        q = quantize(w, fmt)
        weight, w64 = pack(q, "cpu") if form.startswith("packed") else q, ref_dequant(q.data, fmt)
    monkeypatch.setattr(qlinear, "CHUNK_ELEMS", 4 * k)  # chunks of 4 rows: 12 of them, the last short
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    b = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    y = linear(x, weight)
    assert y.shape == (m, n) and y.dtype == torch.float32
    check(y, x, w64, None, U_OUT[torch.float32])
    check(linear(x.view(1, m, k), weight, b), x, w64, b, U_OUT[torch.float32])  # leading dims, a bias
    out = torch.full((m, n), float("nan"))
    assert linear(x, weight, b, out=out) is out
    check(out, x, w64, b, U_OUT[torch.float32])
    h = torch.from_numpy(rng.standard_normal((m, n)).astype(np.float32))
    h0 = h.clone()
    add_linear(h, x, weight, b)
    check(h, x, w64, b, U_OUT[torch.float32], h0=h0)


def test_linear_cpu_bfloat16_activations():
    """x in bfloat16 on the CPU: sums in float32, the output rounded once to bfloat16."""
    w = np.random.default_rng(5).standard_normal((40, 64)).astype(np.float32)
    q = quantize(w, "q4_0")
    x = torch.randn(3, 64).bfloat16()
    y = linear(x, q)
    assert y.dtype == torch.bfloat16
    check(y, x, ref_dequant(q.data, "q4_0"), None, 2.0 ** -8)


def test_linear_shape_errors():
    q = random_q(8, 64, "q8_0", "cpu")
    with pytest.raises(ValueError, match="do not fit"):
        linear(torch.randn(2, 32), q)
    with pytest.raises(ValueError, match="do not fit"):
        linear(torch.randn(2, 64), q, out=torch.empty(2, 9))


# ---------------------------------------------------------------------------------------------------------------
# the kernels: interpreted on the CPU, compiled on CUDA; tiny shapes


KERNEL_CASES = [  # fmt, m, (n, k), dtype, bias, add, config (None: gemv_config's)
    ("q4_0", 1, (64, 128), torch.float16, False, False, None),
    ("q8_0", 1, (64, 128), torch.bfloat16, True, False, (8, 2, 4)),
    ("q4_0", 3, (50, 96), torch.float32, True, True, (8, 2, 4)),  # masked rows and blocks
    ("q8_0", 3, (50, 96), torch.float16, False, True, (4, 4, 4)),
    ("q4_0", 2, (64, 128), torch.bfloat16, True, False, (4, 2, 4)),
    ("q8_0", 8, (24, 64), torch.float32, False, False, (8, 2, 4)),
    ("q4_1", 1, (64, 128), torch.float16, False, False, None),
    ("q4_1", 3, (50, 96), torch.float32, True, True, (8, 2, 4)),
    ("q4_1", 2, (64, 128), torch.bfloat16, True, False, (4, 2, 4)),
    ("q4_1", 8, (24, 64), torch.float16, False, True, (8, 2, 4)),
]


@pytest.mark.parametrize("fmt,m,nk,dtype,bias,add,config", KERNEL_CASES)
def test_gemv_kernel(fmt, m, nk, dtype, bias, add, config):
    need_kernels()
    n, k = nk
    q = random_q(n, k, fmt, DEVICE, seed=m + n)
    g, w64 = pack(q, DEVICE), ref_dequant(q.data, fmt)
    gen = torch.Generator(device=DEVICE).manual_seed(n * m)
    x = torch.randn((m, k), generator=gen, device=DEVICE).to(dtype)
    b = torch.randn(n, generator=gen, device=DEVICE) if bias else None
    out = torch.randn((m, n), generator=gen, device=DEVICE).to(dtype)
    h0 = out.clone()
    qgemv.gemv(x, g.qs, g.scales, g.q4, b, out, add=add, config=config, mins=g.mins)
    check(out, x, w64, b, U_OUT[dtype], h0=h0 if add else None, mag=ref_magnitude(q.data, fmt))


@pytest.mark.parametrize("fmt", QFMTS)
@pytest.mark.parametrize("denorm", [True, False])
def test_gemv_piece_paths(fmt, denorm):
    """Both ways of turning pieces into floats (qgemv._piece: denormals, or the 2^23 offset and an FADD), whatever
    the dtype and tokens would pick: several steps with a short last one, masked rows and tokens, x spread over
    fp16 (2^-14 .. 2^8 times N(0, 1)), a bias and an add."""
    need_kernels()
    n, k, m = 37, 160, 3
    q = random_q(n, k, fmt, DEVICE, seed=13)
    g, w64 = pack(q, DEVICE), ref_dequant(q.data, fmt)
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    mag = 2.0 ** torch.randint(-14, 9, (m, k), generator=gen, device=DEVICE)
    x = (torch.randn((m, k), generator=gen, device=DEVICE) * mag).half()
    b = torch.randn(n, generator=gen, device=DEVICE)
    out = torch.randn((m, n), generator=gen, device=DEVICE).half()
    h0 = out.clone()
    qgemv.gemv(x, g.qs, g.scales, g.q4, b, out, add=True, config=(4, 2, 1), denorm=denorm, mins=g.mins)
    check(out, x, w64, b, U_OUT[torch.float16], h0=h0, mag=ref_magnitude(q.data, fmt))


@pytest.mark.parametrize("fmt,dtype", [("q4_0", torch.float32), ("q8_0", torch.float16), ("q4_0", torch.bfloat16),
                                       ("q4_1", torch.float32), ("q4_1", torch.float16)])
def test_dequant_kernel(fmt, dtype):
    """The prefill path's de-quantizer: each weight its float32 value (Q4_1's d q + m rounded once) rounded once to
    out's dtype."""
    need_kernels()
    q = random_q(21, 96, fmt, DEVICE, seed=7)
    g = pack(q, DEVICE)
    out = torch.empty((21, 96), dtype=dtype, device=DEVICE)
    dequant_gpu.dequant_q(g.qs, g.scales, g.q4, out, mins=g.mins)
    want = ref_dequant(q.data, fmt).float().to(dtype)  # one rounding from the exact float32 value
    if dtype == torch.bfloat16 and not CUDA:  # the interpreter truncates to bfloat16
        torch.testing.assert_close(out.double(), want.double(), atol=0, rtol=2 ** -7)
    else:
        assert torch.equal(out, want)


@pytest.mark.parametrize("fmt", QFMTS)
def test_linear_dispatches_to_kernels(fmt, monkeypatch):
    """linear / add_linear on the kernels' path (patched on for CPU tensors in the interpreter): <= GEMV_MAX_ROWS
    tokens through the GEMV, more through the de-quantizer and a matmul, chunk by chunk."""
    need_kernels()
    monkeypatch.setattr(qlinear, "_on_kernels", lambda t: True)
    monkeypatch.setattr(qlinear, "CHUNK_ELEMS", 16 * 64)  # chunks of 16 rows
    calls = []
    for mod, name in ((qgemv, "gemv"), (dequant_gpu, "dequant_q")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _f=real, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    q = random_q(40, 64, fmt, DEVICE, seed=11)
    g, w64, mag = pack(q, DEVICE), ref_dequant(q.data, fmt), ref_magnitude(q.data, fmt)
    dt = torch.float16 if CUDA else torch.float32  # the CPU's matmul of the prefill path: float32
    for m in (2, qgemv.GEMV_MAX_ROWS + 1):
        calls.clear()
        x = torch.randn((1, m, 64), device=DEVICE).to(dt)
        b = torch.randn(40, device=DEVICE)
        y = linear(x, g, b)
        assert y.shape == (1, m, 40) and y.dtype == dt
        assert calls == (["gemv"] if m <= qgemv.GEMV_MAX_ROWS else ["dequant_q"] * 3)
        check(y, x, w64, b, U_OUT[dt], U_W[dt] if m > qgemv.GEMV_MAX_ROWS else 0.0, mag=mag)
        h = torch.randn((1, m, 40), device=DEVICE).to(dt)
        h0 = h.clone()
        add_linear(h, x, g, b)
        check(h, x, w64, b, U_OUT[dt], U_W[dt] if m > qgemv.GEMV_MAX_ROWS else 0.0, h0=h0, mag=mag)


# ---------------------------------------------------------------------------------------------------------------
# CUDA: compiled kernels, big shapes


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", QFMTS)
@pytest.mark.parametrize("nk", [(8192, 8192), (28672, 8192), (8192, 28672), (3001, 4096), (1000, 11008)])
@pytest.mark.parametrize("m", [1, 3, 8, 17])
def test_linear_cuda_big(fmt, nk, m):
    n, k = nk
    q = random_q(n, k, fmt, "cuda", seed=n + k + m)
    g = pack(q, "cuda")
    assert g.nbytes == row_bytes(fmt, k) * n
    w64, mag = ref_dequant(q.data, fmt), ref_magnitude(q.data, fmt)
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn((m, k), device="cuda").to(dtype)
        b = torch.randn(n, device="cuda").to(dtype)
        u_w = U_W[dtype] if m > qgemv.GEMV_MAX_ROWS else 0.0
        check(linear(x, g, b), x, w64, b, U_OUT[dtype], u_w, mag=mag)
        h = torch.randn((m, n), device="cuda").to(dtype)
        h0 = h.clone()
        add_linear(h, x, g)
        check(h, x, w64, None, U_OUT[dtype], u_w, h0=h0, mag=mag)
    del w64, mag
    torch.cuda.empty_cache()


@pytest.mark.gpu
@gpu
def test_linear_cuda_unpacked_and_float():
    """A QTensor left in its file blocks on the GPU (chunks de-quantized by torch) and float weights."""
    q = random_q(1500, 2048, "q4_0", "cuda", seed=2)
    x = torch.randn((2, 2048), device="cuda").half()
    check(linear(x, q), x, ref_dequant(q.data, "q4_0"), None, U_OUT[torch.float16])
    w = torch.randn(300, 2048, device="cuda")
    # fp16 weights go to cuBLAS (torch.mm), whose fp16 GEMMs may reduce split-K partial sums in fp16 (torch's
    # allow_fp16_reduced_precision_reduction, on by default): a second rounding of 2^-11 |partial|, beyond this
    # file's bound (one rounding of the output). That is torch's setting, not the dispatcher's arithmetic: off here,
    # cuBLAS sums in float32 and rounds once, as the bound says (it failed by 4 of 600 elements, 0.0298 > 0.0218).
    old = torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    try:
        check(linear(x, w.half()), x, w.half().double(), None, U_OUT[torch.float16])
    finally:
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = old


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", QFMTS)
def test_gemv_in_cuda_graph(fmt):
    """linear(out=) and add_linear captured in one CUDA graph (after a warm-up call that compiles), replayed on
    new inputs: the same results as eager calls."""
    n, k = 4096 + 96, 8192
    g = pack(random_q(n, k, fmt, "cuda", seed=5), "cuda")
    x = torch.randn((1, k), device="cuda").half()
    out = torch.empty((1, n), device="cuda").half()
    h = torch.zeros((1, n), device="cuda").half()
    b = torch.randn(n, device="cuda").half()
    linear(x, g, b, out=out)
    add_linear(h, x, g)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        linear(x, g, b, out=out)
        add_linear(h, x, g)
    for seed in range(3):
        x.copy_(torch.randn((1, k), device="cuda", generator=torch.Generator("cuda").manual_seed(seed)).half())
        h.fill_(1.0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, linear(x, g, b))
        want = torch.ones_like(h)
        add_linear(want, x, g)
        assert torch.equal(h, want)


def test_empty_weight_and_tokens():
    """A layer with no hot rows (n = 0) and a step with no tokens: empty outputs, nothing launched."""
    need_kernels()
    g = pack(random_q(0, 64, "q4_0", DEVICE), DEVICE)
    assert g.nbytes == 0
    out = torch.empty((2, 0), device=DEVICE)
    assert qgemv.gemv(torch.randn((2, 64), device=DEVICE), g.qs, g.scales, True, None, out) is out
    assert linear(torch.randn((3, 64)), pack(random_q(0, 64, "q8_0", "cpu"), "cpu")).shape == (3, 0)
    g5 = pack(random_q(5, 64, "q8_0", DEVICE), DEVICE)
    assert qgemv.gemv(torch.empty((0, 64), device=DEVICE), g5.qs, g5.scales, False, None,
                      torch.empty((0, 5), device=DEVICE)).shape == (0, 5)


@pytest.mark.parametrize("fmt", QFMTS)
@pytest.mark.parametrize("kernels", [True, False])
def test_linear_rows_reads_slices_by_index(fmt, kernels, monkeypatch):
    """linear_rows: slices of a stacked weight picked by index (a mixture's routed experts), all times x or each
    times its own row of x (per_slot); on the kernels (the GEMV reading the slices in place, MAP / XSLOT) and off
    them (gathered first) against float64 products of the de-quantized slices."""
    if kernels:
        need_kernels()
        monkeypatch.setattr(qlinear, "_on_kernels", lambda t: True)
    out_rows, k, slices = 32, 64, 5
    q = random_q(slices * out_rows, k, fmt, DEVICE, seed=17)
    g, w64, mag = pack(q, DEVICE), ref_dequant(q.data, fmt), ref_magnitude(q.data, fmt)
    rows = torch.tensor([3, 0, 3, 1], device=DEVICE)  # repeats allowed: two routed slots may not, but cold ones do
    idx = (rows[:, None] * out_rows + torch.arange(out_rows, device=DEVICE)).reshape(-1).cpu()
    x = torch.randn((1, k), device=DEVICE)
    check(qlinear.linear_rows(x, g, rows, out_rows), x, w64[idx], None, U_OUT[torch.float32],
          mag=None if mag is None else mag[idx])
    xs = torch.randn((len(rows), k), device=DEVICE)
    y = qlinear.linear_rows(xs, g, rows, out_rows, per_slot=True)  # (1, 4 * out_rows)
    assert y.shape == (1, len(rows) * out_rows)
    for i, r in enumerate(rows.tolist()):
        sl = slice(r * out_rows, (r + 1) * out_rows)
        check(y[:, i * out_rows:(i + 1) * out_rows], xs[i:i + 1], w64[sl], None, U_OUT[torch.float32],
              mag=None if mag is None else mag[sl])
