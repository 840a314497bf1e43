"""Stages on models bigger than the device: the model run layer by layer from its file (docs/profiler.md, "Models
bigger than the device: layer by layer").

`StreamedModel` stands where the transformers path's LoadedModel does (pi-profile, pi-eval, pi-train-predictors). It
reads a local safetensors folder or GGUF file in place (hotneurons.weights) into a lazy decoder of our own
(hotneurons.models, build_model(layers=False)): only embeddings, final norm and head stay on the device. A batch of
token ids (B, T) goes through it one layer at a time, its hidden states (B, T, d) carried from layer to layer; for
layer i: its attention and norms come to the device (decoder.load_layer) and its FFN (FFNWeights.from_source), all
de-quantized to float; each of the B sequences runs through attention (batch 1, positions 0..T-1, the one-layer
cache overwritten by each); the FFN computes the neuron values h (B, T, n), which the attached consumers (the stages'
hooks: models/ffn_hooks.StageHooks) see and may replace exactly as the transformers path's forward hooks do; then the
down projection; then the layer is dropped and its pages of the file released (source.release), since the next batch
reads them again from the page cache. One layer's weights on the device at a time, the batch's activations beside
them. What the stages need of memory, checked before anything loads: models/stream_memory.py. A mixture of experts
(pi-profile only: models/streamed_experts.open_experts) is its ExpertsModel, whose run_ffn routes the tokens and
runs each expert on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from hotneurons.common import prenorm
from hotneurons.common.model_source import ModelError, resolve_source
from hotneurons.models import MODELS, Decoder, ModelConfig, build_model, ffn_values, gate_values
from hotneurons.models.ffn_weights import FFNWeights, as_stored, float_format, store
from hotneurons.weights.formats import WeightFormat
from hotneurons.weights.names import layer_name
from hotneurons.weights.qtensor import QTensor

LOGIT_BYTES = 256 << 20  # the head's output is computed this many bytes of (tokens, vocab) at a time
FFN_TENSORS = ("ffn_up.weight", "ffn_gate.weight", "ffn_down.weight", "ffn_down_t.weight", "ffn_up.bias",
               "ffn_gate.bias", "ffn_down.bias")  # a layer's FFN tensors, as FFNWeights reads them (+ a gate bias)


def streams(model: str | None, gguf_file: str | None = None, layer_by_layer: bool | None = None) -> bool:
    """Whether a stage runs `model` layer by layer: as asked, or (None) where the in-place sources read it, a local
    safetensors folder or GGUF file; hub ids go through transformers."""
    if layer_by_layer is not None:
        return layer_by_layer
    sid = resolve_source(model, gguf_file)
    return sid.kind == "gguf" or (sid.kind == "folder" and any(Path(sid.path).glob("*.safetensors")))


def meta_source(info: dict[str, Any], model: str | None = None,
                gguf_file: str | None = None) -> tuple[str | None, str | None, str | None]:
    """(model, gguf_file, activation) to open for an artifact's meta.json "model" section, unless `model` names
    another (whose own activation then holds); as models/family.load_model_from_meta."""
    if model is not None:
        return model, gguf_file, None
    src = info["source"]
    path = src["path"] if src["kind"] in ("gguf", "folder") else info["name"]
    return path, gguf_file or src.get("gguf_file"), info["activation"]


@dataclass(frozen=True)
class FileNorm:
    """A layer's pre-FFN RMSNorm read from the file: as common/prenorm.FFNNorm, without a module."""

    weight: torch.Tensor  # (d,) as HF stores it (Gemma: gamma - 1)
    eps: float
    offset: float  # gamma = offset + weight

    def gamma(self) -> torch.Tensor:
        """(d,) float32: x_post = gamma * x_pre / r."""
        return self.offset + self.weight.float()

    def divisor(self, x_pre: torch.Tensor) -> torch.Tensor:
        """(..., d) -> (...,) float32 r = sqrt(mean(x_pre ** 2) + eps), as FFNNorm.divisor."""
        return (x_pre.float().pow(2).mean(-1) + self.eps).sqrt()


@dataclass
class FloatFFN:
    """One layer's FFN in float on the device (torch Linear orientation)."""

    up: torch.Tensor  # (n, d)
    down: torch.Tensor  # (d, n)
    gate: torch.Tensor | None = None  # (n, d)
    b_up: torch.Tensor | None = None  # (n,)
    b_gate: torch.Tensor | None = None  # (n,)
    b_down: torch.Tensor | None = None  # (d,)

    def values(self, cfg: ModelConfig, x: torch.Tensor, on_gate=None) -> torch.Tensor:
        """x (..., d) -> the neuron values h (..., n) that enter the down projection; `on_gate` (gated FFNs) is
        handed act(gate x) (..., n) first (the gate sparsity criteria: common/gating.py)."""
        gate = None if self.gate is None else F.linear(x, self.gate, self.b_gate)  # (..., n)
        if on_gate is not None and gate is not None:
            on_gate(gate_values(cfg, gate))
        return ffn_values(cfg, F.linear(x, self.up, self.b_up), gate)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """h (..., n) -> y (..., d)."""
        return F.linear(h, self.down, self.b_down)


