"""Parsing and printing byte sizes (torch-free)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from remat.core.errors import UsageError

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int, *, what: str = "size") -> int:
    """Parse ``32MiB``, ``2GiB``, ``1.5GB``, ``1e9`` or ``4096`` into a whole number of bytes.

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB)
    powers of 1000; a fractional result is rounded up to the next byte.
    """
    if isinstance(text, bool):
        raise UsageError(f"{what} {text!r} is not a size; give bytes such as 32MiB or 1e9")
    if isinstance(text, int):
        if text < 0:
            raise UsageError(f"{what} {text} is negative; give a size of zero bytes or more")
        return text
    if str(text).strip().startswith("-"):
        raise UsageError(f"{what} {text!r} is negative; give a size of zero bytes or more")
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise UsageError(
            f"{what} {text!r} is not a size; write a number with an optional unit, "
            "such as 32MiB, 2GiB, 1.5GB, 1e9 or 4096"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value):
        raise UsageError(f"{what} {text!r} is too large; give a finite size such as 2GiB")
    return math.ceil(value)


def format_bytes(n: float) -> str:
    """Print a byte count with a binary unit: ``512 MiB``, ``2 GiB``, ``1.5 KiB``, ``100 B``."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n >= 1 << 60:  # beyond any device: a budget meaning "no limit" (1e99)
        return f"{sign}{float(n):.3g} B"
    for unit, scale in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30),
                        ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            value = n / scale
            text = f"{value:.2f}".rstrip("0").rstrip(".")
            return f"{sign}{text} {unit}"
    return f"{sign}{n:.0f} B"


def first_names(names: Sequence[str]) -> str:
    """``a, b, c and 5 more``: the first three of ``names`` and how many others."""
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
