"""``remat.auto_checkpoint``: one call in the user's own training script.

It profiles the model on the batch, plans the fastest schedule under the budget, applies
it and returns a handle whose ``report`` says what it did; the model's weights, buffers,
gradients and flags are as they were (``remat.profile`` puts them back). The plan is kept
on disk (Note [The plan cache] in :mod:`.plan_cache`), so the next launch of the same
script applies it without profiling, unless the model, the batch's shapes, the device or
torch changed, which it says.

Given one ``batch``, it plans for that batch's shape. Given ``shapes=`` (a range) or
``batches=`` (a few real batches of different shapes), it profiles the range and applies
a plan set: each forward runs the plan of its batch's shape, every shape of the range
predicted within the budget (Note [Plan sets] in remat.core.plan_set; docs/shapes.md).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat.core import __version__
from remat.core.errors import UsageError
from remat.core.model_identity import digest
from remat.core.plan_format import Plan
from remat.core.plan_set import OUTSIDE, PlanSet, plan_set
from remat.core.planner import plan as make_plan
from remat.core.profile_format import OPTIMIZERS, Profile
from remat.core.shapes import ShapeRange, parse_shapes
from remat.core.solve.budget import Budget
from remat.core.solve.from_profile import problem_from_profile
from remat.core.units import format_bytes
from remat.in_script.plan_cache import (
    CacheEntry,
    cache_folder,
    changed_fields,
    load_entry,
    save_entry,
    slot_path,
)
from remat.measure.malloc import MALLOC_MODES, set_malloc
from remat.measure.model_state import check_batch, refuse_meta
from remat.profiling.profiler import profile
from remat.profiling.shaped import infer_shapes, profile_shapes
from remat.runtime.batch_shape import tensors_of
from remat.runtime.identity import stage_identity
from remat.runtime.install import Handle, apply, check_free

__all__ = ["AutoCheckpoint", "AutoCheckpointReport", "auto_checkpoint", "model_loss"]

LossFn = Callable[[nn.Module, Any], Any]


@dataclass(frozen=True)
class AutoCheckpointReport:
    """What ``auto_checkpoint`` did: where the plan came from and what it predicts."""

    source: str  # "profiled" or "cache"
    why: str | None  # why it profiled (no plan cached, what changed); None from the cache
    budget_bytes: int | None
    predicted_peak_bytes: int | None  # a plan set's: the most any of its shapes reaches
    predicted_overhead: float | None  # step time over the step without checkpointing
    regions: tuple[str, ...]  # a plan set's: those of the plan for its largest shape
    seconds: float
    cache_path: Path | None
    buckets: tuple[str, ...] = ()  # a plan set: one line per plan, the shapes it runs
    reserve_bytes: int = 0  # left free under the budget (auto_checkpoint's reserve_bytes)
    # a plan set: how many plans, and its largest shape (where regions and overhead are)
    plans: int = 0
    largest: str | None = None
    allocator: str | None = None  # on CPU: what the C allocator does with freed memory

    def __str__(self) -> str:
        where = ("from the plan cache" if self.source == "cache"
                 else f"profiled and planned ({self.why})")
        regions = " ".join(self.regions) or "none"
        what = f"plan set of {self.plans} plans" if self.plans else "plan"
        at = f" at its largest shape ({self.largest})" if self.largest else ""
        parts = [f"remat: {what} {where}, applied in {self.seconds:.2f} s; regions{at} "
                 f"{regions}"]
        if self.predicted_peak_bytes is not None and self.budget_bytes is not None:
            parts.append(f"predicted peak {format_bytes(self.predicted_peak_bytes)} of a "
                         f"{format_bytes(self.budget_bytes)} budget"
                         + (" (the most any shape reaches)" if self.plans else "")
                         + (f" ({format_bytes(self.reserve_bytes)} of it kept free)"
                            if self.reserve_bytes else ""))
        if self.predicted_overhead is not None:
            parts.append(f"predicted step time {self.predicted_overhead:+.1%}"
                         + (" there" if self.largest else ""))
        if self.allocator is not None and self.allocator.startswith("glibc"):
            parts.append(f"C allocator: {self.allocator}")  # what remat changed
        return "; ".join(parts) + "".join(f"\n  {line}" for line in self.buckets)


@dataclass(eq=False)
class AutoCheckpoint:
    """The plan ``auto_checkpoint`` applied: ``remove()`` undoes it (as
    ``remat.remove(model)``), ``report`` says what was done."""

    handle: Handle
    plan: Plan | PlanSet
    report: AutoCheckpointReport

    @property
    def active(self) -> bool:
        return self.handle.active

    def remove(self) -> None:
        self.handle.remove()

    def __repr__(self) -> str:
        return f"AutoCheckpoint({self.report})"


def model_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """``model(**batch).loss``: the loss a transformers model (or ``Trainer.compute_loss``
    by default) trains on."""
    if not isinstance(batch, Mapping):
        raise UsageError(f"the example batch is a {type(batch).__name__}, not a mapping of "
                         "the model's keyword arguments; pass loss_fn(model, batch)")
    out = model(**batch)
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if loss is None:
        raise UsageError("the model returned no loss for the example batch; put 'labels' in "
                         "the batch (the data collator usually does) or pass "
                         "loss_fn(model, batch)")
    return loss


def _loss_for(model: nn.Module, batch: Any, loss_fn: LossFn | None) -> LossFn | None:
    """``loss_fn``; for a transformers model fed a mapping, ``model(**batch).loss``; else
    None (the profile's default: the model's output, reduced)."""
    if loss_fn is not None:
        if not callable(loss_fn):
            raise UsageError(f"loss_fn is a {type(loss_fn).__name__}; pass a function "
                             "loss_fn(model, batch) that returns the scalar loss")
        return loss_fn
    if type(model).__module__.startswith("transformers.") and isinstance(batch, Mapping):
        return model_loss
    return None


def _fields(model: nn.Module, batch: Any, optimizer: str, dims: ShapeRange | None
            ) -> dict[str, Any]:
    """What a cached plan depends on (Note [The plan cache])."""
    first = next(model.parameters(), None)
    return {
        "parameters": stage_identity(model).fingerprint,
        "trainable": digest([n for n, p in model.named_parameters() if p.requires_grad]),
        "batch": [[list(t.shape) if dims is None else t.dim(),
                   str(t.dtype).removeprefix("torch.")] for t in tensors_of(batch)],
        **({"shapes": str(dims)} if dims is not None else {}),
        "device": str(first.device) if first is not None else "cpu",
        "torch": str(torch.__version__),
        "remat": __version__,
        "optimizer": optimizer,
    }


def auto_checkpoint(
    model: nn.Module,
    budget: Budget | str | int | float,
    *,
    batch: Any = None,
    batches: Sequence[Any] | None = None,
    shapes: str | Mapping[str, Any] | None = None,
    outside: str = "error",
    loss_fn: LossFn | None = None,
    optimizer: str = "adamw",
    stages: list[str] | tuple[str, ...] | None = None,
    cache: str | os.PathLike[str] | bool | None = None,
    repeats: int = 2,
    reserve_bytes: int = 0,
    malloc: str = "keep",
) -> AutoCheckpoint:
    """Profile ``model`` on ``batch``, plan it under ``budget`` and apply the plan.

    ``reserve_bytes``: what the plan leaves free under the budget for memory the step
    holds beyond the profiled one (DDP's gradient buckets: the accelerate integration
    reserves one copy of the gradients); the report keeps the budget given.

    With ``shapes`` (``"batch=1..16,seq=128..2048:8"``) or ``batches`` (a few real batches
    of different shapes; the range they span), it profiles the range and applies a plan
    set instead (docs/shapes.md): every shape of the range is predicted within the budget
    by the plan that runs it, and a batch outside it raises (``outside="error"``) or runs
    the plan of least memory with one warning (``outside="conservative"``). ``batch`` is
    then the example the profiled shapes are made from (default: the first of
    ``batches``), and a fractional budget is of the peak at the range's largest shape.

    ``budget``: the peak of a whole training step, in bytes or a size (``"12GiB"``), or a
    fraction of the measured peak without checkpointing (``"60%"``). ``loss_fn(model,
    batch)`` runs the forward and returns the scalar loss; by default ``model(**batch).loss``
    for a transformers model fed a mapping, else the model's output (reduced).
    ``optimizer``: what the step's optimizer state is measured as (``adamw``,
    ``adamw-fused``, ``sgd``). ``stages``: the chain's module paths (default: discovered).
    ``cache``: a folder for plans, or False for none (default ``REMAT_CACHE``, else
    ``~/.cache/remat/plans``; Note [The plan cache]). ``repeats``: the profile's timed
    rounds. ``malloc``: on CPU, ``"keep"`` lets glibc keep freed memory for the rest of the
    process (as ``remat profile`` and ``remat bench`` do), which steadies the profile's
    timed steps and the training's (``benchmarks/step_order.md``); ``"system"`` leaves the C
    allocator alone (docs/bench.md, "Steady CPU timings"). Raises
    :class:`remat.CheckFailed` (naming the least budget) when no plan fits,
    and ``UsageError`` for bad input, both with the model as it was.
    """
    began = time.perf_counter()
    request = _checked(model, budget, batch=batch, batches=batches, shapes=shapes,
                       outside=outside, loss_fn=loss_fn, optimizer=optimizer, stages=stages,
                       repeats=repeats, reserve_bytes=reserve_bytes)
    fields = _fields(model, request.batch, optimizer, request.dims)
    allocator = _allocator(fields["device"], malloc)
    folder = cache_folder(cache)
    path = None if folder is None else slot_path(folder, request.slot())
    entry = None if path is None else load_entry(path)
    why = "the plan cache is off" if path is None else "no plan cached for this model"
    if entry is not None:
        cached = _apply_cached(model, entry, fields)
        if not isinstance(cached, str):
            return _result(cached[1], cached[0], "cache", None, began, path, reserve_bytes,
                           allocator)
        why = cached
    plan = _planned(request)
    if path is not None:
        save_entry(path, fields, plan)  # before apply: a bad folder changes nothing
    handle = apply(model, plan)
    return _result(handle, plan, "profiled", why, began, path, reserve_bytes, allocator)


def _allocator(device: str, malloc: str) -> str | None:
    """``set_malloc(malloc)`` where the step runs on the CPU (``device``: the cache key's,
    :func:`_fields`); None elsewhere, where the device's own allocator serves the step."""
    if malloc not in MALLOC_MODES:
        raise UsageError(f"malloc={malloc!r} is not one of {', '.join(MALLOC_MODES)}")
    return set_malloc(malloc) if device == "cpu" else None


