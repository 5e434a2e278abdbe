"""Zero-bubble schedules on paper (remat.core.zero_bubble, torch-free): orders of F, I, W
and B ops, each rank's peak and the step time (Note [A backward in passes, on paper])."""

from __future__ import annotations

from pathlib import Path

import pytest

from remat.core.errors import CheckFailed, UsageError
from remat.core.pipeline import ScheduleBuffers, pipeline_step, schedule_order
from remat.core.plan_format import Plan, Region
from remat.core.solve.problem import Problem
from remat.core.zero_bubble import SplitFigures, split_pipeline_step, split_step_time

FIXTURES = Path(__file__).parent / "fixtures"
NONE = SplitFigures(0, 0, 0, 0)


def _problem() -> Problem:
    return Problem.load(FIXTURES / "chain_uniform_8.json")


def _per_stage(problem: Problem) -> Plan:
    return Plan(problem.stage_names, tuple(Region(i, i + 1) for i in range(problem.n)))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 5), (4, 2)])
def test_orders_of_full_backwards_give_the_one_stage_schedules_peaks_and_step(
        schedule: str, p: int, m: int) -> None:
    # the same ops written as F and B: the walk and the timing agree with
    # remat.core.pipeline's for GPipe and 1F1B, plan by plan
    problem = _problem()
    buffers = [ScheduleBuffers(output_bytes=1000 * (r + 1), persistent_bytes=777,
                               held_bytes=-10) for r in range(p)]
    orders = {r: [(kind, r, i) for kind, _, i in schedule_order(schedule, r, p, m)]
              for r in range(p)}
    for plans in ([Plan(problem.stage_names)] * p, [_per_stage(problem)] * p,
                  [Plan(problem.stage_names), _per_stage(problem)] * p):
        plans = plans[:p]
        want = pipeline_step(plans, [problem] * p, schedule, m, send_s=0.01, buffers=buffers)
        peaks, step = split_pipeline_step(plans, [problem] * p, [NONE] * p, orders,
                                          buffers, send_s=0.01)
        assert [peaks[r] for r in range(p)] == list(want.peaks)
        assert step == pytest.approx(want.step_s)


def test_a_micro_batch_between_its_input_and_weight_passes_holds_the_stages_own_bytes(
        ) -> None:
    # rank 1 holds stage 1 of 2: F F I I W W over two micro-batches; with what the input
    # pass leaves far above everything else, the peak is the first weight pass, the
    # second micro-batch waiting for its own: that pass's peak (its own held bytes
    # included) plus the other's held bytes, above the stage's parameters, optimizer
    # state and input; no plan changes it
    problem = _problem()
    held = 10**12
    split = SplitFigures(input_peak_bytes=5000, held_bytes=held, weight_peak_bytes=held + 7,
                         later_weight_peak_bytes=held + 9)
    orders = {0: [("F", 0, 0), ("F", 0, 1), ("I", 0, 0), ("W", 0, 0), ("I", 0, 1),
                  ("W", 0, 1)],
              1: [("F", 1, 0), ("F", 1, 1), ("I", 1, 0), ("I", 1, 1), ("W", 1, 0),
                  ("W", 1, 1)]}
    idle = problem.params_bytes + problem.optimizer_state_bytes + problem.inputs_bytes
    for plan in (Plan(problem.stage_names), _per_stage(problem)):
        peaks, _ = split_pipeline_step([plan, plan], [problem] * 2, [NONE, split], orders)
        assert peaks[1] == idle + (held + 7) + held
    # what the plan keeps from the forward to the input pass is what a plan changes
    many = {0: [("F", 0, i) for i in range(4)] + [op for i in range(4)
                                                   for op in (("I", 0, i), ("W", 0, i))],
            1: [("F", 1, i) for i in range(4)] + [op for i in range(4)
                                                   for op in (("I", 1, i), ("W", 1, i))]}
    plain, _ = split_pipeline_step([Plan(problem.stage_names)] * 2, [problem] * 2,
                                   [NONE, NONE], many)
    planned, _ = split_pipeline_step([_per_stage(problem)] * 2, [problem] * 2,
                                     [NONE, NONE], many)
    assert planned[1] < plain[1]


def test_the_input_pass_sends_on_and_the_weight_pass_fills_the_bubble() -> None:
    # two stages on two ranks, one micro-batch: rank 1 runs F I W, rank 0 F then its W
    # (the first stage's input pass is empty, its W the whole backward) once rank 1's I is
    # done: the step is F0 + F1 + I1 + max(W1, B0), sends included
    f, b, rb, send = (1.0, 2.0), (4.0, 6.0), (0.5, 0.25), 0.125
    share = 0.25
    splits = [NONE, SplitFigures(0, 0, 0, 0, weight_share=share)]
    orders = {0: [("F", 0, 0), ("I", 0, 0), ("W", 0, 0)],
              1: [("F", 1, 0), ("I", 1, 0), ("W", 1, 0)]}
    i1 = b[1] * (1 - share) + rb[1]
    want = f[0] + send + f[1] + i1 + max(b[1] * share, send + b[0] + rb[0])
    assert split_step_time(f, b, rb, (0.0, 0.0), splits, orders, send) == pytest.approx(want)
    # a full backward on rank 1 instead: its W's share waits on the critical path
    full = {0: orders[0], 1: [("F", 1, 0), ("B", 1, 0)]}
    want_full = f[0] + send + f[1] + b[1] + rb[1] + send + b[0] + rb[0]
    assert split_step_time(f, b, rb, (0.0, 0.0), splits, full, send) == pytest.approx(
        want_full)


