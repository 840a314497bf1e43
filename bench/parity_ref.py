"""A third opinion for bench/parity.py: llama.cpp's LLaMA graph (arch llama, as SmolLM2's files have it) in float64
on the file's weights de-quantized by gguf-py, with or without the rounding of activations that llama.cpp's CPU
matrix products apply. Where our runtime and llama.cpp disagree on a quantized file, the reference without rounding
stands for exact arithmetic on the stored weights (what our kernels compute: xq=False in kernels/cold_q.py) and the
one with rounding for llama.cpp; whichever side the reference matches is explained by it.

llama.cpp's CPU backend (ggml-cpu.c type_traits_cpu .vec_dot_type) multiplies a weight of type W by activations x
converted first to W's "vec_dot_type":
  Q4_0, Q5_0, Q8_0, IQ4_NL -> Q8_0 and Q4_1, Q5_1 -> Q8_1: per 32 values d = max|x| / 127 stored fp16,
    q = rint(x * 127 / max|x|) (x86's quantize_row_q8_0); Q8_1 also keeps s = fp16(d * sum q) with d before its
    fp16 rounding, which the weights' per-block min multiplies (ggml_vec_dot_q4_1_q8_1: m * s) in place of
    fp16(d) * sum q;
  K-quants and the other IQ types -> Q8_K: per 256 values iscale = -127 / x_m (x_m the value of largest |x|),
    q = min(127, rint(iscale * x)), d = 1 / iscale in float32 (quantize_row_q8_K_ref);
  F16 -> F16 (x rounded to half precision), BF16 -> BF16, F32 -> F32 (x as is).
An embedding row is de-quantized exactly (get_rows); the KV cache is F32 in the comparisons (type_k = type_v = 0), so
the attention products round nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hotneurons.weights.names import layer_name

Q8_0_TYPES = {"Q4_0", "Q5_0", "Q8_0", "IQ4_NL"}
Q8_1_TYPES = {"Q4_1": 20, "Q5_1": 24}  # their block bytes: fp16 d, fp16 m (the min), then the quants
X_ROUNDING = {"F32": None, "F16": "f16", "BF16": "bf16"}  # else: Q8_0_TYPES -> q8_0, the rest -> q8_k


def x_rounding(ggml_type: str) -> str | None:
    """How llama.cpp's CPU rounds the activations a weight of `ggml_type` multiplies (module docstring)."""
    if ggml_type in X_ROUNDING:
        return X_ROUNDING[ggml_type]
    return "q8_0" if ggml_type in Q8_0_TYPES else "q8_1" if ggml_type in Q8_1_TYPES else "q8_k"


def round_x(x: np.ndarray, kind: str | None) -> np.ndarray:
    """x (T, k) float64 as llama.cpp's matrix product sees it after converting it for `kind`, float64."""
    if kind is None:
        return x
    x32 = x.astype(np.float32)
    T, k = x32.shape
    if kind == "f16":
        return x32.astype(np.float16).astype(np.float64)
    if kind == "bf16":  # round to nearest even on the upper 16 bits
        u = x32.view(np.uint32).astype(np.uint64)
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16).astype(np.uint32)
        return u.view(np.float32).astype(np.float64)
    if kind in ("q8_0", "q8_1"):
        return q8_blocks(x32)[0]
    if kind == "q8_k":
        b = x32.reshape(T, k // 256, 256)  # (T, blocks, 256)
        at = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)  # the signed value of largest |x|
        ok = at != 0
        iscale = np.where(ok, np.float32(-127) / np.where(ok, at, 1), np.float32(0)).astype(np.float32)
        q = np.minimum(127, np.rint(b * iscale))
        d = np.where(ok, np.float32(1) / np.where(ok, iscale, 1), np.float32(0)).astype(np.float32)
        return (q * d).astype(np.float64).reshape(T, k)
    raise ValueError(f"activation rounding {kind!r}: use f16, bf16, q8_0 or q8_k")


