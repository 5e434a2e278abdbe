"""Reading a memory budget: bytes for the peak of a whole step, or a fraction of one.

A :class:`Budget` is read once, where the user gave it (:meth:`Budget.parse`: the syntax
and the sign are checked there, before anything is measured), and turned into bytes
against a problem where one is at hand (:meth:`Budget.bytes`). A fraction has one
meaning everywhere: a share of the peak of one whole training step without
checkpointing, as measured on the device that runs it (``Problem.measured_no_checkpoint
_peak_bytes``); under ``--distributed`` that device is a rank, and the problem carries
the largest rank's peak, so every rank reads the same bytes and plans the same (``remat
plan --world``, planning a rank on paper, takes it of the rank's predicted step). This is
the meaning docs/commands.md and docs/python-api.md give.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from remat.core.errors import UsageError
from remat.core.solve.problem import Problem
from remat.core.units import parse_size

__all__ = ["Budget", "check_budget", "parse_budget"]

_FRACTION = re.compile(r"^\s*([0-9]*\.[0-9]+|[0-9]+\.[0-9]*|[0-9]*\.?[0-9]+[eE][+-]?[0-9]+)\s*$")
#: More bytes than any device's step could peak at (an exbibyte): a fraction under one
#: byte of it is under one byte of every step.
_LARGEST_STEP = 1 << 60
_PERCENT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*%\s*$")


@dataclass(frozen=True)
class Budget:
    """A memory budget as the user gave it: ``nbytes`` or a ``fraction``, one of them.

    ``6GiB``, ``512MiB``, ``1e9`` and whole numbers are bytes; ``50%`` and unitless
    numbers up to 1 written with a point (``0.5``) are fractions of the measured peak
    without checkpointing. ``text`` is what was given, for messages and reports.
    """

    text: str
    nbytes: int | None = None
    fraction: float | None = None

    def __post_init__(self) -> None:
        if (self.nbytes is None) == (self.fraction is None):
            raise UsageError(f"budget {self.text!r} must be bytes or a fraction, one of them")

    @classmethod
    def parse(cls, value: Budget | str | int | float) -> Budget:
        """Read ``value`` (UsageError, one sentence, for anything that is not a budget)."""
        if isinstance(value, Budget):
            return value
        fraction: float | None = None
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise UsageError(f"budget {value!r} is not a size; give bytes such as 6GiB, or 50%")
        text: str | int = value if not isinstance(value, float) else 0
        if isinstance(value, float):
            if not math.isfinite(value) or value <= 0:
                raise UsageError(f"budget {value!r} must be above zero; give bytes such as 6GiB")
            if value <= 1:
                fraction = value
            else:
                text = math.floor(value)
        elif isinstance(text, str):
            if text.strip().startswith("-"):
                raise UsageError(
                    f"budget {text!r} must be above zero; give bytes such as 6GiB, or 50%"
                )
            percent = _PERCENT.match(text)
            plain = _FRACTION.match(text)
            if percent:
                fraction = float(percent.group(1)) / 100
            elif plain and 0 < float(plain.group(1)) <= 1:
                fraction = float(plain.group(1))
        if fraction is not None:
            if fraction * _LARGEST_STEP < 1:  # under one byte of any step's peak
                raise _zero_or_tiny(value)
            return cls(str(value), fraction=fraction)
        if isinstance(text, int) and text <= 0:
            raise UsageError(f"budget {text!r} must be above zero; give bytes such as 6GiB")
        nbytes = parse_size(text, what="budget")
        if nbytes <= 0:
            raise _zero_or_tiny(value)
        return cls(str(value), nbytes=nbytes)

    def bytes(self, problem: Problem) -> int:
        """The budget in bytes for ``problem``: the peak of one whole training step."""
        if self.nbytes is not None:
            return self.nbytes
        assert self.fraction is not None
        peak = problem.measured_no_checkpoint_peak_bytes
        if peak is None:
            raise UsageError(
                f"budget {self.text!r} is a fraction of the measured peak without "
                "checkpointing, which this problem does not have; give bytes such as 6GiB "
                "instead"
            )
        if peak == 0:
            raise UsageError(
                f"budget {self.text!r} is a fraction of the measured peak without "
                "checkpointing, which is 0 bytes here, so the profile measured nothing; "
                "profile the model again, or give bytes such as 6GiB"
            )
        value = math.floor(self.fraction * peak)
        if value <= 0:
            raise _zero_or_tiny(self.text)
        return value

    def __str__(self) -> str:
        return self.text


def _zero_or_tiny(text: str | int | float) -> UsageError:
    if _positive(text):  # 1e-300 and 1e-300% alike: above zero as written
        return UsageError(
            f"budget {text!r} comes to less than one byte; give a budget the step can fit, "
            "in bytes such as 6GiB, or a fraction such as 50%"
        )
    return UsageError(f"budget {text!r} must be above zero; give bytes such as 6GiB, or 50%")


def parse_budget(text: Budget | str | int | float, problem: Problem) -> int:
    """The budget in bytes for ``problem``: ``Budget.parse(text).bytes(problem)`` (kept for
    callers of the older name; remat reads a :class:`Budget` once and passes it on)."""
    return Budget.parse(text).bytes(problem)


def _positive(text: str | int | float) -> bool:
    """Whether ``text`` is a number above zero as written (``1e-300``, ``1e-300%``)."""
    try:
        return float(str(text).strip().rstrip("%").strip()) > 0
    except ValueError:
        return False


def check_budget(text: Budget | str | int | float) -> Budget:
    """``Budget.parse(text)`` (kept for callers of the older name)."""
    return Budget.parse(text)