def to_device(w: torch.Tensor | QTensor | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """A stored weight as a float tensor on `device`: block formats de-quantized there a chunk of rows at a time (no
    float32 copy of the whole matrix beside the result: ffn_weights.store)."""
    if w is None or not isinstance(w, QTensor):
        return None if w is None else w.to(device=device, dtype=dtype)
    return store(w, float_format(dtype), device)


@dataclass
class StreamedModel:
    """A model read from its file, run layer by layer; what the stages read of a LoadedModel (`info`, `activation`,
    `tokenizer`, `layers`) under the same names."""

    source: Any  # hotneurons.weights.source.WeightSource
    cfg: ModelConfig
    activation: str
    info: dict[str, Any]  # the meta.json "model" section, as the transformers path writes it
    device: torch.device
    dtype: torch.dtype
    ctx: int  # tokens per sequence at most (the one-layer KV cache)
    _decoder: Decoder | None = None
    _tokenizer: Any = None
    consumers: list = field(default_factory=list)  # StageHooks attached (entered) on this model
    # pi-eval --row-format: each layer's FFN as the runtime stores its rows in this format (None: as the file has it)
    row_format: WeightFormat | None = None

    @property
    def layers(self) -> range:
        return range(self.cfg.n_layers)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = self.source.tokenizer()
        return self._tokenizer

    @property
    def decoder(self) -> Decoder:
        """The lazy decoder: embeddings, final norm and head on the device, built on first use (after the stage's
        memory check)."""
        if self._decoder is None:
            src, dev, dt = self.source, self.device, self.dtype

            def get(name: str) -> torch.Tensor | QTensor | None:
                if name not in src.infos:
                    return None
                # a layer's weights de-quantized once per batch, on the device: its B x T tokens all read them (kept in
                # blocks, each sequence's GEMMs would de-quantize them again); the head and embeddings stay as stored
                return to_device(src.get(name), dev, dt) if name.startswith("blk.") else src.get(name)

            self._decoder = build_model(self.cfg, get, self.device, self.dtype, self.ctx,
                                        release=lambda name: src.release(name) if name in src.infos else 0,
                                        layers=False)
        return self._decoder

    def attach(self, consumer: Any) -> None:
        self.consumers.append(consumer)

    def detach(self, consumer: Any) -> None:
        self.consumers.remove(consumer)

    def ffn_norms(self, required: bool = False) -> list[FileNorm] | None:
        """Every layer's pre-FFN RMSNorm (its weight read from the file), or None for families without one (OPT,
        Falcon); `required`: refused in one line there instead (the powerinfer predictor form needs them)."""
        if not prenorm.has_ffn_norm(self.info["family"]) or self.cfg.norm not in ("rms", "rms_gemma"):
            if required:
                raise prenorm.refusal(self.info["family"], self.info.get("model_type"))
            return None
        offset = 1.0 if self.cfg.norm == "rms_gemma" else 0.0
        return [FileNorm(self._float(layer_name(i, "ffn_norm.weight")), self.cfg.norm_eps, offset) for i in self.layers]

    def gate_column_norms(self) -> list[torch.Tensor]:
        """Per layer ||W_gate[:, i]||_2 (d,) on the device, WINA's channel weights, each gate matrix read once (as a
        batch reads it: de-quantized on the device) and its pages released."""
        from hotneurons.common.gate_masks import column_norms

        out = []
        for i in self.layers:
            w = to_device(self.source.get(layer_name(i, "ffn_gate.weight")), self.device, self.dtype)  # (n, d)
            out.append(column_norms(w))
            del w
            self.source.release(layer_name(i, "ffn_gate.weight"))
        return out

    def _float(self, name: str) -> torch.Tensor:
        w = self.source.get(name)
        w = w.dequantize(torch.float32) if isinstance(w, QTensor) else w.float().clone()  # a copy: off the map
        self.source.release(name)
        return w

    def ffn(self, i: int) -> FloatFFN:
        """Layer i's FFN from the file, in float on the device (release_ffn(i) drops its pages after)."""
        w = FFNWeights.from_source(self.source, i)
        dev, dt = self.device, self.dtype
        if self.row_format is not None:  # rounded anew each batch, as the file is read anew: no layer is kept
            w = as_stored(w, self.row_format, dev, dt)
        down = to_device(w.down_t, dev, dt).T if w.down_t is not None else to_device(w.down, dev, dt)  # (d, n)
        bias = layer_name(i, "ffn_gate.bias")
        b_gate = self.source.get(bias) if bias in self.source.infos else None
        return FloatFFN(up=to_device(w.up, dev, dt), down=down, gate=to_device(w.gate, dev, dt),
                        b_up=to_device(w.b_up, dev, dt), b_gate=to_device(b_gate, dev, dt),
                        b_down=to_device(w.b_down, dev, dt))

    def release_ffn(self, i: int) -> None:
        for name in (layer_name(i, t) for t in FFN_TENSORS):
            if name in self.source.infos:
                self.source.release(name)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) through every layer, one at a time, feeding the attached consumers (see the module's
        docstring) -> the last hidden states (B, T, d), before the final norm."""
        B, T = ids.shape
        if T > self.ctx:
            why = (f"the {self.ctx} positions {self.cfg.model_type} was trained for"
                   if self.ctx == self.cfg.max_positions else f"the {self.ctx} this model was opened for")
            raise ModelError(f"sequences of {T} tokens are past {why}: use a sequence length <= {self.ctx}",
                             params="seq_len")
        dec, ids = self.decoder, ids.to(self.device)
        norms = self.cfg.norm in ("rms", "rms_gemma") and prenorm.has_ffn_norm(self.info["family"])
        h = torch.stack([dec.embed(ids[b], 0) for b in range(B)])  # (B, T, d)
        for i in self.layers:
            dec.load_layer(i)
            # batch 1 in the decoder: each sequence at positions 0..T-1, overwriting the one-layer cache
            h2, x = (torch.stack(t) for t in zip(*(dec.attention(i, h[b], 0) for b in range(B))))  # (B, T, d) each
            if norms:  # h2 is the residual entering the pre-FFN RMSNorm (x = norm(h2))
                for c in self.consumers:
                    c.on_pre_norm(i, h2)
            h = dec.after_ffn(i, h2, self.run_ffn(i, x))  # (B, T, d)
            for c in self.consumers:
                c.end_layer(i)
            del h2, x
            dec.drop_layer(i)
            self.release_ffn(i)
        return h

    def run_ffn(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Layer i's FFN on x (B, T, d) -> y (B, T, d), its neuron values handed to the consumers on the way
        (models/streamed_experts.ExpertsModel: a mixture of experts')."""
        w = self.ffn(i)
        for c in self.consumers:  # the input criteria: channels of x masked before gate and up read it
            out = c.on_ffn_input(i, x) if _asks(c, "wants_input") else None
            x = x if out is None else out
        takers = [c for c in self.consumers if _asks(c, "wants_gate")]
        v = w.values(self.cfg, x, (lambda a: [c.on_gate(i, a) for c in takers]) if takers else None)  # (B, T, n)
        for c in self.consumers:  # in order, each seeing what the one before returned, as chained hooks do
            out = c.on_ffn(i, v, x if c.wants_x() else None)
            v = v if out is None else out
        return w.project(v)

    @torch.inference_mode()
    def nll(self, ids: torch.Tensor) -> tuple[float, int]:
        """(summed next-token negative log-likelihood in float64, predicted tokens) of ids (B, T), the head run a
        chunk of positions at a time (its (tokens, vocab) logits are the largest activation)."""
        h = self.forward(ids)  # (B, T, d)
        ids = ids.to(self.device)
        B, T = ids.shape
        step = max(1, LOGIT_BYTES // (20 * self.cfg.vocab))  # float32 logits + their float64 copy and log-softmax
        total = 0.0
        for b in range(B):
            for t0 in range(0, T - 1, step):
                t1 = min(T - 1, t0 + step)
                logits = self.decoder.logits(h[b, t0:t1])  # (t, vocab) float32
                total += float(F.cross_entropy(logits.double(), ids[b, t0 + 1:t1 + 1], reduction="sum"))
        return total, B * (T - 1)

    @torch.inference_mode()
    def ffn_values(self, layer: int, x: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
        """(count, d) FFN inputs -> (count, n) float32 values h on the CPU, from the layer's weights in the file (as
        predictors/fit.ffn_values does from a loaded model)."""
        w = self.ffn(layer)
        out = [w.values(self.cfg, x[s:s + chunk].to(self.device, self.dtype)).float().cpu()
               for s in range(0, len(x), chunk)]
        del w
        self.release_ffn(layer)
        return torch.cat(out) if out else torch.zeros((0, self.cfg.n_ff))


def _asks(consumer: Any, wants: str) -> bool:
    """A consumer's wants_gate() / wants_input(); False for one without them (written before the gated criteria)."""
    f = getattr(consumer, wants, None)
    return bool(f()) if f is not None else False


def open_streamed(model: str | None, gguf_file: str | None = None, *, activation: str | None = None,
                  device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                  ctx: int = 512) -> StreamedModel:
    """A StreamedModel of a local safetensors folder or GGUF file, reading only its header (the decoder's embeddings
    and head load on first use). ctx: the longest sequence it will run (the stage's sequence length). A mixture of
    experts is refused (pi-profile opens one with models/streamed_experts.open_experts first)."""
    from hotneurons.models.family import adapter_for
    from hotneurons.models.open import model_info, open_model

    source, sid, mcfg, act = open_model(model, gguf_file, activation)
    adapter = adapter_for(source.config)
    info = model_info(source, sid, act, adapter.name, adapter.gated)
    info["weight_dtype"] = str(dtype).removeprefix("torch.")  # the compute dtype, as the transformers path records
    if mcfg.family not in MODELS:
        raise ValueError(f"no model definition for family '{mcfg.family}': run it whole, through transformers")
    # a cache past the trained positions is refused (models/common.Decoder); a batch that long is refused by forward
    return StreamedModel(source, mcfg, act, info, torch.device(device), dtype, min(ctx, mcfg.max_positions))
