"""``remat.verification``: evidence that a plan changed memory and time only, never the training.

``remat.verify(model, batch, plan)`` compares a plain twin with a twin that has the plan
applied (loss, gradients, optimizer steps, a short trajectory), checks every rebuilt
tensor against its forward fingerprint and looks for hazards; see ``docs/verify.md``.
``ValueCheck`` is the value check alone, as a debug mode for any applied plan.

The function is :func:`remat.verification.harness.verify`, re-exported here and as
``remat.verify``.
"""

from __future__ import annotations

from remat.verification.fingerprint import ValueCheck
from remat.verification.harness import verify
from remat.verification.hazards import HazardProbe
from remat.verification.tolerance import Tolerance, TolerancePolicy, parse_tolerance
from remat.verification.twin_models import default_loss
from remat.verification.verify_report import (
    CHECK_NAMES,
    HAZARD_KINDS,
    Check,
    Divergence,
    Hazard,
    OpMismatch,
    ValueCheckResult,
    VerifyReport,
)

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
