"""kernels/gated.py, the sparse gated FFN of one token (gate GEMV, compaction, up GEMV by index, column-sparse down
product, reduction), against its dense torch reference (gated_ffn_torch: the same roundings) and once against float64
numpy on de-quantized weights; and qgemv's GEMV by index with a device row count.

Thresholds sit midway in a wide gap between neighbouring reference values (`_tau`), so that the kernels' float32
sums, which run in another order than the reference's, cannot put a neuron on the other side; the test that a
threshold equal to a value does not pass (> not >=) uses exact integer arithmetic instead.

Tolerance, elementwise: |y - ref| <= U |ref| + (4 U + 1e-5) (|h| @ |down_t|) + 1e-6, U the output dtype's rounding
(test_qlinear's U_OUT): y is rounded once, each h may differ from the reference's by a few roundings of x's dtype (g
and u rounded from float32 sums taken in another order, then act(g) and the product rounded), sums are float32.

Without CUDA the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1) on tiny shapes, with qgemv's
BLOCK_N raised to 16 so that the interpreter runs few programs; the tests marked gpu run them compiled at LLaMA-3-8B's
FFN shape (d 4096, n 14336), in a CUDA graph too."""

import numpy as np
import pytest
import torch
from hotneurons.kernels import gated, qgemv
from hotneurons.kernels.gated import DownRows, GatedWorkspace, gated_ffn
from hotneurons.kernels.gated_ref import as_float, gate_up_values, gated_ffn_torch, pass_masks
from hotneurons.kernels.ops import ffn_rows_torch
from hotneurons.kernels.qlinear import pack
from hotneurons.weights.quants import dequantize
from test_qlinear import CUDA, DEVICE, QFMTS, U_OUT, check, gpu, need_kernels, random_q, ref_dequant


@pytest.fixture(autouse=True)
def few_gemv_programs(monkeypatch):
    """In the interpreter: qgemv with 16 rows a program, by index too (its config asks for >= 512 programs, slow to
    interpret)."""
    if not CUDA:
        real = qgemv.gemv_config
        monkeypatch.setattr(qgemv, "gemv_config", lambda n, k, q4, m=1: (16, *real(n, k, q4, m)[1:]))
        monkeypatch.setattr(gated, "MAP_Q4_ROWS", 16)


def _weights(fmt: str, n: int, d: int, device: str, seed: int, dtype: torch.dtype = torch.float16) -> list:
    """gate, up, down_t (n, d): packed random blocks (test_qlinear.random_q), or floats ~ N(0, 0.1) in dtype."""
    if fmt in ("f16", "f32"):
        g = torch.Generator(device=device).manual_seed(seed)
        return [(0.1 * torch.randn((n, d), generator=g, device=device)).to(dtype) for _ in range(3)]
    gate, up, down = (pack(random_q(n, d, fmt, device, seed=seed + i), device) for i in range(3))
    return [gate, up, DownRows.of(down)]  # down_t as the runtime keeps it (test_down_rows_layouts_agree: as a GpuQ)