@dataclass(frozen=True)
class _Request:
    """``auto_checkpoint``'s inputs, checked: what to plan for, and how."""

    model: nn.Module
    batch: Any  # the example batch (with a range: the one its shapes are made from)
    ranged: bool  # shapes= or batches= given: a plan set for the range ``dims``
    dims: ShapeRange | None
    outside: str
    loss: LossFn | None
    optimizer: str
    budget: Budget
    stages: list[str] | tuple[str, ...] | None
    repeats: int
    reserve_bytes: int

    def slot(self) -> dict[str, Any]:
        """What names the request's slot in the plan cache (Note [The plan cache])."""
        return {"model": type(self.model).__name__,
                "stages": None if self.stages is None else list(self.stages),
                "budget": str(self.budget), "optimizer": self.optimizer,
                **({"shapes": "range", "outside": self.outside} if self.ranged else {}),
                **({"reserve": self.reserve_bytes} if self.reserve_bytes else {})}


def _checked(
    model: nn.Module,
    budget: Budget | str | int | float,
    *,
    batch: Any,
    batches: Sequence[Any] | None,
    shapes: str | Mapping[str, Any] | None,
    outside: str,
    loss_fn: LossFn | None,
    optimizer: str,
    stages: list[str] | tuple[str, ...] | None,
    repeats: int,
    reserve_bytes: int,
) -> _Request:
    """``auto_checkpoint``'s arguments checked, each in turn: a UsageError for the first
    that is wrong, before anything is profiled."""
    if not isinstance(model, nn.Module):
        raise UsageError(f"model is a {type(model).__name__}, not a torch.nn.Module")
    check_free(model)
    ranged = shapes is not None or batches is not None
    if outside not in OUTSIDE:
        raise UsageError(f"outside={outside!r} is not one of {', '.join(OUTSIDE)}")
    batch = _example_batch(batch, batches)
    check_batch(batch)
    refuse_meta(model, batch, fake=False)
    dims = None
    if ranged:
        dims = parse_shapes(shapes) if shapes is not None else infer_shapes(batches or ())
    if not isinstance(optimizer, str) or optimizer not in OPTIMIZERS:
        raise UsageError(f"optimizer={optimizer!r} is unknown; use one of "
                         f"{', '.join(OPTIMIZERS)}")
    read = _read_budget(budget)
    if isinstance(reserve_bytes, bool) or not isinstance(reserve_bytes, int) or (
            reserve_bytes < 0):
        raise UsageError(f"reserve_bytes={reserve_bytes!r} must be a whole number of bytes "
                         ">= 0")
    if stages is not None and (isinstance(stages, str) or not all(
            isinstance(s, str) for s in stages)):
        raise UsageError(f"stages={stages!r} is not a list of module paths")
    loss = _loss_for(model, batch, loss_fn)
    return _Request(model, batch, ranged, dims, outside, loss, optimizer, read, stages,
                    repeats, reserve_bytes)


