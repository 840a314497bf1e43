"""transformers' side of loading a model (models/family.load_model): its progress bars switched as the caller asks,
a GGUF's metadata parsed once per load, and the activation a GGUF records set on the config transformers built."""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def gguf_activation(path: str, config: Any) -> None:
    """Set the config's activation to the one a GGUF records (our key, PowerInfer's arch: weights/gguf_source.py)."""
    from hotneurons.weights.gguf_source import GGUFSource
    from hotneurons.weights.names import config_activation

    with GGUFSource(path) as src:
        if src.activation is not None:
            config_activation(config, src.activation, getattr(src.config, "fat_threshold", 0.0))


@contextmanager
def hf_progress(enabled: bool) -> Iterator[None]:
    """transformers' progress bars (de-quantizing a GGUF, loading weights) on or off within the block."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    # AutoConfig and AutoTokenizer each parse the GGUF's metadata (its whole vocabulary, seconds) for the same
    # config: parse it once per load
    read_gguf = getattr(gguf_utils, "load_gguf_checkpoint", None)
    parsed: dict[str, Any] = {}

    def read_once(path, return_tensors=False, **kw):
        if return_tensors or kw:
            return read_gguf(path, return_tensors=return_tensors, **kw)
        if path not in parsed:
            parsed[path] = read_gguf(path, return_tensors=False)
        return copy.deepcopy(parsed[path])

    if read_gguf is not None:
        gguf_utils.load_gguf_checkpoint = read_once
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)  # the de-quantization bar is plain tqdm, deaf to the switch above
    if gguf_tqdm is not None and not enabled:
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if read_gguf is not None:
            gguf_utils.load_gguf_checkpoint = read_gguf
