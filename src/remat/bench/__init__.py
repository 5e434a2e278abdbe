"""``remat.bench``: every checkpointing strategy side by side; ``remat.auto``: the main job.

``remat.bench(model, budgets=..., strategies=...)`` (or ``remat.bench.bench``) measures
no checkpointing, the classic recipes, ``torch.compile`` with its activation memory
budget and remat's optimal plan in one process, predicted against measured, and compares
micro-batches under a budget; :func:`write_report` writes the report folder. See
``docs/bench.md``. ``remat.auto(model, budget="50%")`` profiles, plans, applies,
verifies and measures one model.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from remat.bench.auto import AutoReport, auto
from remat.bench.environment import Environment
from remat.bench.report import ReportFiles, write_report
from remat.bench.results import BenchReport, Finding, MicrobatchReport, MicrobatchRow, Row
from remat.bench.run import bench
from remat.bench.strategies import DEFAULT_BUDGETS, STRATEGIES, parse_budgets, parse_strategies

__all__ = [
    "DEFAULT_BUDGETS",
    "STRATEGIES",
    "AutoReport",
    "BenchReport",
    "Environment",
    "Finding",
    "MicrobatchReport",
    "MicrobatchRow",
    "ReportFiles",
    "Row",
    "auto",
    "bench",
    "parse_budgets",
    "parse_strategies",
    "write_report",
]


class _CallableModule(types.ModuleType):
    """``remat.bench(...)`` calls :func:`bench` even once ``remat.bench`` is the module."""

    def __call__(self, *args: Any, **kwargs: Any) -> BenchReport:
        return bench(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
