"""The optimal solver on homogeneous chains equals Griewank's binomial checkpointing (revolve).

Note [Revolve's counting and ours]
----------------------------------
Revolve reverses ``l`` steps ``F_1 .. F_l`` with ``s`` checkpoint slots (the initial
state's included). Every step is run once *taped*, right before its adjoint, and the
tape is never kept past it; the other forward runs are *advances* (no tape), and the
least number of advances is the binomial closed form

    p(l, s) = t*l - C(s + t, t - 1),  t the least integer with C(s + t, s) >= l.

In this project a stage run with grad (at the top level, or in the rebuild of its
innermost region) is the taped step: with keep only and early stop every stage runs
with grad exactly once. A run without saving (inside a region's forward, or a child
region run in its parent's rebuild) is an advance. A region's held input is a
checkpoint. So the forward evaluations of a plan (``sum(Simulation.forward_runs)``)
are ``l`` taped runs plus its advances.

The chain that makes the two families the same: ``l`` stages with unit boundaries
(``a_i = 1``, output too), ``fwd_s = rebuild_s = 1``, ``bwd_s = 0``, nothing else
(no transients, gradients, fixed bytes or region overhead; ``nosave_transient_bytes
= 0``), ``early_stop`` on, keep only, every stage ``saves_input`` and keeps ``S``
saved bytes, the tape. Then, with the budget ``S + 3 + s`` bytes:

* a taped stage ``i`` at its forward (in a rebuild) holds, beyond the checkpoints
  other than ``x_i``: its input ``x_i``, its output ``x_{i+1}``, ``S``, and the
  gradient of its level's end ``x_e`` (alive through the rebuild): ``S + 3``. At its
  backward: ``x_i``, ``S`` and the gradients of ``x_{i+1}`` and ``x_i``: ``S + 3``
  again (at the top level too, where the forward has no gradient yet). So ``s`` slots
  are left for checkpoints, as in revolve.
* advances need at most 3 beyond the checkpoints and never decide anything.
* ``S >= s`` stands for revolve's "the tape is not kept": a taped stage that is not
  the last item of its level keeps ``x_i + S`` while the items after it run their own
  taped steps, which needs ``S + 1`` more than the ``S + 3 + checkpoints`` they need
  alone: more than the ``s`` there are.

Result (exact, tested below): the optimal plan makes ``p(steps, s) + steps`` forward
evaluations. The literal "keep saves nothing" chain (``S = 0``) is a different family:
there a kept tape costs one slot like a checkpoint and saves the advance, so its
optimum is never more and often fewer forward evaluations (``test_free_tapes...``).
Early stop does not matter here: without it a rebuild reruns a child region that ends
its level (a stage at depth ``d`` runs ``d + 1`` times), but an optimal plan never
ends a level with a region, whose items can join the level itself; both give
``p(steps, s) + steps``.
"""

from __future__ import annotations

import math

import pytest

from remat.core.solve import Problem, StageCost, dp, simulate, solvers


def revolve_advances(steps: int, s: int) -> int:
    """Griewank's p(l, s): the least advances reversing ``l = steps`` steps with ``s`` slots."""
    assert steps >= 1 and s >= 1
    t = 1
    while math.comb(s + t, s) < steps:
        t += 1
    return t * steps - math.comb(s + t, t - 1)


def revolve_chain(steps: int, tape: int, early_stop: bool = True) -> Problem:
    stages = tuple(
        StageCost(f"s{i}", 1, 1, {"keep": tape}, fwd_s=1.0, bwd_s=0.0, rebuild_s=1.0,
                  nosave_transient_bytes=0)
        for i in range(steps)
    )
    return Problem(stages, early_stop=early_stop)


def test_closed_form() -> None:
    assert revolve_advances(200, 20) == 378  # t = 2: C(22, 20) = 231 >= 200 > 21
    assert revolve_advances(1, 1) == 0
    # One slot: l(l-1)/2. l - 1 slots: one sweep.
    assert [revolve_advances(n, 1) for n in range(1, 7)] == [0, 1, 3, 6, 10, 15]
    assert all(revolve_advances(n, n - 1) == n - 1 for n in range(2, 12))
    # One more slot never costs advances.
    for n in range(1, 60):
        assert all(revolve_advances(n, s + 1) <= revolve_advances(n, s) for s in range(1, 12))


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("steps", [1, 2, 3, 5, 8, 13, 21])
def test_optimal_forward_evaluations_equal_revolve(steps: int, early_stop: bool) -> None:
    smax = 8
    problem = revolve_chain(steps, tape=smax, early_stop=early_stop)
    assert problem.backward_base_bytes == 0
    # Every budget at once from one table (one-byte slots: exact).
    table = dp.numpy_tables(dp.Model(problem, 1), smax + 3 + smax).top[0]
    for s in range(1, smax + 1):
        assert table[smax + 3 + s] + steps == revolve_advances(steps, s) + steps, (steps, s)
    # And the solver's plan, scored by the simulator, makes exactly that many runs.
    for s in (1, 2, 3, 5):
        plan = solvers.optimal(problem, smax + 3 + s)
        sim = simulate(plan, problem)
        assert sum(sim.forward_runs) == revolve_advances(steps, s) + steps, (steps, s)
        assert sim.peak_bytes <= smax + 3 + s


def test_revolve_200_stages_20_slots() -> None:
    # p(200, 20) = 378 advances: 578 forward evaluations. The tables at n = 200 take a
    # while, so only the slot counts that matter are filled (S = s = 20).
    s = 20
    problem = revolve_chain(200, tape=s)
    table = dp.numpy_tables(dp.Model(problem, 1), s + 3 + s).top[0]
    assert table[s + 3 + s] == revolve_advances(200, s) == 378
    assert table[s + 3 + s] + 200 == 578


def test_free_tapes_are_never_worse_than_revolve() -> None:
    # S = 0: a tape costs the one slot of its input, so keeping it beats an advance.
    cheaper = 0
    for steps in range(2, 13):
        table = dp.numpy_tables(dp.Model(revolve_chain(steps, tape=0), 1), 3 + 9).top[0]
        for s in range(1, 10):
            ours = table[3 + s]
            assert ours <= revolve_advances(steps, s), (steps, s)
            cheaper += ours < revolve_advances(steps, s)
    assert cheaper > 0
