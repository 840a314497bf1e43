"""pi-profile on a mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): docs/profiler.md, "Mixtures of experts".

Only the layer-by-layer path runs them (ExpertsModel, a StreamedModel whose FFN is the router and its experts): per
layer the router picks each token's top-k experts (models/moe.route), then each expert runs on the tokens routed to
it alone, so that its neuron values h (tokens routed, n_ff_exp) are exactly what it computes; the consumers see the
routing (on_route) and each expert's h (on_expert; -1: Qwen2-MoE's shared expert, on every token). The output is
models/moe.moe_ffn's: each token's k expert outputs weighted and summed in its top-k order.

ExpertCounter counts: per (layer, expert) the tokens routed and the sum of their routing weights; per (layer, expert,
neuron) the routed tokens on which the neuron was active (active_mask's rule: nonzero, or |h| > tau_l). The taus
are calibrated over the routed experts' values (ExpertMagnitudes), so that target_sparsity of the (token, expert,
neuron) values a layer computes fall at or below them; the shared expert is counted at its layer's tau. No predictor
samples: the router is the exact predictor of which experts run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from hotneurons.artifacts.profile import ExpertsMeta
from hotneurons.common import artifacts
from hotneurons.common.model_source import ModelError, resolve_source
from hotneurons.models import ModelConfig, ffn_values
from hotneurons.models.ffn_hooks import StageHooks
from hotneurons.models.moe import route
from hotneurons.models.stream_memory import Need, _itemsize
from hotneurons.models.stream_memory import profile_need as dense_need
from hotneurons.models.streamed import StreamedModel, to_device
from hotneurons.profiler.hooks import MagnitudeCollector, count_active
from hotneurons.weights.names import layer_name

SHARED = -1  # the `expert` of Qwen2-MoE's shared expert in neurons.parquet and on_expert


def whole_model_refusal(name: str, model: str | None, gguf_file: str | None) -> ModelError:
    """A mixture of experts asked to run through transformers (a hub id, or --whole-model): refused in one line. The
    transformers path counts one dense FFN per layer through its modules' hooks; experts need the router's choice,
    which only our own decoder hands over."""
    hub = resolve_source(model, gguf_file).kind == "hub"
    fix = (f"download it first (huggingface-cli download {name} --local-dir DIR) and profile DIR" if hub else
           "drop --whole-model")
    return ModelError(f"'{name}' is a mixture of experts: pi-profile counts experts layer by layer from a local "
                      f"safetensors folder or GGUF file: {fix}", params=("model", "layer_by_layer"))


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


def experts_meta(cfg: ModelConfig) -> ExpertsMeta:
    return ExpertsMeta(n_experts=cfg.n_experts, n_experts_used=cfg.n_experts_used, n_ff_exp=cfg.n_ff_exp,
                       n_ff_shexp=cfg.n_ff_shexp, norm_topk=cfg.norm_topk)


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


class ExpertCounter(StageHooks):
    """Counts on the model's device: `routed` (L, E) tokens per expert, `weight_sum` (L, E) float64 their routing
    weights, `counts` (L, E, n) active neurons among those tokens, `shared` (L, n_sh) the shared expert's over all."""

    def __init__(self, lm: ExpertsModel, taus: list[float] | None):
        super().__init__(lm)
        c, dev = lm.cfg, lm.device
        self.taus = taus
        self.routed = torch.zeros(c.n_layers, c.n_experts, dtype=torch.int64, device=dev)
        self.weight_sum = torch.zeros(c.n_layers, c.n_experts, dtype=torch.float64, device=dev)
        self.counts = torch.zeros(c.n_layers, c.n_experts, c.n_ff_exp, dtype=torch.int64, device=dev)
        self.shared = torch.zeros(c.n_layers, c.n_ff_shexp, dtype=torch.int64, device=dev) if c.n_ff_shexp else None

    def tensors(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps and torchrun all-reduces."""
        out = {"routed": self.routed, "weight_sum": self.weight_sum, "counts": self.counts}
        return out if self.shared is None else {**out, "shared": self.shared}

    def on_route(self, i: int, weights: torch.Tensor, idx: torch.Tensor) -> None:
        idx = idx.flatten()  # (T * k,)
        self.routed[i] += torch.bincount(idx, minlength=self.routed.shape[1])
        self.weight_sum[i].index_add_(0, idx, weights.flatten().to(torch.float64))

    def on_expert(self, i: int, e: int, h: torch.Tensor) -> None:
        n = count_active(h, None if self.taus is None else self.taus[i])  # (n,)
        if e == SHARED:
            self.shared[i] += n
        else:
            self.counts[i, e] += n


class ExpertMagnitudes(MagnitudeCollector):
    """Calibration: |h| of every routed (token, expert) pair of a layer, pooled and then subsampled as the dense
    collector does (uniformly over the layer's values, whichever expert computed them)."""

    def __init__(self, lm, per_batch: int = 1 << 18, seed: int = 0):
        super().__init__(lm, per_batch, seed)
        self._layer: list[torch.Tensor] = []

    def on_route(self, i: int, weights: torch.Tensor, idx: torch.Tensor) -> None:
        pass

    def on_expert(self, i: int, e: int, h: torch.Tensor) -> None:
        if e != SHARED:
            self._layer.append(h.flatten())

    def end_layer(self, i: int) -> None:
        if self._layer:
            self.on_ffn(i, torch.cat(self._layer), None)
        self._layer = []


def write_tables(partial: Path, cfg: ModelConfig, tables: dict[str, np.ndarray]) -> np.ndarray:
    """experts.parquet and neurons.parquet (with its expert column) from ExpertCounter's tensors (numpy) -> the
    routed experts' counts (L, E * n) for the summary."""
    L, E, n = tables["counts"].shape
    experts = pd.DataFrame({"layer": np.repeat(np.arange(L, dtype=np.int32), E),
                            "expert": np.tile(np.arange(E, dtype=np.int32), L),
                            "count": tables["routed"].reshape(-1).astype(np.int64),
                            "weight_sum": tables["weight_sum"].reshape(-1).astype(np.float64)})
    artifacts.write_parquet(partial / "experts.parquet", experts)
    parts = [_neurons(tables["shared"][:, None, :], SHARED)] if "shared" in tables else []  # (L, 1, n_sh)
    neurons = pd.concat([*parts, _neurons(tables["counts"], 0)]).sort_values(["layer", "expert", "neuron"],
                                                                            kind="stable")
    artifacts.write_parquet(partial / "neurons.parquet", neurons.reset_index(drop=True))
    return tables["counts"].reshape(L, E * n)


def _neurons(counts: np.ndarray, first: int) -> pd.DataFrame:
    """(L, E, n) counts -> rows (layer, expert, neuron, count), experts numbered from `first`."""
    L, E, n = counts.shape
    return pd.DataFrame({"layer": np.repeat(np.arange(L, dtype=np.int32), E * n),
                         "expert": np.tile(np.repeat(np.arange(first, first + E, dtype=np.int32), n), L),
                         "neuron": np.tile(np.arange(n, dtype=np.int32), L * E),
                         "count": counts.reshape(-1).astype(np.int64)})


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