def _example_batch(batch: Any, batches: Sequence[Any] | None) -> Any:
    """``batch``, or the first of ``batches``; UsageError for ``batches`` that are not a
    list of batches, or neither given."""
    if batches is not None and (isinstance(batches, (torch.Tensor, Mapping, str))
                                or not isinstance(batches, Sequence) or not batches):
        raise UsageError("batches must be a list of real batches of different shapes")
    if batch is None:
        if not batches:
            raise UsageError("give batch= (the example batch loss_fn(model, batch) takes), "
                             "or batches= / shapes= for a range of shapes")
        batch = batches[0]
    return batch


def _apply_cached(model: nn.Module, entry: CacheEntry, fields: dict[str, Any]
                  ) -> tuple[Plan | PlanSet, Handle] | str:
    """The cached plan and its handle, applied where the entry's fields still hold; else
    why it profiles instead."""
    changed = changed_fields(entry.fields, fields)
    if entry.plan is not None and not changed:
        try:
            return entry.plan, apply(model, entry.plan)
        except UsageError as err:  # the stages moved though the fields agree
            return f"the cached plan did not apply ({err})"
    return ("the cached entry was unreadable" if entry.plan is None
            else "; ".join(changed))


def _planned(request: _Request) -> Plan | PlanSet:
    """Profile the model and plan it under the budget: a plan set for a range."""
    model, batch = request.model, request.batch
    if request.dims is not None:
        ranged_profile = profile_shapes(model, batch, request.loss, request.dims,
                                        stages=request.stages, optimizer=request.optimizer,
                                        repeats=request.repeats)
        return plan_set(ranged_profile,
                        _reserved(request.budget, ranged_profile, request.reserve_bytes),
                        outside=request.outside)
    prof = profile(model, batch, request.loss, request.stages, request.optimizer,
                   repeats=request.repeats)
    return make_plan(prof, _reserved(request.budget, prof, request.reserve_bytes))


