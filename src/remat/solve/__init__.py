"""The torch-free planning core: problem, simulator, budgets, solvers.

Never imports torch (a test imports it with torch made unavailable). See
``docs/cost-model.md`` for what the simulator counts and why.
"""

from __future__ import annotations

from remat.solve.budget import parse_budget
from remat.solve.problem import SCHEMA_VERSION, Problem, StageCost
from remat.solve.simulate import Event, Simulation, StepTime, simulate
from remat.solve.solvers import SOLVERS, minimum_budget, optimal, solve

__all__ = [
    "SCHEMA_VERSION",
    "SOLVERS",
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
