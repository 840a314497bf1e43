import pytest
from hotneurons.common.units import format_bytes, format_size_arg, parse_bytes, parse_rate


@pytest.mark.parametrize("text,value", [
    ("24GB", 24 * 10**9), ("24GiB", 24 * 2**30), ("24gb", 24 * 10**9), ("24 GB", 24 * 10**9),
    ("512MB", 512 * 10**6), ("1.5TB", 1.5 * 10**12), ("800 KiB", 800 * 1024), ("0", 0), ("0GB", 0),
    (" 2 gib ", 2 * 2**30), ("100B", 100), (".5GB", 5 * 10**8), (1234, 1234),
])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == int(value)


@pytest.mark.parametrize("text", ["", "GB", "24", "24 XB", "-1GB", "24GB!", "twenty GB", "1e9", "24 G B"])
def test_parse_bytes_rejects_junk_with_the_accepted_forms(text):
    with pytest.raises(ValueError) as e:
        parse_bytes(text)
    msg = str(e.value)
    assert "\n" not in msg and "24GB" in msg and "GiB" in msg


def test_parse_rate():
    assert parse_rate("25GB/s") == 25e9
    assert parse_rate("25 GB") == 25e9
    assert parse_rate("1GiB/s") == 2**30
    for bad in ("0GB/s", "fast", "25"):
        with pytest.raises(ValueError, match="GB/s"):
            parse_rate(bad)


def test_format_bytes_shows_both_units():
    assert format_bytes(24 * 10**9) == "24.00 GB (22.35 GiB)"
    assert "MiB" in format_bytes(5 * 10**6)


def test_format_size_arg_rounds_up_and_parses_back():
    for n in (1, 999, 1000, 352_001, 39_710_000_001, 24 * 2**30, 3 * 10**12 + 1):
        s = format_size_arg(n)
        assert n <= parse_bytes(s) <= n * 1.01 + 1