def _read_budget(budget: object) -> Budget:
    """``budget`` read once, where the user gave it (a UsageError for what is not one)."""
    if isinstance(budget, bool) or not isinstance(budget, (Budget, str, int, float)):
        raise UsageError(f"budget={budget!r} is not a budget; give bytes, a size such as "
                         "'12GiB', or a fraction such as '60%'")
    return Budget.parse(budget)


def _reserved(budget: Budget, prof: Profile, reserve: int) -> Budget:
    """``budget`` less ``reserve`` bytes (a fraction taken of the profile's peak first)."""
    if not reserve:
        return budget
    limit = budget.bytes(problem_from_profile(prof)) - reserve
    if limit <= 0:
        raise UsageError(f"reserve_bytes={reserve} leaves nothing of the budget "
                         f"({format_bytes(limit + reserve)}); give a larger budget")
    return Budget.parse(limit)


def _result(handle: Handle, plan: Plan | PlanSet, source: str, why: str | None,
            began: float, path: Path | None, reserve: int = 0,
            allocator: str | None = None) -> AutoCheckpoint:
    if isinstance(plan, PlanSet):
        largest = plan.plans[plan.choose(plan.dims.hi) or 0]
        peaks = [p.predicted_peak_bytes for p in plan.plans if p.predicted_peak_bytes]
        t, t0 = largest.predicted_step_time_s, largest.baseline_step_time_s
        report = AutoCheckpointReport(
            source=source, why=why, budget_bytes=plan.budget_bytes + reserve,
            predicted_peak_bytes=max(peaks, default=None),
            predicted_overhead=t / t0 - 1 if t and t0 else None,
            regions=tuple(str(r) for r in largest.regions),
            seconds=time.perf_counter() - began, cache_path=path,
            buckets=tuple(plan.describe()), reserve_bytes=reserve, plans=len(plan.plans),
            largest=plan.dims.shape_text(plan.dims.hi), allocator=allocator)
        return AutoCheckpoint(handle, plan, report)
    t, t0 = plan.predicted_step_time_s, plan.baseline_step_time_s
    report = AutoCheckpointReport(
        source=source, why=why,
        budget_bytes=None if plan.budget_bytes is None else plan.budget_bytes + reserve,
        predicted_peak_bytes=plan.predicted_peak_bytes,
        predicted_overhead=t / t0 - 1 if t and t0 else None,
        regions=tuple(str(r) for r in plan.regions),
        seconds=time.perf_counter() - began, cache_path=path, reserve_bytes=reserve,
        allocator=allocator)
    return AutoCheckpoint(handle, plan, report)
