"""Tiny random models of every supported family, saved with save_pretrained so that tests and benchmark checks load
them the user's way. Tests import it as `tiny`, bench as `tests.tiny`: the models are a test fixture, and the few
benchmark checks that run them live, like tests/, only in a checkout, so the one copy sits here."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 259  # 256 bytes + <s>, </s>, <pad>
# A minimal chat template, so that chat paths (pi-generate --chat, pi-serve's chat completions) run on tiny models.
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def byte_tokenizer():
    """A byte-level tokenizer (no merges): every text tokenises, no download needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for tok in ("<s>", "</s>", "<pad>"):
        vocab[tok] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   chat_template=CHAT_TEMPLATE)


def _configs():
    from transformers import (
        FalconConfig,
        Gemma3TextConfig,
        GemmaConfig,
        LlamaConfig,
        MistralConfig,
        OPTConfig,
        Qwen2Config,
        Qwen3Config,
    )

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=256, bos_token_id=256, eos_token_id=257, pad_token_id=258)
    gated = dict(common, intermediate_size=48, num_key_value_heads=2)
    return {
        "opt": lambda: OPTConfig(**{**common, "ffn_dim": 48, "word_embed_proj_dim": 32, "activation_function": "relu"}),
        "llama-reglu": lambda: LlamaConfig(**gated, hidden_act="relu"),
        "mistral-drelu": lambda: MistralConfig(**gated, hidden_act="relu"),
        "llama-swiglu": lambda: LlamaConfig(**gated, hidden_act="silu"),
        "qwen2-swiglu": lambda: Qwen2Config(**gated, hidden_act="silu"),
        "qwen3-swiglu": lambda: Qwen3Config(**gated, head_dim=8, hidden_act="silu"),  # per-head q/k norms
        "falcon-relu": lambda: FalconConfig(**common, activation="relu", bias=True),
        "falcon-gelu": lambda: FalconConfig(**common, activation="gelu", new_decoder_architecture=True,
                                            num_kv_heads=2),
        "gemma-geglu": lambda: GemmaConfig(**gated, head_dim=8, hidden_activation="gelu_pytorch_tanh"),
        "gemma3-geglu": lambda: Gemma3TextConfig(**gated, head_dim=8, hidden_activation="gelu_pytorch_tanh",
                                                 sliding_window=16),
    }


def _moe_configs():
    """Mixtures of experts: 4 experts, 2 per token. Apart from FAMILIES: the profiler, solver and runtime, whose tests
    run every family, do not run experts yet (models/family.MOE_ADAPTER); models/ does (tests/test_models_moe.py)."""
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, bos_token_id=256, eos_token_id=257, pad_token_id=258,
                  num_experts_per_tok=2, hidden_act="silu")
    return {
        "mixtral": lambda: MixtralConfig(**common, intermediate_size=32, num_local_experts=4),  # renormalises top-k
        "qwen2-moe": lambda: Qwen2MoeConfig(**common, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                                            shared_expert_intermediate_size=48, norm_topk_prob=False),
        "qwen3-moe": lambda: Qwen3MoeConfig(**common, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                                            head_dim=16, norm_topk_prob=True),  # per-head q/k norms, 4 x 16 != 32
        "olmoe": lambda: OlmoeConfig(**common, intermediate_size=16, num_experts=4, norm_topk_prob=False),  # whole q/k
    }


FAMILIES = list(_configs())
MOE_FAMILIES = list(_moe_configs())
ACTIVATION_OVERRIDE = {"mistral-drelu": "drelu"}  # dReLU models are remote code; see make_drelu


def build(name: str, folder: Path, seed: int = 0) -> Path:
    """Random weights (slightly scaled up so activations are not all tiny), saved to `folder`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config({**_configs(), **_moe_configs()}[name]())
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # matrices, and the experts' stacked ones (E, out, in)
                p.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def make_drelu(lm) -> None:
    """Turn a loaded ReLU Mistral into a dReLU one (relu on both branches), as Bamboo/TurboSparse's own code does."""
    import types

    def drelu_forward(m, x):
        return m.down_proj(torch.relu(m.gate_proj(x)) * torch.relu(m.up_proj(x)))

    for layer in lm.layers:  # a bound method: deepcopy and .to() of the model carry it along
        layer.mlp.forward = types.MethodType(drelu_forward, layer.mlp)


def load_rounded(folder, family: str):
    """A tiny model on the CPU in float32 with its FFN weights rounded to bf16 (what the runtime's cold rows store),
    so that the runtime and HF `generate` compute with the same weights."""
    from hotneurons.models.family import load_model

    lm = load_model(str(folder), device="cpu", dtype="float32", activation=ACTIVATION_OVERRIDE.get(family))
    if family == "mistral-drelu":
        make_drelu(lm)
    with torch.no_grad():
        for layer in lm.layers:
            for m in lm.adapter.layer_ffn(layer).values():
                m.weight.copy_(m.weight.bfloat16().float())
    return lm


def round_ffns_to_int8(lm, group: int | None = None) -> None:
    """FFN weights -> what int8 cold rows with a scale per `group` weights (default: the runtime's INT8_GROUP) stand
    for, in place: groups along each neuron's gate and up rows and its down column, as the runtime stores them."""
    from hotneurons.kernels.cold import INT8_GROUP
    from hotneurons.runtime.cold_rows import from_int8_groups, to_int8_groups

    group = group or INT8_GROUP
    with torch.no_grad():
        for layer in lm.layers:
            for name, m in lm.adapter.layer_ffn(layer).items():
                w = m.weight.T if name == "down" else m.weight  # (n, d): one row per neuron
                back = from_int8_groups(*to_int8_groups(w, group), group)
                m.weight.copy_(back.T if name == "down" else back)


def write_predictors(run: Path, info: dict, threshold: float, hidden: int = 8,
                     tensors: dict[str, torch.Tensor] | None = None) -> None:
    """RUN/predictors written by hand (export.predictors.write_predictors, normed form), so a test or a benchmark
    needs no training: random weights of `hidden` units and one `threshold` for every layer, or `tensors` as
    predictors.safetensors holds them (layers.{i}.fc1.weight, .fc2.weight, .threshold: their own thresholds). Tied
    to RUN/profile when the run has one."""
    from hotneurons.export.predictors import Form
    from hotneurons.export.predictors import write_predictors as write

    L, d, n = info["n_layers"], info["d_model"], info["n_neurons"]
    if tensors is None:
        torch.manual_seed(0)
        layers = [(torch.randn(hidden, d), torch.randn(n, hidden)) for _ in range(L)]
        write(run, info, layers, threshold, Form.NORMED, name="random")
        return
    layers = [(tensors[f"layers.{i}.fc1.weight"], tensors[f"layers.{i}.fc2.weight"]) for i in range(L)]
    write(run, info, layers, [float(tensors[f"layers.{i}.threshold"]) for i in range(L)], Form.NORMED, name="given")
