"""Model loading and one adapter per architecture family (where a model comes from, and its fingerprint:
common/model_source.py).

An adapter knows, for its family, where each decoder layer's FFN weights are (HF module names), whether the
FFN is gated, and which activation it uses. Every stage finds FFN tensors through it, never by guessing.

The per-neuron activation value is what enters the down projection (`fc2`, `down_proj`, `dense_4h_to_h`):
ungated `act(fc1(x))`, gated `act(gate_proj(x)) * up_proj(x)`, dReLU `relu(gate_proj(x)) * relu(up_proj(x))`.
A neuron whose value is exactly 0 contributes nothing, so skipping it is lossless.

The FFN input (what predictors see and what profile samples store) is the input of the FFN's first linear
layers: the hidden state after the pre-FFN norm (`final_layer_norm` in OPT, `post_attention_layernorm` in
LLaMA-style models, `ln_mlp` / `input_layernorm` in Falcon). The runtime has it before the FFN runs.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from hotneurons.common import sparse_act
from hotneurons.common.kinds import Activation, choose
from hotneurons.common.model_info import ModelInfo, ParamCounts, attention_heads
from hotneurons.common.model_source import ModelError, ModelSource, load_error, resolve_source, text_config
from hotneurons.models.hf_io import gguf_activation, hf_progress
from hotneurons.weights.formats import ALIASES, WeightFormat, weight_format
from torch import nn

# Activation kinds (common/kinds.Activation). ReLU-family kinds have exact zeros; the others need a magnitude threshold.
ACTIVATIONS = Activation.values()
RELU_FAMILY = tuple(a.value for a in Activation if a.relu_family)


@dataclass(frozen=True)
class FamilyAdapter:
    """Where one architecture family keeps its FFN, by HF module name relative to a decoder layer."""

    name: str
    model_types: tuple[str, ...]
    mlp: str  # FFN submodule of a decoder layer ("" = the layer itself, as in OPT)
    up: str  # first (up) projection, d -> n; gated models: the "up" branch
    down: str  # down projection, n -> d
    gate: str | None = None  # gated models only
    act_config_keys: tuple[str, ...] = ("hidden_act",)  # config attributes naming the activation
    experts: bool = False  # a mixture of experts: only models/ runs it yet (MOE_ADAPTER)

    @property
    def gated(self) -> bool:
        return self.gate is not None

    def activation(self, config: Any, override: str | None = None) -> Activation:
        """The activation kind from the config; `override` for dReLU remote-code models."""
        if override:
            return choose(override, Activation, "activation", ModelError, "activation")
        raw = next((getattr(config, k) for k in self.act_config_keys if getattr(config, k, None)), "")
        raw = str(raw).lower()
        if raw in ("drelu", "fatrelu"):  # written by pi-relufy (common/sparse_act.py)
            return Activation(raw)
        if raw.startswith("relu"):
            return Activation.REGLU if self.gated else Activation.RELU
        if raw in ("silu", "swish"):
            return Activation.SWIGLU if self.gated else Activation.GELU  # ungated SiLU is thresholded like GELU
        if raw.startswith("gelu"):
            return Activation.GEGLU if self.gated else Activation.GELU
        raise ModelError(f"activation '{raw}' of {self.name} model is not supported; name one of "
                         f"{', '.join(ACTIVATIONS)} explicitly", params="activation")

    def layer_ffn(self, layer: nn.Module) -> dict[str, nn.Linear]:
        """{"up", "down", "gate"?} -> the nn.Linear modules of one decoder layer's FFN."""
        if self.experts:
            raise ExpertsRefused(_MOE_REFUSAL.format("its layers are mixtures of experts"), params="model")
        mlp = layer.get_submodule(self.mlp) if self.mlp else layer
        mods = {"up": mlp.get_submodule(self.up), "down": mlp.get_submodule(self.down)}
        if self.gate:
            mods["gate"] = mlp.get_submodule(self.gate)
        return mods

    def ffn_module(self, layer: nn.Module) -> nn.Module | None:
        return layer.get_submodule(self.mlp) if self.mlp else None


