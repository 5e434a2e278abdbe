"""Pipeline parallelism on paper: each rank's peak and the pipeline's step time.

Under pipeline parallelism each rank runs its own chain of stages, one micro-batch at a
time, and holds several micro-batches' activations at once: how many depends on the
schedule and the rank. With ``p`` ranks and ``m`` micro-batches, GPipe runs every
forward before any backward, so every rank holds all ``m``; 1F1B (torch's
``Schedule1F1B``) runs ``min(p - r, m)`` forwards on rank ``r`` before its first
backward and then alternates, so rank ``r`` holds at most that many. A rank's peak is
then its one-micro-batch step peak (the simulator's, under its own plan) plus what each
other micro-batch in flight keeps from its forward to its backward
(``Simulation.kept_bytes``): exact where the one-micro-batch peak falls in backward, an
upper bound otherwise.

The step time comes from the schedule itself: every rank runs its ops in the schedule's
order, a forward after the previous rank's forward of the same micro-batch (and a send),
a backward after the next rank's backward of it; a rebuild is part of the backward it
serves, so checkpointing on a rank that waits in the bubble costs the pipeline little
and on the slowest rank it stretches the whole step. With equal ranks and no sends the
step is ``(m + p - 1) * (F + B)`` for both schedules (tests check it). Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from remat.core.errors import CheckFailed, UsageError
from remat.core.plan_format import Plan, Region
from remat.core.solve.problem import Problem
from remat.core.solve.simulator import simulate

__all__ = ["SCHEDULES", "PipelineStep", "RankCost", "ScheduleBuffers", "check_schedule",
           "in_flight",
           "pipeline_step", "plan_pipeline", "rank_cost", "rank_peak", "schedule_order",
           "step_time"]

SCHEDULES = ("gpipe", "1f1b")


def check_schedule(schedule: str, ranks: int = 1, microbatches: int = 1) -> None:
    """UsageError for a schedule remat does not model or a count below 1."""
    if schedule not in SCHEDULES:
        raise UsageError(f"schedule {schedule!r} is not known; choose one of "
                         f"{', '.join(SCHEDULES)}")
    for name, value in (("ranks", ranks), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{name}={value!r} must be a whole number >= 1")


def in_flight(schedule: str, rank: int, ranks: int, microbatches: int) -> int:
    """How many micro-batches rank ``rank`` holds at once at most (module docstring)."""
    check_schedule(schedule, ranks, microbatches)
    if not 0 <= rank < ranks:
        raise UsageError(f"rank {rank} is outside 0..{ranks - 1}")
    return microbatches if schedule == "gpipe" else min(ranks - rank, microbatches)


def schedule_order(schedule: str, rank: int, ranks: int, microbatches: int
                   ) -> list[tuple[str, int]]:
    """Rank ``rank``'s ops in order: ``("F", i)`` and ``("B", i)`` for micro-batch ``i``."""
    m = microbatches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = in_flight(schedule, rank, ranks, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m):  # then one backward, one forward while forwards remain
        order.append(("B", i))
        if warmup + i < m:
            order.append(("F", warmup + i))
    return order


@dataclass(frozen=True)
class RankCost:
    """One micro-batch on one rank under its plan."""

    forward_s: float  # its forward
    backward_s: float  # its backward with the rebuilds and options it runs
    outside_s: float  # once per step: the optimizer step and what is outside the chain
    peak_bytes: int  # the one-micro-batch step's peak
    kept_bytes: int  # what it holds from its forward to its backward


def rank_cost(plan: Plan, problem: Problem) -> RankCost:
    """A rank's cost from the simulator (the problem is the rank's, for one micro-batch)."""
    sim = simulate(plan, problem)
    t = sim.time
    return RankCost(
        forward_s=t.forward_s,
        backward_s=t.backward_s + t.rebuild_s + t.option_s + t.overhead_s,
        outside_s=t.outside_chain_s,
        peak_bytes=sim.peak_bytes,
        kept_bytes=sim.kept_bytes,
    )


