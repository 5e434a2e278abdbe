"""``remat.plan(profile, budget)``: the fastest checkpoint plan that fits a memory budget.

A thin front over the torch-free solvers in :mod:`remat.solve`; it accepts a measured
:class:`~remat.profile_format.Profile` (or a ready :class:`~remat.solve.Problem`) and
returns the :class:`~remat.plan.Plan` the runtime applies.
"""

from __future__ import annotations

from typing import Any

from remat.errors import UsageError
from remat.plan import Plan
from remat.profile_format import Profile
from remat.solve import SOLVERS, Problem, solve

__all__ = ["plan", "to_problem"]


def to_problem(source: Profile | Problem, *, slots: int | None = None) -> Problem:
    """The solver's view of a profile (or the problem itself, with ``slots`` if given)."""
    if isinstance(source, Profile):
        return Problem.from_profile(source, slots=500 if slots is None else slots)
    if isinstance(source, Problem):
        if slots is None or slots == source.slots:
            return source
        return Problem.from_dict({**source.to_dict(), "slots": slots})
    raise UsageError(
        f"expected a remat Profile or Problem, got a {type(source).__name__}; "
        "measure one with remat.profile(model, batch, loss_fn)"
    )


def plan(
    profile: Profile | Problem,
    budget: str | int | float | None = None,
    solver: str = "optimal",
    *,
    slots: int | None = None,
    **params: Any,
) -> Plan:
    """The plan ``solver`` chooses for ``profile`` under ``budget``.

    ``budget`` is bytes (``"6GiB"``, ``"512MiB"``, an integer) meaning the peak of a whole
    training step, or a fraction (``"50%"``, ``0.5``) of the profile's measured peak
    without checkpointing. ``solver`` is one of :data:`remat.solve.SOLVERS` (``optimal``,
    ``none``, ``per-stage``, ``every-k``, ``segments-k``, ``megatron-uniform``,
    ``megatron-block``, ``selective-everywhere``, ``min-peak``); ``params`` go to it
    (``k=`` for every-k and segments-k, ``num_layers=`` for the Megatron recipes).
    ``optimal`` raises :class:`remat.CheckFailed` naming the minimum feasible budget when
    nothing fits. The plan carries its predicted peak and step time.
    """
    if solver not in SOLVERS:
        raise UsageError(f"solver {solver!r} is not known; choose one of {', '.join(SOLVERS)}")
    return solve(solver, to_problem(profile, slots=slots), budget, **params)
