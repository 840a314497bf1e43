"""llama.cpp's pre-tokenization of a GGUF's BPE vocabulary: `tokenizer.ggml.pre` names the regexes that cut text into
words before BPE merges run inside each (llama.cpp's src/llama-vocab.cpp llm_tokenizer_bpe, src/unicode.cpp).

llama.cpp does not run these regexes with Unicode classes: it maps every non-ASCII character to one byte standing for
its category (letter, number, punctuation, mark, symbol, other; whitespace to \\v) with its own Unicode table
(weights/gguf_unicode.py), rewrites each \\p{..} to that byte plus the ASCII members, and runs ECMAScript regexes on
the result; regexes without \\p{..} run on the characters themselves, non-ASCII whitespace again turned into \\v. So
\\p{Lu} is any letter, and [^a-z] matches every non-ASCII letter. Done the same way here with Python's `re` (ASCII
classes, as std::regex in the C locale), the words are llama.cpp's. The hand-written splitters llama.cpp uses for the
GPT-2, LLaMA-3 and Qwen regexes implement those regexes; its Kimi-K2 and digit-group splitters are written out below.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from functools import lru_cache

from hotneurons.weights.gguf_unicode import RUNS, WHITESPACE

MARK = {"N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5", "o": "\xd0"}  # llama.cpp's category bytes
HAN = "\xd6"  # Kimi-K2's splitter tells Han letters apart (llama.cpp's unicode_cpt_is_han ranges)
HAN_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
              (0x2B820, 0x2CEAF), (0x2CEB0, 0x2EBEF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))
# what llama.cpp writes for each \p{..} beside the category byte: its ASCII members
ASCII = {"N": "0-9", "L": "A-Za-z", "P": r"!-#%-*,-/:-;?-@\[-\]_\{\}", "M": "", "S": r"\$\+<->^`\|\~"}
CLASS = {"N": "N", "L": "L", "P": "P", "M": "M", "S": "S", "Lu": "L", "Ll": "L", "Lt": "L", "Lm": "L", "Lo": "L"}

CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PORO = " ?[^(\\s|.,!?…。，、।۔،)]+"
NEWLINES = r"[^\n]+|[\n]+"
DIGIT_GROUPS = "digit groups"  # llama.cpp's unicode_regex_split_custom_afmoe
KIMI = "kimi-k2"  # llama.cpp's unicode_regex_split_custom_kimi_k2
CASED = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+{c}|"
         r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*{c}")
CASED_M = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+{c}|"
           r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*{c}")
TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PUNCT_WORDS = "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^{nl}\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
DEEPSEEK_LETTERS = (  # escapes: characters NFC would change
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼ"
    "ℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+")
CJK = "[一-龥ࠀ-一가-퟿]+"


@dataclass(frozen=True)
class Pre:
    """One of llama.cpp's pre-tokenizer types: its regexes (each cuts the pieces the one before left) and the
    settings llama.cpp loads with it."""

    regexes: tuple[str, ...]
    clean_spaces: bool = True  # detokenizing drops the space before ?!., and in " 's" (llama.cpp's clean-up)
    ignore_merges: bool = False  # a word that is a token is that token, whatever the merges
    add_bos: bool = False
    byte_encode: bool = True  # GPT-2's bytes-to-characters map (else the word's own UTF-8 characters)
    escape_whitespace: bool = False  # spaces written "▁" before merging (SentencePiece-style BPE)
    no_bos: bool = False  # the vocabulary has no BOS token unless the file names one


def _pres(names: str, pre: Pre) -> dict[str, Pre]:
    return dict.fromkeys(names.split(), pre)


_C = dict(clean_spaces=False)
PRE: dict[str, Pre] = {
    **_pres("default", Pre((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))),
    **_pres("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
            Pre((LLAMA3,), ignore_merges=True, add_bos=True)),
    **_pres("dbrx smaug-bpe", Pre((LLAMA3,))),
    "jais-2": Pre((LLAMA3.removesuffix(r"\s+(?!\S)|\s+") + "|".join(rf"\s{{{n}}}(?!\S)" for n in
                                                                   (512, 256, 128, 64, 32, 16, 8, 4))
                   + r"|\s{1,2}(?!\S)|\s{1}",)),
    "deepseek-llm": Pre(("[\r\n]", DEEPSEEK_LETTERS, "\\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$", CJK, r"\p{N}+"), **_C),
    **_pres("deepseek-v3 hunyuan-dense joyai-llm hy_v4",
            Pre((r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+", PUNCT_WORDS.replace("{nl}", "\r\n")
                 + "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"),
                **_C)),
    "spark2_5": Pre((r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
                     PUNCT_WORDS.replace("{nl}", "\r\n") + "| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+",
                     r"\p{N}"), **_C),
    "youtu": Pre(("[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
                  CASED_M.replace("{c}", CONTRACTIONS + "?") + r"|\p{N}" + TAIL), ignore_merges=True, **_C),
    "deepseek-coder": Pre(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", CJK, r"\p{N}"), **_C),
    "falcon": Pre((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]")),
    **_pres("starcoder refact codeshell exaone minerva-7b mellum2", Pre((r"\p{N}", GPT2))),
    **_pres("command-r smollm", Pre((r"\p{N}", GPT2), **_C)),
    **_pres("gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert jina-v1-en "
            "jina-v2-code roberta-bpe exaone4 mpt olmo jais", Pre((GPT2,))),
    **_pres("trillion granite-docling", Pre((GPT2,), **_C)),
    **_pres("stablelm2 megrez", Pre((QWEN2,))),
    **_pres("qwen2 deepseek-r1-qwen kormo f2llmv2 hunyuan solar-open grok-2", Pre((QWEN2,), **_C)),
    "qwen35": Pre((CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
                   r"\s*[\r\n]+|\s+(?!\S)|\s+",), **_C),
    "poro-chat": Pre((PORO,), **_C),
    **_pres("bloom gpt3-finnish", Pre((PORO,))),
    "chatglm-bpe": Pre((LLAMA3,), no_bos=True),
    **_pres("glm4 glm5", Pre((LLAMA3,), ignore_merges=True, no_bos=True)),
    "viking": Pre((PORO, r"\p{N}"), **_C),
    "tekken": Pre((CASED.replace("{c}", "") + r"|\p{N}" + TAIL,), ignore_merges=True, add_bos=True, **_C),
    "chameleon": Pre(("<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\\t\\n]|    |  )", r"\p{N}",
                      r"[\p{P}!-/:-@\[-`{-~]", GPT2), add_bos=True, **_C),
    **_pres("gpt-4o llama4 kanana2 talkie minimax-m2",
            Pre((CASED.replace("{c}", CONTRACTIONS + "?") + r"|\p{N}{1,3}" + TAIL,), **_C)),
    "granite-embed-multi-97m": Pre((CASED.replace("{c}", CONTRACTIONS + "?").replace("[\\p{L}])", "[\\p{L}\\p{M}])")
                                    + r"|\p{N}{1,3}" + TAIL,), ignore_merges=True, **_C),
    **_pres("tiny_aya cohere2moe",
            Pre((DIGIT_GROUPS, CASED_M.replace("{c}", CONTRACTIONS + "?") + r"|\p{N}{1,3}" + TAIL), **_C)),
    "kimi-k2": Pre((KIMI,), **_C),
    "superbpe": Pre((r"\p{N}+", r"(?=(\d{3})+(?!\d))"), **_C),
    **_pres("bailingmoe bailingmoe2 llada-moe",
            Pre((r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]|\s+(?!\S)|\s+",), **_C)),
    "seed-coder": Pre((CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|"
                       r"\s+(?!\S)|\s+",), **_C),
    "ufakzeka": Pre((QWEN2.removeprefix(CONTRACTIONS + "|"),), **_C),
    "afmoe": Pre((DIGIT_GROUPS, "[一-鿿㐀-䶿豈-﫿぀-ゟ゠-ヿ･-ﾟ⼀-⿟เ-๿຀-໿ក-៿က-႟ꩠ-ꩿꧠ-꧿가-힯ᄀ-ᇿ]+",
                  PUNCT_WORDS.replace("{nl}", r"\r\n") + r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), **_C),
    "laguna": Pre((NEWLINES, QWEN2), **_C),
    "exaone-moe": Pre((CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}|"
                       r" ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",)),
    **_pres("gemma4 granite-embed-multi-311m", Pre((NEWLINES,), byte_encode=False, escape_whitespace=True)),
    "sarvam-moe": Pre((NEWLINES,), byte_encode=False, escape_whitespace=True, **_C),
    "minicpm5": Pre((r"\p{N}{1,3}", CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                     r"\s*[\r\n]+|\s+(?!\S)|\s+"), ignore_merges=True),
    "whitespace": Pre((r"\S+",), byte_encode=False),
}
PRE[""] = PRE["default"]  # no key: llama.cpp's default (it warns that quality degrades)
KIMI_RE = (f"{HAN}+|[^\\r\\n\\p{{L}}\\p{{N}}{HAN}]?\\p{{L}}+{CONTRACTIONS}?|\\p{{N}}{{1,3}}|"
           f" ?[^\\s\\p{{L}}\\p{{N}}{HAN}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")


# ---------------------------------------------------------------------------------------------------------------
# Characters to category bytes


def _runs() -> tuple[list[int], str]:
    starts, classes, at = [], [], 0
    for m in re.finditer(r"([0-9a-f]+)([NLMPSo])", "".join(RUNS)):
        at += int(m.group(1), 16)
        starts.append(at)
        classes.append(m.group(2))
    return starts, "".join(classes)


_STARTS, _CLASSES = _runs()
_COLLAPSE: dict[int, str] = {}  # non-ASCII code point -> its category byte, filled as text shows them
_COLLAPSE_HAN: dict[int, str] = {}
_WIDE = {c: "\v" for c in WHITESPACE if c >= 128}  # std::wregex's \s is ASCII: llama.cpp writes \v for the others


def category(cp: int) -> str:
    return _CLASSES[bisect.bisect_right(_STARTS, cp) - 1]


def _is_han(cp: int) -> bool:
    return any(a <= cp <= b for a, b in HAN_RANGES)


def collapse(text: str, han: bool = False) -> str:
    """`text` with every non-ASCII character as llama.cpp's category byte (whitespace \\v): as long as `text`."""
    table = _COLLAPSE_HAN if han else _COLLAPSE
    for cp in {ord(c) for c in text if c >= "\x80"} - table.keys():
        table[cp] = ("\v" if cp in WHITESPACE else HAN if han and _is_han(cp) else MARK[category(cp)])
    return text.translate(table)


