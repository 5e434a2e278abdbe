"""The planning core: problem files, the simulator, budgets and solvers.

The optimal solver is checked against brute force: every nested region plan with every
option per stage is scored by the simulator, on random heterogeneous chains, at every
budget (one-byte slots, so the DP's table covers them all at once).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remat.core import theory
from remat.core.errors import CheckFailed, UsageError
from remat.core.plan_format import Plan, Region
from remat.core.solve import Problem, Simulation, StageCost, dp, parse_budget, simulate, solvers
from remat.core.solve.simulator import plan_tree
from remat.core.stage_record import HeldRead
from remat.core.units import format_bytes

FIXTURES = Path(__file__).parent / "fixtures"
MiB = 1 << 20


def load(name: str) -> Problem:
    return Problem.load(FIXTURES / f"chain_{name}.json")


def peak(plan: Plan) -> int:
    assert plan.predicted_peak_bytes is not None
    return plan.predicted_peak_bytes


def seconds(plan: Plan) -> float:
    assert plan.predicted_step_time_s is not None
    return plan.predicted_step_time_s


def scaled(problem: Problem, factor: int) -> Problem:
    """The same problem with every byte count (and the host bandwidth) times ``factor``."""
    data = problem.to_dict()
    for key, value in data.items():
        if key.endswith("_bytes") and value is not None:
            data[key] = value * factor
    for s in data["stages"]:
        for key, value in s.items():
            if key.endswith("_bytes") and isinstance(value, int):
                s[key] = value * factor
        s["saved_bytes"] = {o: v * factor for o, v in s["saved_bytes"].items()}
        if "bwd_transient_by_option" in s:
            s["bwd_transient_by_option"] = {
                o: v * factor for o, v in s["bwd_transient_by_option"].items()
            }
    if problem.offload_bandwidth_bytes_per_s is not None:
        data["offload_bandwidth_bytes_per_s"] = problem.offload_bandwidth_bytes_per_s * factor
    return Problem.from_dict(data)


# -- brute force ------------------------------------------------------------------------------


def _levels(start: int, stop: int, inside: bool) -> Iterator[list[tuple[int, int]]]:
    """Every region list for one level over [start, stop) (``inside``: not the parent again)."""
    if start == stop:
        yield []
        return
    yield from _levels(start + 1, stop, False)  # the first stage is bare
    for end in range(start + 1, stop + 1):
        if inside and end == stop:
            continue
        for inner in _levels(start, end, True):
            for rest in _levels(end, stop, False):
                yield [(start, end), *inner, *rest]


def _spans_a_break(regions: Iterable[Region], problem: Problem) -> bool:
    return any(r.start < b < r.stop for r in regions for b in problem.breaks)


def _choices(problem: Problem) -> Iterator[tuple[tuple[Region, ...], tuple[str, ...]]]:
    """Every plan the chain allows (no region over a chain break), as regions and options."""
    for regions in _levels(0, problem.n, False):
        rs = tuple(Region(*r) for r in regions)
        if _spans_a_break(rs, problem):
            continue
        for options in itertools.product(*(problem.options(i) for i in range(problem.n))):
            yield rs, options


def all_plans(problem: Problem) -> Iterator[Plan]:
    """Every plan the chain allows (no region over a chain break)."""
    for rs, options in _choices(problem):
        yield Plan(problem.stage_names, rs, options)


_FORKED: list[Problem] = []  # the problem a forked worker scores (it does not pickle)


def _forked_scores(part: int, parts: int) -> list[tuple[int, float]]:
    return _scores(_FORKED[0], part, parts)


def _scores(problem: Problem, part: int, parts: int) -> list[tuple[int, float]]:
    out = []
    for k, (rs, options) in enumerate(_choices(problem)):
        if k % parts == part:  # a worker builds only the plans it scores
            sim = simulate(Plan(problem.stage_names, rs, options), problem)
            out.append((sim.peak_bytes, sim.step_time_s))
    return out


#: Above this many plans the brute force is split over the machine's cores (forked: the
#: simulator is pure Python, and the six-stage chains are 25,216 to 100,864 plans each).
_SPLIT_ABOVE = 1500


def brute_force(problem: Problem) -> list[tuple[int, float]]:
    """(peak, step time) of every plan (in no particular order)."""
    options = math.prod(len(problem.options(i)) for i in range(problem.n))
    parts = min(len(os.sched_getaffinity(0)), 4)
    if parts < 2 or _LEVELS[problem.n] * options <= _SPLIT_ABOVE:
        return _scores(problem, 0, 1)
    _FORKED[:] = [problem]
    try:
        with multiprocessing.get_context("fork").Pool(parts) as pool:
            found = pool.starmap(_forked_scores, [(k, parts) for k in range(parts)])
    finally:
        _FORKED.clear()
    return [score for part in found for score in part]


def test_brute_force_counts_every_laminar_family() -> None:
    # Level arrangements L(n) = 2, 8, 48, 352, 2880, 25216 (a region's inside is half of L).
    counts = [sum(1 for _ in _levels(0, n, False)) for n in range(1, 7)]
    assert counts == [2, 8, 48, 352, 2880, 25216]


# -- random chains ------------------------------------------------------------------------------

_LEVELS = [1, 2, 8, 48, 352, 2880, 25216]  # region arrangements of n stages
_MAX_PLANS = 6000  # keeps one brute force under half a second


@st.composite
def chains(draw: st.DrawFn, max_n: int = 5, breaks: bool = False, reads: bool = False,
           held: bool = False) -> Problem:
    """Random heterogeneous chains with small integer sizes and integer times (``breaks``:
    some links are chain breaks; ``reads``: stages read tensors made before them, which
    regions opening later hold; ``held``: the model's code holds some inputs in forward)."""
    n = draw(st.integers(1, max_n))
    small = st.integers(0, 6)
    a = [draw(small) for _ in range(n + 1)]
    offload = draw(st.booleans())
    selective = [draw(st.booleans()) for _ in range(n)]
    # a second selective option, whose backward is also that of the stage rebuilt in full
    # (Note [A selective stage rebuilt in full] in the simulator)
    nothing = [sel and draw(st.booleans()) for sel in selective]

    def count() -> int:
        return _LEVELS[n] * math.prod(1 + sel + no + offload
                                      for sel, no in zip(selective, nothing, strict=True))

    while count() > _MAX_PLANS and any(nothing):
        nothing[max(i for i, no in enumerate(nothing) if no)] = False
    while count() > _MAX_PLANS and any(selective):
        selective[max(i for i, sel in enumerate(selective) if sel)] = False
    if count() > _MAX_PLANS:
        offload = False
    stages = []
    for i in range(n):
        keep = draw(st.integers(0, 10))
        saved: dict[str, int] = {"keep": keep}
        extra: dict[str, float] = {}
        by_option: dict[str, int] = {}
        taped: dict[str, int] = {}  # a taped forward's own transient
        if selective[i]:
            saved["selective:save-matmuls"] = draw(st.integers(0, keep))
            extra["selective:save-matmuls"] = float(draw(st.integers(0, 2)))
            if draw(st.booleans()):  # its replay needs another backward transient than keep
                by_option["selective:save-matmuls"] = draw(st.integers(0, 6))
            if draw(st.booleans()):  # its frame saves nothing as it goes: another peak
                taped["selective:save-matmuls"] = draw(st.integers(0, 8))
        if selective[i] and nothing[i]:
            saved["selective:save-nothing"] = draw(st.integers(0, saved["selective:save-matmuls"]))
            extra["selective:save-nothing"] = float(draw(st.integers(0, 3)))
            by_option["selective:save-nothing"] = draw(st.integers(0, 6))
            taped["selective:save-nothing"] = draw(st.integers(0, 8))
        if offload and draw(st.booleans()):
            saved["offload"] = draw(st.integers(0, 12))  # else keep + input
        stages.append(StageCost(
            f"s{i}", a[i], a[i + 1], saved,
            fwd_s=float(draw(st.integers(1, 3))), bwd_s=2.0,
            rebuild_s=float(draw(st.integers(0, 3))), extra_bwd_s=extra,
            fwd_transient_bytes=draw(st.integers(0, 3)),
            bwd_transient_bytes=draw(st.integers(0, 3)),
            nosave_transient_bytes=draw(st.none() | st.integers(0, 8)),
            grad_bytes=draw(st.integers(0, 4)),
            saves_input=draw(st.booleans()),
            break_before="glue" if breaks and i > 0 and draw(st.booleans()) else None,
            bwd_transient_by_option=by_option,
            fwd_transient_by_option=taped,
            pending_grad_bytes=draw(st.integers(0, 3)),
            reads=tuple(
                HeldRead(10 * i + t, made, draw(st.integers(1, 6)), boundary=draw(st.booleans()),
                         by_call=draw(st.booleans()))
                for t, made in enumerate(draw(st.lists(st.integers(0, i), max_size=2)))
            ) if reads else (),
            held_through=draw(st.none() | st.integers(i + 1, n + 1)) if held else None,
            # what a region holding this stage and the next pays for the link between them
            link_s=float(draw(st.integers(0, 2))) if i + 1 < n else 0.0,
        ))
    pre_grads, post_grads = draw(st.integers(0, 6)), draw(st.integers(0, 3))
    attributed = sum(s.grad_bytes for s in stages) + pre_grads + post_grads
    pre_chain = draw(st.integers(0, 2))
    post_backward = draw(st.none() | st.integers(0, 6))
    return Problem(
        tuple(stages),
        params_bytes=draw(st.integers(0, 3)),
        grads_bytes=attributed + draw(st.integers(0, 4)),  # the rest: unattributed
        pre_chain_grads_bytes=pre_grads,
        post_chain_grads_bytes=post_grads,
        optimizer_step_bytes=draw(st.integers(0, 12)),
        optimizer_state_bytes=draw(st.integers(0, 2)),
        pre_chain_bytes=pre_chain,
        # the post-chain's backward apart from its forward, and what the model's code alone
        # held of the pre-chain, gone at the forward's return (which needs the first)
        post_chain_backward_bytes=post_backward,
        pre_chain_at_return_bytes=0 if post_backward is None else draw(st.integers(0, pre_chain)),
        post_chain_bytes=draw(st.integers(0, 6)),
        inputs_bytes=draw(st.integers(0, 2)),
        region_overhead_s=float(draw(st.integers(0, 2))),
        region_overhead_bytes=draw(st.integers(0, 2)),
        # Powers of two keep every time an exact float, so sums compare exactly.
        offload_bandwidth_bytes_per_s=draw(st.sampled_from([1.0, 2.0, 4.0])) if offload else None,
        early_stop=draw(st.booleans()),
    )


def constant_s(problem: Problem) -> float:
    return sum(s.fwd_s + s.bwd_s for s in problem.stages) + problem.outside_chain_s


def check_against_brute_force(problem: Problem) -> None:
    scores = brute_force(problem)
    base = problem.backward_base_bytes
    top = max(peak for peak, _ in scores) - base + 2
    model = dp.Model(problem, 1)  # one-byte slots: exact
    fast = dp.numpy_tables(model, top)
    slow = dp.python_tables(model, top)
    assert np.array_equal(fast.top, slow.top)
    assert np.array_equal(fast.seg0, slow.seg0)
    assert np.array_equal(fast.seg1, slow.seg1)
    assert np.array_equal(fast.segp, slow.segp)
    least = min(peak for peak, _ in scores)
    assert solvers.minimum_budget(problem) == least
    assert simulate(solvers.min_peak(problem), problem).peak_bytes == least
    previous = math.inf
    for m in range(top + 1):
        best = min((t for peak, t in scores if peak <= base + m), default=math.inf)
        got = fast.top[0, m] + constant_s(problem)
        assert got == best or (math.isinf(got) and math.isinf(best)), (m, got, best)
        assert got <= previous  # more budget is never slower
        previous = got
        if math.isfinite(got):
            regions, options = dp.reconstruct(fast, m)
            plan = Plan(problem.stage_names, tuple(Region(*r) for r in regions), tuple(options))
            sim = simulate(plan, problem)
            assert sim.peak_bytes <= base + m
            assert sim.step_time_s == got


@settings(max_examples=40, deadline=None)
@given(chains())
def test_optimal_equals_brute_force_at_every_budget(problem: Problem) -> None:
    check_against_brute_force(problem)


@settings(max_examples=40, deadline=None)
@given(chains(breaks=True))
def test_optimal_equals_brute_force_over_plans_without_regions_across_breaks(
    problem: Problem,
) -> None:
    check_against_brute_force(problem)  # every table path, the minimum, the plans
    for budget in {max(2, solvers.minimum_budget(problem)), max(2, peak(solvers.none(problem)))}:
        assert not _spans_a_break(solvers.optimal(problem, budget).regions, problem)
    for name in ("per-stage", "segments-k", "megatron-uniform"):
        assert not _spans_a_break(solvers.solve(name, problem).regions, problem)


@settings(max_examples=40, deadline=None)
@given(chains(reads=True), st.data())
def test_optimal_keeps_the_budget_where_regions_hold_tensors_read_from_before_them(
    problem: Problem, data: st.DataObject,
) -> None:
    # The tables do not count reads (Note [Reads from before a region]); the simulator
    # does, and optimal's plan must fit in it at every budget from the minimum it names.
    scores = brute_force(problem)
    least = solvers.minimum_budget(problem)
    assert least >= min(peak for peak, _ in scores)
    assert any(peak <= least for peak, _ in scores)
    top = max(peak for peak, _ in scores)
    for budget in {least, top, data.draw(st.integers(least, top))} - {0}:  # 0 is not a budget
        plan = solvers.optimal(problem, budget)
        assert simulate(plan, problem).peak_bytes == plan.predicted_peak_bytes <= budget
    # The named minimum comes from the smallest-peak plan of the tables, which do not see
    # reads; below it optimal may still find a plan, and then it fits.
    if least > 1:
        try:
            plan = solvers.optimal(problem, least - 1)
        except CheckFailed:
            pass
        else:
            assert simulate(plan, problem).peak_bytes <= least - 1


@settings(max_examples=40, deadline=None)
@given(chains(held=True))
def test_the_tables_charge_what_the_model_holds_in_forward_at_least_as_the_simulator(
    problem: Problem,
) -> None:
    # The simulator holds the boundaries the model's code keeps in the top-level forward
    # exactly; the tables charge them as an upper bound: every plan they accept fits.
    scores = brute_force(problem)
    base = problem.backward_base_bytes
    top = max(peak for peak, _ in scores) - base + 2
    model = dp.Model(problem, 1)
    fast, slow = dp.numpy_tables(model, top), dp.python_tables(model, top)
    assert np.array_equal(fast.top, slow.top) and np.array_equal(fast.seg1, slow.seg1)
    assert solvers.minimum_budget(problem) >= min(peak for peak, _ in scores)
    for m in range(top + 1):
        got = fast.top[0, m] + constant_s(problem)
        best = min((t for p, t in scores if p <= base + m), default=math.inf)
        assert got >= best  # never faster than a plan that really fits
        if math.isfinite(got):
            regions, options = dp.reconstruct(fast, m)
            plan = Plan(problem.stage_names, tuple(Region(*r) for r in regions), tuple(options))
            assert simulate(plan, problem).peak_bytes <= base + m


def test_a_region_holds_what_it_reads_from_before_it_until_its_backward() -> None:
    # x1 (made by s0) is read by the code before s3, as a skip connection is, and a
    # 7-byte tensor made with it is read by s2's call. Region [2, 4) holds both from its
    # forward to its backward; x1 counts once with its other holders (s1 keeps it unless
    # it saves no input). [1, 4) holds only the 7 bytes (x1 is its input); [0, 4) nothing
    # (both are made inside it and rebuilt).
    skip = HeldRead(0, 1, 0, boundary=True)
    bias = HeldRead(1, 1, 7, by_call=True)

    def extra_at(event: str, *regions: Region, s1_keeps_input: bool = True) -> int:
        stages = (StageCost("s0", 10, 100, {"keep": 0}),
                  StageCost("s1", 100, 1, {"keep": 0}, saves_input=s1_keeps_input),
                  StageCost("s2", 1, 1, {"keep": 0}, reads=(bias,)),
                  StageCost("s3", 1, 1, {"keep": 0}, reads=(skip,)))
        with_reads = Problem(stages)
        without = Problem(tuple(dataclasses.replace(s, reads=()) for s in stages))
        plan = Plan(with_reads.stage_names, regions)
        after = dict(simulate(plan, with_reads).events)
        before = dict(simulate(plan, without).events)
        assert set(after) == set(before)
        assert all(after[e] >= before[e] for e in after)
        return after[event] - before[event]

    R = Region
    assert extra_at("rebuild s3 (for [2, 4))", R(2, 4)) == 7
    assert extra_at("rebuild s3 (for [2, 4))", R(2, 4), s1_keeps_input=False) == 107
    assert extra_at("backward s1", R(2, 4), s1_keeps_input=False) == 0  # released
    assert extra_at("rebuild s3 (for [1, 4))", R(1, 4)) == 7
    assert extra_at("rebuild s3 (for [0, 4))", R(0, 4)) == 0
    p = Problem((StageCost("s0", 1, 1, {"keep": 0}, reads=(skip, bias)),))
    round_trip = Problem.from_dict(json.loads(json.dumps(p.to_dict())))
    assert round_trip == p and round_trip.stages[0].reads == (skip, bias)


def test_pending_gradients_ride_with_backward_position_in_both_the_tables_and_the_simulator(
) -> None:
    stages = tuple(StageCost(f"s{i}", 4, 4, {"keep": 8}, pending_grad_bytes=p)
                   for i, p in enumerate((0, 50, 0)))
    p = Problem(stages)
    q = Problem(tuple(dataclasses.replace(s, pending_grad_bytes=0) for s in stages))
    for regions in [(), (Region(1, 2),), (Region(0, 3),)]:
        with_pending = dict(simulate(Plan(p.stage_names, regions), p).events)
        without = dict(simulate(Plan(q.stage_names, regions), q).events)
        extra = {e: with_pending[e] - without[e] for e in without}
        assert extra.pop("backward s1") == 50
        for e in [e for e in extra if e.startswith("rebuild") and "(for [0, 3))" not in e]:
            assert extra.pop(e) == 50  # [1, 2) is rebuilt where s1's backward is next
        assert set(extra.values()) == {0}, extra
    check_against_brute_force(p)  # the tables count it where the simulator does


def test_recipes_are_cut_at_breaks_and_the_simulator_refuses_a_region_across_one() -> None:
    saved = {"keep": 1}
    stages = [StageCost(f"h.{i}", 1, 1, saved, break_before="reads .item()" if i == 3 else None)
              for i in range(7)]
    p = Problem(tuple(stages))
    R = Region
    assert p.breaks == (3,)
    assert solvers.segments(p, 2).regions == (R(0, 3), R(3, 4), R(4, 7))
    assert solvers.megatron_uniform(p, 7).regions == (R(0, 3), R(3, 7))
    plan = Plan(p.stage_names, (R(2, 5),))
    with pytest.raises(UsageError, match=r"region \[2, 5\) spans a chain break before stage "
                       r"'h.3' \(reads .item\(\)\); end the region at stage 3"):
        simulate(plan, p)
    round_trip = Problem.from_dict(json.loads(json.dumps(p.to_dict())))
    assert round_trip == p and round_trip.stages[3].break_before == "reads .item()"


@settings(max_examples=15, deadline=None)
@given(chains(max_n=4), st.data())
def test_optimal_solver_matches_brute_force_and_both_paths(problem: Problem, data: st.DataObject
                                                           ) -> None:
    scores = brute_force(problem)
    least = solvers.minimum_budget(problem)
    if least > 1:
        with pytest.raises(CheckFailed):
            solvers.optimal(problem, least - 1)
    high = max(peak for peak, _ in scores) + 1
    low = max(least, 1)  # a budget is above zero
    budgets = sorted({low, high, *data.draw(st.lists(st.integers(low, high), max_size=4))})
    times = []
    for budget in budgets:
        plan = solvers.optimal(problem, budget)  # budgets below 500 bytes: one-byte slots
        assert plan == dataclasses.replace(
            solvers.optimal(problem, budget, path="python"), solve_time_s=plan.solve_time_s)
        best = min(t for peak, t in scores if peak <= budget)
        assert plan.predicted_step_time_s == best
        assert peak(plan) <= budget
        times.append(plan.predicted_step_time_s)
    assert times == sorted(times, reverse=True)


def _six(selective: tuple[int, ...], early_stop: bool, grads: bool = False) -> Problem:
    a = [3, 5, 2, 6, 1, 4, 2]
    keeps = [7, 3, 9, 2, 8, 5]
    stages = []
    for i in range(6):
        saved = {"keep": keeps[i]}
        extra = {}
        if i in selective:
            saved["selective:save-matmuls"] = keeps[i] // 3
            extra["selective:save-matmuls"] = 1.0
        stages.append(StageCost(f"h.{i}", a[i], a[i + 1], saved, fwd_s=float(1 + i % 3), bwd_s=3.0,
                                rebuild_s=float(1 + (i * 5) % 3), extra_bwd_s=extra,
                                fwd_transient_bytes=i % 2, bwd_transient_bytes=(i * 7) % 3,
                                grad_bytes=(i * 3) % 5 if grads else 0,
                                saves_input=not grads or i % 3 != 1))
    if grads:  # gradients by position, and stages 1 and 4 that let their input go
        return Problem(tuple(stages), params_bytes=4, grads_bytes=16, optimizer_state_bytes=8,
                       pre_chain_grads_bytes=3, post_chain_grads_bytes=2, optimizer_step_bytes=6,
                       post_chain_bytes=5, region_overhead_s=0.5, region_overhead_bytes=1,
                       early_stop=early_stop)
    return Problem(tuple(stages), params_bytes=4, grads_bytes=4, optimizer_state_bytes=8,
                   post_chain_bytes=5, region_overhead_s=0.5, region_overhead_bytes=1,
                   early_stop=early_stop)


@pytest.mark.parametrize(("selective", "early_stop", "grads"), [
    ((), True, False), ((), False, False), ((1, 4), True, False), ((), True, True),
    ((1, 4), False, True)])
def test_optimal_equals_brute_force_on_six_stages(selective: tuple[int, ...], early_stop: bool,
                                                  grads: bool) -> None:
    check_against_brute_force(_six(selective, early_stop, grads))


# -- the simulator by hand ------------------------------------------------------------------------


def test_simulator_walks_the_tiny_chain_as_computed_by_hand() -> None:
    p = load("tiny_3")
    sim = simulate(Plan(p.stage_names), p)
    # Fixed 17 in forward (params 5, optimizer 10, input 1, pre-chain 1), 22 with grads.
    # x = 2, 3, 1, 2; saved 4, 6, 3; forward transients 1, 0, 2; backward 1, 2, 0.
    assert [e.live_bytes for e in sim.events] == [
        19,  # forward pre-chain: fixed + x0
        27,  # s0: x0 + x1 + saved 4 + transient 1
        33,  # s1: kept (x0 + 4) + x1 + x2 + 6
        40,  # s2: kept (x0+4, x1+6) + x2 + x3 + 3 + 2
        42,  # post-chain forward: kept 16 + x3 + 4
        47,  # post-chain backward: + grads 5
        44,  # s2 backward: kept 16, gradients of x3 and x2, transient 0
        43,  # s1 backward: x0+4, x1+6, gradients of x2 and x1, transient 2
        34,  # s0 backward
        24,  # pre-chain backward: gradient of x0
        21,  # optimizer step: params, grads, optimizer state, input
    ]
    assert sim.peak_bytes == 47 == p.measured_no_checkpoint_peak_bytes
    assert sim.peak_event == "backward post-chain"
    assert sim.step_time_s == 4 + 8
    assert sim.forward_runs == (1, 1, 1)


def _graded(saves_input: bool = True, optimizer_step_bytes: int = 9) -> Problem:
    stages = (StageCost("s0", 2, 3, {"keep": 4}, grad_bytes=5),
              StageCost("s1", 3, 1, {"keep": 6}, grad_bytes=7, saves_input=saves_input))
    return Problem(stages, params_bytes=1, pre_chain_bytes=1, post_chain_bytes=2,
                   grads_bytes=20, pre_chain_grads_bytes=3, post_chain_grads_bytes=2,
                   optimizer_step_bytes=optimizer_step_bytes)


def test_gradients_appear_at_the_backward_that_creates_them() -> None:
    p = _graded()
    assert p.unattributed_grads_bytes == 3 and p.backward_base_bytes == 2 + 3
    sim = simulate(Plan(p.stage_names), p)
    # F = params 1 + pre-chain 1; x = 2, 3, 1; saved 4, 6; gradients: unattributed 3 from
    # the post-chain's backward, post-chain's 2 and each stage's (5, 7) right after their
    # backward's peak (what a part creates before it is in its transient), pre-chain 3.
    assert [e.live_bytes for e in sim.events] == [
        4,  # forward pre-chain: F + x0
        11,  # s0: x0 + x1 + 4
        18,  # s1: (x0 + 4) + x1 + x2 + 6
        20,  # forward post-chain: + 2
        23,  # backward post-chain: + 3 unattributed gradients
        26,  # s1: kept (x0 + 4, x1) + x2's and x1's gradients + 2 + 6 back in use
        25,  # s0: x0 + 4, x1's and x0's gradients, 2 + 7 parameter gradients
        24,  # pre-chain backward: F + all 20 gradients + x0's gradient
        30,  # optimizer step: params 1 + gradients 20 + its temporaries 9
    ]
    # s1 does not keep its input: x1 goes when s1's forward is done.
    loose = simulate(Plan(p.stage_names), _graded(saves_input=False))
    assert [e.live_bytes for e in loose.events] == [4, 11, 18, 17, 20, 23, 25, 24, 30]
    # selective stages keep their input whatever saves_input says (the checkpoint holds it)
    assert not p.stages[0].keeps_input("offload") and _graded(False).stages[1].keeps_input(
        "selective:save-matmuls")
    # with large optimizer temporaries the step's peak is theirs, whatever the plan
    heavy = _graded(optimizer_step_bytes=40)
    assert simulate(Plan(p.stage_names), heavy).peak_event == "optimizer step"
    assert solvers.minimum_budget(heavy) == 1 + 20 + 40
    for problem in (p, _graded(saves_input=False), heavy):
        check_against_brute_force(problem)


def test_a_region_keeps_its_input_and_rebuilds_in_backward() -> None:
    p = load("tiny_3")
    sim = simulate(Plan(p.stage_names, (Region(0, 2),)), p)
    live = dict(sim.events)
    # Forward inside [0, 2): no-save peaks (transients 0 and 1) over the held x0.
    assert live["forward s0 (in [0, 2), not saved)"] == 17 + 2 + 3 + 0
    assert live["forward s1 (in [0, 2), not saved)"] == 17 + 2 + 3 + 1 + 1
    # s2 keeps; post-chain backward holds x0 (region), x2 + 3 (s2), x3, post 4, grads.
    assert live["backward post-chain"] == 22 + 2 + 1 + 3 + 2 + 4
    # The rebuild of [0, 2) runs with the gradient of x2 (1) alive.
    assert live["rebuild s1 (for [0, 2))"] == 22 + (2 + 4) + 3 + 1 + 6 + 0 + 1
    assert sim.forward_runs == (2, 2, 1)
    assert sim.time.rebuild_s == 1 + 2
    assert sim.time.overhead_s == 0.125


def _runs(regions: tuple[Region, ...], options: tuple[str, ...], early_stop: bool = True
          ) -> Simulation:
    saved = {"keep": 3, "selective:save-matmuls": 1}
    stages = tuple(StageCost(f"b{i}", 2, 2, saved, 1.0, 2.0, 1.0) for i in range(4))
    p = Problem(stages, early_stop=early_stop, offload_bandwidth_bytes_per_s=1.0)
    return simulate(Plan(p.stage_names, regions, options), p)


NESTED = (Region(0, 4), Region(0, 2), Region(2, 4))
KEEP4 = ("keep",) * 4


def test_stage_at_depth_d_runs_d_plus_one_times_without_early_stop() -> None:
    assert _runs(NESTED, KEEP4, early_stop=False).forward_runs == (3, 3, 3, 3)


def test_early_stop_skips_what_the_parent_does_not_need() -> None:
    # [0, 4) needs only the input of its last child [2, 4): its rebuild stops there.
    assert _runs(NESTED, KEEP4).forward_runs == (3, 3, 2, 2)
    # A trailing selective stage hands over its input before running, so the rebuild
    # stops before it; it is rebuilt in full at its own backward (rebuild time, not the
    # partial-rebuild time).
    sel = _runs((Region(0, 4),), ("keep", "keep", "keep", "selective:save-matmuls"))
    assert sel.forward_runs == (2, 2, 2, 2)
    assert sel.time.rebuild_s == 4 and sel.time.option_s == 0
    # Offloaded stages hand over nothing: the rebuild ends at the last keep stage.
    off = _runs((Region(0, 4),), ("keep", "keep", "offload", "offload"))
    assert off.forward_runs == (2, 2, 1, 1)
    assert off.time.rebuild_s == 2
    assert off.time.option_s == 2 * 2 * (2 + 3)  # both ways, saved keep bytes + input
    # Without early stop everything after the region's input runs again.
    assert _runs((Region(0, 4),), ("keep", "keep", "offload", "offload"), False
                 ).forward_runs == (2, 2, 2, 2)


def test_plan_tree_nests_regions() -> None:
    plan = Plan(tuple("abcde"), (Region(0, 4), Region(1, 3), Region(4, 5)))
    top = plan_tree(plan)
    assert [(i.start, i.stop, i.region is not None) for i in top] == [(0, 4, True), (4, 5, True)]
    assert [(i.start, i.stop) for i in top[0].items] == [(0, 1), (1, 3), (3, 4)]


def test_simulate_rejects_plans_that_do_not_fit_the_problem() -> None:
    p = load("tiny_3")
    with pytest.raises(UsageError, match="stage 0 is 'a' but the problem's is 's0'"):
        simulate(Plan(("a", "b", "c")), p)
    with pytest.raises(UsageError, match="2 stages but the problem has 3"):
        simulate(Plan(("s0", "s1")), p)
    with pytest.raises(UsageError, match="no host link"):
        simulate(Plan(p.stage_names, options=("offload", "keep", "keep")), p)
    with pytest.raises(UsageError, match="'s1' has no measured saved bytes"):
        simulate(Plan(p.stage_names, options=("keep", "selective:save-matmuls", "keep")), p)


def test_offload_moves_saved_bytes_off_the_device_at_bandwidth_cost() -> None:
    p = load("hetero_6")
    keep = simulate(Plan(p.stage_names), p)
    off = simulate(Plan(p.stage_names, options=("offload",) + ("keep",) * 5), p)
    s0 = p.stages[0]
    assert off.time.option_s == pytest.approx(2 * s0.offload_bytes / 2.0e10)
    assert off.peak_bytes == keep.peak_bytes - s0.boundary_bytes - s0.saved_bytes["keep"]


# -- closed forms ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n", range(1, 13))
def test_uniform_segments_match_the_textbook_bound(n: int) -> None:
    """Exact peak = textbook + one boundary when the last segment is full, else textbook.

    The textbook counts ``ceil(n/k)`` boundaries plus ``k`` stages of ``A_i = S + A``.
    Exactly: the rebuilt segment's first input is its boundary (counted once, -A) and
    the stage in backward has its incoming and outgoing gradients (+2A). When the last
    segment is shorter it is processed first, and by the time a full segment is rebuilt
    the last boundary is freed: the two effects cancel.
    """
    A, S = 3 * MiB, 5 * MiB
    stages = tuple(StageCost(f"h.{i}", A, A, {"keep": S}, 1.0, 2.0, 1.0, {}, 0, 0, 0)
                   for i in range(n))
    p = Problem(stages)
    for k in range(1, n + 1):
        plan = solvers.megatron_uniform(p, num_layers=k)
        peak = simulate(plan, p).peak_bytes  # no fixed bytes: all activations
        row = theory.segment_row(n, k, A, S + A)
        last = n - (row.segments - 1) * k
        assert peak == row.total_bytes + (A if last == min(k, n) else 0), (n, k)


def test_per_stage_and_none_on_a_uniform_chain() -> None:
    n, A, S = 8, 2 * MiB, 7 * MiB
    stages = tuple(StageCost(f"h.{i}", A, A, {"keep": S}, 1.0, 2.0, 1.5, {}, 0, 0, 0)
                   for i in range(n))
    p = Problem(stages, region_overhead_s=0.25)
    none = simulate(Plan(p.stage_names), p)
    # Everything kept, plus the gradients in and out of the last stage's backward.
    assert none.peak_bytes == n * (A + S) + 2 * A
    per = solvers.per_stage(p)
    assert per.predicted_peak_bytes == n * A + (S + A) + A
    assert per.predicted_step_time_s == none.step_time_s + n * (1.5 + 0.25)
    assert per.baseline_step_time_s == none.step_time_s


# -- solvers --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny_3", "uniform_8", "hetero_6", "gpt2_12"])
def test_every_solver_returns_a_valid_plan_with_predictions(name: str) -> None:
    p = load(name)
    measured = p.measured_no_checkpoint_peak_bytes
    assert measured is not None
    least = solvers.minimum_budget(p)
    budget = max(least, math.floor(0.6 * measured))
    none_time = simulate(Plan(p.stage_names), p).step_time_s
    plans = [
        solvers.none(p), solvers.per_stage(p), solvers.every(p, 2), solvers.segments(p),
        solvers.megatron_uniform(p, 2), solvers.megatron_block(p, 2),
        solvers.selective_everywhere(p), solvers.min_peak(p), solvers.optimal(p, budget),
    ]
    for plan in plans:
        roundtrip = Plan.from_json(plan.to_json())
        assert roundtrip == plan
        sim = simulate(plan, p)
        assert plan.predicted_peak_bytes == sim.peak_bytes
        assert plan.predicted_step_time_s == sim.step_time_s
        assert plan.baseline_step_time_s == none_time
        assert plan.solve_time_s is not None and plan.solve_time_s >= 0
    assert [p.solver for p in plans] == [
        "none", "per-stage", "every-2", f"segments-{round(math.sqrt(p.n))}",
        "megatron-uniform-2", "megatron-block-2", "selective-everywhere", "min-peak", "optimal"]
    assert plans[-1].budget_bytes == budget
    assert peak(plans[-1]) <= budget
    fitting = [seconds(q) for q in plans[:-1] if peak(q) <= budget]
    assert all(seconds(plans[-1]) <= t for t in fitting)
    assert plans[-2].predicted_peak_bytes == least


def test_recipe_shapes() -> None:
    saved = {"keep": 1, "selective:save-matmuls": 0}
    p = Problem(tuple(StageCost(f"h.{i}", 1, 1, saved) for i in range(7)))
    R = Region
    assert solvers.every(p, 3).regions == (R(0, 1), R(3, 4), R(6, 7))
    assert solvers.segments(p, 3).regions == (R(0, 2), R(2, 5), R(5, 7))
    assert solvers.segments(p).regions == (R(0, 2), R(2, 5), R(5, 7))  # round(sqrt(7)) = 3
    assert solvers.megatron_uniform(p, 3).regions == (R(0, 3), R(3, 6), R(6, 7))
    assert solvers.megatron_block(p, 2).regions == (R(0, 1), R(1, 2))
    assert solvers.megatron_block(p, 2).options == ("keep",) * 7
    assert solvers.selective_everywhere(p).options == ("selective:save-matmuls",) * 7
    by_name = dataclasses.replace(solvers.solve("every-k", p, k=3), solve_time_s=None)
    assert by_name == dataclasses.replace(solvers.every(p, 3), solve_time_s=None)
    with pytest.raises(UsageError, match="from 1 to 7"):
        solvers.segments(p, 8)
    with pytest.raises(UsageError, match="not known"):
        solvers.solve("rotor", p)
    with pytest.raises(UsageError, match="does not take"):
        solvers.solve("none", p, k=2)


def test_infeasible_budget_names_the_minimum() -> None:
    p = load("gpt2_12")
    least = solvers.minimum_budget(p)
    with pytest.raises(CheckFailed) as info:
        solvers.optimal(p, least - 1)
    assert format_bytes(least) in str(info.value) and str(least) in str(info.value)
    assert "the smallest peak any plan reaches is" in str(info.value)
    assert info.value.exit_code == 1
    assert solvers.optimal(p, least).predicted_peak_bytes == least


def test_where_the_tables_miss_units_the_minimum_is_named_as_found_not_as_a_bound() -> None:
    # an FSDP2 rank's problem: the tables do not count gathered units, so a plan they never
    # give may peak below the least they find (docs/cost-model.md)
    from remat.core.transforms import per_rank_problem

    p = per_rank_problem(load("gpt2_12"), world_size=2, strategy="fsdp")
    least = solvers.minimum_budget(p)
    with pytest.raises(CheckFailed) as info:
        solvers.optimal(p, least - 1)
    assert f"the smallest peak remat found is {format_bytes(least)} ({least} bytes" \
        in str(info.value)
    assert solvers.optimal(p, least).predicted_peak_bytes <= least


@settings(max_examples=25, deadline=None)
@given(chains(max_n=4), st.integers(2, 40), st.data())
def test_coarse_slots_stay_within_budget(problem: Problem, slots: int, data: st.DataObject
                                         ) -> None:
    """With slots larger than a byte the plan still fits, and is never better than exact."""
    scale = 1 << 20
    big = dataclasses.replace(scaled(problem, scale), slots=slots)
    least = solvers.minimum_budget(big)
    assert least == scale * solvers.minimum_budget(problem)
    low = max(least, scale)
    budgets = [low + scale * i for i in range(12)] + [low + data.draw(st.integers(0, 12 * scale))]
    for budget in budgets:
        plan = solvers.optimal(big, budget)  # never raises at or above the minimum
        assert peak(plan) <= budget
        exact = solvers.optimal(problem, budget // scale)
        assert seconds(plan) >= seconds(exact)


def test_numpy_dp_on_64_stages_is_fast() -> None:
    a = 24 * MiB
    stages = tuple(StageCost(
        f"h.{i}", a, a,
        {"keep": 17 * a + i * 4096, "selective:save-matmuls": 10 * a,
         "selective:save-attention": 14 * a},
        0.01, 0.02, 0.01, {"selective:save-matmuls": 0.002, "selective:save-attention": 0.001},
        4 * a, 6 * a) for i in range(64))
    p = Problem(stages, params_bytes=500 * MiB, grads_bytes=500 * MiB,
                optimizer_state_bytes=1000 * MiB, post_chain_bytes=800 * MiB,
                region_overhead_s=1e-4, offload_bandwidth_bytes_per_s=2e10)
    budget = (solvers.minimum_budget(p) + simulate(Plan(p.stage_names), p).peak_bytes) // 2
    started = time.perf_counter()
    plan = solvers.optimal(p, budget)
    elapsed = time.perf_counter() - started
    assert peak(plan) <= budget
    assert elapsed < 30  # about 1 s on two cores; a guard against a complexity blow-up


def _numba() -> object:
    from remat.core.solve import dp_numba

    if not dp_numba.available():
        pytest.skip("numba is not installed (the fast extra)")
    return dp_numba


@settings(max_examples=40, deadline=None)
@given(chains(breaks=True, held=True), st.integers(0, 40))
def test_numba_tables_equal_numpy_tables(problem: Problem, top: int) -> None:
    dp_numba = _numba()
    model = dp.Model(problem, 1)
    fast = dp_numba.numba_tables(model, top)  # type: ignore[attr-defined]
    ref = dp.numpy_tables(model, top)
    assert np.array_equal(fast.seg0, ref.seg0)
    assert np.array_equal(fast.seg1, ref.seg1)
    assert np.array_equal(fast.segp, ref.segp)
    assert np.array_equal(fast.top, ref.top)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_numba_tables_filled_in_waves_of_tiles_equal_numpy_tables(threads: int) -> None:
    """Chains long enough for many tiles (8 starts x 16 columns) and waves: whichever
    thread fills a tile, and in whatever order a wave's tiles go, every cell is the same."""
    import random

    dp_numba = _numba()
    for seed in range(3):
        rng = random.Random(seed)
        n = rng.randint(30, 50)
        a = [rng.randint(1, 8) * MiB for _ in range(n + 1)]
        stages = tuple(StageCost(
            f"s{i}", a[i], a[i + 1],
            {"keep": rng.randint(2, 12) * a[i], "selective:save-matmuls": rng.randint(1, 4) * a[i]},
            fwd_s=rng.uniform(1e-3, 1e-2), bwd_s=rng.uniform(2e-3, 2e-2),
            rebuild_s=rng.uniform(1e-3, 1e-2),
            extra_bwd_s={"selective:save-matmuls": rng.uniform(1e-4, 5e-3)},
            fwd_transient_bytes=rng.randint(0, 3) * a[i],
            bwd_transient_bytes=rng.randint(0, 4) * a[i],
            nosave_transient_bytes=rng.randint(0, 3) * a[i],
            grad_bytes=rng.randint(0, 4) * MiB,
        ) for i in range(n))
        p = Problem(stages, params_bytes=64 * MiB, grads_bytes=256 * MiB,
                    optimizer_state_bytes=128 * MiB, post_chain_bytes=32 * MiB,
                    region_overhead_s=1e-4, offload_bandwidth_bytes_per_s=2e10)
        model = dp.Model(p, 4 * MiB)
        top = 60
        fast = dp_numba.numba_tables(model, top, threads=threads)  # type: ignore[attr-defined]
        ref = dp.numpy_tables(model, top)
        for name in ("seg0", "seg1", "segp", "top"):
            assert np.array_equal(getattr(fast, name), getattr(ref, name)), (seed, name)
        assert np.isfinite(ref.top[0]).any() and not np.isfinite(ref.top[0]).all()


def test_solver_threads_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    dp_numba = _numba()
    monkeypatch.setenv("REMAT_SOLVER_THREADS", "3")
    assert dp_numba.solver_threads() == 3  # type: ignore[attr-defined]
    monkeypatch.setenv("REMAT_SOLVER_THREADS", "two")
    with pytest.raises(UsageError, match="REMAT_SOLVER_THREADS='two' is not a whole number"):
        dp_numba.solver_threads()  # type: ignore[attr-defined]
    monkeypatch.delenv("REMAT_SOLVER_THREADS")
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert dp_numba.solver_threads() == 2  # type: ignore[attr-defined]
    monkeypatch.setattr(os, "getloadavg", lambda: (1.2, 1.0, 1.0))  # a core is busy
    assert dp_numba.solver_threads() == 1  # type: ignore[attr-defined]


@settings(max_examples=40, deadline=None)
@given(chains(breaks=True, held=True), st.integers(0, 40))
def test_numba_flat_table_equals_numpy_flat_table(problem: Problem, top: int) -> None:
    from remat.core.solve import flat

    _numba()
    model = dp.Model(problem, 1)
    fast = flat.flat_tables(model, top, path="numba").top
    assert np.array_equal(fast, flat.flat_tables(model, top, path="numpy").top)


@settings(max_examples=30, deadline=None)
@given(chains(max_n=5), st.integers(2, 9), st.integers(0, 30))
def test_flat_tables_agree_with_slots_of_several_bytes(problem: Problem, q: int,
                                                       top: int) -> None:
    from remat.core.solve import flat

    _numba()
    model = dp.Model(problem, q)
    fast = flat.flat_tables(model, top, path="numba").top
    assert np.array_equal(fast, flat.flat_tables(model, top, path="numpy").top)


def _jumpy_chain(seed: int, n: int = 8) -> Problem:
    """Small boundaries with a few large ones: a region's need then falls as it grows past
    a large boundary (the gradient alive at its stop), the stops the kernel applies one by
    one (Note [Flat records])."""
    rng = np.random.default_rng(seed)
    a = [int(rng.integers(20, 60)) if rng.random() < 0.3 else int(rng.integers(0, 8))
         for _ in range(n + 1)]
    stages = tuple(
        StageCost(f"s{i}", a[i], a[i + 1], {"keep": int(rng.integers(0, 12))},
                  fwd_s=float(rng.integers(1, 4)), bwd_s=2.0,
                  rebuild_s=float(rng.integers(0, 4)), grad_bytes=int(rng.integers(0, 5)),
                  fwd_transient_bytes=int(rng.integers(0, 3)),
                  bwd_transient_bytes=int(rng.integers(0, 3)),
                  saves_input=bool(rng.random() < 0.5))
        for i in range(n))
    return Problem(stages, params_bytes=2, grads_bytes=sum(s.grad_bytes for s in stages),
                   optimizer_state_bytes=2, region_overhead_s=1.0)


def test_flat_tables_agree_on_chains_whose_needs_are_not_monotone() -> None:
    # Slots of several bytes and needs that fall as a region grows: dropping the
    # one-by-one stops, or rounding a remainder equal to the slot the wrong way, changed
    # the compiled tables in 241 and 109 of 1,200 such cases (300 seeds).
    from remat.core.solve import flat

    _numba()
    fell = 0
    for seed in range(60):
        problem = _jumpy_chain(seed)
        for q in (1, 2, 3, 5):
            model = dp.Model(problem, q)
            fi = flat.FlatInputs.of(model)
            top = (3 * sum(s.boundary_bytes for s in problem.stages) + 50) // q
            for k in range(problem.n):
                need = flat.region_need(fi, k)
                fell += int(np.count_nonzero(need < np.maximum.accumulate(need)))
            fast = flat.flat_tables(model, top, path="numba").top
            assert np.array_equal(fast, flat.flat_tables(model, top, path="numpy").top), (
                seed, q)
    assert fell > 0


@pytest.mark.parametrize("name", ["tiny_3", "uniform_8", "hetero_6", "gpt2_12"])
def test_numba_path_on_fixtures(name: str) -> None:
    _numba()
    p = load(name)
    least, none = solvers.minimum_budget(p), peak(solvers.none(p))
    for budget in (least, (least + none) // 2, none):
        plans = [solvers.optimal(p, budget, path=path) for path in ("numba", "numpy", "python")]
        assert len({(q.regions, q.options, q.predicted_step_time_s) for q in plans}) == 1


def _flat_plans(problem: Problem) -> Iterator[Plan]:
    """Every flat plan: disjoint regions (compositions of the chain), every stage keeping."""
    n = problem.n
    for cuts in itertools.product((0, 1, 2), repeat=n):  # 0 bare, 1 opens a region, 2 extends
        if cuts[0] == 2:
            continue
        regions, i = [], 0
        ok = True
        while i < n:
            if cuts[i] == 1:
                j = i + 1
                while j < n and cuts[j] == 2:
                    j += 1
                regions.append(Region(i, j))
                i = j
            elif cuts[i] == 0:
                i += 1
            else:
                ok = False
                break
        if ok and not _spans_a_break(regions, problem):
            yield Plan(problem.stage_names, tuple(regions))


@settings(max_examples=40, deadline=None)
@given(chains(breaks=True))
def test_segments_optimal_equals_the_best_flat_plan(problem: Problem) -> None:
    from remat.core.solve import flat

    scores = [(simulate(p, problem).peak_bytes, simulate(p, problem).step_time_s)
              for p in _flat_plans(problem)]
    base = problem.backward_base_bytes
    top = max(peak for peak, _ in scores) - base + 2
    t = flat.flat_tables(dp.Model(problem, 1), top, path="numpy")
    for m in range(top + 1):
        best = min((s for peak, s in scores if peak <= base + m), default=math.inf)
        got = t.top[0, m] + constant_s(problem)
        assert got == best or (math.isinf(got) and math.isinf(best)), (m, got, best)
        if math.isfinite(got):
            plan = Plan(problem.stage_names, tuple(Region(*r) for r in flat.flat_plan(t, m)))
            sim = simulate(plan, problem)
            assert sim.peak_bytes <= base + m and sim.step_time_s == got
    # Through the solver: never better than optimal, never worse than every-k/segments-k.
    none = peak(solvers.none(problem))
    least = min(peak for peak, _ in scores)
    for budget in {least, (least + none) // 2, none} - {0}:
        try:
            plan = solvers.solve("segments-optimal", problem, budget)
        except CheckFailed:
            continue  # slot rounding near the least flat peak
        assert peak(plan) <= budget
        assert seconds(plan) >= seconds(solvers.optimal(problem, budget))


# -- budgets --------------------------------------------------------------------------------------


def test_parse_budget() -> None:
    p = dataclasses.replace(load("tiny_3"), measured_no_checkpoint_peak_bytes=1000)
    assert parse_budget("6GiB", p) == 6 << 30
    assert parse_budget("512MiB", p) == 512 << 20
    assert parse_budget("1e9", p) == 10**9
    assert parse_budget(4096, p) == 4096
    assert parse_budget("50%", p) == 500
    assert parse_budget("0.5", p) == 500
    assert parse_budget(0.25, p) == 250
    assert parse_budget("1.0", p) == 1000
    assert parse_budget("150%", p) == 1500
    for bad in ("0%", "abc", "-5", 0, True, "0.0"):
        with pytest.raises(UsageError):
            parse_budget(bad, p)
    no_peak = dataclasses.replace(p, measured_no_checkpoint_peak_bytes=None)
    with pytest.raises(UsageError, match="fraction of the measured peak"):
        parse_budget("50%", no_peak)


# -- problem files ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("chain_*.json")), ids=lambda p: p.name)
def test_fixtures_load_and_round_trip(path: Path) -> None:
    p = Problem.load(path)
    assert Problem.from_json(p.to_json()) == p
    assert p.measured_no_checkpoint_peak_bytes == simulate(Plan(p.stage_names), p).peak_bytes


def _tiny() -> dict:
    return json.loads((FIXTURES / "chain_tiny_3.json").read_text())


def test_problem_accepts_sizes_as_text() -> None:
    data = _tiny()
    data["params_bytes"] = "1KiB"
    data["stages"][0]["saved_bytes"]["keep"] = "2KiB"
    p = Problem.from_dict(data)
    assert p.params_bytes == 1024 and p.stages[0].saved_bytes["keep"] == 2048


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d["stages"][1]["saved_bytes"].pop("keep"), "stage 's1' saved_bytes=.* no 'keep'"),
    (lambda d: d["stages"][0].update(output_bytes=7), "'s0' has output_bytes=7 .* 's1'"),
    (lambda d: d["stages"][2].update(fwd_s=-1), "stage 's2' fwd_s=-1"),
    # it may be negative (a backward that frees before its peak), to minus keep's saved
    # bytes and the two gradients (6 here)
    (lambda d: d["stages"][2].update(bwd_transient_bytes=-7),
     "stage 's2' bwd_transient_bytes=-7 frees more"),
    (lambda d: d["stages"][2].update(bwd_transient_bytes=-1.5), "stage 's2' bwd_transient_bytes"),
    (lambda d: d["stages"][0]["saved_bytes"].update({"fast": 1}), "stage 's0' saved_bytes"),
    (lambda d: d["stages"][1].update(extra_bwd_s={"selective:save-matmuls": 1.0}),
     "'s1' has extra_bwd_s for 'selective:save-matmuls' but no saved_bytes"),
    (lambda d: d["stages"][1].update(color="red"), "stage 's1' has unknown key.*color"),
    (lambda d: d["stages"][1].pop("boundary_bytes"), "stage 's1' is missing key.*boundary_bytes"),
    (lambda d: d.update(schema_version=9), "schema version 9"),
    (lambda d: d.update(budget="3GiB"), "unknown key.*budget"),
    (lambda d: d.update(offload_bandwidth_bytes_per_s=0), "above zero"),
    (lambda d: d.update(slots=0), "slots=0"),
    (lambda d: d.update(stages=[]), "no stages"),
    (lambda d: d["stages"][1].update(name="s0"), "'s0' is listed twice"),
])
def test_problem_validation_names_the_field(edit: Callable[[dict], object], message: str
                                            ) -> None:
    data = _tiny()
    edit(data)
    with pytest.raises(UsageError, match=message):
        Problem.from_dict(data)


def test_schema_version_1_files_read_as_before() -> None:
    data = _tiny()
    assert data["schema_version"] == 1
    p = Problem.from_dict(data)
    assert p.unattributed_grads_bytes == p.grads_bytes and p.backward_base_bytes == 22
    assert all(s.grad_bytes == 0 and s.saves_input for s in p.stages)
    written = p.to_dict()
    assert written["schema_version"] == 2 and written["stages"][0]["grad_bytes"] == 0
    assert Problem.from_dict(written) == p
    data["stages"][0]["grad_bytes"] = 1  # not a version-1 key
    with pytest.raises(UsageError, match=r"'s0' has unknown key.*grad_bytes"):
        Problem.from_dict(data)
    with pytest.raises(UsageError, match=r"schema version 1.*unknown key.*optimizer_step"):
        Problem.from_dict({**_tiny(), "optimizer_step_bytes": 4})


def test_gradient_parts_may_not_exceed_the_total() -> None:
    data = load("tiny_3").to_dict()
    data["stages"][1]["grad_bytes"] = 4
    data["pre_chain_grads_bytes"] = 2  # 6 > grads_bytes 5
    with pytest.raises(UsageError, match="add up to 6 bytes, more than grads_bytes=5"):
        Problem.from_dict(data)
    data["grads_bytes"] = 6
    assert Problem.from_dict(data).unattributed_grads_bytes == 0
    data["stages"][0]["saves_input"] = "no"
    with pytest.raises(UsageError, match="stage 's0' saves_input='no'"):
        Problem.from_dict(data)


def test_problem_file_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot read problem file"):
        Problem.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(UsageError, match="not valid JSON"):
        Problem.load(tmp_path / "bad.json")
    p = load("tiny_3")
    p.save(tmp_path / "p.json")
    assert Problem.load(tmp_path / "p.json") == p


def test_options_follow_measurements_and_the_host_link() -> None:
    p = load("hetero_6")
    assert p.options(0) == ("keep", "selective:save-matmuls", "selective:save-attention", "offload")
    assert load("uniform_8").options(0) == ("keep",)
    s = p.stages[0]
    assert s.offload_bytes == s.saved_bytes["keep"] + s.boundary_bytes


# -- torch stays out ------------------------------------------------------------------------------


def test_the_planning_core_never_imports_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import remat.core.solve, remat.core.solve.dp, remat.core.solve.solvers\n"
        "import remat.core.solve.budget\n"
        "from remat.core.solve import Problem, minimum_budget, optimal\n"
        f"p = Problem.load({str(FIXTURES / 'chain_hetero_6.json')!r})\n"
        "optimal(p, minimum_budget(p) + 1)\n"
        "assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules"
        " if sys.modules[m] is not None)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", ["tiny_3", "uniform_8", "hetero_6", "gpt2_12"])
