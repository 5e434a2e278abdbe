"""remat with 🤗 accelerate: plan and apply **before** ``accelerator.prepare``.

::

    accelerator = Accelerator()
    done = remat.integrations.accelerate_prepare.auto_checkpoint_before_prepare(
        accelerator, model, "60%", batch=next(iter(loader)), loss_fn=loss_fn)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

Why before (Note [Before prepare]): ``prepare`` wraps the model (DDP on several
processes; FSDP2's ``fully_shard`` with its plugin) and puts an autocast wrapper on its
``forward`` under mixed precision. ``remat.auto_checkpoint`` profiles by running whole
training steps; on a DDP-wrapped model each of those steps all-reduces, and the
profile's step count depends on timing noise, so ranks that profile on their own can
wait on each other's collectives. Before ``prepare`` the model is a plain module on each
rank: the main process profiles and plans once (one process writing the plan cache), the
plan is broadcast, and every rank applies the same plan. remat's stage hooks sit on the
blocks, below DDP, FSDP2 and the autocast wrapper, so ``prepare`` wraps a planned model
as it wraps any other (``docs/distributed.md``: ``remat.apply`` before ``fully_shard``).

The plan is made for one process's whole training step at the batch given (the
per-device batch the loader yields): under DDP a rank also holds DDP's gradient buckets
(one more copy of the gradients, unless ``gradient_as_bucket_view=True``), which the
single-process budget does not count; give the budget with that room, or plan a
per-rank problem (``docs/distributed.md``, "Per-rank budgets").
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from remat.core.errors import UsageError
from remat.core.plan_format import Plan
from remat.in_script.script_entry import AutoCheckpoint, AutoCheckpointReport, auto_checkpoint
from remat.runtime.install import apply

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["auto_checkpoint_before_prepare"]


def _prepared(accelerator: Accelerator, model: nn.Module) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    if getattr(model, "_is_accelerate_prepared", False):
        return True
    if isinstance(model, DistributedDataParallel):
        return True
    if type(model).__name__.startswith("FSDP") or hasattr(model, "_get_fsdp_state"):
        return True  # fully_shard's FSDPModule: the class FSDP2 makes for the model
    return any(m is model for m in getattr(accelerator, "_models", ()))


def auto_checkpoint_before_prepare(
    accelerator: Accelerator,
    model: nn.Module,
    budget: str | int | float,
    *,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
    optimizer: str = "adamw",
    stages: list[str] | tuple[str, ...] | None = None,
    cache: str | os.PathLike[str] | bool | None = None,
    repeats: int = 2,
) -> AutoCheckpoint:
    """:func:`remat.auto_checkpoint` for a model that ``accelerator.prepare`` will wrap next.

    The main process profiles ``model`` on ``batch`` (one process's batch, on the
    device it trains on), plans under ``budget`` and applies the plan; on several
    processes the plan is broadcast and every rank applies the same one (its report's
    ``source`` is ``"main process"``). Arguments as :func:`remat.auto_checkpoint`.
    Raises ``UsageError`` when the model was already prepared, or when the FSDP plugin
    checkpoints activations itself (``activation_checkpointing=True``).
    """
    if _prepared(accelerator, model):
        raise UsageError("the model was already given to accelerator.prepare; call "
                         "auto_checkpoint_before_prepare on the plain model first, then "
                         "prepare it")
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is not None and getattr(plugin, "activation_checkpointing", False):
        raise UsageError("the FSDP plugin has activation_checkpointing=True, which would "
                         "checkpoint every block on top of remat's plan; set it to False "
                         "and let remat's plan checkpoint")
    if accelerator.num_processes == 1:
        return auto_checkpoint(model, budget, batch=batch, loss_fn=loss_fn,
                               optimizer=optimizer, stages=stages, cache=cache,
                               repeats=repeats)
    # DDP (what prepare wraps with on several processes, FSDP2's plugin included on a
    # CPU) holds its gradient buckets beside the gradients, which one process's profile
    # does not see: the plan leaves one copy of the gradients free for them
    reserve = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    from accelerate.utils import broadcast_object_list

    done: AutoCheckpoint | None = None
    message: list[Any] = [None]
    if accelerator.is_main_process:
        try:
            done = auto_checkpoint(model, budget, batch=batch, loss_fn=loss_fn,
                                   optimizer=optimizer, stages=stages, cache=cache,
                                   repeats=repeats, reserve_bytes=reserve)
            message = [("plan", done.plan.to_dict(), done.report)]
        except Exception as err:  # every rank raises, none waits on a broadcast
            message = [("error", f"{type(err).__name__}: {err}", None)]
            broadcast_object_list(message)
            raise
    broadcast_object_list(message)
    kind, payload, report = message[0]
    if kind == "error":
        raise UsageError(f"remat could not plan on the main process ({payload}); fix "
                         "that error, which the main process raised in full")
    if done is not None:
        return done
    plan = Plan.from_dict(payload)
    handle = apply(model, plan)
    assert isinstance(report, AutoCheckpointReport)
    return AutoCheckpoint(handle, plan, AutoCheckpointReport(
        source="main process", why=None, budget_bytes=report.budget_bytes,
        predicted_peak_bytes=report.predicted_peak_bytes,
        predicted_overhead=report.predicted_overhead, regions=report.regions,
        seconds=report.seconds, cache_path=None, reserve_bytes=report.reserve_bytes))
