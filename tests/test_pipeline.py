"""Pipeline parallelism on paper (remat.core.pipeline): in-flight micro-batches per rank,
the schedule's step time against its closed form, per-rank peaks."""

from __future__ import annotations

from pathlib import Path

import pytest

from remat.core.errors import UsageError
from remat.core.pipeline import (
    RankCost,
    in_flight,
    pipeline_step,
    rank_cost,
    schedule_order,
    step_time,
)
from remat.core.plan_format import Plan, Region
from remat.core.solve.problem import Problem

FIXTURES = Path(__file__).parent / "fixtures"


def _equal_ranks(p: int, forward_s: float, backward_s: float) -> list[RankCost]:
    return [RankCost(forward_s, backward_s, 0.0, 0, 0)] * p


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(1, 3), (2, 4), (4, 8), (4, 2), (3, 7)])
@pytest.mark.parametrize(("f", "b"), [(1.0, 2.0), (1.0, 1.0), (3.0, 1.0)])
def test_equal_ranks_take_m_plus_p_minus_one_forward_and_backward(
    schedule: str, p: int, m: int, f: float, b: float
) -> None:
    assert step_time(_equal_ranks(p, f, b), schedule, m) == pytest.approx((m + p - 1) * (f + b))


def test_in_flight_micro_batches_per_rank_as_measured_with_torch_pipelining() -> None:
    # issue 19: 2 ranks, 4 micro-batches: GPipe keeps 4 on both, 1F1B 2 on the first and
    # 1 on the last
    assert [in_flight("gpipe", r, 2, 4) for r in range(2)] == [4, 4]
    assert [in_flight("1f1b", r, 2, 4) for r in range(2)] == [2, 1]
    assert [in_flight("1f1b", r, 4, 2) for r in range(4)] == [2, 2, 2, 1]
    # each rank runs every micro-batch's forward and backward once, a forward first
    for schedule in ("gpipe", "1f1b"):
        for r in range(4):
            order = schedule_order(schedule, r, 4, 8)
            assert sorted(order) == sorted([(k, 0, i) for k in "FB" for i in range(8)])
            assert all(order.index(("F", 0, i)) < order.index(("B", 0, i)) for i in range(8))
    with pytest.raises(UsageError, match="schedule 'zb'"):
        in_flight("zb", 0, 2, 4)
    with pytest.raises(UsageError, match="rank 2 is outside"):
        in_flight("1f1b", 2, 2, 4)


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 8, 4), (2, 8, 3),
                                           (3, 6, 2), (4, 12, 3), (2, 2, 2)])
def test_interleaving_divides_the_bubble_by_the_chunks_per_rank(p: int, m: int, v: int
                                                                ) -> None:
    # Narayanan et al. 2021: with v chunks of F/v and B/v per rank, the bubble is
    # (p - 1)(F + B)/v instead of (p - 1)(F + B), where m is at least p
    f, b = 1.0, 2.0
    costs = [RankCost(f / v, b / v, 0.0, 0, 0)] * (p * v)
    assert step_time(costs, "interleaved-1f1b", m, chunks=v) == pytest.approx(
        m * (f + b) + (p - 1) * (f + b) / v)
    for r in range(p):  # every chunk runs every micro-batch once, its forward first
        order = schedule_order("interleaved-1f1b", r, p, m, v)
        assert sorted(order) == sorted((k, c, i) for k in "FB" for c in range(v)
                                       for i in range(m))
        assert all(order.index(("F", c, i)) < order.index(("B", c, i))
                   for c in range(v) for i in range(m))
    # the first rank holds more micro-batches than the last, and more than under 1F1B
    counts = [in_flight("interleaved-1f1b", r, p, m, v) for r in range(p)]
    assert counts == sorted(counts, reverse=True)
    assert counts[0] > in_flight("1f1b", 0, p, m)


