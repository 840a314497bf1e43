"""A mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) read from its file and run layer by layer, as
models/streamed.py runs a dense model: ExpertsModel, a StreamedModel whose FFN is the router and its experts
(ExpertFFN). Per layer the router picks each token's top-k experts (models/moe.route), then each expert runs on the
tokens routed to it alone, so that its neuron values h (tokens routed, n_ff_exp) are exactly what it computes; the
consumers (pi-profile's counters, pi-eval's dense pass) see the routing (on_route) and each expert's h (on_expert; -1:
Qwen2-MoE's shared expert, on every token). The output is models/moe.moe_ffn's: each token's k expert outputs weighted
and summed in its top-k order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from hotneurons.common.model_source import ModelError, resolve_source
from hotneurons.models.common import ffn_values
from hotneurons.models.config import ModelConfig
from hotneurons.models.moe import route
from hotneurons.models.stream_memory import Need, _itemsize
from hotneurons.models.stream_memory import profile_need as dense_need
from hotneurons.models.streamed import StreamedModel, to_device
from hotneurons.weights.names import layer_name

SHARED = -1  # the `expert` of Qwen2-MoE's shared expert in neurons.parquet and on_expert


def open_experts(model: str | None, gguf_file: str | None = None, *, activation: str | None = None,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 ctx: int = 512) -> ExpertsModel | None:
    """An ExpertsModel of a local safetensors folder or GGUF file holding a mixture of experts; None for a dense
    model (open_streamed opens it). As models/open.open_model, with experts allowed."""
    from hotneurons.common.kinds import Activation, choose
    from hotneurons.models.family import adapter_for
    from hotneurons.models.open import model_info
    from hotneurons.weights.source import open_source

    sid = resolve_source(model, gguf_file)
    if sid.kind == "hub":
        return None  # open_model refuses it in one line
    source = open_source(str(Path(sid.path)), sid.gguf_file)
    adapter = adapter_for(source.config, experts=True)
    if not adapter.experts:
        return None
    act = activation or (str(source.activation) if source.activation is not None else None)
    act = str(adapter.activation(source.config, act))
    cfg = ModelConfig.from_hf(source.config, choose(act, Activation, "activation"))
    # the "model" section as models/open.model_info counts it, but (docs/artifacts.md) n_neurons is one expert's, as
    # the profile's tables count them, and weight_dtype the compute dtype, as the transformers path records it
    info = {**model_info(source, sid, act, "moe", True), "n_neurons": cfg.n_ff_exp,
            "weight_dtype": str(dtype).removeprefix("torch.")}
    # a cache past the trained positions is refused (models/common.Decoder); a batch that long by forward
    return ExpertsModel(source, cfg, act, info, torch.device(device), dtype, min(ctx, cfg.max_positions))


@dataclass
class ExpertFFN:
    """One layer's router and experts in float on the device (torch Linear orientation)."""

    router: torch.Tensor  # (E, d)
    gate: torch.Tensor  # (E, n, d)
    up: torch.Tensor  # (E, n, d)
    down: torch.Tensor  # (E, d, n)
    shared: tuple[torch.Tensor, ...] | None = None  # gate (n_sh, d), up (n_sh, d), down (d, n_sh), its gate (1, d)

    def __call__(self, cfg: ModelConfig, x: torch.Tensor, hooks: list, i: int) -> torch.Tensor:
        """x (T, d) -> y (T, d), as models/moe.moe_ffn; the hooks see the routing and each expert's values."""
        weights, idx = route(cfg, F.linear(x, self.router))  # (T, k) each
        for c in hooks:
            c.on_route(i, weights, idx)
        ys = x.new_zeros(*idx.shape, x.shape[-1])  # (T, k, d): each token's experts' outputs, in its top-k order
        for e in range(cfg.n_experts):
            tok, slot = (idx == e).nonzero(as_tuple=True)  # (m,) each: the tokens routed to e, e's place in their top-k
            if len(tok):
                xe = x[tok]  # (m, d)
                for c in hooks:  # pi-train-predictors' expert predictors fit on these (predictors/experts_fit.py)
                    if hasattr(c, "on_expert_input"):
                        c.on_expert_input(i, e, xe)
                h = _visit(hooks, i, e, ffn_values(cfg, F.linear(xe, self.up[e]), F.linear(xe, self.gate[e])))  # (m, n)
                ys[tok, slot] = F.linear(h, self.down[e])  # (m, d)
        y = torch.einsum("tkd,tk->td", ys, weights)  # (T, d): moe_ffn's sum over k
        if self.shared is not None:
            g_sh, u_sh, d_sh, gate_sh = self.shared
            h = _visit(hooks, i, SHARED, ffn_values(cfg, F.linear(x, u_sh), F.linear(x, g_sh)))  # (T, n_sh)
            y = y + torch.sigmoid(F.linear(x, gate_sh)) * F.linear(h, d_sh)  # gate (T, 1)
        return y


