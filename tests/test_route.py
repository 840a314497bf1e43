"""kernels/route.py: the routing kernel against its torch twin, the twin against float64 numpy, and HybridMoE's decode
pieces (to_host, device_part) through the kernel against the reference mixture of experts.

Without CUDA the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1) on CPU tensors; with CUDA
compiled, on the same checks. Tolerances on the weights (|got - want| <= atol + rtol |want|):
  kernel vs twin, float16 / bfloat16: one unit of the dtype (rtol its eps, atol its smallest subnormal): both
      round nearly the same float32 value once (the interpreter truncates to bfloat16: still within one unit);
  kernel vs twin, float32: 4 eps: two float32 softmaxes in other orders (exp, divide or multiply by the inverse sum,
      the renormalisation), each within a few eps of float64;
  twin vs float64: one unit of the dtype for float16 / bfloat16, 8 eps for float32.
Everything else (ids, counts, stack indices, x) is equal. Logits in float16 / bfloat16 tie often (a few hundred
values a binade): tied experts are compared by their logits, the kernel's order among them (lowest id first) against
numpy's stable sort.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hotneurons.kernels import qlinear
from hotneurons.kernels import route as routing

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SHAPES = [(8, 1), (8, 2), (8, 8), (60, 1), (60, 2), (60, 8), (128, 1), (128, 2), (128, 8)]  # (E, k)


def need_kernels():
    """The kernel on CPU tensors needs Triton and its interpreter (conftest sets it before triton is imported)."""
    pytest.importorskip("triton")
    if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA and not in Triton's interpreter")


def tol(dtype: torch.dtype, f32_eps: int) -> dict:
    f = torch.finfo(dtype)
    if dtype == torch.float32:
        return dict(rtol=f32_eps * f.eps, atol=0.0)
    return dict(rtol=f.eps, atol=f.smallest_normal * f.eps)  # one unit, subnormals included


def outputs(E: int, k: int, d: int, dtype: torch.dtype, fired0: torch.Tensor) -> dict[str, torch.Tensor]:
    """The step's preallocated outputs, filled with garbage the step must overwrite (fired: counts so far)."""
    def junk(n, dt):
        return torch.full((n,), 7, dtype=dt, device=DEVICE)

    return dict(fired=fired0.clone(), route_w=junk(k, dtype), route_ids=junk(k, torch.long),
                local=junk(k, torch.long), w_gpu=junk(k, dtype), x_host=junk(d, torch.float32),
                ids_host=junk(k, torch.long), w_host=junk(k, torch.float32))


def inputs(seed: int, E: int, d: int, dtype: torch.dtype, distinct: bool):
    """logits (1, E), x (1, d) in dtype, lut (E,) with some -1 (cold), fired (E,) int32 counts so far. distinct:
    logits on a shuffled grid with jitter (no two equal after rounding), else plain normal ones (ties possible)."""
    g = torch.Generator().manual_seed(seed)
    if distinct:
        z = (torch.randperm(E, generator=g).double() - E / 2) * (8 / E) + 0.1 * (8 / E) * torch.rand(E, generator=g)
    else:
        z = 2 * torch.randn(E, generator=g, dtype=torch.float64)
    logits = z[None].to(DEVICE, dtype)  # (1, E)
    x = torch.randn(1, d, generator=g, dtype=torch.float64).to(DEVICE, dtype)  # (1, d)
    lut = torch.where(torch.rand(E, generator=g) < 0.4, -1, torch.randperm(E, generator=g)).to(DEVICE)  # (E,)
    fired = torch.randint(0, 5, (E,), generator=g, dtype=torch.int32).to(DEVICE)  # (E,)
    return logits, x, lut, fired


