import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch's and Numba's OpenMP threads must not spin (runtime)

import torch

if not torch.cuda.is_available():  # kernels/fused.py's Triton kernels run in Triton's interpreter (numpy, CPU tensors)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import tiny

TEXT = ("The quick brown fox jumps over the lazy dog. " * 3 + "Sparse activations make large models fast. ") * 40


@pytest.fixture(scope="session", autouse=True)
def gguf_cache_dir(tmp_path_factory):
    """GGUF cache entries (common/gguf_cache.py) of this session in its temp folder, not in ~/.cache."""
    old = os.environ.get("HOTNEURONS_CACHE")
    if old is None:
        os.environ["HOTNEURONS_CACHE"] = str(tmp_path_factory.mktemp("gguf-cache"))
    yield os.environ["HOTNEURONS_CACHE"]
    if old is None:
        os.environ.pop("HOTNEURONS_CACHE", None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(name) -> folder of a saved tiny random model of that family (built once per session)."""
    root = tmp_path_factory.mktemp("models")
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = tiny.build(name, root / name)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def text_corpus(tmp_path_factory) -> Path:
    """A local .jsonl corpus of a few documents (goes through the `datasets` json loader)."""
    import json

    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    with open(path, "w") as f:
        for i in range(12):
            f.write(json.dumps({"text": f"Document {i}. " + TEXT[i * 37:] + TEXT[: i * 53]}) + "\n")
    return path


@pytest.fixture(autouse=True)
def float_route_for_cold_experts(monkeypatch):
    """The reference comparisons of a mixture of experts hold the float route (equal to float64 up to float32 sums);
    the tests of the int route, the cold experts' default where the CPU has VNNI (kernels/cold_q.py), ask for it."""
    from hotneurons.kernels import cold_q

    monkeypatch.setattr(cold_q, "XQ_EXPERTS", False)
