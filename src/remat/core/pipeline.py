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
step is ``(m + p - 1) * (F + B)`` for both schedules (tests check it).

Interleaved 1F1B (torch's ``ScheduleInterleaved1F1B``, Narayanan et al. 2021) gives each
rank ``v`` chunks of the model: virtual stage ``s`` runs on rank ``s % p`` as its chunk
``s // p``, so problems, plans and costs are per virtual stage, in pipeline order. Its
order is torch's (warm-up forwards over the chunks a round of micro-batches at a time,
then one forward and one backward, then the remaining backwards; a test compares it with
torch's own), and a rank's peak adds, to the op it runs, what each of its other chunks
holds at that moment: parameters, optimizer state, its receive buffer, gradients after
that chunk's first backward, and its micro-batches in flight. Torch-free.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from remat.core.errors import CheckFailed, UsageError
from remat.core.plan_format import Plan, Region
from remat.core.solve.in_flight import InFlight, fastest_kept_capped
from remat.core.solve.problem import Problem
from remat.core.solve.simulator import Simulation, simulate

__all__ = ["SCHEDULES", "ZERO_BUBBLE", "PipelineStep", "RankCost", "ScheduleBuffers",
           "check_schedule", "chunked_rank_peak", "descend", "in_flight",
           "pipeline_step", "plan_pipeline", "rank_choices", "rank_cost", "rank_peak",
           "schedule_order", "step_time", "with_ladder"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
#: torch's schedules that split each backward into input and weight passes, in orders torch
#: builds: remat.core.zero_bubble plans them from those orders, not this module.
ZERO_BUBBLE = ("interleaved-zero-bubble", "zbv-zero-bubble", "dualpipev")
#: Schedules that run one stage per rank (the others take ``chunks``).
SINGLE_STAGE = ("gpipe", "1f1b")


def check_schedule(schedule: str, ranks: int = 1, microbatches: int = 1,
                   chunks: int = 1) -> None:
    """UsageError for a schedule remat does not model, a count below 1, or chunks the
    schedule does not take."""
    if schedule in ZERO_BUBBLE:
        raise UsageError(
            f"schedule {schedule!r} splits each backward into an input pass and weight passes "
            "in an order torch builds, so it is planned from that order: use "
            "remat.core.zero_bubble.split_pipeline_step / plan_split_pipeline with "
            "remat.parallel.pipeline.schedule_orders(schedule), and apply the plans with "
            "split_backward=True")
    if schedule not in SCHEDULES:
        raise UsageError(f"schedule {schedule!r} is not known; choose one of "
                         f"{', '.join(SCHEDULES)}")
    for name, value in (("ranks", ranks), ("microbatches", microbatches), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{name}={value!r} must be a whole number >= 1")
    if schedule in SINGLE_STAGE and chunks != 1:
        raise UsageError(f"schedule {schedule!r} runs one stage per rank, not {chunks}; "
                         "use interleaved-1f1b for several")
    if schedule == "interleaved-1f1b":
        rounds = max(1, microbatches // ranks)
        if microbatches % rounds:
            raise UsageError(f"interleaved-1f1b needs the micro-batch count to be a multiple "
                             f"of its rounds ({rounds} for {ranks} ranks), not {microbatches}")


def _check_rank(rank: int, ranks: int) -> None:
    if not 0 <= rank < ranks:
        raise UsageError(f"rank {rank} is outside 0..{ranks - 1}")


def schedule_order(schedule: str, rank: int, ranks: int, microbatches: int, chunks: int = 1
                   ) -> list[tuple[str, int, int]]:
    """Rank ``rank``'s ops in order: ``(kind, chunk, i)``, kind ``"F"`` or ``"B"``, for
    micro-batch ``i`` on the rank's chunk ``chunk`` (virtual stage ``chunk * ranks + rank``;
    always 0 under the one-stage schedules)."""
    check_schedule(schedule, ranks, microbatches, chunks)
    _check_rank(rank, ranks)
    m = microbatches
    if schedule == "gpipe":
        return [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]
    if schedule == "1f1b":
        warmup = min(ranks - rank, m)
        order = [("F", 0, i) for i in range(warmup)]
        for i in range(m):  # then one backward, one forward while forwards remain
            order.append(("B", 0, i))
            if warmup + i < m:
                order.append(("F", 0, warmup + i))
        return order
    # interleaved: forwards take the chunks in turn a round of micro-batches at a time;
    # backwards the same from the last chunk down (torch's _get_1f1b_rank_ops)
    v, per_round = chunks, m // max(1, m // ranks)
    total = m * v
    warmup = min((v - 1) * per_round + 2 * (ranks - 1 - rank), total)
    next_mb = {("F", c): 0 for c in range(v)} | {("B", c): 0 for c in range(v)}

    def op(kind: str, step: int) -> tuple[str, int, int]:
        c = ((step // per_round) % v if kind == "F"
             else v - 1 - ((step - warmup) // per_round) % v)
        i = next_mb[(kind, c)]
        next_mb[(kind, c)] = i + 1
        return (kind, c, i)

    order = [op("F", step) for step in range(warmup)]
    for step in range(warmup, total):
        order += [op("F", step), op("B", step)]
    order += [op("B", step) for step in range(total, total + warmup)]
    return order


def in_flight(schedule: str, rank: int, ranks: int, microbatches: int, chunks: int = 1) -> int:
    """How many micro-batch forwards rank ``rank`` holds at once at most, over its chunks
    (module docstring)."""
    held = most = 0
    for kind, _, _ in schedule_order(schedule, rank, ranks, microbatches, chunks):
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return most


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
    return _cost(simulate(plan, problem))


def _cost(sim: Simulation) -> RankCost:
    t = sim.time
    return RankCost(
        forward_s=t.forward_s,
        backward_s=t.backward_s + t.rebuild_s + t.option_s + t.overhead_s,
        outside_s=t.outside_chain_s,
        peak_bytes=sim.peak_bytes,
        kept_bytes=sim.kept_bytes,
    )


def _ranks_of(n_stages: int, chunks: int) -> int:
    if chunks < 1 or n_stages % chunks:
        raise UsageError(f"{n_stages} stages do not split into {chunks} chunks per rank; "
                         "give one per virtual stage, ranks x chunks in all")
    return n_stages // chunks


def step_time(costs: Sequence[RankCost], schedule: str, microbatches: int,
              send_s: float = 0.0, chunks: int = 1) -> float:
    """The pipeline's step: when the last rank finishes its last op and its once-a-step
    work, every op run in its rank's order as soon as what it needs is done. ``costs``:
    one per virtual stage, in pipeline order (one per rank where ``chunks`` is 1)."""
    n = len(costs)
    p = _ranks_of(n, chunks)
    check_schedule(schedule, p, microbatches, chunks)
    orders = [schedule_order(schedule, r, p, microbatches, chunks) for r in range(p)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, mb) -> finish
    free = [0.0] * p
    nxt = [0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            while nxt[r] < len(orders[r]):
                kind, c, i = orders[r][nxt[r]]
                s = c * p + r
                if kind == "F":
                    needs = [("F", s - 1, i)] if s > 0 else []
                    took = costs[s].forward_s
                else:
                    needs = [("F", s, i)] + ([("B", s + 1, i)] if s < n - 1 else [])
                    took = costs[s].backward_s
                if any(x not in done for x in needs):
                    break
                ready = max([free[r], *(done[x] + (send_s if x[1] % p != r else 0.0)
                                        for x in needs)])
                free[r] = done[(kind, s, i)] = ready + took
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # the orders are built deadlock-free; this guards a bad one
            raise AssertionError("the pipeline schedule deadlocked")
    return max(free[r] + sum(costs[c * p + r].outside_s for c in range(chunks))
               for r in range(p))


@dataclass(frozen=True)
class PipelineStep:
    """Each rank's peak and in-flight count, and the pipeline's step time."""

    peaks: tuple[int, ...]
    in_flight: tuple[int, ...]
    step_s: float


@dataclass(frozen=True)
class ScheduleBuffers:
    """What torch's pipeline stage keeps beyond the rank's one-micro-batch step
    (``torch.distributed.pipelining``, torch 2.13, measured; ``remat.parallel.pipeline``'s
    Note [What a pipeline stage keeps] says where each comes from)."""

    output_bytes: int = 0  # per micro-batch, from its backward to the step's end
    input_grad_bytes: int = 0  # per micro-batch, from its backward to the step's end
    persistent_bytes: int = 0  # throughout
    # per other micro-batch in flight, beyond what its plan keeps (may be negative:
    # what the plan keeps counts the rank's input, a receive buffer)
    held_bytes: int = 0
    # from the end of the rank's first backward on (measured, not identified: one more
    # tensor of the output's size on 1F1B ranks before the last)
    after_first_backward_bytes: int = 0
    # per micro-batch, from its backward to the step's end (measured, not identified: one
    # tensor of the output's size per backward on GPipe ranks before the last)
    after_backward_bytes: int = 0

    def extras(self, done_b: int) -> int:
        """What the schedule holds beyond the micro-batches in flight once ``done_b``
        backwards have run."""
        return (self.persistent_bytes
                + (self.output_bytes + self.input_grad_bytes + self.after_backward_bytes) * done_b
                + (self.after_first_backward_bytes if done_b else 0))


@dataclass(frozen=True)
class _Chunk:
    """One stage's figures on its rank for the schedule walk (Note [Pipeline rank peak])."""

    forward: int  # its one-micro-batch forward's peak
    first_backward: int  # its first backward's peak, before any gradient of its own
    later_backward: int  # a later backward's, with all its gradients
    tail: int  # from its optimizer step on
    kept: int  # per micro-batch in flight
    grads: int
    idle: int  # while another chunk runs: parameters, optimizer state, its input
    buffers: ScheduleBuffers

    def extras(self, done_b: int) -> int:
        return self.buffers.extras(done_b)


def _figures(plan: Plan, problem: Problem, buffers: ScheduleBuffers
             ) -> tuple[RankCost, _Chunk]:
    """The stage's cost and its figures for the schedule walk, from one simulation."""
    sim = simulate(plan, problem)
    return _cost(sim), _chunk(sim, plan, problem, buffers)


def _chunk(sim: Simulation, plan: Plan, problem: Problem, buffers: ScheduleBuffers
           ) -> _Chunk:
    # Note [Pipeline rank peak]: a rank's live bytes at any moment are those of the
    # micro-batch it runs (the one-micro-batch step's forward or backward) plus what
    # each other micro-batch in flight keeps from its forward to its backward, plus the
    # schedule's buffers (its receive buffers, and what it keeps of the micro-batches
    # already run). A micro-batch's output kept for the merged output stays after the
    # post-chain's backward, where the one-micro-batch step lets it go. Parameter
    # gradients exist from the end of the rank's first backward on, so a forward after
    # it (1F1B) runs with all of them, and a later backward adds none: its peak is the
    # backward's without gradients, plus all of them. With several chunks on a rank
    # (interleaved), each is such a walk of its own, and the others add what they hold.
    bare = simulate(plan, problem.without_grads)
    labels = sim.labels
    first_b = next(i for i, label in enumerate(labels) if label.startswith("backward"))
    last = labels.index("optimizer step") if "optimizer step" in labels else len(labels)
    post = [i for i in range(first_b, last) if labels[i] == "backward post-chain"]
    rest = [i for i in range(first_b, last) if labels[i] != "backward post-chain"]

    def backward(live: Sequence[int], more: int) -> int:
        return max(max((live[i] for i in post), default=0),
                   max((live[i] for i in rest), default=0) + buffers.output_bytes) + more

    return _Chunk(
        forward=max(sim.live[:first_b]),
        first_backward=backward(sim.live, 0),
        later_backward=backward(bare.live, problem.grads_bytes),
        tail=max(sim.live[last:], default=0),
        kept=sim.kept_bytes + buffers.held_bytes,
        grads=problem.grads_bytes,
        idle=problem.params_bytes + problem.optimizer_state_bytes + problem.inputs_bytes,
        buffers=buffers,
    )


def _walk(chunks: Sequence[_Chunk], order: Sequence[tuple[str, int, int]]) -> int:
    v = len(chunks)
    held, done = [0] * v, [0] * v

    def others(c: int) -> int:
        return sum(k.idle + (k.grads if done[j] else 0) + held[j] * k.kept + k.extras(done[j])
                   for j, k in enumerate(chunks) if j != c)

    peak = 0
    for kind, c, _ in order:
        k = chunks[c]
        if kind == "F":
            live = k.forward + (k.grads if done[c] else 0)
            held[c] += 1
            peak = max(peak, live + (held[c] - 1) * k.kept + k.extras(done[c]) + others(c))
        else:
            held[c] -= 1
            live = k.later_backward if done[c] else k.first_backward
            peak = max(peak, live + held[c] * k.kept + k.extras(done[c]) + others(c))
            done[c] += 1
    return max([peak, *(k.tail + k.extras(done[c]) + others(c) for c, k in enumerate(chunks))])


def schedule_terms(order: Sequence[tuple[str, int, int]], buffers: ScheduleBuffers
                   ) -> InFlight:
    """What a one-stage rank's schedule adds to each phase of its one-micro-batch step, as
    :func:`_walk` adds it (for :func:`remat.core.solve.in_flight.fastest_kept_capped`)."""
    terms: dict[str, list[tuple[int, int]]] = {"F0": [], "FG": [], "B1": [], "BL": []}
    held = done = 0
    for kind, _, _ in order:
        extras = buffers.extras(done)
        if kind == "F":
            held += 1
            count, which = held - 1, "FG" if done else "F0"
        else:
            held -= 1
            count, which = held, "BL" if done else "B1"
            done += 1
        # the others keep the plan's kept bytes plus the schedule's held bytes each
        terms[which].append((count, extras + count * buffers.held_bytes))
    def phase(kind: str) -> tuple[tuple[int, int], ...]:
        return tuple(sorted(set(terms[kind])))

    return InFlight(phase("F0"), phase("FG"), phase("B1"), phase("BL"),
                    output_bytes=buffers.output_bytes)


def fastest_rank_plan(problem: Problem, budget: int, schedule: str, rank: int, ranks: int,
                      microbatches: int, buffers: ScheduleBuffers = ScheduleBuffers(),
                      *, path: str = "auto") -> Plan | None:
    """The fastest plan of a one-stage rank (GPipe, 1F1B) whose peak under the schedule
    fits ``budget``, exact where the optimal tables are, in slots (Note [Capping what a
    plan keeps]), and never slower than the optimal plans at a ladder of one-micro-batch
    budgets that fit; None where none fits."""
    found, fits = _capped_rank_plan(problem, budget, schedule, rank, ranks, microbatches,
                                    buffers, path)
    # The tables are exact in slots: each held quantity is charged whole slots, so near the
    # budget they can miss a plan that fits in bytes (as the optimal solver's recipes
    # beside its tables, Note [Recipes beside the tables]); the ladder's plans, each solved
    # at its own budget, are scored beside it, so the plan is never slower than theirs.
    candidates = ([found] if found is not None else []) + [
        plan for plan in _ladder(problem) if fits(plan)]
    return min(candidates, key=lambda plan: simulate(plan, problem).step_time_s, default=None)


def _capped_rank_plan(problem: Problem, budget: int, schedule: str, rank: int, ranks: int,
                      microbatches: int, buffers: ScheduleBuffers, path: str = "auto"
                      ) -> tuple[Plan | None, Callable[[Plan], bool]]:
    """The capped tables' plan for the rank, and the rank's exact check of a plan."""
    if schedule not in SINGLE_STAGE:
        raise UsageError(f"fastest_rank_plan takes {' or '.join(SINGLE_STAGE)}; "
                         "plan_pipeline chooses the chunks of an interleaved rank together")
    check_schedule(schedule, ranks, microbatches)
    order = schedule_order(schedule, rank, ranks, microbatches)

    def fits(plan: Plan) -> bool:
        return _walk([_figures(plan, problem, buffers)[1]], order) <= budget

    # what follows the rank's last backward (the optimizer step, every micro-batch's
    # buffers) is the same under every plan: no plan fits where it does not
    bare = _figures(Plan(problem.stage_names), problem, buffers)[1]
    if bare.tail + bare.extras(sum(kind == "B" for kind, _, _ in order)) > budget:
        return None, fits
    terms = schedule_terms(order, buffers)
    return fastest_kept_capped(problem, budget, terms, fits, path=path), fits


def rank_peak(plan: Plan, problem: Problem, schedule: str, rank: int, ranks: int,
              microbatches: int, buffers: ScheduleBuffers = ScheduleBuffers()) -> int:
    """Rank ``rank``'s peak over its ops in schedule order (Note [Pipeline rank peak]),
    under a one-stage-per-rank schedule; :func:`chunked_rank_peak` for several."""
    return chunked_rank_peak([plan], [problem], schedule, rank, ranks, microbatches,
                             [buffers])


def chunked_rank_peak(plans: Sequence[Plan], problems: Sequence[Problem], schedule: str,
                      rank: int, ranks: int, microbatches: int,
                      buffers: Sequence[ScheduleBuffers] | None = None) -> int:
    """Rank ``rank``'s peak with its chunks' plans and problems (chunk ``c`` is virtual
    stage ``c * ranks + rank``), over its ops in schedule order."""
    v = len(plans)
    if len(problems) != v or (buffers is not None and len(buffers) != v):
        raise UsageError("give one plan, problem and ScheduleBuffers per chunk of the rank")
    order = schedule_order(schedule, rank, ranks, microbatches, v)
    figures = [_figures(plan, problem,
                        buffers[c] if buffers is not None else ScheduleBuffers())[1]
               for c, (plan, problem) in enumerate(zip(plans, problems, strict=True))]
    return _walk(figures, order)


def pipeline_step(plans: Sequence[Plan], problems: Sequence[Problem], schedule: str,
                  microbatches: int, send_s: float = 0.0,
                  buffers: Sequence[ScheduleBuffers] | None = None,
                  chunks: int = 1) -> PipelineStep:
    """Per virtual stage ``s``, ``plans[s]`` on ``problems[s]`` (one micro-batch of its
    chain); ``buffers[s]``: what the schedule keeps for it (none when not given). With
    ``chunks`` per rank, stage ``s`` runs on rank ``s % ranks``; peaks are per rank."""
    if len(plans) != len(problems) or not plans:
        raise UsageError("give one plan per stage's problem, for at least one stage")
    n = len(plans)
    p = _ranks_of(n, chunks)
    if buffers is None:
        buffers = [ScheduleBuffers()] * n
    if len(buffers) != n:
        raise UsageError("give one ScheduleBuffers per stage")
    check_schedule(schedule, p, microbatches, chunks)
    figures = [_figures(plan, problem, b)
               for plan, problem, b in zip(plans, problems, buffers, strict=True)]
    costs = [cost for cost, _ in figures]
    counts = tuple(in_flight(schedule, r, p, microbatches, chunks) for r in range(p))
    peaks = tuple(
        _walk([figures[c * p + r][1] for c in range(chunks)],
              schedule_order(schedule, r, p, microbatches, chunks))
        for r in range(p))
    return PipelineStep(peaks, counts, step_time(costs, schedule, microbatches, send_s, chunks))


# -- choosing every rank's plan ---------------------------------------------------------

#: Single-micro-batch budgets tried per rank, between its smallest peak and no limit.
BUDGET_STEPS = 12


#: At most this many chunk-plan combinations are checked per rank (interleaved).
COMBINATIONS = 4096


def _ladder(problem: Problem) -> list[Plan]:
    """The stage's optimal plans at a ladder of one-micro-batch budgets, its
    smallest-peak plan and per-stage regions (the least a micro-batch in flight keeps,
    often the only fit where many are in flight), without repeats."""
    import remat.core.solve.solvers as solvers

    least = solvers.minimum_budget(problem)
    most = simulate(Plan(problem.stage_names), problem).peak_bytes
    per_stage = Plan(problem.stage_names, tuple(Region(i, i + 1) for i in range(problem.n)))
    return with_ladder([per_stage, solvers.min_peak(problem)],
                       lambda budget: solvers.optimal(problem, budget), least, most)


def with_ladder(plans: list[Plan], solve: Callable[[int], Plan], least: int, most: int
                ) -> list[Plan]:
    """``plans`` and ``solve(budget)``'s plans at :data:`BUDGET_STEPS` + 1 budgets from
    ``least`` to ``most`` (those it finds none for left out), without repeats."""
    plans = list(plans)
    for k in range(BUDGET_STEPS + 1):
        budget = least + (most - least) * k // BUDGET_STEPS
        if budget < 1:
            continue  # nothing to plan: a chain of no bytes at all
        try:
            plans.append(solve(budget))
        except CheckFailed:
            continue
    found: dict[tuple[tuple[tuple[int, int], ...], tuple[str, ...]], Plan] = {}
    for plan in plans:
        found.setdefault((tuple((r.start, r.stop) for r in plan.regions), tuple(plan.options)),
                         plan)
    return list(found.values())


def _thin(items: list[int], keep: int) -> list[int]:
    if len(items) <= keep:
        return items
    return sorted({items[round(k * (len(items) - 1) / (keep - 1))] for k in range(keep)})


def rank_choices(ladders: Sequence[Sequence[tuple[Plan, RankCost, _Chunk]]], budget: int,
                 peak_of: Callable[[list[_Chunk]], int]) -> list[tuple[int, ...]]:
    """The rank's combinations of its chunks' candidates whose peak (``peak_of`` the
    chosen candidates' figures, in the rank's chunk order) fits ``budget`` and that no
    other fitting one beats in every chunk's time, fastest first."""
    v = len(ladders)
    per = max(2, int(COMBINATIONS ** (1 / v)))
    ids = [_thin(list(range(len(ladder))), per) for ladder in ladders]
    fitting = [combo for combo in itertools.product(*ids)
               if peak_of([ladders[c][i][2] for c, i in enumerate(combo)]) <= budget]

    def times(combo: tuple[int, ...]) -> tuple[float, ...]:
        return tuple(t for c, i in enumerate(combo)
                     for t in (ladders[c][i][1].forward_s, ladders[c][i][1].backward_s))

    timed = {combo: times(combo) for combo in fitting}
    front = [a for a in fitting
             if not any(b != a and all(x <= y for x, y in zip(timed[b], timed[a], strict=True))
                        and timed[b] != timed[a] for b in fitting)]
    return sorted(front, key=lambda combo: sum(timed[combo]))


def descend(counts: Sequence[int], time_of: Callable[[Sequence[int]], float]) -> list[int]:
    """From every rank's first (fastest) choice, each rank in turn takes the choice among
    its ``counts[r]`` that shortens ``time_of`` most, until none does."""
    chosen = [0] * len(counts)
    best = time_of(chosen)
    improved = True
    while improved:
        improved = False
        for r, count in enumerate(counts):
            for k in range(count):
                trial = [*chosen[:r], k, *chosen[r + 1:]]
                t = time_of(trial)
                if t < best - 1e-12:
                    best, chosen, improved = t, trial, True
    return chosen


def plan_pipeline(problems: Sequence[Problem], budget: int, schedule: str,
                  microbatches: int, send_s: float = 0.0,
                  buffers: Sequence[ScheduleBuffers] | None = None,
                  chunks: int = 1) -> tuple[list[Plan], PipelineStep]:
    """Every stage's plan for the pipeline's step time under ``budget`` bytes per rank
    (``problems``: one per virtual stage, ``chunks`` per rank, as in
    :func:`pipeline_step`).

    Per stage, candidates are its optimal plans at a ladder of one-micro-batch budgets,
    its smallest-peak plan and per-stage regions; per rank, the combinations of its
    chunks' candidates whose peak under the schedule (:func:`chunked_rank_peak`, with
    ``buffers``) fits ``budget`` (early ranks hold more under 1F1B, so they get tighter
    plans), less those another fitting one beats in every chunk's time. Then, starting
    from every rank's fastest, each rank in turn takes the combination that shortens the
    pipeline's step most, until none does: a rank off the critical path may keep a
    slower plan. Raises CheckFailed when a rank has no plan that fits.

    With one stage a rank (GPipe, 1F1B) each rank's candidates also hold its fastest
    plan that fits (:func:`fastest_rank_plan`, exact where the optimal tables are): a
    rank's forward and once-a-step work are the same under every plan and the step never
    shortens when a backward grows, so every rank taking that plan is the fastest choice
    over all ranks' plans together. With several chunks a rank (interleaved) the chunks'
    plans are chosen from their candidates as above.
    """
    n = len(problems)
    p = _ranks_of(n, chunks)
    check_schedule(schedule, p, microbatches, chunks)
    if buffers is None:
        buffers = [ScheduleBuffers()] * n
    if len(buffers) != n:
        raise UsageError("give one ScheduleBuffers per stage")
    run = _PipelineRun(schedule, p, microbatches, chunks, send_s, tuple(buffers))
    ladders = _candidates(problems, budget, run)
    picks = _Picks(run, ladders, [_rank_fits(ladders, budget, run, r) for r in range(p)])
    chosen = descend([len(c) for c in picks.choices], picks.time_of)
    plans = [plan for plan, _, _ in picks.picked(chosen)]
    return plans, pipeline_step(plans, problems, schedule, microbatches, send_s, buffers,
                                chunks)


@dataclass(frozen=True)
class _PipelineRun:
    """The schedule plan_pipeline plans for, and each stage's buffers."""

    schedule: str
    ranks: int
    microbatches: int
    chunks: int
    send_s: float
    buffers: tuple[ScheduleBuffers, ...]

    def stages(self, r: int) -> list[int]:
        """Rank ``r``'s virtual stages, in chunk order."""
        return [c * self.ranks + r for c in range(self.chunks)]


_Ladders = list[list[tuple[Plan, RankCost, _Chunk]]]


def _candidates(problems: Sequence[Problem], budget: int, run: _PipelineRun) -> _Ladders:
    """Each stage's candidates with their figures: its ladder, and with one stage a rank,
    first the rank's fastest plan that fits where the capped tables find one."""
    buffers = run.buffers
    ladders = [[(plan, *_figures(plan, problem, buffers[s])) for plan in _ladder(problem)]
               for s, problem in enumerate(problems)]
    if run.chunks == 1:
        # one stage a rank: its fastest plan that fits is exact (Note [Capping what a plan
        # keeps]), and with the forwards plan-independent no slower plan shortens the step
        for r, problem in enumerate(problems):
            exact = _capped_rank_plan(problem, budget, run.schedule, r, run.ranks,
                                      run.microbatches, buffers[r])[0]
            if exact is not None:
                ladders[r].insert(0, (exact, *_figures(exact, problem, buffers[r])))
    return ladders


def _rank_fits(ladders: _Ladders, budget: int, run: _PipelineRun, r: int
               ) -> list[tuple[int, ...]]:
    """Rank ``r``'s combinations of its chunks' candidates that fit ``budget``
    (:func:`rank_choices`); CheckFailed where none does."""
    stages = run.stages(r)
    order = schedule_order(run.schedule, r, run.ranks, run.microbatches, run.chunks)
    found = rank_choices([ladders[s] for s in stages], budget,
                         functools.partial(_walk, order=order))
    if not found:
        count = in_flight(run.schedule, r, run.ranks, run.microbatches, run.chunks)
        kept = sum(run.buffers[s].persistent_bytes
                   + run.microbatches * run.buffers[s].output_bytes for s in stages)
        raise CheckFailed(
            f"no plan of pipeline rank {r} fits {budget} bytes with "
            f"{count} micro-batch{'es' if count != 1 else ''} in flight"
            + (f" and the {kept} bytes the stage keeps for {run.microbatches} micro-batches "
               "(receive buffers, outputs)" if kept else "")
            + "; raise the budget, or use fewer or smaller micro-batches")
    return found


@dataclass(frozen=True)
class _Picks:
    """The ranks' fitting combinations (``choices[r]``) and the stages' candidates."""

    run: _PipelineRun
    ladders: _Ladders
    choices: list[list[tuple[int, ...]]]

    def picked(self, choice: Sequence[int]) -> list[tuple[Plan, RankCost, _Chunk]]:
        """Every stage's candidate under ``choice``, one combination a rank."""
        p = self.run.ranks
        out: list[tuple[Plan, RankCost, _Chunk]] = [self.ladders[0][0]] * len(self.ladders)
        for r, k in enumerate(choice):
            for c, i in enumerate(self.choices[r][k]):
                out[c * p + r] = self.ladders[c * p + r][i]
        return out

    def time_of(self, choice: Sequence[int]) -> float:
        """The pipeline's step time under ``choice``."""
        run = self.run
        return step_time([cost for _, cost, _ in self.picked(choice)], run.schedule,
                         run.microbatches, run.send_s, run.chunks)
