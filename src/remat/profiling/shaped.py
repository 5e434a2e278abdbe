"""Profiles over a range of batch shapes (Note [Shape-aware profiles] in remat.core.shapes).

:func:`profile_shapes` profiles the model at the few shapes the fits need, made from one
example batch by :func:`resize` (its content repeated along the varying axes, so token ids
stay token ids), and returns one profile carrying the fit. :func:`infer_shapes` reads the
range off a sample of real batches; :func:`batch_axes` says which axes of the batch's
tensors each named dimension is (docs/shapes.md). :func:`check_fit` profiles a held-out
shape and compares it with the fit.
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.core.errors import UsageError
from remat.core.maxima import collecting
from remat.core.profile_format import Profile, numeric_paths
from remat.core.shape_profiles import (
    anchor_shape,
    at_shape,
    figure_kind,
    fit_profile,
    scaled_times,
)
from remat.core.shapes import (
    Dim,
    InputKey,
    Shape,
    ShapeRange,
    byte_grid,
    ladder,
    middle,
    parse_shapes,
)
from remat.measure.model_state import model_restored
from remat.measure.rounds import interleaved
from remat.measure.step import checking_loss, make_optimizer
from remat.profiling.profiler import Progress, default_loss, profile
from remat.profiling.timing import bare_step_s
from remat.runtime.batch_shape import tensors_of

__all__ = ["FitReport", "batch_axes", "check_fit", "infer_shapes", "interleaved_steps",
           "profile_shapes", "resize", "tensors_of", "time_shapes"]

LossFn = Callable[[nn.Module, Any], Any]
Axes = dict[str, list[tuple[int, int]]]  # dimension -> (tensor index, axis) pairs
#: the batch's axes each named dimension is (docs/shapes.md); ``axisN`` is axis N
AXES: dict[str, tuple[int, ...]] = {"batch": (0,), "seq": (1,), "height": (2,), "width": (3,),
                                    "side": (2, 3)}


def _rebuild(obj: Any, fn: Callable[[torch.Tensor, int], torch.Tensor], count: list[int]) -> Any:
    if isinstance(obj, torch.Tensor):
        count[0] += 1
        return fn(obj, count[0] - 1)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a NamedTuple
        return type(obj)(*(_rebuild(x, fn, count) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_rebuild(x, fn, count) for x in obj)
    if isinstance(obj, Mapping):
        items = {k: _rebuild(v, fn, count) for k, v in obj.items()}
        try:
            return type(obj)(items)  # type: ignore[call-arg]  # dict, BatchEncoding, ...
        except TypeError:
            return items
    return obj


def _has_axes(t: torch.Tensor, axes: tuple[int, ...]) -> bool:
    """``t`` has every axis of ``axes``, of one size where there are two (a square side)."""
    return t.dim() > max(axes) and (len(axes) == 1 or t.shape[axes[0]] == t.shape[axes[1]])


def batch_axes(batch: Any, dims: ShapeRange) -> Axes:
    """Which ``(tensor, axis)`` pairs of ``batch`` each dimension is (docs/shapes.md):
    ``batch`` axis 0, ``seq`` axis 1, ``height`` axis 2 and ``width`` axis 3, ``side``
    both, ``axisN`` axis N, each in every tensor whose size there equals the first such
    tensor's."""
    tensors = list(tensors_of(batch))
    if not tensors:
        raise UsageError("the batch holds no tensors; give the example batch the loss takes")
    out: Axes = {}
    for d in dims.dims:
        axes = AXES.get(d.name) or (int(d.name.removeprefix("axis")),)
        ref = next((k for k, t in enumerate(tensors) if _has_axes(t, axes)), None)
        if ref is None:
            raise UsageError(f"dimension {d.name} is axis {' and '.join(map(str, axes))} of "
                             "the batch's tensors, and no tensor of the batch has it; name the "
                             "dimension by the axis that varies (axisN)")
        size = tensors[ref].shape[axes[0]]
        out[d.name] = [(k, a) for k, t in enumerate(tensors) if t.dim() > max(axes)
                       and all(t.shape[x] == size for x in axes) for a in axes]
    return out


