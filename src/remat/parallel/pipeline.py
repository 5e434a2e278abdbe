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
remat.runtime.rebuild_once); :mod:`remat.core.zero_bubble` predicts and plans them from
the schedule's own order (:func:`schedule_orders`, with :func:`split_stage` per stage).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.core.errors import UsageError
from remat.core.pipeline import SINGLE_STAGE, ZERO_BUBBLE, ScheduleBuffers, check_schedule
from remat.core.plan_format import Plan
from remat.core.profile_format import Profile
from remat.core.solve.problem import Problem
from remat.core.zero_bubble import KINDS, SplitFigures
from remat.measure.tracker import LiveMemoryTracker, iter_tensors, storage_key

__all__ = ["apply_to_stage", "dropped_checkpoints", "part_loss", "profile_part",
           "rank_step_peak", "receive_buffers", "schedule_buffers", "schedule_orders",
           "split_figures", "split_stage"]


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
                     microbatches: int, first: bool, last: bool,
                     prev_on_rank: bool = False, next_on_rank: bool = False
                     ) -> ScheduleBuffers:
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
    # - on the others, tensors of the output's size the profile does not count, found by
    #   per-op traces (2 ranks, 8 micro-batches, each op's peak against the walk's) and
    #   not identified (received output gradients held on are one candidate): under
    #   1F1B one from the end of the first backward on (rank 0: first backward within
    #   32 bytes, every later op 32,752 bytes over, forwards and backwards alike); under
    #   GPipe one more after each backward, to the step's end (rank 0: backward k
    #   32,776 x (k - 1) bytes over with one counted, with no plan, per-block regions or
    #   one region over the part); and under 1F1B after the first rank, one input
    #   gradient from the end of the first backward on (the last of 2 ranks: every later
    #   backward 32,768 bytes over beside what follows);
    # - under GPipe, after the first rank, each input gradient stays to the step's end
    #   (the backward sends are waited for after the last backward; 1F1B waits for each);
    # - under interleaved 1F1B (torch's _PipelineScheduleRuntime) every send is waited
    #   for at the step's end: each sent output (before the last stage) and each sent
    #   input gradient (after the first) stays to the step's end.
    #   torch's zero-bubble schedules run on that runtime too: they keep the same, but
    #   for a neighbour on the same rank (the V-shaped ones: ``prev_on_rank``,
    #   ``next_on_rank``), to which nothing is sent: the output goes to the next stage's
    #   receive buffer as it is, the input gradient to the previous stage's.
    if schedule in ZERO_BUBBLE:
        schedule = "interleaved-1f1b"
    check_schedule(schedule, microbatches=microbatches,
                   chunks=1 if schedule in SINGLE_STAGE else 2)
    output = _bytes(_forward(part, microbatch))
    received = 0 if first else _bytes(microbatch)
    post = (profile.fixed.post_chain_forward_bytes or 0) if last else 0
    return ScheduleBuffers(
        output_bytes=(output if last or (schedule == "interleaved-1f1b" and not next_on_rank)
                      else 0),
        input_grad_bytes=(received if schedule == "gpipe" or (
            schedule == "interleaved-1f1b" and not prev_on_rank) else 0),
        persistent_bytes=(microbatches - 1) * received + (0 if last else microbatches * output),
        held_bytes=post - received,
        after_first_backward_bytes=((0 if last else output) + received
                                    if schedule == "1f1b" else 0),
        after_backward_bytes=output if schedule == "gpipe" and not last else 0,
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


def schedule_orders(schedule: Any) -> dict[int, list[tuple[str, int, int]]]:
    """Every rank's compute ops in the order a built torch schedule runs them, as
    ``(kind, stage, micro-batch)`` with kind ``F``, ``I``, ``W`` or ``B``
    (:mod:`remat.core.zero_bubble`): read off its ``pipeline_order``; an op that overlaps
    a forward and a backward (``ScheduleDualPipeV``) counts as the two in turn."""
    table = getattr(schedule, "pipeline_order", None)
    if not isinstance(table, dict):
        raise UsageError(f"{type(schedule).__name__} has no pipeline_order to read; give a "
                         "schedule from torch.distributed.pipelining with several stages "
                         "per rank")
    orders: dict[int, list[tuple[str, int, int]]] = {}

    def add(rank: int, action: Any) -> None:
        subs = getattr(action, "sub_actions", None)
        if subs:
            for sub in subs:
                add(rank, sub)
            return
        kind = str(getattr(action.computation_type, "value", action.computation_type))
        if kind in KINDS and action.microbatch_index is not None:
            orders[rank].append((kind, int(action.stage_index), int(action.microbatch_index)))

    for rank, actions in sorted(table.items()):
        orders[int(rank)] = []
        for action in actions:
            if action is not None:
                add(int(rank), action)
    return orders


def split_figures(part: nn.Module, microbatch: Any, *, last: bool,
                  loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                  target: Any = None, rounds: int = 5) -> SplitFigures:
    """``part``'s backward as torch's zero-bubble schedules run it, an input pass and then
    the weight passes (torch's own ``stage_backward_input`` and ``stage_backward_weight``),
    for two micro-batches in turn without a plan, under the live-storage tracker, then
    ``rounds`` more timed (:class:`remat.core.zero_bubble.SplitFigures`; Note [A backward
    in passes, on paper]).
    ``microbatch`` as for :func:`profile_part`: it must require grad, as a receive buffer
    does (the first rank's input pass is empty and needs no figures)."""
    # torch's own two functions, so that the graph is kept and freed exactly as the
    # schedules keep and free it
    from torch.distributed.pipelining._backward import (
        stage_backward_input,
        stage_backward_weight,
    )

    _check_split(part, microbatch, last, loss_fn, target)
    passes = _SplitPasses(part, microbatch, last, loss_fn, target, list(part.parameters()),
                          stage_backward_input, stage_backward_weight)
    part.zero_grad(set_to_none=True)
    gc.collect()
    base, first, later = _tracked_passes(passes)
    _, input_peak, held, weight_peak, _ = first
    later_weight_peak = later[3]
    t_input, t_weight = _timed_passes(passes, rounds)
    return SplitFigures(
        input_peak_bytes=max(0, input_peak - base),
        held_bytes=max(0, held - base),
        weight_peak_bytes=max(0, weight_peak - base),
        later_weight_peak_bytes=max(0, later_weight_peak - base),
        weight_share=t_weight / (t_input + t_weight) if t_input + t_weight > 0 else 0.5,
        input_s=t_input,
        weight_s=t_weight,
    )


def _check_split(part: nn.Module, microbatch: Any, last: bool,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None, target: Any) -> None:
    """split_figures's arguments, checked."""
    from remat.runtime.install import applied

    if applied(part):
        raise UsageError("split_figures measures the part without a plan; remove it first "
                         "(remat.remove)")
    if not isinstance(microbatch, torch.Tensor) or not microbatch.requires_grad:
        raise UsageError("split_figures needs the micro-batch a later rank receives, a "
                         "tensor that requires grad; the first rank runs no input pass")
    if last and (loss_fn is None or target is None):
        raise UsageError("the last pipeline rank's passes start from its real loss; give "
                         "loss_fn=(output, target) -> loss and the micro-batch's target")


@dataclass(frozen=True)
class _SplitPasses:
    """One micro-batch's forward through ``part``, then its backward in torch's two passes
    (``input_pass``: ``stage_backward_input``, ``weight_pass``: ``stage_backward_weight``)."""

    part: nn.Module
    microbatch: torch.Tensor
    last: bool
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    target: Any
    params: list[torch.Tensor]
    input_pass: Callable[..., Any]
    weight_pass: Callable[..., Any]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor],
                                                list[torch.Tensor] | None]:
        out = self.part(x)
        if self.last:
            assert self.loss_fn is not None
            return out, [self.loss_fn(out, self.target)], None
        return out, [out], [torch.ones_like(out)]

    def run(self, tracker: LiveMemoryTracker | None, marks: list[int]) -> tuple[float, float]:
        """The passes' seconds (input, weight); with ``tracker``, ``marks`` gets the live
        bytes before the input pass, its peak and the live bytes after, then the weight
        pass's peak and the live bytes after it."""
        x = self.microbatch.detach().requires_grad_(True)
        # the stage keeps its output until the input pass (the last one's for the merged
        # output, counted after it as a schedule buffer): so does this
        out, outputs, grads = self.forward(x)
        if tracker is not None:
            marks.append(tracker.live_bytes)
            tracker.reset_peak()
        t0 = time.perf_counter()
        _, groups = self.input_pass(outputs, grads, [x], iter(self.params))
        t1 = time.perf_counter()
        del out, outputs, grads
        if tracker is not None:
            marks += [tracker.peak_bytes, tracker.live_bytes]
            tracker.reset_peak()
        t2 = time.perf_counter()
        self.weight_pass(iter(self.params), groups)
        t3 = time.perf_counter()
        del groups
        if tracker is not None:
            marks += [tracker.peak_bytes, tracker.live_bytes]
        return t1 - t0, t3 - t2