def test_optimal_at_the_no_checkpoint_peak_is_no_checkpointing(name: str) -> None:
    """Slot rounding must not push optimal off the plan that exactly fits (and is fastest)."""
    p = load(name)
    none = solvers.none(p)
    plan = solvers.optimal(p, peak(none))
    assert plan.predicted_step_time_s == none.predicted_step_time_s
    assert plan.regions == () and set(plan.options) == {"keep"}


@settings(max_examples=40, deadline=None)
@given(chains())
def test_baseline_time_is_the_simulated_step_without_checkpointing(problem: Problem) -> None:
    from remat.core.solve.simulator import baseline_time

    problem = dataclasses.replace(problem, outside_chain_s=0.1)
    stages = tuple(dataclasses.replace(s, fwd_s=s.fwd_s / 3, bwd_s=s.bwd_s / 7,
                                       extra_bwd_s={**s.extra_bwd_s, "keep": 0.01 * i})
                   for i, s in enumerate(problem.stages))
    problem = dataclasses.replace(problem, stages=stages)  # times that round when summed
    assert baseline_time(problem) == simulate(Plan(problem.stage_names), problem).time


@settings(max_examples=60, deadline=None)
@given(chains(), st.integers(1, 9), st.data())
def test_flat_inputs_built_from_the_problem_equal_the_models(problem: Problem, q: int,
                                                             data: st.DataObject) -> None:
    from remat.core.solve import flat

    spare = data.draw(st.integers(0, q - 1))
    built = flat.FlatInputs.build(problem, q, spare)
    ref = flat.FlatInputs.of(dp.Model(problem, q, spare))
    for field in dataclasses.fields(flat.FlatInputs):
        ours, theirs = getattr(built, field.name), getattr(ref, field.name)
        if isinstance(theirs, np.ndarray):
            assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs), field.name
        else:
            assert ours == theirs and type(ours) is type(theirs), field.name


