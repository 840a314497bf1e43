"""PowerInfer's files from a GGUF model, streamed: the model's tensors are copied as stored (Q4_0 stays Q4_0, byte for
byte), each layer's down projection is cut into one row per neuron in its own block format (`ffn_down_t`, what
PowerInfer's axpy kernel reads), and the predictors are added as F16 `fc1` / `fc2`. Nothing is widened to float
but, where a block needs torch's path, a window of one down matrix's columns, so a 39 GB 70B exports in a few GB of
memory. The metadata (architecture keys, tokenizer) is the source file's, renamed to PowerInfer's arch; the
tensor set is the one its sparse loader requires (export/powerinfer.py's docstring)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hotneurons.weights.names import layer_name

from .gguf_model import ExportError, Tensor, host, source_fields
from .powerinfer import ARCH, check_predictors, counts_and_masks, write_folder

LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up")
SKIPPED_KEYS = ("general.architecture", "general.alignment")  # the writer sets both


def _copied(f, name: str, as_name: str | None = None) -> Tensor:
    """A tensor of the source file as stored: its bytes, (rows, row bytes), of its ggml type."""
    e = f.tensors[name]
    rows = int(np.prod(e.shape[:-1])) if len(e.shape) > 1 else 1
    shape = (rows, e.nbytes // rows) if len(e.shape) > 1 else (e.nbytes,)  # bytes
    return Tensor(as_name or name, shape, np.dtype(np.uint8),
                  lambda: f.buf[e.offset:e.offset + e.nbytes].reshape(shape), ggml_type=e.ggml_type)


def down_t(source, layer: int) -> Tensor:
    """blk.{layer}.ffn_down_t: the down matrix (d, n) as n rows of d weights, in the file's own format, cut by the
    runtime's own down_t_rows (Numba's one pass over the file's blocks, else windows of columns through torch)."""
    from hotneurons.models.ffn_weights import FFNWeights, down_t_rows
    from hotneurons.weights.formats import WeightFormat, from_ggml_type, row_bytes, spec
    from hotneurons.weights.qtensor import QTensor

    e = source.file.tensors[layer_name(layer, "ffn_down.weight")]
    d, n = e.shape  # torch order: (d_model, n_ff)
    fmt = from_ggml_type(e.ggml_type)
    name = layer_name(layer, "ffn_down_t.weight")
    floats = {WeightFormat.F16: np.float16, WeightFormat.F32: np.float32}
    if fmt not in (*floats, WeightFormat.Q4_0, WeightFormat.Q8_0):
        raise ExportError(f"{layer_name(layer, 'ffn_down.weight')} is {fmt.value}: the down rows are re-cut for "
                          f"PowerInfer from q4_0, q8_0, f16 or f32 only; quantize the model to one of those "
                          f"(llama-quantize)")

    def rows() -> np.ndarray:  # (n, d) floats, or (n, row bytes) uint8 blocks
        w = down_t_rows(FFNWeights.from_source(source, layer), torch.arange(n), fmt)
        return np.ascontiguousarray((w.data if isinstance(w, QTensor) else w).numpy())

    if fmt in floats:
        return Tensor(name, (n, d), np.dtype(floats[fmt]), rows)
    return Tensor(name, (n, row_bytes(fmt, d)), np.dtype(np.uint8), rows, ggml_type=spec(fmt).ggml_type)


