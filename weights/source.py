"""A model's tensors read in place from its files: `WeightSource` (the common interface), `open_source`.

`get(name)` returns a CPU tensor over the file's memory map, no copy: float formats (F32/F16/BF16) as a torch tensor
of that dtype, block formats as a `QTensor` whose data are the mapped rows. Names are canonical (weights/names.py),
values HF's; where a reverse conversion changes values (Gemma's norm shift, Q/K row order of a GGUF) the result is a
copy, which the TensorInfo says. Pages read stay resident (as page cache mapped into this process) until
`release(name)` drops them from the process, once a tensor was copied to the GPU or into the host layout: what was
handed out stays valid and reads the file again if touched.

The files are mapped copy-on-write (MAP_PRIVATE): writing into a returned tensor never changes the file.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hotneurons.common.kinds import Activation
from hotneurons.common.model_source import ModelError
from hotneurons.weights.formats import WeightFormat
from hotneurons.weights.qtensor import FLOAT_DTYPES, QTensor


@dataclass(frozen=True)
class TensorInfo:
    """One canonical tensor: its shape in torch order and its stored format. `transposed`: stored as the transpose
    of the canonical weight (PowerInfer's ffn_down_t, (n_ff, d)); `converted`: get() makes a (small) copy to undo
    the converter (none, "permuted rows", "norm shift", "regrouped qkv"), or a copy of a file's per-expert tensors
    ("stacked experts", not small: weights/safetensors_source.py)."""

    name: str
    shape: tuple[int, ...]
    fmt: WeightFormat
    nbytes: int  # bytes in the file
    transposed: bool = False
    converted: str | None = None


@dataclass(frozen=True)
class Span:
    """Where a tensor's bytes lie: `buf` a uint8 numpy view of the whole mapping, [offset, offset + nbytes)."""

    buf: np.ndarray
    offset: int
    nbytes: int

    def array(self) -> np.ndarray:
        return self.buf[self.offset:self.offset + self.nbytes]  # (nbytes,) uint8 view of the map


def view(span: Span, fmt: WeightFormat, shape: tuple[int, ...]) -> torch.Tensor | QTensor:
    """The mapped bytes as a float tensor of `shape`, or a QTensor of (prod(shape[:-1]), shape[-1]); no copy."""
    raw = torch.from_numpy(span.array())  # (nbytes,) uint8, shares the map
    if fmt in FLOAT_DTYPES:
        if (span.buf.ctypes.data + span.offset) % FLOAT_DTYPES[fmt].itemsize:  # torch views need aligned data
            raise ModelError(f"a {fmt} tensor at byte {span.offset} is not aligned to its element size: re-save the "
                             f"file with an aligned writer (safetensors >= 0.3, gguf-py)", params="model")
        return raw.view(FLOAT_DTYPES[fmt]).reshape(shape)
    rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    return QTensor(raw.reshape(rows, -1), fmt, (rows, int(shape[-1])))


# map_file's mappings by start address: (path, bytes, the read-only shared mapping of the same file once asked for)
_MAPPED: dict[int, list] = {}


def map_file(path: str | os.PathLike) -> np.ndarray:
    """The whole file as a uint8 array over a copy-on-write mapping (writable views; the file never changes); the
    mapping lives as long as any view of it."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise ModelError(f"'{path}' is empty: download or write it again", params="model")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    buf = np.frombuffer(mm, dtype=np.uint8)  # keeps `mm` alive as its base
    start = buf.ctypes.data
    _MAPPED[start] = [str(path), buf.nbytes, None]
    weakref.finalize(mm, _MAPPED.pop, start, None)
    return buf


def shared_view(a: np.ndarray) -> np.ndarray:
    """`a` (a C-contiguous view inside a map_file mapping) as the same bytes of a read-only shared mapping of the
    file, opened once per file; `a` itself where it lies in no such mapping (anonymous memory, a copy). Why: CUDA
    page-locks a shared mapping's page-cache pages in place, where pinning a private mapping's pages copies each
    into anonymous memory first (the kernel unshares them for copy-on-write), slowly and resident twice."""
    p = a.ctypes.data
    for start, entry in _MAPPED.items():
        if start <= p < start + entry[1]:
            if entry[2] is None:
                with open(entry[0], "rb") as f:
                    entry[2] = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)
            raw = entry[2][p - start:p - start + a.nbytes]  # (bytes,) uint8, read-only
            return raw.view(a.dtype).reshape(a.shape)
    return a


_PAGE = mmap.PAGESIZE
_libc = None


def _madvise(addr: int, length: int, advice: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise({addr:#x}, {length}) failed: {os.strerror(err)}")


def drop_pages(span: Span) -> int:
    """madvise(MADV_DONTNEED) on the whole pages inside the span (rounded inward: a page shared with a neighbour
    stays); returns the bytes advised. A no-op where the OS has no MADV_DONTNEED."""
    return drop_range(span.buf.ctypes.data + span.offset, span.nbytes)


def drop_range(start: int, nbytes: int) -> int:
    """madvise(MADV_DONTNEED) on the whole pages inside [start, start + nbytes) of a file's private mapping (never
    anonymous memory: it would read back as zeros); returns the bytes advised."""
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if advice is None:
        return 0
    lo = -(-start // _PAGE) * _PAGE
    hi = (start + nbytes) // _PAGE * _PAGE
    if hi <= lo:
        return 0
    _madvise(lo, hi - lo, advice)
    return hi - lo


class WeightSource:
    """A model's weights read in place. Subclasses fill `path`, `config`, `activation`, `infos` and `_spans` (canonical
    name -> Span), and override `get` where values need converting."""

    path: Path
    config: Any  # the transformers (text) config
    activation: Activation | None  # what the file records; None: the config's (models/family.py's adapter)
    infos: dict[str, TensorInfo]
    _spans: dict[str, Span]

    def get(self, name: str) -> torch.Tensor | QTensor:
        """The canonical tensor, in place (see the module's docstring)."""
        info = self.info(name)
        return view(self._spans[name], info.fmt, info.shape)

    def info(self, name: str) -> TensorInfo:
        if name not in self.infos:
            near = sorted(n for n in self.infos if n.split(".")[-2:] == name.split(".")[-2:])[:3]
            raise KeyError(f"no tensor {name!r} in {self.path}" + (f" (tensors like it: {', '.join(near)})" if near
                                                                     else ": see .infos for the names it has"))
        return self.infos[name]

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def __iter__(self) -> Iterator[str]:
        return iter(self.infos)

    def release(self, name: str) -> int:
        """Drop this tensor's pages from the process (the file's page cache keeps them for the OS to reuse);
        returns the bytes released. Tensors already handed out stay valid: touched again, they read the file again
        (so writes into them are lost: the mapping is private)."""
        self.info(name)
        return drop_pages(self._spans[name])

    def release_view(self, t: torch.Tensor | QTensor) -> int:
        """Drop the pages of one contiguous view handed out by `get` (some rows of a tensor), as `release` does a
        whole tensor's; returns the bytes released. A tensor outside this source's mappings (a copy) is left alone:
        its memory is not the file's, and dropping it would zero it."""
        data = t.data if isinstance(t, QTensor) else t
        if not data.is_contiguous() or not self.is_mapped(t):
            return 0
        return drop_range(data.data_ptr(), data.numel() * data.element_size())

    def is_mapped(self, t: torch.Tensor | QTensor) -> bool:
        """Whether `t`'s memory lies inside one of this source's mappings (a view, not a copy)."""
        data = t.data if isinstance(t, QTensor) else t
        ptr = data.data_ptr()
        return any(b.ctypes.data <= ptr < b.ctypes.data + b.nbytes for b in self._buffers())

    def _buffers(self) -> list[np.ndarray]:
        return list({id(s.buf): s.buf for s in self._spans.values()}.values())

    def tokenizer(self) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        """Forget the mappings; they are unmapped once no tensor handed out refers to them."""
        self._spans = {}

    def __enter__(self) -> WeightSource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, {len(self.infos)} tensors)"


