"""Text corpora for profiling and evaluation, all yielding plain strings, and their packing into token batches.

- `wikipedia-sample` (default): the English Wikipedia dump shipped inside the `gensim` wheel
  (gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2), redirects
  dropped, wiki markup stripped to plain text. Fixed split by article position: every tenth article
  (index 9, 19, ...) is `:eval`, the rest `:train`. Plain `wikipedia-sample` means `:train`; profiling
  never reads `:eval`.
- `c4` (allenai/c4, `en`) and `wikipedia` (wikimedia/wikipedia, `20231101.en`): HF `datasets`, streaming.
- a local `.txt` / `.jsonl` / `.json` / `.parquet` file or a folder of them: the same `datasets` loaders.
"""

from __future__ import annotations

import bz2
import importlib.util
import json
import os
import re
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from hotneurons.common.kinds import FixableError

if TYPE_CHECKING:  # torch loads in ~1 s: only where token ids are stacked
    import torch

WIKI_SAMPLE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
EVAL_EVERY = 10  # article i is held out for evaluation iff i % EVAL_EVERY == EVAL_EVERY - 1
HUB_DATASETS = {
    "c4": ("allenai/c4", "en"),
    "wikipedia": ("wikimedia/wikipedia", "20231101.en"),
}
_LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class CorpusError(FixableError, ValueError):
    """A corpus that cannot be read: unknown name, missing column, no files, empty."""


def known_datasets() -> str:
    return "wikipedia-sample[:train|:eval], c4, wikipedia, or a local .txt/.jsonl/.parquet file or folder"


def iter_texts(dataset: str = "wikipedia-sample", text_column: str = "text") -> Iterator[str]:
    """Yield the documents of a corpus as plain strings, in a fixed order."""
    name, _, split = dataset.partition(":")
    if name == "wikipedia-sample":
        yield from wikipedia_sample(split or "train")
        return
    if name in HUB_DATASETS:
        from datasets import load_dataset

        path, config = HUB_DATASETS[name]
        ds = load_dataset(path, config, split=split or "train", streaming=True)
        yield from (row[text_column] for row in ds)
        return
    if os.path.exists(dataset):
        yield from _local_texts(Path(dataset), text_column)
        return
    if _looks_like_path(dataset):
        raise CorpusError(f"dataset path '{dataset}' does not exist: check the path, or name a corpus "
                          f"(wikipedia-sample, c4, wikipedia)", params="dataset")
    raise CorpusError(f"unknown dataset '{dataset}': use {known_datasets()}", params="dataset")


def _looks_like_path(dataset: str) -> bool:
    return ("/" in dataset or os.sep in dataset or dataset.startswith((".", "~"))
            or Path(dataset).suffix.lower() in _LOCAL_BUILDERS)


def check_corpus(dataset: str, text_column: str = "text") -> None:
    """Refuse, in one line and before a model loads, a corpus that does not exist, cannot be read, or holds no text
    (empty, or whitespace only): reads documents up to the first that has some text."""
    try:
        for text in iter_texts(dataset, text_column):
            if not isinstance(text, str):
                raise CorpusError(f"the column '{text_column}' of dataset '{dataset}' holds {type(text).__name__}, "
                                  f"not text: name the text column", params="text_column")
            if text.strip():
                return
    except CorpusError:
        raise
    except Exception as e:  # a broken file, a hub corpus out of reach
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CorpusError(f"cannot read dataset '{dataset}': {first}", params="dataset") from None
    raise CorpusError(f"dataset '{dataset}' holds no text (it is empty or whitespace only): name another",
                      params="dataset")


def _local_texts(path: Path, text_column: str) -> Iterator[str]:
    files = sorted(p for p in path.rglob("*") if p.suffix in _LOCAL_BUILDERS) if path.is_dir() else [path]
    if not files:
        raise CorpusError(f"no .txt/.jsonl/.json/.parquet files in folder '{path}'")
    builders = {_LOCAL_BUILDERS.get(f.suffix) for f in files}
    if None in builders or len(builders) != 1:
        raise CorpusError(f"'{path}': expected files of one kind among .txt, .jsonl, .json, .parquet")
    builder = builders.pop()
    if builder in ("text", "json") and importlib.util.find_spec("datasets") is None:  # e.g. a GPU image
        yield from _plain_texts(path, files, builder, text_column)  # without `datasets`: the same rows, read here
        return
    from datasets import load_dataset

    kw = {"sample_by": "document"} if builder == "text" else {}  # a .txt file is one document, not one per line
    ds = load_dataset(builder, data_files=[str(f) for f in files], split="train", streaming=True, **kw)
    for row in ds:
        if text_column not in row:
            raise CorpusError(f"'{path}' has no column '{text_column}' (columns: {', '.join(row)}): "
                              f"name the text column", params="text_column")
        yield row[text_column]


