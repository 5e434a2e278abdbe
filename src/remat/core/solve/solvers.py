"""Solvers: each turns a Problem (and a budget) into a Plan with its predicted costs.

The classic recipes (``none``, ``per-stage``, ``every-k``, ``segments-k``,
``megatron-uniform``, ``megatron-block``, ``selective-everywhere``) ignore the budget
except to record it; ``optimal`` finds the fastest plan whose predicted peak fits it and
raises CheckFailed, naming the smallest feasible budget, when none does. Every plan's
peak and time come from the simulator.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

import remat.core.recipes as recipes
import remat.core.solve.dp as dp
from remat.core.errors import CheckFailed, UsageError
from remat.core.plan_format import KEEP, Option, Plan, Region
from remat.core.solve.budget import Budget as _Budget
from remat.core.solve.minimum import min_peak_plan
from remat.core.solve.problem import Problem
from remat.core.solve.simulator import baseline_time, simulate
from remat.core.units import format_bytes, parse_size

__all__ = [
    "SOLVERS",
    "TooLarge",
    "every",
    "megatron_block",
    "megatron_uniform",
    "min_peak",
    "minimum_budget",
    "nested_check",
    "none",
    "optimal",
    "per_stage",
    "segments",
    "segments_optimal",
    "selective_everywhere",
    "solve",
    "solver_memory_limit",
]

#: A budget as the solvers take it: a :class:`~remat.core.solve.budget.Budget` or what
#: ``Budget.parse`` reads; None for the solvers that need none.
Budget = _Budget | int | str | float | None


def _budget(budget: Budget, problem: Problem) -> int | None:
    return None if budget is None else _Budget.parse(budget).bytes(problem)


def _unlimited(problem: Problem, limit: int) -> bool:
    """Whether ``limit`` holds the plan without checkpointing, so nothing need be rebuilt.

    Every region, rebuild and option only adds time (all are measured as times >= 0), so
    that plan is then the fastest; answering here keeps budgets of any size (1e99 bytes)
    out of the tables' int64 arithmetic.
    """
    return simulate(_as_plan(problem, ([], None)), problem).peak_bytes <= limit


def _finish(
    problem: Problem,
    regions: Sequence[tuple[int, int]],
    options: Sequence[str] | None,
    solver: str,
    budget: int | None,
    started: float,
    reshard_after_rebuild: bool = False,
) -> Plan:
    # A recipe's region over a chain break is cut there (the optimal tables never span one).
    regions = recipes.split_at_breaks(list(regions), problem.breaks)
    plan = _as_plan(problem, (regions, options), reshard_after_rebuild)
    sim = simulate(plan, problem)
    baseline = baseline_time(problem).total_s
    return Plan(
        stages=plan.stages,
        regions=plan.regions,
        options=plan.options,
        solver=solver,
        budget_bytes=budget,
        predicted_peak_bytes=sim.peak_bytes,
        predicted_step_time_s=sim.step_time_s,
        baseline_step_time_s=baseline,
        solve_time_s=time.perf_counter() - started,
        reshard_after_rebuild=plan.reshard_after_rebuild,
    )


def none(problem: Problem, budget: Budget = None) -> Plan:
    """No checkpointing: every stage keeps what autograd saves."""
    t0 = time.perf_counter()
    return _finish(problem, [], None, "none", _budget(budget, problem), t0)


def per_stage(problem: Problem, budget: Budget = None) -> Plan:
    """One region per stage (transformers' ``gradient_checkpointing_enable``)."""
    t0 = time.perf_counter()
    regions = recipes.per_stage(problem.n)
    return _finish(problem, regions, None, "per-stage", _budget(budget, problem), t0)


def every(problem: Problem, k: int = 2, budget: Budget = None) -> Plan:
    """Single-stage regions on stages 0, k, 2k, ...; the others keep."""
    t0 = time.perf_counter()
    regions = recipes.every(problem.n, k)
    return _finish(problem, regions, None, f"every-{k}", _budget(budget, problem), t0)


def segments(problem: Problem, k: int | None = None, budget: Budget = None) -> Plan:
    """``k`` regions of near-equal length covering the chain (default ``round(sqrt(n))``)."""
    t0 = time.perf_counter()
    regions = recipes.segments(problem.n, k)
    k = len(regions)
    return _finish(problem, regions, None, f"segments-{k}", _budget(budget, problem), t0)


def megatron_uniform(problem: Problem, num_layers: int = 1, budget: Budget = None) -> Plan:
    """Megatron's uniform method: groups of ``num_layers`` consecutive stages, one region each."""
    t0 = time.perf_counter()
    regions = recipes.groups(problem.n, num_layers)
    size = num_layers
    return _finish(problem, regions, None, f"megatron-uniform-{size}", _budget(budget, problem), t0)


def megatron_block(problem: Problem, num_layers: int = 1, budget: Budget = None) -> Plan:
    """Megatron's block method: the first ``num_layers`` stages each alone, the rest keep."""
    t0 = time.perf_counter()
    regions = recipes.block(problem.n, num_layers)
    count = num_layers
    return _finish(problem, regions, None, f"megatron-block-{count}", _budget(budget, problem), t0)


def selective_everywhere(
    problem: Problem, policy: str = "save-matmuls", budget: Budget = None
) -> Plan:
    """No regions; every stage measured under ``selective:<policy>`` uses it, others keep."""
    t0 = time.perf_counter()
    option = Option.selective(policy)
    options = [option if option in s.saved_bytes else KEEP for s in problem.stages]
    return _finish(problem, [], options, "selective-everywhere", _budget(budget, problem), t0)


# -- bounded work (Note [The nested DP's bounds]) ------------------------------------------

#: The nested DP's work bound, in candidate slot updates (:func:`dp.nested_work`): about
#: a minute on the shared 2-core machine (1,000 stages at 500 slots, 1.7e11, took 196 s).
NESTED_WORK_LIMIT = 6 * 10**10


def solver_memory_limit() -> int:
    """The memory the solver's tables may take: ``REMAT_SOLVER_MEMORY`` (a size such as
    ``8GiB``) where set, else half of this machine's physical memory."""
    text = os.environ.get("REMAT_SOLVER_MEMORY", "").strip()
    if text:
        return parse_size(text, what="REMAT_SOLVER_MEMORY")
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        total = 16 << 30  # no sysconf (Windows): a 16 GiB machine
    return max(1, total) // 2


def _most_slots(n: int, early_stop: bool, memory: int) -> int:
    """The most slots under both bounds (0: not even one)."""
    lo, hi = 0, 1 << 20
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if (dp.nested_bytes(n, mid, early_stop) <= memory
                and dp.nested_work(n, mid) <= NESTED_WORK_LIMIT):
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class TooLarge:
    """A problem over the nested DP's bounds: what it needs and what fits instead."""

    size: str  # "a chain of N stages at S slots needs X ..., over the limit of L"
    fewer: str  # the fix within the nested solver: fewer slots, or a coarser chain

    def sentence(self) -> str:
        """The refusal: one sentence with the size, the limit and the fix."""
        return (f"{self.size} for the optimal solver's nested tables; give {self.fewer}, "
                "or use --solver segments-optimal (one level of regions, every stage "
                "keeping), which scales to 10,000 stages")

    def note(self) -> str:
        """What a plan made by the one-level solver in its place says."""
        return (f"{self.size} for the optimal solver's nested tables, so segments-optimal "
                "planned it (one level of regions, every stage keeping); for nested regions "
                f"and selective options give {self.fewer}")


def nested_check(problem: Problem, memory: int | None = None) -> TooLarge | None:
    """Why ``problem`` is too large for the nested DP (its size, the limit and the fix),
    or None where it is within bounds. Arithmetic only: nothing is allocated.

    Note [The nested DP's bounds]
    -----------------------------
    The optimal solver's tables grow as ``n^2 * slots`` and its work as ``n^3 * slots``
    (Note [The tables' size] in dp): at 500 slots, 1,000 stages take 6.2 GB and 3.3
    minutes here, 2,000 stages 25 GB, 3,000 stages 56 GB. So before it allocates
    anything the solver compares both with their bounds: the memory with half this
    machine's memory (``REMAT_SOLVER_MEMORY`` sets another), the work with
    :data:`NESTED_WORK_LIMIT` (about a minute here). Over either, ``optimal`` plans with
    the one-level solver (``segments-optimal``: ``O(n * slots)``, 10,000 stages in
    under a second) and says so in the plan's notes, or, asked not to
    (``scalable=False``), raises UsageError naming the fix: fewer slots (the most that
    fit), a coarser chain, or the one-level solver.
    """
    n, slots = problem.n, problem.slots
    memory = solver_memory_limit() if memory is None else memory
    need, work = dp.nested_bytes(n, slots, problem.early_stop), dp.nested_work(n, slots)
    if need <= memory and work <= NESTED_WORK_LIMIT:
        return None
    most = _most_slots(n, problem.early_stop, memory)
    size = (f"{format_bytes(need)}, over the limit of {format_bytes(memory)}"
            if need > memory else
            f"{work:.2g} slot updates, over the limit of {NESTED_WORK_LIMIT:.2g} (about a "
            "minute)")
    fewer = "a coarser chain (fewer, larger stages)"
    if most >= 2:
        fewer = f"--slots {most} or fewer (coarser plans), or {fewer}"
    return TooLarge(f"a chain of {n:,} stages at {slots} slots needs {size}", fewer)


def minimum_budget(problem: Problem) -> int:
    """The least predicted peak over all plans (exact); where regions hold tensors read
    from before them or FSDP2 units are gathered (which the tables do not count: Note
    [Reads from before a region]), the simulated peak of the tables' smallest-peak plan: a
    budget that plan fits, which another plan may undercut."""
    return _least_plan(problem)[0]


def _has_units(problem: Problem) -> bool:
    """Whether the problem is an FSDP2 rank's with units of its stages (Note [Keep or
    reshard after a rebuild])."""
    return any(s.unit_bytes for s in problem.stages)


def _least_is_exact(problem: Problem) -> bool:
    """Whether the tables count everything the simulator does, so their smallest peak is
    every plan's (not with reads, links, the links' backward, FSDP2 units, autocast's cast
    cache or arguments a frame holds: Note [Reads from before a region], Note [Autocast's
    cast cache], Note [Arguments a checkpoint frame holds] and Note [The backward of the
    code between stages] in simulator.py)."""
    return not (any(s.reads or s.link_saved_bytes or s.link_backward_bytes or s.unit_bytes
                    or s.cast_cache_bytes for s in problem.stages)
                or problem.root_unit_bytes
                or problem.args_at_return_bytes)  # Note [Arguments a checkpoint frame holds]


def _least_plan(problem: Problem, ways: tuple[bool, ...] = (False, True)
                ) -> tuple[int, list[tuple[int, int]], list[Option], bool]:
    """The tables' smallest-peak plan: (peak, regions, options, reshard_after_rebuild),
    units kept or resharded after rebuilds as ``ways`` allows, whichever peaks lower."""
    too_large = nested_check(problem)  # the search is the nested recursion in whole bytes
    if too_large is not None:
        raise UsageError(too_large.sentence())
    least, regions, options = min_peak_plan(problem)
    if not _least_is_exact(problem):
        # what the tables do not count (reads, links, FSDP2 units): the simulator does
        peaks = {reshard: simulate(_as_plan(problem, (regions, options), reshard),
                                   problem).peak_bytes
                 for reshard in (ways if _has_units(problem) else (False,))}
        reshard = min(peaks, key=lambda r: (peaks[r], r))  # keep when both are as low
        return max(least, peaks[reshard]), regions, options, reshard
    return least, regions, options, False


def min_peak(problem: Problem, budget: Budget = None) -> Plan:
    """The plan with the smallest predicted peak (ignores time)."""
    t0 = time.perf_counter()
    _, regions, options, reshard = _least_plan(problem)
    return _finish(problem, regions, options, "min-peak", _budget(budget, problem), t0, reshard)


def table_filler(path: str) -> Callable[[dp.Model, int], dp.Tables]:
    if path == "auto":
        import remat.core.solve.dp_numba as dp_numba

        path = "numba" if dp_numba.available() else "numpy"
    if path == "numba":
        import remat.core.solve.dp_numba as dp_numba

        if not dp_numba.available():
            raise UsageError("path='numba' needs numba, which did not import here; "
                             "install it with pip install numba or use path='numpy'")
        return dp_numba.numba_tables
    fill = {"numpy": dp.numpy_tables, "python": dp.python_tables}.get(path)
    if fill is None:
        raise UsageError(f"path={path!r} is not known; use 'auto', 'numba', 'numpy' or 'python'")
    return fill


Found = tuple[list[tuple[int, int]], list[Option] | None]


def _slots(problem: Problem, limit: int) -> tuple[int, int, int] | None:
    """``limit`` above the backward base in slots: (slot bytes, whole slots, the bytes
    left over); None when the base alone is over it."""
    avail = limit - problem.backward_base_bytes
    if avail < 0:
        return None
    slot = max(1, -(-avail // problem.slots))
    m = avail // slot
    return slot, m, avail - m * slot


_TIGHTEN_ROUNDS = 12
_BISECT_ROUNDS = 10


def _within(problem: Problem, limit: int, solve_at: Callable[[int], Found | None],
            reshard_after_rebuild: bool = False) -> Found | None:
    """``solve_at(limit)``'s plan if it fits ``limit`` in the simulator, else the plan for
    ``limit`` less the overshoot (Note [Reads from before a region]), a few times at most.

    Note [Reads from before a region]
    ---------------------------------
    The tables do not count what a region holds from before it (``StageCost.reads``: a
    skip tensor, a position bias passed on): that depends on where the region opens
    relative to where each tensor was made, a pair the recursion does not carry. The
    simulator counts it, so a table plan can overshoot by it; filling the tables again
    under the budget less the overshoot (doubled each time the fill overshoots again)
    finds one that fits, or a limit with no plan at all: the limits between there and the
    budget are then bisected (a few fills more) for the fastest plan that fits.
    Chains without such reads (most transformer stacks) fit on the first fill. FSDP2's
    gathered units are counted the same way (Note [FSDP2 units] in simulator.py).
    """
    def attempt(dp_limit: int) -> tuple[Found | None, int, float]:
        """The tables' plan at ``dp_limit``, its simulated peak and step time."""
        found = solve_at(dp_limit)
        if found is None:
            return None, 0, math.inf
        sim = simulate(_as_plan(problem, found, reshard_after_rebuild), problem)
        return found, sim.peak_bytes, sim.step_time_s

    found, peak, _ = attempt(limit)
    if found is None or peak <= limit:
        return found
    # Tighten: the overshoot off the table limit, doubled each time a fill overshoots
    # again (a small overshoot can hold the same plan many times), until a plan fits or
    # the tables have none.
    best: tuple[float, Found] | None = None
    dp_limit = limit
    for r in range(_TIGHTEN_ROUNDS):
        dp_limit -= (peak - limit) << r
        found, peak, t = attempt(dp_limit)
        if found is None or peak <= limit:
            if found is not None:
                best = (t, found)
            break
    else:
        return None
    # Then bisect the table limits between there (a fit, or no plan) and the budget (an
    # overshoot) for the fastest plan that fits.
    lo, hi = dp_limit, limit
    slots = _slots(problem, limit)
    slot = 1 if slots is None else slots[0]
    for _ in range(_BISECT_ROUNDS):
        if hi - lo <= slot:
            break
        mid = (lo + hi) // 2
        found, peak, t = attempt(mid)
        if found is not None and peak > limit:
            hi = mid
            continue
        lo = mid
        if found is not None and (best is None or t < best[0]):
            best = (t, found)
    return None if best is None else best[1]


def optimal(problem: Problem, budget: Budget, *, path: str = "auto",
            reshard_after_rebuild: bool | None = None, scalable: bool = True) -> Plan:
    """The fastest plan whose predicted peak fits ``budget`` (Note [The recursion] in dp).

    Memory is divided into ``problem.slots`` slots; ``path`` is ``numba`` (compiled,
    fastest; numba is a dependency, but may be missing where it has no wheel),
    ``numpy``, ``python`` (the reference loops) or
    ``auto`` (numba when installed, else numpy): all fill bitwise equal tables. A problem
    too large for the tables in this machine's memory or in about a minute (Note [The
    nested DP's bounds]) is planned by :func:`segments_optimal` instead, which the plan's
    ``notes`` say, or with ``scalable=False`` refused with UsageError. When
    rounding to slots leaves no plan
    although one fits (budgets within a few slots of the minimum), the plan with the
    smallest peak is returned. Raises CheckFailed when no plan fits at all.

    Note [Keep or reshard after a rebuild]
    --------------------------------------
    On an FSDP2 rank's problem (stages that are units) a region's rebuild can keep the
    units it gathered until their own backward (FSDP2's behaviour) or reshard them and
    gather each again for its backward (Note [Resharding after a rebuild] in
    simulator.py): less memory for one more all-gather per resharded unit. The solver
    finds the fastest plan that fits both ways and keeps the faster (keep when equal:
    fewer collectives); the plan says which (``Plan.reshard_after_rebuild``).
    ``reshard_after_rebuild=True`` or ``False`` solves one way only.
    """
    t0 = time.perf_counter()
    limit = _budget(budget, problem)
    if limit is None:
        raise UsageError("the optimal solver needs a budget; give one such as 6GiB or 50%")
    fill = table_filler(path)
    if _unlimited(problem, limit):
        return _finish(problem, [], None, "optimal", limit, t0)
    too_large = nested_check(problem)
    if too_large is not None:
        if not scalable:
            raise UsageError(too_large.sentence())
        return _scaled_down(problem, limit, too_large)
    ways = _reshard_ways(problem, reshard_after_rebuild)
    tables_plan = functools.partial(_tables_plan, problem, fill)
    best = _fastest_way(problem, limit, tables_plan, ways)
    if best is None:
        best = _least_peak_way(problem, limit, ways)
    _, reshard, found = best
    plan = _finish(problem, found[0], found[1], "optimal", limit, t0, reshard)
    assert plan.predicted_peak_bytes is not None and plan.predicted_peak_bytes <= limit
    return plan


def _tables_plan(problem: Problem, fill: Callable[[dp.Model, int], dp.Tables],
                 dp_limit: int) -> Found | None:
    """The nested tables' plan within ``dp_limit``; None where none fits in slots."""
    slots = _slots(problem, dp_limit)
    if slots is None:
        return None
    slot, m, spare = slots
    tables = fill(dp.Model(problem, slot, spare), m)
    return dp.reconstruct(tables, m) if math.isfinite(tables.top[0, m]) else None


def _reshard_ways(problem: Problem, reshard_after_rebuild: bool | None) -> tuple[bool, ...]:
    """Whether to reshard after rebuilds, each way optimal tries (Note [Keep or reshard
    after a rebuild]): both on a problem with units unless the caller chose one."""
    if reshard_after_rebuild is not None and not isinstance(reshard_after_rebuild, bool):
        raise UsageError(f"reshard_after_rebuild={reshard_after_rebuild!r} is not a bool; "
                         "give True, False or None (choose)")
    ways = (False, True) if _has_units(problem) else (False,)
    if reshard_after_rebuild is not None:
        ways = (reshard_after_rebuild,)
    return ways


def _fastest_way(problem: Problem, limit: int, tables_plan: Callable[[int], Found | None],
                 ways: tuple[bool, ...]) -> tuple[float, bool, Found] | None:
    """The fastest plan fitting ``limit`` over ``ways``, the first on a tie: (step seconds,
    reshard, plan); None where the tables and recipes find none."""
    best: tuple[float, bool, Found] | None = None
    for reshard in ways:
        got = _fastest_fitting(problem, limit, tables_plan, reshard)
        if got is not None and (best is None or got[0] < best[0]):
            best = (got[0], reshard, got[1])
    return best


def _least_peak_way(problem: Problem, limit: int, ways: tuple[bool, ...],
                    ) -> tuple[float, bool, Found]:
    """The plan of least peak where it fits ``limit`` (rounding to slots left the tables
    none); CheckFailed naming that peak where it does not."""
    least, regions, options, reshard = _least_plan(problem, ways)
    if limit < least:
        fixed = problem.backward_base_bytes
        # where the tables do not count everything, another plan may peak a little
        # lower (docs/cost-model.md): the figure is the least remat found, not a bound
        whose = "any plan reaches" if _least_is_exact(problem) else "remat found"
        raise CheckFailed(
            f"no plan fits a budget of {format_bytes(limit)} ({limit} bytes): the smallest "
            f"peak {whose} is {format_bytes(least)} ({least} bytes, of which "
            f"{format_bytes(fixed)} is fixed), so give a budget of at least that"
        )
    return (math.inf, reshard, (regions, options))


def _scaled_down(problem: Problem, limit: int, too_large: TooLarge) -> Plan:
    """The one-level solver's plan for a problem too large for the nested tables, its
    notes saying so (Note [The nested DP's bounds])."""
    try:
        plan = segments_optimal(problem, limit)
    except CheckFailed as err:
        raise CheckFailed(f"{too_large.size} for the optimal solver's nested tables, so "
                          f"the one-level solver tried it: {err}") from None
    return replace(plan, notes=(*plan.notes, too_large.note()))


def _fastest_fitting(problem: Problem, limit: int, tables_plan: Callable[[int], Found | None],
                     reshard: bool) -> tuple[float, Found] | None:
    """The tables' plan or a faster classic recipe, whichever is fastest and fits
    ``limit`` with units kept or resharded after rebuilds: (step seconds, plan)."""
    found = _within(problem, limit, tables_plan, reshard)
    # Note [Recipes beside the tables]: slot rounding charges every held quantity a whole
    # slot, so at a budget within a few slots of a recipe's exact peak the tables can
    # miss that recipe. The classic recipes are few and scored exactly in bytes, so the
    # fastest one that fits competes with the table's plan: optimal is never slower
    # than a recipe that fits the same budget.
    # Only a recipe faster than the table's plan can win, and a flat recipe's time is
    # cheap to bound (its regions' rebuilds), so the recipes are simulated fastest first
    # and only while they could still beat the best plan that fits.
    best_s = math.inf
    if found is not None:
        sim = simulate(_as_plan(problem, found, reshard), problem)
        best_s = sim.step_time_s if sim.peak_bytes <= limit else math.inf
    simulated: set[tuple[tuple[int, int], ...]] = set()  # recipes can coincide
    for estimate, least, family, k in _recipes_by_time(problem):
        if estimate > best_s * (1 + 1e-9):
            break
        if least > limit:
            continue
        regions = recipes.split_at_breaks(_recipe(problem.n, family, k), problem.breaks)
        if tuple(regions) in simulated:
            continue
        simulated.add(tuple(regions))
        sim = simulate(_as_plan(problem, (regions, None), reshard), problem)
        if sim.peak_bytes <= limit and sim.step_time_s < best_s:
            found, best_s = (regions, None), sim.step_time_s
    if found is None or not math.isfinite(best_s):
        return None
    return best_s, found


def _recipes_by_time(problem: Problem) -> list[tuple[float, int, str, int]]:
    """The classic recipes, fastest first: (estimated step time, least peak, family, k).

    Every stage of a recipe keeps, so each region adds its overhead, the links inside it
    and its stages' rebuilds (with early stop too: each stage hands the next its output)
    to the time without regions; the estimate differs from the simulator's only by float
    rounding.
    The least peak is a lower bound: at the end of the forward every bare stage still
    holds what it saved, on top of the forward's base. Both are closed forms per family
    (``every`` alone needs a strided sum), so the regions are built (:func:`_recipe`) only
    for the few recipes that get simulated, and to sum the links inside each ``groups``
    and ``segments`` recipe where the stages' ``link_s`` are not all 0.
    """
    n = problem.n
    if n == 0:
        return []
    base = baseline_time(problem).total_s  # no regions: every stage keeps
    rebuild = np.array([s.rebuild_s for s in problem.stages])
    kept = np.array([s.saved_bytes[KEEP] for s in problem.stages], dtype=np.int64)
    rebuilt, kept_before = np.cumsum(rebuild), np.cumsum(kept)
    ovh, fwd_base, all_kept = problem.region_overhead_s, problem.forward_base_bytes, int(kept.sum())
    ks = np.arange(1, n + 1)
    timed: list[tuple[float, int, str, int]] = [(base, fwd_base + all_kept, "none", 0)]
    for k in range(1, n + 1):  # every-k: stages 0, k, 2k, ... alone
        count = -(-n // k)
        timed.append((base + ovh * count + float(rebuild[::k].sum()),
                      fwd_base + all_kept - int(kept[::k].sum()), "every", k))
    # groups of k and k segments cover the chain: every stage is rebuilt, nothing kept.
    for family, counts in (("groups", -(-n // ks)), ("segments", ks)):
        estimates = base + ovh * counts + float(rebuilt[-1]) + _links_inside(problem, family)
        timed += [(float(t), fwd_base, family, int(k)) for t, k in zip(estimates, ks, strict=True)]
    block = base + ovh * ks + rebuilt  # the first k stages alone
    timed += [(float(t), fwd_base + all_kept - int(c), "block", int(k))
              for t, c, k in zip(block, kept_before, ks, strict=True)]
    timed.sort(key=lambda item: item[0])
    return timed


def _links_inside(problem: Problem, family: str) -> np.ndarray:
    """Per k = 1..n: the ``link_s`` of the links inside the regions of ``family``'s
    recipe k (every stage inside a region: every link but those between two regions)."""
    n = problem.n
    prefix = np.array(problem.link_prefix)
    if not prefix[-1]:
        return np.zeros(n)
    out = np.empty(n)
    for k in range(1, n + 1):
        spans = np.array(_recipe(n, family, k))
        out[k - 1] = float((prefix[spans[:, 1] - 1] - prefix[spans[:, 0]]).sum())
    return out


def _recipe(n: int, family: str, k: int) -> list[tuple[int, int]]:
    """The regions of one classic recipe (none, every-k, groups, segments-k, block)."""
    if family == "none":
        return []
    build = {"every": recipes.every, "groups": recipes.groups, "segments": recipes.segments,
             "block": recipes.block}[family]
    return build(n, k)


def _as_plan(
    problem: Problem, found: tuple[Sequence[tuple[int, int]], Sequence[str] | None],
    reshard_after_rebuild: bool = False,
) -> Plan:
    regions, options = found
    names = problem.stage_names
    return Plan(
        names,
        tuple(Region(*r) for r in regions),
        tuple(options) if options else (KEEP,) * len(names),
        reshard_after_rebuild=reshard_after_rebuild,
    )


def segments_optimal(problem: Problem, budget: Budget) -> Plan:
    """The fastest flat plan (disjoint regions, every stage keeps) whose peak fits ``budget``.

    The one-level solver of :mod:`remat.core.solve.flat`: no ``O(n^3)`` term, for chains too
    long for ``optimal``. Raises CheckFailed when no flat plan fits (in slots).
    """
    import remat.core.solve.flat as flat

    t0 = time.perf_counter()
    limit = _budget(budget, problem)
    if limit is None:
        raise UsageError("segments-optimal needs a budget; give one such as 6GiB or 50%")
    if _unlimited(problem, limit):
        return _finish(problem, [], None, "segments-optimal", limit, t0)
    # its table and per-column records: 20 bytes per stage and slot (flat.py)
    need, memory = 20 * (problem.n + 1) * (problem.slots + 1), solver_memory_limit()
    if need > memory:
        most = memory // (20 * (problem.n + 1)) - 1
        fewer = (f"at most {most} slots (--slots {most})" if most >= 2
                 else "a coarser chain (fewer, larger stages)")
        raise UsageError(f"a chain of {problem.n:,} stages at {problem.slots} slots needs "
                         f"{format_bytes(need)} for the one-level solver's table, over the "
                         f"limit of {format_bytes(memory)}; give {fewer}")

    def flat_plan(dp_limit: int) -> Found | None:
        slots = _slots(problem, dp_limit)
        if slots is None:
            return None
        slot, m, spare = slots
        tables = flat.flat_tables(flat.FlatInputs.build(problem, slot, spare), m)
        return (flat.flat_plan(tables, m), None) if math.isfinite(tables.top[0, m]) else None

    found = _within(problem, limit, flat_plan)
    if found is not None:
        plan = _finish(problem, found[0], None, "segments-optimal", limit, t0)
        assert plan.predicted_peak_bytes is not None and plan.predicted_peak_bytes <= limit
        return plan
    raise CheckFailed(
        f"no flat plan (disjoint regions, every stage keeping) fits a budget of "
        f"{format_bytes(limit)} ({limit} bytes) in {problem.slots} slots; give a larger "
        "budget, or use the optimal solver (nested regions and options)"
    )


SOLVERS: dict[str, Callable[..., Plan]] = {
    "none": none,
    "per-stage": per_stage,
    "every-k": every,
    "segments-k": segments,
    "megatron-uniform": megatron_uniform,
    "megatron-block": megatron_block,
    "selective-everywhere": selective_everywhere,
    "min-peak": min_peak,
    "optimal": optimal,
    "segments-optimal": segments_optimal,
}


def solve(name: str, problem: Problem, budget: Budget = None, **params: Any) -> Plan:
    """Run the solver called ``name`` (a key of :data:`SOLVERS`) with its ``params``."""
    solver = SOLVERS.get(name)
    if solver is None:
        raise UsageError(f"solver {name!r} is not known; choose one of {', '.join(SOLVERS)}")
    try:
        inspect.signature(solver).bind(problem, budget=budget, **params)
    except TypeError as err:
        raise UsageError(f"solver {name!r} does not take these parameters ({err})") from None
    return solver(problem, budget=budget, **params)
