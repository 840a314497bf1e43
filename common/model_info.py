"""The meta.json "model" section: what a model is, as every stage records it and the solver's cost model reads it.

`ModelInfo` is the section (its fields are the JSON keys); `ParamCounts` its `params` (`ParamCounts.count`: the one
accounting of parameters from per-layer totals). Three places build one from a model, each where its input lives:
models/open.model_info (a file's tensor table; a mixture of experts' profile through it, profiler/experts.py) and
models/family.model_info (a transformers module). Readers get the dict (`to_meta`), as meta.json holds it; the solver
reads it back with `from_meta`.

Not models/config.ModelConfig: that is how to run a model (norms, rope, fused projections), read from its config;
this is what it is (shapes, parameter counts, identity), recorded so that a later stage can check and price it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hotneurons.common.model_source import ModelSource, fingerprint
from hotneurons.common.schema import ArtifactError


def attention_heads(config: Any) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of a transformers (text) config. Falcon-7B is multi-query (1 kv head)
    unless its config says otherwise; Falcon-40B's "new" architecture has num_kv_heads; the rest name
    num_key_value_heads, or none (one kv head per query head: OPT, LLaMA-1)."""
    n_heads = int(config.num_attention_heads)
    n_kv = int(getattr(config, "num_key_value_heads", None) or n_heads)
    if config.model_type == "falcon":
        new_arch = getattr(config, "new_decoder_architecture", False)
        n_kv = int(config.num_kv_heads) if (new_arch or not config.multi_query) else 1
    return n_heads, n_kv, int(getattr(config, "head_dim", None) or config.hidden_size // n_heads)


@dataclass(frozen=True)
class ParamCounts:
    """The `params` of the model section: parameter counts (not bytes), shared tensors counted once."""

    embedding: int
    lm_head: int  # 0 when tied to the embedding
    other: int  # outside the layers besides embedding and head: final norm, OPT's learned positions
    attention_per_layer: tuple[int, ...]  # (layers,) every parameter of a decoder layer outside its FFN
    ffn_per_layer: tuple[int, ...]  # (layers,) a mixture of experts: its router's, experts' and shared expert's

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.other + sum(self.attention_per_layer) + sum(self.ffn_per_layer)

    @classmethod
    def count(cls, total: int, embedding: int, lm_head: int, layers: Sequence[int], ffn: Sequence[int]) -> ParamCounts:
        """From the model's total, its embedding and untied head, and per decoder layer its total and its FFN's."""
        return cls(embedding=int(embedding), lm_head=int(lm_head),
                   other=int(total) - sum(layers) - int(embedding) - int(lm_head),
                   attention_per_layer=tuple(int(a) - int(f) for a, f in zip(layers, ffn, strict=True)),
                   ffn_per_layer=tuple(int(f) for f in ffn))

    def to_meta(self) -> dict[str, Any]:
        return {"total": self.total, "embedding": self.embedding, "lm_head": self.lm_head, "other": self.other,
                "attention_per_layer": list(self.attention_per_layer), "ffn_per_layer": list(self.ffn_per_layer)}


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    """The "model" section of every stage's meta.json (docs/artifacts.md). The fields a builder always fills but an
    older or hand-made section may lack (source, fingerprint, family, model_type, activation, weight_dtype) are None
    there and left out of `to_meta`."""

    name: str  # what the user named: hub id, folder or .gguf path
    source: dict[str, Any] | None = field(default=None, hash=False)  # kind (hub, folder, gguf), path, gguf_file,
    #                                                                   revision
    fingerprint: str | None = None  # common/model_source.fingerprint: what every stage compares
    family: str | None = None  # models/family's adapter; moe for a mixture of experts
    model_type: str | None = None  # transformers' model_type
    activation: str | None = None  # common/kinds.Activation's value
    gated: bool
    n_layers: int
    d_model: int
    n_neurons: int  # FFN neurons per layer (a mixture of experts: see models/open.model_info, profiler/experts.py)
    ffn_bias: bool = False
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    weight_dtype: str | None = None  # float32, bfloat16, ..., or a GGUF file's stored format (q4_0)
    params: ParamCounts

    @classmethod
    def of(cls, source: ModelSource, config: Any, **fields: Any) -> ModelInfo:
        """A builder's section: name, source and fingerprint from where the model came from and its config."""
        return cls(name=source.name, source={"kind": source.kind, "path": source.path, "gguf_file": source.gguf_file,
                                             "revision": source.revision},
                   fingerprint=fingerprint(source, config), **fields)

    def to_meta(self) -> dict[str, Any]:
        """The JSON object meta.json holds, keys in field order."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "params"}
        d["source"] = None if self.source is None else dict(self.source)  # a copy: the instance stays as it was
        return {**{k: v for k, v in d.items() if v is not None}, "params": self.params.to_meta()}

    @classmethod
    def from_meta(cls, model: dict[str, Any]) -> ModelInfo:
        """From a meta.json "model" section; a missing field is refused in one line (ArtifactError)."""
        try:
            p = model["params"]
            params = ParamCounts(
                embedding=int(p["embedding"]), lm_head=int(p.get("lm_head", 0)),
                # older profiles name only the final norm
                other=int(p["other"]) if "other" in p else int(p.get("final_norm", 0)),
                attention_per_layer=tuple(int(x) for x in p["attention_per_layer"]),
                ffn_per_layer=tuple(int(x) for x in p["ffn_per_layer"]))
            info = cls(
                name=str(model["name"]), source=model.get("source"), fingerprint=model.get("fingerprint"),
                family=model.get("family"), model_type=model.get("model_type"), activation=model.get("activation"),
                gated=bool(model["gated"]), n_layers=int(model["n_layers"]), d_model=int(model["d_model"]),
                n_neurons=int(model["n_neurons"]), ffn_bias=bool(model.get("ffn_bias", False)),
                num_attention_heads=int(model["num_attention_heads"]),
                num_key_value_heads=int(model["num_key_value_heads"]), head_dim=int(model["head_dim"]),
                vocab_size=int(model["vocab_size"]), weight_dtype=model.get("weight_dtype"), params=params)
        except KeyError as e:
            raise ArtifactError(f"profile meta.json lacks model field {e.args[0]!r}: re-run pi-profile") from None
        if len(params.attention_per_layer) != info.n_layers or len(params.ffn_per_layer) != info.n_layers:
            raise ArtifactError(f"profile meta.json: params per layer do not list {info.n_layers} layers: "
                                f"re-run pi-profile")
        return info

    @property
    def rows(self) -> int:
        """Weight rows per neuron: gate, up, down (gated) or up, down."""
        return 3 if self.gated else 2

    @property
    def neuron_params(self) -> int:
        """Parameters that move with one neuron: its rows plus its bias entries (up, and gate if gated)."""
        return self.rows * self.d_model + (self.rows - 1 if self.ffn_bias else 0)

    def ffn_fixed_params(self, layer: int) -> int:
        """FFN parameters not owned by any neuron (the down projection's bias)."""
        return max(0, self.params.ffn_per_layer[layer] - self.n_neurons * self.neuron_params)
