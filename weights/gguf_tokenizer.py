"""`GGUFTokenizer`: a GGUF file's own tokenizer, built from its header's tokenizer.* keys, giving llama.cpp's ids for
the same text and llama.cpp's text for the same ids (its src/llama-vocab.cpp, as llama-cpp-python 0.3.36 has it;
docs/runtime.md).

Three of llama.cpp's vocabulary kinds (`tokenizer.ggml.model`): "gpt2" (byte-level BPE: the words of the file's
pre-tokenizer, weights/gguf_pretok.py, each merged by the merges' ranks), "gemma4" (BPE on "▁"-spaced text) and
"llama" (SentencePiece: the adjacent pair whose join scores highest is joined first, bytes of unknown characters as
<0xXX> tokens, a space before text). Special tokens (types CONTROL and USER_DEFINED, and those llama.cpp recognises
by name) are cut out of the text first, longest first; CONTROL ones only when asked (`parse_special`). The interface
is the part of transformers' tokenizers the project calls: __call__, encode, decode, apply_chat_template, the special
tokens and ids.
"""

from __future__ import annotations

from enum import IntFlag
from typing import Any

from hotneurons.common.model_source import ModelError
from hotneurons.weights.gguf_chat import render_chat
from hotneurons.weights.gguf_merge import merge
from hotneurons.weights.gguf_pretok import PRE, Pre, split


