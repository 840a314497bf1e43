"""Weight sources (weights/source.py, gguf_source.py, safetensors_source.py): every canonical tensor of every tiny
family equals the HF model's parameter; GGUFs written in llama.cpp's conventions (Q/K permuted, Gemma norms + 1,
Falcon QKV regrouped; F16, Q8_0 and Q4_0 tensors) read back as HF's values; the activation survives a round trip;
a PowerInfer file reads as model + predictors + GPU index; get() is a view of the map; release() lowers RSS; bad
inputs give one-line errors."""

from pathlib import Path

import numpy as np
import pytest
import tiny
import torch
from hotneurons.common.kinds import Activation
from hotneurons.common.model_source import ModelError
from hotneurons.export.gguf_model import llama_metadata, permute_qk, vocab_from_tokenizer
from hotneurons.models.family import adapter_for
from hotneurons.weights.formats import WeightFormat
from hotneurons.weights.gguf_file import GGUFFile
from hotneurons.weights.gguf_source import GGUFSource
from hotneurons.weights.qtensor import QTensor
from hotneurons.weights.safetensors_source import SafetensorsSource
from hotneurons.weights.source import open_source
from transformers import AutoModelForCausalLM, AutoTokenizer

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# canonical -> HF name, written out here apart from weights/names.py; "{i}" is the layer
LLAMA = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
         "output.weight": "lm_head.weight", "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
         **{f"blk.{{i}}.attn_{a}.weight": f"model.layers.{{i}}.self_attn.{b}_proj.weight"
            for a, b in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))},
         "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
         **{f"blk.{{i}}.ffn_{a}.weight": f"model.layers.{{i}}.mlp.{a}_proj.weight" for a in ("gate", "up", "down")}}
QK_NORM = {"blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
           "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight"}
GEMMA3 = {**LLAMA, **QK_NORM, "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
          "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
          "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight"}
OPT = {"token_embd.weight": "model.decoder.embed_tokens.weight",
       "position_embd.weight": "model.decoder.embed_positions.weight",
       **{f"output_norm.{s}": f"model.decoder.final_layer_norm.{s}" for s in ("weight", "bias")},
       **{f"blk.{{i}}.{a}.{s}": f"model.decoder.layers.{{i}}.{b}.{s}" for s in ("weight", "bias") for a, b in (
           ("attn_norm", "self_attn_layer_norm"), ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
           ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.out_proj"), ("ffn_norm", "final_layer_norm"),
           ("ffn_up", "fc1"), ("ffn_down", "fc2"))}}
_FALCON_LINEAR = (("attn_qkv", "self_attention.query_key_value"), ("attn_output", "self_attention.dense"),
                  ("ffn_up", "mlp.dense_h_to_4h"), ("ffn_down", "mlp.dense_4h_to_h"))
FALCON = {"token_embd.weight": "transformer.word_embeddings.weight",
          **{f"output_norm.{s}": f"transformer.ln_f.{s}" for s in ("weight", "bias")},
          **{f"blk.{{i}}.attn_norm.{s}": f"transformer.h.{{i}}.input_layernorm.{s}" for s in ("weight", "bias")},
          **{f"blk.{{i}}.{a}.{s}": f"transformer.h.{{i}}.{b}.{s}"
             for a, b in _FALCON_LINEAR for s in ("weight", "bias")}}
FALCON_NEW = {"token_embd.weight": "transformer.word_embeddings.weight",
              **{f"output_norm.{s}": f"transformer.ln_f.{s}" for s in ("weight", "bias")},
              **{f"blk.{{i}}.attn_norm.{s}": f"transformer.h.{{i}}.ln_mlp.{s}" for s in ("weight", "bias")},
              **{f"blk.{{i}}.attn_norm_2.{s}": f"transformer.h.{{i}}.ln_attn.{s}" for s in ("weight", "bias")},
              **{f"blk.{{i}}.{a}.weight": f"transformer.h.{{i}}.{b}.weight" for a, b in _FALCON_LINEAR}}