def resize(batch: Any, axes: Axes, sizes: Mapping[str, int]) -> Any:
    """``batch`` with each dimension's axes at ``sizes``: the content repeated (or cut)
    along them, so ids, masks and labels keep their values. A tensor with a varying axis is
    a fresh contiguous one at every size, its sample's own too: a view of a longer batch
    there would hold the longer storage and take a copy in the loss where the other sizes
    take none, a profile unlike the rest."""
    by_tensor: dict[int, list[tuple[int, int]]] = {}
    for name, pairs in axes.items():
        for k, axis in pairs:
            by_tensor.setdefault(k, []).append((axis, int(sizes[name])))

    def one(t: torch.Tensor, k: int) -> torch.Tensor:
        if k not in by_tensor:
            return t
        given = t
        for axis, n in by_tensor[k]:
            if t.shape[axis] != n:
                index = torch.arange(n, device=t.device) % t.shape[axis]
                t = t.index_select(axis, index)
        return t.clone(memory_format=torch.contiguous_format) if t is given else t

    return _rebuild(batch, one, [0])


def infer_shapes(batches: Sequence[Any]) -> ShapeRange:
    """The range a sample of real batches spans: each axis whose size varies, named by
    :func:`batch_axes`' rules, from the least to the largest size seen, in steps of the
    sizes' greatest common divisor (a collator padding to a multiple of 8 gives steps of 8
    or more)."""
    if isinstance(batches, (torch.Tensor, Mapping)) or not isinstance(batches, Sequence) or (
            len(batches) < 2):
        raise UsageError("batches must be a list of two or more real batches of different "
                         "shapes; or give shapes= instead")
    shapes = [[tuple(t.shape) for t in tensors_of(b)] for b in batches]
    if any(len(s) != len(shapes[0]) or [len(x) for x in s] != [len(x) for x in shapes[0]]
           for s in shapes):
        raise UsageError("the batches differ in their tensors or their tensors' number of "
                         "axes; give batches of one structure")
    varying: dict[int, list[int]] = {}  # axis -> sizes seen, from the first tensor varying
    for k in range(len(shapes[0])):
        for axis in range(len(shapes[0][k])):
            sizes = [s[k][axis] for s in shapes]
            if len(set(sizes)) > 1 and axis not in varying:
                varying[axis] = sizes
    if not varying:
        raise UsageError("the batches all have one shape; give batches of different shapes "
                         "or shapes=")
    names = {axes[0]: name for name, axes in AXES.items() if len(axes) == 1}
    if 2 in varying and 3 in varying and varying[2] == varying[3]:
        del varying[3]
        names[2] = "side"
    dims = []
    for axis, sizes in sorted(varying.items()):
        step = math.gcd(*sizes)
        lo, hi = min(sizes), max(sizes)
        dims.append(Dim(names.get(axis, f"axis{axis}"), lo, hi, step))
    return ShapeRange(tuple(dims))


def time_shapes(dims: ShapeRange) -> tuple[Shape, ...]:
    """The shapes timed for the time fits: the range's smallest, middle (the lattice value
    nearest the geometric mean in each dimension) and largest."""
    centre = tuple(middle(d) for d in dims.dims)
    return tuple(dict.fromkeys((dims.lo, centre, dims.hi)))


#: rounds of :func:`interleaved_steps` that level the timed shapes' profiles
LEVEL_ROUNDS = 5


