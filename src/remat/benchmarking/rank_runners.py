"""Bench's and auto's rows on one rank of a data-parallel ``torchrun`` job
(``--distributed``): each row's runner wrapped as the job runs it, and its peak.

:class:`Ranks` is :class:`remat.parallel.data_parallel.DataParallelRank` with the
runners of :mod:`.runners`; the per-rank problem is
:func:`remat.parallel.data_parallel.rank_problem`.
"""

from __future__ import annotations

from typing import Any

from remat.core.plan_format import Plan
from remat.parallel.data_parallel import DataParallelRank, rank_step_peak

from .factory import whole
from .runners import EagerRunner, Runner
from .step_measures import MemoryMeasure

__all__ = ["RANK_PROFILE_REPEATS", "Ranks", "profile_rounds"]

# Note [Profile rounds per rank]: two ranks on shared cores move a step by about a fifth
# from one round to the next (gpt, 2 gloo ranks on 2 cores: plain steps of 71 to 97 ms in
# one profile), and a per-stage rebuild adds about as much. A profile's medians over 4 or
# 5 rounds missed the measured overhead by more than 10 points in one or two jobs of
# three (benchmarks/distributed_time.md, eighth and tenth runs); over 6 or 8 rounds in
# none of 15 jobs (ninth, eleventh to fourteenth). So under --distributed bench and auto
# profile 8 rounds unless told otherwise.
RANK_PROFILE_REPEATS = 8


def profile_rounds(given: int | None, distributed: str | None, one_process: int) -> int:
    """Timed rounds of each profile: ``given``, else ``one_process`` without
    ``distributed`` and :data:`RANK_PROFILE_REPEATS` with it (Note [Profile rounds per
    rank])."""
    if given is None:
        return one_process if distributed is None else RANK_PROFILE_REPEATS
    return whole(given, "profile_repeats", 1)


class Ranks(DataParallelRank):
    """One rank of a ``torchrun`` job (``--distributed``): how its rows are built and measured.

    A row's model is sharded before the plan is applied (FSDP2, which replaces the
    parameters the optimizer takes) or wrapped after (DDP). Its peak is measured from the
    allocator's events (:func:`remat.parallel.data_parallel.rank_step_peak`; the
    live-storage tracker does not follow FSDP2's parameters), DDP's gradient buckets
    included.
    """

    def runner(self, model: Any, batch: Any, loss_fn: Any, optimizer: str,
               plan: Plan | None) -> Runner:
        self.shard_before_plan(model, plan)
        runner = (Runner(model, batch, loss_fn, optimizer) if plan is None
                  else EagerRunner(model, batch, loss_fn, optimizer, plan))
        runner.model, resident = self.wrap_after_plan(model, batch, loss_fn, runner.optimizer)
        runner.resident_bytes = resident  # type: ignore[attr-defined]
        return runner

    @staticmethod
    def measure(runner: Runner) -> MemoryMeasure:
        resident = getattr(runner, "resident_bytes", 0)
        peak = rank_step_peak(runner.model, runner.batch, runner.loss_fn, runner.optimizer,
                              resident_bytes=resident)
        return MemoryMeasure(peak_bytes=peak, instrument="torch.profiler (rank)",
                             start_bytes=0, timeline=())
