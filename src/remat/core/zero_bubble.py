"""Zero-bubble pipeline schedules on paper: each rank's peak and the step time (torch-free).

Note [A backward in passes, on paper]
-------------------------------------
torch's zero-bubble schedules (``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``) run a stage's backward of a micro-batch as an input pass ``I``
(the input's gradient, sent on at once, the graph kept) and later a weight pass ``W``
(the parameters' gradients), to fill the bubble; some ops stay a full backward ``B``.
The first stage, whose input needs no gradient, does nothing in ``I`` and its whole
backward in ``W``. Their orders are built by torch and differ by schedule, rank and
micro-batch count, so this module takes them as given (``remat.parallel.pipeline.schedule_orders``
reads them off a built schedule): per rank, its ops in order as ``(kind, stage, i)``.

With the regions run by ``split_backward=True`` (Note [One rebuild for a backward in
passes] in remat.runtime.rebuild_once) a micro-batch on a stage holds, between ``F`` and
``I``, what its plan keeps (``Simulation.kept_bytes``, as under 1F1B), and between ``I``
and ``W`` what the input pass left for the weight pass: the rebuilt tensors, kept with the
graph, so the same for every plan (measured on the test gpt's second half: 3,885 KB
after the input pass with no plan, a region per block and one region over both blocks;
the input pass's peak 4,082 KB for all three). So a stage's plan sets its forward's peak
and what a micro-batch keeps until ``I``; the input pass's peak, what it leaves and the
weight pass's peak are the stage's own, measured once without a plan
(:class:`SplitFigures`, ``remat.parallel.pipeline.split_figures``). Time: ``I`` is the input
pass's measured time plus the plan's rebuilds (they run at the first pass that needs
them); ``W`` the weight pass's.

A rank's live bytes at an op are its op's own (the forward's peak, the input pass's, the
weight pass's, or a full backward's as in Note [Pipeline rank peak]) plus, per stage it
holds, each other micro-batch between ``F`` and ``I`` (kept), each between ``I`` and ``W``
(held), its gradients once its first ``W`` or ``B`` ran, and the schedule's buffers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from remat.core.errors import CheckFailed, UsageError
from remat.core.pipeline import (
    RankCost,
    ScheduleBuffers,
    _Chunk,
    _figures,
    descend,
    rank_choices,
    rank_cost,
    with_ladder,
)
from remat.core.plan_format import Plan, Region, parse_option
from remat.core.solve.problem import Problem

__all__ = ["KINDS", "SplitFigures", "plan_split_pipeline", "split_pipeline_step",
           "split_step_time"]

#: The ops of a rank's order: forward, input pass, weight pass, full backward.
KINDS = ("F", "I", "W", "B")


@dataclass(frozen=True)
class SplitFigures:
    """A stage's backward as two passes, for one micro-batch without a plan (Note [A
    backward in passes, on paper]). Bytes are above the stage's parameters, optimizer
    state and input, as the simulator's ``kept_bytes``. Time: ``input_s`` and
    ``weight_s``, the two passes' measured seconds (the plan's rebuilds run in the input
    pass, on top); where they are not known, ``weight_share`` of the one-pass backward's
    time goes to the weight pass and the rest to the input pass. Measured on the test
    gpt's stages (hidden 64), the two passes took about twice one backward, each about
    as long as it: a second walk over the graph costs as much as the first on a model
    this small, so a share of one backward prices them at half."""

    input_peak_bytes: int  # the input pass's peak, the micro-batch's forward state included
    held_bytes: int  # what it leaves for the weight pass
    weight_peak_bytes: int  # the first weight pass's peak (no gradients before it)
    later_weight_peak_bytes: int  # a later one's, the gradients there from the start
    weight_share: float = 0.5
    input_s: float | None = None
    weight_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("input_peak_bytes", "held_bytes", "weight_peak_bytes",
                     "later_weight_peak_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UsageError(f"SplitFigures.{name}={value!r} must be a whole number >= 0")
        if not 0.0 <= self.weight_share <= 1.0:
            raise UsageError(f"SplitFigures.weight_share={self.weight_share!r} must be "
                             "between 0 and 1")
        for name in ("input_s", "weight_s"):
            value = getattr(self, name)
            if value is not None and not value >= 0.0:
                raise UsageError(f"SplitFigures.{name}={value!r} must be seconds >= 0")
        if (self.input_s is None) != (self.weight_s is None):
            raise UsageError("give SplitFigures both input_s and weight_s, or neither")

    def input_pass_s(self, backward_s: float) -> float:
        """The input pass's time, without rebuilds, for a one-pass backward of
        ``backward_s``."""
        if self.input_s is not None:
            return self.input_s
        return backward_s * (1.0 - self.weight_share)

    def weight_pass_s(self, backward_s: float) -> float:
        """The weight pass's time, for a one-pass backward of ``backward_s``."""
        if self.weight_s is not None:
            return self.weight_s
        return backward_s * self.weight_share


