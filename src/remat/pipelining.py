"""remat on ``torch.distributed.pipelining`` stages: profile a rank's part, predict its
peak with the schedule's micro-batches in flight, apply its plan.

Each pipeline rank runs its own part of the model (a ``PipelineStage``'s ``submod``
from a manual split). Its profile is the part's one-micro-batch training step: the last
rank's with the real loss, an earlier rank's with a stand-in loss ``(output * g).sum()``,
``g`` ones of the output's shape (its backward receives a gradient of that shape, as the
stage does from the next rank). The per-rank problems then go to
:func:`remat.core.pipeline.pipeline_step` (peaks per rank under the schedule, with
:func:`schedule_buffers`: what torch's stage keeps per micro-batch) and
:func:`remat.core.pipeline.plan_pipeline`. A plan is applied to the part with
:func:`apply_to_stage` before or after the ``PipelineStage`` is built: the stage calls
the part's forward and runs its backward through autograd, where the checkpoints rebuild.

Measured on gloo (gpt split over 2 and 4 processes, 4 and 8 micro-batches, GPipe and
1F1B; ``benchmarks/pipeline_ranks.md``): every rank's peak within 3.5% of the
prediction. ``pipeline()``'s export traces through checkpoint calls written in the
model and drops them; :func:`dropped_checkpoints` names the stages that lost theirs,
and a remat plan applies to the exported stage module (same module paths) instead.
Under interleaved 1F1B a rank holds several stages (chunks): each is profiled, given its
buffers and its plan as its own part, and the core walks a rank's chunks together
(``chunks=`` in :mod:`remat.core.pipeline`). Under the zero-bubble schedules, whose
backward runs as an input pass and weight passes, apply plans with
``split_backward=True`` (Note [One rebuild for a backward in passes] in
remat.runtime.rebuild_once); the core does not plan for those schedules yet.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from remat.core.errors import UsageError
from remat.core.pipeline import SINGLE_STAGE, ScheduleBuffers, check_schedule
from remat.core.plan_format import Plan
from remat.core.profile_format import Profile
from remat.measure.tracker import LiveMemoryTracker, iter_tensors, storage_key

__all__ = ["apply_to_stage", "dropped_checkpoints", "part_loss", "profile_part",
           "rank_step_peak", "receive_buffers", "schedule_buffers"]


def _bytes(value: Any) -> int:
    seen: dict[tuple[str, int], int] = {}
    for t in iter_tensors(value):
        key = storage_key(t)
        if key is not None:
            seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _forward(part: nn.Module, microbatch: Any) -> Any:
    """``part(microbatch)`` without grad, under the fake mode its parameters belong to
    (a part built under ``remat.fake_mode()`` makes new tensors, positions say, there)."""
    from torch._subclasses.fake_tensor import FakeTensor

    mode = next((p.fake_mode for p in part.parameters() if isinstance(p, FakeTensor)), None)
    with torch.no_grad(), mode if mode is not None else contextlib.nullcontext():
        return part(microbatch)


def part_loss(part: nn.Module, microbatch: Any, *, last: bool,
              loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
              target: Any = None) -> Callable[[nn.Module, Any], torch.Tensor]:
    """The loss a rank's part is profiled with (module docstring): the last rank's
    ``loss_fn(output, target)``, an earlier rank's ``(output * ones).sum()``."""
    if last:
        if loss_fn is None or target is None:
            raise UsageError("the last pipeline rank is profiled with its real loss; give "
                             "loss_fn=(output, target) -> loss and the micro-batch's target")
        return lambda model, batch: loss_fn(model(batch), target)
    out = _forward(part, microbatch)
    if not isinstance(out, torch.Tensor):
        raise UsageError(f"the part returned {type(out).__name__}; remat profiles pipeline "
                         "parts that return one tensor")
    g = torch.ones_like(out)  # its values do not matter; fake where the part is fake
    return lambda model, batch: (model(batch) * g).sum()


def profile_part(part: nn.Module, microbatch: Any, *, last: bool,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                 target: Any = None, stages: Sequence[str] | None = None,
                 optimizer: str = "adamw", repeats: int = 2, **options: Any) -> Profile:
    """This rank's profile: ``part``'s one-micro-batch step (module docstring).
    ``microbatch``: what the stage receives (a non-first rank's should require grad,
    as the stage's receive buffer does). ``options`` go to ``remat.profile`` (``fake``,
    ``device``: a part built under ``remat.fake_mode()`` is profiled without its
    weights, for a device this machine does not have)."""
    from remat.profiling.profiler import profile

    lf = part_loss(part, microbatch, last=last, loss_fn=loss_fn, target=target)
    return profile(part, microbatch, lf, stages=stages, optimizer=optimizer, repeats=repeats,
                   **options)