EXPECTED = {"opt": OPT, "llama-reglu": LLAMA, "mistral-drelu": LLAMA, "llama-swiglu": LLAMA,
            "qwen2-swiglu": {**LLAMA, **{f"blk.{{i}}.attn_{a}.bias": f"model.layers.{{i}}.self_attn.{a}_proj.bias"
                                         for a in "qkv"}},
            "qwen3-swiglu": {**LLAMA, **QK_NORM}, "falcon-relu": FALCON, "falcon-gelu": FALCON_NEW,
            "gemma-geglu": LLAMA, "gemma3-geglu": GEMMA3}
TIED = {"opt", "falcon-relu", "falcon-gelu", "gemma-geglu", "gemma3-geglu"}


def expected_names(family: str, n_layers: int) -> dict[str, str]:
    out = {}
    for c, h in EXPECTED[family].items():
        for i in range(n_layers) if "{i}" in c else [None]:
            out[c.format(i=i)] = h.format(i=i)
    if family in TIED:
        out.pop("output.weight", None)
    return out


def hf_state(folder: Path) -> tuple[dict[str, torch.Tensor], object]:
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}, model.config


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_safetensors_tensors_equal_the_hf_parameters(family, tiny_model_dir):
    folder = tiny_model_dir(family)
    state, cfg = hf_state(folder)
    with open_source(folder) as src:
        assert isinstance(src, SafetensorsSource) and src.activation is None
        want = expected_names(family, cfg.num_hidden_layers)
        assert set(src.infos) == set(want)
        assert src.tied == (family in TIED) == bool(src.config.tie_word_embeddings)
        for name, hf in want.items():
            t = src.get(name)
            assert src.is_mapped(t), name  # a view of the file, no copy
            assert t.dtype == state[hf].dtype and torch.equal(t, state[hf]), name
            assert src.infos[name].shape == tuple(state[hf].shape) and src.infos[name].fmt == WeightFormat.F32


# ---------------------------------------------------------------------------------------------------------------
# GGUFs in llama.cpp's conventions, written here from the HF state


