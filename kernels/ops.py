"""The decode step's device ops as torch functions (the reference), and `Ops`, the one dispatch between them, their
torch.compile twins and kernels/fused.py's Triton kernels (same arguments, same roundings).

The FFN's torch twin of the Numba kernels (`ffn_rows_torch`: hot rows, dense prefill, oracle masks) is here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from hotneurons.common.kinds import GpuOps, choose
from hotneurons.kernels.cold import ACT_CODE, GATED

RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")  # weight * x / rms(x), HF's form


# ---------------------------------------------------------------------------------------------------------------
# FFN rows


def act_torch(activation: str, a: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
    """Neuron values h from pre-activations: ungated a = up.x + b; gated a = gate.x, u = up.x."""
    if activation == "relu":
        return torch.relu(a)
    if activation == "gelu":
        return F.gelu(a)
    if activation == "reglu":
        return torch.relu(a) * u
    if activation == "drelu":
        return torch.relu(a) * torch.relu(u)
    if activation == "swiglu":
        return F.silu(a) * u
    if activation == "geglu":
        return F.gelu(a, approximate="tanh") * u
    raise ValueError(f"unknown activation '{activation}': choose one of {', '.join(ACT_CODE)}")


def gate_act(activation: str, g: torch.Tensor) -> torch.Tensor:
    """A gated activation's gate factor act(g): h = act(g) * up (drelu: * relu(up))."""
    if activation in ("reglu", "drelu"):
        return torch.relu(g)
    if activation == "swiglu":
        return F.silu(g)
    if activation == "geglu":
        return F.gelu(g, approximate="tanh")
    raise ValueError(f"activation '{activation}' has no gate: gated sparsity needs one of reglu, drelu, swiglu, geglu")


def gated_values(activation: str, g: torch.Tensor, u: torch.Tensor, taus: tuple[float, float]) -> torch.Tensor:
    """Neuron values h of gate and up pre-activations (tokens, n), zero where a neuron does not pass (common/gating.py:
    |act(g)| > tau_g and |h| > tau_h, compared in float32 as the kernels compare)."""
    a = gate_act(activation, g)
    h = a * (torch.relu(u) if activation == "drelu" else u)
    keep = (a.float().abs() > taus[0]) & (h.float().abs() > taus[1])  # (tokens, n)
    return h * keep.to(h.dtype)


def neuron_values(activation: str, x: torch.Tensor, gate: torch.Tensor | None, up: torch.Tensor,
                  b_up: torch.Tensor | None, taus: tuple[float, float] | None = None) -> torch.Tensor:
    """(tokens, d) x and (n, d) rows -> (tokens, n) neuron values h; with `taus` (tau_g, tau_h) of a gated FFN, zero
    where a neuron does not pass them (gated_values)."""
    if activation in GATED:
        g, u = F.linear(x, gate), F.linear(x, up)
        return act_torch(activation, g, u) if taus is None else gated_values(activation, g, u, taus)
    return act_torch(activation, F.linear(x, up, b_up))


def ffn_rows_torch(activation: str, x: torch.Tensor, gate: torch.Tensor | None, up: torch.Tensor,
                   b_up: torch.Tensor | None, down_t: torch.Tensor,
                   taus: tuple[float, float] | None = None) -> torch.Tensor:
    """Torch twin of the Numba cold kernels (runtime/cold_rows.ffn_rows) over all given rows: (tokens, d) ->
    (tokens, d), in x's dtype and device; `taus`: only the neurons that pass them (neuron_values)."""
    return neuron_values(activation, x, gate, up, b_up, taus) @ down_t  # (tokens, n) @ (n, d)


# ---------------------------------------------------------------------------------------------------------------
# A decode step's ops (the static decoder's; `predict` also the hybrid FFN's)