@settings(max_examples=40, deadline=None)
@given(chains(), st.integers(1, 30))
def test_recipe_estimates_bound_the_simulation_and_optimal_never_loses_to_a_recipe(
    problem: Problem, slots: int
) -> None:
    """The closed forms that order the recipes beside the tables (Note [Recipes beside the
    tables]): each estimate is the recipe's simulated time up to rounding and each least
    peak a lower bound; at each recipe's own peak, with coarse slots, optimal is no slower."""
    problem = dataclasses.replace(problem, slots=slots, region_overhead_s=0.25)
    estimates = solvers._recipes_by_time(problem)
    families = {family for _, _, family, _ in estimates}
    assert families == {"none", "every", "groups", "segments", "block"}
    assert [e for e, *_ in estimates] == sorted(e for e, *_ in estimates)
    for estimate, least, family, k in estimates:
        regions = solvers._recipe(problem.n, family, k)
        sim = simulate(Plan(problem.stage_names, tuple(Region(*r) for r in regions)), problem)
        assert math.isclose(estimate, sim.step_time_s, rel_tol=1e-12, abs_tol=1e-12)
        assert least <= sim.peak_bytes
        plan = solvers.optimal(problem, max(sim.peak_bytes, 1))  # budgets are > 0
        assert seconds(plan) <= sim.step_time_s * (1 + 1e-12)


