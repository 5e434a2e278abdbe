"""Byte figures that are the largest of several whole numbers, kept so while a profile over a
range of shapes is measured (Note [Maxima fitted term by term] in remat.core.shapes).

A transient is a peak: the most a stage's ops hold at once, the largest of the live totals
after each op. Each of those totals is a sum of tensor sizes, an exact polynomial in the
shape; the peak is not, since which op holds the most changes with the shape. While
:func:`collecting`, the profiler records such a peak as a :class:`Maximum`, an ``int``
that also carries every total it is the largest of. Adding or subtracting a plain int
shifts every term (``peak - exit + clones`` stays the largest of shifted totals);
anything else (a sum of two peaks, a product, a negation, ``min``) gives a plain int, a
figure the fit then steps over the ladder as before. So nothing wrong can come of a term
list, only a figure fitted less tightly. Outside :func:`collecting` nothing changes: the
helpers return plain ints. Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["Maximum", "collecting", "is_collecting", "largest", "maximum_of"]

_COLLECTING = [0]


@contextmanager
def collecting() -> Iterator[None]:
    """Record peaks as :class:`Maximum` (with their terms) inside the block."""
    _COLLECTING[0] += 1
    try:
        yield
    finally:
        _COLLECTING[0] -= 1


def is_collecting() -> bool:
    return _COLLECTING[0] > 0


class Maximum(int):
    """The largest of ``terms``, as an int that keeps them through ``+`` and ``-`` of plain
    ints (module docstring)."""

    terms: tuple[int, ...]

    def __new__(cls, terms: Iterable[int]) -> Maximum:
        found = tuple(int(t) for t in terms)
        if not found:
            raise ValueError("a Maximum needs at least one term")
        self = super().__new__(cls, max(found))
        self.terms = found
        return self

    def __getnewargs__(self) -> tuple[Any, ...]:  # type: ignore[override]
        return (self.terms,)

    # A Maximum on both sides is a plain int: the sum of two peaks is no peak of sums
    # (and int's own methods would hand the other operand's reflected method a constant).
    def __add__(self, other: Any) -> Any:
        if type(other) is int:
            return Maximum(t + other for t in self.terms)
        return int(self) + (int(other) if isinstance(other, Maximum) else other)

    __radd__ = __add__

    def __sub__(self, other: Any) -> Any:
        if type(other) is int:
            return Maximum(t - other for t in self.terms)
        return int(self) - (int(other) if isinstance(other, Maximum) else other)

    def __rsub__(self, other: Any) -> Any:
        return other - int(self)


def _terms(value: int) -> tuple[int, ...]:
    return value.terms if isinstance(value, Maximum) else (int(value),)


def maximum_of(values: Iterable[int]) -> int:
    """The largest of ``values``: a :class:`Maximum` of them while :func:`collecting`."""
    found = tuple(values)
    if is_collecting():
        return Maximum(t for v in found for t in _terms(v))
    return max(found)


def largest(*values: int) -> int:
    """``max(*values)``, keeping every term where one of them is a :class:`Maximum` (the
    builtin would return one of the objects and drop the others' terms)."""
    if any(isinstance(v, Maximum) for v in values):
        return Maximum(t for v in values for t in _terms(v))
    return max(values)
