"""Where a model's modules live: whole decoder layers and an untied input embedding kept in CPU RAM (`OnCPULayer`,
`OnCPUEmbedding`), a hybrid FFN put in place of a layer's FFN (`install`), and the bytes on each side."""

from __future__ import annotations

import torch
from hotneurons.models.family import LoadedModel
from torch import nn


class _OnCPU(nn.Module):
    """A module `inner` kept in CPU RAM, out of the module tree (so that `model.to(device)` leaves it there), whose
    outputs go to the `home` device; its attributes read through (those the model reads, e.g. attention_type)."""

    def __init__(self, inner: nn.Module, device: torch.device | str):
        super().__init__()
        object.__setattr__(self, "inner", inner)
        self.home = torch.device(device)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["inner"], name)


class OnCPULayer(_OnCPU):
    """A whole decoder layer run on the CPU in float32 (layer-split mode); inputs and outputs hop devices."""

    def __init__(self, layer: nn.Module, device: torch.device | str, dtype: torch.dtype):
        super().__init__(layer.to("cpu", torch.float32), device)
        self.home_dtype = dtype

    @staticmethod
    def _move(obj, device, dtype=None):
        if isinstance(obj, torch.Tensor):
            return obj.to(device, dtype) if (dtype is not None and obj.is_floating_point()) else obj.to(device)
        if isinstance(obj, (tuple, list)):
            return type(obj)(OnCPULayer._move(o, device, dtype) for o in obj)
        if isinstance(obj, dict):
            return {k: OnCPULayer._move(v, device, dtype) for k, v in obj.items()}
        return obj

    def forward(self, *args, **kwargs):
        args = self._move(args, "cpu", torch.float32)
        kwargs = self._move(kwargs, "cpu", torch.float32)
        out = self.inner(*args, **kwargs)
        return self._move(out, self.home, self.home_dtype)


class OnCPUEmbedding(_OnCPU):
    """An untied model's input embedding kept in CPU RAM: a token reads one row of it, so the row is looked up on
    the CPU and copied to the device (llama.cpp keeps its input embedding on the CPU for the same reason), and the
    table's bytes go to hot neurons instead. pi-solve counts it there (solver/cost.py)."""

    def __init__(self, embedding: nn.Module, device: torch.device | str):
        super().__init__(embedding.to("cpu"), device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(ids.to("cpu")).to(self.home)


def embedding_to_cpu(lm: LoadedModel, device: torch.device | str) -> OnCPUEmbedding | None:
    """Keep an untied model's input embedding in CPU RAM (OnCPUEmbedding); tied ones are the LM head too and stay."""
    emb = lm.model.get_input_embeddings()
    if isinstance(emb, OnCPUEmbedding):
        return emb
    if not lm.info["params"]["lm_head"]:
        return None
    lm.model.set_input_embeddings(OnCPUEmbedding(emb, device))
    return lm.model.get_input_embeddings()


def install(lm: LoadedModel, layer: int, module: nn.Module) -> None:
    """Put `module` in place of layer `layer`'s FFN, dropping the original FFN weights."""
    block = lm.layers[layer]
    ad = lm.adapter
    if ad.mlp:
        setattr(block, ad.mlp, module)
    else:  # OPT: fc1 -> act -> fc2 sit in the layer itself; the hybrid module takes fc2's place and x
        setattr(block, ad.up, nn.Identity())
        setattr(block, "activation_fn", nn.Identity())
        setattr(block, ad.down, module)


def nbytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def count_bytes(lm: LoadedModel, ffns: list, cpu_layers: list[OnCPULayer]) -> tuple[int, int]:
    """(bytes on the compute device incl. predictors, bytes in CPU RAM: the hybrid FFNs' cold rows, CPU-side layers
    and an untied input embedding)."""
    dev = nbytes(lm.model)
    cpu = sum(f.cold_bytes() for f in ffns) + sum(nbytes(c.inner) for c in cpu_layers)
    emb = lm.model.get_input_embeddings()
    return dev, cpu + (nbytes(emb.inner) if isinstance(emb, OnCPUEmbedding) else 0)
