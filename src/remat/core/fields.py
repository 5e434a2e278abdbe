"""Field checks and schema versions: one copy for every JSON artifact (torch-free).

The plan, the profile, the problem and the reports of ``remat bench``/``remat auto``
check their fields with these and read their ``schema_version`` through
:func:`schema_version`, so every artifact says the same thing about the same mistake.
``what`` names the field as the user sees it (``"profile stage 'h.0' fwd_s"``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from remat.core.errors import UsageError
from remat.core.units import parse_size

__all__ = [
    "MAX_BYTES",
    "byte_count",
    "check_keys",
    "finite",
    "flag",
    "schema_version",
    "seconds",
    "seconds_range",
    "stage_index",
]

#: The largest byte count an artifact holds (1 PiB): no device keeps more, and the
#: solver's int64 sums of a few thousand of them stay exact.
MAX_BYTES = 1 << 50


def byte_count(value: object, what: str, *, sizes: bool = False,
               largest: int | None = MAX_BYTES) -> int:
    """``value`` as bytes from 0 to ``largest`` (None: no bound); an integral float is
    taken as its int, and with ``sizes`` a size such as ``"32MiB"`` too (hand-written
    problem files)."""
    if isinstance(value, float) and value.is_integer() and value >= 0:
        value = int(value)
    hint = ("give an int >= 0" if largest is None
            else "give an int from 0 to 2**50 (1 PiB)" if largest == MAX_BYTES
            else f"give an int from 0 to {largest}")
    hint += " or a size like 32MiB" if sizes else ""
    if sizes and isinstance(value, str):
        value = parse_size(value, what=what)
    if (isinstance(value, bool) or not isinstance(value, int) or value < 0
            or (largest is not None and value > largest)):
        raise UsageError(f"{what}={value!r} is not a byte count; {hint}")
    return value


def seconds(value: object, what: str) -> float:
    """``value`` as a time in seconds: a finite number >= 0."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value if isinstance(value, float) else 0.0)
        or not 0 <= value < 1e300  # an int too large for a float is no time either
    ):
        raise UsageError(f"{what}={value!r} is not a time; give seconds as a number >= 0")
    return float(value)


def finite(value: object, what: str) -> float:
    """``value`` as a finite float of either sign."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not abs(value) < 1e300 or value != value):
        raise UsageError(f"{what}={value!r} is not a finite number")
    return float(value)


def seconds_range(value: object, what: str) -> tuple[float, float]:
    """``value`` as a ``[low, high]`` pair of seconds with ``low <= high``."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise UsageError(f"{what}={value!r} is not a [low, high] pair of seconds")
    low, high = seconds(value[0], what), seconds(value[1], what)
    if low > high:
        raise UsageError(f"{what}={value!r} has low above high; give [low, high]")
    return low, high


def stage_index(value: object, what: str) -> int | None:
    """``value`` as a stage index (an int >= 0) or None."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise UsageError(f"{what}={value!r} is not a stage index; give an int >= 0 or null")
    return value


def flag(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise UsageError(f"{what}={value!r} must be true or false")
    return value


def check_keys(data: object, required: Iterable[str], known: Iterable[str], where: str, *,
               missing_hint: str = "add them") -> Mapping[str, Any]:
    """``data`` as a mapping that has every ``required`` key and no key outside ``known``."""
    if not isinstance(data, Mapping):
        raise UsageError(f"{where} must be a JSON object, got {type(data).__name__}")
    missing = [key for key in required if key not in data]
    if missing:
        raise UsageError(f"{where} is missing key(s) {', '.join(missing)}; {missing_hint}")
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise UsageError(f"{where} has unknown key(s) {', '.join(unknown)}; remove them")
    return data


def schema_version(data: Mapping[str, Any], readable: tuple[int, ...], artifact: str,
                   regenerate: str, *, default: int | None = None) -> int:
    """The ``schema_version`` of ``data`` if this remat reads it (``default`` when the key
    is absent and a default is given); UsageError otherwise."""
    version = data.get("schema_version", default)
    if not isinstance(version, bool) and version in readable:
        assert isinstance(version, (int, float))
        return int(version)
    reads = (f"version {readable[0]}" if len(readable) == 1
             else f"versions {', '.join(map(str, readable))}")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        # "1" spells the version this remat reads and is still a string: say so
        kind = {str: "a string", bool: "a boolean", float: "a decimal number", list: "a list",
                dict: "an object"}.get(type(version), type(version).__name__)
        spelled = " or ".join(str(v) for v in readable)
        raise UsageError(
            f"{artifact} schema_version must be the integer {spelled}, not {kind} "
            f"({version!r}); write \"schema_version\": {readable[-1]} without quotes, or "
            f"{regenerate}"
        )
    raise UsageError(
        f"{artifact} schema version {version!r} is not supported (this remat reads "
        f"{reads}); {regenerate}"
    )
