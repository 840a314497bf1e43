"""`Sampling` settings and `sample`: one token id from a decode step's logits.

Sampling runs where the logits are (the GPU after a CUDA decode step): the vocabulary's softmax, top-k and top-p
there, and one draw by the inverse of the cumulative distribution, whose one uniform number comes from the caller's
CPU generator. Only the chosen id crosses to the host; the same seed draws the same uniform on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    repetition_penalty: float = 1.0  # 1: off (HF rule: positive logits divided, negative multiplied)
    seed: int = 0


def sample(logits: torch.Tensor, history: list[int], s: Sampling, gen: torch.Generator) -> int:
    """One token id from (vocab,) logits (left unchanged), on their device; `gen` is a CPU generator."""
    if s.temperature <= 0 and s.repetition_penalty == 1.0:  # greedy: the argmax where the logits are (first of ties)
        return int(torch.argmax(logits.detach()))
    logits = logits.detach().float().clone()  # (vocab,) float32, on the logits' device
    if s.repetition_penalty != 1.0 and history:
        ids = torch.tensor(sorted(set(history)), device=logits.device)
        seen = logits[ids]
        logits[ids] = torch.where(seen > 0, seen / s.repetition_penalty, seen * s.repetition_penalty)
    if s.temperature <= 0:
        return int(torch.argmax(logits))
    logits = logits / s.temperature
    if s.top_k > 0:
        kth = torch.topk(logits, min(s.top_k, logits.numel())).values[-1]
        logits[logits < kth] = -float("inf")
    if s.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, -1) >= s.top_p  # keep the smallest prefix reaching top_p
        logits[order[drop]] = -float("inf")
    return draw(torch.softmax(logits, -1), gen)


def draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    """An index of probs (n,) (summing to ~1, on any device) drawn with probability probs[i]: the first i whose
    cumulative sum exceeds u * total, u uniform in [0, 1) from `gen` (float64 sums: a zero-probability entry adds
    nothing to the sum, so it can never be the first to exceed it)."""
    cdf = probs.cumsum(0, dtype=torch.float64)  # (n,)
    u = torch.rand((), generator=gen, dtype=torch.float64)
    i = torch.searchsorted(cdf, (u * cdf[-1]).to(cdf.device)[None], right=True)  # (1,)
    return min(int(i), probs.numel() - 1)  # u * total rounds below total; the clamp guards the last ulp