def _tracked_passes(passes: _SplitPasses) -> tuple[int, list[int], list[int]]:
    """The live bytes before, and the marks of two runs under the live-storage tracker:
    the first with no gradients yet, the second with the gradients there from the start."""
    tracker = LiveMemoryTracker()
    tracker.register_existing(passes.part)
    target, microbatch = passes.target, passes.microbatch
    tracker.register_existing([microbatch, target] if target is not None else [microbatch])
    first: list[int] = []
    later: list[int] = []
    with tracker:
        base = tracker.live_bytes
        passes.run(tracker, first)  # no gradients yet
        passes.run(tracker, later)  # the gradients there from the start
    return base, first, later


def _timed_passes(passes: _SplitPasses, rounds: int) -> tuple[float, float]:
    """The median seconds of the input and the weight pass over ``rounds`` untracked runs
    (at least one); the part's gradients are cleared after."""
    inputs, weights = [], []
    for _ in range(max(1, rounds)):
        t_input, t_weight = passes.run(None, [])
        inputs.append(t_input)
        weights.append(t_weight)
    passes.part.zero_grad(set_to_none=True)
    return statistics.median(inputs), statistics.median(weights)


def split_stage(part: nn.Module, microbatch: Any, *, schedule: str, microbatches: int,
                first: bool, last: bool, prev_on_rank: bool = False,
                next_on_rank: bool = False,
                loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                target: Any = None, stages: Sequence[str] | None = None,
                repeats: int = 2) -> tuple[Problem, ScheduleBuffers, SplitFigures]:
    """What :mod:`remat.core.zero_bubble` needs of one pipeline stage, before its
    ``PipelineStage`` is built: its problem (:func:`profile_part`), what the schedule keeps
    for it (:func:`schedule_buffers`) and its two passes (:func:`split_figures`; zeros on
    the first stage, whose input pass is empty). ``prev_on_rank`` / ``next_on_rank``: its
    neighbour stages run on this rank (the V-shaped schedules)."""
    from remat.core.planner import to_problem

    profile = profile_part(part, microbatch, last=last, loss_fn=loss_fn, target=target,
                           stages=stages, repeats=repeats)
    buffers = schedule_buffers(profile, part, microbatch, schedule=schedule,
                               microbatches=microbatches, first=first, last=last,
                               prev_on_rank=prev_on_rank, next_on_rank=next_on_rank)
    split = (SplitFigures(0, 0, 0, 0) if first else
             split_figures(part, microbatch, last=last, loss_fn=loss_fn, target=target))
    return to_problem(profile), buffers, split
