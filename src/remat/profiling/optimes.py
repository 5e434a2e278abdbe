"""What a selective option and a checkpoint region cost in time, from timed steps.

A stage under ``selective:<policy>`` runs in its own checkpoint frame under torch's
selective-checkpoint dispatch mode: its forward pays the mode's cost on every op, and its
backward replays the forward, running again every op the policy does not save. Pricing
that as the unsaved ops' share of the stage's forward (each aten op timed in a forward
pass, as remat did before) missed the mode's cost: on the built-in ``gpt`` the share
came to 0.6x a block's forward for ``save-matmuls`` while timed steps showed 0.9x, and
``bench`` measured selective-everywhere 20 points slower than predicted. So the profile
times training steps with each option applied to every stage, interleaved with plain
steps, and charges each stage what its forward and backward took beyond the plain ones
(:func:`option_extra_s`).

A region's fixed cost is measured on a chain of tiny stages (:mod:`.overhead`), which sees
the checkpoint frame but not what grows with the stage (a pack and an unpack hook per
saved tensor, the rebuilt stage's backward finding its inputs in fresh memory). The
profile's steps with one region per stage show the whole of it: their time beyond the
plain step and the stages' timed rebuilds, per region (:func:`region_overhead_s`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from remat.errors import UsageError
from remat.profiling.timing import StepTimes

__all__ = ["option_extra_s", "policy_op_names", "region_overhead_rounds", "region_overhead_s"]


def policy_op_names(option: str, stage: str) -> frozenset[str]:
    """The aten ops (by name, ``aten.mm.default``) that ``option`` saves in ``stage``."""
    from remat.runtime.policies import resolve

    return frozenset(str(op) for op in resolve(option, stage).ops)


def _rounds(plain: Sequence[StepTimes], other: Sequence[StepTimes]) -> None:
    if not plain or len(plain) != len(other):
        raise UsageError(
            f"need paired rounds, got {len(plain)} plain and {len(other)} other; "
            "pass one plain round for each round with the option"
        )


def option_extra_s(plain: Sequence[StepTimes], with_option: Sequence[StepTimes],
                   floor_s: float = 0.0) -> tuple[float, ...]:
    """Per stage: what its forward and backward took under the option beyond the plain
    step of the same round (round ``r`` of each list ran back to back), the median over
    rounds, at least ``floor_s`` (the checkpoint frame every selective stage opens: a
    noisy round can make a stage look free, and none is)."""
    _rounds(plain, with_option)
    n = len(plain[0].fwd_s)
    return tuple(
        max(floor_s, statistics.median(
            (o.fwd_s[i] + o.bwd_s[i]) - (p.fwd_s[i] + p.bwd_s[i])
            for p, o in zip(plain, with_option, strict=True)
        ))
        for i in range(n)
    )


def region_overhead_s(plain: Sequence[StepTimes], per_stage: Sequence[StepTimes],
                      floor_s: float) -> float:
    """Seconds one region costs beyond rebuilding its stage: per round, the step with one
    region per stage less the plain step and the timed rebuilds, over the number of
    regions; the median over rounds, at least ``floor_s`` (the tiny chain's figure)."""
    return max(floor_s, statistics.median(region_overhead_rounds(plain, per_stage)))


def region_overhead_rounds(plain: Sequence[StepTimes], per_stage: Sequence[StepTimes]
                           ) -> list[float]:
    """Per round: the step with one region per stage less the plain step and the timed
    rebuilds, over the number of regions (:func:`region_overhead_s` is their median)."""
    _rounds(plain, per_stage)
    n = len(plain[0].fwd_s)
    return [(r.step_s - p.step_s - sum(r.rebuild_s)) / n
            for p, r in zip(plain, per_stage, strict=True)]