def interleaved_steps(model: nn.Module, batches: Mapping[Shape, Any], loss_fn: LossFn | None,
                      optimizer: str | torch.optim.Optimizer = "adamw", *,
                      rounds: int = LEVEL_ROUNDS) -> dict[Shape, float]:
    """Per shape, the median seconds of the plain training step on its batch, timed in
    ``rounds`` interleaved rounds (:func:`remat.measure.rounds.interleaved`) after one
    warm-up round (Note [Timed shapes levelled] in remat.core.shapes). The model, the
    optimizer given and the RNG are as they were afterwards."""
    loss = checking_loss(loss_fn or default_loss)
    first = next(model.parameters(), None)
    device = first.device if first is not None else None
    given = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
    devices = [device] if device is not None and device.type == "cuda" else []
    training = model.training
    with model_restored(model, given), torch.random.fork_rng(devices=devices):
        model.train()
        try:
            opt = make_optimizer(model, optimizer)
            times = interleaved({shape: functools.partial(bare_step_s, model, batch, loss, opt,
                                                          device=device)
                                 for shape, batch in batches.items()}, repeats=rounds, warmup=1)
        finally:
            model.train(training)
    return {shape: statistics.median(t) for shape, t in times.items()}


def _levels(profiles: Mapping[Shape, Profile], steps: Mapping[Shape, float], at: Shape
            ) -> dict[Shape, float]:
    """Per profiled shape, the factor that gives its plain step the ratio to ``at``'s that
    the interleaved ``steps`` measured (1 at ``at``)."""
    anchor = profiles[at].step_s / steps[at]
    return {shape: anchor * steps[shape] / p.step_s for shape, p in profiles.items()
            if p.step_s > 0}


