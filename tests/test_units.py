from __future__ import annotations

import pytest

from remat.core.errors import UsageError
from remat.core.units import format_bytes, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("32MiB", 32 << 20),
        ("2GiB", 2 << 30),
        ("2gib", 2 << 30),
        ("1e9", 10**9),
        ("4096", 4096),
        (4096, 4096),
        ("1.5KiB", 1536),
        ("1.5GB", 1_500_000_000),
        ("10 B", 10),
        ("0.5", 1),  # fractions of a byte round up
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "12XB", "1,5GiB", "-3", "abc", "1e999"])
def test_bad_sizes_raise_one_line_usage_errors(text: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_size(text, what="--act")
    assert "\n" not in str(info.value)
    assert "--act" in str(info.value)


def test_format_bytes() -> None:
    assert format_bytes(512 << 20) == "512 MiB"
    assert format_bytes(2 << 30) == "2 GiB"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(100) == "100 B"
    assert format_bytes(68 * (1 << 20) + 1) == "68 MiB"  # rounds to 68.00: no trailing point
    assert format_bytes(-(3 << 30)) == "-3 GiB"
