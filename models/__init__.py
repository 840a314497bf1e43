"""Model definitions, one per family: each owns its weights and its static KV cache, fed tensor by tensor from a
weight source (hotneurons.weights). The engine (hotneurons.runtime) runs them; transformers is only their reference.

The engine's contract (models/common.Decoder): embed(tokens, pos0) -> h; per layer attention(i, h, pos0) -> (h2, x),
the engine's FFN y = ffn(i, x), after_ffn(i, h2, y) -> h; then logits(h). The FFN weights are not the model's."""

from __future__ import annotations

from collections.abc import Callable

import torch
from hotneurons.models.common import Decoder, Loader, WeightFn, _linear, ffn_values, gate_values
from hotneurons.models.config import ModelConfig, Rope
from hotneurons.models.falcon import Falcon
from hotneurons.models.llama import Llama
from hotneurons.models.moe import moe_ffn
from hotneurons.models.opt import OPT
from hotneurons.weights.names import layer_name

# moe: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, whose attention is LLaMA's (their FFN: models/moe.py)
MODELS: dict[str, type[Decoder]] = {"llama": Llama, "gemma": Llama, "opt": OPT, "falcon": Falcon, "moe": Llama}

__all__ = ["MODELS", "Decoder", "Falcon", "Llama", "ModelConfig", "OPT", "Rope", "build_model", "dense_ffn",
           "ffn_values", "gate_values", "moe_ffn"]


def build_model(cfg: ModelConfig, weights: WeightFn, device: torch.device | str, dtype: torch.dtype, ctx: int,
                release: Callable[[str], None] | None = None, layers: bool = True) -> Decoder:
    """The model of cfg's family, its non-FFN weights pulled from `weights` by canonical name (each `release`d after)
    and a KV cache of `ctx` tokens allocated on `device`.

    layers=False: a lazy model, for models bigger than the device: only embeddings, final norm and head now (and a
    cache of one layer); `weights` is kept, and decoder.load_layer(i) / drop_layer(i) bring in and free one layer's
    attention at a time."""
    if cfg.family not in MODELS:
        raise ValueError(f"no model definition for family '{cfg.family}': the definitions are {', '.join(MODELS)}")
    return MODELS[cfg.family](cfg, weights, device, dtype, ctx, release, layers)


def dense_ffn(weights: WeightFn, cfg: ModelConfig, i: int, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32, release: Callable[[str], None] | None = None
              ) -> Callable[[torch.Tensor], torch.Tensor]:
    """Layer i's whole FFN from its canonical ffn_* weights (float or QTensor): x (T, d) -> y (T, d). A mixture of
    experts' is models/moe.moe_ffn (every neuron of each token's chosen experts)."""
    if cfg.moe:
        return moe_ffn(weights, cfg, i, device, dtype, release)
    load = Loader(weights, device, dtype, release)
    p = layer_name(i, "ffn_")
    up, down = load.matrix(p + "up.weight"), load.matrix(p + "down.weight")
    gate = load.matrix(p + "gate.weight") if cfg.gated else None
    b_up, b_down = (load.tensor(p + "up.bias"), load.tensor(p + "down.bias")) if cfg.ffn_bias else (None, None)
    b_gate = load.tensor(p + "gate.bias") if cfg.ffn_bias and cfg.gated else None

    def ffn(x: torch.Tensor) -> torch.Tensor:
        g = _linear(x, gate, b_gate) if gate is not None else None  # (T, n)
        return _linear(ffn_values(cfg, _linear(x, up, b_up), g), down, b_down)  # (T, d)

    return ffn
