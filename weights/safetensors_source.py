"""`SafetensorsSource`: an HF folder's *.safetensors read in place, under canonical names (weights/names.py).

Each file is mapped once (copy-on-write) and its header parsed here (8-byte little-endian length, then JSON: per
tensor dtype, shape, [begin, end) from the end of the header), so a BF16 weight comes as a torch bfloat16 view of the
mapped bytes, no copy. Several files: model.safetensors.index.json's weight_map says which holds what (else every
*.safetensors in the folder). HF's values need no conversion; only the names change. A tied head has no
`output.weight` (config.tie_word_embeddings: the embedding serves).

Experts (weights/names.py): a file's per-expert tensors become one canonical (E, out, in) tensor, stacked by get()
(a copy: the experts lie apart in the file); a fused gate_up_proj (E, 2 n, d) becomes two, each a strided view of
the file (releasing one drops the pages of both: what was handed out reads the file again if touched).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hotneurons.common.model_source import ModelError
from hotneurons.weights.formats import WeightFormat, spec
from hotneurons.weights.names import NameMap, expert_order
from hotneurons.weights.source import Span, TensorInfo, WeightSource, drop_pages, map_file, view

DTYPES = {"F32": WeightFormat.F32, "F16": WeightFormat.F16, "BF16": WeightFormat.BF16}
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """(the JSON header, byte offset of the data) of one .safetensors file."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelError(f"'{path}' is too short for a safetensors file: re-download or re-save it", params="model")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            raise ModelError(f"'{path}' announces a {n}-byte header: it is not a safetensors file", params="model")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelError(f"'{path}' has no readable safetensors header ({e}): re-save it", params="model") from None
    return header, 8 + n


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ModelError(f"'{folder}' lacks {missing[0]}, which model.safetensors.index.json lists: download the "
                             f"whole model", params="model")
        return [folder / n for n in names]
    return sorted(folder.glob("*.safetensors"))


class SafetensorsSource(WeightSource):
    def __init__(self, folder: str | Path):
        from hotneurons.common.model_source import text_config
        from transformers import AutoConfig

        self.path = Path(folder)
        if not (self.path / "config.json").is_file():
            raise ModelError(f"folder '{folder}' has *.safetensors but no config.json: save the model with "
                             f"save_pretrained", params="model")
        self.full_config = AutoConfig.from_pretrained(str(self.path))
        self.config = text_config(self.full_config)
        self.activation = None  # config.json says it (hidden_act; dReLU / FATReLU as common/sparse_act.py marks)
        try:
            names = NameMap(self.config.model_type, self.config.num_hidden_layers)
        except ValueError as e:
            raise ModelError(f"'{folder}': {e}", params="model") from None
        self.infos, self._spans, self.hf_names, self.unmapped = {}, {}, {}, []
        self._experts: dict[str, list[Span]] = {}  # stacked name -> its experts' spans, in expert order
        self._halves: dict[str, tuple[tuple[int, ...], int]] = {}  # half of a gate_up_proj -> (its shape, 0 | 1)
        per_expert: dict[str, dict[int, tuple[Span, WeightFormat, tuple[int, ...], str]]] = {}
        for file in weight_files(self.path):
            header, start = read_header(file)
            buf = map_file(file)
            for hf_name, t in header.items():
                if hf_name == "__metadata__":
                    continue
                parts = names.parts(hf_name)
                if not parts:
                    self.unmapped.append(hf_name)
                    continue
                if t["dtype"] not in DTYPES:
                    raise ModelError(f"'{file.name}', tensor {hf_name}: dtype {t['dtype']} is not read here: save the "
                                     f"model in float32, float16 or bfloat16", params="model")
                begin, end = t["data_offsets"]
                fmt, shape = DTYPES[t["dtype"]], tuple(int(n) for n in t["shape"])
                if start + end > buf.size or end - begin != int(np.prod(shape, dtype=np.int64)) * spec(fmt).block_bytes:
                    raise ModelError(f"'{file.name}', tensor {hf_name}: its bytes [{begin}, {end}) do not fit its "
                                     f"shape {list(shape)} or the file: re-download it", params="model")
                span = Span(buf, start + begin, end - begin)
                for part in parts:
                    name = part.name
                    if part.expert is not None:
                        per_expert.setdefault(name, {})[part.expert] = (span, fmt, shape, hf_name)
                        continue
                    if part.half is not None:
                        self._halves[name] = (shape, part.half)
                        shape_half = (shape[0], shape[1] // 2, *shape[2:])  # (E, n, d)
                        self.infos[name] = TensorInfo(name, shape_half, fmt, (end - begin) // 2)
                    else:
                        self.infos[name] = TensorInfo(name, shape, fmt, end - begin)
                    self._spans[name] = span
                    self.hf_names[name] = hf_name
        for name, per in per_expert.items():
            try:
                order = expert_order(name, per)
            except ValueError as e:
                raise ModelError(f"'{folder}': {e}", params="model") from None
            spans, fmts, shapes, hf = zip(*(per[e] for e in order))
            if len(set(fmts)) > 1 or len(set(shapes)) > 1:
                raise ModelError(f"'{folder}': the experts of {name} differ in dtype or shape: re-save the model",
                                 params="model")
            self.infos[name] = TensorInfo(name, (len(spans), *shapes[0]), fmts[0], sum(s.nbytes for s in spans),
                                          converted="stacked experts")
            self._experts[name] = list(spans)
            self.hf_names[name] = hf[0]  # expert 0's
        if not self.infos:
            raise ModelError(f"no tensor of '{folder}' maps to a {self.config.model_type} weight: check its "
                             f"*.safetensors belong to this config.json", params="model")

    def get(self, name: str) -> torch.Tensor:
        if name in self._experts:
            info = self.info(name)
            return torch.stack([view(s, info.fmt, info.shape[1:]) for s in self._experts[name]])  # (E, out, in)
        if name in self._halves:
            shape, half = self._halves[name]
            return view(self._spans[name], self.infos[name].fmt, shape).chunk(2, dim=1)[half]  # (E, n, d) view
        return super().get(name)

    def release(self, name: str) -> int:
        if name in self._experts:
            return sum(drop_pages(s) for s in self._experts[name])
        return super().release(name)

    def _buffers(self) -> list[np.ndarray]:
        spans = [*self._spans.values(), *(s for per in self._experts.values() for s in per)]
        return list({id(s.buf): s.buf for s in spans}.values())

    def close(self) -> None:
        super().close()
        self._experts = {}

    @property
    def tied(self) -> bool:
        """The head is the embedding (no `output.weight`)."""
        return "output.weight" not in self.infos

    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.path))
