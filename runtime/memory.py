"""What a layout will take of host and device memory, counted from the file's tensor table before anything loads,
and the check that refuses, in one line, a load that would not fit (instead of an out-of-memory kill halfway).

Host: the cold rows in their format, plus everything the device part holds when the device is the CPU, plus one
layer's conversion temporaries. Device: the decoder's weights (attention, norms, embeddings, head) as they will be
stored, the hot rows, the static KV cache. The file's pages are not counted: they are page cache, released tensor by
tensor as the load copies them.

HOTNEURONS_HOST_MEMORY (a size such as 16GB) replaces the host memory the check sees as available: to plan for
another machine, or to test the refusal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hotneurons.common.memory import SLACK, MemoryPlanError, available_host
from hotneurons.kernels.qlayout_k import K_FORMATS
from hotneurons.weights.formats import bytes_per_weight, kernel_format, spec, weight_format
from hotneurons.weights.names import layer_name


@dataclass(frozen=True)
class MemoryNeed:
    host: int  # bytes of anonymous host memory the layout keeps
    gpu: int  # bytes on the compute device (0 when it is the CPU: counted in host)
    temp: int  # bytes of the largest layer's conversion temporaries while loading


def is_ffn_weight(name: str) -> bool:
    """An FFN projection's tensor (laid out by the hybrid FFNs), not a norm."""
    return ".ffn_" in name and "norm" not in name


def _stored_bytes(info: Any, dtype: torch.dtype) -> int:
    """Bytes of a non-FFN tensor on the device: block formats as stored where the GEMV reads them, else in the format
    they are converted to at load (weights/formats.kernel_format), floats in the compute dtype."""
    if spec(info.fmt).block > 1:
        fmt = kernel_format(info.fmt, "cuda")
        return int(info.nbytes) if fmt == info.fmt else int(np.prod(info.shape) * bytes_per_weight(fmt))
    return int(np.prod(info.shape)) * torch.empty((), dtype=dtype).element_size()


def _hot_bytes(source: Any, i: int, gpu: np.ndarray, d: int, mats: int, hot_fmt: str, neuron_major: bool) -> int:
    """Layer i's hot rows on the device (gpu: its neurons' mask): in hot_fmt, or for a K-quant hot_fmt in the formats
    models/ffn_weights.k_hot_formats keeps them in (its down projection's may differ)."""
    n_hot = int(gpu.sum())
    if weight_format(hot_fmt) not in K_FORMATS:
        return int(n_hot * mats * d * bytes_per_weight(hot_fmt))
    from hotneurons.models.ffn_weights import k_hot_formats

    down = source.infos.get(layer_name(i, "ffn_down.weight")) or source.infos.get(layer_name(i, "ffn_down_t.weight"))
    rows, dn = k_hot_formats(weight_format(hot_fmt), source.infos[layer_name(i, "ffn_up.weight")].fmt, down.fmt,
                             dense=n_hot == len(gpu), neuron_major=neuron_major)
    return int(n_hot * d * ((mats - 1) * bytes_per_weight(rows) + bytes_per_weight(dn)))


def _cold_bytes(source: Any, i: int, n_cold: int, d: int, mats: int, cold_fmt: str) -> int:
    """Layer i's cold rows in CPU RAM: in cold_fmt, or for a K-quant in models/ffn_weights.cold_formats' formats
    (its down_t's may differ)."""
    if weight_format(cold_fmt) not in K_FORMATS:
        return int(n_cold * mats * d * bytes_per_weight(cold_fmt))
    from hotneurons.models.ffn_weights import cold_formats

    infos = source.infos
    down = infos.get(layer_name(i, "ffn_down.weight")) or infos.get(layer_name(i, "ffn_down_t.weight"))
    gate = infos.get(layer_name(i, "ffn_gate.weight"))
    rows, dt = cold_formats(weight_format(cold_fmt), infos[layer_name(i, "ffn_up.weight")].fmt,
                            None if gate is None else gate.fmt, down.fmt)
    return int(n_cold * d * ((mats - 1) * bytes_per_weight(rows) + bytes_per_weight(dt)))


