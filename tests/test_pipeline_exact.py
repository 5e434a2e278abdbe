"""A pipeline rank's fastest plan under its schedule, exact (remat.core.solve.in_flight and
remat.core.pipeline.fastest_rank_plan), checked against every plan of small chains."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remat.core.errors import CheckFailed, UsageError
from remat.core.pipeline import (
    ScheduleBuffers,
    _chunk,
    _figures,
    _walk,
    fastest_rank_plan,
    plan_pipeline,
    schedule_order,
    schedule_terms,
    step_time,
)
from remat.core.plan_format import Plan
from remat.core.solve import Problem, simulate
from remat.core.solve.in_flight import fastest_kept_capped
from test_solve import all_plans, chains


@st.composite
def ranks(draw: st.DrawFn) -> tuple[str, int, int, int, ScheduleBuffers]:
    """A schedule, the number of ranks, one rank, micro-batches and its stage's buffers."""
    schedule = draw(st.sampled_from(["gpipe", "1f1b"]))
    p = draw(st.integers(1, 4))
    m = draw(st.integers(p if schedule == "1f1b" else 1, 5))
    buffers = ScheduleBuffers(output_bytes=draw(st.integers(0, 4)),
                              input_grad_bytes=draw(st.integers(0, 3)),
                              persistent_bytes=draw(st.integers(0, 5)),
                              held_bytes=draw(st.integers(-2, 3)),
                              after_first_backward_bytes=draw(st.integers(0, 3)),
                              after_backward_bytes=draw(st.integers(0, 2)))
    return schedule, p, draw(st.integers(0, p - 1)), m, buffers


def _walked(problem: Problem, schedule: str, p: int, r: int, m: int, buffers: ScheduleBuffers
            ) -> list[tuple[int, float, Plan]]:
    """Every plan's peak on the rank and one micro-batch's step time."""
    order = schedule_order(schedule, r, p, m)
    walked = []
    for plan in all_plans(problem):
        sim = simulate(plan, problem)
        walked.append((_walk([_chunk(sim, plan, problem, buffers)], order), sim.step_time_s,
                       plan))
    return walked


_SLOW = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


@_SLOW
@given(chains(max_n=4), ranks(), st.data())
def test_a_ranks_fastest_plan_is_the_fastest_of_every_plan_whose_peak_fits(
        problem: Problem, rank: tuple[str, int, int, int, ScheduleBuffers],
        data: st.DataObject) -> None:
    schedule, p, r, m, buffers = rank
    walked = _walked(problem, schedule, p, r, m, buffers)
    peaks = [peak for peak, _, _ in walked]
    budget = data.draw(st.integers(min(peaks) - 2, max(peaks) + 2))
    best = min((t for peak, t, _ in walked if peak <= budget), default=math.inf)
    got = fastest_rank_plan(problem, budget, schedule, r, p, m, buffers, path="numpy")
    if got is None:
        assert best == math.inf
        return
    order = schedule_order(schedule, r, p, m)
    assert _walk([_figures(got, problem, buffers)[1]], order) <= budget
    assert simulate(got, problem).step_time_s == best


@_SLOW
@given(chains(max_n=4), ranks(), st.data())
def test_the_capped_tables_alone_keep_the_rank_within_its_budget(
        problem: Problem, rank: tuple[str, int, int, int, ScheduleBuffers],
        data: st.DataObject) -> None:
    """Without the caller's exact check every plan the tables give fits the rank (the
    raised gradient offsets and the cap do it; only the optimizer step after the last
    backward, the same for every plan, is left to the caller)."""
    schedule, p, r, m, buffers = rank
    walked = _walked(problem, schedule, p, r, m, buffers)
    peaks = [peak for peak, _, _ in walked]
    budget = data.draw(st.integers(min(peaks) - 2, max(peaks) + 2))
    order = schedule_order(schedule, r, p, m)
    got = fastest_kept_capped(problem, budget, schedule_terms(order, buffers),
                              lambda plan: True, path="numpy")
    if got is not None:
        figures = _figures(got, problem, buffers)[1]
        without_tail = type(figures)(**{**figures.__dict__, "tail": -(10 ** 9)})
        assert _walk([without_tail], order) <= budget


def test_every_table_path_gives_the_same_plan() -> None:
    problem = _three_stages()
    order = schedule_order("gpipe", 0, 2, 4)
    budget = min(_walk([_figures(plan, problem, ScheduleBuffers())[1]], order)
                 for plan in all_plans(problem)) + 3
    plans = {path: fastest_rank_plan(problem, budget, "gpipe", 0, 2, 4, path=path)
             for path in ("python", "numpy", "numba")}
    assert plans["python"] is not None
    assert plans["python"] == plans["numpy"] == plans["numba"]


def _three_stages() -> Problem:
    from remat.core.solve import StageCost

    stages = tuple(StageCost(f"s{i}", 4, 4, {"keep": 9 + 3 * i}, fwd_s=1.0, bwd_s=2.0,
                             rebuild_s=1.0 + i, grad_bytes=2) for i in range(3))
    return Problem(stages, params_bytes=2, grads_bytes=8, optimizer_state_bytes=2, inputs_bytes=1,
                   post_chain_bytes=3, region_overhead_s=0.5)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_pipeline_plan_is_the_fastest_of_every_combination_of_ranks_plans(
        schedule: str) -> None:
    problem = _three_stages()
    plans = list(all_plans(problem))
    m, none = 3, ScheduleBuffers()
    figures = [_figures(plan, problem, none) for plan in plans]
    peaks = [[_walk([chunk], schedule_order(schedule, r, 2, m)) for _, chunk in figures]
             for r in range(2)]
    steps = {(i, j): step_time([figures[i][0], figures[j][0]], schedule, m)
             for i, j in itertools.product(range(len(plans)), repeat=2)}
    for budget in range(10, 80, 3):
        best = min((s for (i, j), s in steps.items()
                    if peaks[0][i] <= budget and peaks[1][j] <= budget), default=math.inf)
        if best == math.inf:
            with pytest.raises(CheckFailed, match="no plan of pipeline rank"):
                plan_pipeline([problem] * 2, budget, schedule, m)
            continue
        _, step = plan_pipeline([problem] * 2, budget, schedule, m)
        assert max(step.peaks) <= budget
        assert step.step_s == best, budget


def test_an_interleaved_rank_is_refused_by_the_one_stage_planner() -> None:
    with pytest.raises(UsageError, match="interleaved"):
        fastest_rank_plan(_three_stages(), 100, "interleaved-1f1b", 0, 2, 4)
