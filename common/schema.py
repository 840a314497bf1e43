"""Typed JSON files: dataclasses that read and write one artifact file each, with a schema version.

`Section` is a JSON object with named fields (nested sections, lists and dicts of them, `Kind` enums, plain
values); `JsonFile` is a whole file: it adds `schema_version`, `load(path)` and `save(path)`. Field names are
the on-disk keys, so a file's dataclass is also its documentation (docs/artifacts.md lists them).

Rules every file follows:
- a reader refuses another `schema_version` in one line naming the file and the stage to re-run. A file
  without the key predates it and has version 1's keys, so it reads as version 1;
- a required field (no default) that is missing is refused the same way; keys the class does not name are
  kept in `extras` and written back, so reading and saving a file loses nothing;
- an `optional()` field is left out of the file while it is None (keys that only some files have);
- `obj["key"]` reads like the JSON object (nested sections come back as plain dicts), for notebooks and
  scripts written against the files. New code uses attributes.

Also here, because the files are written through them: ArtifactError and the atomic write primitives.
"""

from __future__ import annotations

import json
import os
import tempfile
import types
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import MISSING, dataclass, field, fields
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from hotneurons.common.kinds import FixableError, Kind, choose

S = TypeVar("S", bound="Section")
F = TypeVar("F", bound="JsonFile")


class ArtifactError(FixableError):
    """An artifact is missing, of another format version, or made for another model. One-line message."""


# ---------------------------------------------------------------------------------------------------------------
# Atomic writes


def umask() -> int:
    """The process's umask, read without changing it where Linux shows it (/proc/self/status)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (not thread-safe, hence the above first)
    os.umask(mask)
    return mask


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temp path next to `path`; renamed onto `path` when the block ends, removed if it raises.

    The rename is atomic on one file system, so a reader sees the old file or the new one, never half of one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes it 0600: give the file the mode open() would have
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write, fsync, then rename: a crash leaves the old file intact."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _json_default(o: Any) -> Any:
    if isinstance(o, Section):
        return o.to_dict()
    if hasattr(o, "tolist"):  # numpy arrays and scalars
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n").encode())


def read_json(path: str | os.PathLike) -> Any:
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------------------------
# Typed JSON objects

_OMIT = "omit_when_none"


def optional(**kw: Any) -> Any:
    """A field that defaults to None and is left out of the JSON while None (a key only some files have)."""
    return field(default=None, metadata={_OMIT: True}, **kw)


@dataclass(kw_only=True)
class Section:
    """A JSON object with typed fields; see the module docstring."""

    extras: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Kind fields given as their string values become members (so a typo fails where it is made)."""
        hints = _hints(type(self))
        for f in _fields(type(self)):
            tp, v = hints[f.name], getattr(self, f.name)
            if typing.get_origin(tp) in (typing.Union, types.UnionType):
                tp = next((a for a in typing.get_args(tp) if a is not type(None)), tp)
            if isinstance(v, str) and isinstance(tp, type) and issubclass(tp, Kind) and not isinstance(v, tp):
                setattr(self, f.name, choose(v, tp, f.name))

    @classmethod
    def from_dict(cls: type[S], d: Any, where: str = "", fix: str = "re-run the stage that wrote it") -> S:
        """Build from a parsed JSON object; a missing required key or a wrong kind raises ArtifactError."""
        if not isinstance(d, dict):
            raise ArtifactError(f"{where}: expected a JSON object for {cls.__name__}, got {type(d).__name__}: {fix}")
        hints, kw = _hints(cls), {}
        for f in _fields(cls):
            if f.name in d:
                kw[f.name] = _convert(hints[f.name], d[f.name], where, f.name, fix)
            elif f.default is MISSING and f.default_factory is MISSING:
                raise ArtifactError(f"{where} lacks {f.name!r}: {fix}")
        kw["extras"] = {k: v for k, v in d.items() if k not in kw and k not in _names(cls)}
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: fields in declaration order, then the extras."""
        return {**{f.name: _plain(getattr(self, f.name)) for f in _fields(type(self)) if not self._absent(f)},
                **self.extras}

    def _absent(self, f) -> bool:
        return f.metadata.get(_OMIT, False) and getattr(self, f.name) is None

    # dict-style reads (the JSON value of a key), for code written against the files
    def __getitem__(self, key: str) -> Any:
        if key in self.extras or key not in self:
            return self.extras[key]
        return _plain(getattr(self, key))

    def __contains__(self, key: object) -> bool:
        if key in self.extras:
            return True
        f = _by_name(type(self)).get(key)
        return f is not None and not self._absent(f)

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def keys(self) -> list[str]:
        return list(self.to_dict())


@dataclass(kw_only=True)
class JsonFile(Section):
    """One artifact file. Subclasses set SCHEMA_VERSION (bump it when a key changes meaning or goes) and WRITER
    (the command that writes the file: the fix a reader names)."""

    SCHEMA_VERSION: ClassVar[int] = 1
    WRITER: ClassVar[str] = "the stage that wrote it"

    schema_version: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        self.schema_version = type(self).SCHEMA_VERSION  # what this code writes

    @classmethod
    def from_dict(cls: type[F], d: Any, where: str = "", fix: str = "") -> F:
        fix = fix or f"re-run {cls.WRITER} with this hotneurons"
        v = d.get("schema_version", 1) if isinstance(d, dict) else None
        if v != cls.SCHEMA_VERSION:
            raise ArtifactError(f"{where} has schema_version {v}, this hotneurons reads {cls.SCHEMA_VERSION}: {fix}")
        return super().from_dict(d, where, fix)

    @classmethod
    def load(cls: type[F], path: str | os.PathLike) -> F:
        path = Path(path)
        if not path.exists():
            raise ArtifactError(f"no {path}: run {cls.WRITER} first")
        try:
            d = read_json(path)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ArtifactError(f"{path} is not valid JSON ({e.msg if hasattr(e, 'msg') else e}): "
                                f"re-run {cls.WRITER}") from None
        return cls.from_dict(d, str(path))

    def save(self, path: str | os.PathLike) -> None:
        write_json(path, self.to_dict())


@lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@lru_cache(maxsize=None)
def _fields(cls: type) -> tuple:
    return tuple(f for f in fields(cls) if f.name != "extras")


@lru_cache(maxsize=None)
def _names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in _fields(cls))


@lru_cache(maxsize=None)
def _by_name(cls: type) -> dict[str, Any]:
    return {f.name: f for f in _fields(cls)}


def _convert(tp: Any, v: Any, where: str, name: str, fix: str) -> Any:
    """A parsed JSON value -> the field's type (sections, enums, lists and dicts of them); other values as they are."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if v is None:
            return None
        tp = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if v is None:
        return None
    if origin is list and args:
        return [_convert(args[0], x, where, name, fix) for x in v]
    if origin is dict and len(args) == 2:
        return {k: _convert(args[1], x, where, f"{name}.{k}", fix) for k, x in v.items()}
    if isinstance(tp, type) and issubclass(tp, Section):
        return tp.from_dict(v, where, fix)
    if isinstance(tp, type) and issubclass(tp, Kind):
        if v not in tp.values():
            raise ArtifactError(f"{where}: unknown {name} {v!r} (this hotneurons knows {', '.join(tp.values())}): "
                                f"{fix}")
        return tp(v)
    return v


def _plain(v: Any) -> Any:
    if isinstance(v, Section):
        return v.to_dict()
    if isinstance(v, Kind):
        return v.value
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v
