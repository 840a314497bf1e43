"""Random ReLU LLaMA models (ReGLU: LlamaConfig hidden_act="relu") for the memory benchmark (bench/memory.py),
written streamed, one tensor at a time, in the two formats users bring: an HF folder (config.json, model.safetensors
in bf16, a tokenizer) and a Q4_0 GGUF in llama.cpp's conventions (arch llama, Q/K rows permuted as its converter
does, norms F32, every 2-D weight Q4_0).

The weights are RANDOM (normal, std 0.02; norms 1): the figures measured on them are memory and time, never quality.
With unit-scale FFN inputs a gate pre-activation is a sum of d terms of std 0.02, so ReLU fires for about half of
the neurons: LLaMA has no gate bias to push that lower, and the fraction does not change what memory a stage holds.

Each tensor's values come from its own seed (the run's seed and the tensor's HF name), so both files hold the same
model (the GGUF: the bf16 values quantized) and any one tensor can be made again without the others. Files are
written to a temporary name and renamed; `ensure_models` keeps a manifest.json and reuses files it describes.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from hotneurons.weights.names import layer_name

WRITER_VERSION = 3  # bump when the files written for a shape change: manifests of older files then do not match
STD = 0.02
FORMATS = ("hf", "gguf", "gguf-k")  # gguf-k: the Q4_0 file re-quantized by llama.cpp as Q4_K_M (needs llama_cpp)
ACTIVATION_KEY = "hotneurons.activation"  # the GGUF's own record of its FFN activation (llama arch says nothing)


@dataclass(frozen=True)
class Shape:
    """A LLaMA-architecture model's shape (untied LM head: what ReluLLaMA and most LLaMA checkpoints have)."""

    d_model: int
    n_neurons: int
    n_heads: int
    n_kv_heads: int
    n_layers: int
    vocab: int
    max_positions: int = 2048

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def params(self) -> int:
        d, kv = self.d_model, self.n_kv_heads * self.head_dim
        layer = 2 * d * d + 2 * d * kv + 3 * d * self.n_neurons + 2 * d
        return self.n_layers * layer + 2 * self.vocab * d + d

    @property
    def bf16_bytes(self) -> int:
        return 2 * self.params


# "1.7GB"/"3.1GB": the bf16 safetensors' size (835.7M / 1.54G weights); their Q4_0 GGUFs are 0.47 / 0.87 GB.
# "small": 4 MB, for tests and CPU smoke runs; its vocabulary holds the byte tokenizer's 259 tokens.
SHAPES: dict[str, Shape] = {
    "small": Shape(d_model=256, n_neurons=704, n_heads=4, n_kv_heads=2, n_layers=2, vocab=1024),
    "1.7GB": Shape(d_model=2048, n_neurons=5632, n_heads=32, n_kv_heads=4, n_layers=16, vocab=32000),
    "3.1GB": Shape(d_model=2048, n_neurons=5632, n_heads=32, n_kv_heads=4, n_layers=32, vocab=32000),
}


@dataclass(frozen=True)
class TensorSpec:
    """One weight: its HF and llama.cpp names, numpy-order shape, whether it is a norm (ones, F32 in the GGUF) and
    the head count its rows are permuted by for llama.cpp (q and k), if any."""

    hf: str
    gguf: str
    shape: tuple[int, ...]
    norm: bool = False
    permute_heads: int | None = None


def tensor_plan(s: Shape) -> list[TensorSpec]:
    """Every tensor of the model, in llama.cpp's file order (the safetensors file uses it too)."""
    d, kv = s.d_model, s.n_kv_heads * s.head_dim
    out = [TensorSpec("model.embed_tokens.weight", "token_embd.weight", (s.vocab, d)),
           TensorSpec("model.norm.weight", "output_norm.weight", (d,), norm=True),
           TensorSpec("lm_head.weight", "output.weight", (s.vocab, d))]
    for i in range(s.n_layers):
        p, b = f"model.layers.{i}.", layer_name(i)
        out += [TensorSpec(p + "input_layernorm.weight", b + "attn_norm.weight", (d,), norm=True),
                TensorSpec(p + "self_attn.q_proj.weight", b + "attn_q.weight", (d, d), permute_heads=s.n_heads),
                TensorSpec(p + "self_attn.k_proj.weight", b + "attn_k.weight", (kv, d), permute_heads=s.n_kv_heads),
                TensorSpec(p + "self_attn.v_proj.weight", b + "attn_v.weight", (kv, d)),
                TensorSpec(p + "self_attn.o_proj.weight", b + "attn_output.weight", (d, d)),
                TensorSpec(p + "post_attention_layernorm.weight", b + "ffn_norm.weight", (d,), norm=True),
                TensorSpec(p + "mlp.gate_proj.weight", b + "ffn_gate.weight", (s.n_neurons, d)),
                TensorSpec(p + "mlp.up_proj.weight", b + "ffn_up.weight", (s.n_neurons, d)),
                TensorSpec(p + "mlp.down_proj.weight", b + "ffn_down.weight", (d, s.n_neurons))]
    return out


