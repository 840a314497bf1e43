"""A mixture of experts' routing for one decode token in one Triton kernel, and its torch twin (the reference).

After the router's logits GEMV, a decode step's routing is bookkeeping on k numbers: softmax, top-k, renormalise, the
casts, the copies of the weights and ids into the device buffers and into the pinned host buffers that the CPU's cold
experts read, the expert counts, the look-up of each routed expert in the device stacks. In torch that is some twenty
kernels a layer, each a couple of microseconds inside a CUDA graph even though each touches a few bytes; here it is
one launch (runtime/moe_ffn.HybridMoE.to_host picks it on CUDA, the twin elsewhere).

`route_step_torch` computes as models/moe.route does (softmax in float32 or wider, torch.topk, the weights rounded
once to the logits' dtype); `route_step` gives the same outputs up to the order of float32 sums (a few units of
float32 in the weights before their rounding to the dtype). Ties: the kernel takes equal probabilities in the order
of their expert ids, the lowest first; torch.topk leaves their order unspecified. All outputs are preallocated and
written in place, with no host sync, so that either can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
from hotneurons.kernels.ops import top_k

try:  # CPU-only torch builds come without Triton: the twin still runs, the kernel is only called on CUDA
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

MAX_EXPERTS = 512  # the kernel holds all logits in one block of one program
MAX_K = 16  # slots per token; the top-k is k passes of an argmax over the experts
BLOCK_D = 1024  # elements of x copied per loop step
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def route_step_torch(logits: torch.Tensor, x: torch.Tensor, k: int, norm_topk: bool, lut: torch.Tensor,
                     fired: torch.Tensor, route_w: torch.Tensor, route_ids: torch.Tensor, local: torch.Tensor,
                     w_gpu: torch.Tensor, x_host: torch.Tensor, ids_host: torch.Tensor, w_host: torch.Tensor) -> None:
    """logits (1, E), x (1, d) in the model dtype; lut (E,) long: expert id -> index in the device stacks, -1 for a
    cold expert. Writes route_w (k,) (the weights rounded to the logits' dtype), route_ids (k,) long, fired (E,) += 1
    at the routed experts, local (k,) long (the stack index, 0 for a cold slot), w_gpu (k,) (the weight, 0 for a
    cold slot), x_host (d,) float32, ids_host (k,) long, w_host (k,) float32 (route_w widened)."""
    w, ids = top_k(logits.reshape(1, -1), k, norm_topk)
    w, ids = w[0], ids[0]  # (k,) each
    route_w.copy_(w)
    route_ids.copy_(ids)
    fired.index_add_(0, ids, torch.ones_like(ids, dtype=fired.dtype))
    at = lut[ids]  # (k,) stack index, -1: cold
    local.copy_(at.clamp(min=0))
    w_gpu.copy_(torch.where(at >= 0, w, torch.zeros_like(w)))
    x_host.copy_(x.reshape(-1))
    ids_host.copy_(ids)
    w_host.copy_(w)


def fits(n_experts: int, k: int, dtype: torch.dtype) -> bool:
    """Whether route_step takes a layer of n_experts experts, k a token, logits in dtype (else: route_step_torch)."""
    return n_experts <= MAX_EXPERTS and 1 <= k <= min(n_experts, MAX_K) and dtype in DTYPES


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


@_jit
def _route_kernel(logits_ptr, x_ptr, sx, lut_ptr, fired_ptr, w_ptr, ids_ptr, local_ptr, wgpu_ptr, xh_ptr, idsh_ptr,
                  wh_ptr, E, d, K: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """One program: the softmax over E logits, the top K by K passes of an argmax (equal probabilities: the lowest
    expert id first), then every output, and x widened to float32 into the host buffer."""
    e = tl.arange(0, BLOCK_E)
    on = e < E
    z = tl.load(logits_ptr + e, mask=on, other=float("-inf")).to(tl.float32)  # (BLOCK_E,)
    p = tl.exp(z - tl.max(z, axis=0))
    p = tl.where(on, p, 0.0)
    p = p / tl.sum(p, axis=0)  # (BLOCK_E,) the probabilities, as torch's float32 softmax
    q = tl.where(on, p, -1.0)  # probabilities not taken yet; -1 below any
    slot = tl.arange(0, BLOCK_K)
    top = tl.zeros([BLOCK_K], dtype=tl.float32)  # (BLOCK_K,) the first K slots used
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(q, axis=0)
        i = tl.min(tl.where(q == best, e, BLOCK_E), axis=0)  # the lowest id of the largest
        i = tl.where(i < E, i, 0)  # NaN logits match nothing: expert 0, never out of bounds
        top = tl.where(slot == j, best, top)
        ids = tl.where(slot == j, i, ids)
        q = tl.where(e == i, -1.0, q)
    used = slot < K
    if NORM:
        top = top / tl.sum(tl.where(used, top, 0.0), axis=0)
    w = top.to(logits_ptr.dtype.element_ty).to(tl.float32)  # (BLOCK_K,) rounded once to the logits' dtype
    ids64 = ids.to(tl.int64)
    tl.store(w_ptr + slot, w.to(w_ptr.dtype.element_ty), mask=used)
    tl.store(ids_ptr + slot, ids64, mask=used)
    tl.store(idsh_ptr + slot, ids64, mask=used)
    tl.store(wh_ptr + slot, w, mask=used)
    # the K ids are distinct and this is the only program: a plain read-modify-write counts each once
    n = tl.load(fired_ptr + ids, mask=used, other=0)
    tl.store(fired_ptr + ids, n + 1, mask=used)
    at = tl.load(lut_ptr + ids, mask=used, other=-1)  # (BLOCK_K,) stack index, -1: cold
    tl.store(local_ptr + slot, tl.maximum(at, 0), mask=used)
    tl.store(wgpu_ptr + slot, tl.where(at >= 0, w, 0.0).to(wgpu_ptr.dtype.element_ty), mask=used)
    o = tl.arange(0, BLOCK_D)
    for s in range(0, d, BLOCK_D):
        m = s + o < d
        v = tl.load(x_ptr + (s + o).to(tl.int64) * sx, mask=m, other=0.0).to(tl.float32)
        tl.store(xh_ptr + s + o, v, mask=m)


def _pow2(n: int) -> int:
    return max(2, triton.next_power_of_2(n))  # two at least: no one-element blocks to reduce over


def route_step(logits: torch.Tensor, x: torch.Tensor, k: int, norm_topk: bool, lut: torch.Tensor,
               fired: torch.Tensor, route_w: torch.Tensor, route_ids: torch.Tensor, local: torch.Tensor,
               w_gpu: torch.Tensor, x_host: torch.Tensor, ids_host: torch.Tensor, w_host: torch.Tensor) -> None:
    """route_step_torch's outputs from one kernel launch (arguments as there). Checks shapes only: no sync."""
    if triton is None:
        raise RuntimeError("route_step needs Triton, which is not installed: call route_step_torch")
    E = logits.shape[-1]
    if logits.numel() != E:
        raise ValueError(f"route_step routes one token, got logits {tuple(logits.shape)}: call route_step_torch")
    if E > MAX_EXPERTS:
        raise ValueError(f"route_step takes at most {MAX_EXPERTS} experts, got {E}: fall back to route_step_torch")
    if not 1 <= k <= min(E, MAX_K):
        raise ValueError(f"route_step takes 1 to {min(E, MAX_K)} experts a token, got k={k}: fall back to "
                         f"route_step_torch")
    if logits.dtype not in DTYPES:
        raise ValueError(f"route_step computes logits in {DTYPES}, got {logits.dtype}: fall back to route_step_torch")
    xr = x.reshape(-1) if x.dim() == 1 else x[0]  # (d,) x's one row, strided as it is
    d = xr.shape[0]
    sizes = {"logits": (logits, E), "lut": (lut, E), "fired": (fired, E), "route_w": (route_w, k),
             "route_ids": (route_ids, k), "local": (local, k), "w_gpu": (w_gpu, k), "x_host": (x_host, d),
             "ids_host": (ids_host, k), "w_host": (w_host, k)}
    for name, (t, n) in sizes.items():
        if t.numel() != n or not t.is_contiguous():
            raise ValueError(f"route_step: {name} is {tuple(t.shape)} (contiguous: {t.is_contiguous()}), expected "
                             f"{n} contiguous elements: pass a contiguous buffer of that size")
    _route_kernel[(1,)](logits, xr, xr.stride(0), lut, fired, route_w, route_ids, local, w_gpu, x_host, ids_host,
                        w_host, E, d, K=k, NORM=bool(norm_topk), BLOCK_E=_pow2(E), BLOCK_K=_pow2(k),
                        BLOCK_D=min(BLOCK_D, _pow2(d)),
                        num_warps=4)