def test_schedules_refuse_chunks_they_do_not_run_and_counts_they_cannot_split() -> None:
    with pytest.raises(UsageError, match="runs one stage per rank"):
        schedule_order("1f1b", 0, 2, 4, chunks=2)
    with pytest.raises(UsageError, match="multiple of its rounds"):
        schedule_order("interleaved-1f1b", 0, 2, 5, chunks=2)
    with pytest.raises(UsageError, match="do not split into 2 chunks"):
        step_time([RankCost(1.0, 1.0, 0.0, 0, 0)] * 3, "interleaved-1f1b", 4, chunks=2)


def test_a_rebuild_on_the_slowest_rank_stretches_the_step_more_than_one_in_the_bubble(
) -> None:
    slow, fast = RankCost(2.0, 4.0, 0.0, 0, 0), RankCost(1.0, 2.0, 0.0, 0, 0)
    base = step_time([fast, slow], "1f1b", 8)

    def with_rebuild(c: RankCost) -> RankCost:
        return RankCost(c.forward_s, c.backward_s + 1.0, 0.0, 0, 0)

    on_fast = step_time([with_rebuild(fast), slow], "1f1b", 8) - base
    on_slow = step_time([fast, with_rebuild(slow)], "1f1b", 8) - base
    assert 0 <= on_fast < on_slow
    assert on_slow == pytest.approx(8.0)  # every micro-batch's backward on the critical rank


def test_a_rank_peaks_at_its_one_micro_batch_peak_plus_what_the_others_in_flight_keep(
) -> None:
    problem = Problem.load(FIXTURES / "chain_uniform_8.json")
    names = problem.stage_names
    keep = Plan(names)
    per_stage = Plan(names, tuple(Region(i, i + 1) for i in range(len(names))))
    kept = {name: rank_cost(plan, problem).kept_bytes
            for name, plan in (("keep", keep), ("per-stage", per_stage))}
    assert 0 < kept["per-stage"] < kept["keep"]
    for plan in (keep, per_stage):
        one = rank_cost(plan, problem)
        gpipe = pipeline_step([plan, plan], [problem, problem], "gpipe", 4)
        ofob = pipeline_step([plan, plan], [problem, problem], "1f1b", 4)
        assert gpipe.peaks == (one.peak_bytes + 3 * one.kept_bytes,) * 2
        assert ofob.peaks == (one.peak_bytes + one.kept_bytes, one.peak_bytes)
        assert gpipe.step_s == pytest.approx(ofob.step_s)  # equal ranks: the same bubble
    with pytest.raises(UsageError, match="one plan per stage"):
        pipeline_step([keep], [problem, problem], "gpipe", 4)


def test_a_1f1b_forward_after_the_first_backward_runs_with_every_gradient() -> None:
    # Measured with torch.distributed.pipelining (gloo, gpt halves, 1F1B over 2 ranks):
    # the first rank peaked in its third forward, after its first backward had made
    # every parameter gradient, 8% above its one-micro-batch peak plus one kept.
    import dataclasses

    from remat.core.solve import simulate

    base = Problem.load(FIXTURES / "chain_uniform_8.json")
    # each stage's backward makes gradients as large as what it saved: the step's own
    # backward frees about as much as it makes, a forward after it holds them all
    more = [s.saved_bytes["keep"] for s in base.stages]
    problem = dataclasses.replace(
        base, grads_bytes=base.grads_bytes + sum(more),
        stages=tuple(dataclasses.replace(s, grad_bytes=s.grad_bytes + m)
                     for s, m in zip(base.stages, more, strict=True)))
    plan = Plan(problem.stage_names)
    sim = simulate(plan, problem)
    first_backward = next(i for i, e in enumerate(sim.labels) if e.startswith("backward"))
    forward = max(sim.live[:first_backward])
    one = rank_cost(plan, problem)
    peaks = pipeline_step([plan, plan], [problem, problem], "1f1b", 4).peaks
    assert peaks[0] == forward + one.kept_bytes + problem.grads_bytes
    assert peaks[0] > one.peak_bytes + one.kept_bytes  # the old count missed it
    # one in flight on the last rank: its second forward holds every gradient too
    assert peaks[1] == max(one.peak_bytes, forward + problem.grads_bytes)