def test_bad_orders_and_plans_are_refused_in_one_sentence() -> None:
    problem = _problem()
    plans, problems = [Plan(problem.stage_names)] * 2, [problem] * 2
    good = {0: [("F", 0, 0), ("W", 0, 0)], 1: [("F", 1, 0), ("I", 1, 0), ("W", 1, 0)]}
    with pytest.raises(UsageError, match="kind one of F, I, W, B"):
        split_pipeline_step(plans, problems, [NONE] * 2, {**good, 1: [("X", 1, 0)]})
    with pytest.raises(UsageError, match="stage 1 appears in the orders of ranks 0 and 1"):
        split_pipeline_step(plans, problems, [NONE] * 2, {**good, 0: [("F", 1, 0)]})
    with pytest.raises(UsageError, match="no rank's order runs stage 1"):
        split_pipeline_step(plans, problems, [NONE] * 2, {0: good[0]})
    with pytest.raises(UsageError, match="orders deadlock"):
        split_pipeline_step(plans, problems, [NONE] * 2,
                            {0: [("W", 0, 0), ("F", 0, 0)], 1: good[1]})
    nested = Plan(problem.stage_names, (Region(0, 4), Region(0, 2)))
    with pytest.raises(UsageError, match="one level of regions"):
        split_pipeline_step([nested, nested], problems, [NONE] * 2, good)
    with pytest.raises(UsageError, match="weight_share"):
        SplitFigures(0, 0, 0, 0, weight_share=1.5)


def _order(text: str) -> list[tuple[str, int, int]]:
    return [(op[1], int(op[0]), int(op[2:])) for op in text.split()]


#: torch 2.13's ScheduleInterleavedZeroBubble, 2 ranks x 2 stages, 4 micro-batches
#: (remat.parallel.pipeline.schedule_orders of the built schedule)
INTERLEAVED_ZB = {
    0: _order("0F0 0F1 2F0 2F1 2I0 2W0 0F2 2I1 2W1 0F3 0I0 0W0 2F2 0I1 0W1 2F3 2I2 2W2 "
              "2I3 2W3 0I2 0W2 0I3 0W3"),
    1: _order("1F0 1F1 3F0 3I0 3F1 3I1 3W0 1F2 1I0 3W1 1F3 1I1 1W0 3F2 3I2 1W1 3F3 3I3 "
              "3W2 1I2 3W3 1I3 1W2 1W3"),
}


def test_zero_bubble_plans_fit_every_rank_and_are_no_slower_than_uniform_per_stage() -> None:
    from remat.core.solve import simulate
    from remat.core.zero_bubble import plan_split_pipeline

    problem = _problem()
    kept = simulate(Plan(problem.stage_names), problem).kept_bytes
    split = SplitFigures(input_peak_bytes=kept + kept // 10, held_bytes=kept,
                         weight_peak_bytes=kept + kept // 20,
                         later_weight_peak_bytes=kept + kept // 20 + problem.grads_bytes,
                         weight_share=0.4)
    splits = [NONE, split, split, split]
    plain, plain_step = split_pipeline_step([Plan(problem.stage_names)] * 4, [problem] * 4,
                                            splits, INTERLEAVED_ZB)
    uniform, uniform_step = split_pipeline_step([_per_stage(problem)] * 4, [problem] * 4,
                                                splits, INTERLEAVED_ZB)
    assert all(uniform[r] < plain[r] for r in (0, 1)) and uniform_step > plain_step
    budget = (max(uniform.values()) + min(plain.values())) // 2
    plans, peaks, step = plan_split_pipeline([problem] * 4, splits, INTERLEAVED_ZB, budget)
    assert peaks == split_pipeline_step(plans, [problem] * 4, splits, INTERLEAVED_ZB)[0]
    assert all(peak <= budget for peak in peaks.values())
    assert step <= uniform_step + 1e-12
    assert any(plan.regions for plan in plans)
    assert all(plan.parent(r) is None for plan in plans for r in plan.regions)
    # with room for no plan anywhere, no plan is the fastest
    roomy, _, roomy_step = plan_split_pipeline([problem] * 4, splits, INTERLEAVED_ZB,
                                               max(plain.values()))
    assert roomy_step == pytest.approx(plain_step)
    assert not any(plan.regions for plan in roomy)
    with pytest.raises(CheckFailed, match="no one-level plan of pipeline rank"):
        plan_split_pipeline([problem] * 4, splits, INTERLEAVED_ZB, min(uniform.values()) // 2)
