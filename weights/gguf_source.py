"""`GGUFSource`: a GGUF file's tensors in place, under canonical names with HF's values (weights/names.py).

Reads llama.cpp's GGUFs and PowerInfer's own files (magic PWRI, the rest GGUF v3: export/powerinfer.py) from a
copy-on-write memory map (the header parsed by weights/gguf_file.GGUFFile). ggml lists a tensor's dims
fastest-moving first: shapes here are torch's (reversed), block formats (rows, row_bytes) uint8. The config is built
from the metadata keys alone (no tensor is read): transformers' GGUF path reads metadata only too, but refuses PWRI
files, needs gguf-py and misses a few keys (Qwen3's head_dim, Falcon's layout). The tokenizer is llama.cpp's, built
from the header (weights/gguf_tokenizer.py).

PowerInfer's files also hold per layer a predictor (`blk.{i}.fc1.weight` (r, d), `blk.{i}.fc2.weight` (n_ff, r)) and
the down projection transposed (`blk.{i}.ffn_down_t.weight` (n_ff, d), exposed as stored, TensorInfo.transposed), the
key `powerinfer.sparse_threshold`, and beside the file `<file>.generated.gpuidx` (per layer a 0/1 GPU mask).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hotneurons.common.kinds import Activation, choose
from hotneurons.common.model_source import ModelError
from hotneurons.weights import names as N
from hotneurons.weights.formats import from_ggml_type
from hotneurons.weights.gguf_file import INTS, GGUFFile
from hotneurons.weights.qtensor import QTensor
from hotneurons.weights.source import Span, TensorInfo, WeightSource, view

_ROWS = re.compile(r"blk\.(\d+)\.(attn_q|attn_k|attn_qkv)\.(weight|bias)")



class GGUFSource(WeightSource):
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.file = GGUFFile(self.path)
        self.powerinfer: bool = self.file.powerinfer
        self.meta = self.file.meta
        self.arch: str = self.meta.get("general.architecture", "")
        if self.arch not in N.GGUF_MODEL_TYPE:
            raise ModelError(f"GGUF architecture {self.arch!r} of '{path}' is not supported: supported are "
                             f"{', '.join(N.GGUF_MODEL_TYPE)}", params="model")
        self.infos, self._spans = {}, {}
        for t in self.file.tensors.values():
            if t.ggml_type in INTS:
                raise ModelError(f"'{path}', tensor {t.name}: an integer tensor in a model file (a .gpuidx file "
                                 f"named as the model?): name the model's .gguf", params="model")
            fmt = from_ggml_type(t.ggml_type)
            # Qwen2-MoE's shared-expert gate: llama.cpp's converter squeezes it to (d,); canonical is HF's (1, d)
            shape = (1, *t.shape) if t.name.endswith(".ffn_gate_inp_shexp.weight") and len(t.shape) == 1 else t.shape
            self.infos[t.name] = TensorInfo(t.name, shape, fmt, t.nbytes, transposed=".ffn_down_t." in t.name,
                                            converted=self._conversion(t.name, len(t.shape)))
            self._spans[t.name] = Span(self.file.buf, t.offset, t.nbytes)
        self.activation, fat = self._activation()
        self.config = self._config()
        if self.activation is not None:
            N.config_activation(self.config, self.activation, fat)

    # -- values --------------------------------------------------------------------------------------------------

    def _conversion(self, name: str, ndim: int) -> str | None:
        m = _ROWS.fullmatch(name)
        if m and m.group(2) != "attn_qkv" and self.arch in N.GGUF_PERMUTED_QK:
            return "permuted rows"
        if m and m.group(2) == "attn_qkv" and self.arch in N.GGUF_FALCON_QKV:
            return "regrouped qkv"
        if ndim == 1 and name.endswith("norm.weight") and self.arch in N.GGUF_NORM_SHIFT:
            return "norm shift"
        return None

    def _key(self, k: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{k}", default)

    def _need(self, k: str) -> int:
        if f"{self.arch}.{k}" not in self.meta:
            raise ModelError(f"'{self.path}' lacks the key {self.arch}.{k}: it is no complete llama.cpp model file "
                             f"(write it again with llama.cpp's converter)", params="model")
        return int(self.meta[f"{self.arch}.{k}"])

    def _heads(self, kind: str, layer: int) -> int:
        n = self._key("attention.head_count") if kind == "q" else self._key(
            "attention.head_count_kv", self._key("attention.head_count"))
        return int(n[layer] if isinstance(n, list) else n)  # some files give a count per layer

    def _row_index(self, name: str, rows: int) -> torch.Tensor:
        m = _ROWS.fullmatch(name)
        layer, kind = int(m.group(1)), m.group(2)
        if kind == "attn_qkv":
            n_head, n_kv = self._heads("q", layer), self._heads("kv", layer)
            idx = N.falcon_qkv_rows(n_head, n_kv, rows // (n_head + 2 * n_kv))
        else:
            idx = N.unpermute_qk_rows(rows, self._heads("q" if kind == "attn_q" else "kv", layer))
        return torch.from_numpy(idx)

    def get(self, name: str) -> torch.Tensor | QTensor:
        """In place, except where the converter's change is undone (TensorInfo.converted): Q/K rows permuted back and
        Falcon's QKV regrouped (a row gather, quantized rows too), Gemma's norms less 1 (float32)."""
        info = self.info(name)
        t = view(self._spans[name], info.fmt, info.shape)
        if info.converted == "norm shift":
            if isinstance(t, QTensor):
                t = t.dequantize(torch.float32).reshape(info.shape)
            return t.float() - 1.0  # (d,) float32: llama.cpp's converter stored 1 + w
        if info.converted in ("permuted rows", "regrouped qkv"):
            rows = info.shape[0]
            idx = self._row_index(name, rows)
            return t.rows(idx) if isinstance(t, QTensor) else t[idx]  # copy: (rows, ...) in HF's order
        return t

    # -- metadata -----------------------------------------------------------------------------------------------

    def _activation(self) -> tuple[Activation | None, float]:
        """PowerInfer's arch in a PWRI file (what its runtime computes), else our key, else llama.cpp's arch."""
        fat = float(self.meta.get(N.FAT_THRESHOLD_KEY, 0.0))
        if self.powerinfer and self.arch in N.POWERINFER_ACTIVATION:
            return N.POWERINFER_ACTIVATION[self.arch], fat
        if N.ACTIVATION_KEY in self.meta:
            return choose(self.meta[N.ACTIVATION_KEY], Activation, f"activation ({N.ACTIVATION_KEY} of {self.path})",
                          ModelError, "model"), fat
        return N.LLAMACPP_ACTIVATION.get(self.arch), fat

    def _config(self) -> Any:
        from transformers import AutoConfig

        key, need, tensors = self._key, self._need, self.infos
        mt = N.GGUF_MODEL_TYPE[self.arch]
        d, heads = need("embedding_length"), need("attention.head_count")
        kv = key("attention.head_count_kv", heads)
        kv = max(kv) if isinstance(kv, list) else int(kv)
        if "token_embd.weight" not in tensors:
            raise ModelError(f"'{self.path}' has no token_embd.weight: it is no complete model file", params="model")
        common = dict(vocab_size=tensors["token_embd.weight"].shape[0], hidden_size=d, num_attention_heads=heads,
                      num_hidden_layers=need("block_count"), tie_word_embeddings="output.weight" not in tensors,
                      bos_token_id=self.meta.get("tokenizer.ggml.bos_token_id"),
                      eos_token_id=self.meta.get("tokenizer.ggml.eos_token_id"),
                      pad_token_id=self.meta.get("tokenizer.ggml.padding_token_id"))
        # as transformers' own GGUF config has them, where the file has them: the model's fingerprint hashes the config
        for k, meta_key in (("unk_token_id", "tokenizer.ggml.unknown_token_id"),
                            ("_model_name_or_path", "general.name")):
            if self.meta.get(meta_key) is not None:
                common[k] = self.meta[meta_key]
        if key("context_length") is not None:
            common["max_position_embeddings"] = int(key("context_length"))
        if mt == "opt":
            cfg = dict(common, ffn_dim=need("feed_forward_length"), word_embed_proj_dim=d,
                       do_layer_norm_before=True, activation_function="relu", enable_bias=True)
            if "position_embd.weight" in tensors:  # OPT's learned positions keep 2 rows ahead (HF's offset)
                cfg["max_position_embeddings"] = tensors["position_embd.weight"].shape[0] - 2
            return AutoConfig.for_model(mt, **cfg)
        if key("rope.freq_base") is not None:
            common["rope_theta"] = float(key("rope.freq_base"))
        if mt == "falcon":
            new_arch = any(n.endswith("attn_norm_2.weight") for n in tensors)
            return AutoConfig.for_model(
                mt, **common, num_kv_heads=kv, new_decoder_architecture=new_arch, multi_query=not new_arch and kv == 1,
                parallel_attn=new_arch or not any(".ffn_norm." in n for n in tensors),
                bias="blk.0.attn_qkv.bias" in tensors, alibi=False,
                ffn_hidden_size=int(key("feed_forward_length", 4 * d)),
                layer_norm_epsilon=float(key("attention.layer_norm_epsilon", 1e-5)))
        head_dim = int(key("attention.key_length", d // heads))
        cfg = dict(common, num_key_value_heads=kv, head_dim=head_dim, intermediate_size=need("feed_forward_length"),
                   rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)))
        if self.arch in N.GGUF_MOE_TYPE and (self.arch != "llama" or key("expert_count")):  # experts (3-D, stacked)
            mt = N.GGUF_MOE_TYPE[self.arch]
            cfg.update(N.gguf_expert_config(self.arch, key, need))
        if mt in ("gemma2", "gemma3_text"):
            # llama.cpp's attention scale: 1/sqrt(head_dim), but hidden/heads for the 27B models (46 and 62 layers)
            big = cfg["num_hidden_layers"] == (46 if mt == "gemma2" else 62)
            cfg["query_pre_attn_scalar"] = d // heads if big else head_dim
            for k, name in (("attention.sliding_window", "sliding_window"),
                            ("attn_logit_softcapping", "attn_logit_softcapping"),
                            ("final_logit_softcapping", "final_logit_softcapping")):
                if key(k) is not None:
                    cfg[name] = key(k)
        return AutoConfig.for_model(mt, **cfg)

    @property
    def sparse_threshold(self) -> float | None:
        """PowerInfer's predictor cutoff (`powerinfer.sparse_threshold`), None where the file has none."""
        t = self.meta.get(N.SPARSE_THRESHOLD_KEY)
        return None if t is None else float(t)

    def predictor(self, layer: int) -> tuple[torch.Tensor | QTensor, torch.Tensor | QTensor]:
        """(fc1 (r, d), fc2 (n_ff, r)) of a PowerInfer file's layer, in place."""
        names = (N.layer_name(layer, "fc1.weight"), N.layer_name(layer, "fc2.weight"))
        if not all(n in self.infos for n in names):
            raise ModelError(f"'{self.path}' has no predictor for layer {layer} ({names[0]}): use a PowerInfer file "
                             f"(PWRI) with predictors", params="model")
        return self.get(names[0]), self.get(names[1])

    @property
    def gpu_index_path(self) -> Path:
        return self.path.with_name(self.path.name + ".generated.gpuidx")

    def gpu_index(self) -> list[np.ndarray] | None:
        """Per layer (n_ff,) bool, True where PowerInfer's `.generated.gpuidx` beside the file puts the neuron on the
        GPU; None where there is no such file."""
        if not self.gpu_index_path.is_file():
            return None
        f = GGUFFile(self.gpu_index_path)
        masks = {int(m.group(1)): np.frombuffer(f.buf, INTS[t.ggml_type], int(np.prod(t.shape)), t.offset) != 0
                 for t in f.tensors.values()
                 if t.ggml_type in INTS and (m := re.fullmatch(r"blk\.(\d+)\.gpu_idx", t.name))}
        n = self.config.num_hidden_layers
        if sorted(masks) != list(range(n)):
            raise ModelError(f"'{self.gpu_index_path}' has GPU masks for layers {sorted(masks)}, the model {n} "
                             f"layers: delete it (PowerInfer makes another) or export the model again", params="model")
        return [masks[i] for i in range(n)]

    def tokenizer(self) -> Any:
        """The file's own tokenizer as llama.cpp reads it (weights/gguf_tokenizer.py): llama.cpp's ids for the same
        text, its chat template; from this header's tokenizer.* keys (and general.name, general.architecture, which
        llama.cpp reads a few token attributes by)."""
        from hotneurons.weights.gguf_tokenizer import GGUFTokenizer

        keys = [k for k in self.meta if k.startswith("tokenizer.") or k in ("general.name", "general.architecture")]
        return GGUFTokenizer({k: self.file.array(k) for k in keys}, str(self.path))

    def close(self) -> None:
        super().close()
        self.file = None