def test_the_schedule_buffers_add_to_the_ranks_that_keep_them() -> None:
    # GPipe's last rank peaks in its first backward, the three other micro-batches in
    # flight holding what their head and loss keep, beside its receive buffers; the
    # first rank keeps neither. Outputs kept for the merged output count from each
    # micro-batch's backward to the step's end.
    from remat.core.pipeline import ScheduleBuffers, rank_peak

    problem = Problem.load(FIXTURES / "chain_uniform_8.json")
    plan = Plan(problem.stage_names)
    plain = pipeline_step([plan, plan], [problem, problem], "gpipe", 4).peaks
    buffers = [ScheduleBuffers(), ScheduleBuffers(held_bytes=7, persistent_bytes=5)]
    kept = pipeline_step([plan, plan], [problem, problem], "gpipe", 4, buffers=buffers).peaks
    assert kept[0] == plain[0]
    assert kept[1] == plain[1] + 3 * 7 + 5
    # outputs far larger than the rest: the peak holds all four, each added byte of
    # output counts four times
    huge = 10 * plain[1]
    peaks = [rank_peak(plan, problem, "gpipe", 1, 2, 4, ScheduleBuffers(output_bytes=h))
             for h in (huge, 2 * huge)]
    assert peaks[1] - peaks[0] == 4 * huge
    with pytest.raises(UsageError, match="one ScheduleBuffers per stage"):
        pipeline_step([plan, plan], [problem, problem], "gpipe", 4, buffers=buffers[:1])


def test_what_a_rank_holds_from_its_first_backward_on_counts_once_and_only_after_it() -> None:
    # Measured (1F1B, 2 gloo ranks, 8 micro-batches, a per-op trace): rank 0's first
    # backward within 32 bytes of its prediction, every op after it one output over.
    from remat.core.pipeline import ScheduleBuffers, rank_peak

    buffers = ScheduleBuffers(persistent_bytes=5, output_bytes=2, after_first_backward_bytes=7,
                              after_backward_bytes=3)
    assert buffers.extras(0) == 5
    assert buffers.extras(3) == 5 + 3 * (2 + 3) + 7
    problem = Problem.load(FIXTURES / "chain_uniform_8.json")
    plan = Plan(problem.stage_names)
    huge = 10 * simulate_peak(plan, problem)  # large enough that an op after it holds the peak
    peaks = [rank_peak(plan, problem, "1f1b", 0, 2, 4,
                       ScheduleBuffers(after_first_backward_bytes=b))
             for b in (0, huge, 2 * huge)]
    assert peaks[1] > peaks[0]
    assert peaks[2] - peaks[1] == huge  # once, not once per backward done


def simulate_peak(plan: Plan, problem: Problem) -> int:
    from remat.core.solve import simulate

    return simulate(plan, problem).peak_bytes


