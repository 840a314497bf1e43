"""The pre-FFN norm: where the residual stream enters a layer's FFN block.

PowerInfer's predictors read the residual stream *before* the FFN's RMSNorm (`ffn_inp` in its llama.cpp), ours of
the "normed" form read the FFN input after it. The two are tied by the norm itself:

    x_post = gamma * x_pre / r,    r = sqrt(mean(x_pre ** 2) + eps)    (per token, float32 inside, as HF computes)

so a predictor on x_post with fc1 is, up to the positive factor r, the same function as one on x_pre with
fc1 * gamma (ReLU, no biases: positively homogeneous). The profiler stores r beside each sample's x_post, from which
the "powerinfer" predictor form is trained; the evaluation and the runtime feed that form x_pre itself.

Only a pre-FFN RMSNorm with a weight has this form: LLaMA-family models (`post_attention_layernorm`) and Gemma
(`pre_feedforward_layernorm` where the layer has one, else `post_attention_layernorm`; its weight is stored as
gamma - 1). OPT and Falcon (a LayerNorm with a bias, or attention and FFN in parallel off one norm) have none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hotneurons.common.kinds import FixableError
from torch import nn

# the pre-FFN norm's name on a decoder layer, per adapter family, first present wins
NORM_NAMES = {"llama": ("post_attention_layernorm",),
              "gemma": ("pre_feedforward_layernorm", "post_attention_layernorm")}


class PreNormError(FixableError, ValueError):
    """A model without a pre-FFN RMSNorm asked for the pre-norm predictor form."""


@dataclass(frozen=True)
class FFNNorm:
    """One layer's pre-FFN RMSNorm: its module (whose input is x_pre), gamma's offset and eps."""

    module: nn.Module
    eps: float
    offset: float  # gamma = offset + weight: 0 (LLaMA), 1 (Gemma stores gamma - 1)

    def gamma(self) -> torch.Tensor:
        """(d,) float32: x_post = gamma * x_pre / r."""
        return self.offset + self.module.weight.detach().float()

    def divisor(self, x_pre: torch.Tensor) -> torch.Tensor:
        """(..., d) residual -> (...,) float32 r = sqrt(mean(x_pre ** 2) + eps), the norm's divisor as HF computes
        it (float32 whatever the model's dtype)."""
        return (x_pre.float().pow(2).mean(-1) + self.eps).sqrt()


def ffn_norm(family: str, layer: nn.Module) -> FFNNorm | None:
    """The decoder layer's pre-FFN RMSNorm, or None where the family has none of this form."""
    for name in NORM_NAMES.get(family, ()):
        mod = getattr(layer, name, None)
        if mod is None:
            continue
        eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
        weight = getattr(mod, "weight", None)
        if not type(mod).__name__.endswith("RMSNorm") or eps is None or weight is None or weight.dim() != 1:
            return None
        return FFNNorm(mod, float(eps), 1.0 if type(mod).__name__.startswith("Gemma") else 0.0)
    return None


def has_ffn_norm(family: str) -> bool:
    """Whether models of this adapter family have a pre-FFN RMSNorm (decided without the model)."""
    return family in NORM_NAMES


def refusal(family: str, model_type: str | None = None) -> PreNormError:
    kind = f"{family} ({model_type})" if model_type and model_type != family else family
    return PreNormError(f"the powerinfer predictor form reads the residual before a pre-FFN RMSNorm, which {kind} "
                        f"models do not have: use the normed form", params="form")


def ffn_norms(lm) -> list[FFNNorm]:
    """Every layer's pre-FFN RMSNorm of a LoadedModel; refused in one line for families without one."""
    norms = [ffn_norm(lm.adapter.name, layer) for layer in lm.layers]
    if any(n is None for n in norms):
        raise refusal(lm.adapter.name, lm.info.get("model_type"))
    return norms