def _tau(v: torch.Tensor, share: float) -> float:
    """A float32 threshold that about `share` of the values v (1-D, >= 0) exceed: midway in the widest gap between
    neighbours within 3 ranks of that share, or 1/256 of them for long v (fp16 values repeat: among thousands 3
    ranks may hold no gap)."""
    s = v.double().sort().values.cpu()
    k = round((1 - share) * len(s))  # values that fail
    w = max(3, len(s) // 256)
    i = max(range(max(1, k - w), min(len(s) - 1, k + w) + 1), key=lambda j: float(s[j] - s[j - 1]))
    assert s[i] > s[i - 1], "no gap to put a threshold in"
    return float(np.float32((s[i - 1] + s[i]) / 2))


def _taus(a: torch.Tensor, h: torch.Tensor, rate: float) -> tuple[float, float]:
    """(tau_g, tau_h) that about `rate` of the neurons pass, both tests at work in between (gate-h): the gate passes
    (1 + rate) / 2 of them, |h| rate / that of those. Rate 0: none passes the gate; 1: both tests at 0."""
    if rate == 0:
        return float(2 * a.float().abs().max() + 1), 0.0
    if rate == 1:
        return 0.0, 0.0
    share = min((1 + rate) / 2, 0.95 * float((a != 0).float().mean()))  # relu's: only the positive g can pass
    tau_g = _tau(a.float().abs(), share)
    return tau_g, _tau(h.float().abs()[a.float().abs() > tau_g], rate / share)


def _check(y: torch.Tensor, ref: torch.Tensor, h: torch.Tensor, down_t, u_h: float | None = None,
           either: torch.Tensor | None = None) -> None:
    """y against ref within the module docstring's bound (u_h: the weight of |h| @ |down_t|, 4 U + 1e-5 unless
    given); either: h of the neurons that may count or not, whose whole terms the bound takes in too."""
    u = U_OUT[y.dtype]
    w = as_float(down_t).double().abs()
    tol = u * ref.double().abs() + (4 * u + 1e-5 if u_h is None else u_h) * (h.double().abs() @ w) + 1e-6
    if either is not None:
        tol += either.double().abs() @ w
    err = (y.double() - ref.double()).abs()
    worst = int(torch.argmax(err - tol))
    assert bool((err <= tol).all()), (f"{int((err > tol).sum())} of {err.numel()} outside: worst err "
                                      f"{float(err.flatten()[worst]):.3g} > tol {float(tol.flatten()[worst]):.3g}")


def _near(v: torch.Tensor, tau: float, u: float) -> torch.Tensor:
    """Where the kernels and the reference may put values v on either side of tau: within 4 roundings of x's dtype
    (u) of it (g and u are rounded from float32 sums taken in another order: a rounding apart at times), or, at tau 0,
    within float32's last bits of 0 (act() far left of 0: exactly 0 in one exp and not in the other). With n in the
    thousands a few neurons sit there; the tiny tests' thresholds in wide gaps leave none."""
    v = v.float().abs()
    near = (v - tau).abs() <= 4 * u * v.clamp(min=tau)
    return near | (v < 2.0 ** -14 * v.max()) if tau == 0 else near


def _compare(y: torch.Tensor, ws: GatedWorkspace, activation: str, x: torch.Tensor, weights: list, a: torch.Tensor,
             h: torch.Tensor, tg: float, th: float) -> torch.Tensor:
    """gated_ffn's pass 1 (ws.ids ascending, ws.count) and y against the reference's, but for the neurons _near a
    threshold; returns pass 2's mask."""
    u = U_OUT[y.dtype]
    p1, p2 = pass_masks(a, h, tg, th)
    near1 = _near(a, tg, u)
    near2 = near1 | (p1 & _near(h, th, u))
    ids = ws.ids[:int(ws.count)].long()
    assert bool((ids[1:] > ids[:-1]).all())  # ascending
    got = torch.zeros_like(p1[0]).index_fill_(0, ids, True)
    assert torch.equal(got & ~near1[0], p1[0] & ~near1[0])
    _check(y, gated_ffn_torch(activation, x, *weights, tg, th), h * p2 * ~near2, weights[2], either=h * near2)
    return p2


def _case(activation: str, fmt: str, rate: float, n: int, d: int, dtype: torch.dtype, seed: int,
          splits: int | None = None, device: str = DEVICE) -> None:
    """gated_ffn on random weights at about `rate` against gated_ffn_torch (_compare)."""
    weights = _weights(fmt, n, d, device, seed, dtype)
    x = torch.randn((1, d), generator=torch.Generator(device=device).manual_seed(seed), device=device)
    x = (x * 2 / (as_float(weights[0]).std() * d ** 0.5)).to(dtype)  # g ~ N(0, 4), as a model's
    a, h = gate_up_values(activation, x, *weights[:2])
    tg, th = _taus(a[0], h[0], rate)
    ws = GatedWorkspace.make(n, d, device, dtype, splits)
    f32 = dict(dtype=torch.float32, device=device)
    y = gated_ffn(activation, x, *weights, torch.tensor(tg, **f32), torch.tensor(th, **f32), ws)
    assert y is ws.y and y.shape == (1, d) and y.dtype == dtype
    if rate == 0:
        assert int(ws.count) == 0 and not bool(y.any())
        return
    p2 = _compare(y, ws, activation, x, weights, a, h, tg, th)
    assert abs(float(p2.float().mean()) - rate) < 0.06
    if rate == 1:  # every neuron whose h is not 0: the dense FFN, in float32 throughout (a few roundings apart)
        assert not bool(h[~p2].any())
        w = [as_float(t) for t in weights]
        dense = ffn_rows_torch(activation, x.float(), w[0], w[1], None, w[2])
        _check(y, dense, h, weights[2], u_h=8 * U_OUT[dtype] + 1e-5)


# ---------------------------------------------------------------------------------------------------------------
# the interpreter (or CUDA), tiny shapes


@pytest.mark.parametrize("rate", [0.0, 0.3, 0.7, 1.0])
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "f16"])
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_gated_ffn_matches_torch(activation, fmt, rate):
    need_kernels()
    _case(activation, fmt, rate, 160, 128, torch.float16, seed=int(10 * rate) + 3 * len(fmt))


