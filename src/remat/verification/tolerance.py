"""How close two results must be to count as equal: by dtype (``auto``), ``exact``, or fixed.

Two kinds of comparison use it. Twin comparisons (plain model against the model with the
plan) compare tensors element by element, ``|a - b| <= atol + rtol * |b|``; the ``auto``
table is ``torch.testing``'s for the low-precision types and tighter for float64.
Rebuild comparisons (the value check) compare a rebuilt op's output with the same op's
output in forward through checksums; on the same device with the same kernels those
agree to the bit, so their relative tolerance is tighter still and only absorbs kernels
that are not deterministic (atomics on accelerators).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from remat.core.errors import UsageError

__all__ = ["Tolerance", "TolerancePolicy", "parse_tolerance"]


@dataclass(frozen=True)
class Tolerance:
    """Element-wise closeness: ``|a - b| <= atol + rtol * |b|``; zeros mean bitwise equal."""

    rtol: float
    atol: float

    @property
    def exact(self) -> bool:
        return self.rtol == 0 and self.atol == 0

    def __str__(self) -> str:
        return "exact" if self.exact else f"rtol={self.rtol:g}, atol={self.atol:g}"


_EXACT = Tolerance(0.0, 0.0)
_TWIN = {
    torch.float64: Tolerance(1e-9, 1e-12),
    torch.complex128: Tolerance(1e-9, 1e-12),
    torch.float32: Tolerance(1.3e-6, 1e-5),
    torch.complex64: Tolerance(1.3e-6, 1e-5),
    torch.bfloat16: Tolerance(1.6e-2, 1e-5),
    torch.float16: Tolerance(1e-3, 1e-5),
}
_REBUILD_RTOL = {
    torch.float64: 1e-10,
    torch.complex128: 1e-10,
    torch.float32: 1e-5,
    torch.complex64: 1e-5,
    torch.bfloat16: 1e-2,
    torch.float16: 1e-2,
}
_DEFAULT_LOW_PRECISION = Tolerance(1.6e-2, 1e-5)  # float8 and other narrow types


@dataclass(frozen=True)
class TolerancePolicy:
    """``mode`` is ``auto`` (by dtype), ``exact`` (bitwise) or ``fixed`` (``fixed`` for all)."""

    mode: str
    fixed: Tolerance | None = None

    def for_dtype(self, dtype: torch.dtype) -> Tolerance:
        """The element-wise tolerance for comparing two tensors of ``dtype``."""
        if self.mode == "exact" or not (dtype.is_floating_point or dtype.is_complex):
            return _EXACT
        if self.mode == "fixed":
            assert self.fixed is not None
            return self.fixed
        return _TWIN.get(dtype, _DEFAULT_LOW_PRECISION)

    def rebuild_rtol(self, dtype: torch.dtype) -> float:
        """The relative tolerance of a rebuilt op's checksum against its forward one."""
        if self.mode == "exact" or not (dtype.is_floating_point or dtype.is_complex):
            return 0.0
        if self.mode == "fixed":
            assert self.fixed is not None
            return self.fixed.rtol
        return _REBUILD_RTOL.get(dtype, 1e-2)

    def describe(self, dtype: torch.dtype | None = None) -> str:
        if self.mode == "exact":
            return "exact"
        if self.mode == "fixed":
            return f"fixed ({self.fixed})"
        if dtype is None:
            return "auto"
        return f"auto ({str(dtype).removeprefix('torch.')}: {self.for_dtype(dtype)})"


def parse_tolerance(value: object) -> TolerancePolicy:
    """``"auto"``, ``"exact"``, a number (rtol = atol = it), a Tolerance, or its text form."""
    if isinstance(value, TolerancePolicy):
        return value
    if isinstance(value, Tolerance):
        return TolerancePolicy("fixed", value)
    if value in ("auto", "exact"):
        return TolerancePolicy(str(value))
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    if number is None or not math.isfinite(number) or number < 0:
        raise UsageError(
            f"tolerance {value!r} is not valid; use 'auto', 'exact' or a number >= 0 such as 1e-6"
        )
    if number == 0:
        return TolerancePolicy("exact")
    return TolerancePolicy("fixed", Tolerance(number, number))
