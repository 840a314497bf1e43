"""Corpora: the embedded Wikipedia sample and its fixed split, local files, packing into token rows."""

import json

import pytest
import tiny
from hotneurons.common.corpus import (
    CorpusError,
    clean_wiki_text,
    iter_texts,
    token_batches,
    token_rows,
    wikipedia_sample,
    wikipedia_sample_titles,
)


def test_wikipedia_sample_split_is_fixed_and_disjoint():
    train, held = wikipedia_sample_titles("train"), wikipedia_sample_titles("eval")
    assert len(train) == 96 and len(held) == 10 and not set(train) & set(held)
    assert held[:3] == ["Academy Award for Best Production Design", "List of Atlas Shrugged characters",
                        "Andre Agassi"]
    text = list(iter_texts("wikipedia-sample"))  # plain name = :train
    assert text == wikipedia_sample("train") and len(wikipedia_sample("all")) == 106
    joined = "\n".join(text)
    assert 2_500_000 < len(joined) < 3_000_000
    assert "'''" not in joined and "[[" not in joined and "{{" not in joined and "\n==" not in joined
    assert text[0].startswith("Anarchism")


def test_clean_wiki_text():
    assert clean_wiki_text("'''Bold''' and ''it''\n\n\n==History==\n  text ") == "Bold and it\n\nHistory\ntext"


def test_local_files_and_folders(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "one"}) + "\n" + json.dumps({"text": "two"}) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "three"}) + "\n")
    assert list(iter_texts(str(tmp_path))) == ["one", "two", "three"]
    txt = tmp_path / "t" / "doc.txt"
    txt.parent.mkdir()
    txt.write_text("line one\nline two\n")
    assert list(iter_texts(str(txt))) == ["line one\nline two\n"]  # a .txt file is one document
    import pandas as pd

    pq = tmp_path / "p" / "d.parquet"
    pq.parent.mkdir()
    pd.DataFrame({"body": ["x", "y"]}).to_parquet(pq)
    assert list(iter_texts(str(pq), text_column="body")) == ["x", "y"]
    with pytest.raises(CorpusError, match="no column 'text'"):
        list(iter_texts(str(pq)))
    with pytest.raises(CorpusError, match="unknown split"):
        list(iter_texts("wikipedia-sample:test"))
    with pytest.raises(CorpusError, match="one kind"):
        (tmp_path / "p" / "e.txt").write_text("z")
        list(iter_texts(str(tmp_path / "p")))


def test_token_rows_pack_budget_and_tail():
    tok = tiny.byte_tokenizer()
    docs = ["abcdefghij", "klmnopqrstuvwxyz"]  # 10 + 1 EOS + 16 + 1 EOS = 28 body tokens
    rows = list(token_rows(tok, iter(docs), seq_len=8, max_tokens=1000))
    assert [len(r) for r in rows] == [8, 8, 8, 8]  # BOS + 7 body tokens a row: 28 = 4 * 7
    assert all(r[0] == tok.bos_token_id for r in rows)
    body = [t for r in rows for t in r[1:]]
    assert tok.decode(body, skip_special_tokens=True) == "".join(docs)
    rows = list(token_rows(tok, iter(docs + ["ab"]), seq_len=8, max_tokens=1000))
    assert [len(r) for r in rows] == [8, 8, 8, 8, 4]  # the tail "ab" + EOS comes as a short row
    assert sum(len(r) for r in token_rows(tok, iter(docs), seq_len=8, max_tokens=13)) == 13
    batches = list(token_batches(tok, iter(docs), seq_len=8, batch_size=3, max_tokens=1000))
    assert [tuple(b.shape) for b in batches] == [(3, 8), (1, 8)]
    batches = list(token_batches(tok, iter(docs + ["ab"]), seq_len=8, batch_size=3, max_tokens=1000))
    assert [tuple(b.shape) for b in batches] == [(3, 8), (1, 8), (1, 4)]


def test_local_files_read_the_same_without_datasets(tmp_path, monkeypatch):
    """A machine without `datasets` (a GPU image) reads .jsonl and .txt corpora itself, in the same order."""
    import importlib.util

    docs, txt = tmp_path / "j", tmp_path / "t"
    docs.mkdir()
    txt.mkdir()
    (docs / "a.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    (docs / "b.jsonl").write_text(json.dumps({"text": "three", "id": 3}) + "\n")
    (txt / "1.txt").write_text("first doc\nline two")
    (txt / "2.txt").write_text("second")
    with_datasets = list(iter_texts(str(docs / "a.jsonl"))) + list(iter_texts(str(txt)))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "datasets" else real(n, *a))
    assert list(iter_texts(str(docs))) == ["one", "two", "three"]
    assert list(iter_texts(str(docs / "a.jsonl"))) + list(iter_texts(str(txt))) == with_datasets
    with pytest.raises(CorpusError, match="no column 'body'"):
        list(iter_texts(str(docs), text_column="body"))