def step_time(costs: Sequence[RankCost], schedule: str, microbatches: int,
              send_s: float = 0.0) -> float:
    """The pipeline's step: when the last rank finishes its last op and its once-a-step
    work, every op run in its rank's order as soon as what it needs is done."""
    p = len(costs)
    check_schedule(schedule, p, microbatches)
    orders = [schedule_order(schedule, r, p, microbatches) for r in range(p)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, rank, micro-batch) -> finish
    free = [0.0] * p
    nxt = [0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            if nxt[r] >= len(orders[r]):
                continue
            kind, i = orders[r][nxt[r]]
            if kind == "F":
                needs = [("F", r - 1, i)] if r > 0 else []
                took = costs[r].forward_s
            else:
                needs = [("F", r, i)] + ([("B", r + 1, i)] if r < p - 1 else [])
                took = costs[r].backward_s
            if any(n not in done for n in needs):
                continue
            ready = max([free[r], *(done[n] + (send_s if n[1] != r else 0.0)
                                    for n in needs)])
            free[r] = done[(kind, r, i)] = ready + took
            nxt[r] += 1
            remaining -= 1
            progressed = True
        if not progressed:  # the orders are built deadlock-free; this guards a bad one
            raise AssertionError("the pipeline schedule deadlocked")
    return max(free[r] + costs[r].outside_s for r in range(p))


@dataclass(frozen=True)
class PipelineStep:
    """Each rank's peak and in-flight count, and the pipeline's step time."""

    peaks: tuple[int, ...]
    in_flight: tuple[int, ...]
    step_s: float


@dataclass(frozen=True)
class ScheduleBuffers:
    """What torch's pipeline stage keeps beyond the rank's one-micro-batch step
    (``torch.distributed.pipelining``, torch 2.13, measured; ``remat.pipelining``'s
    Note [What a pipeline stage keeps] says where each comes from)."""

    output_bytes: int = 0  # per micro-batch, from its backward to the step's end
    input_grad_bytes: int = 0  # per micro-batch, from its backward to the step's end
    persistent_bytes: int = 0  # throughout
    # per other micro-batch in flight, beyond what its plan keeps (may be negative:
    # what the plan keeps counts the rank's input, a receive buffer)
    held_bytes: int = 0


def _without_grads(problem: Problem) -> Problem:
    stages = tuple(replace(s, grad_bytes=0, pending_grad_bytes=0) for s in problem.stages)
    return replace(problem, stages=stages, grads_bytes=0, pre_chain_grads_bytes=0,
                   post_chain_grads_bytes=0)


def rank_peak(plan: Plan, problem: Problem, schedule: str, rank: int, ranks: int,
              microbatches: int, buffers: ScheduleBuffers = ScheduleBuffers()) -> int:
    """Rank ``rank``'s peak over its ops in schedule order (Note [Pipeline rank peak])."""
    # Note [Pipeline rank peak]: a rank's live bytes at any moment are those of the
    # micro-batch it runs (the one-micro-batch step's forward or backward) plus what
    # each other micro-batch in flight keeps from its forward to its backward, plus the
    # schedule's buffers (its receive buffers, and what it keeps of the micro-batches
    # already run). A micro-batch's output kept for the merged output stays after the
    # post-chain's backward, where the one-micro-batch step lets it go. Parameter
    # gradients exist from the end of the rank's first backward on, so a forward after
    # it (1F1B) runs with all of them, and a later backward adds none: its peak is the
    # backward's without gradients, plus all of them.
    sim = simulate(plan, problem)
    bare = simulate(plan, _without_grads(problem))
    labels = sim.labels
    first_b = next(i for i, label in enumerate(labels) if label.startswith("backward"))
    last = labels.index("optimizer step") if "optimizer step" in labels else len(labels)
    post = [i for i in range(first_b, last) if labels[i] == "backward post-chain"]
    rest = [i for i in range(first_b, last) if labels[i] != "backward post-chain"]

    def backward(live: Sequence[int], more: int, current_output: int) -> int:
        return max(max((live[i] for i in post), default=0),
                   max((live[i] for i in rest), default=0) + current_output) + more

    forward = max(sim.live[:first_b])
    kept = sim.kept_bytes + buffers.held_bytes
    held = done_b = 0
    peak = 0
    for kind, _ in schedule_order(schedule, rank, ranks, microbatches):
        extras = (buffers.persistent_bytes
                  + (buffers.output_bytes + buffers.input_grad_bytes) * done_b)
        if kind == "F":
            grads = problem.grads_bytes if done_b else 0
            peak = max(peak, forward + held * kept + grads + extras)
            held += 1
        else:
            held -= 1
            if done_b:
                live = backward(bare.live, problem.grads_bytes, buffers.output_bytes)
            else:
                live = backward(sim.live, 0, buffers.output_bytes)
            peak = max(peak, live + held * kept + extras)
            done_b += 1
    extras = (buffers.persistent_bytes
              + (buffers.output_bytes + buffers.input_grad_bytes) * done_b)
    return max(peak, max(sim.live[last:], default=0) + extras)


def pipeline_step(plans: Sequence[Plan], problems: Sequence[Problem], schedule: str,
                  microbatches: int, send_s: float = 0.0,
                  buffers: Sequence[ScheduleBuffers] | None = None) -> PipelineStep:
    """Per rank ``r``, ``plans[r]`` on ``problems[r]`` (one micro-batch of its chain);
    ``buffers[r]``: what the schedule keeps on it (none when not given)."""
    if len(plans) != len(problems) or not plans:
        raise UsageError("give one plan per rank's problem, for at least one rank")
    p = len(plans)
    if buffers is None:
        buffers = [ScheduleBuffers()] * p
    if len(buffers) != p:
        raise UsageError("give one ScheduleBuffers per rank")
    costs = [rank_cost(plan, problem) for plan, problem in zip(plans, problems, strict=True)]
    counts = tuple(in_flight(schedule, r, p, microbatches) for r in range(p))
    peaks = tuple(rank_peak(plan, problem, schedule, r, p, microbatches, buffers[r])
                  for r, (plan, problem) in enumerate(zip(plans, problems, strict=True)))
    return PipelineStep(peaks, counts, step_time(costs, schedule, microbatches, send_s))


# -- choosing every rank's plan ---------------------------------------------------------

#: Single-micro-batch budgets tried per rank, between its smallest peak and no limit.
BUDGET_STEPS = 12


def _candidates(problem: Problem, budget: int, schedule: str, rank: int, ranks: int,
                microbatches: int, buffers: ScheduleBuffers) -> list[tuple[Plan, RankCost]]:
    """The rank's optimal plans at a ladder of one-micro-batch budgets, its
    smallest-peak plan and per-stage regions, those that fit ``budget`` on the rank
    under the schedule (:func:`rank_peak`), fastest first."""
    from remat.core.solve import solvers

    least = solvers.minimum_budget(problem)
    most = simulate(Plan(problem.stage_names), problem).peak_bytes
    # per-stage regions too: the least a micro-batch in flight keeps, often the only
    # fit where many are in flight
    per_stage = Plan(problem.stage_names, tuple(Region(i, i + 1) for i in range(problem.n)))
    plans = [per_stage, solvers.min_peak(problem)]
    for k in range(BUDGET_STEPS + 1):
        try:
            plans.append(solvers.optimal(problem, least + (most - least) * k // BUDGET_STEPS))
        except CheckFailed:
            continue
    found: dict[tuple[tuple[tuple[int, int], ...], tuple[str, ...]], tuple[Plan, RankCost]] = {}
    for plan in plans:
        key = (tuple((r.start, r.stop) for r in plan.regions), tuple(plan.options))
        if key in found:
            continue
        if rank_peak(plan, problem, schedule, rank, ranks, microbatches, buffers) <= budget:
            found[key] = (plan, rank_cost(plan, problem))
    return sorted(found.values(), key=lambda pc: pc[1].forward_s + pc[1].backward_s)


def plan_pipeline(problems: Sequence[Problem], budget: int, schedule: str,
                  microbatches: int, send_s: float = 0.0,
                  buffers: Sequence[ScheduleBuffers] | None = None
                  ) -> tuple[list[Plan], PipelineStep]:
    """Every rank's plan for the pipeline's step time under ``budget`` bytes per rank.

    Per rank, candidates are its optimal plans at a ladder of one-micro-batch budgets,
    its smallest-peak plan and per-stage regions, those whose peak under the schedule
    (:func:`rank_peak`, with ``buffers``) fits ``budget`` (early ranks hold
    more under 1F1B, so they get tighter plans); then, starting from every rank's fastest
    candidate, each rank in turn takes the candidate that shortens the pipeline's step
    most, until none does: a rank off the critical path may keep a slower plan. Raises
    CheckFailed when a rank has no plan that fits.
    """
    p = len(problems)
    if buffers is None:
        buffers = [ScheduleBuffers()] * p
    if len(buffers) != p:
        raise UsageError("give one ScheduleBuffers per rank")
    counts = [in_flight(schedule, r, p, microbatches) for r in range(p)]
    options = [_candidates(problem, budget, schedule, r, p, microbatches, buffers[r])
               for r, problem in enumerate(problems)]
    for r, found in enumerate(options):
        if not found:
            b = buffers[r]
            kept = b.persistent_bytes + microbatches * b.output_bytes
            raise CheckFailed(
                f"no plan of pipeline rank {r} fits {budget} bytes with "
                f"{counts[r]} micro-batch{'es' if counts[r] != 1 else ''} in flight"
                + (f" and the {kept} bytes the stage keeps for {microbatches} micro-batches "
                   "(receive buffers, outputs)" if kept else "")
                + "; raise the budget, or use fewer or smaller micro-batches")
    chosen = [0] * p

    def time_of(choice: Sequence[int]) -> float:
        return step_time([options[r][c][1] for r, c in enumerate(choice)], schedule,
                         microbatches, send_s)

    best = time_of(chosen)
    improved = True
    while improved:
        improved = False
        for r in range(p):
            for c in range(len(options[r])):
                trial = list(chosen)
                trial[r] = c
                t = time_of(trial)
                if t < best - 1e-12:
                    best, chosen, improved = t, trial, True
    plans = [options[r][c][0] for r, c in enumerate(chosen)]
    return plans, pipeline_step(plans, problems, schedule, microbatches, send_s, buffers)
