"""What each benchmark row runs, and the plans behind them (every figure from the simulator).

A row is a strategy at a budget. The checkpointing recipes (``none``, ``per-stage``,
``every-K``, ``sqrt``, ``selective``) ignore budgets and give one row each; ``remat``
(the optimal plan) and ``compile`` (``torch.compile`` with
``activation_memory_budget``) give one row per budget. Plans come from
:func:`remat.core.planner.plan`, so a row's predicted peak and step time are the simulator's.
``hf-gc`` (transformers models only; part of the default set on them) is transformers' own
``gradient_checkpointing_enable``, predicted as remat's per-stage plan: the same regions.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from remat.core.errors import CheckFailed, UsageError
from remat.core.plan_format import Plan
from remat.core.planner import plan as make_plan
from remat.core.solve import Problem
from remat.core.solve.budget import Budget

from .runners import HF_GC, supports_hf_gc

__all__ = [
    "DEFAULT_BUDGETS",
    "OPTIONAL_STRATEGIES",
    "REMAT_COMPILE",
    "STRATEGIES",
    "RowSpec",
    "baseline_plan",
    "matched_rows",
    "parse_budgets",
    "parse_strategies",
    "plan_rows",
    "with_default_rows",
]

#: Strategy names in report order; ``every-K`` takes any whole K (``every-2`` by default).
STRATEGIES = ("none", "per-stage", "every-2", "sqrt", "selective", "compile", "remat")
#: remat's plan for the model with its stages compiled (``remat.compile_stages``), from a
#: profile of the compiled stages; with ``compile`` also at each compile row's peak.
REMAT_COMPILE = "remat+compile"
#: Strategies outside the default set: ``hf-gc`` needs a transformers model
#: (:func:`with_default_rows` adds it to the default set on one); ``remat+compile``
#: profiles the model a second time, compiled (``remat bench --compile`` adds it).
OPTIONAL_STRATEGIES = (HF_GC, REMAT_COMPILE)
_ORDER = ("none", "per-stage", HF_GC, "every-2", "sqrt", "selective", "compile", "remat",
          REMAT_COMPILE)
DEFAULT_BUDGETS = ("100%", "75%", "50%", "35%", "25%")
BUDGETED = ("compile", "remat", REMAT_COMPILE)
_EVERY = re.compile(r"^every-([0-9]+)$")

def _entries(value: str | Sequence[object], what: str, example: str) -> list[object]:
    items: list[object] = (
        [s.strip() for s in value.split(",")] if isinstance(value, str) else list(value)
    )
    if not items or any(isinstance(s, str) and not s for s in items):
        raise UsageError(f"--{what} {value!r} has an empty entry; give a list such as {example}")
    return items


def parse_strategies(value: str | Sequence[str]) -> tuple[str, ...]:
    """Strategy names from ``"none,per-stage,remat"`` (or a list), in report order, unique."""
    found: list[str] = []
    for item in _entries(value, "strategies", "per-stage,remat"):
        name = str(item).strip().lower()
        match = _EVERY.match(name)
        if match and int(match.group(1)) < 1:
            raise UsageError(f"strategy {name!r} needs K of 1 or more, e.g. every-2")
        if name not in (*STRATEGIES, *OPTIONAL_STRATEGIES) and not match:
            raise UsageError(
                f"strategy {name!r} is not known; choose from "
                f"{', '.join((*STRATEGIES, *OPTIONAL_STRATEGIES))} (every-K for any K)"
            )
        if name not in found:
            found.append(name)
    order = {name: i for i, name in enumerate(_ORDER)}
    return tuple(sorted(found, key=lambda n: order.get(n, order["every-2"])))


def with_default_rows(strategies: tuple[str, ...], model: object) -> tuple[str, ...]:
    """``strategies``, plus ``hf-gc`` when they are the default set and ``model`` is a
    transformers model with its own gradient checkpointing (what its users run today)."""
    if strategies == STRATEGIES and supports_hf_gc(model):  # type: ignore[arg-type]
        return parse_strategies([*STRATEGIES, HF_GC])
    return strategies


def parse_budgets(
    value: str | Sequence[Budget | str | int | float],
) -> tuple[Budget | str | int | float, ...]:
    """Budgets from ``"100%,50%,64MiB"`` (or a list), each read (:meth:`Budget.parse`: a
    usage error for one that is not a budget), unique, in given order, as given: the rows
    read them again and label them as written."""
    found: list[Budget | str | int | float] = []
    for item in _entries(value, "budgets", "100%,50%,25%"):
        Budget.parse(item)  # type: ignore[arg-type]
        if item not in found:
            found.append(item)  # type: ignore[arg-type]
    return tuple(found)


@dataclass(frozen=True)
class RowSpec:
    """One row to measure: a plan for remat's runtime, or (``plan`` None) a compiled model.

    ``error`` says why a row cannot run (an infeasible budget); ``matched_to`` names the
    baseline whose measured peak is this remat row's budget.
    """

    strategy: str
    budget: str | None = None
    budget_bytes: int | None = None
    budget_fraction: float | None = None
    plan: Plan | None = None
    matched_to: str | None = None
    error: str | None = None

    @property
    def key(self) -> str:
        if self.matched_to is not None:
            return f"{self.strategy}@{self.matched_to}"
        return self.strategy if self.budget is None else f"{self.strategy}@{self.budget}"


def baseline_plan(problem: Problem, strategy: str) -> Plan:
    """The plan of a checkpointing recipe, scored by the simulator."""
    if strategy == "none":
        return make_plan(problem, None, "none")
    if strategy == "per-stage":
        return make_plan(problem, None, "per-stage")
    if strategy == HF_GC:
        # transformers checkpoints each decoder layer: remat's per-stage regions, so the
        # simulator's per-stage figures are its prediction; the solver name marks the row
        return replace(make_plan(problem, None, "per-stage"), solver=HF_GC)
    if strategy == "sqrt":
        return make_plan(problem, None, "segments-k")
    if strategy == "selective":
        return make_plan(problem, None, "selective-everywhere")
    match = _EVERY.match(strategy)
    if match:
        return make_plan(problem, None, "every-k", k=min(int(match.group(1)), problem.n))
    raise UsageError(f"strategy {strategy!r} has no plan; choose a checkpointing recipe")


def _remat_row(
    problem: Problem, label: str, budget: int, peak: int | None, matched_to: str | None = None,
    strategy: str = "remat",
) -> RowSpec:
    fraction = None if not peak else budget / peak
    try:
        plan = make_plan(problem, budget, "optimal")
    except CheckFailed as err:
        return RowSpec(strategy, label, budget, fraction, None, matched_to, str(err))
    if strategy == REMAT_COMPILE:  # solved from the compiled stages' problem
        plan = replace(plan, compiled=True)
    return RowSpec(strategy, label, budget, fraction, plan, matched_to)


def plan_rows(
    problem: Problem, strategies: Sequence[str],
    budgets: Sequence[Budget | str | int | float], compiled: Problem | None = None,
) -> list[RowSpec]:
    """Every row the strategies and budgets ask for; ``none`` always comes first.
    ``compiled``: the problem of the stage-compiled model, for ``remat+compile`` rows
    (their budgets are the same bytes as the other rows')."""
    peak = problem.measured_no_checkpoint_peak_bytes
    rows = [RowSpec("none", plan=baseline_plan(problem, "none"))]
    for strategy in strategies:
        if strategy in ("none", *BUDGETED):
            continue
        rows.append(RowSpec(strategy, plan=baseline_plan(problem, strategy)))
    for given in budgets:
        budget = Budget.parse(given)
        nbytes, label = budget.bytes(problem), str(budget)
        if "compile" in strategies:
            fraction = min(1.0, nbytes / peak) if peak else 1.0
            rows.append(RowSpec("compile", label, nbytes, fraction))
        if "remat" in strategies:
            rows.append(_remat_row(problem, label, nbytes, peak))
        if REMAT_COMPILE in strategies and compiled is not None:
            rows.append(_remat_row(compiled, label, nbytes, peak, strategy=REMAT_COMPILE))
    return rows


def matched_rows(
    problem: Problem, peaks: dict[str, int], strategy: str = "remat",
    reference: Problem | None = None,
) -> list[RowSpec]:
    """remat's plan with each baseline's peak as its budget (the matched comparison);
    ``reference`` gives the peak fractions are of (default: ``problem``'s)."""
    peak = (reference or problem).measured_no_checkpoint_peak_bytes
    return [
        _remat_row(problem, f"={name}", nbytes, peak, matched_to=name, strategy=strategy)
        for name, nbytes in peaks.items()
        if name != "none"
    ]