def _visit(hooks: list, i: int, e: int, h: torch.Tensor) -> torch.Tensor:
    """h through the hooks in order, each seeing what the one before returned (as StreamedModel.run_ffn)."""
    for c in hooks:
        out = c.on_expert(i, e, h)
        h = h if out is None else out
    return h


class ExpertsModel(StreamedModel):
    """A mixture of experts read from its file, run layer by layer: StreamedModel with the FFN above."""

    def _ffn_names(self, i: int) -> list[str]:
        return [n for n in self.source.infos if n.startswith(f"blk.{i}.ffn_") and "_norm" not in n]

    def ffn(self, i: int) -> ExpertFFN:
        """Layer i's router and experts from the file, de-quantized on the device (a block format's stacked experts
        come as (E * out, in) rows)."""
        def get(name: str) -> torch.Tensor:
            return to_device(self.source.get(layer_name(i, f"ffn_{name}.weight")), self.device, self.dtype)

        E, d = self.cfg.n_experts, self.cfg.d_model
        gate, up = (get(f"{p}_exps").reshape(E, -1, d) for p in ("gate", "up"))  # (E, n, d) each
        down = get("down_exps").reshape(E, d, -1)  # (E, d, n)
        shared = None
        if self.cfg.n_ff_shexp:  # gate, up (n_sh, d); down (d, n_sh); its gate (1, d)
            shared = (*(get(p) for p in ("gate_shexp", "up_shexp", "down_shexp")), get("gate_inp_shexp").reshape(1, d))
        return ExpertFFN(get("gate_inp"), gate, up, down, shared)

    def release_ffn(self, i: int) -> None:
        for name in self._ffn_names(i):
            self.source.release(name)

    def run_ffn(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, d) -> y (B, T, d), the B x T tokens routed together."""
        return self.ffn(i)(self.cfg, x.reshape(-1, x.shape[-1]), self.consumers, i).reshape(x.shape)

    def ffn_values(self, layer: int, x: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
        raise ModelError("a mixture of experts has no predictor samples to train on: its router picks the experts",
                         params="model")


def experts_need(sm: ExpertsModel, batch: int, seq_len: int, samples_per_layer: int, calibration_tokens: int,
                 calibrate: bool) -> Need:
    """stream_memory.profile_need without samples, plus the experts' outputs (T, k, d) and the shared expert's
    projections; the calibration pools a layer's routed values (T * k * n float32) before subsampling."""
    need = dense_need(sm, batch, seq_len, 0, calibration_tokens, calibrate)
    c, tokens, size = sm.cfg, batch * seq_len, _itemsize(sm.dtype)
    extra = tokens * ((c.n_experts_used + 2) * c.d_model + 3 * c.n_ff_shexp) * size
    pooled = tokens * c.n_experts_used * c.n_ff_exp * 4 * 2 if calibrate else 0
    return Need(device={**need.device, "experts' outputs": extra + (pooled if sm.device.type != "cpu" else 0)},
                host={**need.host, "calibration's pooled values": pooled})

