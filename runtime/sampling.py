"""`Sampling` settings and `sample`: one token id from a decode step's logits."""

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
    """One token id from (vocab,) logits (left unchanged)."""
    if s.temperature <= 0 and s.repetition_penalty == 1.0:  # greedy: the argmax where the logits are (first of ties)
        return int(torch.argmax(logits.detach()))
    logits = logits.detach().float().cpu().clone()
    if s.repetition_penalty != 1.0 and history:
        ids = torch.tensor(sorted(set(history)))
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
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
