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
from hotneurons.runtime.moe_ffn import HybridMoE
from test_cold_experts_sparse import GPU, _cfg, _moe_weights, _tokens, _with_down_t

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