def falcon_regroup(w: torch.Tensor, n_head: int, n_kv: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's FalconModel: kv groups of (n_head/n_kv q, k, v) -> all q, all k, all v."""
    hd = w.shape[0] // (n_head + 2 * n_kv)
    qkv = w.reshape(n_kv, n_head // n_kv + 2, hd, *w.shape[1:])
    return torch.cat((qkv[:, :-2].reshape(-1, *w.shape[1:]), qkv[:, -2].reshape(-1, *w.shape[1:]),
                      qkv[:, -1].reshape(-1, *w.shape[1:])))


def llamacpp_value(arch: str, name: str, w: torch.Tensor, cfg) -> torch.Tensor:
    if arch == "llama" and ".attn_q." in name:
        return permute_qk(w, cfg.num_attention_heads)
    if arch == "llama" and ".attn_k." in name:
        return permute_qk(w, cfg.num_key_value_heads)
    if arch == "gemma" and name.endswith("norm.weight"):
        return w + 1
    if arch == "falcon" and ".attn_qkv." in name:
        return falcon_regroup(w, cfg.num_attention_heads, cfg.num_kv_heads)
    return w


def write_llamacpp(path: Path, family: str, arch: str, state, cfg, quant: dict[str, int] | None = None,
                   metadata=None) -> dict[str, tuple[np.ndarray, int]]:
    """A GGUF as llama.cpp's converter writes it: 2-D F16 (or `quant[name]`), 1-D F32. Returns name -> (what was
    written, ggml type)."""
    w = gguf.GGUFWriter(str(path), arch)
    if metadata is not None:
        metadata(w)
    else:  # the keys llama.cpp's converter writes, no hotneurons.activation
        w.add_name(family)
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.hidden_size)
        w.add_block_count(cfg.num_hidden_layers)
        w.add_feed_forward_length(getattr(cfg, "intermediate_size", None) or cfg.ffn_hidden_size)
        w.add_head_count(cfg.num_attention_heads)
        if arch == "falcon":
            w.add_head_count_kv(cfg.num_kv_heads)
            w.add_layer_norm_eps(cfg.layer_norm_epsilon)
        else:
            w.add_head_count_kv(cfg.num_key_value_heads)
            w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        if arch == "gemma":
            w.add_key_length(cfg.head_dim)
            w.add_value_length(cfg.head_dim)
        v = vocab_from_tokenizer(tiny.byte_tokenizer(), cfg.vocab_size)
        w.add_tokenizer_model(v.model)  # no merges (Vocab.add_to's placeholder merge is one transformers refuses)
        w.add_token_list(v.tokens)
        w.add_token_types(v.types)
        w.add_token_scores([0.0] * len(v.tokens))
        w.add_bos_token_id(v.bos)
        w.add_eos_token_id(v.eos)
    written = {}
    for name, hf in expected_names(family, cfg.num_hidden_layers).items():
        v = llamacpp_value(arch, name, state[hf], cfg).float().numpy()
        if v.ndim == 1:
            a, t = v.astype(np.float32), Q.F32
        elif quant and name in quant:
            a, t = gguf.quants.quantize(v, quant[name]), quant[name]
        else:
            a, t = v.astype(np.float16), Q.F16
        w.add_tensor(name, a, raw_dtype=t if t not in (Q.F32, Q.F16) else None)
        written[name] = (a, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


QUANT = {"blk.0.attn_q.weight": Q.Q4_0, "blk.1.attn_k.weight": Q.Q8_0, "blk.0.ffn_gate.weight": Q.Q8_0,
         "blk.1.ffn_up.weight": Q.Q4_0, "token_embd.weight": Q.Q8_0}


@pytest.fixture(scope="module")
def llama_gguf(tiny_model_dir, tmp_path_factory):
    state, cfg = hf_state(tiny_model_dir("llama-swiglu"))
    path = tmp_path_factory.mktemp("gguf") / "llama.gguf"
    written = write_llamacpp(path, "llama-swiglu", "llama", state, cfg, QUANT)
    return path, state, cfg, written


def test_gguf_reads_back_as_the_hf_values(llama_gguf):
    path, state, cfg, written = llama_gguf
    with open_source(path.parent, path.name) as src:
        assert isinstance(src, GGUFSource) and not src.powerinfer
        want = expected_names("llama-swiglu", cfg.num_hidden_layers)
        assert set(src.infos) == set(want)
        for name, hf in want.items():
            t, w = src.get(name), state[hf]
            assert src.infos[name].shape == tuple(w.shape), name
            if name in QUANT:  # the same blocks as quantizing HF's rows: Q/K row order is undone on whole rows
                blocks = gguf.quants.quantize(w.numpy(), QUANT[name])
                assert isinstance(t, QTensor) and t.shape == tuple(w.shape) and np.array_equal(t.data.numpy(), blocks)
                assert np.array_equal(gguf.quants.dequantize(t.data.numpy(), QUANT[name]),
                                      gguf.quants.dequantize(blocks, QUANT[name])), name
            else:
                assert torch.equal(t, w.to(t.dtype)) and t.dtype == (torch.float32 if w.dim() == 1 else torch.float16)
        c = src.config  # from the metadata alone
        assert (c.model_type, c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.num_attention_heads,
                c.num_key_value_heads, c.vocab_size, c.tie_word_embeddings) == (
            "llama", cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.vocab_size, False)
        assert src.activation == Activation.SWIGLU == adapter_for(c).activation(c)  # llama.cpp's llama: SwiGLU


def test_get_is_in_place_and_conversions_copy(llama_gguf):
    path, *_ = llama_gguf
    with GGUFSource(path) as src:
        base = src.file.buf  # the whole file, mapped
        q = src.get("blk.1.ffn_up.weight")  # Q4_0, no conversion
        assert isinstance(q, QTensor) and src.is_mapped(q) and np.shares_memory(q.data.numpy(), base)
        assert q.data.data_ptr() == base.ctypes.data + src.file.tensors["blk.1.ffn_up.weight"].offset
        f = src.get("blk.0.ffn_down.weight")  # F16
        assert f.dtype == torch.float16 and np.shares_memory(f.numpy(), base)
        assert src.infos["blk.0.attn_q.weight"].converted == "permuted rows"
        assert not src.is_mapped(src.get("blk.0.attn_q.weight"))  # a row gather (attention is small)
        assert src.release("blk.1.ffn_up.weight") >= 0 and torch.equal(q.data, src.get("blk.1.ffn_up.weight").data)


@pytest.mark.parametrize("family,arch", [("gemma-geglu", "gemma"), ("falcon-gelu", "falcon"),
                                         ("falcon-relu", "falcon")])
def test_gguf_conversions_of_other_families(family, arch, tiny_model_dir, tmp_path):
    state, cfg = hf_state(tiny_model_dir(family))
    write_llamacpp(tmp_path / "m.gguf", family, arch, state, cfg)
    with open_source(tmp_path / "m.gguf") as src:
        for name, hf in expected_names(family, cfg.num_hidden_layers).items():
            t, w = src.get(name), state[hf]
            if src.infos[name].converted == "norm shift":  # 1 + w - 1 in float32: within an ulp of 1
                assert t.dtype == torch.float32 and torch.allclose(t, w, rtol=0, atol=2.0 ** -23), name
            else:
                assert torch.equal(t, w.to(t.dtype)), name
        c, act = src.config, {"gemma": Activation.GEGLU, "falcon": Activation.GELU}[arch]
        assert src.activation == act == adapter_for(c).activation(c)
        assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (
            cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads)
        if arch == "falcon":
            assert (c.new_decoder_architecture, c.num_kv_heads, c.parallel_attn, c.bias) == (
                cfg.new_decoder_architecture, cfg.num_kv_heads, cfg.parallel_attn, cfg.bias)
        else:
            assert (c.head_dim, c.num_key_value_heads, c.intermediate_size) == (
                cfg.head_dim, cfg.num_key_value_heads, cfg.intermediate_size)


@pytest.mark.parametrize("family,act", [("llama-reglu", "reglu"), ("mistral-drelu", "drelu"),
                                        ("llama-reglu", "fatrelu")])
def test_activation_survives_a_gguf_round_trip(family, act, tiny_model_dir, tmp_path):
    from hotneurons.common.sparse_act import config_activation

    state, cfg = hf_state(tiny_model_dir(family))
    cfg.fat_threshold = 0.5
    write_llamacpp(tmp_path / "m.gguf", family, "llama", state, cfg,
                   metadata=lambda w: llama_metadata(w, cfg, family, act))  # export/gguf_model.py's keys
    with open_source(tmp_path / "m.gguf") as src:
        assert src.activation == Activation(act) == adapter_for(src.config).activation(src.config)
        # what models/family.py's loader patches the FFNs by (dReLU, FATReLU and its threshold)
        assert config_activation(src.config) == ((act, 0.5 if act == "fatrelu" else 0.0) if act != "reglu"
                                                 else (None, 0.0))


# ---------------------------------------------------------------------------------------------------------------
# PowerInfer's files


@pytest.fixture(scope="module")
def powerinfer_files(tmp_path_factory):
    from hotneurons.export import roundtrip as rt
    from hotneurons.export.powerinfer import write_powerinfer
    from transformers import AutoTokenizer

    work = tmp_path_factory.mktemp("pwri")
    folder = rt.build_model(work / "model", hidden_size=32, intermediate_size=1024, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2)
    state, cfg = hf_state(folder)
    tok = AutoTokenizer.from_pretrained(str(folder))
    g = torch.Generator().manual_seed(0)
    preds = [(torch.randn(8, 32, generator=g).half().float(), torch.randn(1024, 8, generator=g).half().float())
             for _ in range(2)]
    masks = [torch.rand(1024, generator=g).numpy() < 0.3 for _ in range(2)]
    counts = [np.arange(1024) for _ in range(2)]
    summary = write_powerinfer(state, vocab_from_tokenizer(tok, cfg.vocab_size), preds, 0.25, counts, masks, 1 << 20,
                               work / "out", config=cfg)
    return work / "out" / summary["files"]["model"], state, cfg, preds, masks


def test_powerinfer_file_reads_as_model_predictors_and_gpu_index(powerinfer_files, tmp_path):
    path, state, cfg, preds, masks = powerinfer_files
    with open_source(path) as src:
        assert src.powerinfer and src.activation == Activation.REGLU == adapter_for(src.config).activation(src.config)
        assert src.sparse_threshold == 0.25
        for name, hf in expected_names("llama-reglu", 2).items():
            if ".ffn_down." in name:
                name = name.replace("ffn_down", "ffn_down_t")
                info = src.infos[name]
                assert info.transposed and info.shape == (1024, 32)
                assert torch.equal(src.get(name), state[hf].T.half()), name
            else:
                assert torch.equal(src.get(name), state[hf].to(src.get(name).dtype)), name
        for i in range(2):
            fc1, fc2 = src.predictor(i)
            assert torch.equal(fc1.float(), preds[i][0]) and torch.equal(fc2.float(), preds[i][1])
        assert all(np.array_equal(a, b) for a, b in zip(src.gpu_index(), masks, strict=True))
        assert src.config.intermediate_size == 1024 and src.config.num_key_value_heads == 2
        # the tokenizer transformers builds from the same metadata (it refuses the PWRI magic: a GGUF copy here)
        data = bytearray(path.read_bytes())
        data[:4] = b"GGUF"
        (tmp_path / "copy.gguf").write_bytes(data)
        text = "The quick brown fox jumps over the lazy dog and then <s> again</s>"
        theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="copy.gguf")
        assert src.tokenizer()(text)["input_ids"] == theirs(text)["input_ids"]
        with GGUFSource(tmp_path / "copy.gguf") as plain:
            assert plain.activation == Activation.REGLU  # our key, where the arch (llama) alone says SwiGLU


def test_header_parser_agrees_with_gguf_py(llama_gguf, powerinfer_files, tmp_path):
    data = bytearray(powerinfer_files[0].read_bytes())
    data[:4] = b"GGUF"  # GGUFReader refuses PWRI
    (tmp_path / "pwri.gguf").write_bytes(data)
    for path in (llama_gguf[0], tmp_path / "pwri.gguf"):
        ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
        assert [(t.name, t.shape, t.ggml_type, t.offset, t.nbytes) for t in ours.tensors.values()] == [
            (t.name, tuple(int(n) for n in reversed(t.shape.tolist())), int(t.tensor_type), t.data_offset, t.n_bytes)
            for t in ref.tensors]
        for key, f in ref.fields.items():
            if not key.startswith("GGUF."):
                assert ours.array(key) == pytest.approx(f.contents()), key


def test_block_formats_read_as_qtensors(tmp_path):
    """Q4_1 and the K formats of Q4_K_M files come as QTensors of their stored rows."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    for k, v in (("embedding_length", 256), ("block_count", 1), ("feed_forward_length", 256),
                 ("attention.head_count", 2)):
        w.add_uint32(f"llama.{k}", v)
    rows = {"token_embd.weight": Q.Q4_K, "blk.0.ffn_gate.weight": Q.Q5_K, "blk.0.ffn_up.weight": Q.Q6_K,
            "blk.0.ffn_down.weight": Q.Q4_1}
    blocks = {}
    for name, t in rows.items():
        block, bb = gguf.GGML_QUANT_SIZES[t]
        shape = (300 if name == "token_embd.weight" else 256, 256 // block * bb)  # rows of 256 weights
        blocks[name] = rng.integers(0, 256, shape, dtype=np.uint8)
        w.add_tensor(name, blocks[name], raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open_source(tmp_path / "k.gguf") as src:
        assert src.config.vocab_size == 300 and src.config.intermediate_size == 256
        for name, t in rows.items():
            q = src.get(name)
            assert isinstance(q, QTensor) and q.fmt == WeightFormat(t.name.lower()) and src.is_mapped(q)
            assert q.shape == (blocks[name].shape[0], 256) and np.array_equal(q.data.numpy(), blocks[name])


def test_sharded_safetensors(tiny_model_dir, tmp_path):
    state, cfg = hf_state(tiny_model_dir("qwen3-swiglu"))
    AutoModelForCausalLM.from_pretrained(str(tiny_model_dir("qwen3-swiglu"))).save_pretrained(
        tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 2
    with open_source(tmp_path) as src:
        want = expected_names("qwen3-swiglu", cfg.num_hidden_layers)
        assert set(src.infos) == set(want) and all(torch.equal(src.get(n), state[h]) for n, h in want.items())


def test_config_and_tokenizer_read_no_tensor(llama_gguf, monkeypatch):
    path, *_ = llama_gguf

    def refuse(*a, **k):
        raise AssertionError("a tensor was de-quantized")

    monkeypatch.setattr(gguf, "dequantize", refuse)
    monkeypatch.setattr(gguf.quants, "dequantize", refuse)
    with GGUFSource(path) as src:
        assert src.config.hidden_size == 32
        tok = src.tokenizer()
        theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)  # transformers' own way
    text = "Sparse <s>activations</s> make large models fast."
    assert tok.vocab_size == 259 and tok(text)["input_ids"] == theirs(text)["input_ids"]


# ---------------------------------------------------------------------------------------------------------------
# Memory and errors


def _mapping_rss(t: torch.Tensor) -> int:
    """Resident bytes of the one memory mapping that holds t's first byte (its Rss line in /proc/self/smaps): this
    process's pages of that file alone, which neither other processes nor this one's allocations move."""
    addr = t.data_ptr()
    rss, inside = None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "Rss:":
                rss = int(line.split()[1]) << 10
                break
    assert rss is not None, f"no mapping holds address {addr:#x}"
    return rss


def _ones_embedding(folder: Path) -> Path:
    """A safetensors folder whose only tensor is a 64 MiB bf16 embedding of ones (32768 x 1024)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=1024, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                vocab_size=32768).save_pretrained(folder)
    save_file({"model.embed_tokens.weight": torch.ones(32768, 1024, dtype=torch.bfloat16)},
              str(folder / "model.safetensors"))
    return folder


