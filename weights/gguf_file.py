"""The GGUF container, parsed in place: `GGUFFile` reads a GGUF v2/v3 (or PowerInfer's PWRI) header from a
copy-on-write memory map: metadata (`meta`), tensors (name -> `Entry`: ggml dims, type, offset). ggml lists a tensor's
dims fastest-moving first; weights/gguf_source.py turns entries into torch views under canonical names."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from hotneurons.common.model_source import ModelError
from hotneurons.weights.formats import from_ggml_type, spec
from hotneurons.weights.source import map_file

T, V = gguf.GGMLQuantizationType, gguf.GGUFValueType  # the file's numbers, as gguf-py's writer names them
# PowerInfer's ggml (Dec 2023) numbers I8/I16/I32 16/17/18 (ggml.h:351-353); today's ggml T.I8/T.I16/T.I32 (24-26)
POWERINFER_INTS = {16: int(T.I8), 17: int(T.I16), 18: int(T.I32)}
INTS = {int(T.I8): np.int8, int(T.I16): np.int16, int(T.I32): np.int32,
        int(T.I64): np.int64}  # ggml's integer types (gpuidx files hold I32)
_LONG = 1024  # metadata arrays longer than this (vocabularies) are kept as their length until asked for
# GGUF metadata value types: fixed-size scalars (numpy dtype), a string, an array; as plain ints, since each of a
# vocabulary's strings is compared with them (an enum member's compare costs several times an int's)
_SCALARS = {int(t): dt for t, dt in (
    (V.UINT8, np.uint8), (V.INT8, np.int8), (V.UINT16, np.uint16), (V.INT16, np.int16), (V.UINT32, np.uint32),
    (V.INT32, np.int32), (V.FLOAT32, np.float32), (V.BOOL, np.bool_), (V.UINT64, np.uint64), (V.INT64, np.int64),
    (V.FLOAT64, np.float64))}
_STRING, _ARRAY = int(V.STRING), int(V.ARRAY)


@dataclass(frozen=True)
class Entry:
    """One row of the tensor table: shape in torch order, ggml type, absolute byte offset and size."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int


class GGUFFile:
    """A GGUF (or PWRI) file's header parsed in Python, the whole file mapped copy-on-write: `meta` (key -> value;
    arrays longer than _LONG as their length, `array(key)` reads them whole), `tensors` (name -> Entry), `buf` (the
    mapping as uint8). Nothing past the header is read. Written here rather than over gguf-py's GGUFReader, which
    builds a numpy view per vocabulary string (seconds for 50k tokens). Every tensor type of weights/formats.py is
    read (any mix of them); an integer one only as such (INTS: PowerInfer's GPU masks)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.buf = map_file(path)
            self._parse()
        except (struct.error, UnicodeDecodeError, ValueError, IndexError) as e:
            if isinstance(e, ModelError):
                raise
            raise ModelError(f"'{path}' is not a readable GGUF file ({type(e).__name__}: {e}): check it is whole "
                             f"(not a .partial) and GGUF v2/v3", params="model") from None

    def _parse(self) -> None:
        buf, path = self.buf, self.path
        magic = bytes(buf[:4])
        if magic not in (b"GGUF", b"PWRI"):
            raise ModelError(f"'{path}' is not a GGUF file (it does not start with GGUF or PWRI)", params="model")
        self.powerinfer = magic == b"PWRI"
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):  # a big-endian file reads as a huge version
            raise ModelError(f"'{path}' is GGUF version {version}: little-endian v2 or v3 is read; convert it with "
                             f"llama.cpp's current tools", params="model")
        self.meta: dict[str, Any] = {}
        self._long: dict[str, tuple[int, int, int]] = {}  # key -> (element type, count, offset)
        pos = 24
        for _ in range(n_kv):
            key, pos = self._string(pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            self.meta[key], pos = self._value(key, vtype, pos + 4)
        entries = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            gtype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            if self.powerinfer:
                gtype = POWERINFER_INTS.get(gtype, gtype)
            entries.append((name, tuple(int(n) for n in reversed(dims)), gtype, offset))  # ggml's ne: fastest first
        align = int(self.meta.get("general.alignment", 32))
        start = -(-pos // align) * align
        self.tensors: dict[str, Entry] = {}
        for name, shape, gtype, offset in entries:
            nbytes = _nbytes(path, name, shape, gtype)
            if start + offset + nbytes > buf.size:
                raise ModelError(f"'{path}' is truncated: tensor {name} ends past the file's {buf.size} bytes; "
                                 f"download or write it again", params="model")
            self.tensors[name] = Entry(name, shape, gtype, start + offset, nbytes)

    def _string(self, pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self.buf, pos)
        return bytes(self.buf[pos + 8:pos + 8 + n]).decode("utf-8"), pos + 8 + n

    def _value(self, key: str, vtype: int, pos: int) -> tuple[Any, int]:
        if vtype in _SCALARS:
            dt = np.dtype(_SCALARS[vtype]).newbyteorder("<")
            return np.frombuffer(self.buf, dt, 1, pos)[0].item(), pos + dt.itemsize
        if vtype == _STRING:
            return self._string(pos)
        if vtype != _ARRAY:
            raise ValueError(f"key {key} has value type {vtype}, which GGUF does not define")
        etype, count = struct.unpack_from("<IQ", self.buf, pos)
        pos += 12
        if count > _LONG:
            self._long[key] = (etype, count, pos)
            return count, self._skip(etype, count, pos)
        return self._elements(key, etype, count, pos)

    def _elements(self, key: str, etype: int, count: int, pos: int) -> tuple[list, int]:
        if etype in _SCALARS:
            dt = np.dtype(_SCALARS[etype]).newbyteorder("<")
            return np.frombuffer(self.buf, dt, count, pos).tolist(), pos + count * dt.itemsize
        out = []
        for _ in range(count):
            v, pos = self._value(key, etype, pos)
            out.append(v)
        return out, pos

    def _skip(self, etype: int, count: int, pos: int) -> int:
        if etype in _SCALARS:
            return pos + count * np.dtype(_SCALARS[etype]).itemsize
        if etype != _STRING:
            raise ValueError(f"an array of {count} elements of type {etype} is longer than this reader keeps")
        for _ in range(count):  # variable-length: walk the lengths
            pos += 8 + struct.unpack_from("<Q", self.buf, pos)[0]
        return pos

    def array(self, key: str) -> Any:
        """A metadata value whole (a vocabulary's tokens, merges, scores)."""
        if key not in self._long:
            return self.meta.get(key)
        etype, count, pos = self._long[key]
        return self._elements(key, etype, count, pos)[0]


def _nbytes(path: Path, name: str, shape: tuple[int, ...], gtype: int) -> int:
    n = int(np.prod(shape, dtype=np.int64))
    if gtype in INTS:
        return n * np.dtype(INTS[gtype]).itemsize
    try:
        s = spec(from_ggml_type(gtype))
    except ValueError as e:
        raise ModelError(f"'{path}', tensor {name}: {e}", params="model") from None
    if shape[-1] % s.block:
        raise ModelError(f"'{path}', tensor {name}: rows of {shape[-1]} are not whole blocks of {s.block}",
                         params="model")
    return n // s.block * s.block_bytes