@pytest.mark.parametrize("activation, rate, fmt, dtype, d, splits", [
    ("swiglu", 0.5, "q4_1", torch.float32, 96, 3),  # units of d not a multiple of the program's (masks along d)
    ("reglu", 0.3, "q8_0", torch.bfloat16, 96, 1),  # relu's: about half the gates positive,
    ("drelu", 0.15, "q4_0", torch.float32, 160, 7),  # drelu's: a quarter of the h
    ("geglu", 0.5, "f32", torch.float32, 72, 5),  # float rows: d not a multiple of 32
])
def test_gated_ffn_formats_and_dtypes(activation, rate, fmt, dtype, d, splits):
    need_kernels()
    _case(activation, fmt, rate, 200, d, dtype, seed=d + splits, splits=splits)


def test_threshold_equal_to_a_value_does_not_pass():
    """Integer weights and x in {-1, 0, 1}: g, u and relu's a and h are exact integers, and so is y, in the kernels
    and the reference alike. A threshold equal to a value that several neurons share leaves them all out; at 0 the
    neurons whose gate row is zero (act(g) = 0) do not pass, whatever the activation."""
    need_kernels()
    n, d = 96, 64
    gen = torch.Generator().manual_seed(5)
    gate, up, down_t = (torch.randint(-1, 2, (n, d), generator=gen).half().to(DEVICE) for _ in range(3))
    gate[:8] = 0
    x = torch.randint(-1, 2, (1, d), generator=gen).half().to(DEVICE)
    ws = GatedWorkspace.make(n, d, DEVICE, torch.float16, splits=3)
    f32 = dict(dtype=torch.float32, device=DEVICE)
    for activation in ("reglu", "swiglu", "geglu"):
        a, h = gate_up_values(activation, x, gate, up)
        taus = [(0.0, 0.0)]
        if activation == "reglu":  # the most shared positive value of each
            taus += [(float(a[a > 0].mode().values), 0.0), (0.0, float(h.abs()[h.abs() > 0].mode().values))]
        for tg, th in taus:
            y = gated_ffn(activation, x, gate, up, down_t, torch.tensor(tg, **f32), torch.tensor(th, **f32), ws)
            p1, p2 = pass_masks(a, h, tg, th)
            assert int(ws.count) == int(p1.sum()) and not bool(p1[0, :8].any())
            ties = int(((a.float().abs() >= tg) & (h.float().abs() >= th)).sum()) - int(p2.sum())
            assert ties > 0 or tg == th == 0  # the thresholds do meet values
            ref = gated_ffn_torch(activation, x, gate, up, down_t, tg, th)
            if activation == "reglu":
                assert torch.equal(y, ref)
            else:
                _check(y, ref, h * p2, down_t)