class Attr(IntFlag):
    """llama.cpp's token attributes (llama.h llama_token_attr)."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8


# tokenizer.ggml.token_type values (UNDEFINED 0, NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6)
TYPE_ATTR = (Attr.UNDEFINED, Attr.NORMAL, Attr.UNKNOWN, Attr.CONTROL, Attr.USER_DEFINED, Attr.UNUSED, Attr.BYTE)
SPECIAL = Attr.CONTROL | Attr.UNKNOWN
MODELS = ("gpt2", "llama", "gemma4")
# tokens llama.cpp makes CONTROL by their text where the file names no such token (its FIM and end-of-turn roles)
FIM = {"fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                   "<|code_prefix|>", "<|prefix|>"),
       "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                   "<|code_suffix|>", "<|suffix|>"),
       "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                   "<|code_middle|>", "<|middle|>"),
       "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
       "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
       "fim_sep": ("<|file_sep|>",)}
EOG = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
       "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
       "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[")
OLD_KEYS = {"fim_pre": "prefix", "fim_suf": "suffix", "fim_mid": "middle"}  # deprecated, read after the others
ALWAYS_SHOWN = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss: rendered as text
# GPT-2's byte-level alphabet: bytes that print stand for themselves, the others for 256 + n
_PRINTS = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
BYTE_CHAR = {b: chr(b) if b in _PRINTS else chr(256 + sum(c not in _PRINTS for c in range(b))) for b in range(256)}
CHAR_BYTE = {c: b for b, c in BYTE_CHAR.items()}
_TO_BYTE_CHARS = str.maketrans({chr(b): c for b, c in BYTE_CHAR.items()})
SPACE = "\u2581"  # "▁": SentencePiece's space
WORD_CACHE = 1 << 17  # words whose ids are kept (text repeats its words; a server's stream of texts has no end)


def _need(meta: dict[str, Any], key: str, path: str) -> Any:
    if meta.get(key) is None:
        raise ModelError(f"'{path}' has no {key}: it carries no tokenizer llama.cpp could use; convert the model again "
                         f"with llama.cpp's convert_hf_to_gguf.py (it writes the tokenizer) or load its HF folder",
                         params="model")
    return meta[key]


class GGUFTokenizer:
    """llama.cpp's tokenizer of one GGUF header (`meta`: its tokenizer.* keys, general.name, general.architecture)."""

    padding_side = "right"

    def __init__(self, meta: dict[str, Any], path: str = "the GGUF file"):
        self.name_or_path = path
        model = _need(meta, "tokenizer.ggml.model", path)
        if model not in MODELS:
            raise ModelError(f"'{path}' has a {model!r} tokenizer (tokenizer.ggml.model), which is not read here: "
                             f"supported are {', '.join(MODELS)}; load the model's HF folder instead", params="model")
        self.tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(_need(meta, "tokenizer.ggml.tokens", path))]
        n = len(self.tokens)
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.spm = model == "llama"
        pre_name = "gemma4" if model == "gemma4" else str(meta.get("tokenizer.ggml.pre") or "")
        if not self.spm and pre_name not in PRE:
            raise ModelError(f"'{path}' names the pre-tokenizer {pre_name!r} (tokenizer.ggml.pre), which llama.cpp "
                             f"does not know: convert the model again with llama.cpp's convert_hf_to_gguf.py",
                             params="model")
        self.pre: Pre | None = None if self.spm else PRE[pre_name]
        self.ranks: dict[tuple[str, str], int] = {}
        if not self.spm:
            # no merges: llama.cpp refuses the file; read as a vocabulary that merges nothing (files written for
            # transformers' GGUF loader, which refuses the placeholder merge llama.cpp's needs)
            for r, m in enumerate(meta.get("tokenizer.ggml.merges") or []):
                cut = m.find(" ", 1)  # llama.cpp splits at the first space after the first character
                self.ranks.setdefault((m[:cut], m[cut + 1:]) if cut > 0 else ("", ""), r)
        scores = meta.get("tokenizer.ggml.scores")
        self.scores = [0.0] * n if scores is None else [float(s) for s in scores]
        types = meta.get("tokenizer.ggml.token_type")
        self.attrs = [TYPE_ATTR[t] if 0 <= t < len(TYPE_ATTR) else Attr.UNDEFINED for t in map(int, types)] \
            if types is not None else [Attr.NORMAL] * n
        pre = self.pre
        self.add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", self.spm))
        self.clean_spaces = pre is not None and pre.clean_spaces
        self.escape_whitespace = pre is not None and pre.escape_whitespace
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", self.spm or (pre is not None and pre.add_bos)))
        self.add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        if pre_name in ("gemma4", "granite-embed-multi-311m"):
            self.add_bos = True  # llama.cpp's workaround for Gemma 4 files that say otherwise
        default = {"llama": (1, 2, 0), "gpt2": (11, 11, None), "gemma4": (None, None, None)}[model]
        if pre is not None and pre.no_bos:
            default = (None, *default[1:])
        roles = dict(zip(("bos", "eos", "unknown"), default, strict=True))
        for role in ("bos", "eos", "eot", "eom", "unknown", "padding", *FIM):  # keys out of range: the default
            i = roles.get(role)
            roles[role] = i if i is not None and i < n else None
            for key in (role, OLD_KEYS.get(role)):
                k = meta.get(f"tokenizer.ggml.{key}_token_id")
                if key is not None and k is not None and 0 <= int(k) < n:
                    roles[role] = int(k)
        self._special_by_name(roles, meta)
        self.bos_token_id, self.eos_token_id = roles["bos"], roles["eos"]
        self.unk_token_id, self.pad_token_id = roles["unknown"], roles["padding"]
        self.chat_template = meta.get("tokenizer.chat_template")
        # longest first, as llama.cpp cuts them out (its sort is by length only)
        special = [i for i, a in enumerate(self.attrs) if a & (Attr.CONTROL | Attr.USER_DEFINED | Attr.UNKNOWN)]
        self.special = sorted(special, key=lambda i: -len(self.tokens[i].encode()))
        self._words: dict[str, list[int]] = {}
        self._pieces: dict[int, bytes] = {}

    def _special_by_name(self, roles: dict[str, int | None], meta: dict[str, Any]) -> None:
        """llama.cpp's attributes by token text: end-of-generation tokens and, where the file names no FIM token of
        a role, those of its names present are CONTROL (llama.cpp takes one name per role, in hash order: vocabularies
        with two names of one role and the second no control token are read otherwise); gpt-oss's channel tokens are
        text; Phi-3's special tokens eat the whitespace after them, some BERTs' mask the whitespace before."""
        attrs, ids = self.attrs, self.ids
        named = [ids[t] for t in EOG if t in ids]
        for role, texts in FIM.items():
            if roles[role] is None:
                found = [ids[t] for t in texts if t in ids]
                named += found
                roles[role] = min(found, default=None)
        for i in named:
            attrs[i] |= Attr.CONTROL
        for t in ALWAYS_SHOWN:
            if t in ids:
                attrs[ids[t]] = Attr.USER_DEFINED
        eog = {ids[t] for t in EOG if t in ids} | {roles[r] for r in ("fim_pad", "fim_rep", "fim_sep", "eos", "eot",
                                                                     "eom") if roles[r] is not None}
        texts = {self.tokens[i] for i in eog}
        call = "<|call|>" in texts or "<|calls|>" in texts
        if "<|end|>" in texts and call and ("<|return|>" in texts or "<|flush|>" in texts):  # gpt-oss, Solar Open
            eog.discard(ids["<|end|>"])
            attrs[ids["<|end|>"]] = Attr.USER_DEFINED
        if "</s>" in texts and texts & {"<|tool_response>", "<|plamo:eos|>"}:
            eog.discard(ids["</s>"])
            attrs[ids["</s>"]] = Attr.NORMAL
        self.eog_token_ids = frozenset(eog)
        name = str(meta.get("general.name") or "").lower()
        pre, arch = str(meta.get("tokenizer.ggml.pre") or ""), str(meta.get("general.architecture") or "")
        if any(k in pre for k in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or arch in ("nomic-bert-moe",
                                                                                          "jina-bert-v3"):
            if "<mask>" in ids:
                attrs[ids["<mask>"]] |= Attr.LSTRIP
        elif "phi-3" in name or "phi3" in name:
            for i, a in enumerate(attrs):
                if a & (Attr.CONTROL | Attr.USER_DEFINED | Attr.UNKNOWN) or self.tokens[i] == "</s>":
                    attrs[i] |= Attr.RSTRIP
            for t in ("<unk>", "<s>", "<|endoftext|>"):
                if t in ids:
                    attrs[ids[t]] &= ~Attr.RSTRIP
        elif "modern-bert" in name and "[MASK]" in ids:
            attrs[ids["[MASK]"]] |= Attr.LSTRIP

    # -- text to ids ----------------------------------------------------------------------------------------------

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """The text cut at special tokens (longest first): raw pieces and token ids."""
        frags: list[str | int] = [text] if text else []
        for i in self.special:
            t, a = self.tokens[i], self.attrs[i]
            if (not parse_special and a & SPECIAL) or t not in text:
                continue
            out: list[str | int] = []
            for f in frags:
                while isinstance(f, str) and (at := f.find(t)) != -1:
                    left, f = f[:at], f[at + len(t):]
                    if a & Attr.LSTRIP:
                        left = left.rstrip(" \t\n\v\f\r")
                    if a & Attr.RSTRIP:
                        f = f.lstrip(" \t\n\v\f\r")
                    out += [left, i] if left else [i]
                if f != "":
                    out.append(f)
            frags = out
        return frags

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """llama.cpp's llama_tokenize(text, add_special, parse_special)."""
        out: list[int] = []
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            out.append(self.bos_token_id)
        prev_special = True
        for f in self._partition(text, parse_special):
            if isinstance(f, int):
                out.append(f)
                prev_special = True
            elif self.spm:
                out += self._spm(((" " if self.add_space_prefix and prev_special else "") + f).replace(" ", SPACE))
                prev_special = False
            else:
                for word in split(f.replace(" ", SPACE) if self.escape_whitespace else f, self.pre):
                    ids = self._words.get(word)
                    if ids is None:
                        if len(self._words) >= WORD_CACHE:
                            self._words.clear()
                        ids = self._words[word] = self._bpe(word)
                    out += ids
        if add_special_tokens and self.add_eos and self.eos_token_id is not None:
            out.append(self.eos_token_id)
        return out

    def _bpe(self, word: str) -> list[int]:
        """One word through the merges, lowest rank first (llama.cpp's BPE); symbols that are no token come out as
        those of their bytes that are."""
        pre, ids, ranks = self.pre, self.ids, self.ranks
        w = word.encode().decode("latin-1").translate(_TO_BYTE_CHARS) if pre.byte_encode else word
        if w in ids and (pre.ignore_merges or (pre is PRE["gemma4"] and not w.strip("\n"))):
            return [ids[w]]
        out = []
        for s in merge(list(w), lambda a, b: ranks.get((a, b))):  # per character: per byte where byte-encoded
            if s in ids:
                out.append(ids[s])
            else:
                codes = [chr(b) for b in s.encode() if b < 0x80] if pre.byte_encode else \
                    [f"<0x{b:02X}>" for b in s.encode()]
                out += [ids[c] for c in codes if c in ids]
        return out

    def _spm(self, text: str) -> list[int]:
        """llama.cpp's SentencePiece: the adjacent pair whose join is the best-scored token joins first; symbols that
        are no token come out as their <0xXX> byte tokens."""
        ids, scores = self.ids, self.scores
        out = []
        for s in merge(list(text), lambda a, b: None if (i := ids.get(a + b)) is None else -scores[i]):
            if s in ids:
                out.append(ids[s])
                continue
            for b in s.encode():
                t = ids.get(f"<0x{b:02X}>", ids.get(chr(b)) if b < 0x80 else None)
                if t is None:
                    raise ValueError(f"the text has byte 0x{b:02X}, which this vocabulary has no token for "
                                     f"(<0x{b:02X}>): llama.cpp refuses it too")
                out.append(t)
        return out

    # -- ids to text ----------------------------------------------------------------------------------------------

    def piece(self, i: int, special: bool = True) -> bytes:
        """llama.cpp's llama_token_to_piece: the bytes token `i` stands for ('' for control tokens unless
        `special`)."""
        a = self.attrs[i]
        if not special and a & SPECIAL:
            return b""
        if (p := self._pieces.get(i)) is None:
            t = self.tokens[i]
            if a & (SPECIAL | Attr.USER_DEFINED):
                p = t.encode()
            elif a & Attr.NORMAL and (self.spm or self.escape_whitespace):
                p = t.replace(SPACE, " ").encode()
            elif a & Attr.NORMAL:
                p = b"".join(bytes([CHAR_BYTE[c]]) if c in CHAR_BYTE else
                             f"[UNK_BYTE_0x{c.encode().hex()}{t}]".encode() for c in t)
            elif a & Attr.BYTE:
                p = bytes([int(t[3:5], 16)])
            else:
                p = b""  # unused and undefined tokens: nothing, as llama.cpp
            self._pieces[i] = p
        return p

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        """llama.cpp's llama_detokenize(ids, remove_special=False, unparse_special=not skip_special_tokens): pieces
        joined, the first one's leading space dropped where a space is prefixed, then its space clean-up."""
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        ids = [int(i) for i in ([ids] if isinstance(ids, int) else ids)]
        out = bytearray()
        for k, i in enumerate(ids):
            p = self.piece(i, not skip_special_tokens)
            out += p[1:] if k == 0 and self.add_space_prefix and p[:1] == b" " else p
        if self.clean_spaces:
            out = _clean_spaces(out)
        return out.decode("utf-8", errors="replace")

    # -- transformers' interface ------------------------------------------------------------------------------------

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, return_tensors: str | None = None,
                 padding: bool | str = False) -> Any:
        from transformers import BatchEncoding

        rows = [self.encode(t, add_special_tokens) for t in ([text] if isinstance(text, str) else text)]
        masks = [[1] * len(r) for r in rows]
        if padding and len(rows) > 1:
            width, pad = max(map(len, rows)), self.pad_token_id if self.pad_token_id is not None else 0
            left = self.padding_side == "left"
            rows = [[pad] * (width - len(r)) + r if left else r + [pad] * (width - len(r)) for r in rows]
            masks = [[0] * (width - len(m)) + m if left else m + [0] * (width - len(m)) for m in masks]
        if isinstance(text, str) and return_tensors is None:  # tensors: (1, n), as transformers'
            rows, masks = rows[0], masks[0]
        return BatchEncoding({"input_ids": rows, "attention_mask": masks}, tensor_type=return_tensors)

    def apply_chat_template(self, conversation: list[dict[str, Any]], add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = False, tools: list | None = None,
                            documents: list | None = None, **kwargs: Any) -> Any:
        """The file's chat template rendered as transformers renders it (Jinja2, sandboxed, trim_blocks,
        lstrip_blocks); tokenized as llama.cpp's server does: a BOS the template writes is dropped where BOS is
        added anyway (an EOS likewise), then special tokens added and parsed."""
        if self.chat_template is None:
            raise ValueError("this GGUF file has no chat template (tokenizer.chat_template)")
        bos, eos = self.bos_token or "", self.eos_token or ""
        special = {k: getattr(self, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        text = render_chat(self.chat_template, messages=conversation, add_generation_prompt=add_generation_prompt,
                           tools=tools, documents=documents, **{**special, **kwargs})
        if not tokenize:
            return text
        if self.add_bos and bos and text.startswith(bos):
            text = text[len(bos):]
        if self.add_eos and eos and text.endswith(eos):
            text = text[:-len(eos)]
        ids = self.encode(text)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def get_vocab(self) -> dict[str, int]:
        return dict(self.ids)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str]:
        return self.tokens[ids] if isinstance(ids, int) else [self.tokens[i] for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        return self.ids.get(tokens) if isinstance(tokens, str) else [self.ids.get(t) for t in tokens]

    def _token(self, i: int | None) -> str | None:
        return None if i is None else self.tokens[i]

    bos_token = property(lambda self: self._token(self.bos_token_id))
    eos_token = property(lambda self: self._token(self.eos_token_id))
    unk_token = property(lambda self: self._token(self.unk_token_id))
    pad_token = property(lambda self: self._token(self.pad_token_id))

    def __repr__(self) -> str:
        kind = "llama (SentencePiece)" if self.spm else f"BPE, pre-tokenizer {self.pre.regexes[0][:40]!r}..."
        return f"GGUFTokenizer({self.name_or_path!r}, {len(self)} tokens, {kind})"


def _clean_spaces(t: bytearray) -> bytearray:
    """llama.cpp's three passes over detokenized text, in place as it does them: no space before ?!., ; a lone
    apostrophe between spaces loses both; no space before 's 'm 're 've."""
    total1, total = len(t), 1 if t else 0
    for i in range(1, total1):
        x = t[i]
        if t[i - 1] == 0x20 and x in b"?!.,":
            total -= 1
        t[total] = x
        total += 1
    total2, total, i = total, 1 if total else 0, 1
    while i < total2:
        x = t[i]
        if x == 0x27 and i + 1 < total2 and t[i - 1] == 0x20 and t[i + 1] == 0x20:
            total -= 1
            i += 1
            t[i] = 0
        t[total] = x
        total += 1
        i += 1
    total3, total = total, 1 if total else 0
    for i in range(1, total3):
        x = t[i]
        if t[i - 1] == 0x20 and x == 0x27 and i + 1 < total3:
            x1 = t[i + 1]
            if x1 in b"sm" or (i + 2 < total3 and x1 not in b"td" and bytes(t[i + 1:i + 3]) in (b"re", b"ve")):
                total -= 1
        t[total] = x
        total += 1
    return t[:total]
