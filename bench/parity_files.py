"""The GGUF files bench/parity.py runs in both runtimes: float and quantized copies of a GGUF, and tiny random models
of every family both decoders read, exported in llama.cpp's layout.

- `float_copy`: every block tensor of a GGUF de-quantized (gguf-py's `gguf.quants.dequantize`) and written F32 (or
  F16, the matrices only: norms stay F32 as llama.cpp's converter writes them), the metadata copied key for key.
- `quantized_copy`: llama.cpp's own quantizer (`llama_model_quantize` of llama-cpp-python) on a float copy, with the
  file type's usual mix (as the files users download are made: e.g. Q4_0 keeps the embedding Q6_K); where a row
  length is no multiple of 256, llama.cpp writes that tensor in its fallback type (Q4_K -> Q5_0, Q6_K -> Q8_0).
- `family_gguf`: a tiny random model of tests/tiny.py in llama.cpp's conventions (canonical names,
  Q/K rows interleaved for arch llama, Gemma norms + 1, Falcon's fused QKV regrouped), all F32, with the keys
  llama.cpp's loader needs and the byte-level vocabulary.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

# --types names -> llama.cpp file types (llama_ftype)
FTYPES = {"q4_0": "MOSTLY_Q4_0", "q4_1": "MOSTLY_Q4_1", "q5_0": "MOSTLY_Q5_0", "q5_1": "MOSTLY_Q5_1",
          "q8_0": "MOSTLY_Q8_0", "q4_k": "MOSTLY_Q4_K_M", "q5_k": "MOSTLY_Q5_K_M", "q6_k": "MOSTLY_Q6_K",
          "q3_k": "MOSTLY_Q3_K_M", "q2_k": "MOSTLY_Q2_K", "iq4_xs": "MOSTLY_IQ4_XS", "iq4_nl": "MOSTLY_IQ4_NL"}
# tiny families llama.cpp runs as our decoder does, with their GGUF arch. Left out: opt (no llama.cpp arch),
# llama-reglu, mistral-drelu and falcon-relu (llama.cpp's llama and falcon compute SwiGLU and GELU whatever the
# model was trained with: only our `hotneurons.activation` key says ReLU, which llama.cpp ignores).
FAMILY_ARCH = {"llama-swiglu": "llama", "qwen2-swiglu": "qwen2", "qwen3-swiglu": "qwen3", "gemma-geglu": "gemma",
               "gemma3-geglu": "gemma3", "falcon-gelu": "falcon", "mixtral": "llama", "qwen2-moe": "qwen2moe",
               "qwen3-moe": "qwen3moe", "olmoe": "olmoe"}


def tensor_types(path: Path | str) -> dict[str, int]:
    """Type name -> count of a GGUF's tensors (what llama.cpp's quantizer chose per tensor)."""
    import gguf

    return dict(Counter(t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors))


def float_copy(src: Path | str, dst: Path | str, dtype: str = "f32") -> Path:
    """`src` with every tensor de-quantized by gguf-py, written as `dtype` (f32, or f16 for 2-D tensors), the metadata
    (tokenizer included) copied; general.file_type set to ALL_F32 (0) / MOSTLY_F16 (1)."""
    import gguf

    if dtype not in ("f32", "f16"):
        raise ValueError(f"float copy as {dtype!r}: use f32 or f16")
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), vtype, sub)
    w.add_file_type(0 if dtype == "f32" else 1)
    for t in r.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))  # numpy order: gguf-py lists ggml's ne, fastest first
        a = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        if dtype == "f16" and a.ndim >= 2:
            a = a.astype(np.float16)
        w.add_tensor(t.name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(dst)
    return dst


def quantized_copy(src: Path | str, dst: Path | str, kind: str, threads: int = 2) -> Path:
    """`src` (a float GGUF) quantized by llama.cpp to file type `kind` (FTYPES: its usual tensor mix)."""
    import llama_cpp

    if kind not in FTYPES:
        raise ValueError(f"quantization type {kind!r}: use one of {', '.join(FTYPES)}")
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{FTYPES[kind]}")
    p.nthread = threads
    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".partial")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), p)
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize {src} -> {kind} failed (code {rc})")
    tmp.replace(dst)
    return dst


class _NoFileType:
    """A GGUFWriter whose add_file_type does nothing: export.gguf_model's metadata says MOSTLY_F16, these files are
    F32 throughout (family_gguf writes ALL_F32 itself)."""

    def __init__(self, w: Any):
        self._w = w

    def add_file_type(self, *_: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._w, name)


def _llamacpp_value(arch: str, name: str, t: Any, cfg: Any) -> Any:
    """An HF tensor under its canonical name as llama.cpp's converter stores it (weights/names.py's conventions)."""
    from hotneurons.export.gguf_model import permute_qk
    from hotneurons.weights import names as N

    if arch in N.GGUF_PERMUTED_QK and name.endswith(".weight") and (".attn_q." in name or ".attn_k." in name):
        return permute_qk(t, cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads)
    if arch in N.GGUF_NORM_SHIFT and name.endswith("norm.weight"):
        return t + 1
    if arch in N.GGUF_FALCON_QKV and ".attn_qkv." in name:  # HF's kv groups -> all Q, all K, all V
        hd = cfg.hidden_size // cfg.num_attention_heads
        return t[np.argsort(N.falcon_qkv_rows(cfg.num_attention_heads, cfg.num_kv_heads, hd))]
    if name.endswith("ffn_gate_inp_shexp.weight"):
        return t.reshape(-1)  # (1, d) -> (d,)
    return t


def family_gguf(family: str, path: Path | str, seed: int = 0) -> Path:
    """tests/tiny.py's random model of `family` (FAMILY_ARCH) as an F32 GGUF in llama.cpp's layout."""
    import tempfile

    import gguf
    import torch
    from hotneurons.export.gguf_model import llama_metadata, moe_metadata, rope, vocab_from_tokenizer
    from hotneurons.weights.names import NameMap
    from transformers import AutoModelForCausalLM

    from tests import tiny

    if family not in FAMILY_ARCH:
        raise ValueError(f"family {family!r}: llama.cpp runs {', '.join(FAMILY_ARCH)} as our decoder does")
    arch = FAMILY_ARCH[family]
    with tempfile.TemporaryDirectory() as tmp:
        model = AutoModelForCausalLM.from_pretrained(str(tiny.build(family, Path(tmp), seed)), dtype=torch.float32)
    cfg = model.config
    state = NameMap(cfg.model_type, cfg.num_hidden_layers).tensors(model.state_dict())
    path = Path(path)
    tmp_path = path.with_name(path.name + ".partial")
    w = gguf.GGUFWriter(str(tmp_path), arch)
    if arch == "falcon":
        w.add_name(family)
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.hidden_size)
        w.add_block_count(cfg.num_hidden_layers)
        w.add_feed_forward_length(cfg.ffn_hidden_size or 4 * cfg.hidden_size)
        w.add_head_count(cfg.num_attention_heads)
        w.add_head_count_kv(cfg.num_kv_heads)
        w.add_layer_norm_eps(cfg.layer_norm_epsilon)
        w.add_rope_freq_base(rope(cfg)[0])
    elif "moe" in family or family in ("mixtral", "olmoe"):
        moe_metadata(_NoFileType(w), cfg, family)
    else:
        llama_metadata(_NoFileType(w), cfg, family)
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        w.add_key_length(hd)
        w.add_value_length(hd)
        if getattr(cfg, "sliding_window", None) and arch == "gemma3":
            w.add_sliding_window(cfg.sliding_window)
    w.add_file_type(0)  # ALL_F32
    vocab_from_tokenizer(tiny.byte_tokenizer(), cfg.vocab_size).add_to(w)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))  # HF's state dict lists a tied head too
    for name, t in state.items():
        if tied and name == "output.weight":
            continue
        w.add_tensor(name, _llamacpp_value(arch, name, t.detach(), cfg).float().contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp_path.replace(path)
    return path


def main_type(path: Path | str) -> str:
    """The type most of a GGUF's tensors other than F32 have (F32 for an all-F32 file)."""
    types = {k: v for k, v in tensor_types(path).items() if k != "F32"}
    return max(types, key=types.get) if types else "F32"
