"""A profile over a range of shapes: fitted from profiles at a few shapes, evaluated at any.

:func:`fit_profile` turns profiles of one model at the byte grid and at the timed shapes
(Note [Shape-aware profiles] in :mod:`remat.core.shapes`) into one profile carrying a
:class:`~remat.core.shapes.ShapeFit`; :func:`at_shape` gives the profile at any shape of
the range, as a plain profile every planner and simulator takes. Torch-free.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import replace
from fractions import Fraction
from typing import Any

from remat.core.errors import CheckFailed, UsageError
from remat.core.maxima import Maximum
from remat.core.profile_format import Profile, numeric_paths, set_path
from remat.core.shapes import (
    FitCheck,
    Shape,
    ShapeFit,
    ShapeRange,
    byte_grid,
    eval_bytes,
    eval_envelope,
    eval_steps,
    fit_bytes,
    fit_envelope,
    fit_times,
    ladder,
)
from remat.core.solve.from_profile import predict_no_checkpoint_peak

__all__ = ["Resized", "anchor_shape", "at_shape", "figure_kind", "fit_profile", "scaled_times",
           "shape_of"]

# Figures not carried across shapes: bookkeeping, the peaks (measured only at the shape
# measured, predicted again by the simulator), the timed rounds and spreads (the timing of
# the profile's own shape), and the bytes a region keeps beyond its input (measured on a
# tiny chain, the same at every shape). A region's time (``region_overhead_s``, the
# residual of the per-stage rounds) is fitted as every time is: it grows with the shape
# (measured on the variable-length hf:llama: 1.6 ms a region at seq 32, 14.6 ms at 1024),
# and the largest shape's, once kept for the whole range, priced one region per layer at
# seq 32 at +160% where +52% was measured.
_NOT_FITTED = frozenset({"schema_version", "batch_size", "measured_peak_bytes",
                         "predicted_peak_bytes", "profile_s", "region_overhead_bytes"})
_NOT_FITTED_UNDER = ("timed_rounds.", "timing_noise.", "batch_shapes.", "scaling.", "shapes.")


_UNSHAPED = ("timed_rounds", "timing_noise", "batch_shapes", "scaling", "shapes", "time_spread",
             "measured_peak_bytes", "predicted_peak_bytes", "batch_size")


def figure_kind(path: str, value: float) -> str:
    """``skip``, ``bytes`` (an exact polynomial), ``time`` (fitted) or ``same`` (must not
    change with the shape: indices, counts)."""
    if path in _NOT_FITTED or path.startswith(_NOT_FITTED_UNDER) or ".time_spread." in path:
        return "skip"
    if isinstance(value, float):
        return "time"
    if any("bytes" in part for part in path.split(".")):
        return "bytes"
    return "same"


def _skeleton(node: Any) -> Any:
    """``node`` with every whole number replaced by None and times and unfitted parts
    dropped (a profile of bytes only has fewer times): two profiles of one model at two
    shapes must have equal skeletons."""
    if isinstance(node, Mapping):
        return {k: _skeleton(v) for k, v in node.items()
                if not isinstance(v, float) and k not in _UNSHAPED}
    if isinstance(node, list):
        return [_skeleton(v) for v in node]
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return None
    return node


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    """Where two skeletons first differ, briefly."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{path}.{k}" if path else k)
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for k, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return _first_difference(x, y, f"{path}.{k}" if path else str(k))
    return f"{path or 'the profile'} ({repr(a)[:60]} against {repr(b)[:60]})"


def _call_args_alike(profiles: Mapping[Shape, Profile]) -> Mapping[Shape, Profile]:
    """``profiles``, without the stages' ``call_args`` where their lists differ between
    shapes.

    Which arguments a stage gets can change with the shape: transformers drops the 4-D
    attention mask where a batch has no padding (SDPA then runs causal), so a padded
    sample cut to a shorter length passes one argument fewer. The lists cannot be fitted
    then, and a profile without them counts the arguments the frames hold as one total
    (``args_at_return``, fitted like every figure), as profiles before the lists did
    (Note [Arguments a checkpoint frame holds] in remat.core.solve.simulator).
    """
    lists = {tuple(len(st.call_args) for st in p.stages) for p in profiles.values()}
    if len(lists) <= 1:
        return profiles
    return {shape: dataclasses.replace(p, stages=tuple(
        dataclasses.replace(st, call_args=()) for st in p.stages))
        for shape, p in profiles.items()}


def anchor_shape(timed: Sequence[Shape]) -> Shape:
    """The timed shape a range profile is anchored at: its own figures are that shape's."""
    return max(timed, key=lambda s: (sum(s), s))


