"""Byte sizes and bandwidths written the way people write them: `24GB`, `24GiB`, `24 gb`, `512MB`, `1.5TB`.

Decimal units are powers of 10 (GB = 10^9 bytes), binary units powers of 2 (GiB = 2^30 bytes), as on a
GPU's box (decimal) versus what `nvidia-smi` shows (MiB). Case does not matter; the `i` does.
"""

from __future__ import annotations

import re

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)\s*$", re.IGNORECASE)

SIZE_FORMS = "a number with a unit, e.g. 24GB (10^9 bytes), 24GiB (2^30 bytes), 512MB, 1.5TB, 800 KiB, or 0"
RATE_FORMS = "a size per second, e.g. 25GB/s, 900GiB/s, 3.35TB/s"


def parse_bytes(text: str | int | float) -> int:
    """`24GB` -> 24_000_000_000, `24GiB` -> 25_769_803_776, `0` -> 0. A bare non-zero number is refused
    (is `24` bytes or GB?); anything else raises ValueError with a one-line message listing the forms."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return int(text)
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"cannot read {text!r} as a size: use {SIZE_FORMS}")
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit == "":
        if number == 0:
            return 0
        raise ValueError(f"{text!r} has no unit: use {SIZE_FORMS}")
    if unit not in _UNITS:
        raise ValueError(f"unknown unit {m.group(2)!r} in {text!r}: use {SIZE_FORMS}")
    return int(round(number * _UNITS[unit]))


def parse_rate(text: str | int | float) -> float:
    """`25GB/s` or `25GB` -> 25e9 bytes per second."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text <= 0:
            raise ValueError(f"bandwidth must be > 0, got {text}")
        return float(text)
    s = str(text).strip()
    if s.lower().endswith("/s"):
        s = s[:-2]
    try:
        value = parse_bytes(s)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a bandwidth: use {RATE_FORMS}") from None
    if value <= 0:
        raise ValueError(f"bandwidth must be > 0, got {text!r}: use {RATE_FORMS}")
    return float(value)


def format_bytes(n: float) -> str:
    """Decimal and binary side by side, so nobody has to guess: `24.00 GB (22.35 GiB)`."""
    n = float(n)
    if abs(n) < 10**6:
        return f"{n / 1e3:.1f} kB ({n / 2**10:.1f} KiB)"
    if abs(n) < 10**9:
        return f"{n / 1e6:.1f} MB ({n / 2**20:.1f} MiB)"
    return f"{n / 1e9:.2f} GB ({n / 2**30:.2f} GiB)"


def format_size_arg(n: float) -> str:
    """A size a user can paste back as a flag, rounded up so it is never below n: `39.71GB`, `352.01kB`."""
    import math

    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{math.ceil(n / scale * 100) / 100:.2f}{unit}"
    return f"{math.ceil(n)}B"


def format_rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.1f} GB/s"