def tensors_of(source, n_layers: int, predictors: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[Tensor]:
    """PowerInfer's tensor set from the source (weights/gguf_source.GGUFSource), in its order per layer (the loader
    takes them by name)."""
    f = source.file
    need = ["token_embd.weight", "output_norm.weight", *(layer_name(i, f"{k}.weight") for i in range(n_layers)
                                                        for k in (*LAYER_TENSORS, "ffn_down"))]
    missing = [n for n in need if n not in f.tensors]
    if missing:
        raise ExportError(f"the model file lacks {missing[0]} ({len(missing)} missing): PowerInfer's LLaMA needs "
                          f"every one of {', '.join(LAYER_TENSORS)}, ffn_down per layer")
    out = [_copied(f, "token_embd.weight"), _copied(f, "output_norm.weight"),
           _copied(f, "output.weight") if "output.weight" in f.tensors else  # a tied model: its embedding again
           _copied(f, "token_embd.weight", "output.weight")]
    for i, (fc1, fc2) in enumerate(predictors):
        out += [_copied(f, layer_name(i, f"{k}.weight")) for k in LAYER_TENSORS]
        out += [down_t(source, i),
                Tensor(layer_name(i, "fc1.weight"), tuple(fc1.shape), np.dtype(np.float16),  # (r, d)
                       lambda w=fc1, i=i: host(w, np.float16, layer_name(i, "fc1.weight"))),
                Tensor(layer_name(i, "fc2.weight"), tuple(fc2.shape), np.dtype(np.float16),  # (n_ff, r)
                       lambda w=fc2, i=i: host(w, np.float16, layer_name(i, "fc2.weight")))]
    return out


def source_metadata(path: Path, src_arch: str, arch: str, threshold: float):
    """The writer's metadata callable: the source's key-values (its arch's keys renamed to `arch`), PowerInfer's
    threshold."""
    fields = source_fields(path, SKIPPED_KEYS)

    def metadata(w) -> None:
        for name, value, vtype, sub in fields:
            if name.startswith(src_arch + "."):
                name = arch + name[len(src_arch):]
            w.add_key_value(name, value, vtype, sub_type=sub)
        w.add_float32("powerinfer.sparse_threshold", float(threshold))

    return metadata


def write_powerinfer_gguf(source, predictors: Sequence[tuple[torch.Tensor, torch.Tensor]],
                          threshold: float, counts: Sequence[np.ndarray], gpu_mask: Sequence[np.ndarray] | None,
                          vram_capacity: int, out: str | Path, *, activation: str, name: str = "model",
                          progress: bool = False, info: dict[str, Any] | None = None) -> dict[str, Any]:
    """write_powerinfer's files for the GGUF model `source` (weights/gguf_source.GGUFSource: its tensors as
    stored, this module's docstring); `predictors` already in PowerInfer's form. The caller has checked the model
    (powerinfer_arch) and the output folder. Returns the summary (OUT/export.json)."""
    from hotneurons.weights.formats import from_ggml_type

    path, out, f = Path(source.path), Path(out), source.file
    src_arch = str(f.meta.get("general.architecture", ""))
    L = int(f.meta[f"{src_arch}.block_count"])
    n_ff, d = f.tensors[layer_name(0, "ffn_up.weight")].shape  # (n_ff, d_model)
    arch = ARCH[activation]
    check_predictors(predictors, L, d, n_ff, threshold, vram_capacity)
    counts, gpu_mask = counts_and_masks(counts, gpu_mask, L, n_ff)
    gguf_name = f"{name}.powerinfer.gguf"
    tensors = tensors_of(source, L, predictors)
    summary: dict[str, Any] = {
        "format": "powerinfer", "arch": arch, "activation": activation, "name": name, "n_layers": L, "d_model": d,
        "n_neurons": n_ff, "source_file": str(path), "sparse_threshold": float(threshold),
        "predictor_hidden": [int(f1.shape[0]) for f1, _ in predictors],
        "formats": sorted({from_ggml_type(e.ggml_type).value for e in f.tensors.values()}),  # as stored
        "files": {"model": gguf_name, "activation": "activation/activation_{i}.pt",
                  "gpu_index": f"{gguf_name}.generated.gpuidx" if gpu_mask is not None else None},
        "gpu_neurons_per_layer": None if gpu_mask is None else [int(m.sum()) for m in gpu_mask],
        "vram_capacity": int(vram_capacity) if gpu_mask is not None else None, **(info or {})}
    metadata = source_metadata(path, src_arch, arch, threshold)
    return write_folder(out, gguf_name, arch, metadata, tensors, counts, gpu_mask, vram_capacity, summary, progress)
