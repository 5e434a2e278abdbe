"""Small helpers shared by the built-in models: option checks and seeded construction."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from remat.core.errors import UsageError


def check_int(name: str, value: object, *, minimum: int = 1) -> int:
    """Return ``value`` if it is an int of at least ``minimum``, else raise UsageError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(f"option {name}={value!r} is invalid; give a whole number >= {minimum}")
    return value


def check_prob(name: str, value: object) -> float:
    """Return ``value`` as a float if it lies in [0, 1), else raise UsageError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise UsageError(f"option {name}={value!r} is invalid; give a number in [0, 1)")
    return float(value)


@contextmanager
def seeded(seed: object) -> Iterator[None]:
    """Seed torch's CPU RNG inside the block and restore the caller's RNG state afterwards."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise UsageError(f"option seed={seed!r} is invalid; give a whole number")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