def fit_profile(dims: ShapeRange, profiles: Mapping[Shape, Profile],
                timed: Sequence[Shape], inputs: Mapping[str, tuple[int, int]],
                levels: Mapping[Shape, float] | None = None) -> Profile:
    """The profile at the largest timed shape, carrying the fit through ``profiles``.

    ``profiles`` holds a profile at every shape of :func:`byte_grid` and of the
    :func:`ladder` (their byte figures are read) and at each shape of ``timed`` (profiled
    with their times). Each byte figure is the grid's polynomial where that matches every
    profile, else stepped over the ladder (Note [Figures that are maxima]). ``levels``: per
    timed shape, the factor its times are multiplied by before they are fitted (Note
    [Timed shapes levelled] in remat.core.shapes; 1 where not given). Raises
    :class:`CheckFailed` where the model's structure changes with the shape.
    """
    grid = byte_grid(dims)
    rungs = ladder(dims)
    rung_shapes = list(itertools.product(*rungs))
    missing = [s for s in (*grid, *rung_shapes, *timed) if s not in profiles]
    if missing:
        raise UsageError(f"no profile at {dims.shape_text(missing[0])}; profile every shape "
                         "of the byte grid, the ladder and the timed shapes")
    at = anchor_shape(timed)
    profiles = _call_args_alike(profiles)
    data = {s: p.to_dict() for s, p in profiles.items()}
    base = Profile.from_dict(_plain(data[at]))  # no Maximum reaches the planners
    skeleton = _skeleton(data[at])
    for shape, d in data.items():
        if _skeleton(d) != skeleton:
            raise CheckFailed(
                f"the profile at {dims.shape_text(shape)} differs in structure from the one "
                f"at {dims.shape_text(at)}: {_first_difference(_skeleton(d), skeleton)}; the "
                "model does other work at other shapes, so profile each shape range apart")
    numbers = {s: numeric_paths(d) for s, d in data.items()}
    kinds = {path: figure_kind(path, v) for path, v in numbers[at].items()}
    for path, kind in kinds.items():
        if kind == "same":
            for shape, found in numbers.items():
                if found[path] != numbers[at][path]:
                    raise CheckFailed(
                        f"{path} is {found[path]} at {dims.shape_text(shape)} and "
                        f"{numbers[at][path]} at {dims.shape_text(at)}; the model's stages "
                        "behave differently across the range, so profile narrower ranges")
    byte_paths = [p for p, k in kinds.items() if k == "bytes"]
    fitted = fit_bytes(dims, grid, [{p: int(numbers[s][p]) for p in byte_paths} for s in grid])
    polynomial: dict[str, Any] = {}
    steps: dict[str, tuple[int, ...]] = {}
    envelopes: dict[str, tuple[tuple[Fraction, ...], ...]] = {}
    for path in byte_paths:
        if all(_fits(dims, fitted, numbers[grid[0]], path, s, int(found[path]))
               for s, found in numbers.items()):
            if path in fitted:
                polynomial[path] = fitted[path]
        elif (terms := _envelope(dims, grid, numbers, path)) is not None:
            envelopes[path] = terms
        else:
            steps[path] = tuple(int(numbers[s][path]) for s in rung_shapes)
    checks = []
    for shape in timed:
        if shape in grid:
            continue
        over = [eval_steps(dims, rungs, steps[p], shape) - int(numbers[shape][p])
                for p in steps]
        checks.append(FitCheck(shape, len(byte_paths),
                               len(byte_paths) - sum(1 for d in over if d),
                               max(over, default=0)))
    time_paths = [p for p, k in kinds.items() if k == "time"]
    level = dict(levels or {})
    times = fit_times(dims, list(timed), [
        {p: numbers[s][p] * level.get(s, 1.0) for p in time_paths} for s in timed])
    fit = ShapeFit(dims=dims, at=at, byte_points=grid, time_points=tuple(timed),
                   bytes=polynomial, times=times, checks=tuple(checks), inputs=inputs,
                   rungs=rungs, steps=steps, envelopes=envelopes)
    return replace(base, shapes=fit)


def scaled_times(profile: Profile, factor: float) -> Profile:
    """``profile`` with every time figure :func:`fit_profile` fits multiplied by
    ``factor`` (Note [Timed shapes levelled] in remat.core.shapes)."""
    if factor <= 0 or factor != factor:
        raise UsageError(f"a time factor must be positive, not {factor}")
    data = profile.to_dict()
    for path, value in numeric_paths(data).items():
        if figure_kind(path, value) == "time":
            set_path(data, path, value * factor)
    return Profile.from_dict(data)


