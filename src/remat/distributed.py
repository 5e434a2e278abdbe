"""Moved to :mod:`remat.parallel`: rank set-up in :mod:`remat.parallel.ranks`, DDP and
FSDP2 in :mod:`remat.parallel.data_parallel`, collective counts and timings in
:mod:`remat.parallel.gathers`, the allocator-event accounting in
:mod:`remat.measure.allocator_events` (``StepMemory`` is ``EventStepMemory`` there).
These names are re-exported so that old imports keep working."""

from remat.measure.allocator_events import Allocation, account_step
from remat.measure.allocator_events import EventStepMemory as StepMemory
from remat.parallel.data_parallel import (
    STRATEGIES,
    allocated_bytes,
    ddp_bucket_bytes,
    local_bytes,
    plan_rank_memory,
    plan_rank_peak,
    profile_as_run,
    rank_step_memory,
    rank_step_peak,
    shard_stages,
    warm_ddp,
    wrap_ddp,
)
from remat.parallel.gathers import (
    GatherCount,
    count_all_gathers,
    count_reduce_scatters,
    time_all_gather,
    time_unit_gathers,
)
from remat.parallel.ranks import RankInfo, env_rank, init_from_env, shard_batch

__all__ = [
    "STRATEGIES",
    "Allocation",
    "GatherCount",
    "RankInfo",
    "StepMemory",
    "account_step",
    "allocated_bytes",
    "count_all_gathers",
    "count_reduce_scatters",
    "ddp_bucket_bytes",
    "env_rank",
    "init_from_env",
    "local_bytes",
    "plan_rank_memory",
    "plan_rank_peak",
    "profile_as_run",
    "rank_step_memory",
    "rank_step_peak",
    "shard_batch",
    "shard_stages",
    "time_all_gather",
    "time_unit_gathers",
    "warm_ddp",
    "wrap_ddp",
]
