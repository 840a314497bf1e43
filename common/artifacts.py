"""The artifact contract between stages: run directories, stage metadata, atomic outputs, compatibility checks.

A run directory (default `runs/<model-slug>/`) holds one subfolder per stage (`profile/`, `placement/`,
`predictors/`, `eval/`), each with a `meta.json` recording its inputs. Every stage writes its folder through
`staged()` (all of it appears at once, or nothing changes) and checks what it reads: the stage, the
`format_version` of the folder's layout, the `schema_version` of each JSON file and the model fingerprint;
an artifact made for something else is refused in one line.

`StageMeta` here holds the fields every meta.json starts with; each artifact's own typed files (the profile's,
the placement's, the predictors' and the eval report's) are in artifacts/ (its __init__ lists them).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from hotneurons import __version__
from hotneurons.common.schema import (  # noqa: F401  (re-exported: the stages' one import for artifact I/O)
    ArtifactError,
    JsonFile,
    Section,
    atomic_path,
    atomic_write_bytes,
    optional,
    read_json,
    write_json,
)

FORMAT_VERSION = 1  # bump when a stage folder's layout (tables, tensors, sample files) changes
M = TypeVar("M", bound="StageMeta")


def slugify(name: str) -> str:
    """`HuggingFaceTB/SmolLM2-135M-Instruct` -> `SmolLM2-135M-Instruct`; a path -> its last component."""
    base = name.rstrip("/").split("/")[-1]
    for ext in (".gguf", ".safetensors", ".bin"):
        if base.lower().endswith(ext):
            base = base[: -len(ext)]
    slug = "".join(c if c.isalnum() or c in "-_." else "-" for c in base).strip("-.")
    return slug or "model"


def default_run_dir(model_name: str) -> Path:
    return Path("runs") / slugify(model_name)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


if TYPE_CHECKING:  # pandas loads in ~0.3 s: only where a table is read or written (the CLIs' --help stays quick)
    import pandas as pd


def write_parquet(path: str | os.PathLike, df: pd.DataFrame) -> None:
    with atomic_path(path) as tmp:
        df.to_parquet(tmp, index=False)


def _reason(e: BaseException) -> str:
    """The first line of an exception's message, for a one-line error."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def check_table(path: str | os.PathLike, columns: tuple[str, ...], writer: str) -> None:
    """Refuse a parquet file that is empty, truncated, not parquet, or lacks `columns`, in one line naming the file
    and `writer` (the command to re-run). Reads only the footer."""
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
    except Exception as e:  # ArrowInvalid, OSError: empty, random bytes, cut short
        raise ArtifactError(f"{path} is not a readable parquet table ({_reason(e)}): re-run {writer}") from None
    missing = [c for c in columns if c not in names]
    if missing:
        raise ArtifactError(f"{path} lacks the column(s) {', '.join(missing)}: re-run {writer}")


def read_table(path: str | os.PathLike, columns: tuple[str, ...], writer: str) -> pd.DataFrame:
    """`check_table`, then the table; a file that breaks while read is refused the same way."""
    check_table(path, columns, writer)
    try:
        import pandas as pd

        return pd.read_parquet(path)
    except Exception as e:
        raise ArtifactError(f"{path} is not a readable parquet table ({_reason(e)}): re-run {writer}") from None


def check_tensors(path: str | os.PathLike, writer: str) -> list[str]:
    """The tensor names of a safetensors file; an empty, cut or foreign file is refused in one line."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # SafetensorError, OSError
        raise ArtifactError(f"{path} is not a readable safetensors file ({_reason(e)}): re-run {writer}") from None


def check_npy(path: str | os.PathLike, writer: str, dtype: Any = None, shape: tuple[int | None, ...] | None = None):
    """A read-only memory map of a .npy file; a missing, empty, cut or misshapen one is refused in one line.
    `shape` entries that are None are not checked."""
    import numpy as np

    path = Path(path)
    if not path.exists():
        raise ArtifactError(f"{path} is missing: re-run {writer}")
    if path.stat().st_size == 0:
        raise ArtifactError(f"{path} is empty: re-run {writer}")
    try:
        a = np.load(path, mmap_mode="r")
    except Exception as e:  # ValueError "mmap length is greater than file size", EOFError, UnpicklingError
        raise ArtifactError(f"{path} is truncated or not a .npy array ({_reason(e)}): re-run {writer}") from None
    if dtype is not None and a.dtype != np.dtype(dtype):
        raise ArtifactError(f"{path} holds {a.dtype}, expected {np.dtype(dtype)}: re-run {writer}")
    if shape is not None and (a.ndim != len(shape) or any(w is not None and w != n for w, n in zip(shape, a.shape))):
        want = "(" + ", ".join("*" if w is None else str(w) for w in shape) + ")"
        raise ArtifactError(f"{path} has shape {a.shape}, expected {want}: re-run {writer}")
    return a


# ---------------------------------------------------------------------------------------------------------------
# Interrupts


class StageInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a stage. `kept` is the folder holding a checkpoint to resume from, None when nothing was kept
    (nothing then stands in the way of a fresh run); `done` is the finished stage folder when the interrupt came
    while it was written (the write is completed first)."""

    def __init__(self, message: str, *, kept: Path | None = None, done: Path | None = None):
        super().__init__(message)
        self.kept, self.done = kept, done


@contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Ctrl-C (SIGINT) waits until the block ends, then raises KeyboardInterrupt: for writes that must not stop
    half way (a checkpoint's files, the swap of a finished folder). Outside the main thread a plain block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    old = signal.getsignal(signal.SIGINT)
    if old in (signal.SIG_IGN, None):
        yield
        return
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if caught:
        raise KeyboardInterrupt


# ---------------------------------------------------------------------------------------------------------------
# Stage folders


@contextmanager
def staged(final: str | os.PathLike, *, fresh: bool = True, owner: bool = True,
           keep_on_failure: Callable[[Path], bool] | bool = False) -> Iterator[Path]:
    """Build a stage folder in `.{name}.partial` next to `final`, then swap it into place in one rename.

    Yields the partial folder. When the block ends normally the old `final` (if any) is renamed aside, the
    partial folder renamed onto `final`, and the old one removed: a reader sees the old folder or the new one.
    When the block raises, `final` is untouched and the partial folder is removed, unless
    `keep_on_failure` (a bool, or a test of the partial folder) says it holds work worth resuming.
    `fresh=False` reuses a partial folder left by an earlier attempt (resume). `owner=False` (the other ranks
    of a distributed run) only yields the path: the owner creates, swaps and removes it.
    """
    final = Path(final)
    partial = final.with_name(f".{final.name}.partial")
    if owner and fresh:
        shutil.rmtree(partial, ignore_errors=True)
    if owner:
        partial.mkdir(parents=True, exist_ok=True)
    try:
        yield partial
    except BaseException:
        keep = keep_on_failure(partial) if callable(keep_on_failure) else keep_on_failure
        if owner and not keep:
            with deferred_interrupt():  # a second Ctrl-C must not leave half a folder
                shutil.rmtree(partial, ignore_errors=True)
        raise
    if owner:
        with deferred_interrupt():
            _swap_in(partial, final)


def _swap_in(partial: Path, final: Path) -> None:
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(partial, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def command_line() -> str:
    """How this process was started: `pi-profile --tokens ...`, or `python -m hotneurons.profiler ...`."""
    if sys.argv[0].endswith("__main__.py") and getattr(sys, "orig_argv", None):
        return " ".join(["python", *sys.orig_argv[1:]])
    return " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------------------------------------------
# meta.json


@dataclass(kw_only=True)
class StageMeta(JsonFile):
    """The fields every stage's meta.json starts with. Subclasses set STAGE and add the stage's own fields.
    `model` is the model section (common/model_info.ModelInfo.to_meta): shapes, parameters, fingerprint."""

    STAGE: ClassVar[str] = ""

    stage: str
    format_version: int = FORMAT_VERSION
    package_version: str = __version__
    command: str = field(default_factory=command_line)
    created: str = field(default_factory=_now)
    inputs: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls: type[M], d: Any, where: str = "", fix: str = "") -> M:
        if isinstance(d, dict):
            check_meta(d, cls.STAGE, where)
        return super().from_dict(d, where, fix)


def base_meta(stage: str, inputs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fields every stage's meta.json starts with, as a plain dict (hand-made artifacts in tests and benches
    add "model" and their own fields)."""
    d = StageMeta(stage=stage, inputs=inputs or {}).to_dict()
    del d["model"]
    return d


def check_meta(meta: dict[str, Any], stage: str, where: str | Path) -> None:
    """Refuse another stage's meta.json or another format version (one line naming the file and the fix)."""
    if stage and meta.get("stage") != stage:
        raise ArtifactError(f"{where} is a '{meta.get('stage')}' artifact, expected '{stage}'")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(
            f"{where} has format_version {meta.get('format_version')}, this hotneurons reads {FORMAT_VERSION}: "
            f"re-run the stage that made it with this version"
        )


def _model(meta: Any) -> dict[str, Any]:
    return meta.model if isinstance(meta, StageMeta) else meta["model"]


def check_same_model(meta_a: Any, meta_b: Any, what_a: str, what_b: str) -> None:
    """Refuse artifacts made for different models (compares model fingerprints). Either side may be a StageMeta
    or a dict with a "model" entry."""
    ma, mb = _model(meta_a), _model(meta_b)
    fa, fb = ma["fingerprint"], mb["fingerprint"]
    if fa != fb:
        raise ArtifactError(
            f"{what_a} was made for model '{ma['name']}' ({fa[:12]}) but {what_b} for "
            f"'{mb['name']}' ({fb[:12]}): use artifacts of one model"
        )