_GATED = dict(mlp="mlp", up="up_proj", down="down_proj", gate="gate_proj")
ADAPTERS: dict[str, FamilyAdapter] = {
    "opt": FamilyAdapter("opt", ("opt",), mlp="", up="fc1", down="fc2", act_config_keys=("activation_function",)),
    "llama": FamilyAdapter("llama", ("llama", "mistral", "mixtral_dense", "qwen2", "qwen3"), **_GATED),
    "falcon": FamilyAdapter("falcon", ("falcon",), mlp="mlp", up="dense_h_to_4h", down="dense_4h_to_h",
                            act_config_keys=("activation",)),
    "gemma": FamilyAdapter("gemma", ("gemma", "gemma2", "gemma3", "gemma3_text"), **_GATED,
                           act_config_keys=("hidden_activation", "hidden_act")),
}

# Mixtures of experts: models/ runs them (models/moe.py), but the profiler, solver and runtime count and place one
# dense FFN's neurons per layer: adapter_for refuses them unless asked (ModelConfig.from_hf: experts=True)
MOE_ADAPTER = FamilyAdapter("moe", ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"), **_GATED, experts=True)
_MOE_REFUSAL = ("{}: mixtures of experts run from a local safetensors folder or GGUF file in pi-profile (layer by "
                "layer), pi-solve, pi-generate and pi-serve, not whole through transformers nor in pi-eval or "
                "pi-train-predictors (the router picks the experts: no predictors): run those on the local file")


class ExpertsRefused(ModelError):
    """A mixture of experts where the caller did not ask for one (adapter_for's `experts`)."""


def supported_model_types() -> list[str]:
    return sorted(t for a in ADAPTERS.values() for t in a.model_types)


def adapter_for(config: Any, experts: bool = False) -> FamilyAdapter:
    """The family adapter of a (text) config; a mixture of experts is refused in one line unless `experts`."""
    model_type = getattr(config, "model_type", None)
    for adapter in ADAPTERS.values():
        if model_type in adapter.model_types:
            return adapter
    if model_type in MOE_ADAPTER.model_types:
        if experts:
            return MOE_ADAPTER
        raise ExpertsRefused(_MOE_REFUSAL.format(f"model type '{model_type}' is a mixture of experts"),
                             params="model")
    raise ValueError(f"unsupported architecture '{model_type}': supported model types are "
                     f"{', '.join(supported_model_types())}")


def decoder_layers(model: nn.Module, config: Any) -> nn.ModuleList:
    """The ModuleList of decoder layers (found by length, so wrappers such as Gemma3's multimodal one work)."""
    n = text_config(config).num_hidden_layers
    for _, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n and "Layer" in type(mod[0]).__name__:
            return mod
    raise ValueError(f"could not find {n} decoder layers in {type(model).__name__}")


# ---------------------------------------------------------------------------------------------------------------
# Loading


def _load_errors_in_one_line(load):
    """`load_model` raising ModelError, in one line, for whatever transformers raises on a model it cannot find or
    read (OSError, huggingface_hub's errors, a broken config.json)."""
    @functools.wraps(load)
    def wrapper(model: str | None = None, *args, **kw):
        try:
            return load(model, *args, **kw)
        except ModelError:
            raise
        except (OSError, json.JSONDecodeError) as e:
            raise load_error(model or "SmolLM2-135M-Instruct", e) from None
        except ValueError as e:
            from huggingface_hub.errors import HFValidationError

            if isinstance(e, HFValidationError):
                raise load_error(model or "", e) from None
            raise
    return wrapper


def check_model(model: str | None, gguf_file: str | None = None, *, revision: str | None = None,
                trust_remote_code: bool = False, activation: str | None = None, experts: bool = False) -> ModelSource:
    """What `load_model` would refuse, found before any weights load: the source exists (a GGUF file starts with
    the GGUF magic), a hub id is in the local cache or the hub answers, and the architecture and activation are
    supported (a mixture of experts only with `experts`: pi-profile's layer-by-layer path). Reads only the config
    (not a GGUF's: that would read its tensors' table)."""
    source = resolve_source(model, gguf_file, revision)
    if source.gguf_file:
        path = os.path.join(source.path, source.gguf_file)
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic not in (b"GGUF", b"PWRI"):  # PWRI: PowerInfer's own files (read in place only)
            raise ModelError(f"'{path}' is not a GGUF file (it does not start with GGUF)", params="model")
        return source
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source.path, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        if isinstance(e, ModelError):
            raise
        raise load_error(source.name, e) from None
    adapter = adapter_for(text_config(config), experts)
    adapter.activation(text_config(config), activation)
    return source


# the compute dtypes a model runs in, by weights/formats.py's names (f32, f16, bf16; its ALIASES fp16, float16, ...
# parse too); f64 for the float64 references
_COMPUTE_DTYPES = {WeightFormat.F32: torch.float32, WeightFormat.F16: torch.float16, WeightFormat.BF16: torch.bfloat16,
                   WeightFormat.F64: torch.float64}


def pick_dtype(dtype: str, device: str) -> torch.dtype:
    """One place decides the compute dtype: f32 on CPU (fast there), f16 on CUDA unless told otherwise. Any spelling
    of weights/formats.py's (f16, fp16, float16, ...) is read."""
    if dtype == "auto":
        return torch.float16 if device.startswith("cuda") else torch.float32
    try:
        fmt = weight_format(dtype)
    except ValueError:
        fmt = None
    if fmt not in _COMPUTE_DTYPES:  # a one-line error listing every spelling read
        names = [str(f) for f in _COMPUTE_DTYPES] + [a for a, f in ALIASES.items() if f in _COMPUTE_DTYPES]
        choose(dtype, ["auto", *names], "dtype", ModelError, "dtype")
    return _COMPUTE_DTYPES[fmt]


def pick_device(device: str = "auto") -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"device '{device}' asked for but CUDA is not available: use the CPU", params="device")
    return device


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any
    adapter: FamilyAdapter
    activation: str
    source: ModelSource
    info: dict[str, Any]  # the "model" section of every stage's meta.json
    cache: Any = None  # decoding: the KV cache of the sequence in progress (`prefill` starts it, `step` extends it)

    @property
    def layers(self) -> nn.ModuleList:
        return decoder_layers(self.model, self.model.config)

    # -- decoding, as runtime/lm.DecodeModel describes it (the runtime's transformers path) --------------------------
    @property
    def vocab(self) -> int:
        return int(self.model.get_input_embeddings().num_embeddings)

    @property
    def eos(self) -> set[int]:
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return set(eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos]))

    @property
    def ctx(self) -> int:
        cfg = text_config(self.model.config)
        return int(getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", 2048))

    @property
    def static_ctx(self) -> None:
        return None  # transformers' cache grows as it is filled

    def prefill(self, rt: Any, ids: list[int]) -> torch.Tensor:
        logits, self.cache = step(self.model, torch.tensor([ids], device=rt.device))  # (1, T, vocab)
        return logits[0, -1]

    def step(self, rt: Any, token: int, pos: int) -> torch.Tensor:
        """`pos` is the cache's length already: transformers counts the positions itself."""
        logits, self.cache = step(self.model, torch.tensor([[token]], device=rt.device), self.cache)  # (1, 1, vocab)
        return logits[0, -1]


@_load_errors_in_one_line
def load_model(model: str | None = None, gguf_file: str | None = None, *, revision: str | None = None,
               device: str = "cpu", dtype: str = "auto", trust_remote_code: bool = False,
               activation: str | None = None, progress: bool | None = None, cache: bool = True) -> LoadedModel:
    """Load a causal LM + tokenizer through transformers (hub id, folder or GGUF) and pick its adapter.

    A GGUF file is de-quantized once and then loaded from its cache entry (common/gguf_cache.py) unless `cache` is
    False or HOTNEURONS_CACHE=off; the LoadedModel (fingerprint, source) is the same either way. `progress`: show
    transformers' loading bars (None: only while de-quantizing a GGUF, the one slow load).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = resolve_source(model, gguf_file, revision)
    torch_dtype = pick_dtype(dtype, device)
    entry = None
    if source.gguf_file and cache:
        from hotneurons.common import gguf_cache

        entry = gguf_cache.entry_for(os.path.join(source.path, source.gguf_file), str(torch_dtype).split(".")[-1])
    if entry is not None and entry.valid():
        try:
            with hf_progress(bool(progress)):
                config = AutoConfig.from_pretrained(entry.folder)
                adapter_for(text_config(config)).activation(text_config(config), activation)
                hf_model = AutoModelForCausalLM.from_pretrained(entry.folder, config=config, dtype=torch_dtype)
                tokenizer = AutoTokenizer.from_pretrained(entry.folder)
            return wrap_model(hf_model.to(device), tokenizer, source, activation)
        except ModelError:
            raise
        except Exception as e:  # a damaged entry: rebuild it from the GGUF
            import warnings

            warnings.warn(f"ignoring the GGUF cache entry {entry.folder} ({type(e).__name__}: {e}); rebuilding it",
                          stacklevel=2)
            entry.remove()
    kw: dict[str, Any] = dict(revision=revision, trust_remote_code=trust_remote_code)
    if source.gguf_file:
        kw["gguf_file"] = source.gguf_file
    with hf_progress(progress if progress is not None else bool(source.gguf_file)):
        config = AutoConfig.from_pretrained(source.path, **kw)
        if source.gguf_file and activation is None:  # what the file records (transformers reads llama as SwiGLU)
            gguf_activation(os.path.join(source.path, source.gguf_file), text_config(config))
        adapter = adapter_for(text_config(config))
        adapter.activation(text_config(config), activation)  # fail before loading weights
        patched, threshold = sparse_act.config_activation(text_config(config))
        if patched:  # dReLU / FATReLU: built as ReGLU, then each FFN patched (common/sparse_act.py)
            text_config(config).hidden_act = "relu"
        hf_model = AutoModelForCausalLM.from_pretrained(source.path, config=config, dtype=torch_dtype, **kw)
        tokenizer = AutoTokenizer.from_pretrained(source.path, **kw)
    if patched:
        sparse_act.patch_ffn([adapter.ffn_module(layer) for layer in decoder_layers(hf_model, hf_model.config)],
                             patched, threshold)
        text_config(hf_model.config).hidden_act = patched
    if entry is not None and not patched:
        entry.save(hf_model, tokenizer)
    return wrap_model(hf_model.to(device), tokenizer, source, activation)


def load_model_from_meta(info: dict[str, Any], model: str | None = None, gguf_file: str | None = None, *,
                         device: str = "cpu", dtype: str = "auto", trust_remote_code: bool = False) -> LoadedModel:
    """The model an artifact was made for, from its meta.json "model" section, unless `model` names another
    (later stages then compare fingerprints and refuse a mismatch)."""
    activation = None
    if model is None:
        src = info["source"]
        model = src["path"] if src["kind"] in ("gguf", "folder") else info["name"]
        gguf_file = gguf_file or src.get("gguf_file")
        activation = info["activation"] if info["activation"] == "drelu" else None  # not readable from configs
    return load_model(model, gguf_file, device=device, dtype=dtype, trust_remote_code=trust_remote_code,
                      activation=activation, revision=info.get("source", {}).get("revision"))


def wrap_model(hf_model: nn.Module, tokenizer: Any, source: ModelSource, activation: str | None = None) -> LoadedModel:
    """A LoadedModel around an HF causal LM already in memory (benchmarks build random ones this way)."""
    cfg = text_config(hf_model.config)
    adapter = adapter_for(cfg)
    act = adapter.activation(cfg, activation)
    hf_model.eval()
    info = model_info(hf_model, adapter, act, source, next(hf_model.parameters()).dtype)
    return LoadedModel(hf_model, tokenizer, adapter, act, source, info)


def model_info(model: nn.Module, adapter: FamilyAdapter, activation: str, source: ModelSource,
               dtype: torch.dtype) -> dict[str, Any]:
    """The meta.json "model" section (common/model_info.ModelInfo) of a loaded model, counted from its modules."""
    cfg = text_config(model.config)
    layers = decoder_layers(model, model.config)
    up = adapter.layer_ffn(layers[0])["up"]
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == emb.data_ptr()
    n_heads, n_kv, head_dim = attention_heads(cfg)
    params = ParamCounts.count(
        sum(p.numel() for p in model.parameters()), emb.numel(), 0 if (head is None or tied) else head.weight.numel(),
        [sum(p.numel() for p in layer.parameters()) for layer in layers],
        [sum(p.numel() for m in adapter.layer_ffn(layer).values() for p in m.parameters()) for layer in layers])
    return ModelInfo.of(
        source, model.config, family=adapter.name, model_type=cfg.model_type, activation=activation,
        gated=adapter.gated, n_layers=len(layers), d_model=up.in_features, n_neurons=up.out_features,
        ffn_bias=up.bias is not None, num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=head_dim,
        vocab_size=cfg.vocab_size, weight_dtype=str(dtype).removeprefix("torch."), params=params).to_meta()


@functools.lru_cache(maxsize=None)
def _cache_arg(forward_type: type) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(forward_type.forward).parameters else "past_key_values"


def step(model: nn.Module, input_ids: torch.Tensor, cache: Any = None) -> tuple[torch.Tensor, Any]:
    """One cached forward of a transformers causal LM: (logits (batch, T, vocab), its cache). transformers 5.2x names
    the cache `cache` and warns on every call that passes `past_key_values`; earlier versions know only the latter."""
    name = _cache_arg(type(model))
    out = model(input_ids=input_ids, use_cache=True, **({} if cache is None else {name: cache}))
    return out.logits, out[name]
