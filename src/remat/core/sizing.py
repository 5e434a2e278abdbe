"""The largest micro-batch that fits a budget, per strategy, on paper.

From a profile with batch scaling (two batch sizes, fitted linearly: a fake profile for a
target device costs seconds at any size), each strategy's plan is made again at each
micro-batch (:func:`remat.core.transforms.at_batch_size`, every peak from the simulator)
and the largest micro-batch whose predicted peak fits the budget is found by doubling
and then bisecting (a step's peak grows with the micro-batch under every strategy). The
strategies users compare: no checkpointing, one region per stage (per-layer
checkpointing, what frameworks offer), and remat's optimal plan. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from remat.core.errors import CheckFailed, UsageError
from remat.core.plan_format import Plan
from remat.core.profile_format import Profile
from remat.core.solve import SOLVERS, solve
from remat.core.solve.problem import Problem

__all__ = ["STRATEGIES", "Fit", "fastest_batch", "largest_batch", "plan_at"]

#: The strategies compared: no checkpointing, per-layer checkpointing, remat's plan.
STRATEGIES = ("none", "per-stage", "optimal")
#: Micro-batches searched up to this (a step of a million samples is not a micro-batch).
MAX_BATCH = 1 << 20


@dataclass(frozen=True)
class Fit:
    """A strategy's largest micro-batch under the budget (None: not even 1) and its plan."""

    strategy: str
    batch_size: int | None
    plan: Plan | None


def plan_at(profile: Profile, strategy: str, n: int, budget_bytes: int,
            transform: Callable[[Problem], Problem] | None = None) -> Plan | None:
    """Solver ``strategy``'s plan at micro-batch ``n`` (``transform`` applied to the
    problem), or None when it is predicted not to fit ``budget_bytes``."""
    from remat.core.planner import to_problem
    from remat.core.transforms import at_batch_size

    problem = to_problem(at_batch_size(profile, n))
    if transform is not None:
        problem = transform(problem)
    try:
        found = solve(strategy, problem, budget_bytes)
    except CheckFailed:
        return None
    peak = found.predicted_peak_bytes
    return found if peak is not None and peak <= budget_bytes else None


def fastest_batch(
    profile: Profile,
    budget_bytes: int,
    largest: int,
    *,
    transform: Callable[[Problem], Problem] | None = None,
) -> Fit:
    """Among the micro-batches up to ``largest`` (every one up to 64, then 1.25x apart,
    and ``largest``), the one where remat's plan gives the most samples per second; the
    largest micro-batch often needs so much rebuilding that a smaller one trains faster."""
    sizes = set(range(1, min(largest, 64) + 1)) | {largest}
    n = 64.0
    while n < largest:
        sizes.add(int(n))
        n *= 1.25
    best = Fit("optimal", None, None)
    best_rate = 0.0
    for size in sorted(sizes):
        plan = plan_at(profile, "optimal", size, budget_bytes, transform)
        step = None if plan is None else plan.predicted_step_time_s
        if step and size / step > best_rate:
            best, best_rate = Fit("optimal", size, plan), size / step
    return best


def largest_batch(
    profile: Profile,
    budget_bytes: int,
    strategy: str,
    *,
    transform: Callable[[Problem], Problem] | None = None,
    limit: int = MAX_BATCH,
) -> Fit:
    """The largest micro-batch at which ``strategy``'s plan is predicted within
    ``budget_bytes`` (``transform``: applied to each problem, e.g. one rank's under FSDP)."""
    if strategy not in SOLVERS:
        raise UsageError(f"strategy {strategy!r} is not known; choose one of "
                         f"{', '.join(STRATEGIES)}")
    if profile.scaling is None:
        raise UsageError("the largest micro-batch needs a profile at two batch sizes "
                         "(remat.profiling.profiler.profile_scaling)")

    def at(n: int) -> Plan | None:
        return plan_at(profile, strategy, n, budget_bytes, transform)

    best = at(1)
    if best is None:
        return Fit(strategy, None, None)
    low, high = 1, None  # low fits; high (once found) does not
    while high is None and low < limit:
        n = min(2 * low, limit)
        found = at(n)
        if found is None:
            high = n
        else:
            low, best = n, found
    if high is not None:
        while high - low > 1:
            mid = (low + high) // 2
            found = at(mid)
            if found is None:
                high = mid
            else:
                low, best = mid, found
    return Fit(strategy, low, best)
