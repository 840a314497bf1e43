"""The artifact contract between stages: run directories, meta.json, atomic writes, compatibility checks.

A run directory (default `runs/<model-slug>/`) holds one subfolder per stage (`profile/`, `placement/`,
`predictors/`), each with a `meta.json` recording its inputs. Every stage checks the `format_version` and
the model fingerprint of what it reads and refuses, in one line, an artifact made for something else.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd
from hotneurons import __version__

FORMAT_VERSION = 1  # bump when an on-disk layout changes; readers refuse other versions


class ArtifactError(Exception):
    """An artifact is missing, of another format version, or made for another model. One-line message."""


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


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temp file in the same folder, fsync, then rename: a crash leaves the old file intact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n").encode())


def read_json(path: str | os.PathLike) -> Any:
    with open(path) as f:
        return json.load(f)


def write_parquet(path: str | os.PathLike, df: pd.DataFrame) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        df.to_parquet(tmp, index=False)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def command_line() -> str:
    """How this process was started: `pi-profile --tokens ...`, or `python -m hotneurons.profiler ...`."""
    if sys.argv[0].endswith("__main__.py") and getattr(sys, "orig_argv", None):
        return " ".join(["python", *sys.orig_argv[1:]])
    return " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])


def base_meta(stage: str, inputs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fields every stage's meta.json starts with."""
    return {
        "stage": stage,
        "format_version": FORMAT_VERSION,
        "package_version": __version__,
        "command": command_line(),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "inputs": inputs or {},
    }


def replace_dir(staging: Path, final: Path) -> None:
    """Swap a fully written staging folder into place; the old folder is removed only after the swap."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(staging, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def check_meta(meta: dict[str, Any], stage: str, where: Path) -> None:
    if meta.get("stage") != stage:
        raise ArtifactError(f"{where} is a '{meta.get('stage')}' artifact, expected '{stage}'")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(
            f"{where} has format_version {meta.get('format_version')}, this hotneurons reads {FORMAT_VERSION}: "
            f"re-run the stage that made it with this version"
        )


def check_same_model(meta_a: dict[str, Any], meta_b: dict[str, Any], what_a: str, what_b: str) -> None:
    """Refuse artifacts made for different models (compares model fingerprints)."""
    fa, fb = meta_a["model"]["fingerprint"], meta_b["model"]["fingerprint"]
    if fa != fb:
        raise ArtifactError(
            f"{what_a} was made for model '{meta_a['model']['name']}' ({fa[:12]}) but {what_b} for "
            f"'{meta_b['model']['name']}' ({fb[:12]}): use artifacts of one model (or re-run with --force)"
        )


def read_profile(run_dir: str | os.PathLike) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Load `RUN/profile/neurons.parquet` (layer, neuron, count) and `RUN/profile/meta.json`."""
    pdir = Path(run_dir) / "profile"
    meta_path, table = pdir / "meta.json", pdir / "neurons.parquet"
    if not meta_path.exists() or not table.exists():
        raise ArtifactError(f"no profile in {pdir}: run `pi-profile --out {run_dir}` first")
    meta = read_json(meta_path)
    check_meta(meta, "profile", pdir)
    return pd.read_parquet(table), meta
