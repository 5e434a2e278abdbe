"""Plan sets: one plan per bucket of batch shapes, each predicted within the budget.

Note [Plan sets]
~~~~~~~~~~~~~~~~
A single plan for the longest shape pays that shape's rebuilds on every shorter batch; a
plan for a short shape goes over the budget on a long one. :func:`plan_set` takes a
profile over a range of shapes (Note [Shape-aware profiles] in :mod:`remat.core.shapes`)
and a budget, and chooses:

1. the profile at every shape of the range's lattice (:func:`at_shape`), priced by the
   simulator, and the optimal plan at every lattice shape (at most ``SOLVED_SHAPES``; a
   larger lattice is solved at an even sub-lattice that keeps both ends of each
   dimension);
2. each of those plans priced at every lattice shape: it *covers* a shape where its
   predicted peak is within the budget and its predicted step time within ``within``
   (2%) of the best time there (the shape's own optimal where it was solved, else the
   fastest plan that fits there);
3. greedily, the plans that cover the most shapes not yet covered, until every shape is;
   each shape then runs the fastest chosen plan that covers it. A *bucket* is the shapes
   one plan runs, written as boxes (a range per dimension).

So every lattice shape is predicted within the budget by the plan that runs it, by the
simulator, not by an argument about monotonicity. Shapes outside the range (or off its
step, Note [Shapes between the steps]) get what ``outside`` says: ``error`` (a
UsageError naming the shape and the range) or ``conservative``: the plan of least
predicted peak at the range's largest shape, with one warning. The runtime reads the
shape off the forward's inputs (``inputs``: per dimension, a tensor's position among the
tensors of the forward's args then kwargs, an axis, and that axis's offset from the
dimension) and picks the bucket's plan at each forward (:mod:`remat.runtime.install`).

Note [Shapes between the steps]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A range's step is the lattice it is planned on; a collator without ``pad_to_multiple_of``
still hands over lengths between the steps (37 in ``seq=32..1024:8``). Such a shape runs
the plan of the lattice shape above it in every dimension (where a rounding collator would
have put it), and only where that was predicted: :func:`plan_set` prices every shape
between the steps (at most ``BETWEEN_LIMIT``) under that plan, from the profile at the
shape itself (the byte polynomials and the maxima fitted term by term are exact there too;
a stepped figure reads its ladder cell). If each is within the budget, the set says so
(``between``: how many were priced) and runs them; if one is over, a figure is not a whole
number there, or there are too many, ``between`` is 0 and such shapes are outside, as
before. Only memory is checked there: a shape between the steps runs a plan at most one
step's worth slower than its own best.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, ClassVar

from remat.core.artifact import JsonArtifact
from remat.core.errors import CheckFailed, UsageError
from remat.core.plan_format import Plan
from remat.core.planner import made_for
from remat.core.profile_format import Profile
from remat.core.shape_profiles import Resized
from remat.core.shapes import InputKey, Shape, ShapeFit, ShapeRange, input_key, input_key_list
from remat.core.solve import minimum_budget, solve
from remat.core.solve.budget import Budget
from remat.core.solve.from_profile import problem_from_profile
from remat.core.solve.problem import Problem
from remat.core.solve.simulator import simulate
from remat.core.units import format_bytes

__all__ = ["OUTSIDE", "PlanSet", "plan_set"]

#: What a batch outside the range gets (Note [Plan sets]).
OUTSIDE = ("error", "conservative")
#: The most lattice shapes solved for their own optimal plan.
SOLVED_SHAPES = 256
#: The most lattice shapes a plan set prices; a larger range needs a coarser step.
LATTICE_LIMIT = 8192
#: The most shapes between the steps a plan set prices (Note [Shapes between the steps]).
BETWEEN_LIMIT = 16384

Box = tuple[tuple[int, int], ...]  # per dimension, the least and largest value


@dataclass(frozen=True)
class PlanSet(JsonArtifact):
    """Plans for a range of batch shapes (Note [Plan sets]); ``buckets[k]`` are the boxes
    of shapes ``plans[k]`` runs."""

    artifact: ClassVar[str] = "plan-set"
    written_by: ClassVar[str] = "remat plan --shapes --json"

    dims: ShapeRange
    plans: tuple[Plan, ...]
    buckets: tuple[tuple[Box, ...], ...]
    inputs: Mapping[str, InputKey] = field(hash=False)
    budget_bytes: int
    conservative: int  # the plan outside shapes get with outside="conservative"
    outside: str = "error"
    shapes: int = 0  # lattice shapes priced
    solved: int = 0  # of them, solved for their own optimal plan
    slowest_ratio: float = 1.0  # the most a shape's plan is over its shape's best time
    solve_time_s: float = 0.0
    # shapes between the steps priced within the budget, each under the plan of the
    # lattice shape above it; 0: such shapes are outside (Note [Shapes between the steps])
    between: int = 0
    # where ``between`` is 0 and the range has shapes between its steps: why they are
    # outside, in words (the first shape that was not priced within the budget)
    between_refused: str = ""

    def __post_init__(self) -> None:
        if self.outside not in OUTSIDE:
            raise UsageError(f"outside={self.outside!r} is not one of {', '.join(OUTSIDE)}")
        plans, buckets = tuple(self.plans), tuple(tuple(b) for b in self.buckets)
        if not plans or not all(isinstance(p, Plan) for p in plans):
            raise UsageError("a plan set needs at least one plan")
        if len(buckets) != len(plans):
            raise UsageError(f"a plan set has {len(plans)} plans and {len(buckets)} buckets; "
                             "give one bucket per plan")
        if len({p.stages for p in plans}) != 1:
            raise UsageError("the plans of a plan set must name the same stages")
        if not 0 <= self.conservative < len(plans):
            raise UsageError(f"conservative={self.conservative} is not a plan of the set")
        missing = set(self.dims.names) - set(self.inputs)
        if missing:
            raise UsageError(f"the plan set does not say where to read {', '.join(missing)} "
                             "from the forward's inputs; plan it from a profile_shapes profile")
        object.__setattr__(self, "plans", plans)
        object.__setattr__(self, "buckets", tuple(
            tuple(tuple((int(a), int(b)) for a, b in box) for box in boxes)
            for boxes in buckets))
        object.__setattr__(self, "inputs", MappingProxyType(
            {k: input_key(v) for k, v in self.inputs.items()}))

    def __deepcopy__(self, memo: dict[int, Any]) -> PlanSet:
        return self  # immutable (a copy of a model with the set applied shares it)

    @property
    def stages(self) -> tuple[str, ...]:
        return self.plans[0].stages

    def choose(self, shape: Sequence[int]) -> int | None:
        """The index of the plan ``shape`` runs, or None outside the range."""
        shape = tuple(shape)
        if not self.dims.holds(shape):
            if not (self.between and self.dims.spans(shape)):
                return None
            shape = self.dims.up(shape)
        for k, boxes in enumerate(self.buckets):
            for box in boxes:
                if all(lo <= v <= hi for v, (lo, hi) in zip(shape, box, strict=True)):
                    return k
        return None

    def ends(self, k: int) -> tuple[Shape, Shape]:
        """The smallest and the largest shape of plan ``k``'s bucket."""
        return (min((tuple(lo for lo, _ in box) for box in self.buckets[k]), key=_size),
                max((tuple(hi for _, hi in box) for box in self.buckets[k]), key=_size))

    def describe(self) -> list[str]:
        """One line per plan: the shapes it covers and what it checkpoints."""
        lines = []
        for k, (plan, boxes) in enumerate(zip(self.plans, self.buckets, strict=True)):
            where = "; ".join(box_text(self.dims, b) for b in boxes[:4])
            more = f" (+{len(boxes) - 4} boxes)" if len(boxes) > 4 else ""
            regions = " ".join(str(r) for r in plan.regions) or "none"
            options = sorted({str(o) for o in plan.options} - {"keep"})
            peak = plan.predicted_peak_bytes
            lines.append(f"plan {k}: {where}{more}: regions {regions}"
                         + (f", options {' '.join(options)}" if options else "")
                         + (f", predicted peak up to {peak} bytes" if peak else ""))
        if self.between:
            lines.append(f"between the steps: each of the {self.between} shapes runs the plan "
                         "of the shape above it, predicted within the budget")
        elif self.between_refused:
            lines.append(f"between the steps: outside ({self.between_refused}); pad batches "
                         f"to the steps ({self.dims}) or plan a range whose step they keep")
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {
            "dims": self.dims.to_dict(),
            "plans": [p.to_dict() for p in self.plans],
            "buckets": [[[list(r) for r in box] for box in boxes] for boxes in self.buckets],
            "inputs": {k: input_key_list(v) for k, v in self.inputs.items()},
            "budget_bytes": self.budget_bytes,
            "conservative": self.conservative,
            "outside": self.outside,
            "shapes": self.shapes,
            "solved": self.solved,
            "slowest_ratio": self.slowest_ratio,
            "solve_time_s": self.solve_time_s,
            "between": self.between,
            **({"between_refused": self.between_refused} if self.between_refused else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlanSet:
        keys = {"dims", "plans", "buckets", "inputs", "budget_bytes", "conservative",
                "outside", "shapes", "solved", "slowest_ratio", "solve_time_s"}
        optional = {"between", "between_refused"}
        if not isinstance(data, Mapping) or not keys <= set(data) <= keys | optional:
            raise UsageError("a plan set must have exactly the keys "
                             f"{', '.join(sorted(keys))} (and {', '.join(sorted(optional))}, "
                             "optional); write it with remat plan --shapes")
        try:
            return cls(
                dims=ShapeRange.from_dict(data["dims"]),
                plans=tuple(Plan.from_dict(p) for p in data["plans"]),
                buckets=tuple(tuple(tuple(tuple(r) for r in box) for box in boxes)
                              for boxes in data["buckets"]),
                inputs={k: tuple(v) for k, v in data["inputs"].items()},
                **{k: data[k] for k in ("budget_bytes", "conservative", "outside", "shapes",
                                        "solved", "slowest_ratio", "solve_time_s")},
                between=data.get("between", 0),
                between_refused=str(data.get("between_refused", "")),
            )
        except (TypeError, ValueError) as err:
            raise UsageError(f"the plan set could not be read ({err}); write it again with "
                             "remat plan --shapes") from err


def _size(shape: Shape) -> tuple[int, Shape]:
    """Shapes ordered by the sum of their dimensions, then as tuples."""
    return (sum(shape), shape)


def box_text(dims: ShapeRange, box: Box) -> str:
    """``seq=8..48`` for a box of shapes."""
    return ",".join(f"{d.name}={lo}" if lo == hi else f"{d.name}={lo}..{hi}"
                    for d, (lo, hi) in zip(dims.dims, box, strict=True))


def _sub_lattice(dims: ShapeRange, most: int) -> list[Shape]:
    """An even sub-lattice of at most ``most`` shapes keeping both ends of each dimension."""
    per = max(2, int(most ** (1 / len(dims.dims))))
    axes = []
    for d in dims.dims:
        values = list(d.values())
        if len(values) <= per:
            axes.append(values)
        else:
            picks = {values[round(k * (len(values) - 1) / (per - 1))] for k in range(per)}
            axes.append(sorted(picks))
    return list(itertools.product(*axes))


def _key(plan: Plan) -> tuple[Any, ...]:
    return (plan.regions, plan.options)


def _boxes(points: list[Shape]) -> tuple[Box, ...]:
    """Runs along the last dimension, the others fixed (the lattice's order)."""
    out: list[Box] = []
    for point in sorted(points):
        if out and out[-1][:-1] == tuple((v, v) for v in point[:-1]):
            lo = out[-1][-1][0]
            out[-1] = (*out[-1][:-1], (lo, point[-1]))
            continue
        out.append(tuple((v, v) for v in point))
    return tuple(out)


def _too_small(dims: ShapeRange, problems: Mapping[Shape, Any], limit: int) -> CheckFailed:
    """No plan fits some shape: the least budget the whole range needs, and where."""
    least = {x: minimum_budget(p) for x, p in problems.items()}
    worst = max(least, key=lambda x: (least[x], x))
    first = min((x for x in least if least[x] > limit), key=_size)
    err = CheckFailed(
        f"no plan fits a budget of {format_bytes(limit)} ({limit} bytes) at "
        f"{dims.shape_text(first)}; the range {dims} needs at least "
        f"{format_bytes(least[worst])} ({least[worst]} bytes, the least peak at "
        f"{dims.shape_text(worst)}): give that budget or narrow the range")
    err.minimum_budget_bytes = least[worst]  # type: ignore[attr-defined]
    return err


@dataclass(frozen=True)
class _Lattice:
    """The range's lattice and what plan_set prices at each of its shapes."""

    dims: ShapeRange
    shapes: list[Shape]
    profiles: Mapping[Shape, Profile]
    problems: Mapping[Shape, Problem]
    limit: int  # the budget, bytes
    resized: Resized  # the profile at any shape of the range, between the steps too

    def solve(self, x: Shape) -> Plan:
        """The optimal plan at ``x``; where none fits, the whole range's :func:`_too_small`."""
        try:
            return solve("optimal", self.problems[x], self.limit)
        except CheckFailed as err:
            raise _too_small(self.dims, self.problems, self.limit) from err


@dataclass
class _Priced:
    """The candidate plans, each priced at every lattice shape (its simulated peak and step
    time), and the times of the shapes where it fits the budget."""

    lattice: _Lattice
    plans: list[Plan] = field(default_factory=list)
    prices: list[dict[Shape, tuple[int, float]]] = field(default_factory=list)
    fits: list[dict[Shape, float]] = field(default_factory=list)

    def add(self, plan: Plan) -> None:
        at = self.lattice
        sims = {x: simulate(plan, at.problems[x]) for x in at.shapes}
        price = {x: (sim.peak_bytes, sim.step_time_s) for x, sim in sims.items()}
        self.plans.append(plan)
        self.prices.append(price)
        self.fits.append({x: t for x, (peak, t) in price.items() if peak <= at.limit})


def plan_set(profile: Profile, budget: Budget | str | int | float, *, within: float = 0.02,
             outside: str = "error") -> PlanSet:
    """The plan set for ``profile``'s range under ``budget`` (Note [Plan sets]).

    ``budget`` is bytes or a size (the peak of a whole step), or a fraction of the
    measured peak without checkpointing at the range's largest shape. Raises
    :class:`CheckFailed` naming the shape and the least budget where no plan fits.
    """
    began = time.perf_counter()
    fit = _checked_range(profile, within, outside)
    at = _lattice(profile, fit.dims, budget)
    dims, lattice = at.dims, at.shapes
    solved_at = lattice if len(lattice) <= SOLVED_SHAPES else _sub_lattice(dims, SOLVED_SHAPES)
    priced, best = _candidates(at, solved_at)
    covers = [{x for x, t in f.items() if t <= (1 + within) * best[x] + 1e-12}
              for f in priced.fits]
    chosen = _greedy_cover(dims, lattice, covers)
    runs, slowest = _runs(lattice, chosen, covers, priced.fits, best)
    used = [k for k in chosen if runs[k]]
    out_plans = [_bucket_plan(at, priced, k, runs[k]) for k in used]
    conservative = min(range(len(used)), key=lambda j: priced.prices[used[j]][dims.hi][0])
    plan_of = {x: j for j, k in enumerate(used) for x in runs[k]}
    between, peaks, refused = _between(at, plan_of, out_plans)
    out_plans = [replace(p, predicted_peak_bytes=max(p.predicted_peak_bytes or 0, peaks[j]))
                 if j in peaks else p for j, p in enumerate(out_plans)]
    return PlanSet(
        dims=dims, plans=tuple(out_plans), buckets=tuple(_boxes(runs[k]) for k in used),
        inputs=fit.inputs, budget_bytes=at.limit, conservative=conservative, outside=outside,
        shapes=len(lattice), solved=len(solved_at), slowest_ratio=slowest,
        solve_time_s=time.perf_counter() - began, between=between, between_refused=refused,
    )


def _between(at: _Lattice, plan_of: Mapping[Shape, int], plans: Sequence[Plan]
             ) -> tuple[int, dict[int, int], str]:
    """How many shapes between the steps were priced within the budget under the plan of
    the lattice shape above each, and each plan's peak there; ``(0, {}, why)`` where one
    was not (Note [Shapes between the steps]), ``why`` empty where no shape is between."""
    dims = at.dims
    count = dims.box_size - dims.size
    if not count:
        return 0, {}, ""
    if count > BETWEEN_LIMIT:
        return 0, {}, (f"{count} shapes lie between the steps, more than the "
                       f"{BETWEEN_LIMIT} a plan set prices")
    peaks: dict[int, int] = {}
    for x in dims.between():
        j = plan_of[dims.up(x)]
        try:
            problem = problem_from_profile(at.resized.at(x, between=True, peak=False))
        except (CheckFailed, UsageError):  # a figure not whole (or not a figure) there
            return 0, {}, (f"at {dims.shape_text(x)} the profile's byte figures are not "
                           "whole numbers: the model's sizes follow the range only on its "
                           "steps, as a strided layer's output length does")
        peak = simulate(plans[j], problem).peak_bytes
        if peak > at.limit:
            return 0, {}, (f"{dims.shape_text(x)} under the plan of "
                           f"{dims.shape_text(dims.up(x))} is predicted at {peak} bytes, over "
                           f"the budget of {at.limit}")
        peaks[j] = max(peaks.get(j, 0), peak)
    return count, peaks, ""


def _checked_range(profile: Profile, within: float, outside: str) -> ShapeFit:
    """The profile's range, after checking the arguments plan_set was given."""
    fit = profile.shapes
    if fit is None:
        raise UsageError("this profile covers one shape; profile a range (shapes=) to plan "
                         "a plan set, or plan it with remat.plan")
    if outside not in OUTSIDE:
        raise UsageError(f"outside={outside!r} is not one of {', '.join(OUTSIDE)}")
    if not 0 <= within < 1:
        raise UsageError(f"within={within!r} must be a fraction from 0 to 1, e.g. 0.02")
    dims = fit.dims
    if dims.size > LATTICE_LIMIT:
        raise UsageError(f"the range {dims} holds {dims.size} shapes, more than the "
                         f"{LATTICE_LIMIT} a plan set prices; give the dimensions a coarser "
                         "step (e.g. seq=128..2048:8), as a padding collator rounds them")
    return fit


def _lattice(profile: Profile, dims: ShapeRange, budget: Budget | str | int | float) -> _Lattice:
    """The profile and problem at every lattice shape, and the budget in bytes."""
    lattice = list(dims.lattice())
    resized = Resized(profile)
    profiles = {x: resized.at(x) for x in lattice}
    problems = {x: problem_from_profile(p) for x, p in profiles.items()}
    limit = Budget.parse(budget).bytes(problem_from_profile(profile))
    return _Lattice(dims, lattice, profiles, problems, limit, resized)


def _candidates(at: _Lattice, solved_at: list[Shape]) -> tuple[_Priced, dict[Shape, float]]:
    """The candidate plans priced, and each lattice shape's best time (steps 1 and 2).

    A shape solved for its own optimal plan has that plan's time; another has the fastest
    candidate that fits there, or, where none does, its own optimal plan joins them.
    """
    candidates: dict[tuple[Any, ...], Plan] = {}
    best: dict[Shape, float] = {}
    for x in solved_at:
        found = at.solve(x)
        best[x] = found.predicted_step_time_s or 0.0
        candidates.setdefault(_key(found), found)
    priced = _Priced(at)
    for plan in candidates.values():
        priced.add(plan)
    for x in at.shapes:
        if x not in best:
            times = [f[x] for f in priced.fits if x in f]
            if not times:
                priced.add(at.solve(x))
                times = [priced.fits[-1][x]]
            best[x] = min(times)
    return priced, best


def _greedy_cover(dims: ShapeRange, lattice: list[Shape], covers: list[set[Shape]]) -> list[int]:
    """The plans covering the most shapes not yet covered, until every shape is (step 3)."""
    chosen: list[int] = []
    left = set(lattice)
    while left:
        k = max(range(len(covers)), key=lambda j: (len(covers[j] & left), -j))
        if not covers[k] & left:  # cannot happen: each shape's best plan covers it
            raise CheckFailed(f"no plan covers {dims.shape_text(next(iter(left)))}")
        chosen.append(k)
        left -= covers[k]
    return chosen


def _runs(lattice: list[Shape], chosen: list[int], covers: list[set[Shape]],
          fits: list[dict[Shape, float]], best: Mapping[Shape, float],
          ) -> tuple[dict[int, list[Shape]], float]:
    """The shapes each chosen plan runs (the fastest chosen plan covering each), and the
    most a shape's plan is over its best time."""
    runs: dict[int, list[Shape]] = {k: [] for k in chosen}
    slowest = 1.0
    for x in lattice:
        k = min((j for j in chosen if x in covers[j]), key=lambda j: fits[j][x])
        runs[k].append(x)
        if best[x] > 0:
            slowest = max(slowest, fits[k][x] / best[x])
    return runs, slowest


def _bucket_plan(at: _Lattice, priced: _Priced, k: int, run: list[Shape]) -> Plan:
    """Candidate ``k`` as its bucket's plan: the budget, its peak over the bucket's shapes,
    made for the bucket's largest shape."""
    peak = max(priced.prices[k][x][0] for x in run)
    largest = max(run, key=_size)
    return replace(priced.plans[k], budget_bytes=at.limit, predicted_peak_bytes=peak,
                   made_for=made_for(at.profiles[largest]))