# -- Budget: read once, turned into bytes against a problem ------------------------------------


def test_a_budget_is_read_once_and_turned_into_bytes_against_a_problem() -> None:
    from remat.core.solve.budget import Budget

    with_peak = Problem(stages=(StageCost("s", 1, 1, {"keep": 0}),),
                        measured_no_checkpoint_peak_bytes=1000)
    no_peak = Problem(stages=(StageCost("s", 1, 1, {"keep": 0}),))
    half = Budget.parse("50%")
    assert (half.fraction, half.nbytes, str(half)) == (0.5, None, "50%")
    assert half.bytes(with_peak) == 500 and Budget.parse(half) is half
    assert Budget.parse(0.25).bytes(with_peak) == 250
    six = Budget.parse("6GiB")
    assert six.nbytes == 6 << 30 and six.bytes(no_peak) == 6 << 30
    with pytest.raises(UsageError, match="does not have"):
        half.bytes(no_peak)
    # refused where it is given, before any problem exists: a sign, a word, a share of a
    # step under one byte of any device's peak
    for bad, said in (("-5%", "above zero"), ("0", "above zero"), ("lots", "not a size"),
                      (True, "not a size"), ("1e-300", "less than one byte"),
                      ("1e-300%", "less than one byte")):
        with pytest.raises(UsageError, match=said):
            Budget.parse(bad)  # type: ignore[arg-type]
    assert parse_budget("50%", with_peak) == 500
