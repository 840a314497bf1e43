"""llama.cpp's merge loop over a word's symbols, which its BPE (pairs ranked by the merges) and SentencePiece (pairs
ranked by their join's score) tokenizers share (src/llama-vocab.cpp llm_tokenizer_bpe_session and
llm_tokenizer_spm_session)."""

from __future__ import annotations

import heapq
from typing import Callable


def merge(sym: list[str], key: Callable[[str, str], float | None]) -> list[str]:
    """llama.cpp's merge loop, BPE's and SentencePiece's alike: of the adjacent pairs with a key, the smallest joins
    first, the leftmost among equals, and the pairs it makes are queued; a queued pair whose sides changed since is
    skipped. Returns the symbols left."""
    nxt = list(range(1, len(sym))) + [-1]
    prv = list(range(-1, len(sym) - 1))
    queue: list[tuple[float, int, int, str]] = []

    def pair(a: int, b: int) -> None:
        if a >= 0 and b >= 0 and (k := key(sym[a], sym[b])) is not None:
            heapq.heappush(queue, (k, a, b, sym[a] + sym[b]))

    for i in range(len(sym) - 1):
        pair(i, i + 1)
    while queue:
        _, a, b, joined = heapq.heappop(queue)
        if not sym[a] or not sym[b] or sym[a] + sym[b] != joined:
            continue
        sym[a], sym[b] = joined, ""
        nxt[a] = nxt[b]
        if nxt[b] >= 0:
            prv[nxt[b]] = a
        pair(prv[a], a)
        pair(a, nxt[a])
    return [s for s in sym if s]
