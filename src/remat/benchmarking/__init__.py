"""``remat.benchmarking``: every strategy side by side (``remat.bench``); the main job
(``remat.auto``).

``remat.bench(model, budgets=..., strategies=...)`` measures no checkpointing, the
classic recipes, ``torch.compile`` with its activation memory budget and remat's
optimal plan in one process, predicted against measured, and compares micro-batches
under a budget; :func:`write_report` writes the report folder. See ``docs/bench.md``.
``remat.auto(model, budget="50%")`` profiles, plans, applies, verifies and measures one
model. :func:`bench_range` does the comparison over a range of batch shapes, remat's plan
set at each bucket's ends (``remat bench --shapes``).

The names load on first use, so that a command importing one module of the package (the
steps every command shares, :mod:`.stopping`) does not load the jobs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY: dict[str, str] = {
    "bench": "remat.benchmarking.bench_job",
    "ReportFiles": "remat.benchmarking.bench_report",
    "write_report": "remat.benchmarking.bench_report",
    "Environment": "remat.benchmarking.environment",
    "AutoReport": "remat.benchmarking.auto_report",
    "auto": "remat.benchmarking.main_job",
    "RangeBenchReport": "remat.benchmarking.range_bench",
    "bench_range": "remat.benchmarking.range_bench",
    "write_range_report": "remat.benchmarking.range_bench",
    "BenchReport": "remat.benchmarking.results",
    "Finding": "remat.benchmarking.results",
    "MicrobatchReport": "remat.benchmarking.results",
    "MicrobatchRow": "remat.benchmarking.results",
    "Row": "remat.benchmarking.results",
    "DEFAULT_BUDGETS": "remat.benchmarking.strategies",
    "STRATEGIES": "remat.benchmarking.strategies",
    "parse_budgets": "remat.benchmarking.strategies",
    "parse_strategies": "remat.benchmarking.strategies",
}

if TYPE_CHECKING:
    from remat.benchmarking.auto_report import AutoReport
    from remat.benchmarking.bench_job import bench
    from remat.benchmarking.bench_report import ReportFiles, write_report
    from remat.benchmarking.environment import Environment
    from remat.benchmarking.main_job import auto
    from remat.benchmarking.range_bench import (
        RangeBenchReport,
        bench_range,
        write_range_report,
    )
    from remat.benchmarking.results import (
        BenchReport,
        Finding,
        MicrobatchReport,
        MicrobatchRow,
        Row,
    )
    from remat.benchmarking.strategies import (
        DEFAULT_BUDGETS,
        STRATEGIES,
        parse_budgets,
        parse_strategies,
    )

__all__ = [
    "DEFAULT_BUDGETS",
    "STRATEGIES",
    "AutoReport",
    "BenchReport",
    "Environment",
    "Finding",
    "MicrobatchReport",
    "MicrobatchRow",
    "RangeBenchReport",
    "ReportFiles",
    "Row",
    "auto",
    "bench",
    "bench_range",
    "parse_budgets",
    "parse_strategies",
    "write_range_report",
    "write_report",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'remat.benchmarking' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