def _plain(node: Any) -> Any:
    """A ``to_dict()`` tree with every :class:`Maximum` as the plain int it is."""
    if isinstance(node, Mapping):
        return {k: _plain(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_plain(v) for v in node]
    return int(node) if isinstance(node, Maximum) else node


def _envelope(dims: ShapeRange, grid: Sequence[Shape], numbers: Mapping[Shape, Mapping[str, Any]],
              path: str) -> tuple[tuple[Fraction, ...], ...] | None:
    """``path``'s terms fitted one by one (Note [Maxima fitted term by term]) where the grid
    gives it as a maximum of as many terms at every shape and the fit equals every
    profile; else None (the figure is stepped)."""
    at_grid = [numbers[s][path] for s in grid]
    if not all(isinstance(v, Maximum) for v in at_grid) or len(
            {len(v.terms) for v in at_grid}) != 1:
        return None
    terms = fit_envelope(dims, grid, [v.terms for v in at_grid])
    try:
        if any(eval_envelope(dims, terms, s) != int(found[path])
               for s, found in numbers.items()):
            return None
    except CheckFailed:  # a term not whole at a profiled shape
        return None
    return terms


def _fits(dims: ShapeRange, coefficients: Mapping[str, Any], constant: Mapping[str, float],
          path: str, shape: Shape, measured: int) -> bool:
    """Whether the grid's polynomial (or constant) for ``path`` gives ``measured`` at
    ``shape``; a polynomial that is not whole there does not (a figure that is a maximum,
    stepped instead: a 5-block LM under autocast, its range 17..65 inferred from batches
    with step 1, gave 181,435.75 bytes at seq=32 and the profile was refused)."""
    if path not in coefficients:
        return int(constant[path]) == measured
    try:
        return eval_bytes(dims, coefficients[path], shape) == measured
    except CheckFailed:
        return False


def shape_of(profile: Profile, sizes: Mapping[str, int]) -> Shape:
    """The shape (in the fit's order) from ``{dimension: size}``."""
    fit = _fit_of(profile)
    unknown = set(sizes) - set(fit.dims.names)
    if unknown or set(fit.dims.names) - set(sizes):
        raise UsageError(f"give a size for each of {', '.join(fit.dims.names)} (got "
                         f"{', '.join(sorted(sizes)) or 'none'})")
    return tuple(int(sizes[n]) for n in fit.dims.names)


def _fit_of(profile: Profile) -> ShapeFit:
    if profile.shapes is None:
        raise UsageError("this profile covers one shape; profile a range with shapes= "
                         "(remat profile --shapes) first")
    return profile.shapes


def at_shape(profile: Profile, shape: Sequence[int], *, between: bool = False) -> Profile:
    """``profile`` (one carrying a :class:`ShapeFit`) at ``shape``: every byte figure from
    its polynomial, every time from its fit, the no-checkpoint peak predicted again; the
    measured peak and timed rounds only at the shape measured. At the profile's own shape
    the measured figures stay (the fits pass through them or near them).

    ``between``: also a shape between the range's ends off its steps (Note [Shapes between
    the steps] in remat.core.plan_set); raises :class:`CheckFailed` where a polynomial is
    not whole there."""
    return Resized(profile).at(shape, between=between)


class Resized:
    """:func:`at_shape` for one profile at many shapes: the profile's figures are read
    once, not once per shape (a plan set prices hundreds of shapes)."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.fit = _fit_of(profile)
        base = profile.to_dict()
        base["measured_peak_bytes"] = None
        for key in ("timed_rounds", "batch_shapes", "shapes"):
            base.pop(key, None)
        for stage in base["stages"]:
            stage.pop("time_spread", None)
        self._base = base

    def at(self, shape: Sequence[int], *, between: bool = False, peak: bool = True
           ) -> Profile:
        """The profile at ``shape`` (:func:`at_shape`); ``peak=False`` leaves its
        no-checkpoint peak unpredicted (``None``), for a caller that prices plans only."""
        fit = self.fit
        shape = tuple(shape)
        if not (fit.dims.spans(shape) if between else fit.dims.holds(shape)):
            raise UsageError(f"shape {shape} is not in the profile's range {fit.dims}")
        if shape == fit.at:
            return self.profile
        data = _copy_tree(self._base)
        for path, value in fit.byte_values(shape).items():
            set_path(data, path, value)
        for path in fit.times:
            set_path(data, path, fit.time_value(path, shape))
        if "batch" in fit.dims.names:
            data["batch_size"] = shape[fit.dims.names.index("batch")]
        found = Profile.from_dict(data)
        if not peak:
            return replace(found, predicted_peak_bytes=None)
        return replace(found, predicted_peak_bytes=predict_no_checkpoint_peak(found))


def _copy_tree(value: Any) -> Any:
    """A copy of a profile's dict deep enough to set any figure in (dicts and lists)."""
    if isinstance(value, dict):
        return {k: _copy_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_tree(v) for v in value]
    return value
