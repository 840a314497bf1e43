"""A model file opened for the stages that read it in place (the runtime, the layer-by-layer profiler and predictors,
the exporters): its tensor table and config (`open_model`, reading only the header) and the meta.json "model" section
counted from that table (`model_info`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from hotneurons.common.artifacts import ArtifactError
from hotneurons.common.kinds import Activation, choose
from hotneurons.common.model_info import ModelInfo, ParamCounts, attention_heads
from hotneurons.common.model_source import ModelSource, resolve_source


def model_info(source: Any, source_id: ModelSource, activation: str, family: str, gated: bool) -> dict[str, Any]:
    """The meta.json "model" section (common/model_info.ModelInfo) from the file's tensor table: what the file stores
    (weight_dtype: its FFN's format); a mixture of experts' n_neurons is all its experts' neurons (profiler/experts.py
    records one expert's)."""
    infos, cfg = source.infos, source.config
    # the model's tensors (a PowerInfer file also holds its predictors, blk.{i}.fc1/fc2: not the model's)
    numel = {n: int(np.prod(t.shape)) for n, t in infos.items() if not n.endswith((".fc1.weight", ".fc2.weight"))}
    L = int(cfg.num_hidden_layers)
    layer = [sum(v for n, v in numel.items() if n.startswith(f"blk.{i}.")) for i in range(L)]
    ffn = [sum(v for n, v in numel.items() if n.startswith(f"blk.{i}.ffn_") and "_norm" not in n) for i in range(L)]
    up = infos.get("blk.0.ffn_up.weight") or infos["blk.0.ffn_up_exps.weight"]  # (n, d) | experts (E, n, d)
    n_heads, n_kv, head_dim = attention_heads(cfg)
    stored = str(up.fmt)
    return ModelInfo.of(
        source_id, cfg, family=family, model_type=cfg.model_type, activation=activation, gated=gated, n_layers=L,
        d_model=int(up.shape[-1]), n_neurons=int(np.prod(up.shape[:-1])), ffn_bias="blk.0.ffn_up.bias" in infos,
        num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=head_dim, vocab_size=int(cfg.vocab_size),
        weight_dtype={"f32": "float32", "f16": "float16", "bf16": "bfloat16"}.get(stored, stored),
        params=ParamCounts.count(sum(numel.values()), numel.get("token_embd.weight", 0),
                                 numel.get("output.weight", 0), layer, ffn)).to_meta()


def open_model(model: str | None, gguf_file: str | None = None, activation: str | None = None):
    """(source, ModelSource, ModelConfig, Activation) of a model file, reading only its header."""
    from hotneurons.models.config import ModelConfig
    from hotneurons.models.family import adapter_for
    from hotneurons.weights.source import open_source

    sid = resolve_source(model, gguf_file)
    if sid.kind == "hub":
        raise ArtifactError(f"model '{sid.name}' is a hub id: the in-place loader reads a local folder of "
                            f"safetensors or a GGUF file; download it first (huggingface-cli download {sid.name})")
    path = Path(sid.path)
    source = open_source(str(path), sid.gguf_file)
    act = activation or (str(source.activation) if source.activation is not None else None)
    act = str(adapter_for(source.config, experts=True).activation(source.config, act))  # MoE: runtime/moe_load.py
    mcfg = ModelConfig.from_hf(source.config, choose(act, Activation, "activation"))
    return source, sid, mcfg, act
