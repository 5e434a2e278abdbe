"""``remat.verify``: evidence that a plan changed memory and time only, never the training.

``remat.verify(model, batch, plan)`` compares a plain twin with a twin that has the plan
applied (loss, gradients, optimizer steps, a short trajectory), checks every rebuilt
tensor against its forward fingerprint and looks for hazards; see ``docs/verify.md``.
``ValueCheck`` is the value check alone, as a debug mode for any applied plan.

The package itself is callable, so ``remat.verify`` is one object however it was first
reached (``import remat.verify.hazards`` keeps working after ``remat.verify(...)``);
the function is :func:`remat.verify.harness.verify`.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from remat.verify import harness
from remat.verify.fingerprint import ValueCheck
from remat.verify.hazards import HazardProbe
from remat.verify.report import (
    CHECK_NAMES,
    HAZARD_KINDS,
    Check,
    Divergence,
    Hazard,
    OpMismatch,
    ValueCheckResult,
    VerifyReport,
)
from remat.verify.tolerance import Tolerance, TolerancePolicy, parse_tolerance
from remat.verify.twins import default_loss

__all__ = [
    "CHECK_NAMES",
    "HAZARD_KINDS",
    "Check",
    "Divergence",
    "Hazard",
    "HazardProbe",
    "OpMismatch",
    "Tolerance",
    "TolerancePolicy",
    "ValueCheck",
    "ValueCheckResult",
    "VerifyReport",
    "default_loss",
    "parse_tolerance",
    "verify",
]


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> VerifyReport:
        return harness.verify(*args, **kwargs)


_CallableModule.__call__.__doc__ = harness.verify.__doc__
sys.modules[__name__].__class__ = _CallableModule
# What ``remat.verify`` resolves to (remat's lazy attributes read ``remat.verify.verify``).
verify = sys.modules[__name__]