def test_matches_float64_numpy_reference():
    """Mixed formats (gate Q4_0, up Q8_0, down_t Q4_1), float32 x: y against the masked FFN in float64 numpy on
    weights de-quantized by weights/quants.py (test_qlinear checks those against gguf.quants)."""
    need_kernels()
    n, d = 128, 96
    qs = [random_q(n, d, fmt, DEVICE, seed=40 + i) for i, fmt in enumerate(["q4_0", "q8_0", "q4_1"])]
    w64 = [dequantize(q.data.cpu(), q.fmt, d).double().numpy() for q in qs]  # (n, d) each (Q4_1: d q + m rounded)
    x = torch.randn((1, d), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    x64 = x.double().cpu().numpy()
    g, u = x64 @ w64[0].T, x64 @ w64[1].T  # (1, n)
    a = g / (1 + np.exp(-g))
    h = a * u
    tg = _tau(torch.from_numpy(np.abs(a[0])), 0.6)
    th = _tau(torch.from_numpy(np.abs(h[0][np.abs(a[0]) > tg])), 0.7)
    keep = (np.abs(a) > tg) & (np.abs(h) > th)
    y64 = (h * keep) @ w64[2]  # (1, d)
    f32 = dict(dtype=torch.float32, device=DEVICE)
    ws = GatedWorkspace.make(n, d, DEVICE, torch.float32)
    y = gated_ffn("swiglu", x, *(pack(q, DEVICE) for q in qs), torch.tensor(tg, **f32), torch.tensor(th, **f32), ws)
    err = np.abs(y.double().cpu().numpy() - y64)
    tol = 1e-5 * (np.abs(h * keep) @ np.abs(w64[2])) + 1e-6
    assert (err <= tol).all(), f"worst err {err.max():.3g}"
    assert int(ws.count) == int((np.abs(a) > tg).sum())


def test_down_t_rows_feed_gated_ffn():
    """The down projection (d, n) as the runtime stores its neurons' rows (models/ffn_weights.down_t_rows, Q4_0 here,
    then qlinear.pack): neuron j's row holds down[:, j], and gated_ffn takes it as down_t."""
    need_kernels()
    from hotneurons.models.ffn_weights import FFNWeights, down_t_rows

    n, d = 96, 64
    gate, up, _ = _weights("f16", n, d, DEVICE, 21)
    down = 0.1 * torch.randn((d, n), generator=torch.Generator().manual_seed(2))  # (d, n) float32
    q = down_t_rows(FFNWeights(up=up.cpu(), down=down, gate=gate.cpu()), torch.arange(n), "q4_0")
    down_t = pack(q, DEVICE)
    assert down_t.shape == (n, d)
    assert float((down_t.dequantize().cpu() - down.T).abs().max()) <= float(down.abs().max()) / 8  # a 4-bit step
    x = torch.randn((1, d), generator=torch.Generator().manual_seed(3)).half().to(DEVICE)
    a, h = gate_up_values("swiglu", x, gate, up)
    tg, th = _taus(a[0], h[0], 0.5)
    ws = GatedWorkspace.make(n, d, DEVICE, torch.float16, splits=2)
    f32 = dict(dtype=torch.float32, device=DEVICE)
    y = gated_ffn("swiglu", x, gate, up, down_t, torch.tensor(tg, **f32), torch.tensor(th, **f32), ws)
    _compare(y, ws, "swiglu", x, [gate, up, down_t], a, h, tg, th)


@pytest.mark.parametrize("fmt", QFMTS)
def test_down_rows_layouts_agree(fmt):
    """down_t as a GpuQ (block-major scales) and as DownRows (row-major: the runtime's) give the same y bit for bit
    (the same products in the same order), the same bytes, and DownRows.rows widens to GpuQ's weights."""
    need_kernels()
    n, d = 160, 96
    gate, up, down = (pack(random_q(n, d, fmt, DEVICE, seed=70 + i), DEVICE) for i in range(3))
    rows = DownRows.of(down)
    assert rows.nbytes == down.nbytes and rows.shape == down.shape and rows.scales.is_contiguous()
    assert torch.equal(rows.rows(slice(40, 90)).dequantize(), down.rows(slice(40, 90)).dequantize())
    x = torch.randn((1, d), generator=torch.Generator().manual_seed(5)).half().to(DEVICE)
    a, h = gate_up_values("swiglu", x, gate, up)
    tg, th = (torch.tensor(t, dtype=torch.float32, device=DEVICE) for t in _taus(a[0], h[0], 0.5))
    ys = [gated_ffn("swiglu", x, gate, up, w, tg, th, GatedWorkspace.make(n, d, DEVICE, torch.float16, splits=3))
          for w in (down, rows)]
    assert torch.equal(ys[0], ys[1])


def test_refusals():
    """One-line ValueErrors naming the value and the fix; checked before any kernel runs."""
    n, d = 32, 64
    gate, up, down_t = _weights("f16", n, d, "cpu", 0)
    x = torch.randn((1, d)).half()
    ws = GatedWorkspace.make(n, d, "cpu", torch.float16)
    t = torch.tensor(0.5)
    cases = [
        (("relu", x, gate, up, down_t, t, t, ws), "has no gate"),
        (("swiglu", x.float(), gate, up, down_t, t, t, ws), "does not fit the workspace"),
        (("swiglu", x, gate, up, down_t.T, t, t, ws), "down_t"),
        (("swiglu", x, gate, up.float(), down_t, t, t, ws), "cast it once"),
        (("swiglu", x, gate, random_q(n, d, "q4_0", "cpu"), down_t, t, t, ws), "qlinear.pack"),
        (("swiglu", x, gate, DownRows.of(pack(random_q(n, d, "q4_0", "cpu"), "cpu")), down_t, t, t, ws), "DownRows"),
        (("swiglu", x, gate, up, down_t, t.double(), t, ws), "tau_g must be a one-element float32"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match) as e:
            gated_ffn(*args)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="must be positive"):
        GatedWorkspace.make(0, d, "cpu", torch.float16)


@pytest.mark.parametrize("fmt", QFMTS)
def test_gemv_count_stops_at_the_count(fmt):
    """qgemv.gemv(rows=, count=): the first count outputs are the rows' products; programs past the count write
    nothing (a partly counted program computes its other rows from whatever ids sit there)."""
    need_kernels()
    n, k = 48, 64
    q = random_q(n, k, fmt, DEVICE, seed=9)
    w = pack(q, DEVICE)
    rows = torch.randperm(n, generator=torch.Generator().manual_seed(1)).to(torch.int32).to(DEVICE)
    x = torch.randn((1, k), device=DEVICE)
    out = torch.full((1, n), float("nan"), device=DEVICE)
    cfg = (4, *qgemv.gemv_config(n, k, w.q4)[1:])
    qgemv.gemv(x, w.qs, w.scales, w.q4, None, out, config=cfg, mins=w.mins, rows=rows, out_rows=1,
               count=torch.tensor([19], dtype=torch.int32, device=DEVICE))
    idx = rows[:19].long().cpu()
    check(out[:, :19], x, ref_dequant(q.data, fmt)[idx], None, U_OUT[torch.float32], mag=None)
    assert not bool(out[0, :20].isnan().any()) and bool(out[0, 20:].isnan().all())
    with pytest.raises(ValueError, match="pass rows="):
        qgemv.gemv(x, w.qs, w.scales, w.q4, None, out, mins=w.mins, count=torch.tensor([1], dtype=torch.int32))


# ---------------------------------------------------------------------------------------------------------------
# CUDA: compiled, big, in graphs


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rate", [0.0, 0.3, 0.7, 1.0])
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "f16"])
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_gated_ffn_cuda_big(activation, fmt, rate):
    _case(activation, fmt, rate, 14336, 4096, torch.float16, seed=int(10 * rate) + len(fmt), device="cuda")
    torch.cuda.empty_cache()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt, dtype", [("q4_1", torch.bfloat16), ("q4_0", torch.float32), ("f16", torch.float16)])
