"""Answer agreement: greedy chat answers with the FFN masked against the dense model's, on a fixed prompt set.

Perplexity averages over every token of running text; a chat answer can change at one token and then go elsewhere. So
each prompt (a short factual or reasoning question, in the model's chat template) is answered greedily, `new_tokens`
tokens, dense and with masking hooks active, and two figures are reported: the share of prompts whose answer is the
dense one token for token, and the mean share of the dense answer's tokens matched before the first divergence. An
answer ends at its first end-of-sequence token (kept, so stopping early is a divergence).

The prompts run as one left-padded batch through transformers' `generate` (a LoadedModel: the hooks of common/ffn.py
see every step), dense and masked alike, so both answers of a prompt come from the same batched arithmetic.
The shipped set: bench/data/gated_prompts.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from hotneurons.common.artifacts import ArtifactError

PROMPTS = Path(__file__).resolve().parents[1] / "bench" / "data" / "gated_prompts.json"


def load_prompts(path: str | Path) -> list[str]:
    """A JSON file: a list of prompt strings, or an object whose "prompts" is one; refused in one line otherwise."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ArtifactError(f"cannot read prompts from {path} ({type(e).__name__}): give a JSON list of prompt "
                            f"strings, e.g. {PROMPTS}", params="answers") from None
    prompts = data.get("prompts") if isinstance(data, dict) else data
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise ArtifactError(f"{path} holds no list of prompt strings: give one (a list, or {{\"prompts\": [...]}}), "
                            f"e.g. {PROMPTS}", params="answers")
    return prompts


@torch.inference_mode()
def greedy_answers(lm, prompts: list[str], new_tokens: int = 32) -> list[list[int]]:
    """Each prompt as a user turn of the chat template, answered greedily (whatever hooks are active): the answers'
    token ids, each cut after its first end-of-sequence token."""
    tok = lm.tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             if tok.chat_template else p for p in prompts]
    side, pad = tok.padding_side, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    tok.padding_side = "left"  # every prompt ends where its answer starts
    try:
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(lm.model.device)
    finally:
        tok.padding_side = side
    out = lm.model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad,
                            temperature=None, top_p=None, top_k=None)  # (prompts, prompt + new)
    eos = tok.eos_token_id
    answers = []
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        answers.append(row[:row.index(eos) + 1] if eos in row else row)
    return answers


def agreement(dense: list[list[int]], masked: list[list[int]]) -> tuple[float, float]:
    """(share of prompts answered identically, mean share of the dense answer's tokens before the first divergence)."""
    same, prefix = 0, 0.0
    for d, m in zip(dense, masked):
        same += d == m
        k = next((j for j, (x, y) in enumerate(zip(d, m)) if x != y), min(len(d), len(m)))
        prefix += k / max(1, len(d))
    return same / len(dense), prefix / len(dense)
