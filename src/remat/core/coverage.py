"""How much of a model's activation memory its chain of stages covers (torch-free).

Checkpointing can only free what the stages keep; memory the model keeps before the first
stage, after the last or in code no stage runs stays whatever the plan. The covered share
says how much of the no-checkpoint activation memory a plan can act on at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from remat.core.plan_format import KEEP
from remat.core.profile_format import Profile

__all__ = [
    "HINT_BELOW",
    "Coverage",
    "coverage",
    "coverage_hint",
    "coverage_line",
    "coverage_lines",
]

#: Below this share the output suggests naming more stages with ``--stages``.
HINT_BELOW = 0.7


@dataclass(frozen=True)
class Coverage:
    """The chain's part of the activation memory of a step without checkpointing.

    ``chain_bytes`` is what the stages keep: each stage's ``saved_bytes["keep"]``, its
    input (``boundary_bytes``) unless neither it (``saves_input``) nor the stage before
    (``saves_output``) keeps that, and the last stage's output. ``activation_bytes`` adds
    what the model keeps outside the chain: ``fixed.pre_chain_bytes`` (before the first
    stage, beyond its input) and ``fixed.post_chain_bytes`` (the head and loss, beyond
    the last stage's output). Parameters, gradients, optimizer state and the batch are
    not activations and count in neither.
    """

    stages: tuple[str, ...]
    chain_bytes: int
    activation_bytes: int
    given: bool | None = None  # named by the user (True), discovered (False), unknown

    @property
    def share(self) -> float:
        """``chain_bytes / activation_bytes``, in [0, 1] (1.0 when there is nothing)."""
        return self.chain_bytes / self.activation_bytes if self.activation_bytes else 1.0

    @property
    def low(self) -> bool:
        """Whether the share is below :data:`HINT_BELOW`."""
        return self.share < HINT_BELOW

    def to_dict(self) -> dict[str, Any]:
        return {
            "stages": len(self.stages),
            "first": self.stages[0],
            "last": self.stages[-1],
            "given": self.given,
            "chain_bytes": self.chain_bytes,
            "activation_bytes": self.activation_bytes,
            "share": self.share,
        }


def coverage(profile: Profile, *, given: bool | None = None) -> Coverage:
    """The share of the no-checkpoint activation memory that ``profile``'s chain covers.

    ``given``: whether the stages were named by the user (``--stages``) or discovered,
    None if unknown (a profile read from a file); it only changes the wording of
    :func:`coverage_line`.
    """
    stages = profile.stages
    chain = stages[-1].output_bytes + sum(s.saved_bytes[KEEP] for s in stages)
    for i, s in enumerate(stages):
        if s.saves_input or (i > 0 and stages[i - 1].saves_output):
            chain += s.boundary_bytes
    outside = profile.fixed.pre_chain_bytes + profile.fixed.post_chain_bytes
    return Coverage(profile.stage_names, chain, chain + outside, given)


def coverage_line(cov: Coverage) -> str:
    """``stages: 8 found (layer1.0 .. layer4.1), covering 91% of activation memory``."""
    ends = cov.stages[0] if len(cov.stages) == 1 else f"{cov.stages[0]} .. {cov.stages[-1]}"
    how = {True: " given", False: " found", None: ""}[cov.given]
    return f"stages: {len(cov.stages)}{how} ({ends}), covering {cov.share:.0%} of activation memory"


def coverage_hint(cov: Coverage) -> str | None:
    """One sentence suggesting ``--stages`` when the share is low, else None."""
    if not cov.low:
        return None
    return (
        f"hint: {1 - cov.share:.0%} of the activation memory is outside the stages, where no "
        "plan can free it; name more blocks with --stages PATH,... (see docs/stages.md)"
    )


def coverage_lines(profile: Profile, *, given: bool | None = None) -> list[str]:
    """What ``profile``, ``plan`` and ``auto`` print: the line, and the hint when low."""
    cov = coverage(profile, given=given)
    hint = coverage_hint(cov)
    return [coverage_line(cov)] + ([hint] if hint else [])
