"""The reference mixture-of-experts FFN (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), in gpt-fast's mixtral-moe style: each
projection's experts stacked in one tensor, as llama.cpp stores them (blk.N.ffn_{gate,up,down}_exps.weight), and each
token's top-k experts' weights gathered by index, so that one batched product computes them all.

Routing, as transformers computes it for these four families: router logits = x @ ffn_gate_inp.T in the model's
dtype; softmax over all experts in float32 (float64 stays float64); the top-k of those probabilities (softmax before
top-k); renormalised to sum 1 where cfg.norm_topk (Mixtral always, the others per norm_topk_prob); cast to the
model's dtype. A token's output is the sum of its k experts' gated FFNs (act(x W_gate) * (x W_up)) W_down, each times
its weight. Qwen2-MoE adds a shared expert every token runs, times sigmoid(x @ ffn_gate_inp_shexp.T) (one scalar gate
per token).

Gathering (T, k, n, d) weights costs T * k expert matrices of memory: cheap for a decode step (T = 1), so prefill
runs in chunks of tokens that keep each gathered projection under `GATHER_BYTES`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from hotneurons.kernels.ops import top_k
from hotneurons.models.common import Loader, WeightFn, _linear, ffn_values
from hotneurons.models.config import ModelConfig
from hotneurons.weights.names import layer_name

GATHER_BYTES = 256 << 20  # per gathered projection of a chunk of tokens


def route(cfg: ModelConfig, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (T, E) -> (weights (T, k) in the logits' dtype, expert indices (T, k) long)."""
    return top_k(logits, cfg.n_experts_used, cfg.norm_topk)


def _stacked(load: Loader, name: str, n_experts: int) -> torch.Tensor:
    """An experts tensor (E, out, in) as floats on the device (a quantized one comes as (E * out, in) rows)."""
    w = load.tensor(name)
    return w.reshape(n_experts, -1, w.shape[-1])


def moe_ffn(weights: WeightFn, cfg: ModelConfig, i: int, device: torch.device | str = "cpu",
            dtype: torch.dtype = torch.float32, release: Callable[[str], None] | None = None
            ) -> Callable[[torch.Tensor], torch.Tensor]:
    """Layer i's mixture of experts from its canonical weights (float or QTensor, de-quantized here): x (T, d) ->
    y (T, d), every neuron of each token's top-k experts computed."""
    if not cfg.moe:
        raise ValueError(f"{cfg.model_type} has no experts (n_experts 0): its FFN is hotneurons.models.dense_ffn")
    load = Loader(weights, device, dtype, release)
    p, E = layer_name(i, "ffn_"), cfg.n_experts
    router = load.tensor(p + "gate_inp.weight")  # (E, d)
    gate = _stacked(load, p + "gate_exps.weight", E)  # (E, n, d)
    up = _stacked(load, p + "up_exps.weight", E)  # (E, n, d)
    down = _stacked(load, p + "down_exps.weight", E)  # (E, d, n)
    shared = None
    if cfg.n_ff_shexp:
        shared = (load.tensor(p + "gate_shexp.weight"),  # (n_sh, d)
                  load.tensor(p + "up_shexp.weight"),  # (n_sh, d)
                  load.tensor(p + "down_shexp.weight"),  # (d, n_sh)
                  load.tensor(p + "gate_inp_shexp.weight"))  # (1, d)
    per_token = cfg.n_experts_used * gate[0].numel() * gate.element_size()  # bytes one token gathers per projection
    chunk = max(1, GATHER_BYTES // per_token)

    def experts(x: torch.Tensor) -> torch.Tensor:
        w, idx = route(cfg, _linear(x, router))  # (t, k) each
        g = torch.einsum("td,tknd->tkn", x, gate[idx])  # gate[idx]: (t, k, n, d) -> (t, k, n)
        u = torch.einsum("td,tknd->tkn", x, up[idx])  # (t, k, n)
        y = torch.einsum("tkn,tkdn->tkd", ffn_values(cfg, u, g), down[idx])  # down[idx]: (t, k, d, n) -> (t, k, d)
        return torch.einsum("tkd,tk->td", y, w)  # (t, d)

    def ffn(x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([experts(part) for part in x.split(chunk)])  # (T, d)
        if shared is not None:
            g_sh, u_sh, d_sh, gate_sh = shared
            s = _linear(ffn_values(cfg, _linear(x, u_sh), _linear(x, g_sh)), d_sh)  # (T, d)
            y = y + torch.sigmoid(_linear(x, gate_sh)) * s  # gate (T, 1)
        return y

    return ffn