def weight(t: TensorSpec, seed: int) -> torch.Tensor:
    """The tensor's bf16 values in HF's layout: the same on every machine (torch's CPU generator)."""
    if t.norm:
        return torch.ones(t.shape, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(t.hf.encode()))
    return (torch.randn(t.shape, generator=g) * STD).to(torch.bfloat16)


def config(s: Shape, tok, hidden_act: str = "relu") -> "object":
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=s.vocab, hidden_size=s.d_model, intermediate_size=s.n_neurons,
                       num_hidden_layers=s.n_layers, num_attention_heads=s.n_heads, num_key_value_heads=s.n_kv_heads,
                       max_position_embeddings=s.max_positions, hidden_act=hidden_act, tie_word_embeddings=False,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       torch_dtype="bfloat16")


def tokenizer(vocab: int):
    """The byte-level tokenizer of the tiny test models with placeholder tokens ("t260", ...) up to `vocab`, so that
    every id a random model emits decodes to text (a byte tokenizer of 259 ids would print nothing for most), and one
    merge (two spaces): transformers' GGUF tokenizer reader refuses a vocabulary without a real merge."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.tiny import CHAT_TEMPLATE

    ids = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for t in ("<s>", "</s>", "<pad>", "ĠĠ"):
        ids[t] = len(ids)
    if vocab < len(ids):
        raise ValueError(f"vocab {vocab} is below the byte tokenizer's {len(ids)} tokens: use at least {len(ids)}")
    ids.update({f"t{i}": i for i in range(len(ids), vocab)})  # no merges: never produced by encoding, only decoded
    tok = Tokenizer(models.BPE(vocab=ids, merges=[("Ġ", "Ġ")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   chat_template=CHAT_TEMPLATE)


def _bf16_bytes(w: torch.Tensor) -> np.ndarray:
    return w.contiguous().view(torch.int16).numpy()  # numpy has no bf16: its raw 2-byte words


def write_hf(s: Shape, folder: Path, seed: int = 0) -> Path:
    """config.json, tokenizer files and model.safetensors (bf16; the header, then each tensor as it is made)."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = tokenizer(s.vocab)
    config(s, tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    plan, header, at = tensor_plan(s), {"__metadata__": {"format": "pt"}}, 0
    for t in plan:
        n = 2 * int(np.prod(t.shape))
        header[t.hf] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    path = folder / "model.safetensors"
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for t in plan:
            _bf16_bytes(weight(t, seed)).tofile(f)
    os.replace(tmp, path)
    return path


def _gguf_tensors(s: Shape, seed: int) -> Iterator[tuple[TensorSpec, np.ndarray]]:
    import gguf
    from gguf.quants import quantize
    from hotneurons.export.gguf_model import permute_qk

    for t in tensor_plan(s):
        w = weight(t, seed).float()
        if t.norm:
            yield t, w.numpy()
            continue
        if t.permute_heads:
            w = permute_qk(w, t.permute_heads)
        yield t, quantize(w.contiguous().numpy(), gguf.GGMLQuantizationType.Q4_0)


class _Q4Metadata:
    """The writer as llama_metadata sees it, with the file type it writes (F16) replaced by Q4_0's."""

    MOSTLY_Q4_0 = 2  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_0

    def __init__(self, w):
        self._w = w

    def __getattr__(self, name):
        return getattr(self._w, name)

    def add_file_type(self, _ftype: int) -> None:
        self._w.add_file_type(self.MOSTLY_Q4_0)


def write_gguf_q4(s: Shape, path: Path, seed: int = 0) -> Path:
    """A Q4_0 GGUF of the same weights, written tensor by tensor after the header of every tensor's info."""
    return write_q4_file(s, path, (a for _, a in _gguf_tensors(s, seed)))


def write_q4_file(s: Shape, path: Path, arrays: Iterator[np.ndarray], activation: str = "reglu") -> Path:
    """A Q4_0 GGUF of shape `s` whose tensors (tensor_plan's order: norms float32, matrices Q4_0 bytes (rows, row
    bytes), q and k in llama.cpp's row order) come from `arrays` one at a time, after a header that holds every
    tensor's info; written to a temp name and renamed, removed if `arrays` fails."""
    import gguf
    from hotneurons.export.gguf_model import llama_metadata, vocab_from_tokenizer

    path.parent.mkdir(parents=True, exist_ok=True)
    tok = tokenizer(s.vocab)
    tmp = path.with_name(path.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), "llama")
    hidden_act = "silu" if activation == "swiglu" else "relu"
    llama_metadata(_Q4Metadata(w), config(s, tok, hidden_act), path.stem)  # newer versions record the activation
    if not any(ACTIVATION_KEY in kv for kv in w.kv_data):
        w.add_string(ACTIVATION_KEY, activation)
    vocab_from_tokenizer(tok, s.vocab).add_to(w)
    q4 = gguf.GGMLQuantizationType.Q4_0
    block, block_bytes = gguf.GGML_QUANT_SIZES[q4]
    for t in tensor_plan(s):
        if t.norm:
            w.add_tensor_info(t.gguf, t.shape, np.dtype(np.float32), 4 * t.shape[0])
        else:
            byte_shape = (t.shape[0], t.shape[1] // block * block_bytes)
            w.add_tensor_info(t.gguf, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1], raw_dtype=q4)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for a in arrays:
            w.write_tensor_data(a)
        w.close()
        os.replace(tmp, path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return path


def model_paths(folder: Path, name: str) -> dict[str, Path]:
    """Where each format's model lives (what --model names) and its weights file (what file_bytes measures)."""
    return {"hf": folder / name / "hf", "gguf": folder / name / "gguf" / f"random-relu-llama-{name}.Q4_0.gguf",
            "gguf-k": folder / name / "gguf-k" / f"random-relu-llama-{name}.Q4_K_M.gguf"}


def write_gguf_k(s: Shape, path: Path, q4_0: Path, seed: int = 0) -> Path:
    """The Q4_0 file's weights as llama.cpp's Q4_K_M mix (Q4_K and Q6_K tensors): de-quantized to an F16 copy (beside
    `path`, removed after), then quantized by llama-cpp-python's llama_model_quantize (bench/parity_files.py)."""
    from bench.parity_files import float_copy, quantized_copy

    if not q4_0.exists():
        write_gguf_q4(s, q4_0, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    f16 = path.with_name(path.name + ".f16.gguf")
    try:
        return quantized_copy(float_copy(q4_0, f16, "f16"), path, "q4_k", threads=os.cpu_count() or 1)
    finally:
        f16.unlink(missing_ok=True)


def weights_file(fmt: str, model: Path) -> Path:
    return model / "model.safetensors" if fmt == "hf" else model


def ensure_models(name: str, folder: Path, formats: tuple[str, ...] = ("hf", "gguf"), seed: int = 0,
                  log=print) -> dict[str, dict]:
    """The preset `name`'s model in each of `formats` under folder/name, written unless its manifest.json (shape,
    seed, writer version, file sizes) already describes it. Returns {format: {model, file, file_bytes, written_s}}."""
    import time

    s = SHAPES[name]
    paths = model_paths(folder, name)
    manifest_path = folder / name / "manifest.json"
    key = {"writer_version": WRITER_VERSION, "shape": asdict(s), "seed": seed, "std": STD}
    old = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    files = old.get("files", {}) if all(old.get(k) == v for k, v in key.items()) else {}
    for fmt in formats:
        rec = files.get(fmt)
        f = weights_file(fmt, paths[fmt])
        if rec and f.exists() and f.stat().st_size == rec["file_bytes"]:
            continue
        log(f"writing the {name} model as {fmt} ({s.params / 1e6:.1f}M weights) to {paths[fmt]}")
        t0 = time.perf_counter()
        if fmt == "hf":
            write_hf(s, paths[fmt], seed)
        elif fmt == "gguf":
            write_gguf_q4(s, paths[fmt], seed)
        else:
            write_gguf_k(s, paths[fmt], paths["gguf"], seed)
        files[fmt] = {"model": str(paths[fmt]), "file": str(f), "file_bytes": f.stat().st_size,
                      "written_s": round(time.perf_counter() - t0, 2)}
        manifest_path.write_text(json.dumps({**key, "files": files}, indent=1))
    return {fmt: files[fmt] for fmt in formats}


def write_corpus(path: Path, chars: int, seed: int = 0) -> Path:
    """A plain-text corpus of made-up words (pi-profile and pi-eval read .txt files; the lent machines have no
    Wikipedia sample). Only its length matters here."""
    if path.exists() and path.stat().st_size >= chars:
        return path
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    words, n = [], 0
    while n < chars:
        w = "".join(rng.choice(letters, size=int(rng.integers(2, 9))))
        words.append(w)
        n += len(w) + 1
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [" ".join(words[i:i + 14]) + "." for i in range(0, len(words), 14)]
    path.write_text("\n".join(lines) + "\n")
    return path