Order = Sequence[tuple[str, int, int]]


def _placement(orders: Mapping[int, Order], n: int) -> list[int]:
    """The rank of each stage, from the orders; UsageError for an order that is not one."""
    rank_of: dict[int, int] = {}
    for rank, order in orders.items():
        for op in order:
            if len(op) != 3 or op[0] not in KINDS:
                raise UsageError(f"rank {rank}'s order has {op!r}; give (kind, stage, "
                                 f"micro-batch) with kind one of {', '.join(KINDS)}")
            _, s, _ = op
            if not 0 <= s < n:
                raise UsageError(f"rank {rank}'s order names stage {s}, outside 0..{n - 1}")
            if rank_of.setdefault(s, rank) != rank:
                raise UsageError(f"stage {s} appears in the orders of ranks {rank_of[s]} "
                                 f"and {rank}; each stage runs on one rank")
    missing = [s for s in range(n) if s not in rank_of]
    if missing:
        raise UsageError(f"no rank's order runs stage {missing[0]}")
    return [rank_of[s] for s in range(n)]


def split_step_time(forward_s: Sequence[float], backward_s: Sequence[float],
                    rebuild_s: Sequence[float], outside_s: Sequence[float],
                    splits: Sequence[SplitFigures], orders: Mapping[int, Order],
                    send_s: float = 0.0) -> float:
    """The step under ``orders``: each op starts when its rank is free and what it needs
    is done (``F`` the previous stage's ``F``; ``I`` and ``B`` the stage's ``F`` and the
    next stage's ``I`` or ``B``; ``W`` the stage's ``I``, or on the first stage as ``B``),
    a send between ranks taking ``send_s``. Per stage: the forward, the backward without
    rebuilds, the rebuilds, and the once-a-step work."""
    n = len(forward_s)
    rank_of = _placement(orders, n)
    ranks = sorted(orders)
    done: dict[tuple[str, int, int], float] = {}
    free = dict.fromkeys(ranks, 0.0)
    nxt = dict.fromkeys(ranks, 0)
    remaining = sum(len(orders[r]) for r in ranks)

    def back_done(s: int, i: int) -> tuple[str, int, int] | None:
        for kind in ("I", "B") if s > 0 else ("W", "B"):
            if (kind, s, i) in done:
                return (kind, s, i)
        return None

    while remaining:
        progressed = False
        for r in ranks:
            order = orders[r]
            while nxt[r] < len(order):
                kind, s, i = order[nxt[r]]
                needs: list[tuple[str, int, int] | None]
                if kind == "F":
                    needs = [("F", s - 1, i)] if s > 0 else []
                    took = forward_s[s]
                elif kind == "W" and s > 0:
                    needs = [("I", s, i)]
                    took = splits[s].weight_pass_s(backward_s[s])
                elif kind == "I" and s == 0:  # the first stage's input pass is empty
                    needs = [("F", s, i)]
                    took = 0.0
                else:  # I, B, and the first stage's W (its whole backward)
                    needs = [("F", s, i)]
                    if s < n - 1:
                        needs.append(back_done(s + 1, i))
                    own = (splits[s].input_pass_s(backward_s[s]) if kind == "I"
                           else backward_s[s])
                    took = own + rebuild_s[s]
                if any(x is None or x not in done for x in needs):
                    break
                ready = max([free[r], *(done[x] + (send_s if rank_of[x[1]] != r else 0.0)
                                        for x in needs if x is not None)])
                free[r] = done[(kind, s, i)] = ready + took
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise UsageError("the orders deadlock: an op waits for one no rank runs first")
    return max(free[r] + sum(outside_s[s] for s in range(n) if rank_of[s] == r)
               for r in ranks)


