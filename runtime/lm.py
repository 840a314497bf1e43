"""`DecodeModel`: what a runtime's model (`Runtime.lm`) provides, whichever decoder holds it. generate.py's decode
loop, pi-generate and pi-serve read a model through this only, never by asking which class it is.

Two classes provide it:
- runtime/engine.SourceModel: our decoder (models/) reading a GGUF or safetensors file in place; its KV cache is
  static, sized at load (--ctx), and prefill and steps write it (engine.forward);
- models/family.LoadedModel: a transformers causal LM (hub ids, layer-split, --hf-decode); its KV cache is
  transformers', kept on the object between `prefill` and the `step`s that extend it.
The static decoders (runtime/graph_steps.py: StaticDecoder over a LoadedModel, SourceSteps over our decoder) replace
`step` where they apply; their `load_prefill` takes over what `prefill` left.
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any, Protocol

import torch


class DecodeModel(Protocol):
    """A model as the runtime decodes with it: batch 1, one sequence at a time."""

    tokenizer: Any  # text <-> ids (transformers' tokenizer, or a GGUF file's own)
    info: dict[str, Any]  # the "model" section of every stage's meta.json (n_layers, n_neurons, ...)

    @property
    def layers(self) -> Sized:
        """One entry per decoder layer (len() is the depth)."""

    @property
    def vocab(self) -> int:
        """Token ids the model embeds (the ids a request may name)."""

    @property
    def eos(self) -> set[int]:
        """Token ids that end a generation."""

    @property
    def ctx(self) -> int:
        """Tokens a sequence may hold, prompt and generated together."""

    @property
    def static_ctx(self) -> int | None:
        """Tokens of the model's own static KV cache (sized by --ctx); None where the cache grows as it is filled."""

    def prefill(self, rt: Any, ids: list[int]) -> torch.Tensor:
        """Start a sequence: `ids` at positions 0... through `rt`'s layers (runtime/generate.Runtime), the KV cache
        filled; -> (vocab,) float logits of the last id."""

    def step(self, rt: Any, token: int, pos: int) -> torch.Tensor:
        """Extend the sequence by `token` at position `pos` (the count of tokens before it); -> (vocab,) logits."""