def _plain_texts(path: Path, files: list[Path], builder: str, text_column: str) -> Iterator[str]:
    """.txt (one document a file) and .jsonl (one object a line) without `datasets`, in the order it reads them."""
    for f in files:
        if builder == "text":
            yield f.read_text(encoding="utf-8")
            continue
        with open(f, encoding="utf-8") as lines:
            for line in lines:
                if not line.strip():
                    continue
                row = json.loads(line)
                if text_column not in row:
                    raise CorpusError(f"'{path}' has no column '{text_column}' (columns: {', '.join(row)}): "
                                      f"name the text column", params="text_column")
                yield row[text_column]


def wikipedia_sample(split: str = "train") -> list[str]:
    if split not in ("train", "eval", "all"):
        raise CorpusError(f"unknown split 'wikipedia-sample:{split}': use :train, :eval or :all")
    articles = _wiki_articles()
    if split == "all":
        return [text for _, text in articles]
    held_out = split == "eval"
    return [text for i, (_, text) in enumerate(articles) if (i % EVAL_EVERY == EVAL_EVERY - 1) == held_out]


def wikipedia_sample_titles(split: str = "train") -> list[str]:
    articles = _wiki_articles()
    held_out = split == "eval"
    return [t for i, (t, _) in enumerate(articles) if (i % EVAL_EVERY == EVAL_EVERY - 1) == held_out]


@lru_cache(maxsize=1)
def _wiki_articles() -> tuple[tuple[str, str], ...]:
    spec = importlib.util.find_spec("gensim")
    if spec is None or spec.origin is None:
        raise CorpusError("the wikipedia-sample corpus ships inside gensim: pip install 'hotneurons[demo]', "
                          "or use another dataset", params="dataset")
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    path = Path(spec.origin).parent / "test" / "test_data" / WIKI_SAMPLE
    out = []
    with bz2.BZ2File(path) as f:
        for title, markup, _ in extract_pages(f):
            if markup.lstrip().lower().startswith("#redirect"):
                continue
            text = clean_wiki_text(filter_wiki(markup))
            if text:
                out.append((title, text))
    return tuple(out)


_HEADING = re.compile(r"^[ \t]*=+[ \t]*(.*?)[ \t]*=+[ \t]*$", re.M)
_QUOTES = re.compile(r"'{2,}")
_BLANKS = re.compile(r"\n\s*\n+")


def clean_wiki_text(text: str) -> str:
    """What gensim's filter_wiki leaves: bold/italic quotes and `==Heading==` lines; drop them, squeeze blanks."""
    text = _HEADING.sub(r"\1", text)
    text = _QUOTES.sub("", text)
    lines = [ln.strip() for ln in text.splitlines()]
    return _BLANKS.sub("\n\n", "\n".join(lines)).strip()


# ---------------------------------------------------------------------------------------------------------------
# Token batches (the profiler counts on them, the evaluation measures perplexity on them)


def token_rows(tokenizer, texts: Iterator[str], seq_len: int, max_tokens: int) -> Iterator[list[int]]:
    """Pack documents (joined by EOS) into rows of seq_len tokens, each starting with BOS when the model has one.

    Stops at max_tokens tokens in total; only the last row may be shorter (budget or corpus reached).
    """
    head = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    buf: list[int] = []
    total = 0
    for text in texts:
        if not text:
            continue
        buf.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + eos)
        while len(buf) >= seq_len - len(head):
            n = min(seq_len, max_tokens - total) - len(head)  # body tokens of this row
            if n <= 0:
                return
            row = head + buf[:n]
            del buf[:n]
            total += len(row)
            yield row
            if total >= max_tokens:
                return
    n = min(len(buf), max_tokens - total - len(head))
    if n > 0:
        yield head + buf[:n]


def token_batches(tokenizer, texts: Iterator[str], seq_len: int, batch_size: int,
                  max_tokens: int) -> Iterator[torch.Tensor]:
    """(batch, seq_len) int64 batches of token_rows; a final shorter row comes alone as a (1, len) batch."""
    rows: list[list[int]] = []
    for row in token_rows(tokenizer, texts, seq_len, max_tokens):
        if len(row) < seq_len:
            if rows:
                yield _stack(rows)
                rows = []
            yield _stack([row])
            continue
        rows.append(row)
        if len(rows) == batch_size:
            yield _stack(rows)
            rows = []
    if rows:
        yield _stack(rows)


def _stack(rows: list[list[int]]) -> torch.Tensor:
    import torch

    return torch.tensor(rows, dtype=torch.int64)
