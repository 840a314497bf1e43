"""kernels/grouped.py (a mixture of experts' routed pairs times their experts' rows in one launch) against float64, and
its use in runtime/moe_ffn.HybridMoE's prefill against today's per-expert path and the reference models/moe.moe_ffn.

Groups are uneven on purpose: an expert with no pair, one with one, one with more than a tile (BLOCK_M) of pairs, ids
out of stack order. Tolerances: tests/test_qlinear.py's `check` (one rounding of the output, float32 sums, u_w the
rounding of each weight to x's dtype inside the kernel, 0 for float32 x); HybridMoE as tests/test_runtime_moe.py's
(rtol 1e-4, atol 2e-5 x the output's scale: float32 on both sides, other orders of summation).

Without CUDA the kernel runs in Triton's interpreter on tiny shapes (the device patched on for CPU tensors, as
test_qlinear's); the tests marked gpu run it compiled on Qwen3-30B-A3B's shapes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hotneurons.kernels import grouped
from hotneurons.kernels.qlinear import pack
from hotneurons.models import moe
from hotneurons.runtime import moe_ffn
from hotneurons.runtime.moe_ffn import HybridMoE
from hotneurons.runtime.moe_rows import PROJ
from hotneurons.weights.formats import WeightFormat
from hotneurons.weights.qtensor import QTensor
from test_qlinear import CUDA, DEVICE, U_OUT, U_W, check, need_kernels, random_q, ref_dequant, ref_magnitude
from test_runtime_moe import _cfg, _close, _masks, _weights, _x

gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")
COUNTS = [0, 1, 19, 5, 2]  # pairs of each group: none, one, more than a tile of 16
IDS = [3, 0, 4, 1, 2]  # their experts' places in the stack, out of order


def _stack(fmt: str, n: int, k: int, device: str, seed: int):
    """(stack the kernel reads, float64 weights (n, k), Q4_1's |d q| + |m| or None)."""
    if fmt in ("f16", "f32"):
        w = torch.randn((n, k), generator=torch.Generator().manual_seed(seed)).to(device)
        w = w.half() if fmt == "f16" else w
        return w, w.double(), None
    q = random_q(n, k, fmt, device, seed=seed)
    return pack(q, device), ref_dequant(q.data, fmt), ref_magnitude(q.data, fmt)


def _groups(counts, T: int, device: str, seed: int):
    """starts (G + 1,) numpy and tokens (P,): random tokens of T for each pair."""
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    g = torch.Generator().manual_seed(seed)
    return starts, torch.randint(0, T, (int(starts[-1]),), generator=g).to(device)


def _check_groups(y, x, tok, w64, mag, ids, starts, out, dtype) -> None:
    u_w = 0.0 if dtype == torch.float32 else U_W[dtype]
    for e, a, b in zip(ids, starts[:-1], starts[1:]):
        if a == b:
            continue
        rows = slice(e * out, (e + 1) * out)
        xe = x[a:b] if tok is None else x[tok[a:b]]
        check(y[a:b], xe, w64[rows], None, U_OUT[dtype], u_w, mag=None if mag is None else mag[rows])


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "f16", "f32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_equals_float64(fmt, dtype, monkeypatch):
    """The kernel (interpreter on the CPU) over uneven groups, tokens gathered or not; k not a multiple of BLOCK_K
    (a masked step), out not a multiple of BLOCK_N."""
    need_kernels()
    monkeypatch.setattr(grouped, "_on_kernels", lambda t: True)
    out, k, T = 24, 96, 10
    w, w64, mag = _stack(fmt, 5 * out, k, DEVICE, seed=3)
    starts, tok = _groups(COUNTS, T, DEVICE, seed=4)
    tiles = grouped.tile_table(np.array(IDS), starts, 16, DEVICE)
    x = torch.randn((T, k), generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    y = grouped.grouped_linear(x, w, out, IDS, starts, tok, tiles=tiles, config=(16, 64, 4))
    assert y.shape == (starts[-1], out) and y.dtype == dtype
    _check_groups(y, x, tok, w64, mag, IDS, starts, out, dtype)
    xp = x[tok]  # (P, k): the pairs' rows themselves (the down projection's form), tiles of 128 pairs
    y2 = grouped.grouped_linear(xp, w, out, IDS, starts, tiles=grouped.tile_table(np.array(IDS), starts, 128, DEVICE),
                                config=(32, 32, 4))
    _check_groups(y2, xp, None, w64, mag, IDS, starts, out, dtype)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "f32", "q4_k"])
