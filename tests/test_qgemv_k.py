"""The K-quants on the GPU path: kernels/qlayout_k.py (GpuQ's Q4_K / Q5_K / Q6_K layout), kernels/qgemv_k.py (GEMV,
rows by index, de-quantizer), kernels/dequant.dequant_rows of K blocks, and qlinear's dispatch to them, on fresh random
valid blocks against gguf-py's de-quantized weights in float64.

Tolerances (test_qlinear's `check`): |y - ref| <= u_out |ref| + (1e-5 + u_w) (|x| @ mag.T + |b|) + 1e-6, mag the
magnitude the kernel's float32 terms carry per weight: |d sc q| + |dmin m| for Q4_K / Q5_K (it sums d sc (sum q x) -
dmin m (sum x), as Q4_1's), |d sc| (q + 32) for Q6_K (with denormal pieces it sums d sc (sum q x) - 32 d sc (sum x),
q in 0..63); gguf-py's float32 weights are within 2^-24 of those terms of the exact value. De-quantizers: each weight
its float32 value (gguf-py's) rounded once to the output's dtype, exactly (the interpreter truncates to bfloat16:
within one unit).

Without CUDA the kernels run in Triton's interpreter on small shapes (conftest sets TRITON_INTERPRET=1); the tests
marked gpu run them compiled at LLaMA-2-70B's shapes and in a CUDA graph."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from hotneurons.kernels import dequant, dequant_gpu, qgemv, qgemv_k, qlayout_k, qlinear
from hotneurons.kernels.qlinear import GpuQ, add_linear, linear, pack
from hotneurons.weights.formats import row_bytes, spec
from hotneurons.weights.qtensor import QTensor
from test_qlinear import CUDA, DEVICE, U_OUT, U_W, check, gpu, need_kernels

KFMTS = ["q4_k", "q5_k", "q6_k"]
GGML = {"q4_k": GGMLQuantizationType.Q4_K, "q5_k": GGMLQuantizationType.Q5_K, "q6_k": GGMLQuantizationType.Q6_K}


def random_k(n: int, k: int, fmt: str, device: str, seed: int) -> QTensor:
    """Random valid blocks made on the device: random bytes, the fp16 fields d (Q6_K) or d, dmin ~ |N(0, 0.002)| (as
    llama.cpp writes them, non-negative; Q6_K's d either sign)."""
    g = torch.Generator(device=device).manual_seed(seed)
    nb, bb = k // 256, spec(fmt).block_bytes
    blocks = torch.randint(0, 256, (n, nb, bb), generator=g, device=device, dtype=torch.uint8)
    if fmt == "q6_k":
        blocks[:, :, 208:] = (0.002 * torch.randn((n, nb, 1), generator=g, device=device)).half().view(torch.uint8)
    else:
        dd = (0.002 * torch.randn((n, nb, 2), generator=g, device=device)).abs().half()
        blocks[:, :, :4] = dd.view(torch.uint8)
    return QTensor(blocks.reshape(n, nb * bb), fmt, (n, k))


def reference(q: QTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w, mag) (n, k) float64 on q's device: gguf-py's de-quantized weights (small shapes: numpy; big ones:
    weights/quants.dequantize on the device, held to gguf-py bit for bit by tests/test_weights_quants.py) and the
    tolerance's per-weight magnitude (module docstring), from the blocks' fields."""
    n, k = q.shape
    nb = k // 256
    data = q.data
    if data.numel() <= 1 << 22:
        w = torch.from_numpy(gguf_dequantize(data.cpu().numpy(), GGML[q.fmt.value])).to(data.device).double()
    else:
        from hotneurons.weights.quants import dequantize

        w = dequantize(data, q.fmt, k).double()
    b = data.view(n, nb, -1)
    d = b[:, :, 208:210].contiguous().view(torch.float16).double() if q.fmt.value == "q6_k" else \
        b[:, :, 0:2].contiguous().view(torch.float16).double()  # (n, nb, 1)
    if q.fmt.value == "q6_k":  # |d sc| (q + 32) <= |w| + 64 |d sc| (|w| = |d sc| |q - 32|)
        sc = b[:, :, 192:208].contiguous().view(torch.int8).double().repeat_interleave(16, dim=2)  # (n, nb, 256)
        mag = w.abs() + 64 * (d * sc).abs().reshape(n, k)
    else:  # |d sc q| + |dmin m| = |w + dmin m| + |dmin m|
        f = qlayout_k._k_scale_fields(b[:, :, 4:16])[1].double().repeat_interleave(32, dim=2)  # (n, nb, 256): m
        dm = (b[:, :, 2:4].contiguous().view(torch.float16).double() * f).reshape(n, k)
        mag = (w + dm).abs() + dm.abs()
    return w, mag


@pytest.fixture(autouse=True)
def kernels_in_the_interpreter(monkeypatch):
    """Without CUDA: dequant_rows' kernels on CPU tensors (Triton's interpreter)."""
    monkeypatch.setattr(dequant, "_on_kernels", lambda t: True)


# ---------------------------------------------------------------------------------------------------------------
# the layout


@pytest.mark.parametrize("k", [512, 256])  # 256: one block a row, whose slices have a (1, n) stride
@pytest.mark.parametrize("fmt", KFMTS)
def test_pack_keeps_the_bytes(fmt, k):
    n = 19
    q = random_k(n, k, fmt, "cpu", seed=1)
    g = pack(q, "cpu", chunk_bytes=4 * (3 * row_bytes(fmt, k) + 7))  # chunks of 3 rows (a quarter), the last short
    assert isinstance(g, GpuQ) and g.kquant and g.shape == (n, k)
    assert g.nbytes == q.nbytes == n * row_bytes(fmt, k)  # the file's 144 / 176 / 210 bytes a block
    assert torch.equal(g.to_qtensor().data, q.data)
    assert all(t is None or t.stride(0) == 1 for t in (g.scales, g.mins, g.sub, g.qh))  # row-innermost
    w, _ = reference(q)
    assert torch.equal(g.dequantize(torch.float64), w)
    part = g.rows(slice(4, 11))  # views
    assert part.qs.data_ptr() == g.qs[4].data_ptr() and part.nbytes == 7 * row_bytes(fmt, k)
    assert torch.equal(part.to_qtensor().data, q.data[4:11])
    picked = g.rows(torch.tensor([3, 3, 0]))  # copies, made row-innermost again
    assert picked.sub.stride(0) == 1 and torch.equal(picked.to_qtensor().data, q.data[[3, 3, 0]])
    empty = pack(random_k(0, 512, fmt, "cpu", seed=1), "cpu")  # a layer with no hot rows
    assert empty.nbytes == 0 and qgemv_k.gemv(torch.randn(1, 512), empty, None, torch.empty(1, 0)).shape == (1, 0)


@pytest.mark.parametrize("fmt", KFMTS)
def test_layout_is_the_documented_one(fmt):
    """Each weight from the fields as qlayout_k's docstring says they hold it (nibble words in Q4_0's kernel order,
    12-bit scale fields at bit 12 j, the high bits' positions, Q6_K's int8 pairs), against gguf-py."""
    n, k = 3, 512
    q = random_k(n, k, fmt, "cpu", seed=2)
    g = pack(q, "cpu")
    nu = k // 32
    words = g.qs.reshape(n, nu, 16).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # (n, units, 4)
    wi = torch.arange(32)
    i, h, c = wi % 4, (wi // 4) % 2, wi // 8  # weight 8 c + 4 h + i = nibble 2 c + h of word i
    val = (words[:, :, i] >> (4 * (2 * c + h))) & 15  # (n, units, 32)
    d = g.scales.double().repeat_interleave(8, dim=1)[:, :, None]  # (n, units, 1)
    if fmt == "q6_k":
        qh = g.qh.to(torch.int64) & 0xFFFFFFFF  # (n, units, 2)
        at = 8 * c + 2 * h + torch.where(i % 2 == 0, 4, 0)
        val = val | (((qh[:, :, i // 2] >> at) & 3) << 4)
        sc = g.sub.contiguous().view(torch.int8).reshape(n, nu, 2).double()
        w = d * torch.where(wi < 16, sc[:, :, :1], sc[:, :, 1:]) * (val.double() - 32)
    else:
        if fmt == "q5_k":
            kk = 2 * i + h
            at = 8 * c + torch.where(kk < 4, 4 + kk, kk - 4)
            val = val | (((g.qh[:, :, 0].to(torch.int64) & 0xFFFFFFFF)[:, :, None] >> at) & 1) << 4
        s3 = g.sub.to(torch.int64) & 0xFFFFFFFF  # (n, nb, 3)
        bits = s3[:, :, 0] | (s3[:, :, 1] << 32)  # the first 64 of the 96 bits (fields 0-4)
        f = torch.stack([(bits >> (12 * j)) & 0xFFF if j < 5 else
                         ((s3[:, :, 1] | (s3[:, :, 2] << 32)) >> (12 * j - 32)) & 0xFFF for j in range(8)], dim=2)
        f = f.reshape(n, nu, 1)
        dmin = g.mins.double().repeat_interleave(8, dim=1)[:, :, None]
        w = d * (f & 63).double() * val.double() - dmin * (f >> 6).double()
    ref, _ = reference(q)
    torch.testing.assert_close(w.reshape(n, k), ref, rtol=0, atol=1e-6 * float(ref.abs().max()))


def test_gpuq_k_refusals():
    g = pack(random_k(2, 256, "q4_k", "cpu", seed=3), "cpu")
    with pytest.raises(ValueError, match="expected") as e:
        GpuQ(g.qs[:, :64], g.scales, "q4_k", (2, 256), g.mins, g.sub)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="qh None"):  # Q4_K with high bits
        GpuQ(g.qs, g.scales, "q4_k", (2, 256), g.mins, g.sub, torch.zeros((2, 8, 1), dtype=torch.int32))
    q2k = QTensor(torch.zeros((2, 84), dtype=torch.uint8), "q2_k", (2, 256))
    with pytest.raises(ValueError, match="no GPU kernel"):
        pack(q2k, "cpu")


# ---------------------------------------------------------------------------------------------------------------
# the kernels: interpreted on the CPU (small BLOCK_U so that a row spans several steps), compiled on CUDA


GEMV_CASES = [  # m, (n, k), dtype, bias, add, config, denorm (None: gemv's choice)
    (1, (24, 512), torch.float16, False, False, (8, 8, 1), None),  # denormal pieces, several steps
    (3, (21, 768), torch.float32, True, True, (4, 16, 1), None),  # masked rows, tokens and a short last step
    (2, (16, 256), torch.bfloat16, True, False, (8, 32, 1), False),  # one masked step, the FADD pieces
    (8, (12, 512), torch.float16, False, True, (4, 16, 1), None),  # the most tokens
]


@pytest.mark.parametrize("fmt", KFMTS)
@pytest.mark.parametrize("m,nk,dtype,bias,add,config,denorm", GEMV_CASES)
def test_gemv(fmt, m, nk, dtype, bias, add, config, denorm):
    need_kernels()
    n, k = nk
    q = random_k(n, k, fmt, DEVICE, seed=n + m)
    g, (w64, mag) = pack(q, DEVICE), reference(q)
    gen = torch.Generator(device=DEVICE).manual_seed(m * n)
    x = torch.randn((m, k), generator=gen, device=DEVICE).to(dtype)
    b = torch.randn(n, generator=gen, device=DEVICE) if bias else None
    out = torch.randn((m, n), generator=gen, device=DEVICE).to(dtype)
    h0 = out.clone()
    assert qgemv_k.gemv(x, g, b, out, add=add, config=config, denorm=denorm) is out
    check(out, x, w64, b, U_OUT[dtype], h0=h0 if add else None, mag=mag)


@pytest.mark.parametrize("fmt", KFMTS)
def test_gemv_x_over_fp16s_range(fmt):
    """Denormal pieces and x spread over fp16's range (2^-14 .. 2^8 times N(0, 1)): the scales' 2^XEXP and Q6_K's
    offset (qgemv_k._scales, _step) keep their bounds."""
    need_kernels()
    n, k, m = 16, 512, 2
    q = random_k(n, k, fmt, DEVICE, seed=5)
    g, (w64, mag) = pack(q, DEVICE), reference(q)
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    x = (torch.randn((m, k), generator=gen, device=DEVICE) * 2.0 ** torch.randint(-14, 9, (m, k), generator=gen,
                                                                                  device=DEVICE)).half()
    out = torch.empty((m, n), device=DEVICE).half()
    qgemv_k.gemv(x, g, None, out, config=(8, 16, 1), denorm=True)
    check(out, x, w64, None, U_OUT[torch.float16], mag=mag)


@pytest.mark.parametrize("fmt", KFMTS)
def test_gemv_rows_by_index(fmt, monkeypatch):
    """linear_rows on the kernels (MAP, XSLOT) and the GEMV's count= (only the first count[0] output rows, the rest
    any valid index), against gathered float64 slices."""
    need_kernels()
    monkeypatch.setattr(qlinear, "_on_kernels", lambda t: True)
    out_rows, k, slices = 8, 256, 4
    q = random_k(slices * out_rows, k, fmt, DEVICE, seed=7)
    g, (w64, mag) = pack(q, DEVICE), reference(q)
    rows = torch.tensor([2, 0, 2], device=DEVICE)
    idx = (rows[:, None] * out_rows + torch.arange(out_rows, device=DEVICE)).reshape(-1)
    x = torch.randn((1, k), device=DEVICE)
    check(qlinear.linear_rows(x, g, rows, out_rows), x, w64[idx], None, U_OUT[torch.float32], mag=mag[idx])
    xs = torch.randn((len(rows), k), device=DEVICE)
    y = qlinear.linear_rows(xs, g, rows, out_rows, per_slot=True)  # (1, 3 * out_rows)
    for j, r in enumerate(rows.tolist()):
        sl = slice(r * out_rows, (r + 1) * out_rows)
        check(y[:, j * out_rows:(j + 1) * out_rows], xs[j:j + 1], w64[sl], None, U_OUT[torch.float32], mag=mag[sl])
    ids = torch.tensor([5, 30, 9, 0, 0, 0, 0, 0], device=DEVICE)  # 3 wanted, the rest padding
    out = torch.full((1, 8), float("nan"), device=DEVICE)
    qgemv_k.gemv(x, g, None, out, config=(2, 8, 1), rows=ids, out_rows=1, count=torch.tensor([3], device=DEVICE,
                                                                                              dtype=torch.int32))
    check(out[:, :3], x, w64[ids[:3]], None, U_OUT[torch.float32], mag=mag[ids[:3]])


@pytest.mark.parametrize("fmt", KFMTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dequant_kernels(fmt, dtype):
    """The prefill path's de-quantizer of a K GpuQ and dequant_rows of the file's blocks: gguf-py's float32 weights
    rounded once to dtype."""
    need_kernels()
    n, k = 9, 768
    q = random_k(n, k, fmt, DEVICE, seed=11)
    want = reference(q)[0].float().to(dtype)
    got = [dequant_gpu.dequant_k(pack(q, DEVICE), torch.empty((n, k), dtype=dtype, device=DEVICE)),
           dequant.dequant_rows(q.data, fmt, k, dtype)]
    for out in got:
        if dtype == torch.bfloat16 and not CUDA:  # the interpreter truncates to bfloat16
            torch.testing.assert_close(out.double(), want.double(), atol=0, rtol=2 ** -7)
        else:
            assert torch.equal(out, want)


def test_dequant_rows_strided_rows():
    """Rows of a wider buffer (a file's rows with others beside them): the kernel takes the row stride."""
    need_kernels()
    q = random_k(5, 512, "q6_k", DEVICE, seed=12)
    wide = torch.zeros((5, q.data.shape[1] + 64), dtype=torch.uint8, device=DEVICE)
    wide[:, :q.data.shape[1]] = q.data
    got = dequant.dequant_rows(wide[:, :q.data.shape[1]], "q6_k", 512, torch.float32)
    assert torch.equal(got.double(), reference(q)[0])


@pytest.mark.parametrize("fmt", KFMTS)
def test_linear_dispatches_to_kernels(fmt, monkeypatch):
    """linear / add_linear on the kernels' path: <= GEMV_MAX_ROWS tokens through qgemv_k's GEMV, more through
    dequant_gpu.dequant_k and a matmul, a chunk of rows at a time."""
    need_kernels()
    monkeypatch.setattr(qlinear, "_on_kernels", lambda t: True)
    monkeypatch.setattr(qlinear, "CHUNK_ELEMS", 8 * 256)  # chunks of 8 rows
    if not CUDA:  # few programs in the interpreter
        monkeypatch.setattr(qgemv_k, "gemv_config", lambda n, k, fmt, m=1, by_index=False: (8, 8, 1))
    calls = []
    for mod, name in ((qgemv_k, "gemv"), (dequant_gpu, "dequant_k")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _f=real, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    q = random_k(20, 256, fmt, DEVICE, seed=13)
    g, (w64, mag) = pack(q, DEVICE), reference(q)
    dt = torch.float16 if CUDA else torch.float32
    for m in (2, qgemv.GEMV_MAX_ROWS + 1):
        calls.clear()
        x = torch.randn((1, m, 256), device=DEVICE).to(dt)
        b = torch.randn(20, device=DEVICE)
        y = linear(x, g, b)
        assert y.shape == (1, m, 20) and calls == (["gemv"] if m <= qgemv.GEMV_MAX_ROWS else ["dequant_k"] * 3)
        u_w = U_W[dt] if m > qgemv.GEMV_MAX_ROWS else 0.0
        check(y, x, w64, b, U_OUT[dt], u_w, mag=mag)
        h = torch.randn((1, m, 20), device=DEVICE).to(dt)
        h0 = h.clone()
        add_linear(h, x, g, b)
        check(h, x, w64, b, U_OUT[dt], u_w, h0=h0, mag=mag)


def test_linear_cpu_reads_k_gpuq():
    """A K GpuQ off the kernels (the CPU without the interpreter's patch): its de-quantized chunks, float32 sums."""
    q = random_k(10, 512, "q5_k", "cpu", seed=14)
    g, (w64, mag) = pack(q, "cpu"), reference(q)
    x = torch.randn(3, 512)
    check(linear(x, g), x, w64, None, U_OUT[torch.float32], mag=mag)


# ---------------------------------------------------------------------------------------------------------------
# CUDA: compiled kernels, big shapes


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", KFMTS)
@pytest.mark.parametrize("nk", [(8192, 8192), (8192, 28672), (28672, 8192), (3001, 4096), (1000, 11008)])
@pytest.mark.parametrize("m", [1, 3, 8, 17])
def test_linear_cuda_big(fmt, nk, m):
    n, k = nk  # 11008: 43 blocks, 344 units, not a whole number of steps
    q = random_k(n, k, fmt, "cuda", seed=n + k + m)
    g = pack(q, "cuda")
    assert g.nbytes == row_bytes(fmt, k) * n
    w64, mag = reference(q)
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
@pytest.mark.parametrize("fmt", KFMTS)
def test_cuda_rows_by_index_and_dequant_rows(fmt):
    """Rows by index with a device count (the gated path's up GEMV), per-slot slices, and dequant_rows at 4096 x
    14336 against weights/quants.dequantize cast once."""
    n, k = 14336, 4096
    q = random_k(n, k, fmt, "cuda", seed=21)
    g, (w64, mag) = pack(q, "cuda"), reference(q)
    x = torch.randn((1, k), device="cuda").half()
    ids = torch.randperm(n, device="cuda")[:5000]
    out = torch.empty((1, 5000), device="cuda").half()
    qgemv_k.gemv(x, g, None, out, rows=ids, out_rows=1, count=torch.tensor([4321], device="cuda", dtype=torch.int32))
    check(out[:, :4321], x, w64[ids[:4321]], None, U_OUT[torch.float16], mag=mag[ids[:4321]])
    rows = torch.tensor([3, 0, 6], device="cuda")
    xs = torch.randn((3, k), device="cuda").half()
    y = qlinear.linear_rows(xs, g, rows, 2048, per_slot=True)
    for j, r in enumerate(rows.tolist()):
        sl = slice(r * 2048, (r + 1) * 2048)
        check(y[:, j * 2048:(j + 1) * 2048], xs[j:j + 1], w64[sl], None, U_OUT[torch.float16], mag=mag[sl])
    for dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(dequant.dequant_rows(q.data[:512], fmt, k, dtype), w64[:512].float().to(dtype))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", KFMTS)
def test_k_gemv_in_cuda_graph(fmt):
    """linear(out=) and add_linear captured in one CUDA graph after a warm-up call, replayed on new inputs: the eager
    calls' results."""
    n, k = 4096 + 96, 8192
    g = pack(random_k(n, k, fmt, "cuda", seed=5), "cuda")
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


def test_reference_is_gguf():
    """This file's reference: gguf-py's weights (held bit for bit by weights/quants.dequantize, which the big shapes
    use) and a magnitude that bounds |w|."""
    for fmt in KFMTS:
        q = random_k(4, 512, fmt, "cpu", seed=9)
        w, mag = reference(q)
        from hotneurons.weights.quants import dequantize

        assert torch.equal(dequantize(q.data, fmt, 512).double(), w)
        assert bool((mag >= w.abs()).all())
        assert np.isfinite(mag.numpy()).all()


def test_hot_rows_stay_k_quants():
    """models/ffn_weights.hot_blocks with a K-quant hot format (a Q4_K_M file's: Q4_K gate and up, Q6_K down): gate
    and up rows as stored; the down projection as stored when every neuron is hot, else its hot columns (re-blocked)
    in Q6_K's nearest, q8_0, within q8_0's rounding of the stored weights; the gated kernels' neuron-major rows in
    Q4_K's nearest, q4_1."""
    from hotneurons.models.ffn_weights import FFNWeights, hot_blocks
    from hotneurons.weights.formats import WeightFormat

    n, d = 512, 256
    up, gate = random_k(n, d, "q4_k", "cpu", 1), random_k(n, d, "q4_k", "cpu", 2)
    down = random_k(d, n, "q6_k", "cpu", 3)  # (d, n)
    w = FFNWeights(up=up, down=down, gate=gate)
    hot = torch.arange(0, n, 3)  # 171 neurons
    part = hot_blocks(w, hot, WeightFormat.Q4_K, "cpu", gated=True)
    assert torch.equal(part["up"].data, up.data[hot]) and torch.equal(part["gate"].data, gate.data[hot])
    assert part["down"].fmt == WeightFormat.Q8_0 and part["down_cols"] == 192  # whole q8_0 blocks
    cols = reference(down)[0][:, hot]  # (d, 171)
    got = part["down"].dequantize(torch.float64)
    assert bool((got[:, 171:] == 0).all())
    # q8_0 (llama.cpp's rounding): w = q d16, d = max |w| / 127 of the block rounded to fp16 (d16, within 2^-11 d or
    # half fp16's subnormal spacing 2^-25), q = round(w / d): |w - q d16| <= d / 2 + 127 |d - d16|
    step = torch.nn.functional.pad(cols, (0, 21)).abs().reshape(d, 6, 32).amax(dim=2).repeat_interleave(32, 1)
    step = step[:, :171] / 127
    assert bool(((got[:, :171] - cols).abs() <= step / 2 + 127 * torch.clamp(step * 2.0 ** -11, min=2.0 ** -25)).all())
    dense = hot_blocks(w, torch.arange(n), WeightFormat.Q4_K, "cpu", gated=True)
    assert dense["down"].fmt == WeightFormat.Q6_K and torch.equal(dense["down"].data, down.data)
    assert dense["up"].fmt == WeightFormat.Q4_K and dense["down_cols"] == n
    gated = hot_blocks(w, hot, WeightFormat.Q4_K, "cpu", gated=True, neuron_major=True)
    assert {gated[k].fmt for k in ("up", "gate", "down_t")} == {WeightFormat.Q4_1}