# ---------------------------------------------------------------------------------------------------------------
# Regexes


@lru_cache(maxsize=None)
def compiled(expr: str) -> tuple[re.Pattern, bool]:
    """llama.cpp's regex as it runs it: (pattern, whether on the category bytes). Each \\p{..} becomes its category
    byte and ASCII members, bracketed outside a class; an unescaped $ is the end of the piece (ECMAScript's)."""
    if not any(f"\\p{{{k}}}" in expr for k in CLASS):
        return re.compile(re.sub(r"(?<!\\)\$", r"\\Z", expr), re.ASCII), False
    out, inside, i = [], False, 0
    while i < len(expr):
        c = expr[i]
        if c == "[" and (i == 0 or expr[i - 1] != "\\"):
            inside = True
        elif inside and c == "]" and expr[i - 1] != "\\":
            inside = False
        elif expr.startswith("\\p{", i) and (j := expr.find("}", i + 3)) != -1 and expr[i + 3:j] in CLASS:
            k = CLASS[expr[i + 3:j]]
            body = MARK[k] + ASCII[k]
            out.append(body if inside else f"[{body}]")
            i = j + 1
            continue
        out.append(c)
        i += 1
    return re.compile("".join(out), re.ASCII), True


def _digit_groups(s: str, a: int, b: int) -> list[tuple[int, int]]:
    """llama.cpp's digit splitter (AFMoE, Tiny Aya): each run of numbers cut into its first len % 3, then threes;
    the text before a run joins the run's first group (as llama.cpp emits it), the text after the last run is one."""
    out, prev = [], a
    for m in _NUMBERS.finditer(s, a, b):
        first = m.start() + (m.end() - m.start()) % 3
        for end in ([first] if first > m.start() else []) + list(range(first + 3, m.end() + 1, 3)):
            out.append((prev, end))
            prev = end
    if prev < b:
        out.append((prev, b))
    return out