def split_pipeline_step(plans: Sequence[Plan], problems: Sequence[Problem],
                        splits: Sequence[SplitFigures], orders: Mapping[int, Order],
                        buffers: Sequence[ScheduleBuffers] | None = None,
                        send_s: float = 0.0) -> tuple[dict[int, int], float]:
    """Each rank's peak and the step time under a zero-bubble order (Note [A backward in
    passes, on paper]): per stage ``s``, ``plans[s]`` (one level of regions, as
    ``split_backward=True`` runs) on ``problems[s]``, ``splits[s]`` its two passes,
    ``buffers[s]`` what the schedule keeps for it (``remat.core.pipeline.ScheduleBuffers``);
    ``orders``: rank -> its ops ``(kind, stage, micro-batch)`` in order."""
    n = len(plans)
    if not n or len(problems) != n or len(splits) != n:
        raise UsageError("give one plan, problem and SplitFigures per stage")
    buffers = list(buffers) if buffers is not None else [ScheduleBuffers()] * n
    if len(buffers) != n or not all(isinstance(b, ScheduleBuffers) for b in buffers):
        raise UsageError("give one ScheduleBuffers per stage")
    rank_of = _placement(orders, n)
    for plan in plans:
        nested = plan.first_nested()
        if nested is not None:
            raise UsageError(f"region {nested} lies inside another: zero-bubble schedules "
                             "run one level of regions (split_backward=True)")
    figures = [_figures(plan, problem, b)
               for plan, problem, b in zip(plans, problems, buffers, strict=True)]
    peaks = {r: _split_walk({s: figures[s][1] for s in range(n) if rank_of[s] == r},
                            splits, r, orders[r]) for r in orders}
    step = _step_time([cost for cost, _ in figures], [_bare_backward(p) for p in problems],
                      splits, orders, send_s)
    return peaks, step


def _bare_backward(problem: Problem) -> float:
    return rank_cost(Plan(problem.stage_names), problem).backward_s


def _step_time(costs: Sequence[RankCost], bare: Sequence[float],
               splits: Sequence[SplitFigures], orders: Mapping[int, Order],
               send_s: float) -> float:
    """:func:`split_step_time` of plans whose costs are ``costs``; ``bare``: each stage's
    backward with no plan (a plan's backward beyond it is its rebuilds)."""
    return split_step_time([c.forward_s for c in costs], bare,
                           [c.backward_s - b for c, b in zip(costs, bare, strict=True)],
                           [c.outside_s for c in costs], splits, orders, send_s)


def _split_walk(chunks: Mapping[int, _Chunk], splits: Sequence[SplitFigures], rank: int,
                order: Order) -> int:
    """Rank ``rank``'s peak over ``order``; ``chunks``: the figures of the stages it
    holds, by stage."""
    mine = list(chunks)
    before_i = dict.fromkeys(mine, 0)  # micro-batches between F and I (or W, B)
    before_w = dict.fromkeys(mine, 0)  # between I and W
    done = dict.fromkeys(mine, 0)  # backwards finished (W or B): gradients exist after one
    sent = dict.fromkeys(mine, 0)  # input gradients sent (I or B): the schedule's buffers

    def holds(s: int) -> int:
        k = chunks[s]
        return (before_i[s] * k.kept + before_w[s] * splits[s].held_bytes
                + (k.grads if done[s] else 0) + k.extras(sent[s]))

    def others(s: int) -> int:
        return sum(chunks[t].idle + holds(t) for t in mine if t != s)

    peak = 0
    for kind, s, _ in order:
        if s not in chunks:
            raise UsageError(f"rank {rank}'s order runs stage {s}, which another rank holds")
        if kind == "I" and s == 0:  # nothing runs; the micro-batch waits for its W
            continue
        k, sp = chunks[s], splits[s]
        grads = k.grads if done[s] else 0
        # the op's own bytes (its micro-batch's state included) and the stage's other
        # micro-batches; then the counts move on
        if kind == "F":
            live = k.forward + grads + before_i[s] * k.kept
            before_i[s] += 1
        elif kind == "I":
            before_i[s] -= 1
            live = k.idle + sp.input_peak_bytes + grads + before_i[s] * k.kept
        elif kind == "W" and s > 0:
            before_w[s] -= 1
            own = sp.later_weight_peak_bytes if done[s] else sp.weight_peak_bytes
            live = k.idle + own + before_i[s] * k.kept
        else:  # B, or the first stage's W: a whole backward
            before_i[s] -= 1
            live = (k.later_backward if done[s] else k.first_backward) + before_i[s] * k.kept
        peak = max(peak, live + before_w[s] * sp.held_bytes + k.extras(sent[s]) + others(s))
        if kind == "I":
            before_w[s] += 1
            sent[s] += 1
        elif kind == "W" and s > 0:
            done[s] += 1
        elif kind != "F":
            done[s] += 1
            sent[s] += 1
    return max([peak, *(chunks[s].tail + chunks[s].extras(sent[s]) + others(s)
                        for s in mine)])


