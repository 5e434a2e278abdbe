"""``remat.plan(profile, budget)``: the fastest checkpoint plan that fits a memory budget.

A thin front over the torch-free solvers in :mod:`remat.core.solve`; it accepts a measured
:class:`~remat.core.profile_format.Profile` (or a ready :class:`~remat.core.solve.Problem`) and
returns the :class:`~remat.core.plan_format.Plan` the runtime applies.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from remat.core.errors import UsageError
from remat.core.model_identity import MadeFor
from remat.core.plan_format import Plan
from remat.core.profile_format import Profile
from remat.core.solve import SOLVERS, Problem, solve
from remat.core.solve.budget import Budget
from remat.core.solve.from_profile import problem_from_profile

__all__ = ["made_for", "plan", "to_problem", "with_made_for"]


def made_for(profile: Profile) -> MadeFor:
    """What a plan made from ``profile`` is made for (stage identities where it has them)."""
    known = tuple(s.identity for s in profile.stages if s.identity is not None)
    return MadeFor(
        model=profile.model,
        stages=known if len(known) == len(profile.stages) else None,  # None: an older profile
        model_stages=profile.model_stages,
        batch_shapes=profile.batch_shapes,
        profile_sha256=profile.digest(),
    )


def with_made_for(result: Plan, source: Profile | Problem) -> Plan:
    """``result`` recording the profile it was made from; as it is for a bare problem,
    which names no model."""
    if not isinstance(source, Profile) or result.stages != source.stage_names:
        return result
    return replace(result, made_for=made_for(source), compiled=source.compiled)


def to_problem(source: Profile | Problem, *, slots: int | None = None) -> Problem:
    """The solver's view of a profile (or the problem itself, with ``slots`` if given)."""
    if isinstance(source, Profile):
        return problem_from_profile(source, slots=500 if slots is None else slots)
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
    budget: Budget | str | int | float | None = None,
    solver: str = "optimal",
    *,
    slots: int | None = None,
    **params: Any,
) -> Plan:
    """The plan ``solver`` chooses for ``profile`` under ``budget``.

    ``budget`` is bytes (``"6GiB"``, ``"512MiB"``, an integer) meaning the peak of a whole
    training step, or a fraction (``"50%"``, ``0.5``) of the profile's measured peak
    without checkpointing; a :class:`~remat.core.solve.budget.Budget` is taken as read.
    ``solver`` is one of :data:`remat.core.solve.SOLVERS` (``optimal``, ``none``,
    ``per-stage``, ``every-k``, ``segments-k``, ``megatron-uniform``, ``megatron-block``,
    ``selective-everywhere``, ``min-peak``); ``params`` go to it (``k=`` for every-k and
    segments-k, ``num_layers=`` for the Megatron recipes).
    ``optimal`` raises :class:`remat.CheckFailed` naming the minimum feasible budget when
    nothing fits. The plan carries its predicted peak and step time, and, made from a
    profile, what it was made for (``plan.made_for``: ``remat.apply`` refuses it on a model
    whose stages differ).
    """
    if solver not in SOLVERS:
        raise UsageError(f"solver {solver!r} is not known; choose one of {', '.join(SOLVERS)}")
    return with_made_for(solve(solver, to_problem(profile, slots=slots), budget, **params), profile)
