"""The torch-free planning core: problem, simulator, budgets, solvers.

Never imports torch (a test imports it with torch made unavailable). See
``docs/cost-model.md`` for what the simulator counts and why.
"""

from __future__ import annotations

from remat.core.solve.budget import Budget, parse_budget
from remat.core.solve.problem import SCHEMA_VERSION, Problem, StageCost
from remat.core.solve.simulator import Event, Simulation, StepTime, simulate
from remat.core.solve.solvers import SOLVERS, minimum_budget, optimal, solve

__all__ = [
    "SCHEMA_VERSION",
    "SOLVERS",
    "Budget",
    "Event",
    "Problem",
    "Simulation",
    "StageCost",
    "StepTime",
    "minimum_budget",
    "optimal",
    "parse_budget",
    "simulate",
    "solve",
]