def reference64(logits: torch.Tensor, k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """(ids (k,), weights (k,) float64): softmax in float64, sorted descending, equal ones by id (stable)."""
    z = logits[0].double().cpu().numpy()  # (E,)
    p = np.exp(z - z.max())
    p /= p.sum()
    ids = np.argsort(-p, kind="stable")[:k]  # (k,)
    top = p[ids]
    return ids, top / top.sum() if norm else top


def check_routing(logits: torch.Tensor, ids: torch.Tensor, want: torch.Tensor | np.ndarray) -> None:
    """ids route as `want`: k distinct experts, slot by slot the same logit (a tie may swap equal experts), and the
    same expert wherever its logit is unique."""
    z = logits[0].cpu()  # (E,)
    ids, want = ids.cpu(), torch.as_tensor(want).cpu()
    assert len(set(ids.tolist())) == len(ids)
    assert torch.equal(z[ids], z[want]), (ids, want)
    unique = torch.tensor([int((z == v).sum()) == 1 for v in z[want]])  # (k,)
    assert torch.equal(ids[unique], want[unique])


# ---------------------------------------------------------------------------------------------------------------
# the kernel against the twin


def run_both(seed, E, k, norm, dtype, distinct):
    d = (64, 2048)[seed % 2]
    logits, x, lut, fired0 = inputs(seed, E, d, dtype, distinct)
    got, want = outputs(E, k, d, dtype, fired0), outputs(E, k, d, dtype, fired0)
    routing.route_step(logits, x, k, norm, lut, **got)
    routing.route_step_torch(logits, x, k, norm, lut, **want)
    return logits, x, lut, fired0, got, want


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("E,k", SHAPES)
def test_kernel_equals_twin(E, k, norm, dtype):
    """Fresh random logits: the same experts in the same order (distinct logits: exactly; plain normal ones: up to
    ties), weights within the tolerance, the counts, stack indices, cold-slot weights and x equal; each output
    consistent with the kernel's own ids and weights."""
    need_kernels()
    for seed in range(4):
        distinct = seed % 2 == 0
        logits, x, lut, fired0, got, want = run_both(seed, E, k, norm, dtype, distinct)
        ids = got["route_ids"]
        if distinct:
            assert torch.equal(ids, want["route_ids"])
        check_routing(logits, ids, want["route_ids"])
        check_routing(logits, ids, reference64(logits, k, norm)[0])  # ties: the lowest id first
        torch.testing.assert_close(got["route_w"], want["route_w"], **tol(dtype, 4))
        # the kernel's own outputs agree with its ids and weights exactly
        assert torch.equal(got["ids_host"], ids)
        assert torch.equal(got["w_host"], got["route_w"].float())
        assert torch.equal(got["fired"], fired0 + torch.bincount(ids, minlength=E).to(torch.int32))
        at = lut[ids]  # (k,)
        assert torch.equal(got["local"], at.clamp(min=0))
        assert torch.equal(got["w_gpu"], torch.where(at >= 0, got["route_w"], torch.zeros_like(got["route_w"])))
        assert torch.equal(got["x_host"], x[0].float())
        if torch.equal(ids, want["route_ids"]):  # no tie across the k-th place: the same counts and look-ups
            for name in ("fired", "local", "ids_host", "x_host"):
                assert torch.equal(got[name], want[name]), name
            torch.testing.assert_close(got["w_gpu"], want["w_gpu"], **tol(dtype, 4))
            torch.testing.assert_close(got["w_host"], want["w_host"], **tol(dtype, 4))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_ties_lowest_id_first(dtype):
    """Logits with many exact ties (a handful of values): the kernel takes equal experts in the order of their ids,
    as numpy's stable sort of the float64 probabilities; equal logits get bit-equal weights."""
    need_kernels()
    g = torch.Generator().manual_seed(11)
    for E, k in [(8, 8), (60, 8), (128, 5)]:
        logits = torch.randint(0, 4, (1, E), generator=g).to(DEVICE, dtype)  # (1, E)
        lut = torch.arange(E, device=DEVICE)
        got = outputs(E, k, 64, dtype, torch.zeros(E, dtype=torch.int32, device=DEVICE))
        routing.route_step(logits, torch.zeros(1, 64, dtype=dtype, device=DEVICE), k, True, lut, **got)
        ids, w = reference64(logits, k, True)
        assert torch.equal(got["route_ids"].cpu(), torch.from_numpy(ids))
        z, gw = logits[0, got["route_ids"]], got["route_w"]
        assert all(bool(gw[i] == gw[j]) for i in range(k) for j in range(k) if z[i] == z[j])
        torch.testing.assert_close(gw.double().cpu(), torch.from_numpy(w), **tol(dtype, 8))


def test_kernel_refusals():
    """Shapes the one program does not take: one line each, naming the fallback."""
    need_kernels()
    E, k = routing.MAX_EXPERTS + 1, 2
    z = torch.zeros(1, E, device=DEVICE)
    args = (torch.zeros(E, dtype=torch.long, device=DEVICE),)
    outs = outputs(E, k, 8, torch.float32, torch.zeros(E, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="at most 512 experts, got 513: fall back to route_step_torch"):
        routing.route_step(z, torch.zeros(1, 8, device=DEVICE), k, True, *args, **outs)
    outs = outputs(64, 17, 8, torch.float32, torch.zeros(64, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="got k=17: fall back to route_step_torch"):
        routing.route_step(z[:, :64], torch.zeros(1, 8, device=DEVICE), 17, True, *args, **outs)
    outs = outputs(64, 2, 8, torch.float32, torch.zeros(64, dtype=torch.int32, device=DEVICE))
    outs["route_w"] = torch.zeros(3, device=DEVICE)
    with pytest.raises(ValueError, match="route_w is \\(3,\\)"):
        routing.route_step(z[:, :64], torch.zeros(1, 8, device=DEVICE), 2, True,
                           torch.zeros(64, dtype=torch.long, device=DEVICE), **outs)
    assert not routing.fits(600, 2, torch.float32) and not routing.fits(64, 2, torch.float64)
    assert routing.fits(512, 16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------------
# the twin against float64


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", [True, False])
def test_twin_equals_float64(norm, dtype):
    """The twin (models/moe.route's ops) against softmax, a stable descending sort and the renormalisation in
    float64 numpy: the same experts (up to ties), the weights within one unit of the dtype."""
    for seed in range(6):
        for E, k in SHAPES:
            logits, x, lut, fired0 = inputs(seed, E, 64, dtype, distinct=seed % 2 == 0)
            out = outputs(E, k, 64, dtype, fired0)
            routing.route_step_torch(logits, x, k, norm, lut, **out)
            ids, w = reference64(logits, k, norm)
            check_routing(logits, out["route_ids"], ids)
            if torch.equal(out["route_ids"].cpu(), torch.from_numpy(ids)):
                torch.testing.assert_close(out["route_w"].double().cpu(), torch.from_numpy(w), **tol(dtype, 8))
            assert torch.equal(out["fired"], fired0 + torch.bincount(out["route_ids"], minlength=E).int())
            assert torch.equal(out["x_host"], x[0].float()) and torch.equal(out["w_host"], out["route_w"].float())


# ---------------------------------------------------------------------------------------------------------------
# HybridMoE's decode pieces through the kernel


def _step(ffn, x: torch.Tensor) -> torch.Tensor:
    """One decode token through the graph steps' pieces (test_runtime_moe._step_pieces, with the wait for the
    device's routing that a CUDA run needs before the CPU reads the host buffers)."""
    ffn.to_host(x)
    y = ffn.device_part(x)
    if CUDA:
        torch.cuda.synchronize()
    ffn.cold_rows(x)
    return (y + ffn.cold_sum().to(y.dtype)).cpu()


@pytest.mark.parametrize("family", ["qwen2-moe", "mixtral"])
@pytest.mark.parametrize("where", ["gpu", "mixed"])
def test_hybrid_moe_decode_through_the_kernel(family, where, monkeypatch):
    """to_host on the kernel (on CUDA as it runs; without, patched on for CPU tensors as the GEMV tests patch it),
    device_part and the CPU's cold_rows: equal to the reference mixture and to the same pieces through the twin,
    the counts too."""
    need_kernels()
    from hotneurons.models import moe
    from hotneurons.runtime.moe_ffn import HybridMoE
    from test_runtime_moe import _cfg, _close, _masks, _weights, _x

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = _cfg(family)
    w = _weights(cfg, "q4_0", seed=5)
    ref = moe.moe_ffn(w.get, cfg, 0)
    twin, ffn = (HybridMoE(0, cfg, w.get, _masks()[where], DEVICE, torch.float32) for _ in range(2))
    for f in (twin, ffn):
        f.host_io(torch.device(DEVICE))
    x = _x(5, seed=8)
    with monkeypatch.context() as m:
        m.setattr(routing, "fits", lambda *a: False)  # HybridMoE's fallback: the twin, on any device
        want = [_step(twin, x[t:t + 1].to(DEVICE)) for t in range(5)]
    calls = []
    if not CUDA:
        monkeypatch.setattr(qlinear, "_on_kernels", lambda t: True)
    monkeypatch.setattr(routing, "route_step", lambda *a, _f=routing.route_step: calls.append(1) or _f(*a))
    for t in range(5):
        y = _step(ffn, x[t:t + 1].to(DEVICE))
        _close(y, ref(x[t:t + 1]))
        torch.testing.assert_close(y, want[t], rtol=1e-6, atol=1e-6)
    assert len(calls) == 5
    assert torch.equal(ffn.fired, twin.fired) and (ffn.expert_counts == twin.expert_counts).all()
    assert (ffn.counts == twin.counts).all()