def test_reference_path_equals_float64(fmt):
    """Off the kernels (the CPU; K-quant stacks anywhere) grouped_linear de-quantizes each group's rows by torch."""
    out, k, T = 8, 512, 6  # two K-quant blocks a row
    if fmt == "q4_k":
        from blocks import valid_blocks
        from hotneurons.weights.quants import dequantize

        blocks = valid_blocks(np.random.default_rng(7), WeightFormat.Q4_K, 5 * out * 2, scale=1.0)
        data = torch.from_numpy(blocks.reshape(5 * out, -1))  # (rows, 2 blocks)
        w = pack(QTensor(data, fmt, (5 * out, k)), "cpu")
        assert w.kquant and not grouped.kernel_reads(w)
        w64, mag = dequantize(data, fmt, k).double(), None
    else:
        w, w64, mag = _stack(fmt, 5 * out, k, "cpu", seed=8)
    starts, tok = _groups(COUNTS, T, "cpu", seed=9)
    x = torch.randn(T, k, generator=torch.Generator().manual_seed(10))
    y = grouped.grouped_linear(x, w, out, np.array(IDS), starts, tok)
    _check_groups(y, x, tok, w64, mag, IDS, starts, out, torch.float32)


def test_tile_table_covers_each_pair_once():
    starts = np.array([0, 0, 1, 20, 25, 27, 91])
    ids = np.array([5, 0, 4, 1, 2, 3])
    t = grouped.tile_table(ids, starts, 16, "cpu").table.numpy()
    assert t.dtype == np.int32 and ((t[:, 2] - t[:, 1] >= 1) & (t[:, 2] - t[:, 1] <= 16)).all()
    covered = np.concatenate([np.arange(a, b) for _, a, b in t])
    assert np.array_equal(np.sort(covered), np.arange(91))
    for e, a, b in t:  # each tile within its group, with the group's expert
        g = np.searchsorted(starts, a, side="right") - 1
        assert e == ids[g] and b <= starts[g + 1]
    assert [grouped.block_m_for(np.array(s)) for s in ([0, 10, 20], [0, 0, 1, 20, 91], [0, 40, 80], [0, 200])] \
        == [16, 16, 64, 128]


def test_shape_errors():
    w = torch.zeros(4 * 8, 32)
    x = torch.zeros(3, 32)
    tok = torch.zeros(3, dtype=torch.long)
    for args in [(torch.zeros(3, 16), w, 8, [0, 1], [0, 1, 3], tok),  # x's width
                 (x, w, 8, [0, 4], [0, 1, 3], tok),  # an id past the stack
                 (x, w, 8, [0, 1], [0, 3], tok),  # starts not G + 1
                 (x, w, 8, [0, 1], [0, 2, 1], tok[:1]),  # starts decreasing
                 (x, w, 5, [0], [0, 3], tok),  # out_rows not dividing the stack
                 (x, w, 8, [0], [0, 3], tok[:2])]:  # tokens not starts[-1]
        with pytest.raises(ValueError, match="^grouped_linear: .* do not fit: expected") as e:
            grouped.grouped_linear(*args)
        assert "\n" not in str(e.value)


def _spy(monkeypatch) -> list:
    calls = []
    real = grouped.grouped_linear
    monkeypatch.setattr(grouped, "grouped_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("family", ["qwen3-moe", "qwen2-moe"])
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "f32"])
@pytest.mark.parametrize("where", ["gpu", "mixed"])
def test_hybrid_moe_prefill_grouped(family, fmt, where, monkeypatch):
    """HybridMoE's prefill with the grouped kernel (the device's stacks packed as on CUDA, the kernel in the
    interpreter): three launches, equal to today's per-expert path and to the reference; decode untouched."""
    need_kernels()
    cfg = _cfg(family)
    w = _weights(cfg, fmt, seed=11)
    ffn = HybridMoE(0, cfg, w.get, _masks()[where])
    x = _x(17, seed=12)
    loop = ffn(x)  # today's path: a CPU run's stacks are the file's rows
    assert not ffn._grouped_applies(x)
    monkeypatch.setattr(moe_ffn, "GROUPED_DEVICES", ("cpu",))
    monkeypatch.setattr(grouped, "_on_kernels", lambda t: True)
    ffn.stacks = {k: pack(ffn.stacks[k], "cpu") for k in PROJ}  # as CUDA's: GpuQs (floats stay tensors)
    calls = _spy(monkeypatch)
    got = ffn(x)
    assert calls == [1, 1, 1]
    _close(got, loop)
    _close(got, moe.moe_ffn(w.get, cfg, 0)(x))
    calls.clear()
    _close(ffn(x[:1]), moe.moe_ffn(w.get, cfg, 0)(x[:1]))  # decode: the GEMV's path, not grouped
    assert calls == []


