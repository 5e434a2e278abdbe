"""How ``remat auto`` runs its steps: in one process, or on every rank of a ``torchrun`` job.

The main job (:mod:`.main_job`) takes one of these and calls it the same way at each step;
only the strategy knows whether there are ranks. :class:`OneProcess` is the plain run;
:class:`PerRank` is ``--distributed ddp|fsdp`` (Note [auto per rank] in :mod:`.main_job`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from remat.core.plan_format import Plan
from remat.core.planner import plan as make_plan
from remat.core.planner import to_problem
from remat.core.profile_format import Profile
from remat.core.solve import Problem
from remat.core.solve.budget import Budget
from remat.core.solve.paired import paired_overhead
from remat.core.solve.uncertainty import PlanUncertainty, steadiest_and_uncertainty
from remat.parallel.data_parallel import rank_problem
from remat.parallel.ranks import rank_zeros
from remat.profiling.profiler import most_over_ranks

from .rank_runners import Ranks
from .runners import EagerRunner, Factory, Runner
from .step_measures import MemoryMeasure, by_tracker

__all__ = ["DISTRIBUTED", "AutoStrategy", "OneProcess", "PerRank", "strategy_for"]

#: The ``distributed`` values :func:`remat.auto` takes (None: one process).
DISTRIBUTED = ("ddp", "fsdp")


class AutoStrategy(Protocol):
    """The calls the main job makes where one process and a rank differ."""

    #: ``ddp`` or ``fsdp`` per rank; None in one process
    distributed: str | None
    #: whether a second profile may be made (Note [Profiling again])
    profiles_again: bool

    def shard(self, factory: Factory) -> Factory:
        """``factory``, building this process's part of the batch."""
        ...

    def shared(self, profile: Profile) -> Profile:
        """The profile every process plans from."""
        ...

    def rank(self) -> tuple[int | None, int | None]:
        """``(rank, world_size)`` for the report's environment."""
        ...

    def problem(self, profile: Profile, factory: Factory, optimizer: str,
                profile_repeats: int) -> Problem:
        """The problem the plan is chosen for."""
        ...

    def choose(self, profile: Profile, problem: Problem, budget: Budget
               ) -> tuple[Plan, PlanUncertainty | None]:
        """remat's optimal plan under ``budget``, and its range within the timing noise."""
        ...

    def predicted_overhead(self, plan: Plan, profile: Profile) -> float | None:
        """The median of the profile's per-round ratios (None: the problem's medians)."""
        ...

    def runner(self, model: Any, batch: Any, loss_fn: Callable[[Any, Any], Any],
               optimizer: str, plan: Plan | None) -> Runner:
        """A model to measure: plain (``plan`` None) or with ``plan`` applied."""
        ...

    def measure(self, runner: Runner) -> MemoryMeasure:
        """The peak of one of ``runner``'s steps."""
        ...

    def agreed(self, flag: bool) -> bool:
        """``flag`` where every process must take the same decision."""
        ...

    def done(self) -> None:
        """After the runners are closed."""
        ...


class OneProcess:
    """The plain run: the whole batch, the live-storage tracker, the noise's draws."""

    distributed: str | None = None
    profiles_again = True

    def shard(self, factory: Factory) -> Factory:
        return factory

    def shared(self, profile: Profile) -> Profile:
        return profile

    def rank(self) -> tuple[int | None, int | None]:
        return None, None

    def problem(self, profile: Profile, factory: Factory, optimizer: str,
                profile_repeats: int) -> Problem:
        return to_problem(profile)

    def choose(self, profile: Profile, problem: Problem, budget: Budget
               ) -> tuple[Plan, PlanUncertainty | None]:
        # the simplest of the plans tied within the timing noise, and its uncertainty
        return steadiest_and_uncertainty(profile, make_plan(problem, budget, "optimal"),
                                         slots=problem.slots)

    def predicted_overhead(self, plan: Plan, profile: Profile) -> float | None:
        return paired_overhead(plan, profile)

    def runner(self, model: Any, batch: Any, loss_fn: Callable[[Any, Any], Any],
               optimizer: str, plan: Plan | None) -> Runner:
        if plan is None:
            return Runner(model, batch, loss_fn, optimizer)
        return EagerRunner(model, batch, loss_fn, optimizer, plan)

    def measure(self, runner: Runner) -> MemoryMeasure:
        return by_tracker(runner)

    def agreed(self, flag: bool) -> bool:
        return flag

    def done(self) -> None:
        pass


class PerRank:
    """One rank of a ``torchrun`` job under DDP or FSDP2 (Note [auto per rank]).

    Every rank takes rank 0's profile and the per-rank problem, so all choose the same
    plan; peaks come from the allocator's events; a decision to time more pairs is taken
    by all ranks when one needs it. The plan is not checked against the timing noise's
    draws (they re-solve the one-process problem), and no second profile is made.
    """

    profiles_again = False

    def __init__(self, distributed: str) -> None:
        self.distributed: str | None = distributed
        self._ranks: Ranks | None = None

    @property
    def ranks(self) -> Ranks:
        if self._ranks is None:
            from remat.parallel.ranks import init_from_env

            assert self.distributed is not None
            self._ranks = Ranks(self.distributed, init_from_env())
        return self._ranks

    def shard(self, factory: Factory) -> Factory:
        return self.ranks.shard(factory)

    def shared(self, profile: Profile) -> Profile:
        return rank_zeros(profile)

    def rank(self) -> tuple[int | None, int | None]:
        return self.ranks.info.rank, self.ranks.info.world_size

    def problem(self, profile: Profile, factory: Factory, optimizer: str,
                profile_repeats: int) -> Problem:
        self.ranks.stages = profile.stage_names
        return rank_problem(to_problem(profile), self.ranks, factory, optimizer,
                            profile_repeats)

    def choose(self, profile: Profile, problem: Problem, budget: Budget
               ) -> tuple[Plan, PlanUncertainty | None]:
        # the draws re-solve the one-process problem: the per-rank plan as solved
        return make_plan(problem, budget, "optimal"), None

    def predicted_overhead(self, plan: Plan, profile: Profile) -> float | None:
        return None  # the profile's rounds are one process's

    def runner(self, model: Any, batch: Any, loss_fn: Callable[[Any, Any], Any],
               optimizer: str, plan: Plan | None) -> Runner:
        return self.ranks.runner(model, batch, loss_fn, optimizer, plan)

    def measure(self, runner: Runner) -> MemoryMeasure:
        return self.ranks.measure(runner)

    def agreed(self, flag: bool) -> bool:
        return bool(most_over_ranks(int(flag)))

    def done(self) -> None:
        import torch.distributed as dist

        dist.barrier()  # every rank done before any tears its group down


def strategy_for(distributed: str | None) -> AutoStrategy:
    """:class:`OneProcess` for None, :class:`PerRank` for ``ddp`` or ``fsdp``."""
    return OneProcess() if distributed is None else PerRank(distributed)
