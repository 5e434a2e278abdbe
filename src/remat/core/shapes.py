"""Ranges of batch shapes and the fits that carry a profile across them; torch-free.

Note [Shape-aware profiles]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Training feeds batches whose shape changes every step (dynamic padding, bucketing, the
last partial batch). A :class:`ShapeRange` names the dimensions that vary, each a
:class:`Dim` ``name=lo..hi[:step]`` (``batch=1..16,seq=128..2048:8``); a *shape* is one
value per dimension, in the range's order, and the range's *lattice* is every shape whose
values are ``lo + k * step``.

Every byte figure of a profile is a whole-number polynomial in the dimensions: a tensor
holds ``b * s * h`` elements, attention scores ``b * heads * s * s``, a causal mask
``s * s``, parameters none. So the bytes are fitted **exactly** (rational arithmetic, no
rounding) by the tensor-product polynomial of degree 1 in ``batch`` and 2 in every other
dimension, through the smallest grid that determines it: 2 batch values times 3 values of
each other dimension, at the bottom of the range where a step is cheapest. Shapes the fit
did not use (the larger profiles timed below) check it: their bytes must equal the fit's
to the byte, or the range is refused with the field that differs (a kernel that changes
with the size, a sliding window: memory that is not one polynomial over the range).

Times are not exact: each time figure is fitted, by least squares with non-negative
coefficients, as ``c0 + c1 * P1 + c2 * P2``, where ``P1`` is the product of the dimensions
(the work of every linear layer) and ``P2`` the product with each non-batch dimension
squared (attention's), through profiles timed at the range's smallest, middle and largest
shapes. The fit is checked against a held-out timed profile by
:func:`remat.profiling.shaped.check_fit`.

Note [Timed shapes levelled]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The timed shapes are profiled one after the other, tens of seconds apart, and a shared
machine's speed moves by 2x within minutes: a fit through three profiles taken at three
speeds reads the drift as a law of the shape (measured: the built-in gpt over
``batch=2..8,seq=32..128``, fitted 43.3 ms at a held-out shape measured at 56.4 ms, while
a second profile of that shape was 6% off the first). So after the profiles, the plain
step is timed at every timed shape in interleaved rounds (one step of each shape per
round, medians), and each timed profile's times are multiplied by the factor that gives
its plain step the ratio to the largest shape's that the rounds measured; the largest
shape's profile, the one the fit is anchored to, keeps its own times. The levelled fit
says how the times grow with the shape at one speed of the machine; the check levels the
held-out profiles the same way, against the largest shape timed beside them.

Note [Figures that are maxima]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Not every byte figure is one polynomial. A transient is the *peak* over a stage's ops of
what they hold at once, and which op holds the most changes with the shape: at short
sequences the MLP's ``4 * h`` intermediate, at long ones the ``s * s`` attention scores
(measured on the built-in gpt: a transient fitted at seq 16, 24 and 32 is 95 KiB over at
48 and 5.3 MiB over at 128). So each figure is first fitted by the polynomial and checked
at every other shape profiled; a figure the polynomial misses anywhere is *stepped*
instead: measured on a :func:`ladder` of shapes (both ends, the middle, halvings of the
top) and read at a shape as the most it is at the corners of the ladder cell around it.
That is exact on the ladder and, for a figure that grows with the shape (every transient
does), never under it between rungs. Sums (saved tensors, boundaries, gradients,
parameters) stay exact polynomials everywhere.

Note [Maxima fitted term by term]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A stepped figure is safe but loose: the built-in gpt's no-save transient at sequence 40,
read off the rung at 64, was 272 KiB against 121 KiB measured; hf:llama's, 8.9 MiB over.
Yet a peak is the largest of the live totals after each of the stage's ops, and each of
those *is* a polynomial. So while a range is profiled, the profiler keeps a peak's totals
as its terms (:class:`remat.core.maxima.Maximum`); where the grid's profiles give a figure
the same number of terms at every grid shape (the stage runs the same ops), each term is
fitted exactly like any sum (:func:`fit_envelope`), those that are never the largest
anywhere in the range are dropped, and the figure at a shape is the largest of the rest
(:func:`eval_envelope`): exact at every shape, not only on the ladder. Every other
profile (the ladder, the timed shapes) checks it to the byte, as a polynomial is checked;
a figure whose terms the grid does not give alike, or that a check misses, is stepped.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from types import MappingProxyType
from typing import Any

from remat.core.errors import CheckFailed, UsageError

__all__ = ["Dim", "ShapeFit", "ShapeRange", "fit_bytes", "fit_times", "ladder", "parse_shapes"]

#: Dimension names with a meaning the profiler knows (docs/shapes.md): which axis of the
#: batch's tensors each one is.
KNOWN_DIMS = ("batch", "seq", "side", "height", "width")
_NAME = re.compile(r"^(batch|seq|side|height|width|axis[1-9])$")
_DIM = re.compile(r"^\s*([A-Za-z0-9_]+)\s*=\s*(\d+)\s*(?:\.\.\s*(\d+))?\s*(?::\s*(\d+))?\s*$")

Shape = tuple[int, ...]
#: Where the runtime reads one dimension: a tensor's position among the tensors of the
#: forward's args then kwargs, an axis, and the offset of that axis's size from the
#: dimension's value (``loss_fn`` calling ``model(ids[:, :-1])``: -1).
InputKey = tuple[int, int, int]


def input_key(value: Sequence[int]) -> InputKey:
    """``[tensor, axis]`` or ``[tensor, axis, offset]`` (files written before offsets: 0)."""
    if len(value) not in (2, 3):
        raise UsageError(f"an input key is [tensor, axis] or [tensor, axis, offset], got "
                         f"{list(value)!r}; profile the range again")
    tensor, axis, *rest = (int(v) for v in value)
    return tensor, axis, rest[0] if rest else 0


def input_key_list(key: InputKey) -> list[int]:
    """The key as written: the offset only where it is not 0."""
    return list(key) if key[2] else list(key[:2])


@dataclass(frozen=True)
class Dim:
    """One varying dimension: ``lo..hi`` in steps of ``step``."""

    name: str
    lo: int
    hi: int
    step: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise UsageError(
                f"dimension {self.name!r} is not one remat knows; name it batch, seq, side, "
                "height, width or axisN (the batch tensors' axis N)")
        for what in ("lo", "hi", "step"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"dimension {self.name}: {what}={value!r} must be a whole "
                                 "number >= 1")
        if self.hi < self.lo:
            raise UsageError(f"dimension {self.name}={self.lo}..{self.hi} runs backwards; "
                             "give the smaller size first")
        if (self.hi - self.lo) % self.step:
            raise UsageError(
                f"dimension {self.name}={self.lo}..{self.hi}:{self.step}: {self.hi} is not "
                f"{self.lo} plus a whole number of steps of {self.step}; end the range at "
                f"{self.lo + (self.hi - self.lo) // self.step * self.step}")

    @property
    def degree(self) -> int:
        """The polynomial degree bytes have in this dimension (module docstring)."""
        return 1 if self.name == "batch" else 2

    @property
    def count(self) -> int:
        return (self.hi - self.lo) // self.step + 1

    def values(self) -> range:
        return range(self.lo, self.hi + 1, self.step)

    def holds(self, value: int) -> bool:
        return self.lo <= value <= self.hi and (value - self.lo) % self.step == 0

    def __str__(self) -> str:
        if self.lo == self.hi:
            return f"{self.name}={self.lo}"
        return f"{self.name}={self.lo}..{self.hi}" + (f":{self.step}" if self.step > 1 else "")


@dataclass(frozen=True)
class ShapeRange:
    """The dimensions that vary, in a fixed order (a shape lists their values so)."""

    dims: tuple[Dim, ...]

    def __post_init__(self) -> None:
        dims = tuple(self.dims)
        if not dims or not all(isinstance(d, Dim) for d in dims):
            raise UsageError("a shape range needs at least one dimension, e.g. seq=128..2048")
        names = [d.name for d in dims]
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice is not None:
            raise UsageError(f"dimension {twice!r} is named twice; name each dimension once")
        if "side" in names and ({"height", "width"} & set(names)):
            raise UsageError("side is height and width together; name side, or height and "
                             "width, not both")
        object.__setattr__(self, "dims", dims)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dims)

    @property
    def lo(self) -> Shape:
        return tuple(d.lo for d in self.dims)

    @property
    def hi(self) -> Shape:
        return tuple(d.hi for d in self.dims)

    @property
    def size(self) -> int:
        """How many shapes the lattice holds."""
        return math.prod(d.count for d in self.dims)

    def lattice(self) -> Iterator[Shape]:
        return itertools.product(*(d.values() for d in self.dims))

    def holds(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.dims) and all(
            d.holds(v) for d, v in zip(self.dims, shape, strict=True))

    def spans(self, shape: Sequence[int]) -> bool:
        """``shape`` lies between the range's ends, on its steps or not."""
        return len(shape) == len(self.dims) and all(
            d.lo <= v <= d.hi for d, v in zip(self.dims, shape, strict=True))

    @property
    def box_size(self) -> int:
        """How many whole-number shapes lie between the ends, on the steps or not."""
        return math.prod(d.hi - d.lo + 1 for d in self.dims)

    def between(self) -> Iterator[Shape]:
        """Every whole-number shape between the ends that is off the lattice."""
        return (s for s in itertools.product(*(range(d.lo, d.hi + 1) for d in self.dims))
                if not self.holds(s))

    def up(self, shape: Sequence[int]) -> Shape:
        """The lattice shape at or above ``shape`` in every dimension (``shape`` between
        the ends): where a padding collator that rounds up would put it."""
        return tuple(d.lo + -(-(v - d.lo) // d.step) * d.step
                     for d, v in zip(self.dims, shape, strict=True))

    def shape_text(self, shape: Sequence[int]) -> str:
        return ",".join(f"{d.name}={v}" for d, v in zip(self.dims, shape, strict=True))

    def __str__(self) -> str:
        return ",".join(map(str, self.dims))

    def to_dict(self) -> list[dict[str, Any]]:
        return [{"name": d.name, "lo": d.lo, "hi": d.hi, "step": d.step} for d in self.dims]

    @classmethod
    def from_dict(cls, data: object) -> ShapeRange:
        if not isinstance(data, list) or not all(isinstance(d, Mapping) for d in data):
            raise UsageError("a shape range must be a list of {name, lo, hi, step} objects")
        for d in data:
            if set(d) != {"name", "lo", "hi", "step"}:
                raise UsageError(f"shape range dimension {dict(d)!r} must have exactly the "
                                 "keys name, lo, hi and step")
        return cls(tuple(Dim(d["name"], d["lo"], d["hi"], d["step"]) for d in data))


def parse_shapes(text: str | Mapping[str, Any] | ShapeRange) -> ShapeRange:
    """``"batch=1..16,seq=128..2048:8"`` (or ``{"seq": (128, 2048, 8)}``) as a range."""
    if isinstance(text, ShapeRange):
        return text
    if isinstance(text, Mapping):
        dims = []
        for name, spec in text.items():
            values = (spec,) if isinstance(spec, int) else tuple(spec)
            if len(values) not in (1, 2, 3):
                raise UsageError(f"shapes[{name!r}]={spec!r} must be (lo, hi) or (lo, hi, step)")
            lo, hi, step = (values[0], values[0], 1) if len(values) == 1 else (
                values[0], values[1], values[2] if len(values) == 3 else 1)
            dims.append(Dim(str(name), lo, hi, step))
        return ShapeRange(tuple(dims))
    if not isinstance(text, str) or not text.strip():
        raise UsageError(f"shapes={text!r} is not a range; write e.g. batch=1..16,seq=128..2048")
    dims = []
    for part in text.split(","):
        found = _DIM.match(part)
        if found is None:
            raise UsageError(f"{part.strip()!r} is not a dimension range; write name=lo..hi "
                             "or name=lo..hi:step, e.g. seq=128..2048:8")
        name, lo, hi, step = found.groups()
        dims.append(Dim(name, int(lo), int(hi if hi is not None else lo),
                        int(step) if step is not None else 1))
    return ShapeRange(tuple(dims))


# -- the byte polynomials ---------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def monomials(dims: ShapeRange) -> tuple[Shape, ...]:
    """The exponents of the byte polynomial's terms: every ``e`` with ``e[k] <= degree``."""
    return tuple(itertools.product(*(range(_degree(d) + 1) for d in dims.dims)))


def _degree(d: Dim) -> int:
    return min(d.degree, d.count - 1)


def byte_grid(dims: ShapeRange) -> tuple[Shape, ...]:
    """The shapes the byte fit goes through: per dimension ``degree + 1`` lattice values at
    the bottom of its range, spaced by at least 8 where the range allows (module
    docstring)."""
    axes = []
    for d in dims.dims:
        n = _degree(d) + 1
        gap = max(1, min(math.ceil(8 / d.step), (d.count - 1) // max(1, n - 1)))
        axes.append(tuple(d.lo + k * gap * d.step for k in range(n)))
    return tuple(itertools.product(*axes))


def ladder(dims: ShapeRange) -> tuple[tuple[int, ...], ...]:
    """Per dimension, the values where the stepped figures are measured (Note [Figures
    that are maxima]): both ends, the middle and, below the top, halvings of it."""
    out = []
    for d in dims.dims:
        found = {d.lo, d.hi, middle(d)}
        if d.name != "batch":
            for k in (1, 2, 3):
                v = d.lo + (d.hi // 2 ** k - d.lo) // d.step * d.step
                if v > d.lo:
                    found.add(v)
        out.append(tuple(sorted(found)))
    return tuple(out)


def middle(d: Dim) -> int:
    """The lattice value nearest the geometric mean of the ends."""
    target = math.sqrt(d.lo * d.hi)
    return min(d.values(), key=lambda v: abs(v - target))


def eval_steps(dims: ShapeRange, rungs: Sequence[Sequence[int]], values: Sequence[int],
               shape: Sequence[int]) -> int:
    """A stepped figure at ``shape``: the most it is at the corners of the ladder cell
    holding ``shape`` (exact on the ladder; above a figure that grows with the shape
    elsewhere)."""
    choices = []
    for x, rung in zip(shape, rungs, strict=True):
        k = next((j for j, v in enumerate(rung) if v >= x), len(rung) - 1)
        choices.append((k,) if rung[k] == x or k == 0 else (k - 1, k))
    strides = [math.prod(len(r) for r in rungs[j + 1:]) for j in range(len(rungs))]
    return max(values[sum(k * m for k, m in zip(corner, strides, strict=True))]
               for corner in itertools.product(*choices))


def _term(shape: Sequence[int], exponents: Sequence[int]) -> int:
    return math.prod(v ** e for v, e in zip(shape, exponents, strict=True))


def _solve_exact(rows: list[list[Fraction]], rhs: list[Fraction]) -> list[Fraction]:
    """Gaussian elimination over the rationals (the grid makes the system square and
    regular)."""
    n = len(rows)
    a = [[*row, y] for row, y in zip(rows, rhs, strict=True)]
    for col in range(n):
        pivot = next(r for r in range(col, n) if a[r][col] != 0)
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col and a[r][col] != 0:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[r][n] / a[r][r] for r in range(n)]


def fit_bytes(dims: ShapeRange, points: Sequence[Shape],
              values: Sequence[Mapping[str, int]]) -> dict[str, tuple[Fraction, ...]]:
    """Per path, the exact coefficients (over :func:`monomials`) through ``values`` at
    ``points`` (:func:`byte_grid`); paths equal at every point are left out (constant)."""
    terms = monomials(dims)
    if len(points) != len(terms):
        raise UsageError(f"the byte fit needs {len(terms)} shapes, got {len(points)}")
    rows = [[Fraction(_term(p, e)) for e in terms] for p in points]
    out = {}
    for path in values[0]:
        ys = [v[path] for v in values]
        if all(y == ys[0] for y in ys):
            continue
        out[path] = tuple(_solve_exact(rows, [Fraction(y) for y in ys]))
    return out


def _over_common_denominator(coefficients: tuple[Fraction, ...]) -> tuple[tuple[int, ...], int]:
    """The coefficients as whole numerators over their least common denominator: the
    polynomial evaluated in integers, exactly, without a Fraction per term (a plan set
    evaluates every figure at hundreds of shapes)."""
    den = math.lcm(*(c.denominator for c in coefficients)) if coefficients else 1
    return tuple(c.numerator * (den // c.denominator) for c in coefficients), den


def eval_bytes(dims: ShapeRange, coefficients: Sequence[Fraction], shape: Sequence[int]) -> int:
    terms = [_term(shape, e) for e in monomials(dims)]
    return _whole_at(dims, _over_common_denominator(tuple(coefficients)), terms, shape)


def _whole_at(dims: ShapeRange, polynomial: tuple[tuple[int, ...], int], terms: Sequence[int],
              shape: Sequence[int]) -> int:
    """A polynomial over a common denominator (:func:`_over_common_denominator`) at a
    shape whose monomials are ``terms``."""
    numerators, den = polynomial
    total = sum(n * t for n, t in zip(numerators, terms, strict=True))
    whole, rest = divmod(total, den)
    if rest:
        raise CheckFailed(f"the byte fit gives {total / den} bytes at "
                          f"{dims.shape_text(shape)}, not a whole number: that shape is not "
                          "on the fitted lattice; profile the range with the step it runs at")
    return whole


def _exact_coefficients(dims: ShapeRange, points: Sequence[Shape], ys: Sequence[int]
                        ) -> tuple[Fraction, ...]:
    rows = [[Fraction(_term(p, e)) for e in monomials(dims)] for p in points]
    return tuple(_solve_exact(rows, [Fraction(y) for y in ys]))


#: shapes evaluated at once while the terms that are never the largest are found
_LATTICE_BLOCK = 4096
#: the largest lattice searched for them; a larger one keeps every term (sound, slower)
_PRUNED_LATTICE = 65536


def fit_envelope(dims: ShapeRange, points: Sequence[Shape],
                 terms_at: Sequence[Sequence[int]]) -> tuple[tuple[Fraction, ...], ...]:
    """The exact polynomials of a maximum's terms (``terms_at[g][i]``: term ``i`` at
    ``points[g]``, the :func:`byte_grid`), less those never the largest at any shape of
    the lattice (Note [Maxima fitted term by term]).

    Which terms can be dropped is found in floating point with a margin of 16 bytes plus a
    millionth: keeping a term that is never the largest changes no value, so the margin
    errs only towards keeping. A lattice of more than ``_PRUNED_LATTICE`` shapes is not
    searched: every distinct term is kept."""
    import numpy as np

    width = len(terms_at[0])
    if len(points) != len(monomials(dims)) or any(len(t) != width for t in terms_at):
        raise UsageError("fit_envelope needs every term at every grid shape")
    columns = list(dict.fromkeys(tuple(t[i] for t in terms_at) for i in range(width)))
    keep = range(len(columns))
    if len(columns) > 1 and dims.size <= _PRUNED_LATTICE:
        exponents = monomials(dims)
        basis = np.array([[float(_term(p, e)) for e in exponents] for p in points])
        values = np.array(columns, dtype=float).T  # grid shapes x terms
        coefficients = np.linalg.solve(basis, values)
        ever = np.zeros(len(columns), dtype=bool)
        lattice = dims.lattice()
        while block := list(itertools.islice(lattice, _LATTICE_BLOCK)):
            at = np.array([[float(_term(s, e)) for e in exponents] for s in block]) @ coefficients
            top = at.max(axis=1, keepdims=True)
            ever |= (at >= top - (16.0 + 1e-6 * np.abs(top))).any(axis=0)
        keep = [int(i) for i in np.nonzero(ever)[0]]
    return tuple(_exact_coefficients(dims, points, columns[i]) for i in keep)


def eval_envelope(dims: ShapeRange, terms: Sequence[Sequence[Fraction]],
                  shape: Sequence[int]) -> int:
    """A maximum fitted term by term, at ``shape``: the largest of its terms there."""
    return max(eval_bytes(dims, c, shape) for c in terms)


# -- the time fits ----------------------------------------------------------------------


def time_basis(dims: ShapeRange, shape: Sequence[int]) -> tuple[float, ...]:
    """``(1, P1, P2)`` at ``shape`` (module docstring); P2 only where it differs from P1."""
    p1 = float(math.prod(shape))
    degrees = [_degree(d) for d in dims.dims]
    if all(k <= 1 for k in degrees):
        return (1.0, p1)
    p2 = float(math.prod(v ** max(k, 1) for v, k in zip(shape, degrees, strict=True)))
    return (1.0, p1, p2)


def fit_times(dims: ShapeRange, points: Sequence[Shape],
              values: Sequence[Mapping[str, float]]) -> dict[str, tuple[float, ...]]:
    """Per path, non-negative least-squares coefficients over :func:`time_basis`."""
    import numpy as np

    basis = np.array([time_basis(dims, p) for p in points], dtype=float)
    out = {}
    for path in values[0]:
        y = np.array([float(v[path]) for v in values])
        out[path] = _nonnegative_fit(basis, y)
    return out


def _nonnegative_fit(basis: Any, y: Any) -> tuple[float, ...]:
    """Least squares with the negative coefficients dropped one at a time (a time never
    shrinks as the shape grows, and noise must not make it)."""
    import numpy as np

    active = list(range(basis.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(basis[:, active], y, rcond=None)
        if all(c >= 0 for c in coef) or len(active) == 1:
            full = [0.0] * basis.shape[1]
            for k, c in zip(active, coef, strict=True):
                full[k] = max(0.0, float(c))
            return tuple(full)
        active.pop(int(np.argmin(coef)))


def eval_time(dims: ShapeRange, coefficients: Sequence[float], shape: Sequence[int]) -> float:
    return max(0.0, sum(c * x for c, x in zip(coefficients, time_basis(dims, shape),
                                               strict=True)))


# -- the fit a profile carries -----------------------------------------------------------


@dataclass(frozen=True)
class FitCheck:
    """A profiled shape the byte fit did not go through, compared with the fit."""

    shape: Shape
    fields: int  # byte figures compared
    exact: int  # of them, equal to the fit's to the byte
    most_over: int = 0  # the most a stepped figure's fit is above the measured one

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "fields": self.fields, "exact": self.exact,
                "most_over": self.most_over}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FitCheck:
        return cls(tuple(data["shape"]), data["fields"], data["exact"], data["most_over"])


@dataclass(frozen=True)
class ShapeFit:
    """How a profile's figures change over a :class:`ShapeRange` (Note [Shape-aware
    profiles]): exact byte polynomials and time fits; the profile's own figures are those
    at ``at``. ``inputs`` says, per dimension, which tensor of the model's forward (its
    position among the tensors of args then kwargs), which axis carries it and at what
    offset (:data:`InputKey`): the runtime reads the shape there (docs/shapes.md)."""

    dims: ShapeRange
    at: Shape
    byte_points: tuple[Shape, ...]
    time_points: tuple[Shape, ...]
    bytes: Mapping[str, tuple[Fraction, ...]] = field(hash=False)
    times: Mapping[str, tuple[float, ...]] = field(hash=False)
    checks: tuple[FitCheck, ...] = ()
    inputs: Mapping[str, InputKey] = field(default_factory=dict, hash=False)
    # Note [Figures that are maxima]: the ladder's values per dimension, and each stepped
    # figure's value at every ladder shape (in itertools.product order)
    rungs: tuple[tuple[int, ...], ...] = ()
    steps: Mapping[str, tuple[int, ...]] = field(default_factory=dict, hash=False)
    # Note [Maxima fitted term by term]: each such figure's terms, exact polynomials
    envelopes: Mapping[str, tuple[tuple[Fraction, ...], ...]] = field(
        default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "envelopes", MappingProxyType(
            {k: tuple(tuple(Fraction(c) for c in t) for t in v)
             for k, v in self.envelopes.items()}))
        object.__setattr__(self, "steps", MappingProxyType(
            {k: tuple(int(x) for x in v) for k, v in self.steps.items()}))
        object.__setattr__(self, "rungs", tuple(tuple(int(x) for x in r) for r in self.rungs))
        object.__setattr__(self, "bytes", MappingProxyType(dict(self.bytes)))
        object.__setattr__(self, "times", MappingProxyType(dict(self.times)))
        object.__setattr__(self, "inputs", MappingProxyType(
            {k: input_key(v) for k, v in self.inputs.items()}))
        object.__setattr__(self, "at", tuple(self.at))
        if not self.dims.holds(self.at):
            raise UsageError(f"a shape fit at {self.at} outside its range {self.dims}")

    @functools.cached_property
    def _whole(self) -> tuple[dict[str, tuple[tuple[int, ...], int]],
                              dict[str, tuple[tuple[tuple[int, ...], int], ...]]]:
        """The polynomials and the maxima's terms over common denominators."""
        return ({p: _over_common_denominator(tuple(c)) for p, c in self.bytes.items()},
                {p: tuple(_over_common_denominator(tuple(c)) for c in terms)
                 for p, terms in self.envelopes.items()})

    def byte_values(self, shape: Sequence[int]) -> dict[str, int]:
        """Every byte figure at ``shape`` (what :meth:`byte_value` gives each, the
        monomials computed once)."""
        terms = [_term(shape, e) for e in monomials(self.dims)]
        polynomials, envelopes = self._whole
        out = {p: _whole_at(self.dims, f, terms, shape) for p, f in polynomials.items()}
        for p, values in self.steps.items():
            out[p] = eval_steps(self.dims, self.rungs, values, shape)
        for p, fs in envelopes.items():
            out[p] = max(_whole_at(self.dims, f, terms, shape) for f in fs)
        return out

    def byte_value(self, path: str, shape: Sequence[int]) -> int:
        if path in self.envelopes:
            return eval_envelope(self.dims, self.envelopes[path], shape)
        if path in self.steps:
            return eval_steps(self.dims, self.rungs, self.steps[path], shape)
        return eval_bytes(self.dims, self.bytes[path], shape)

    def time_value(self, path: str, shape: Sequence[int]) -> float:
        return eval_time(self.dims, self.times[path], shape)

    def to_dict(self) -> dict[str, Any]:
        return {
            "dims": self.dims.to_dict(),
            "at": list(self.at),
            "byte_points": [list(p) for p in self.byte_points],
            "time_points": [list(p) for p in self.time_points],
            "bytes": {k: [_fraction_text(c) for c in v] for k, v in self.bytes.items()},
            "times": {k: list(v) for k, v in self.times.items()},
            "checks": [c.to_dict() for c in self.checks],
            "inputs": {k: input_key_list(v) for k, v in self.inputs.items()},
            "rungs": [list(r) for r in self.rungs],
            "steps": {k: list(v) for k, v in self.steps.items()},
            **({"envelopes": {k: [[_fraction_text(c) for c in t] for t in v]
                              for k, v in self.envelopes.items()}} if self.envelopes else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShapeFit:
        keys = {"dims", "at", "byte_points", "time_points", "bytes", "times", "checks",
                "inputs", "rungs", "steps"}
        if not isinstance(data, Mapping) or not keys <= set(data) <= keys | {"envelopes"}:
            raise UsageError("a profile's shapes must have exactly the keys "
                             f"{', '.join(sorted(keys))} (and envelopes, optional); profile "
                             "the range again")
        try:
            return cls(
                dims=ShapeRange.from_dict(data["dims"]),
                at=tuple(data["at"]),
                byte_points=tuple(tuple(p) for p in data["byte_points"]),
                time_points=tuple(tuple(p) for p in data["time_points"]),
                bytes={k: tuple(Fraction(c) for c in v) for k, v in data["bytes"].items()},
                times={k: tuple(float(c) for c in v) for k, v in data["times"].items()},
                checks=tuple(FitCheck.from_dict(c) for c in data["checks"]),
                inputs={k: tuple(v) for k, v in data["inputs"].items()},
                rungs=tuple(tuple(r) for r in data["rungs"]),
                steps={k: tuple(v) for k, v in data["steps"].items()},
                envelopes={k: tuple(tuple(Fraction(c) for c in t) for t in v)
                           for k, v in data.get("envelopes", {}).items()},
            )
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
            raise UsageError(f"a profile's shapes could not be read ({err}); profile the "
                             "range again") from err


def _fraction_text(c: Fraction) -> int | str:
    return int(c) if c.denominator == 1 else f"{c.numerator}/{c.denominator}"


def shapes_text(dims: ShapeRange, shapes: Iterable[Shape]) -> str:
    return "; ".join(dims.shape_text(s) for s in shapes)