def magic(path: str | os.PathLike) -> bytes:
    with open(path, "rb") as f:
        return f.read(4)


def open_source(model_path: str | os.PathLike, gguf_file: str | None = None) -> WeightSource:
    """The weights of a model: a folder with config.json and *.safetensors, a .gguf file (PowerInfer's PWRI files
    too), or a folder and the name of a GGUF file in it."""
    path = Path(model_path)
    if gguf_file is not None:
        path = path / gguf_file
        if not path.is_file():
            raise ModelError(f"GGUF file '{gguf_file}' not found in folder '{model_path}'",
                             params=("gguf_file", "model"))
    if not path.exists():
        raise ModelError(f"model '{path}' does not exist: name a folder with config.json and *.safetensors, or a "
                         f".gguf file", params="model")
    if path.is_file():
        if magic(path) not in (b"GGUF", b"PWRI"):
            raise ModelError(f"'{path}' is not a GGUF file (it does not start with GGUF or PWRI): name a .gguf file "
                             f"or a folder with *.safetensors", params="model")
        from hotneurons.weights.gguf_source import GGUFSource

        return GGUFSource(path)
    if any(path.glob("*.safetensors")):
        from hotneurons.weights.safetensors_source import SafetensorsSource

        return SafetensorsSource(path)
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if ggufs:
        raise ModelError(f"folder '{path}' has no *.safetensors but GGUF files ({', '.join(ggufs[:4])}): name one "
                         f"as gguf_file", params="gguf_file")
    raise ModelError(f"folder '{path}' has no *.safetensors or .gguf file: name a model folder or a .gguf file",
                     params="model")
