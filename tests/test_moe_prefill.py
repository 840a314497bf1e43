"""runtime/moe_prefill.py: a long prefill's cold experts computed on the device from their stored rows, against the
reference models/moe.moe_ffn and against the CPU kernel's path, on fresh random Q4_0 / Q8_0 experts. Without CUDA the
"device" is the CPU (dequant_rows de-quantizes by torch there), which the test allows by patching DEVICE_TYPES."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hotneurons.common.kinds import Activation
from hotneurons.models import moe
from hotneurons.runtime import moe_prefill
from hotneurons.runtime.cuda import LockedHost, page_spans
from hotneurons.runtime.moe_ffn import HybridMoE
from hotneurons.runtime.moe_load import lock_cold_experts, share_cold_rows
from test_cold_experts_sparse import GPU, _cfg, _mapped, _moe_weights, _step_pieces, _tokens, _with_down_t

T = 12  # prefill tokens, over the patched threshold


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("act", [Activation.SWIGLU, Activation.DRELU])
def test_cold_experts_on_the_device_equal_reference(fmt, act, monkeypatch):
    rng = np.random.default_rng(31)
    xs = _tokens(rng, T)
    cfg = dataclasses.replace(_cfg(act), act_fn="silu") if act is Activation.SWIGLU else _cfg(act)
    w = _moe_weights(fmt, xs, seed=32)
    ffn = HybridMoE(0, cfg, w.get, GPU, "cpu", torch.float32)
    x = torch.from_numpy(xs)
    cpu_path = ffn(x)  # the CPU's kernels (dense or firing neurons)
    monkeypatch.setattr(moe_prefill, "DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(moe_prefill, "OFFLOAD_TOKENS", 4)
    calls = []
    real = moe_prefill.cold_on_device
    monkeypatch.setattr(moe_prefill, "cold_on_device", lambda *a: calls.append(1) or real(*a))
    got = ffn(x)
    assert calls == [1]
    assert not moe_prefill.offloads(ffn, 3)  # below the threshold
    # a down_t layer computes with down_t's weights on both paths (the file's down, re-quantized neuron-major)
    ref = moe.moe_ffn((w if ffn.down_t is None else _with_down_t(w, ffn, fmt)).get, cfg, 0)(x)
    tol = dict(rtol=1e-4, atol=2e-5 * float(cpu_path.abs().max()))
    torch.testing.assert_close(got, ref, **tol)
    torch.testing.assert_close(got, cpu_path, **tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("act", [Activation.SWIGLU, Activation.DRELU])
def test_cold_experts_on_cuda_equal_reference(fmt, act, monkeypatch):
    """On CUDA (the Triton dequant_rows, float32 compute), a prefill over the threshold takes the device path (a
    down_t layer: down_t's rows) and equals the reference within the CPU test's tolerance."""
    rng = np.random.default_rng(33)
    xs = _tokens(rng, T)
    cfg = dataclasses.replace(_cfg(act), act_fn="silu") if act is Activation.SWIGLU else _cfg(act)
    w = _moe_weights(fmt, xs, seed=34)
    ffn = HybridMoE(0, cfg, w.get, GPU, "cuda", torch.float32)
    monkeypatch.setattr(moe_prefill, "OFFLOAD_TOKENS", 4)
    calls = []
    real = moe_prefill.cold_on_device
    monkeypatch.setattr(moe_prefill, "cold_on_device", lambda *a: calls.append(1) or real(*a))
    x = torch.from_numpy(xs)
    got = ffn(x.cuda()).cpu()
    ref = moe.moe_ffn((w if ffn.down_t is None else _with_down_t(w, ffn, fmt)).get, cfg, 0)(x)
    assert calls == [1]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=2e-5 * float(ref.abs().max()))


def test_page_spans_cover_the_views_whole_pages_merged():
    """page_spans against a brute-force set of pages, on random views of one buffer (some overlapping a page)."""
    rng = np.random.default_rng(35)
    page = 4096
    buf = np.zeros(64 * page, np.uint8)
    base = buf.ctypes.data
    for _ in range(20):
        cuts = np.sort(rng.choice(len(buf), size=8, replace=False))
        views = [buf[a:b] for a, b in zip(cuts[::2], cuts[1::2])]
        got = page_spans(views, page)
        want = {p for v in views for p in range(v.ctypes.data // page, (v.ctypes.data + v.nbytes - 1) // page + 1)}
        assert {p for a, b in got for p in range(a // page, b // page)} == want
        assert all(a % page == 0 and b % page == 0 and a < b for a, b in got)
        assert all(b1 < a2 for (_, b1), (a2, _) in zip(got, got[1:]))  # merged: no two touch
        assert all(base // page * page <= a for a, _ in got)


@pytest.mark.parametrize("act", [Activation.SWIGLU, Activation.DRELU])
def test_lock_views_hold_each_cold_expert_and_no_gpu_expert(act):
    """Every cold expert's rows of each projection a prefill copies lie inside one of lock_views' views (a copy of a
    run of routed cold experts is then page-locked whole), and no GPU expert's rows do (in place: locking them would
    bring the pages their load dropped back)."""
    xs = _tokens(np.random.default_rng(36), T)
    ffn = HybridMoE(0, _cfg(act), _moe_weights("q4_0", xs, seed=37).get, GPU, "cpu", torch.float32)
    views = [(v.ctypes.data, v.ctypes.data + v.nbytes) for v in moe_prefill.lock_views(ffn)]
    copied = ffn.cold[:2] + ((ffn.cold[2],) if ffn.down_t is None else ())
    for rows in copied:
        per = rows.shape[0] // (ffn.cfg.n_experts if ffn.in_place else ffn.n_cold)
        for e in range(ffn.cfg.n_experts):
            c = int(ffn.cold_map[e])
            if c < 0:
                continue
            r = rows[c * per:(c + 1) * per]
            a, b = r.ctypes.data, r.ctypes.data + r.nbytes
            inside = any(va <= a and b <= vb for va, vb in views)
            assert inside == (not GPU[e])  # compact stacks hold cold experts only (cold_map -1 for the rest)
    if ffn.in_place:
        for rows in copied:
            per = rows.shape[0] // ffn.cfg.n_experts
            for e in np.flatnonzero(GPU):
                r = rows[e * per:(e + 1) * per]
                assert not any(va < r.ctypes.data + r.nbytes and r.ctypes.data < vb for va, vb in views)
    if ffn.down_t is not None:
        assert (ffn.down_t.ctypes.data, ffn.down_t.ctypes.data + ffn.down_t.nbytes) in views


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_locked_host_pins_a_read_only_file_mapping(tmp_path):
    """LockedHost page-locks views of a file mapped read-only (as the GGUF's rows are), overlapping a page between
    two views; copies from them arrive equal; freeing it unlocks them."""
    data = np.random.default_rng(38).integers(0, 255, 3 << 20, dtype=np.uint8)
    data.tofile(tmp_path / "rows.bin")
    m = np.memmap(tmp_path / "rows.bin", dtype=np.uint8, mode="r")
    views = [m[100:(1 << 20) + 7], m[(1 << 20) + 9:(2 << 20)], m[(2 << 20) + 5000:]]
    locked = LockedHost(views)
    assert locked.nbytes >= sum(v.nbytes for v in views)
    for v in views:
        t = torch.from_numpy(np.asarray(v))
        assert t.is_pinned()
        dev = t.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(dev.cpu(), t)
    del locked
    assert not torch.from_numpy(np.asarray(views[0])).is_pinned()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_locked_cold_experts_prefill_equals_reference(monkeypatch):
    """With the cold experts' rows locked (as load_moe_runtime does on CUDA), a long prefill's side-stream copies
    give the reference's outputs; the rows read as pinned."""
    rng = np.random.default_rng(39)
    xs = _tokens(rng, T)
    cfg = dataclasses.replace(_cfg(Activation.SWIGLU), act_fn="silu")
    w = _moe_weights("q4_0", xs, seed=40)
    ffn = HybridMoE(0, cfg, w.get, GPU, "cuda", torch.float32)
    locked = lock_cold_experts([ffn], torch.device("cuda"))
    assert locked is not None and all(torch.from_numpy(v).is_pinned() for v in moe_prefill.lock_views(ffn))
    monkeypatch.setattr(moe_prefill, "OFFLOAD_TOKENS", 4)
    x = torch.from_numpy(xs)
    got = ffn(x.cuda()).cpu()
    ref = moe.moe_ffn(w.get, cfg, 0)(x)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=2e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("act", [Activation.SWIGLU, Activation.DRELU])
def test_shared_cold_rows_read_alike(act, tmp_path, monkeypatch):
    """share_cold_rows (what a CUDA load does before locking): the file's cold rows then come from a read-only shared
    mapping of the same bytes, and decode (the graph pieces' Numba kernels, on read-only arrays), a short prefill on
    the CPU and a long one through the copies equal the reference."""
    xs = _tokens(np.random.default_rng(43), T)
    cfg = dataclasses.replace(_cfg(act), act_fn="silu") if act is Activation.SWIGLU else _cfg(act)
    w = _moe_weights("q4_0", xs, seed=44)
    ffn = HybridMoE(0, cfg, _mapped(w, tmp_path).get, GPU, "cpu", torch.float32)
    private = [a.ctypes.data for a in ffn.cold]
    share_cold_rows([ffn])
    assert all(not a.flags.writeable and a.ctypes.data != p for a, p in zip(ffn.cold, private))
    ref = moe.moe_ffn((w if ffn.down_t is None else _with_down_t(w, ffn, "q4_0")).get, cfg, 0)
    x = torch.from_numpy(xs)
    ffn.host_io(torch.device("cpu"))
    tol = dict(rtol=1e-4, atol=2e-5 * float(ref(x).abs().max()))
    torch.testing.assert_close(_step_pieces(ffn, x[:1]), ref(x[:1]), **tol)
    torch.testing.assert_close(ffn(x[:3]), ref(x[:3]), **tol)
    monkeypatch.setattr(moe_prefill, "DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(moe_prefill, "OFFLOAD_TOKENS", 4)
    torch.testing.assert_close(ffn(x), ref(x), **tol)
