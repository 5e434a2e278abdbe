"""What ``remat.verify`` hands back: checks, hazards, the first divergence; all JSON-ready.

Torch-free on purpose: the CLI and tests read reports without running anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CHECK_NAMES",
    "HAZARD_KINDS",
    "Check",
    "Divergence",
    "Hazard",
    "OpMismatch",
    "ValueCheckResult",
    "VerifyReport",
]

#: The checks verify runs, in report order.
CHECK_NAMES = (
    "runs",
    "finite",
    "loss",
    "input-gradients",
    "parameter-gradients",
    "sgd-step",
    "adamw-step",
    "trajectory-losses",
    "trajectory-parameters",
    "rebuilt-values",
)

#: The hazards verify detects (docs/verify.md explains each).
HAZARD_KINDS = (
    "randomness",
    "buffer-mutation",
    "inplace-modification",
    "control-flow",
    "routing",
    "python-side-effect",
    "parameter-changed",
)

STATUSES = ("pass", "fail", "skip", "error")


def _number(value: float | None) -> float | str | None:
    """JSON has no inf or nan; write them as strings."""
    if value is None or math.isfinite(value):
        return value
    return str(value)


@dataclass(frozen=True)
class Check:
    """One comparison between the plain model and the model with the plan.

    ``max_rel_error`` is ``max|a - b| / max|b|`` over the worst tensor (``b`` the plain
    model's), so it stays meaningful where single elements are near zero.
    """

    name: str
    status: str  # one of STATUSES
    message: str
    compared: int = 0  # tensors (or values) compared
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    worst: str | None = None  # the tensor with the largest error, e.g. a parameter name
    tolerance: str = ""  # e.g. "auto (float32: rtol=1.3e-06, atol=1e-05)" or "exact"

    def __post_init__(self) -> None:
        assert self.status in STATUSES, self.status

    @property
    def passed(self) -> bool:
        """Whether the check is no reason to fail (passed, or had nothing to compare)."""
        return self.status in ("pass", "skip")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "passed": self.passed,
            "message": self.message,
            "compared": self.compared,
            "max_abs_error": _number(self.max_abs_error),
            "max_rel_error": _number(self.max_rel_error),
            "worst": self.worst,
            "tolerance": self.tolerance,
        }


@dataclass(frozen=True)
class Divergence:
    """Where the two models first part ways in step 1.

    Stage outputs in forward order, first as the forward computed them, then as the
    rebuilds did (a rebuild's error flows on to the later stages of its region, so the
    first one is the culprit): from the value check's first mismatch (``rebuilt-value``,
    with ``op``), else from the rebuilt stage outputs; if they all agree, gradients in the
    order backward computes them (last stage first): the stage named is the first whose
    own gradients differ although the gradient it received agreed.
    """

    stage: str | None  # module path; None when the divergence lies outside the stages
    stage_index: int | None
    # "output", "rebuilt-value", "rebuilt-output", "output-gradient", "input-gradient" or
    # "parameter-gradient"
    quantity: str
    tensor: str  # what differs, e.g. "blocks.3.mlp.c_fc.weight" or "blocks.3 output"
    max_abs_error: float
    max_rel_error: float
    message: str
    op: str | None = None  # the stage's first rebuilt op that differs, if the value check saw one

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "stage_index": self.stage_index,
            "quantity": self.quantity,
            "tensor": self.tensor,
            "max_abs_error": _number(self.max_abs_error),
            "max_rel_error": _number(self.max_rel_error),
            "op": self.op,
            "message": self.message,
        }


@dataclass(frozen=True)
class OpMismatch:
    """The first op of one rebuilt stage call that differs from the forward's record.

    ``kind`` is ``op`` (another op ran, or more ops than in forward: the code took another
    path), ``metadata`` (same op, other shape or dtype) or ``value`` (same op, other
    values). Errors compare checksums (``remat.verification.fingerprint.checksum``):
    ``max_abs_error`` is the largest difference of the sum, the sum of squares or the
    weighted sum, ``max_rel_error`` the largest of those relative to the output's norm
    (its square for the sum of squares).
    """

    stage: str
    stage_index: int
    region: str | None  # the innermost region holding the stage, e.g. "[2, 4)"
    kind: str  # "op" | "metadata" | "value"
    op_index: int  # position in the stage's forward op sequence
    forward_op: str | None  # None: the rebuild ran more ops than the forward
    rebuilt_op: str
    output_index: int | None = None  # which output of the op differs (values)
    max_abs_error: float | None = None
    max_rel_error: float | None = None

    @property
    def message(self) -> str:
        where = f"stage {self.stage!r}"
        if self.kind == "op" and self.forward_op is None:
            return (
                f"the rebuild of {where} ran {self.rebuilt_op} after the {self.op_index} ops "
                "its forward ran"
            )
        if self.kind == "op":
            return (
                f"the rebuild of {where} ran {self.rebuilt_op} where the forward ran "
                f"{self.forward_op} (op {self.op_index})"
            )
        if self.kind == "metadata":
            return (
                f"the rebuild of {where} gave {self.rebuilt_op} (op {self.op_index}) another "
                "shape or dtype than in forward"
            )
        return (
            f"the rebuild of {where} computed other values in {self.rebuilt_op} (op "
            f"{self.op_index}, output {self.output_index}): relative checksum error "
            f"{self.max_rel_error:.2g}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "stage_index": self.stage_index,
            "region": self.region,
            "kind": self.kind,
            "op_index": self.op_index,
            "forward_op": self.forward_op,
            "rebuilt_op": self.rebuilt_op,
            "output_index": self.output_index,
            "max_abs_error": _number(self.max_abs_error),
            "max_rel_error": _number(self.max_rel_error),
            "message": self.message,
        }


@dataclass(frozen=True)
class ValueCheckResult:
    """Every rebuilt stage call compared op by op with its forward fingerprints."""

    rebuilt_calls: int  # stage calls compared (a stage at nesting depth d runs d times)
    ops_compared: int
    mismatches: tuple[OpMismatch, ...] = ()  # the first per stage, in stage order
    control_flow: tuple[OpMismatch, ...] = ()  # where each stage's op sequence split, if it did
    routing: tuple[OpMismatch, ...] = ()  # each stage's first routing op choosing otherwise
    # outputs that differed but that no later op reads (kernel workspaces, state only their
    # own op's backward reads): skipped, not mismatches; and which, as "op output j"
    outputs_skipped: int = 0
    skipped_outputs: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def first(self) -> OpMismatch | None:
        """The mismatch of the earliest stage in forward order, or None."""
        return self.mismatches[0] if self.mismatches else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "rebuilt_calls": self.rebuilt_calls,
            "ops_compared": self.ops_compared,
            "mismatches": [m.to_dict() for m in self.mismatches],
            "control_flow": [m.to_dict() for m in self.control_flow],
            "routing": [m.to_dict() for m in self.routing],
            "outputs_skipped": self.outputs_skipped,
            "skipped_outputs": list(self.skipped_outputs),
        }


@dataclass(frozen=True)
class Hazard:
    """Something inside a region that makes a rebuild compute or do something else.

    ``covered`` hazards are handled by the runtime (buffers it puts back after the
    rebuild) and are reported for information only; the others fail verification.
    """

    kind: str  # one of HAZARD_KINDS
    message: str
    stage: str | None = None
    stage_index: int | None = None
    region: str | None = None
    count: int = 1  # e.g. how many side effects the rebuilds repeated
    covered: bool = False
    details: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        assert self.kind in HAZARD_KINDS, self.kind

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "stage": self.stage,
            "stage_index": self.stage_index,
            "region": self.region,
            "count": self.count,
            "covered": self.covered,
            "details": list(self.details),
            "message": self.message,
        }


@dataclass(frozen=True)
class VerifyReport:
    """The result of ``remat.verify``: ``ok`` is True only when equivalent and hazard-free."""

    checks: tuple[Check, ...]
    hazards: tuple[Hazard, ...]
    first_divergence: Divergence | None
    value_check: ValueCheckResult | None
    steps: int
    optimizer: str
    tolerance: str
    seed: int
    preserve_rng_state: bool
    plan_solver: str
    plan_regions: tuple[str, ...]
    elapsed_s: float

    @property
    def equivalent(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def blocking_hazards(self) -> tuple[Hazard, ...]:
        return tuple(h for h in self.hazards if not h.covered)

    @property
    def ok(self) -> bool:
        return self.equivalent and not self.blocking_hazards

    def check(self, name: str) -> Check:
        """The check called ``name`` (one of CHECK_NAMES)."""
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "equivalent": self.equivalent,
            "hazard_free": not self.blocking_hazards,
            "checks": [c.to_dict() for c in self.checks],
            "hazards": [h.to_dict() for h in self.hazards],
            "first_divergence": (
                None if self.first_divergence is None else self.first_divergence.to_dict()
            ),
            "value_check": None if self.value_check is None else self.value_check.to_dict(),
            "steps": self.steps,
            "optimizer": self.optimizer,
            "tolerance": self.tolerance,
            "seed": self.seed,
            "preserve_rng_state": self.preserve_rng_state,
            "plan": {"solver": self.plan_solver, "regions": list(self.plan_regions)},
            "elapsed_s": self.elapsed_s,
        }
