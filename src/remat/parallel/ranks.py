"""This process's rank of a ``torchrun`` job: where it sits, joining the group, its share
of the batch, and what every rank must agree on.

Every kind of parallelism in :mod:`remat.parallel` starts here: :func:`init_from_env`
joins the process group torchrun describes, :func:`shard_batch` gives a data-parallel
rank its part of a global batch, and :func:`rank_zeros` hands every rank rank 0's
profile or problem, so that every rank plans the same (ranks that choose different
plans issue different collectives and wait on each other forever).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from remat.core.artifact import JsonArtifact
from remat.core.errors import UsageError

__all__ = ["RankInfo", "env_rank", "init_from_env", "on_every_rank", "rank_zeros",
           "shard_batch"]

A = TypeVar("A", bound=JsonArtifact)


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the job, as torchrun's environment variables say."""

    rank: int
    world_size: int
    local_rank: int


def env_rank() -> RankInfo | None:
    """The rank torchrun (or any launcher setting ``RANK`` and ``WORLD_SIZE``) gave us."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    except ValueError:
        raise UsageError(
            f"RANK={os.environ['RANK']!r} or WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not "
            "a whole number; launch with torchrun, which sets them"
        ) from None
    return RankInfo(rank, world, local)


def init_from_env(backend: str | None = None) -> RankInfo:
    """Join the process group torchrun describes (gloo on CPU, nccl with CUDA), once."""
    import torch.distributed as dist

    info = env_rank()
    if info is None:
        raise UsageError(
            "RANK and WORLD_SIZE are not set, so there is no process group to join; launch "
            "with torchrun --nproc-per-node N (see docs/distributed.md)"
        )
    if not dist.is_available():
        raise UsageError("this torch build has no torch.distributed; install one that does")
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(info.local_rank)
        dist.init_process_group(backend)
    return info


def shard_batch(batch: Any, rank: int, world_size: int) -> Any:
    """This rank's share of a global batch: every tensor split along dim 0 into equal parts.

    Tuples, lists and dicts keep their shape; anything that is not a tensor is kept as is.
    """
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0 or batch.shape[0] % world_size:
            raise UsageError(
                f"a batch tensor of shape {tuple(batch.shape)} does not split into "
                f"{world_size} equal parts along dim 0; use a batch size divisible by it"
            )
        return batch.chunk(world_size)[rank]
    if isinstance(batch, tuple):
        return tuple(shard_batch(b, rank, world_size) for b in batch)
    if isinstance(batch, list):
        return [shard_batch(b, rank, world_size) for b in batch]
    if isinstance(batch, dict):
        return {k: shard_batch(v, rank, world_size) for k, v in batch.items()}
    return batch


def rank_zeros(artifact: A) -> A:
    """Rank 0's ``artifact`` (a profile, a problem) on every rank: the ranks must choose
    the same plans, or their FSDP units, and so their collectives, would differ."""
    import torch.distributed as dist

    shared: list[Any] = [artifact.to_json()]
    dist.broadcast_object_list(shared, src=0)
    return type(artifact).from_json(shared[0])


def on_every_rank(flag: bool, cuda: bool = False) -> bool:
    """``flag`` and the same on every rank of the default group (just ``flag`` without one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    votes = torch.tensor([int(flag)], device="cuda" if cuda else "cpu")
    dist.all_reduce(votes, op=dist.ReduceOp.MIN)
    return bool(votes.item())
