"""`pi-export --format gguf --type T`: a GGUF file copied with its weight matrices re-quantized to another type.

The copy keeps the source's metadata (its tokenizer among it; `general.file_type` set to the new type) and every
tensor's name, shape and order. What is re-quantized, as llama.cpp's llama-quantize decides it:
- every 2-D or 3-D `.weight` (attention, FFN, stacked experts, embeddings, head) to `T`, rows blocked along the
  fastest dim, with weights/quants.quantize (gguf-py's bytes exactly);
- except the embeddings and head (`token_embd`, `output`) of a 4-bit `T`, which go to q8_0: llama.cpp keeps the head
  at Q6_K, which our quantizer does not write, and q8_0 is the nearest above it that it does;
- kept as stored: 1-D tensors (norms, biases), routers (`ffn_gate_inp*`: llama.cpp keeps them F32), and a matrix
  whose rows are no whole number of `T`'s blocks.
A tensor already in the type it is asked for is copied byte for byte; another is de-quantized (weights/quants:
every GGUF type) and quantized again, a chunk of rows at a time.

Streamed: one tensor at a time is read from the memory-mapped source (its pages dropped once written:
weights/source.drop_pages) and its new bytes written, so host memory holds one tensor's output and a chunk of floats,
never the model. The file is written to `OUT.partial` and renamed (export/gguf_model.write_gguf): an interrupted copy
leaves no OUT.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import QUANT_TYPES as TYPES
from .gguf_model import ExportError, Tensor, source_fields, write_gguf

FOUR_BIT = ("q4_0", "q4_1")
HEAD = ("token_embd.weight", "output.weight")
KEPT_KEYS = ("general.file_type",)  # rewritten for the new type
_CHUNK_FLOATS = 1 << 24  # float32 values de-quantized at a time: 64 MB


@dataclass(frozen=True)
class Step:
    """One tensor of the copy: the source's entry (weights/gguf_file.Entry) and the format it is written in."""

    entry: Any
    src: str  # the stored format (weights/formats.py's name)
    out: str  # the format written
    why: str  # "requantized", "as stored" (already `out`), "kept" (not a weight matrix, or rows not whole blocks)

    @property
    def rows(self) -> int:
        return int(np.prod(self.entry.shape[:-1], dtype=np.int64))

    @property
    def shape(self) -> tuple[int, ...]:
        """The bytes written, in the tensor's shape with its last dim in bytes."""
        from hotneurons.weights.formats import row_bytes

        rb = row_bytes(self.out, self.entry.shape[-1]) if self.why == "requantized" else self.entry.nbytes // self.rows
        return (*self.entry.shape[:-1], rb)


def check_type(qtype: str) -> str:
    t = qtype.strip().lower()
    if t not in TYPES:
        raise ExportError(f"--type {qtype!r} cannot be written: the quantizer writes {', '.join(TYPES)} "
                          f"(K-quants: llama.cpp's llama-quantize)")
    return t


def plan(entry: Any, src: str, qtype: str) -> Step:
    """Which format tensor `entry` (stored as `src`) is written in (the module's docstring)."""
    from hotneurons.weights.formats import spec

    name, shape = entry.name, entry.shape  # shape in torch order: rows..., the blocked dim last
    want = "q8_0" if name in HEAD and qtype in FOUR_BIT else qtype
    if len(shape) < 2 or not name.endswith(".weight") or ".ffn_gate_inp" in name or shape[-1] % spec(want).block:
        return Step(entry, src, src, "kept")
    return Step(entry, src, want, "as stored" if want == src else "requantized")


