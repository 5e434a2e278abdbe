"""The fastest plan of one micro-batch when other micro-batches in flight hold what it keeps.

Torch-free. A pipeline rank runs its stage chain one micro-batch at a time and holds
several micro-batches at once: each in flight keeps what its plan keeps from its forward
to its backward (``Simulation.kept_bytes``, ``K``). So the rank's peak is not the
one-micro-batch peak the optimal tables bound: each event of the rank's schedule adds
``a * K + c`` to a phase of the one-micro-batch step (``a`` micro-batches in flight
besides the one running, ``c`` the schedule's buffers). This module finds the fastest plan
under such a peak exactly, with the optimal solver's tables (:mod:`remat.core.solve.dp`).

Note [Capping what a plan keeps]
--------------------------------
The rank's peak couples two figures of a plan: the events of the micro-batch it runs and
the ``K`` the others hold, which the plan also sets (its top-level regions' inputs, its
bare stages' saved tensors). Fix a cap ``K^``: every plan keeping at most ``K^`` fits
the rank if its events fit the budget less ``a * K^ + c`` for their phase, and the fastest
plan that fits the rank, keeping ``K*``, is among those at ``K^ = K*``. So the fastest
plan over all caps is the fastest that fits: exact wherever the tables are (in slots,
Note [The recursion]). Per cap, the tables need two changes, both in the model's offsets:

* the cap itself: the tables' memory at the chain's end (``Top(n, m)``) is the budget
  less what the top level holds, and ``K`` is that holding plus a constant (the chain's
  output, what the pre-chain saved: measured once, ``_kept_beyond``); so ``Top(n, m)``
  is infinite below ``m - cap``;
* the phases: a forward event of the schedule adds the forward's terms (with every
  parameter gradient alive in a 1F1B forward after the first backward), the first
  backward's events gradients by position (the one-micro-batch step's), a later
  backward's all of them from its start (Note [Pipeline rank peak] in
  :mod:`remat.core.pipeline`). Both backward kinds check the same events with different
  gradients and allowances, so an event fits both when it fits the first with its
  gradients ``T(p)`` raised to ``max(T(p), G - U + D_later - D_first)`` (``G`` all
  gradients, ``U`` the unattributed ones the tables' base holds, ``D`` each kind's
  allowance at the cap): one table of offsets again. The top-level forward's room
  (``gs``) and the post-chain's and after-chain's checks take the same allowances.

Caps run over every slot count of the budget; the tables are filled again only where the
raised gradients change (a later backward's allowance falls with the cap where fewer
micro-batches are in flight then: GPipe), otherwise only the top level is (cheap). Where the
tables do not count something the simulator does (regions holding reads from before them,
FSDP2 units), each plan is checked by the caller's exact peak before it is taken.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import remat.core.solve.dp as dp
from remat.core.plan_format import Plan, Region
from remat.core.solve.problem import Problem
from remat.core.solve.simulator import plan_tree, simulate
from remat.core.solve.solvers import table_filler

__all__ = ["InFlight", "fastest_kept_capped"]

#: ``(a, c)`` pairs: a phase's events get ``max(a * K + c)`` more, ``K`` what the plan keeps.
Terms = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class InFlight:
    """What a schedule adds to the one-micro-batch step's events, by phase (Note
    [Capping what a plan keeps]); an empty phase has no such op in the schedule."""

    forward: Terms  # forwards before the first backward: no parameter gradient yet
    forward_with_grads: Terms  # forwards after it: every parameter gradient alive
    first_backward: Terms  # gradients by position, as in the one-micro-batch step
    later_backward: Terms  # every parameter gradient from the start
    output_bytes: int = 0  # kept per micro-batch: added to backward events but the post-chain's


def _at(terms: Terms, kept: int) -> int | None:
    return max((a * kept + c for a, c in terms), default=None)


def _holding(model: dp.Model, plan: Plan) -> int:
    """What the plan's top level holds from its forward to its backward, in the model's
    bytes (one-byte slots)."""
    total = 0
    for item in plan_tree(plan):
        if item.region is not None:
            total += model.hold_open(item.start, 0)
        else:
            k = item.start
            total += model.hold(k, model.opts[k].index(plan.options[k]), 0)
    return total


def _kept_beyond(problem: Problem) -> int:
    """``Simulation.kept_bytes`` less the top level's holding: the same for every plan
    (the chain's output, the pre-chain's saved tensors, what the model's code holds)."""
    plan = Plan(problem.stage_names)
    return simulate(plan, problem).kept_bytes - _holding(dp.Model(problem, 1), plan)


def fastest_kept_capped(problem: Problem, budget: int, in_flight: InFlight,
                        fits: Callable[[Plan], bool], *, path: str = "auto") -> Plan | None:
    """The fastest plan whose events fit ``budget`` bytes with ``in_flight``'s additions
    (Note [Capping what a plan keeps]), or None where the tables find none. ``fits``: the
    caller's exact check of a plan (the rank's peak under its schedule), applied to every
    plan before it is taken."""
    if not in_flight.first_backward:
        raise ValueError("a schedule runs at least one backward")
    fb, bb = problem.forward_base_bytes, problem.backward_base_bytes
    avail = budget - fb
    if avail < 0:
        return None
    q = max(1, -(-avail // problem.slots))
    most = avail // q
    beyond = _kept_beyond(problem)
    model = dp.Model(problem, q, 0)
    sg = list(model.sg)
    n, a = problem.n, model.a
    grads, unattributed = problem.grads_bytes, problem.unattributed_grads_bytes
    residue = problem.backward_residue_bytes
    post_x = a[n] + problem.post_chain_peak_bytes + problem.held_at_chain_end
    post_f = (a[n] + problem.post_chain_bytes + problem.last_input_held_bytes
              + problem.held_at_chain_end)
    after_g = sg[0] + problem.pre_chain_grads_bytes
    out = in_flight.output_bytes
    fill = table_filler(path)
    tables: dict[tuple[int, ...], dp.Tables] = {}
    best: tuple[float, Plan] | None = None
    for cap in range(most + 1):
        kept = cap * q + beyond  # an upper bound of what a plan within the cap keeps
        first = _at(in_flight.first_backward, kept)
        assert first is not None
        room_b = budget - bb - out - first  # the backward's events, gradients by position
        if room_b < 0:
            break  # allowances only grow with the cap
        m = room_b // q
        later = _at(in_flight.later_backward, kept)
        raised_grads = 0 if later is None else max(0, grads - unattributed + later - first)
        # a later backward's chain events have the backward residue too (in T(p) of the
        # first), its post-chain event not (its figure has it)
        raised = 0 if later is None else raised_grads + residue
        offsets = tuple(max(s, raised) for s in sg)
        fwd_d = max(d for d in (_at(in_flight.forward, kept),
                                _grads_on(_at(in_flight.forward_with_grads, kept), grads))
                    if d is not None)
        room_f = budget - fb - fwd_d  # the forward's events
        model.sg = list(offsets)
        model.gs = room_f // q - m
        # Top(n, m): the post-chain's events (backward kinds, then forward), and the cap
        model.post = max(m + _slots(post_x, q) - (room_b + out - raised_grads) // q,
                         m + _slots(post_f, q) - room_f // q, m - cap)
        model.after = _slots(a[0] + max(after_g, raised), q)  # the pre-chain's backward
        t = tables.get(offsets)
        if t is None:
            t = tables[offsets] = fill(model, most)
        else:
            dp.fill_top(t)
        value = float(t.top[0, m]) if m <= most else math.inf
        if math.isfinite(value) and (best is None or value < best[0]):
            regions, options = dp.reconstruct(t, m)
            plan = Plan(problem.stage_names, tuple(Region(*r) for r in regions), tuple(options))
            if fits(plan):
                best = value, plan
        if cap >= m:
            break  # a larger cap admits nothing more: no plan holds more than m slots
    return None if best is None else best[1]


def _grads_on(allowance: int | None, grads: int) -> int | None:
    return None if allowance is None else allowance + grads


def _slots(nbytes: int, q: int) -> int:
    return -(-max(nbytes, 0) // q)