def q8_blocks(x32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 / Q8_1 of x (T, k) float32: (the values the int dots see, float64 (T, k); the Q8_1 min term's error
    s - fp16(d) * sum q per block (T, k / 32), float64)."""
    T, k = x32.shape
    b = x32.reshape(T, k // 32, 32)  # (T, blocks, 32)
    amax = np.abs(b).max(-1, keepdims=True)  # float32
    d32 = amax / np.float32(127)
    d = d32.astype(np.float16).astype(np.float32)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    q = np.rint(b * inv)
    sq = q.sum(-1, keepdims=True)  # (T, blocks, 1) exact integers
    s = (d32 * sq).astype(np.float16).astype(np.float64)
    return (q * d).astype(np.float64).reshape(T, k), (s - d.astype(np.float64) * sq)[..., 0]


class Reference:
    """The LLaMA graph of a GGUF of arch llama (no experts) in float64: `logits(ids, rounded)` (T, vocab)."""

    def __init__(self, path: Path | str):
        import gguf

        r = gguf.GGUFReader(str(path))
        meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
        if meta["general.architecture"] != "llama" or "llama.expert_count" in meta:
            raise ValueError(f"{path}: the reference runs arch llama without experts, not "
                             f"{meta['general.architecture']}")
        self.d = int(meta["llama.embedding_length"])
        self.layers = int(meta["llama.block_count"])
        self.heads = int(meta["llama.attention.head_count"])
        self.kv = int(meta.get("llama.attention.head_count_kv", self.heads))
        self.hd = self.d // self.heads
        self.eps = float(meta["llama.attention.layer_norm_rms_epsilon"])
        self.base = float(meta.get("llama.rope.freq_base", 10000.0))
        self.w: dict[str, tuple[np.ndarray, str]] = {}  # name -> (float64 weights in numpy order, ggml type)
        self.mins: dict[str, np.ndarray] = {}  # Q4_1 / Q5_1 weights' per-block mins (rows, blocks), float64
        for t in r.tensors:
            shape = tuple(int(n) for n in reversed(t.shape))
            a = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float64)
            self.w[t.name] = (a, t.tensor_type.name)
            if t.tensor_type.name in Q8_1_TYPES:  # (rows, blocks, block bytes): bytes 2-3 the fp16 min
                blocks = np.asarray(t.data).reshape(shape[0], -1, Q8_1_TYPES[t.tensor_type.name])
                self.mins[t.name] = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        if "output.weight" not in self.w:  # tied: the head is the embedding, as llama.cpp multiplies it
            self.w["output.weight"] = self.w["token_embd.weight"]
            if "token_embd.weight" in self.mins:
                self.mins["output.weight"] = self.mins["token_embd.weight"]

    def _mm(self, x: np.ndarray, name: str, rounded: bool) -> np.ndarray:
        w, kind = self.w[name]
        if not rounded:
            return x @ w.T
        if name in self.mins:  # Q8_1: the min term with llama.cpp's rounded block sums
            xq, ds = q8_blocks(x.astype(np.float32))
            return xq @ w.T + ds @ self.mins[name].T
        return round_x(x, x_rounding(kind)) @ w.T

    def _norm(self, x: np.ndarray, name: str) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * self.w[name][0]

    def _rope(self, x: np.ndarray) -> np.ndarray:
        """x (T, heads, hd): llama.cpp's NORM rope, adjacent pairs rotated (the file's Q/K rows are in that order)."""
        T = x.shape[0]
        theta = np.arange(T)[:, None] * self.base ** (-np.arange(0, self.hd, 2) / self.hd)  # (T, hd / 2)
        cos, sin = np.cos(theta)[:, None], np.sin(theta)[:, None]
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        return out

    def logits(self, ids: list[int], rounded: bool) -> np.ndarray:
        T, H, K, hd = len(ids), self.heads, self.kv, self.hd
        h = self.w["token_embd.weight"][0][np.asarray(ids)]  # (T, d)
        causal = np.triu(np.full((T, T), -np.inf), 1)
        for i in range(self.layers):
            p = layer_name(i)
            x = self._norm(h, p + "attn_norm.weight")
            q = self._rope(self._mm(x, p + "attn_q.weight", rounded).reshape(T, H, hd))
            k = self._rope(self._mm(x, p + "attn_k.weight", rounded).reshape(T, K, hd))
            v = self._mm(x, p + "attn_v.weight", rounded).reshape(T, K, hd)
            k, v = np.repeat(k, H // K, axis=1), np.repeat(v, H // K, axis=1)  # (T, H, hd)
            s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + causal  # (H, T, T)
            s = np.exp(s - s.max(-1, keepdims=True))
            a = np.einsum("hts,shd->thd", s / s.sum(-1, keepdims=True), v).reshape(T, H * hd)
            h = h + self._mm(a, p + "attn_output.weight", rounded)
            x = self._norm(h, p + "ffn_norm.weight")
            g, u = self._mm(x, p + "ffn_gate.weight", rounded), self._mm(x, p + "ffn_up.weight", rounded)
            h = h + self._mm(g / (1 + np.exp(-g)) * u, p + "ffn_down.weight", rounded)
        return self._mm(self._norm(h, "output_norm.weight"), "output.weight", rounded)