def test_gated_ffn_cuda_odd_shape(fmt, dtype):
    """n and d not powers of two (d 3 * 1024 + 32 * 3: masks along d), 7 splits."""
    _case("swiglu", fmt, 0.5, 11000, 3168, dtype, seed=7, splits=7, device="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "f16"])
def test_gated_ffn_in_cuda_graph(fmt):
    """One captured graph (runtime/cuda.capture) replayed on new x and new thresholds written into tau_g / tau_h:
    the eager call's y bit for bit (the reduction's order is fixed), and the reference's within the bound."""
    from hotneurons.runtime.cuda import capture

    n, d = 14336, 4096
    gate, up, down_t = _weights(fmt, n, d, "cuda", 11)
    x = torch.zeros((1, d), device="cuda").half()
    tau_g, tau_h = (torch.zeros((), dtype=torch.float32, device="cuda") for _ in range(2))
    scale = 2 / (as_float(gate).std() * d ** 0.5)  # g ~ N(0, 4), as _case's
    ws = GatedWorkspace.make(n, d, "cuda", torch.float16)
    graphs, (y,) = capture(torch.device("cuda"), [lambda: gated_ffn("swiglu", x, gate, up, down_t, tau_g, tau_h, ws)])
    assert y is ws.y
    eager_ws = GatedWorkspace.make(n, d, "cuda", torch.float16)
    for seed, rate in [(0, 0.3), (1, 0.7), (2, 0.0), (3, 1.0)]:
        x.copy_(torch.randn((1, d), device="cuda", generator=torch.Generator("cuda").manual_seed(seed)) * scale)
        a, h = gate_up_values("swiglu", x, gate, up)
        tg, th = _taus(a[0], h[0], rate)
        tau_g.fill_(tg)
        tau_h.fill_(th)
        graphs[0].replay()
        torch.cuda.synchronize()
        assert torch.equal(y, gated_ffn("swiglu", x, gate, up, down_t, tau_g, tau_h, eager_ws))
        _compare(y, ws, "swiglu", x, [gate, up, down_t], a, h, tg, th)


@pytest.mark.gpu
@gpu
def test_bench_gated_runs():
    """bench/gated_gemv.bench_gated on a small layer: its figures are there and its result is the reference's."""
    from bench.gated_gemv import bench_gated

    r = bench_gated(1024, 2816, 0.5, "q4_0", repeats=3)
    assert abs(r["pass_rate"] - 0.5) < 0.01 and r["rel_err"] < 1e-2
    assert all(r[key] > 0 for key in ("dense_us", "sparse_us", "gate_us", "dense_gbs", "sparse_gbs"))