class _Inputs:
    """Records the shapes of the tensors the model's forward receives (its first call)."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] | None = None

    def __call__(self, _module: nn.Module, args: Any, kwargs: Any) -> None:
        if self.shapes is None:
            self.shapes = [tuple(t.shape) for t in tensors_of((args, kwargs))]


def _offsets(seen: Mapping[Shape, list[tuple[int, ...]]], j: int, k: int, a: int
             ) -> set[int]:
    """How far axis ``a`` of the forward's ``k``-th tensor is from dimension ``j``, over the
    profiled shapes (one value: it follows the dimension)."""
    return {seen[s][k][a] - s[j] for s in seen if k < len(seen[s]) and a < len(seen[s][k])}


def _forward_keys(dims: ShapeRange, seen: Mapping[Shape, list[tuple[int, ...]]]
                  ) -> dict[str, InputKey]:
    """Per dimension, the first (tensor, axis) of the forward's inputs whose size is the
    dimension's value at every profiled shape, or else its value plus one offset at every
    shape where the dimension took two values or more (``loss_fn`` calling
    ``model(ids[:, :-1])``: -1): what the runtime reads."""
    shapes = list(seen)
    first = seen[shapes[0]]
    out: dict[str, InputKey] = {}
    for j, d in enumerate(dims.dims):
        axes = [(k, a) for k, shape in enumerate(first) for a in range(len(shape))]
        found = {(k, a): _offsets(seen, j, k, a) for k, a in axes}
        follows = [(k, a, next(iter(off))) for (k, a), off in found.items() if len(off) == 1
                   and all(k < len(seen[s]) and a < len(seen[s][k]) for s in shapes)]
        varies = len({s[j] for s in shapes}) > 1
        key = next((key for key in follows if key[2] == 0), None)
        if key is None and varies:
            key = next(iter(follows), None)
        if key is None:
            raise UsageError(
                f"no tensor the model's forward receives has an axis that follows dimension "
                f"{d.name} across the shapes profiled; a plan set chooses its plan from the "
                "forward's inputs, so give the dimensions the model itself receives")
        out[d.name] = key
    return out


def profile_shapes(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn | None = None,
    shapes: str | Mapping[str, Any] | ShapeRange | None = None,
    *,
    batches: Sequence[Any] | None = None,
    stages: Sequence[str] | None = None,
    optimizer: str | torch.optim.Optimizer = "adamw",
    repeats: int = 2,
    progress: Progress | None = None,
) -> Profile:
    """Profile ``model`` over a range of batch shapes into one profile that carries the
    fit (Note [Shape-aware profiles] in remat.core.shapes).

    ``shapes``: the range (``"batch=1..16,seq=128..2048:8"``); without it, the range the
    real ``batches`` span (:func:`infer_shapes`). ``batch``: the example the profiled
    batches are made from (default: the first of ``batches``). The model is profiled with
    bytes only at the byte grid (the bottom of the range) and timed at the smallest,
    middle and largest shapes; it is as it was afterwards (each profile puts it back).
    """
    if shapes is None:
        if batches is None:
            raise UsageError("give shapes= (e.g. 'seq=128..2048') or batches= (real batches "
                             "of different shapes) to profile a range")
        dims = infer_shapes(batches)
    else:
        dims = parse_shapes(shapes)
    sample = batch if batch is not None else (batches[0] if batches else None)
    if sample is None:
        raise UsageError("give batch= (an example batch) to make the profiled shapes from")
    axes = batch_axes(sample, dims)
    grid, timed = byte_grid(dims), time_shapes(dims)
    # bytes-only shapes first: the timed ones then run on a warmed-up process (a first
    # profile pays one-off costs that would read as the smallest shape's time)
    todo = [s for s in dict.fromkeys((*grid, *itertools.product(*ladder(dims))))
            if s not in timed] + list(timed)
    found: dict[Shape, Profile] = {}
    seen: dict[Shape, list[tuple[int, ...]]] = {}
    timed_batches: dict[Shape, Any] = {}
    names = list(stages) if stages is not None else None
    for n, shape in enumerate(todo):
        if progress is not None:
            progress(f"shape {dims.shape_text(shape)}", n, len(todo))
        sized = resize(sample, axes, dict(zip(dims.names, shape, strict=True)))
        if shape in timed:
            timed_batches[shape] = sized
        inputs = _Inputs()
        hook = model.register_forward_pre_hook(inputs, with_kwargs=True)
        try:
            with collecting():  # peaks keep their terms (Note [Maxima fitted term by term])
                found[shape] = profile(model, sized, loss_fn, names, optimizer,
                                       repeats=repeats, _timed=shape in timed)
        finally:
            hook.remove()
        names = list(found[shape].stage_names)
        if inputs.shapes is not None:
            seen[shape] = inputs.shapes
    levels = None
    if len(timed) > 1:
        if progress is not None:
            progress("levelling the timed shapes", len(todo), len(todo))
        steps = interleaved_steps(model, timed_batches, loss_fn, optimizer)
        levels = _levels({s: found[s] for s in timed}, steps, anchor_shape(timed))
    if progress is not None:
        progress("fitting", len(todo), len(todo))
    return fit_profile(dims, found, timed, _forward_keys(dims, seen), levels)


@dataclass(frozen=True)
class FitReport:
    """A held-out shape profiled (twice) and compared with the fit (:func:`check_fit`)."""

    shape: Shape
    byte_fields: int
    bytes_wrong: tuple[tuple[str, int], ...]  # (path, measured - fitted), where they differ
    stepped: frozenset[str]  # the figures read off the ladder (Note [Figures that are maxima])
    step_s: float  # measured step without checkpointing, as the first profile timed it
    fitted_step_s: float
    # the largest |fitted / measured - 1| of the step and stage times, the measured ones
    # levelled to the speed the fit is anchored at (Note [Timed shapes levelled])
    time_error: float
    timing_noise: float  # the profile's own spread of stage times (a fraction)
    # the largest |again / measured - 1| of the same times, both levelled, for a second
    # profile of the same shape: what the times move by between two measurements (Note
    # [Times within the noise])
    repeat_error: float = 0.0
    levelled_step_s: float = 0.0  # the measured step levelled as the fit's times are
    raw_time_error: float = 0.0  # time_error against the profile's times as they ran
    raw_repeat_error: float = 0.0  # repeat_error, likewise

    @property
    def polynomial_exact(self) -> bool:
        """Every figure the polynomial carries equal to the byte."""
        return not any(p not in self.stepped for p, _ in self.bytes_wrong)

    @property
    def stepped_under(self) -> int:
        """The most a stepped figure was measured above the fit (0: never under)."""
        return max(0, max((d for p, d in self.bytes_wrong if p in self.stepped), default=0))

    @property
    def times_within_noise(self) -> bool:
        """The fit is as close to the measurement as a second measurement is."""
        return self.time_error <= max(self.repeat_error, self.timing_noise)


# Note [Times within the noise]
# A fitted time is compared with one profile's time at a held-out shape; on a shared
# machine that profile's times are themselves one draw (the machine's speed moves by 2x
# within minutes). The profile's own stage spread measures the noise within one profile,
# not between two, and the check takes the worst of a dozen figures, so it is compared
# with the same statistic for a second profile of the same shape: the fit is within the
# noise when it is no further from the first measurement than the second one is. Both
# held-out profiles are levelled first, as the fit's timed profiles were (Note [Timed
# shapes levelled] in remat.core.shapes): the plain step at the held-out shape and at the
# fit's anchor, timed in interleaved rounds beside them, put each profile's times at the
# speed the fit is anchored at; the report keeps the errors before levelling too.


def _worst_time_error(predicted: Profile, measured: Profile) -> float:
    errors = [abs(predicted.step_s / measured.step_s - 1)] if measured.step_s else []
    for a, b in zip(predicted.stages, measured.stages, strict=True):
        for field in ("fwd_s", "bwd_s"):
            if getattr(b, field) > 0:
                errors.append(abs(getattr(a, field) / getattr(b, field) - 1))
    return max(errors, default=0.0)


def check_fit(model: nn.Module, batch: Any, loss_fn: LossFn | None, fitted: Profile,
              shape: Sequence[int], *, repeats: int = 2) -> FitReport:
    """Profile ``model`` at ``shape`` (a shape the fit did not use) and compare every byte
    figure (exact) and the step and stage times (relative, levelled: Note [Times within
    the noise]) with the fit's; a second profile of the shape gives what the times move by
    between measurements."""
    fit = fitted.shapes
    if fit is None:
        raise UsageError("this profile covers one shape; give one from profile_shapes")
    shape = tuple(shape)
    axes = batch_axes(batch, fit.dims)

    def sized(at: Shape) -> Any:
        return resize(batch, axes, dict(zip(fit.dims.names, at, strict=True)))

    names = list(fitted.stage_names)
    measured = profile(model, sized(shape), loss_fn, names, fitted.optimizer, repeats=repeats)
    again = profile(model, sized(shape), loss_fn, names, fitted.optimizer, repeats=repeats)
    steps = interleaved_steps(model, {fit.at: sized(fit.at), shape: sized(shape)}, loss_fn,
                              fitted.optimizer)

    def levelled(p: Profile) -> Profile:
        return scaled_times(p, fitted.step_s / steps[fit.at] * steps[shape] / p.step_s)

    predicted = at_shape(fitted, shape)
    got, want = numeric_paths(measured.to_dict()), numeric_paths(predicted.to_dict())
    byte_paths = [p for p, v in want.items() if figure_kind(p, v) == "bytes"]
    wrong = tuple((p, int(got[p] - want[p])) for p in byte_paths if got.get(p) != want.get(p))
    noise = measured.timing_noise.stage_spread if measured.timing_noise is not None else 0.0
    first, second = levelled(measured), levelled(again)
    return FitReport(shape, len(byte_paths), wrong, frozenset(fit.steps), measured.step_s,
                     predicted.step_s, _worst_time_error(predicted, first), noise,
                     _worst_time_error(second, first), levelled_step_s=first.step_s,
                     raw_time_error=_worst_time_error(predicted, measured),
                     raw_repeat_error=_worst_time_error(again, measured))