def predict(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, threshold: torch.Tensor, fired: torch.Tensor,
            m_dev: torch.Tensor | None, m_host: torch.Tensor | None, n_cold: int) -> None:
    """The predictor on one token and its decision. x (d,), fc1 (hidden, d), fc2 (rows, hidden), all in the model
    dtype: logits = fc2 relu(fc1 x), each rounded to that dtype as nn.Linear rounds; a row fires where its logit >=
    threshold (float32 (1,), rounded to the logits' dtype, as Predictor.mask compares). fired (rows,) int32 += the
    decisions; the first n_cold rows' decisions (HybridFFN orders fc2's rows cold neurons first), where given, into
    m_dev (n_cold,) bool and into m_host packed as bits, bit b of byte i = row 8 i + b (uint8, at least
    ceil(n_cold / 8) bytes: the first ceil(n_cold / 8) written, the bits past n_cold zero, the bytes after left
    alone; cold.bit_indices reads them). fc1 and fc2 may be blocks (a QTensor or qlinear.GpuQ: --predictor-dtype
    q8_0). fused.predict is its Triton twin."""
    if isinstance(fc1, torch.Tensor):
        logits = F.linear(torch.relu(F.linear(x, fc1)), fc2)  # (rows,)
    else:  # blocks (--predictor-dtype q8_0): qlinear's GEMVs, rounded to x's dtype as nn.Linear rounds
        from hotneurons.kernels import qlinear

        logits = qlinear.linear(torch.relu(qlinear.linear(x[None], fc1)), fc2)[0]  # (rows,)
    full = logits >= threshold.to(logits.dtype)  # (rows,) bool
    fired += full
    if m_dev is not None:
        m_dev.copy_(full[:n_cold])
    if m_host is not None:
        nb = -(-n_cold // 8)  # bytes of bits
        bits = F.pad(full[:n_cold].to(torch.uint8), (0, 8 * nb - n_cold)).view(nb, 8)  # (nb, 8) 0 or 1, zero padded
        # disjoint bits: their sum is their or
        torch.sum(bits << torch.arange(8, dtype=torch.uint8, device=bits.device), 1, dtype=torch.uint8,
                  out=m_host[:nb])


def weighted_rms(h: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """LLaMA's RMSNorm, w * (h / rms(h) in float32, rounded to h's dtype), in two kernels: torch's fused rms_norm
    computes in float32 and rounds once, as HF's module does after its casts."""
    return torch.mul(w, F.rms_norm(h, (h.shape[-1],), eps=eps), out=out)


def residual_norm(h2_prev: torch.Tensor, hot_prev: torch.Tensor, cold: torch.Tensor | None, w: torch.Tensor,
                  eps: float, out: torch.Tensor) -> torch.Tensor:
    """A layer's input into out: the previous layer's h2 + its hot sum (+ the CPU's float32 cold sum, read where it
    is); returns its RMSNorm (weighted_rms)."""
    torch.add(h2_prev, hot_prev, out=out)
    if cold is not None:
        out.add_(cold)
    return weighted_rms(out, w, eps)


def rms_eps(norm) -> float | None:
    """The epsilon of a LLaMA-form RMSNorm module (weight * x / rms(x)); None for other norms."""
    return getattr(norm, "variance_epsilon", None) if type(norm).__name__ in RMS_NORMS else None


def rms_norm(norm, h: torch.Tensor, out: torch.Tensor | None = None, weighted=weighted_rms) -> torch.Tensor:
    """`norm`(h): LLaMA-form RMSNorms through weighted_rms (or `weighted`, an Ops twin of it); others as they are."""
    eps = rms_eps(norm)
    if eps is None:
        y = norm(h)
        return y if out is None else out.copy_(y)
    return weighted(h, norm.weight, eps, out)


def _rope(t: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """HF's `t * cos + rotate_half(t) * sin` in three kernels instead of six: rotate_half(t) = cat(-b, a) for
    t = cat(a, b), so rotate_half(t) * sin = roll(t) * sin_signed, sin_signed = cat(-sin[:half], sin[half:]) (exact:
    only signs move)."""
    return torch.addcmul(t * cos, t.roll(t.shape[-1] // 2, -1), sin_signed)


def rope_cache(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """One RoPE for the q and k heads, qk (1, heads + kv, 1, hd) (q comes out scaled where cos and sin are); k and
    v (1, kv, 1, hd) written into the caches (1, kv, slots, hd) at pos (1,); returns q (1, heads, 1, hd)."""
    H = qk.shape[1] - k_cache.shape[1]
    qk = _rope(qk, cos, sin_signed)
    k_cache.index_copy_(2, pos, qk[:, H:])
    v_cache.index_copy_(2, pos, v)
    return qk[:, :H]


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
           pos: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of a few queries over the cache as two batched matmuls and a softmax (float32 inside, rounded once,
    as HF's eager attention). For one decode token this beats SDPA's fused kernels, which on CUDA split the work only
    over batch x heads (8 blocks for 8 kv heads). q (1, kv, G, hd), already scaled; keys, values (1, kv, slots, hd);
    mask (1, 1, 1, slots) additive (0 or -inf) or None -> (1, kv, G, hd). pos, the query's position, says what the
    mask says (the slots up to it are open); this op reads the mask, fused.attend reads pos."""
    s = torch.matmul(q, keys.transpose(-1, -2))  # (1, kv, G, slots)
    if mask is not None:
        s = s + mask
    return torch.matmul(torch.softmax(s, dim=-1), values)  # half/bf16 softmax: float32 inside, one rounding


def add_linear(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """h += linear(x, w, b) for one token, into h's memory: without a bias one GEMM that adds into h (beta = 1)."""
    h2 = h.view(1, -1)  # (1, rows)
    if b is None:
        h2.addmm_(x.view(1, -1), w.t())
    else:
        h2.add_(F.linear(x.view(1, -1), w, b))


@dataclass(frozen=True)
class Ops:
    """The ops of a decode step's graphs, as functions of tensors, by name (common/kinds.GpuOps): "torch" (the
    reference, and what the CPU runs); "compile", the small ops through torch.compile, where Inductor fuses each
    into one or a few kernels (the GEMVs stay cuBLAS; docs/history.md); "triton", the hand-written kernels of
    kernels/fused.py, GEMVs included (one or two kernels each)."""

    residual_norm: Callable = residual_norm
    weighted_rms: Callable = weighted_rms
    rope_cache: Callable = rope_cache
    attend: Callable = attend
    predict: Callable = predict
    linear: Callable = F.linear
    add_linear: Callable = add_linear

    @classmethod
    def named(cls, name: str) -> Ops:
        name = choose(name, GpuOps, "ops")
        if name == "torch":
            return cls()
        if name == "compile":
            return cls(*(torch.compile(f) for f in (residual_norm, weighted_rms, rope_cache, attend, predict)))
        from hotneurons.kernels import fused  # triton

        return cls(fused.residual_norm, fused.weighted_rms, fused.rope_cache, fused.attend, fused.predict,
                   fused.linear, fused.add_linear)


def default_ops(device: torch.device) -> str:
    """"triton" on CUDA where Triton imports (it comes with torch's CUDA builds), else "torch"."""
    if device.type != "cuda":
        return "torch"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "torch"
    return "triton"


# a mixture of experts' router (models/moe.route; kernels/route.py's kernel computes the same for one token)
def top_k(logits: torch.Tensor, k: int, norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (T, E) -> (weights (T, k) in the logits' dtype, expert ids (T, k) long), as transformers routes
    Mixtral, Qwen2/3-MoE and OLMoE: softmax over all experts in float32 (float64 stays float64), the top k of those
    probabilities, renormalised to sum 1 where norm_topk, cast to the logits' dtype (models/moe.route)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))  # (T, E)
    top, ids = torch.topk(probs, k, dim=-1)  # (T, k) each
    if norm_topk:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), ids
