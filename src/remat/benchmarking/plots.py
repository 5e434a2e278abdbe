"""The report's PNG plots; matplotlib is optional and imported only here, when plotting."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from remat.core.artifact import replacing
from remat.core.errors import UsageError

from .results import BenchReport, Row
from .strategies import REMAT_COMPILE

__all__ = ["PLOT_HINT", "plot_all"]

PLOT_HINT = "install matplotlib with pip install 'remat[plot]' to get the plots"
_MIB = float(1 << 20)


def _figure(width: float, height: float) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise UsageError(f"matplotlib is not installed; {PLOT_HINT}") from err
    # The object API (no pyplot) draws with Agg and leaves the caller's backend alone.
    return Figure(figsize=(width, height), layout="constrained")


def _budget_levels(report: BenchReport) -> list[int]:
    return sorted({r.budget_bytes for r in report.rows
                   if r.budget_bytes is not None and r.matched_to is None})


def timelines(report: BenchReport, path: Path) -> Path | None:
    """One panel per measured row: live bytes through one step, its budget and prediction."""
    rows = [r for r in report.rows if r.key in report.timelines]
    if not rows:
        return None
    cols = min(3, len(rows))
    lines = math.ceil(len(rows) / cols)
    fig = _figure(4.2 * cols, 2.6 * lines)
    axes = fig.subplots(lines, cols, squeeze=False, sharey=True)
    levels = _budget_levels(report)
    for k, r in enumerate(rows):
        ax = axes[k // cols][k % cols]
        xs, ys = zip(*report.timelines[r.key], strict=True)
        ax.plot(xs, [y / _MIB for y in ys], lw=0.9, color="tab:blue", label="measured")
        for level in levels:
            ax.axhline(level / _MIB, color="0.8", lw=0.6, ls=":")
        if r.budget_bytes is not None:
            ax.axhline(r.budget_bytes / _MIB, color="tab:red", ls="--", lw=1, label="budget")
        if r.predicted_peak_bytes is not None:
            ax.axhline(r.predicted_peak_bytes / _MIB, color="tab:green", ls="-.", lw=0.8,
                       label="predicted peak")
        ax.set_title(f"{r.key} ({r.instrument})", fontsize=8)
        ax.tick_params(labelsize=7)
        if k % cols == 0:
            ax.set_ylabel("live MiB", fontsize=8)
        if k // cols == lines - 1:
            ax.set_xlabel("fraction of one training step", fontsize=8)
    for k in range(len(rows), lines * cols):
        axes[k // cols][k % cols].set_visible(False)
    axes[0][0].legend(fontsize=6, loc="upper left")
    fig.suptitle(f"{report.model}: memory of one step (dotted: the budgets)", fontsize=10)
    with replacing(path) as temporary:  # atomic: a reader never sees half a PNG
        fig.savefig(temporary, dpi=110, format="png")
    return path


def _series(rows: list[Row]) -> tuple[list[float], list[float], list[list[float]]]:
    xs = [(r.measured_peak_bytes or 0) / _MIB for r in rows]
    ys = [(r.step_time_s or 0) * 1e3 for r in rows]
    err = [[y - (r.step_time_min_s or 0) * 1e3 for r, y in zip(rows, ys, strict=True)],
           [(r.step_time_max_s or 0) * 1e3 - y for r, y in zip(rows, ys, strict=True)]]
    return xs, ys, err


def tradeoff(report: BenchReport, path: Path) -> Path | None:
    """Measured peak against median step time (min to max as bars), every measured row."""
    measured = [r for r in report.rows if r.step_time_s is not None
                and r.measured_peak_bytes is not None]
    if not measured:
        return None
    fig = _figure(7.5, 4.8)
    ax = fig.subplots()
    groups = (
        ("baselines", [r for r in measured if r.budget is None], "o", "tab:blue", ""),
        ("remat (budgets)", [r for r in measured if r.strategy == "remat"
                             and r.matched_to is None], "s", "tab:green", "-"),
        ("remat (matched)", [r for r in measured if r.strategy == "remat"
                             and r.matched_to is not None], "D", "tab:olive", ""),
        ("torch.compile", [r for r in measured if r.strategy == "compile"], "^", "tab:red", "-"),
        ("remat+compile (budgets)", [r for r in measured if r.strategy == REMAT_COMPILE
                                     and r.matched_to is None], "P", "tab:purple", "-"),
        ("remat+compile (at compile's peaks)", [r for r in measured
                                                if r.strategy == REMAT_COMPILE
                                                and r.matched_to is not None], "X",
         "tab:pink", ""),
    )
    for label, rows, marker, color, style in groups:
        if not rows:
            continue
        rows = sorted(rows, key=lambda r: r.measured_peak_bytes or 0)
        xs, ys, err = _series(rows)
        ax.errorbar(xs, ys, yerr=err, fmt=marker + (style or ""), color=color, label=label,
                    capsize=2, ms=5, lw=0.9)
        for r, x, y in zip(rows, xs, ys, strict=True):
            ax.annotate(r.key, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    for level in _budget_levels(report):
        ax.axvline(level / _MIB, color="0.75", lw=0.6, ls=":")
    ax.set_xlabel("measured peak of one step (MiB; dotted: budgets)")
    ax.set_ylabel("median step time (ms; bars: min to max)")
    ax.set_title(f"{report.model}: memory against time", fontsize=10)
    ax.legend(fontsize=7)
    with replacing(path) as temporary:  # atomic: a reader never sees half a PNG
        fig.savefig(temporary, dpi=110, format="png")
    return path


def microbatch(report: BenchReport, path: Path) -> Path | None:
    micro = report.microbatch
    rows = [] if micro is None else [r for r in micro.rows if r.samples_per_s]
    if not rows or micro is None:
        return None
    fig = _figure(6.5, 3.6)
    ax = fig.subplots()
    names = [f"{r.strategy}\nb={r.microbatch} x{r.accumulation_steps}" for r in rows]
    colors = ["tab:green" if r.strategy == micro.fastest else "tab:blue" for r in rows]
    ax.bar(names, [r.samples_per_s or 0 for r in rows], color=colors)
    ax.set_ylabel("samples per second")
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(f"global batch {micro.global_batch} under {micro.budget}: throughput",
                 fontsize=10)
    with replacing(path) as temporary:  # atomic: a reader never sees half a PNG
        fig.savefig(temporary, dpi=110, format="png")
    return path


def plot_all(report: BenchReport, folder: Path) -> tuple[Path, ...]:
    """Write every plot that has data; UsageError with the install hint without matplotlib."""
    written = [
        timelines(report, folder / "timelines.png"),
        tradeoff(report, folder / "tradeoff.png"),
        microbatch(report, folder / "microbatch.png"),
    ]
    return tuple(p for p in written if p is not None)