def plan_bytes(source: Any, placement: Any, cold_fmt: str, hot_fmt: str, dtype: torch.dtype, ctx: int,
               info: dict, neuron_major: bool = False) -> MemoryNeed:
    """The memory a layout of `source` will take (see the module's docstring); neuron_major: the hot rows laid out
    for kernels/gated.py (the gate mask on CUDA)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    d, n = info["d_model"], info["n_neurons"]
    mats = 3 if info["gated"] else 2
    cold = sum(_cold_bytes(source, i, len(g) - int(np.sum(g)), d, mats, cold_fmt) for i, g in enumerate(placement.gpu))
    hot = sum(_hot_bytes(source, i, np.asarray(g), d, mats, hot_fmt, neuron_major) for i, g in enumerate(placement.gpu))
    untied = "output.weight" in source.infos  # the embedding then stays in CPU RAM (models/common.load_embedding)
    rest = sum(_stored_bytes(t, dtype) for name, t in source.infos.items()
               if not is_ffn_weight(name) and not (untied and name == "token_embd.weight"))
    kv = 2 * info["n_layers"] * info["num_key_value_heads"] * info["head_dim"] * ctx * itemsize
    temp = 4 * n * d * 2  # a layer's down projection de-quantized a window at a time, and one matrix's float rows
    return MemoryNeed(host=cold + SLACK, gpu=rest + hot + kv, temp=temp)


def plan_moe_bytes(source: Any, gpu: np.ndarray, dtype: torch.dtype, ctx: int, info: dict) -> MemoryNeed:
    """plan_bytes for a mixture of experts (runtime/moe_load.py) with `gpu` (layers, experts) bool: the device holds
    the decoder's weights, each layer's router and shared expert (as stored, or in the compute dtype), its GPU experts'
    share of the stacked experts' bytes as stored, and the KV cache; the host the cold experts' bytes (the file's
    pages they read in place, or their re-quantized copy: about as many)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    untied = "output.weight" in source.infos
    exps = {name: t for name, t in source.infos.items() if name.endswith("_exps.weight")}
    rest = sum(_stored_bytes(t, dtype) for name, t in source.infos.items()
               if name not in exps and not (untied and name == "token_embd.weight"))  # incl. routers, shared
    share = gpu.mean(axis=1)  # (layers,) the share of each layer's experts on the device
    gpu_exps = sum(int(t.nbytes * share[int(name.split(".")[1])]) for name, t in exps.items())
    cold = sum(int(t.nbytes) for t in exps.values()) - gpu_exps
    kv = 2 * info["n_layers"] * info["num_key_value_heads"] * info["head_dim"] * ctx * itemsize
    return MemoryNeed(host=cold + SLACK, gpu=rest + gpu_exps + kv, temp=0)


def check_vram(need: int, device: str, vram: int | None, ctx: int) -> None:
    """Refuse a layout of `need` bytes on the device above --vram."""
    if vram is not None and need > vram:
        raise MemoryPlanError(f"the layout needs {need:,} B on {device} (with a static KV cache of {ctx} tokens: a "
                              f"smaller --ctx needs less) but --vram is {vram:,} B: re-run pi-solve with this budget, "
                              f"or raise --vram")


def check_fits(need: MemoryNeed, device: str, vram: int | None = None, ctx: int = 0) -> None:
    """Refuse, in one line naming both figures and a fix, a layout that does not fit the host or the device."""
    if vram is not None and need.gpu > 1.1 * vram:  # clearly over before loading; the exact count follows the load
        check_vram(need.gpu, device, vram, ctx)
    on_cpu = not str(device).startswith("cuda")
    host = need.host + (need.gpu if on_cpu else 0) + need.temp
    have = available_host()
    if host > have:
        raise MemoryPlanError(f"the layout needs {host / 1e9:.2f} GB of host memory but {have / 1e9:.2f} GB is "
                           f"available: store the cold rows in fewer bits (--cold-dtype q4_0), put more neurons on "
                           f"the GPU (pi-solve with a larger --vram), or free memory")
    if on_cpu:
        return
    free = torch.cuda.mem_get_info(torch.device(device))[0]
    limit = min(free, vram) if vram is not None else free
    if need.gpu > limit:
        what = f"--vram is {vram / 1e9:.2f} GB" if vram is not None and vram < free else \
            f"{free / 1e9:.2f} GB is free on {device}"
        raise MemoryPlanError(f"the layout needs {need.gpu / 1e9:.2f} GB on {device} but {what}: re-run pi-solve with "
                           f"this budget, keep the hot rows in fewer bits (--gpu-dtype q4_0), or a smaller --ctx")


def tensor_bytes(*objs: Any, device: torch.device | str | None = None) -> int:
    """Bytes of the distinct tensors reachable from `objs` (attributes, lists, dicts, dataclasses, modules' buffers),
    each storage counted once, those on `device` only when given: what a layout really holds."""
    seen_obj: set[int] = set()
    seen: dict[tuple[str, int], int] = {}  # (device, storage pointer) -> bytes
    want = None if device is None else torch.device(device).type

    def walk(o: Any, depth: int) -> None:
        if id(o) in seen_obj or depth > 6 or isinstance(o, (str, bytes, int, float, bool, type(None), np.ndarray)):
            return
        seen_obj.add(id(o))
        if isinstance(o, torch.Tensor):
            if want is None or o.device.type == want:
                st = o.untyped_storage()
                seen[(str(o.device), st.data_ptr())] = max(seen.get((str(o.device), st.data_ptr()), 0), st.nbytes())
            return
        if isinstance(o, torch.nn.Module):
            for t in (*o.buffers(), *o.parameters()):
                walk(t, depth + 1)
        items = o.values() if isinstance(o, dict) else o if isinstance(o, (list, tuple)) else \
            vars(o).values() if hasattr(o, "__dict__") else ()
        for v in items:
            walk(v, depth + 1)

    for o in objs:
        walk(o, 0)
    return sum(seen.values())