def _data(buf: np.ndarray, step: Step):
    """The callable write_gguf calls for the step's bytes (step.shape uint8); the source's pages dropped after."""
    import torch
    from hotneurons.weights import quants
    from hotneurons.weights.source import Span, drop_pages

    e, rows, shape = step.entry, step.rows, step.shape

    def make() -> np.ndarray:
        span = Span(buf, e.offset, e.nbytes)
        raw = span.array().reshape(rows, -1)  # (rows, source row bytes) uint8, the map's
        if step.why != "requantized":
            out = raw.copy()
        else:
            cols, src = e.shape[-1], torch.from_numpy(raw)
            out = np.empty((rows, shape[-1]), dtype=np.uint8)  # (rows, row bytes)
            chunk = max(1, _CHUNK_FLOATS // cols)
            for r0 in range(0, rows, chunk):
                w = quants.dequantize(src[r0:r0 + chunk], step.src, cols)  # (r, cols) float32
                out[r0:r0 + chunk] = quants.quantize(w, step.out).numpy()
        drop_pages(span)
        return out.reshape(shape)

    return make


def requantize(model: str | Path, out: str | Path, qtype: str, *, force: bool = False,
               progress: bool = False) -> dict[str, Any]:
    """Write `out`, a copy of the GGUF file `model` with its weight matrices in `qtype` (the module's docstring).
    Everything is checked before a byte is written; returns the summary (bytes in and out, tensors per format)."""
    from hotneurons.common.model_source import ModelError
    from hotneurons.weights.formats import from_ggml_type
    from hotneurons.weights.gguf_file import GGUFFile

    qtype = check_type(qtype)
    src, out = Path(model), Path(out)
    if src.is_dir() or src.suffix.lower() != ".gguf":
        raise ExportError(f"--model {src} is no .gguf file: --format gguf copies a GGUF file (a safetensors folder: "
                          f"convert it first with llama.cpp's convert_hf_to_gguf.py)")
    if not src.is_file():
        raise ExportError(f"--model {src} does not exist: name an existing .gguf file")
    if out.exists() and out.resolve() == src.resolve():
        raise ExportError(f"--out {out} is the input file: name another file")
    if out.is_dir():
        raise ExportError(f"--out {out} is a folder: name the .gguf file to write")
    if out.exists() and not force:
        raise ExportError(f"--out {out} exists: pass --force to replace it, or name another file")
    if not out.parent.is_dir():
        raise ExportError(f"--out {out}: its folder {out.parent} does not exist: create it first")
    try:
        f = GGUFFile(src)
    except ModelError as e:
        raise ExportError(str(e)) from None
    if f.powerinfer:
        raise ExportError(f"--model {src} is PowerInfer's file (PWRI): re-quantize the model's own GGUF, then "
                          f"export that (pi-export --format powerinfer)")
    steps = [plan(e, from_ggml_type(e.ggml_type).value, qtype) for e in f.tensors.values()]
    need = sum(int(np.prod(s.shape)) for s in steps)
    free = shutil.disk_usage(out.parent).free
    if need > free:
        raise ExportError(f"--out {out}: the copy needs {need / 1e9:.2f} GB and {out.parent} has {free / 1e9:.2f} GB "
                          f"free: free space or write elsewhere")
    arch = str(f.meta.get("general.architecture", ""))
    fields = [fld for fld in source_fields(src) if fld[0] not in KEPT_KEYS]
    file_type = _file_type(qtype)

    def metadata(w) -> None:
        for name, value, types, sub in fields:
            w.add_key_value(name, value, types, sub_type=sub)
        w.add_file_type(file_type)

    tensors = [Tensor(s.entry.name, s.shape, np.dtype(np.uint8), _data(f.buf, s), ggml_type=_ggml_type(s))
               for s in steps]
    t0 = time.perf_counter()
    written = write_gguf(out, arch, metadata, tensors, progress=progress, desc=f"{qtype} copy")
    return {"format": "gguf", "type": qtype, "model": str(src), "out": str(out), "arch": arch,
            "bytes_in": src.stat().st_size, "bytes_out": written["file_bytes"],
            "tensors_in": dict(Counter(s.src for s in steps)), "tensors_out": dict(Counter(s.out for s in steps)),
            "steps": dict(Counter(s.why for s in steps)), "seconds": round(time.perf_counter() - t0, 2)}


def _ggml_type(s: Step) -> int:
    from hotneurons.weights.formats import spec

    return s.entry.ggml_type if s.why == "kept" else spec(s.out).ggml_type


def _file_type(qtype: str) -> int:
    """general.file_type (llama.cpp's LLAMA_FTYPE) of a file whose matrices are `qtype`."""
    import gguf

    return int({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}[qtype])


def human_summary(s: dict[str, Any]) -> str:
    from hotneurons.common.units import format_bytes

    types = lambda d: ", ".join(f"{n} {k}" for k, n in sorted(d.items(), key=lambda kv: -kv[1]))  # noqa: E731
    return "\n".join([
        f"model  {s['model']} ({format_bytes(s['bytes_in'])}): {types(s['tensors_in'])}",
        f"wrote  {s['out']} ({format_bytes(s['bytes_out'])}, {s['bytes_out'] / s['bytes_in']:.2f}x): "
        f"{types(s['tensors_out'])} in {s['seconds']:.1f} s",
        f"tensors {', '.join(f'{n} {k}' for k, n in s['steps'].items())}"])
