"""The torch-free half of shape-aware profiles and plan sets (remat.core.shapes): ranges,
the exact byte polynomials against brute force, stepped maxima, the time fits."""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction

import pytest

from remat.core.errors import UsageError
from remat.core.shapes import (
    Dim,
    ShapeFit,
    ShapeRange,
    byte_grid,
    eval_bytes,
    eval_steps,
    eval_time,
    fit_bytes,
    fit_times,
    ladder,
    monomials,
    parse_shapes,
)


def test_a_range_reads_and_writes_as_the_user_types_it() -> None:
    dims = parse_shapes("batch=1..16, seq=128..2048:8")
    assert dims.names == ("batch", "seq")
    assert str(dims) == "batch=1..16,seq=128..2048:8"
    assert dims.size == 16 * 241
    assert dims.holds((3, 136)) and not dims.holds((3, 130)) and not dims.holds((17, 128))
    assert parse_shapes({"seq": (32, 64, 8)}) == parse_shapes("seq=32..64:8")
    assert ShapeRange.from_dict(dims.to_dict()) == dims


@pytest.mark.parametrize(("text", "says"), [
    ("seq=64..32", "backwards"),
    ("seq=32..70:8", "end the range at 64"),
    ("tokens=1..4", "name it batch, seq"),
    ("seq=1..4,seq=2..5", "named twice"),
    ("side=32..64,height=32..64", "not both"),
    ("seq=1..", "not a dimension range"),
    ("", "not a range"),
])
def test_a_bad_range_is_refused_with_what_to_write(text: str, says: str) -> None:
    with pytest.raises(UsageError, match=says):
        parse_shapes(text)


def _poly(rng: random.Random, dims: ShapeRange, denominator: int = 1) -> dict:
    return {e: Fraction(rng.randint(0, 5000), denominator) for e in monomials(dims)}


def _value(poly: dict, shape: tuple[int, ...]) -> Fraction:
    total = Fraction(0)
    for e, c in poly.items():
        term = Fraction(c)
        for v, k in zip(shape, e, strict=True):
            term *= v ** k
        total += term
    return total


@pytest.mark.parametrize("text", ["seq=16..512:8", "batch=1..8,seq=32..256:16",
                                  "batch=2..6,side=32..96:32"])
