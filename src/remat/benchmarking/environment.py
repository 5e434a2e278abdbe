"""What explains a report's figures: versions, device, threads, allocator, dtype, attention."""

from __future__ import annotations

import os
import platform
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from remat.measure.modes import EagerDispatchMode
from remat.runtime.policies import ATTENTION_OPS

from .runners import LossFn

__all__ = ["Environment", "attention_backend", "describe_environment"]


@dataclass(frozen=True)
class Environment:
    remat_version: str
    torch_version: str
    python_version: str
    platform: str
    device: str
    cpu_count: int | None
    threads: int
    interop_threads: int
    dtype: str
    attention_backend: str
    # Under torchrun with --distributed: this process's rank, the world size, ddp or fsdp.
    rank: int | None = None
    world_size: int | None = None
    distributed: str | None = None
    malloc: str = "system allocator"  # what the C allocator does with freed memory

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _OpNames(EagerDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def attention_backend(model: nn.Module, batch: Any, loss_fn: LossFn) -> str:
    """Which attention kernel one training forward really runs, judged by the ops it ran.

    On CPU with dropout, ``scaled_dot_product_attention`` runs as separate ops (bmm,
    softmax, dropout), which is why selective policies are judged by what they save.
    """
    fused = {op.overloadpacket.__name__ for op in ATTENTION_OPS}
    mode = _OpNames()
    devices = [p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"][:1]
    with torch.random.fork_rng(devices=devices), mode:
        loss_fn(model, batch)
    ran = sorted(name for name in mode.seen if name in fused)
    if ran:
        return "fused: " + ", ".join(f"aten.{name}" for name in ran)
    softmax = any(mode.seen[n] for n in ("_softmax", "softmax", "_safe_softmax"))
    if mode.seen["bmm"] and softmax:
        dropout = mode.seen["native_dropout"] or mode.seen["bernoulli_"]
        parts = ["bmm", "softmax"] + (["dropout"] if dropout else [])
        return "math: separate " + ", ".join(parts) + " ops (no fused attention kernel ran)"
    return "none: no attention op ran"


def describe_environment(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    *,
    dtype: str,
    device: str,
    rank: int | None = None,
    world_size: int | None = None,
    distributed: str | None = None,
    malloc: str = "system allocator",
) -> Environment:
    from remat.core import __version__

    return Environment(
        remat_version=__version__,
        torch_version=str(torch.__version__),
        python_version=sys.version.split()[0],
        platform=platform.platform(),
        device=device,
        cpu_count=os.cpu_count(),
        threads=torch.get_num_threads(),
        interop_threads=torch.get_num_interop_threads(),
        dtype=dtype,
        attention_backend=attention_backend(model, batch, loss_fn),
        rank=rank,
        world_size=world_size,
        distributed=distributed,
        malloc=malloc,
    )