def test_hybrid_moe_prefill_grouped_reference_path(monkeypatch):
    """Off the kernels grouped_linear's torch path serves the same call (float experts: the CPU run's stacks)."""
    cfg = _cfg("mixtral")
    w = _weights(cfg, "f16", seed=13)
    ffn = HybridMoE(0, cfg, w.get, _masks()["mixed"])
    x = _x(12, seed=14)
    loop = ffn(x)
    monkeypatch.setattr(moe_ffn, "GROUPED_DEVICES", ("cpu",))
    calls = _spy(monkeypatch)
    _close(ffn(x), loop)
    assert calls == [1, 1, 1]


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_cold_experts_on_the_device_grouped(fmt, monkeypatch):
    """A long prefill's cold experts (runtime/moe_prefill.py) through the grouped kernel (interpreter): their rows
    copied run by run and packed, three launches, equal to the CPU kernel's path and the reference."""
    import dataclasses

    from hotneurons.common.kinds import Activation
    from hotneurons.runtime import moe_prefill
    from test_cold_experts_sparse import GPU, _moe_weights, _tokens
    from test_cold_experts_sparse import _cfg as sparse_cfg

    need_kernels()
    xs = _tokens(np.random.default_rng(41), 12)
    cfg = dataclasses.replace(sparse_cfg(Activation.SWIGLU), act_fn="silu")
    w = _moe_weights(fmt, xs, seed=42)
    ffn = HybridMoE(0, cfg, w.get, GPU, "cpu", torch.float32)
    x = torch.from_numpy(xs)
    cpu_path = ffn(x)
    monkeypatch.setattr(moe_prefill, "DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(moe_prefill, "OFFLOAD_TOKENS", 4)
    monkeypatch.setattr(grouped, "_on_kernels", lambda t: True)
    calls = _spy(monkeypatch)
    got = ffn(x)
    assert calls == [1, 1, 1]  # the GPU experts of a CPU run: today's path; the cold ones: grouped
    tol = dict(rtol=1e-4, atol=2e-5 * float(cpu_path.abs().max()))
    torch.testing.assert_close(got, cpu_path, **tol)
    torch.testing.assert_close(got, moe.moe_ffn(w.get, cfg, 0)(x), **tol)


def test_bench_smoke(tmp_path):
    """bench/moe_prefill_kernel.py on the CPU at tiny sizes: both paths timed, equal, the record written."""
    from bench import moe_prefill_kernel

    out = tmp_path / "r.json"
    moe_prefill_kernel.main(["--experts", "8", "--n-ff", "64", "--d-model", "64", "--top-k", "2", "--tokens", "12",
                             "--reps", "2", "--dtype", "float32", "--out", str(out)])
    f = json.loads(out.read_text())["figures"]
    assert f["shape"]["experts"] == 8 and f["loop_ms"] > 0 and f["grouped_ms"] > 0
    assert f["max_rel_diff"] < 1e-4 and f["grouped_tflops"] > 0


# ---------------------------------------------------------------------------------------------------------------
# CUDA: compiled, Qwen3-30B-A3B's shapes (d 2048, n_ff 768)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "f16"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("proj", ["gate", "down"])
def test_kernel_cuda_qwen3_shapes(fmt, dtype, proj):
    out, k = (768, 2048) if proj == "gate" else (2048, 768)
    E, T = 16, 512
    w, w64, mag = _stack(fmt, E * out, k, "cuda", seed=21)
    rng = np.random.default_rng(22)
    counts = rng.integers(0, 90, E)
    counts[:3] = (0, 1, 130)  # none, one, more than any BLOCK_M
    ids = rng.permutation(E)
    starts, tok = _groups(counts, T, "cuda", seed=23)
    x = torch.randn((T, k), device="cuda").to(dtype)
    y = grouped.grouped_linear(x, w, out, ids, starts, tok)
    _check_groups(y, x, tok, w64, mag, ids, starts, out, dtype)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("where", ["gpu", "mixed"])
def test_hybrid_moe_cuda_grouped_equals_loop(fmt, where, monkeypatch):
    """On CUDA (fp16), the grouped prefill against the per-expert loop (GROUPED_DEVICES emptied) and the reference."""
    cfg = _cfg("qwen3-moe")
    w = _weights(cfg, fmt, seed=24)
    ffn = HybridMoE(0, cfg, w.get, _masks()[where], "cuda", torch.float16)
    x = _x(40, seed=25).cuda().half()
    calls = _spy(monkeypatch)
    got = ffn(x).float()
    assert calls == [1, 1, 1]
    monkeypatch.setattr(moe_ffn, "GROUPED_DEVICES", ())
    loop = ffn(x).float()
    ref = moe.moe_ffn(w.get, cfg, 0)(x.float().cpu())
    tol = dict(rtol=1e-2, atol=1e-2 * float(ref.abs().max()))  # fp16 weights and activations on both device paths
    torch.testing.assert_close(got, loop, **tol)
    torch.testing.assert_close(got.cpu(), ref, **tol)
