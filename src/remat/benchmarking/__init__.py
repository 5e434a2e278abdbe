"""``remat.benchmarking``: every strategy side by side (``remat.bench``); the main job
(``remat.auto``).

``remat.bench(model, budgets=..., strategies=...)`` measures no checkpointing, the
classic recipes, ``torch.compile`` with its activation memory budget and remat's
optimal plan in one process, predicted against measured, and compares micro-batches
under a budget; :func:`write_report` writes the report folder. See ``docs/bench.md``.
``remat.auto(model, budget="50%")`` profiles, plans, applies, verifies and measures one
model. :func:`bench_range` does the comparison over a range of batch shapes, remat's plan
set at each bucket's ends (``remat bench --shapes``).
"""

from __future__ import annotations

from remat.benchmarking.bench_job import bench
from remat.benchmarking.bench_report import ReportFiles, write_report
from remat.benchmarking.environment import Environment
from remat.benchmarking.main_job import AutoReport, auto
from remat.benchmarking.range_bench import RangeBenchReport, bench_range, write_range_report
from remat.benchmarking.results import BenchReport, Finding, MicrobatchReport, MicrobatchRow, Row
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