def test_per_rank_plans_fit_every_rank_and_are_no_slower_than_uniform_per_layer() -> None:
    """1F1B over 2 ranks with 4 micro-batches: the first rank holds 2, the last 1, so at
    a budget the last fits without checkpointing the first must checkpoint; the plans fit
    and the pipeline is no slower than per-layer checkpointing everywhere (what
    frameworks apply uniformly)."""
    from remat.core.pipeline import plan_pipeline
    from remat.core.solve import simulate

    problem = Problem.load(FIXTURES / "chain_uniform_8.json")
    names = problem.stage_names
    per_stage = Plan(names, tuple(Region(i, i + 1) for i in range(len(names))))
    uniform = pipeline_step([per_stage] * 2, [problem] * 2, "1f1b", 4)
    budget = simulate(Plan(names), problem).peak_bytes  # one micro-batch, no checkpointing
    assert max(uniform.peaks) <= budget
    plans, step = plan_pipeline([problem] * 2, budget, "1f1b", 4)
    assert all(peak <= budget for peak in step.peaks)
    assert step.step_s <= uniform.step_s + 1e-12
    kept = [rank_cost(plan, problem).kept_bytes for plan in plans]
    assert kept[0] < kept[1]  # the rank with more in flight keeps less per micro-batch
    assert not plans[1].regions  # the last rank holds one: it needs no checkpointing
    with pytest.raises(Exception, match="no plan of pipeline rank 0 fits"):
        plan_pipeline([problem] * 2, budget // 4, "gpipe", 4)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_where_the_uniform_plan_fits_with_the_stages_buffers_the_per_rank_plans_fit(
        schedule: str) -> None:
    # The pipeline bench found plans chosen without the stage's buffers over budget by
    # what the last rank keeps; the candidates are now counted under the schedule with
    # them, and per-stage regions are always among them.
    from remat.core.pipeline import ScheduleBuffers, plan_pipeline, rank_peak

    problem = Problem.load(FIXTURES / "chain_uniform_8.json")
    per_stage = Plan(problem.stage_names,
                     tuple(Region(i, i + 1) for i in range(problem.n)))
    big = problem.stages[0].boundary_bytes
    buffers = [ScheduleBuffers(), ScheduleBuffers(output_bytes=big, held_bytes=big,
                                                  persistent_bytes=3 * big)]
    uniform = pipeline_step([per_stage] * 2, [problem] * 2, schedule, 4, buffers=buffers)
    budget = max(uniform.peaks)
    plans, step = plan_pipeline([problem] * 2, budget, schedule, 4, buffers=buffers)
    for r, plan in enumerate(plans):
        assert rank_peak(plan, problem, schedule, r, 2, 4, buffers[r]) == step.peaks[r]
        assert step.peaks[r] <= budget
    assert step.step_s <= uniform.step_s


def test_interleaved_plans_fit_every_rank_with_all_its_chunks() -> None:
    """Interleaved 1F1B, 2 ranks of 2 chunks, 4 micro-batches: a rank holds its chunks'
    micro-batches together (the first rank 5 forwards at once), so a budget one chunk
    fits alone makes both checkpoint; the plans fit and are no slower than per-layer
    checkpointing everywhere; a chunk's figures add to the rank's peak."""
    from remat.core.pipeline import chunked_rank_peak, plan_pipeline, rank_peak

    problem = Problem.load(FIXTURES / "chain_uniform_8.json")
    names = problem.stage_names
    keep = Plan(names)
    per_stage = Plan(names, tuple(Region(i, i + 1) for i in range(len(names))))
    uniform = pipeline_step([per_stage] * 4, [problem] * 4, "interleaved-1f1b", 4, chunks=2)
    plain = pipeline_step([keep] * 4, [problem] * 4, "interleaved-1f1b", 4, chunks=2)
    assert uniform.in_flight == plain.in_flight == (5, 3)
    assert all(u < q for u, q in zip(uniform.peaks, plain.peaks, strict=True))
    # two chunks hold more than one does under the same order
    alone = rank_peak(keep, problem, "1f1b", 0, 2, 4)
    assert chunked_rank_peak([keep, keep], [problem] * 2, "interleaved-1f1b", 0, 2, 4) > alone
    budget = (max(uniform.peaks) + min(plain.peaks)) // 2
    plans, step = plan_pipeline([problem] * 4, budget, "interleaved-1f1b", 4, chunks=2)
    assert all(peak <= budget for peak in step.peaks)
    assert step.step_s <= uniform.step_s + 1e-12
    assert any(plan.regions for plan in plans)
    with pytest.raises(UsageError, match="one plan, problem and ScheduleBuffers per chunk"):
        chunked_rank_peak([keep, keep], [problem], "interleaved-1f1b", 0, 2, 4)