_NUMBERS = re.compile(f"[{MARK['N']}0-9]+")


def split(text: str, pre: Pre) -> list[str]:
    """The words llama.cpp's BPE merges run in (before its byte encoding)."""
    pieces = [(0, len(text))]
    subjects: dict[str, str] = {}
    for expr in pre.regexes:
        if expr == DIGIT_GROUPS:
            s = subjects.setdefault("c", collapse(text))
            pieces = [p for a, b in pieces for p in _digit_groups(s, a, b)]
            continue
        if expr == KIMI:
            rx, _ = compiled(KIMI_RE)
            s = subjects.setdefault("h", collapse(text, han=True))
        else:
            rx, cat = compiled(expr)
            s = subjects.setdefault("c", collapse(text)) if cat else subjects.setdefault("w", text.translate(_WIDE))
        out = []
        for a, b in pieces:
            prev, piece = a, s[a:b]  # each piece alone: its ends are the regex's ends, as llama.cpp's
            for m in rx.finditer(piece):
                if m.start() + a > prev:
                    out.append((prev, m.start() + a))
                if m.end() > m.start():
                    out.append((m.start() + a, m.end() + a))
                prev = m.end() + a
            if prev < b:
                out.append((prev, b))
        pieces = out
    return [text[a:b] for a, b in pieces]
