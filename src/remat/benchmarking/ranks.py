"""One rank of a ``torchrun`` job, as bench and auto run it (``--distributed``).

:class:`Ranks` builds and measures a rank's rows; :func:`rank_problem` is the per-rank
problem every rank plans from; :func:`rank_zeros` gives every rank rank 0's profile or
problem. Both :mod:`.run` (bench) and :mod:`.main_job` (auto) use them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, TypeVar

import torch

from remat.core.artifact import JsonArtifact
from remat.core.plan_format import Plan
from remat.core.solve import Problem
from remat.distributed import RankInfo

from .factory import whole
from .runners import EagerRunner, Factory, Runner
from .step_measures import MemoryMeasure

__all__ = ["RANK_PROFILE_REPEATS", "Ranks", "profile_rounds", "rank_problem", "rank_zeros"]

A = TypeVar("A", bound=JsonArtifact)

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


def rank_zeros(artifact: A) -> A:
    """Rank 0's ``artifact`` (a profile, a problem) on every rank: the ranks must choose
    the same plans, or their FSDP units, and so their collectives, would differ."""
    import torch.distributed as dist

    shared: list[Any] = [artifact.to_json()]
    dist.broadcast_object_list(shared, src=0)
    return type(artifact).from_json(shared[0])


class Ranks:
    """One rank of a ``torchrun`` job (``--distributed``): how its rows are built and measured.

    Every rank builds the same model (same seed) and takes its shard of the batch; a row's
    model is wrapped after the plan is applied (DDP) or sharded before (FSDP2, which
    replaces the parameters the optimizer takes). Its peak is measured from the
    allocator's events (:func:`remat.distributed.rank_step_peak`; the live-storage tracker
    does not follow FSDP2's parameters), DDP's gradient buckets included.
    """

    def __init__(self, strategy: str, info: RankInfo) -> None:
        self.strategy = strategy
        self.info = info
        self.stages: tuple[str, ...] = ()  # the profiled stages, each an FSDP unit

    def shard(self, factory: Factory) -> Factory:
        from remat.distributed import shard_batch

        def sharded(batch_size: int | None) -> Any:
            model, batch, loss_fn = factory(batch_size)
            return model, shard_batch(batch, self.info.rank, self.info.world_size), loss_fn

        return sharded

    def runner(self, model: Any, batch: Any, loss_fn: Any, optimizer: str,
               plan: Plan | None) -> Runner:
        import remat.distributed as rd

        if self.strategy == "fsdp":
            rd.shard_stages(model, self.stages, plan)
        runner = (Runner(model, batch, loss_fn, optimizer) if plan is None
                  else EagerRunner(model, batch, loss_fn, optimizer, plan))
        runner.resident_bytes = 0  # type: ignore[attr-defined]
        if self.strategy == "ddp":
            runner.model = rd.wrap_ddp(model)
            rd.warm_ddp(runner.model, batch, loss_fn, runner.optimizer)
            runner.resident_bytes = rd.ddp_bucket_bytes(runner.model)  # type: ignore[attr-defined]
        return runner

    @staticmethod
    def measure(runner: Runner) -> MemoryMeasure:
        from remat.distributed import rank_step_peak

        resident = getattr(runner, "resident_bytes", 0)
        peak = rank_step_peak(runner.model, runner.batch, runner.loss_fn, runner.optimizer,
                              resident_bytes=resident)
        return MemoryMeasure(peak_bytes=peak, instrument="torch.profiler (rank)",
                             start_bytes=0, timeline=())


def rank_problem(problem: Problem, ranks: Ranks, factory: Factory, optimizer: str,
                 repeats: int = 2) -> Problem:
    """The per-rank problem (:func:`remat.core.transforms.per_rank_problem`), with this
    job's largest measured peak without checkpointing, so that budgets given as fractions
    mean fractions of what a rank holds, and every rank plans the same; its times are
    rank 0's profile of the wrapped model (Note [Per-rank time] in remat.distributed)."""
    import torch.distributed as dist

    from remat.core.planner import to_problem
    from remat.core.transforms import per_rank_problem, with_times_of
    from remat.distributed import profile_as_run, time_unit_gathers

    model, batch, loss_fn = factory(None)
    runner = ranks.runner(model, batch, loss_fn, optimizer, None)
    try:
        peak = ranks.measure(runner).peak_bytes
    finally:
        runner.close()

    largest = torch.tensor([peak], dtype=torch.int64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)  # one budget, so one plan, on every rank
    peak = int(largest.item())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    del model, runner
    model, batch, loss_fn = factory(None)
    timed = to_problem(profile_as_run(model, batch, loss_fn, wrap=ranks.strategy,
                                      stages=ranks.stages, optimizer=optimizer,
                                      repeats=repeats))
    timed = rank_zeros(timed)  # one set of times, so one plan
    gathers: list[float] | float = 0.0
    if ranks.strategy == "fsdp":  # what resharding a unit after a rebuild pays again
        shared: list[Any] = [time_unit_gathers(model, ranks.stages)]
        dist.broadcast_object_list(shared, src=0)
        gathers = shared[0]
    sharded = per_rank_problem(problem, world_size=ranks.info.world_size,
                               strategy=ranks.strategy, replicated_bytes=buffers,
                               backend=dist.get_backend(), gather_s=gathers)
    return replace(with_times_of(sharded, timed), measured_no_checkpoint_peak_bytes=peak)