# -- choosing every stage's plan -------------------------------------------------------


def _flat_ladder(problem: Problem) -> list[Plan]:
    """The stage's candidates: no plan, a region per stage, one region over all, each
    selective option every stage has measured on every stage (outside regions, which
    ``split_backward=True`` runs), and the fastest flat plan (``segments-optimal``) at a
    ladder of one-micro-batch budgets."""
    import remat.core.solve.solvers as solvers
    from remat.core.solve.simulator import simulate

    names, n = problem.stage_names, problem.n
    plans = [Plan(names), Plan(names, tuple(Region(i, i + 1) for i in range(n))),
             Plan(names, (Region(0, n),))]
    shared = set.intersection(*(set(stage.saved_bytes) for stage in problem.stages))
    for option in sorted(shared):
        parsed = parse_option(option)
        if parsed.is_selective and not parsed.is_partitioned:
            plans.append(Plan(names, (), options=(option,) * n))
    peaks = [simulate(plan, problem).peak_bytes for plan in plans]
    return with_ladder(plans, lambda budget: solvers.segments_optimal(problem, budget),
                       min(peaks), max(peaks))


def plan_split_pipeline(problems: Sequence[Problem], splits: Sequence[SplitFigures],
                        orders: Mapping[int, Order], budget: int,
                        buffers: Sequence[ScheduleBuffers] | None = None,
                        send_s: float = 0.0) -> tuple[list[Plan], dict[int, int], float]:
    """Every stage's plan for the step time under ``budget`` bytes per rank, under a
    zero-bubble order (arguments as for :func:`split_pipeline_step`); returns the plans,
    each rank's peak and the step.

    Per stage, the candidates are one-level plans (:func:`_flat_ladder`: what
    ``split_backward=True`` runs); per rank, the combinations of its stages' candidates
    whose peak under the order fits ``budget``, less those another fitting one beats in
    every stage's time; then, from every rank's fastest, each rank in turn takes the
    combination that shortens the step most, until none does. Raises CheckFailed when a
    rank has no combination that fits."""
    n = len(problems)
    if not n or len(splits) != n:
        raise UsageError("give one problem and SplitFigures per stage")
    buffers = list(buffers) if buffers is not None else [ScheduleBuffers()] * n
    if len(buffers) != n:
        raise UsageError("give one ScheduleBuffers per stage")
    rank_of = _placement(orders, n)
    bare = [_bare_backward(problem) for problem in problems]
    ladders = [[(plan, *_figures(plan, problem, buffers[s])) for plan in _flat_ladder(problem)]
               for s, problem in enumerate(problems)]
    ranks = sorted(orders)
    stages_of = {r: [s for s in range(n) if rank_of[s] == r] for r in ranks}
    choices: dict[int, list[tuple[int, ...]]] = {}
    for r in ranks:
        def peak_of(figures: list[_Chunk], r: int = r) -> int:
            return _split_walk(dict(zip(stages_of[r], figures, strict=True)), splits, r,
                               orders[r])

        choices[r] = rank_choices([ladders[s] for s in stages_of[r]], budget, peak_of)
        if not choices[r]:
            raise CheckFailed(
                f"no one-level plan of pipeline rank {r} fits {budget} bytes under this "
                "zero-bubble order (what a micro-batch holds between its input and weight "
                "passes does not shrink with regions); raise the budget, or use fewer or "
                "smaller micro-batches")

    def picked(chosen: Sequence[int]) -> list[int]:
        out = [0] * n
        for r, k in zip(ranks, chosen, strict=True):
            for s, i in zip(stages_of[r], choices[r][k], strict=True):
                out[s] = i
        return out

    def time_of(chosen: Sequence[int]) -> float:
        return _step_time([ladders[s][i][1] for s, i in enumerate(picked(chosen))], bare,
                          splits, orders, send_s)

    chosen = descend([len(choices[r]) for r in ranks], time_of)
    plans = [ladders[s][i][0] for s, i in enumerate(picked(chosen))]
    peaks, step = split_pipeline_step(plans, problems, splits, orders, buffers, send_s)
    return plans, peaks, step