def test_byte_polynomials_fitted_at_the_grid_are_exact_everywhere(text: str) -> None:
    rng = random.Random(text)
    dims = parse_shapes(text)
    grid = byte_grid(dims)
    assert len(grid) == len(monomials(dims))  # square system: determined, not fitted
    polys = {f"field{k}": _poly(rng, dims, denominator=2 if k % 2 else 1) for k in range(6)}
    values = [{p: int(_value(poly, x) * 2) for p, poly in polys.items()} for x in grid]
    # bytes are whole numbers: double every polynomial so halves stay whole
    fitted = fit_bytes(dims, grid, values)
    for x in itertools.islice(dims.lattice(), 0, None, max(1, dims.size // 200)):
        for p, poly in polys.items():
            assert eval_bytes(dims, fitted[p], x) == int(_value(poly, x) * 2), (p, x)


def test_a_figure_equal_everywhere_is_left_out_as_constant() -> None:
    dims = parse_shapes("seq=8..64:8")
    grid = byte_grid(dims)
    assert fit_bytes(dims, grid, [{"params": 4096} for _ in grid]) == {}


def test_a_stepped_figure_is_exact_on_the_ladder_and_never_under_a_growing_one() -> None:
    dims = parse_shapes("batch=1..8,seq=16..512:8")
    rungs = ladder(dims)
    assert rungs[0][0] == 1 and rungs[0][-1] == 8 and rungs[1][0] == 16 and rungs[1][-1] == 512

    def peak(b: int, s: int) -> int:  # the larger of an MLP's and attention's transient
        return max(2048 * b * s, 16 * b * s * s) + 64

    values = [peak(*x) for x in itertools.product(*rungs)]
    for x in dims.lattice():
        got = eval_steps(dims, rungs, values, x)
        if all(v in r for v, r in zip(x, rungs, strict=True)):
            assert got == peak(*x)
        assert got >= peak(*x), x


def test_time_fits_recover_noiseless_work_and_stay_non_negative() -> None:
    dims = parse_shapes("batch=1..8,seq=16..512:8")
    points = [(1, 16), (3, 88), (8, 512)]
    exact = [{"t": 0.002 + 1e-6 * b * s + 2e-9 * b * s * s} for b, s in points]
    fit = fit_times(dims, points, exact)["t"]
    assert eval_time(dims, fit, (4, 256)) == pytest.approx(0.002 + 1e-6 * 1024 + 2e-9 * 262144)
    noisy = [{"t": t} for t in (0.5, 0.1, 0.9)]  # a slow first shape: noise, not work
    assert all(c >= 0 for c in fit_times(dims, points, noisy)["t"])


def test_a_shape_fit_survives_its_json() -> None:
    dims = parse_shapes("seq=8..64:8")
    fit = ShapeFit(dims=dims, at=(64,), byte_points=byte_grid(dims), time_points=((8,), (64,)),
                   bytes={"stages.0.saved_bytes.keep": (Fraction(1), Fraction(3), Fraction(1, 2))},
                   times={"step_s": (0.1, 0.2)}, inputs={"seq": (0, 1)},
                   rungs=ladder(dims), steps={"stages.0.bwd_transient_bytes": (1,) * 5})
    again = ShapeFit.from_dict(fit.to_dict())
    assert again.to_dict() == fit.to_dict()
    assert again.byte_value("stages.0.saved_bytes.keep", (16,)) == 1 + 48 + 128


def test_dims_name_only_what_the_profiler_knows() -> None:
    with pytest.raises(UsageError, match="whole number"):
        Dim("seq", 0, 8)
    assert Dim("axis2", 4, 8).degree == 2 and Dim("batch", 1, 4).degree == 1


def test_a_polynomial_not_whole_at_a_profiled_shape_is_a_figure_that_does_not_fit() -> None:
    from remat.core.errors import CheckFailed
    from remat.core.shape_profiles import _fits
    from remat.core.shapes import byte_grid, eval_bytes, fit_bytes, parse_shapes

    dims = parse_shapes("seq=17..65")  # step 1, as a range inferred from 17, 41 and 65
    grid = byte_grid(dims)
    # a maximum that doubles between the grid's shapes (17, 25, 33): the quadratic through
    # them is not whole at 32
    assert grid == ((17,), (25,), (33,))
    values = [{"peak": 1000 * 2 ** k} for k in range(3)]
    fitted = fit_bytes(dims, grid, values)
    with pytest.raises(CheckFailed, match="not a whole number"):
        eval_bytes(dims, fitted["peak"], (32,))
    assert not _fits(dims, fitted, values[0], "peak", (32,), 4000)  # stepped, not refused
    assert _fits(dims, fitted, values[0], "peak", grid[1], values[1]["peak"])


@pytest.mark.parametrize("text", ["seq=16..256:8", "batch=1..6,seq=8..96:8", "side=8..40:4"])
def test_a_maximum_fitted_term_by_term_equals_brute_force_at_every_shape(text: str) -> None:
    """Note [Maxima fitted term by term]: terms that cross (a linear one largest at short
    shapes, a quadratic one at long ones) and terms never the largest; the envelope fitted
    from the grid alone is the maximum at every lattice shape, and keeps only terms that
    are the largest somewhere."""
    from remat.core.shapes import eval_envelope, fit_envelope

    dims = parse_shapes(text)
    grid = byte_grid(dims)
    rng = random.Random(text)
    for _ in range(5):
        polys = [_poly(rng, dims) for _ in range(6)]
        polys.append({e: Fraction(0) for e in monomials(dims)})  # a floor (max(0, ...))
        below = {e: c - 1 if sum(e) == 0 else c for e, c in polys[0].items()}
        polys.append(below)  # always 1 under the first: never the largest
        terms_at = [[int(_value(p, s)) for p in polys] for s in grid]
        fitted = fit_envelope(dims, grid, terms_at)
        for shape in dims.lattice():
            want = max(int(_value(p, shape)) for p in polys)
            assert eval_envelope(dims, fitted, shape) == want, shape
        assert len(fitted) < len(polys)  # the term 1 under the first is dropped
        largest_somewhere = {
            max(range(len(polys)), key=lambda i: (_value(polys[i], s), -i))
            for s in dims.lattice()}
        assert len(fitted) >= len(largest_somewhere)


def test_a_shape_fit_with_maxima_survives_its_json() -> None:
    dims = parse_shapes("seq=8..64:8")
    # 100 + s, largest at short sequences; s * s / 2 at long ones
    terms = ((Fraction(100), Fraction(1), Fraction(0)), (Fraction(0), Fraction(0), Fraction(1, 2)))
    fit = ShapeFit(dims=dims, at=(64,), byte_points=byte_grid(dims), time_points=((8,), (64,)),
                   bytes={}, times={}, envelopes={"stages.0.nosave_transient_bytes": terms})
    again = ShapeFit.from_dict(fit.to_dict())
    assert again.to_dict() == fit.to_dict()
    path = "stages.0.nosave_transient_bytes"
    assert again.byte_value(path, (8,)) == 108 and again.byte_value(path, (64,)) == 2048
    older = {k: v for k, v in fit.to_dict().items() if k != "envelopes"}
    assert ShapeFit.from_dict(older).envelopes == {}  # a profile written before maxima


@pytest.mark.parametrize("text", ["seq=8..64:8", "batch=1..6,seq=8..96:8"])
def test_every_figure_at_once_equals_each_figure_in_rationals(text: str) -> None:
    """ShapeFit.byte_values (integer arithmetic over a common denominator, what a plan set
    reads at hundreds of shapes) gives every polynomial, stepped figure and maximum what
    the rational polynomial and byte_value give, and refuses a shape where a figure is not
    whole as eval_bytes does."""
    from remat.core.errors import CheckFailed

    dims = parse_shapes(text)
    rng = random.Random(text)
    polys = {f"stages.{k}.saved_bytes.keep": _poly(rng, dims, denominator=k + 1)
             for k in range(3)}
    grid = byte_grid(dims)
    # whole at every lattice shape: fitted through whole values, scaled by the denominator
    values = [{p: int(_value(poly, x) * (k + 1)) for k, (p, poly) in enumerate(polys.items())}
              for x in grid]
    for row, x in zip(values, grid, strict=True):  # whole everywhere, coefficients in halves
        row["stages.1.saved_bytes.keep"] = x[-1] * (x[-1] + 1) // 2
    fitted = fit_bytes(dims, grid, values)
    assert any(c.denominator == 2 for c in fitted["stages.1.saved_bytes.keep"])
    terms = tuple(tuple(_poly(rng, dims).values()) for _ in range(3))
    rungs = ladder(dims)
    fit = ShapeFit(dims=dims, at=dims.hi, byte_points=grid, time_points=(dims.lo, dims.hi),
                   bytes=fitted, times={}, rungs=rungs,
                   steps={"stages.0.bwd_transient_bytes": tuple(
                       range(len(list(itertools.product(*rungs)))))},
                   envelopes={"stages.0.nosave_transient_bytes": terms})
    for x in itertools.islice(dims.lattice(), 0, None, 7):
        got = fit.byte_values(x)
        assert set(got) == {*fitted, "stages.0.bwd_transient_bytes",
                            "stages.0.nosave_transient_bytes"}
        for path, value in got.items():
            assert value == fit.byte_value(path, x), (path, x)
        for path, coefficients in fitted.items():
            exact = sum((c * math.prod(v ** e for v, e in zip(x, es, strict=True))
                         for c, es in zip(coefficients, monomials(dims), strict=True)),
                        Fraction(0))
            assert Fraction(got[path]) == exact, (path, x)
        assert got["stages.1.saved_bytes.keep"] == x[-1] * (x[-1] + 1) // 2
    half = ShapeFit(dims=dims, at=dims.hi, byte_points=grid, time_points=(dims.lo, dims.hi),
                    bytes={"p": (Fraction(1, 2),) + (Fraction(0),) * (len(monomials(dims)) - 1)},
                    times={})
    with pytest.raises(CheckFailed, match="not a whole number"):
        half.byte_values(dims.lo)
