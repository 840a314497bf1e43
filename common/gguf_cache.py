"""A cache of de-quantized GGUF models, so that only the first load of a GGUF file pays for transformers' parsing
and de-quantization (tens of seconds on a few cores; later loads read safetensors in about a second).

An entry is an HF folder (config.json, model.safetensors, the tokenizer's files) plus `hotneurons-cache.json`, the
manifest, under `ROOT/gguf/<sha256 of the GGUF file>-<dtype>/`, with the weights exactly as the GGUF load made them
in that dtype. ROOT is $HOTNEURONS_CACHE, else $XDG_CACHE_HOME/hotneurons, else ~/.cache/hotneurons;
HOTNEURONS_CACHE=off (or 0, none, false, no) turns the cache off.

The key is the file's content: its full sha256 is computed once and remembered under `ROOT/gguf/hashes/` with the
file's size, mtime and inode; while these stay the same, the remembered hash is used without reading the file.
An entry is built in a temporary folder and renamed into place once complete, so readers never see half of one;
an entry that fails its manifest check or fails to load is removed and rebuilt.

The model's identity (common/model_source.fingerprint, the "source" in meta.json) is that of the GGUF file either way.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

from hotneurons.common.schema import umask

FORMAT = 1
MANIFEST = "hotneurons-cache.json"
_OFF = ("off", "0", "none", "false", "no", "")


def cache_root() -> Path | None:
    """The cache's root folder, or None when HOTNEURONS_CACHE turns it off."""
    env = os.environ.get("HOTNEURONS_CACHE")
    if env is not None:
        return None if env.strip().lower() in _OFF else Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hotneurons"


def _write_json(path: Path, obj: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2)
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def file_sha256(path: str | os.PathLike, root: Path | None = None) -> str:
    """The file's sha256, remembered under `root` by (path, size, mtime, inode): read in full once per change."""
    path = Path(path).resolve()
    st = path.stat()
    stamp = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}
    memo = None
    if root is not None:
        memo = root / "gguf" / "hashes" / (hashlib.sha256(str(path).encode()).hexdigest()[:32] + ".json")
        try:
            with open(memo) as f:
                known = json.load(f)
            if {k: known.get(k) for k in stamp} == stamp and len(known.get("sha256", "")) == 64:
                return known["sha256"]
        except (OSError, ValueError, AttributeError):
            pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    digest = h.hexdigest()
    if memo is not None:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            _write_json(memo, {**stamp, "sha256": digest})
        except OSError:  # a read-only cache: hash again next time
            pass
    return digest


def _save_weights(model: Any, path: Path) -> None:
    """The state dict as safetensors; a tensor tied to an earlier one (lm_head to the embedding) is left out, as
    save_pretrained does: transformers refuses save_pretrained on a model loaded from a GGUF (a "quantized" one)."""
    from safetensors.torch import save_file

    tensors, seen = {}, set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        tensors[name] = t.detach().contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


class Entry:
    """One GGUF file's cache entry for one dtype: `folder` exists when `valid()`."""

    def __init__(self, gguf_path: str | os.PathLike, dtype: str, root: Path):
        self.gguf_path = Path(gguf_path)
        self.dtype = dtype
        self.root = root
        self.sha256 = file_sha256(gguf_path, root)
        self.folder = root / "gguf" / f"{self.sha256}-{dtype}"

    def valid(self) -> bool:
        """The manifest is there, names this file and dtype, and every file it lists has its size."""
        try:
            with open(self.folder / MANIFEST) as f:
                m = json.load(f)
            if (m.get("format"), m.get("gguf_sha256"), m.get("dtype")) != (FORMAT, self.sha256, self.dtype):
                return False
            files = m["files"]
            return bool(files) and all((self.folder / n).stat().st_size == s for n, s in files.items())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False

    def remove(self) -> None:
        """Move a broken entry aside (atomic), then delete it."""
        if not self.folder.exists():
            return
        trash = self.folder.with_name(f".trash-{self.folder.name}-{os.getpid()}")
        try:
            os.replace(self.folder, trash)
        except OSError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def save(self, model: Any, tokenizer: Any) -> bool:
        """Write the entry from a model loaded from the GGUF (in `dtype`) and its tokenizer; False if it could not."""
        parent = self.folder.parent
        tmp = None
        try:
            parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".tmp-{self.folder.name}-"))
            _save_weights(model, tmp / "model.safetensors")
            config = copy.deepcopy(model.config)  # the config the GGUF load made (fingerprints hash it) ...
            if hasattr(config, "quantization_config"):  # ... less the GGUF "quantization", the weights being plain
                del config.quantization_config
            config.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
            mode = 0o666 & ~umask()
            for name in files:
                os.chmod(tmp / name, mode)
            manifest = {"format": FORMAT, "gguf_sha256": self.sha256, "gguf_file": str(self.gguf_path.resolve()),
                        "dtype": self.dtype, "files": files}
            with open(tmp / MANIFEST, "w") as f:
                json.dump(manifest, f, indent=2)
            os.chmod(tmp / MANIFEST, mode)
            os.chmod(tmp, 0o777 & ~umask())
            self.remove()  # an invalid one in the way
            try:
                os.rename(tmp, self.folder)
            except OSError:  # another process renamed its entry first: keep that one
                if not self.valid():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
            return True
        except Exception as e:  # a full or read-only disk must not fail the load: the model is in memory
            warnings.warn(f"could not write the GGUF cache entry {self.folder}: {e}", stacklevel=2)
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            return False


def entry_for(gguf_path: str | os.PathLike, dtype: str) -> Entry | None:
    """The cache entry of this GGUF file and dtype (valid or not), or None when the cache is off."""
    root = cache_root()
    if root is None:
        return None
    try:
        return Entry(gguf_path, dtype, root)
    except OSError as e:
        warnings.warn(f"GGUF cache off: {e}", stacklevel=2)
        return None