def test_release_lowers_rss(tmp_path):
    with open_source(_ones_embedding(tmp_path)) as src:
        t = src.get("token_embd.weight")
        assert t.dtype == torch.bfloat16 and src.is_mapped(t)
        before = _mapping_rss(t)
        assert float(t.view(-1)[::2048].float().sum()) == 32768 * 1024 / 2048  # one value a page: all pages in
        read = _mapping_rss(t)
        assert read - before > 48 << 20
        assert src.release("token_embd.weight") > 63 << 20
        assert read - _mapping_rss(t) > 63 << 20
        assert float(t[-1, -1]) == 1.0  # still valid: the page comes back from the file


def test_release_view_drops_those_rows_only(tmp_path):
    """release_view drops the pages of some rows of a mapped tensor (the other rows stay resident) and leaves a copy
    or a strided view alone (0 bytes: dropping a copy's anonymous pages would zero it)."""
    with open_source(_ones_embedding(tmp_path)) as src:
        t = src.get("token_embd.weight")
        copy = t[:4096].clone()  # (4096, 1024) 8 MiB anonymous
        assert float(t.view(-1)[::2048].float().sum()) == 32768 * 1024 / 2048  # every page in
        read = _mapping_rss(t)
        assert read >= 64 << 20
        assert src.release_view(copy) == 0 and src.release_view(t[:, :8]) == 0
        assert float(copy.float().sum()) == 4096 * 1024
        assert _mapping_rss(t) == read
        released = src.release_view(t[:16384])  # the first half: 32 MiB
        assert (32 << 20) - 4096 <= released <= 32 << 20
        assert (32 << 20) - 4096 <= read - _mapping_rss(t) <= 32 << 20  # the other half still resident
        assert float(t[:16384].float().sum()) == 16384 * 1024  # read again from the file


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_one_line_errors(tmp_path, llama_gguf):
    with pytest.raises(ModelError) as e:
        open_source(tmp_path / "nothing")
    assert "does not exist" in one_line(e)
    (tmp_path / "x.gguf").write_text("not a model")
    with pytest.raises(ModelError) as e:
        open_source(tmp_path / "x.gguf")
    assert "not a GGUF file" in one_line(e)
    with pytest.raises(ModelError) as e:
        open_source(tmp_path, "missing.gguf")
    assert "not found" in one_line(e)
    (tmp_path / "x.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")  # a truncated header
    with pytest.raises(ModelError) as e:
        open_source(tmp_path / "x.gguf")
    assert "not a readable GGUF file" in one_line(e)
    w = gguf.GGUFWriter(str(tmp_path / "q1.gguf"), "llama")  # a type nothing de-quantizes, gguf-py included
    w.add_tensor("token_embd.weight", np.zeros((4, 18), dtype=np.uint8), raw_dtype=Q.Q1_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError) as e:
        open_source(tmp_path / "q1.gguf")
    assert "token_embd.weight" in one_line(e) and "Q1_0 is not read" in str(e.value)
    w = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError) as e:
        open_source(tmp_path / "bare.gguf")
    assert "lacks the key llama.embedding_length" in one_line(e)
    with GGUFSource(llama_gguf[0]) as src, pytest.raises(KeyError) as e:
        src.get("blk.9.ffn_up.weight")
    assert "no tensor" in str(e.value)
