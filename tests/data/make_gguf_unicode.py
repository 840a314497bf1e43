"""Writes weights/gguf_unicode.py: the Unicode categories llama.cpp's tokenizer splits text by, from llama.cpp's own
table (src/unicode-data.cpp), so that GGUF files are pre-tokenized as llama.cpp does. Python's unicodedata and the
`regex` package follow other Unicode versions (characters assigned since are "undefined" to llama.cpp).

    python tests/data/make_gguf_unicode.py path/to/llama.cpp/src/unicode-data.cpp
"""

import re
import sys
from pathlib import Path

# llama.cpp's category flags (src/unicode.h) -> the classes its pre-tokenizer regexes name; "o": any other
CLASSES = {0x02: "N", 0x04: "L", 0x10: "M", 0x20: "P", 0x40: "S"}
OUT = Path(__file__).resolve().parents[2] / "weights" / "gguf_unicode.py"


def main(src: str) -> None:
    text = Path(src).read_text()
    block = text.split("unicode_ranges_flags = {")[1].split("};")[0]
    starts = [(int(a, 16), int(f, 16)) for a, f in re.findall(r"\{0x([0-9A-F]+), 0x([0-9A-F]+)\}", block)]
    runs: list[tuple[int, str]] = []
    for start, flags in starts[:-1]:  # the last entry is the end (0x110000)
        c = CLASSES.get(flags & 0xFF, "o")
        if not runs or runs[-1][1] != c:
            runs.append((start, c))
    deltas, prev = [], 0
    for start, c in runs:
        deltas.append(f"{start - prev:x}{c}")
        prev = start
    packed = "".join(deltas)
    ws = block_ints(text.split("unicode_set_whitespace = {")[1].split("};")[0])
    lines = [packed[i:i + 112] for i in range(0, len(packed), 112)]
    body = "\n".join(f'    "{ln}"' for ln in lines)
    hexes = [f"0x{c:04X}" for c in ws]
    ws_text = ",\n    ".join(", ".join(hexes[i:i + 12]) for i in range(0, len(hexes), 12))
    OUT.write_text(f'''"""Unicode categories as llama.cpp's tokenizer has them (its src/unicode-data.cpp), written by
tests/data/make_gguf_unicode.py: runs of code points, each "<hex distance from the previous run's start><class>",
class N (number), L (letter), M (mark), P (punctuation), S (symbol) or o (anything else, undefined included)."""

RUNS = (
{body}
)

# llama.cpp's whitespace (its \\s): Unicode's White_Space property
WHITESPACE = frozenset((
    {ws_text}))
''')


def block_ints(block: str) -> list[int]:
    return [int(a, 16) for a in re.findall(r"0x([0-9A-F]+)", block)]


if __name__ == "__main__":
    main(sys.argv[1])
