"""Reading a memory budget: bytes for the peak of a whole step, or a fraction of one."""

from __future__ import annotations

import math
import re

from remat.core.errors import UsageError
from remat.core.plan_format import KEEP
from remat.core.solve.problem import Problem, StageCost
from remat.core.units import parse_size

__all__ = ["check_budget", "parse_budget"]

_FRACTION = re.compile(r"^\s*([0-9]*\.[0-9]+|[0-9]+\.[0-9]*|[0-9]*\.?[0-9]+[eE][+-]?[0-9]+)\s*$")
_PERCENT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*%\s*$")


def parse_budget(text: str | int | float, problem: Problem) -> int:
    """The budget in bytes: the peak of one whole training step on the device.

    ``6GiB``, ``512MiB``, ``1e9`` and whole numbers are bytes; ``50%`` and unitless
    numbers up to 1 written with a point (``0.5``) are fractions of the problem's
    measured peak without checkpointing.
    """
    fraction: float | None = None
    if isinstance(text, bool):
        raise UsageError(f"budget {text!r} is not a size; give bytes such as 6GiB, or 50%")
    if isinstance(text, float):
        if not math.isfinite(text) or text <= 0:
            raise UsageError(f"budget {text!r} must be above zero; give bytes such as 6GiB")
        if text <= 1:
            fraction = text
        else:
            text = math.floor(text)
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
    if fraction is None:
        if isinstance(text, int) and text <= 0:
            raise UsageError(f"budget {text!r} must be above zero; give bytes such as 6GiB")
        value = parse_size(text, what="budget")  # type: ignore[arg-type]
    else:
        peak = problem.measured_no_checkpoint_peak_bytes
        if peak is None:
            raise UsageError(
                f"budget {text!r} is a fraction of the measured peak without checkpointing, "
                "which this problem does not have; give bytes such as 6GiB instead"
            )
        if peak == 0:
            raise UsageError(
                f"budget {text!r} is a fraction of the measured peak without checkpointing, "
                "which is 0 bytes here, so the profile measured nothing; profile the model "
                "again, or give bytes such as 6GiB"
            )
        value = math.floor(fraction * peak)
    if value <= 0 and _positive(text):
        # 1e-300 and 1e-300% alike: above zero as written, under one byte as a budget
        raise UsageError(
            f"budget {text!r} comes to less than one byte; give a budget the step can fit, "
            "in bytes such as 6GiB, or a fraction such as 50%"
        )
    if value <= 0:
        raise UsageError(f"budget {text!r} must be above zero; give bytes such as 6GiB, or 50%")
    return value


def _positive(text: str | int | float) -> bool:
    """Whether ``text`` is a number above zero as written (``1e-300``, ``1e-300%``)."""
    try:
        return float(str(text).strip().rstrip("%").strip()) > 0
    except ValueError:
        return False


def check_budget(text: str | int | float) -> None:
    """Raise UsageError for a budget no problem could read, before anything is measured."""
    stand_in = Problem(stages=(StageCost("stage", 1, 1, {KEEP: 0}),),
                       measured_no_checkpoint_peak_bytes=1 << 50)
    parse_budget(text, stand_in)