def schedule_buffers(profile: Profile, part: nn.Module, microbatch: Any, *, schedule: str,
                     microbatches: int, first: bool, last: bool) -> ScheduleBuffers:
    """What torch's ``PipelineStage`` keeps on this rank beyond ``profile``'s
    one-micro-batch step (:class:`remat.core.pipeline.ScheduleBuffers`, Note [What a
    pipeline stage keeps]). ``profile``: this rank's :func:`profile_part`."""
    # Note [What a pipeline stage keeps] (torch 2.13, measured on gloo with timelines):
    # - receive buffers, allocated before the first step and kept: an input per
    #   micro-batch after the first rank (the profile counts one as its batch), an output
    #   gradient per micro-batch before the last;
    # - a micro-batch in flight keeps what its plan keeps (``Simulation.kept_bytes``),
    #   less its input on a rank after the first (that is a receive buffer), plus, on the
    #   last rank, what the post-chain (head and loss) holds for its backward: the
    #   profile's post-chain forward bytes (gpt: the head's saved input, the logits, the
    #   loss's log-softmax);
    # - on the last rank every micro-batch's output stays to the step's end
    #   (``output_chunks``, for the merged output);
    # - under GPipe, after the first rank, each input gradient stays to the step's end
    #   (the backward sends are waited for after the last backward; 1F1B waits for each);
    # - under interleaved 1F1B (torch's _PipelineScheduleRuntime) every send is waited
    #   for at the step's end: each sent output (before the last stage) and each sent
    #   input gradient (after the first) stays to the step's end.
    check_schedule(schedule, microbatches=microbatches,
                   chunks=1 if schedule in SINGLE_STAGE else 2)
    output = _bytes(_forward(part, microbatch))
    received = 0 if first else _bytes(microbatch)
    post = (profile.fixed.post_chain_forward_bytes or 0) if last else 0
    return ScheduleBuffers(
        output_bytes=output if last or schedule == "interleaved-1f1b" else 0,
        input_grad_bytes=received if schedule in ("gpipe", "interleaved-1f1b") else 0,
        persistent_bytes=(microbatches - 1) * received + (0 if last else microbatches * output),
        held_bytes=post - received,
    )


def receive_buffers(stage: Any) -> list[torch.Tensor]:
    """The stage's receive buffers (inputs and output gradients, one per micro-batch),
    allocated at its first step; register them with the live-storage tracker to measure
    a step as the rank holds it."""
    found = []
    for table in (getattr(stage, "args_recv_info", {}), getattr(stage, "grad_recv_info", {})):
        for infos in table.values():
            for info in infos:
                buffer = getattr(info, "buffer", None)
                if isinstance(buffer, torch.Tensor):
                    found.append(buffer)
    return found


def rank_step_peak(step: Callable[[], Any], parts: Sequence[nn.Module], stages: Sequence[Any],
                   *, held: Sequence[torch.Tensor] = (), optimizer: Any = None
                   ) -> tuple[int, Any]:
    """One pipeline step of a rank as the rank holds it: the parts' gradients cleared, then
    ``step()`` under the live-storage tracker with the parts, the optimizer's state, the
    ``held`` tensors (the rank's batch) and the stages' receive buffers (allocated at the
    first step: run one before) counted as there from the start. Returns the step's peak
    and what ``step()`` returned."""
    for part in parts:
        part.zero_grad(set_to_none=True)
    gc.collect()
    tracker = LiveMemoryTracker()
    for part in parts:
        tracker.register_existing(part)
    if optimizer is not None:
        tracker.register_existing(optimizer)
    tracker.register_existing(list(held))
    for stage in stages:
        tracker.register_existing(receive_buffers(stage))
    with tracker:
        result = step()
    return tracker.peak_bytes, result


def dropped_checkpoints(model: nn.Module, batch: Any,
                        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                        stage_module: nn.Module, stages: Sequence[str]) -> list[str]:
    """The ``stages`` (module paths) that ``model`` checkpoints itself and that
    ``stage_module`` (``pipe.get_stage_module(i)`` or a built stage's ``submod``) holds
    without a checkpoint: ``pipeline()``'s export traces through a
    ``torch.utils.checkpoint`` call written in the model and keeps the plain ops, so the
    stage keeps every activation the model meant to rebuild.

    The model's own checkpointing is found by watching one eager training step of
    ``loss_fn(model, batch)`` (:func:`remat.runtime.existing.recomputed_stages`: modules
    that run again during backward); the stage module's graphs are searched for a
    checkpoint. Empty when nothing was dropped. Apply a remat plan to the stage module
    instead (:func:`apply_to_stage`): its stages are the same paths.
    """
    from remat.runtime.existing import recomputed_stages

    present = [name for name in stages if _has_module(stage_module, name)]
    if not present:
        return []
    own = recomputed_stages(model, batch, loss_fn, present)
    if not own or _graphs_checkpoint(stage_module):
        return []
    return own


def _has_module(root: nn.Module, path: str) -> bool:
    try:
        root.get_submodule(path)
    except AttributeError:
        return False
    return True


def _graphs_checkpoint(root: nn.Module) -> bool:
    """Whether a traced graph under ``root`` still calls a checkpoint."""
    for module in root.modules():
        graph = getattr(module, "graph", None)
        nodes = getattr(graph, "nodes", ())
        if any("checkpoint" in str(node.target).lower() for node in nodes):
            return True
    return False


def apply_to_stage(stage: Any, plan: Plan, **options: Any) -> Any:
    """``remat.apply`` on a ``PipelineStage``'s part (or on the part itself); returns the
    handle. The plan's stages are module paths inside the part; ``options`` go to
    ``remat.apply`` (``split_backward=True`` under a zero-bubble schedule)."""
    from remat.runtime.install import apply

    part = getattr(stage, "submod", stage)
    if not isinstance(part, nn.Module):
        raise UsageError(f"expected a PipelineStage or its module, got {type(stage).__name__}")
    return apply(part, plan, **options)
