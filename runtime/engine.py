"""A model loaded from its file into our own decoder (hotneurons.models) with hybrid FFNs, with no transformers
model object: the weights are read in place from the GGUF or safetensors file (hotneurons.weights), tensor by tensor.
The decoder's attention, norms, embeddings and head go to the compute device in their stored format (or `gpu_dtype`),
each layer's hot FFN rows to the device and its cold rows into the CPU layout, and each tensor's pages of the file
are released once copied, so that resident memory stays near the bytes the layout keeps.

`SourceModel` is Runtime.lm on this path, as the transformers path's LoadedModel is on the other (runtime/lm.py: what
both provide); `forward` is one token (or a prompt) through it. runtime/load.load_source_runtime builds the Runtime
from these pieces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from hotneurons.common.model_source import ModelSource
from hotneurons.weights.formats import TORCH_FLOATS, WeightFormat, kernel_format, nearest, spec, weight_format
from hotneurons.weights.names import layer_name


@dataclass
class SourceModel:
    """What a Runtime keeps of a model loaded into our decoder."""

    decoder: Any  # a hotneurons.models model: attention, norms, embeddings, head and the static KV cache
    tokenizer: Any
    activation: str
    source: ModelSource
    info: dict[str, Any]  # the "model" section of every stage's meta.json
    config: Any  # the transformers config (text config)
    eos: set[int] = field(default_factory=set)

    @property
    def layers(self) -> range:
        return range(self.info["n_layers"])

    # -- decoding, as runtime/lm.DecodeModel describes it ------------------------------------------------------------
    @property
    def vocab(self) -> int:
        return int(self.info["vocab_size"])

    @property
    def ctx(self) -> int:
        return int(self.decoder.ctx)  # its static KV cache

    @property
    def static_ctx(self) -> int:
        return self.ctx

    def prefill(self, rt: Any, ids: list[int], pos0: int = 0) -> torch.Tensor:
        """`pos0` > 0: the ids continue a sequence whose first pos0 positions the cache holds."""
        return forward(rt, ids, pos0)

    def step(self, rt: Any, token: int, pos: int) -> torch.Tensor:
        return forward(rt, [token], pos)


def auto_format(stored: WeightFormat, where: str, compute: torch.dtype, device: str = "cuda") -> str:
    """`auto` for --cold-dtype (where="cpu") or --gpu-dtype (where="gpu", on `device`): the stored format where the
    kernels there read it, else the nearest one they read (weights/formats.py's table: Q4_K -> q4_1, Q5_0, Q6_K,
    IQ4_XS ... -> q8_0, Q2_K, Q3_K, IQ1-IQ3 ... -> q4_0). Float files: bf16 cold rows; hot rows in the compute dtype on
    a GPU, as stored when the device is the CPU (a float32 copy of a bf16 file would double its memory there)."""
    if spec(stored).block == 1:
        if where == "cpu":
            return "bf16"
        return str(kernel_format(stored, "cpu")) if device == "cpu" else str(compute).removeprefix("torch.")
    return str(kernel_format(stored, "cpu" if where == "cpu" else device))


def conversions(source: Any, device: str, cold: str, hot: str, gpu: Any = None) -> str | None:
    """One line: the file's block matrices that are not kept in their stored format, what they become at load (FFN
    rows: the hot and cold rows' formats, one each for the whole FFN; other matrices: models/common._pack's
    kernel_format, where the device's kernels do not read theirs), per stored format with its bytes in the file and
    resident after (FFN rows split by `gpu`: per layer the neurons on the device, bool; None: all there). None where
    nothing is converted. An untied embedding stays as stored (a token's row is de-quantized as it is read)."""
    from hotneurons.common.units import format_bytes
    from hotneurons.models.ffn_weights import kept_format
    from hotneurons.runtime.memory import is_ffn_weight

    dev = torch.device(device).type
    rows: dict[WeightFormat, list] = {}  # stored format -> [tensors, stored bytes, resident bytes, {targets}]
    untied = "output.weight" in source.infos
    for name, t in source.infos.items():
        if (len(t.shape) < 2 or t.fmt in TORCH_FLOATS or name.endswith((".fc1.weight", ".fc2.weight"))
                or (untied and name == "token_embd.weight")):
            continue
        numel = int(np.prod(t.shape))
        if is_ffn_weight(name):
            share = 1.0 if gpu is None else float(np.mean(gpu[int(name.split(".")[1])]))
            kept = [(kept_format(source.infos, name, f, side == "cold", share == 1), w)
                    for side, f, w in (("hot", hot, share), ("cold", cold, 1 - share))]  # a K-quant's rows or down's
            parts = [(str(f), w) for f, w in kept if w > 0 and f != t.fmt]
        else:
            parts = [(str(kernel_format(t.fmt, dev)), 1.0)] if kernel_format(t.fmt, dev) != t.fmt else []
        if not parts:
            continue
        row = rows.setdefault(t.fmt, [0, 0, 0.0, set()])
        row[0] += 1
        row[1] += t.nbytes
        row[2] += sum(w * numel * spec(f).bytes_per_weight for f, w in parts)
        row[3].update(str(f) for f, _ in parts)
    if not rows:
        return None
    said = [f"{str(f).upper()} -> {'/'.join(sorted(r[3]))} ({r[0]} tensor{'s' * (r[0] > 1)}, {format_bytes(r[1])} "
            f"stored -> {format_bytes(r[2])} resident)" for f, r in rows.items()]
    return (f"tensors converted at load (no kernel reads their stored format, or the FFN rows' layout keeps one): "
            f"{'; '.join(said)} (docs/memory.md: the formats)")


def formats_for(source: Any, cold_dtype: str, gpu_dtype: str, compute: torch.dtype,
                device: str) -> tuple[str, str]:
    """(cold rows' format, hot rows' format) from the flags and the file's FFN format."""
    stored = source.infos[layer_name(0, "ffn_up.weight")].fmt
    cold = auto_format(stored, "cpu", compute) if cold_dtype == "auto" else str(weight_format(cold_dtype))
    gpu = auto_format(stored, "gpu", compute, device) if gpu_dtype == "auto" else str(weight_format(gpu_dtype))
    return cold, gpu


def file_predictors(source: Any, dtype: torch.dtype) -> Any:
    """PowerInfer's predictors from its own file (fc1, fc2 per layer; a neuron computed iff its logit >= the file's
    sparse threshold, 0 by default), in the powerinfer form: they read the residual before the pre-FFN norm."""
    from hotneurons.artifacts.predictor_file import Predictor, Predictors
    from hotneurons.artifacts.predictors import PredictorForm
    from hotneurons.models.ffn_weights import to_float

    threshold = source.sparse_threshold or 0.0
    layers = {}
    for i in range(int(source.config.num_hidden_layers)):
        fc1, fc2 = (to_float(w) for w in source.predictor(i))  # (r, d), (n, r)
        layers[i] = Predictor.from_weights(fc1, fc2, threshold, dtype=dtype)
    return Predictors(layers, None, None, PredictorForm.POWERINFER)


def file_placement(source: Any, n_layers: int) -> Any:
    """PowerInfer's split beside its file (`.generated.gpuidx`), or none: every neuron on the CPU side."""
    from hotneurons.artifacts.placement import Placement

    masks = source.gpu_index()
    if masks is None:
        return Placement.uniform(n_layers, source.infos[layer_name(0, "ffn_up.weight")].shape[0], False)
    return Placement(tuple(np.asarray(m, dtype=bool) for m in masks))


def requantized(source: Any, cold: str, hot: str) -> None:
    """Warn, once, where 4- to 6-bit rows of the file (Q4_1, Q4_K, Q5_0, IQ4_XS ...) are re-quantized to q4_0, a
    coarser or other grid than theirs: a real cost in quality (`auto` converts them to their nearest format)."""
    import warnings

    stored = source.infos[layer_name(0, "ffn_up.weight")].fmt
    s = spec(stored)
    if (s.block > 1 and 4 <= s.bits_per_weight <= 6 and nearest(stored) != WeightFormat.Q4_0
            and WeightFormat.Q4_0 in (cold, hot)):
        keep = ("--cold-dtype auto --gpu-dtype auto reads them as stored" if kernel_format(stored, "cpu") == stored else
                f"--cold-dtype auto --gpu-dtype auto converts them to {nearest(stored)} instead")
        warnings.warn(f"the file's {stored} FFN rows are re-quantized to q4_0, which costs quality (SmolLM2-135M from "
                      f"Q4_1: +15% perplexity, docs/memory.md); {keep}", stacklevel=3)


@torch.inference_mode()
def forward(rt: Any, ids: list[int], pos0: int, every: bool = False) -> torch.Tensor:
    """Logits (vocab,) float32 of the last of `ids` (at positions pos0...), through the decoder and the hybrid FFNs;
    several ids (a prompt) run each FFN dense over them, one id is a decode step. every: (T, vocab), all positions'."""
    m = rt.lm.decoder
    h = m.embed(torch.tensor(ids, device=rt.device), pos0)  # (T, d)
    for i, f in enumerate(rt.ffns):
        h2, x = m.attention(i, h, pos0)  # (T, d) the residual after attention, the FFN's input
        f.residual = h2 if f.prenorm else None  # the powerinfer-form predictor reads the residual before the norm
        h = m.after_ffn(i, h2, f(x))
    return m.logits(h) if every else m.logits(h[-1:])[0]
