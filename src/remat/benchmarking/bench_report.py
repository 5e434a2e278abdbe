"""A benchmark's report folder: ``bench.json``, ``README.md`` (the summary) and PNG plots."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from remat.core.artifact import write_text
from remat.core.errors import UsageError
from remat.core.plan_format import Plan
from remat.core.units import format_bytes

from .plots import PLOT_HINT, plot_all
from .results import BenchReport, Finding, MicrobatchReport, Row

__all__ = ["ReportFiles", "markdown", "options_summary", "plan_summary", "write_report"]


@dataclass(frozen=True)
class ReportFiles:
    json_path: Path
    markdown_path: Path
    plots: tuple[Path, ...]
    plots_skipped: str | None  # why no plots were drawn, if none were


def options_summary(options: Sequence[str]) -> str:
    """``keep x5, selective:save-attention x3`` (in first-seen order)."""
    counts = Counter(options)
    return ", ".join(f"{o} x{n}" for o, n in counts.items()) or "-"


def plan_summary(plan: Plan) -> str:
    """``regions [0, 2) [2, 5); options keep x8`` (and ``; FSDP units resharded after
    rebuilds`` for a plan that asks for it)."""
    regions = " ".join(str(r) for r in plan.regions) or "none"
    resharded = "; FSDP units resharded after rebuilds" if plan.reshard_after_rebuild else ""
    return f"regions {regions}; options {options_summary(plan.options)}{resharded}"


def _size(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def _grads(r: Row) -> str:
    if r.grads_match is None:
        return "-"
    if r.grads_match:
        return "equal"
    why = ", rounding" if r.grads_rounding_only else ""
    return f"DIFFER ({r.grads_max_rel_error:.1e}{why})"


def _row_line(r: Row) -> str:
    if r.status != "ok":
        return f"| {r.key} | {r.budget or '-'} | {r.status}: {r.reason} | | | | | | | | |"
    span = f"{_ms(r.step_time_s)} [{_ms(r.step_time_min_s)}, {_ms(r.step_time_max_s)}]"
    budget = "-" if r.budget is None else f"{r.budget} ({_size(r.budget_bytes)})"
    return (
        f"| {r.key} | {budget} | "
        f"{_size(r.predicted_peak_bytes)} | {_size(r.measured_peak_bytes)} ({r.instrument}) | "
        f"{_pct(r.peak_error)} | {span} | {_pct(r.overhead)} ({_pct(r.predicted_overhead)}) | "
        f"{_grads(r)} | {' '.join(r.regions) or '-'} | {options_summary(r.options)} | "
        f"{'-' if r.compile_time_s is None else f'{r.compile_time_s:.0f} s'} |"
    )


def _finding(f: Finding) -> str:
    mark = {True: "MET", False: "MISSED", None: "note"}[f.met]
    return f"- **{mark}** {f.name}: {f.statement}" + (
        f" _(target: {f.target})_" if f.met is not None else "")


def markdown(report: BenchReport, plots: Sequence[Path] = (), plots_note: str | None = None) -> str:
    out = _header(report)
    out += _rows_section(report)
    out += _findings_section(report)
    if report.microbatch is not None:
        out += _microbatch_section(report.microbatch)
    out += _plots_section(plots, plots_note)
    out += _HOW_MEASURED
    return "\n".join(out)


def _header(report: BenchReport) -> list[str]:
    """The title, the command, how the rows were run, and the environment's table."""
    env = report.environment
    out = [f"# remat bench: {report.model}", ""]
    if report.command:
        out += ["Command:", "", "```console", f"$ {report.command}", "```", ""]
    out += [
        f"One process, {report.repeats} timed rounds after {report.warmup} warm-up "
        f"round{'' if report.warmup == 1 else 's'}, "
        f"rows interleaved; optimizer {report.optimizer}, batch size {report.batch_size}; "
        f"measured peak without checkpointing {_size(report.no_checkpoint_peak_bytes)}; "
        f"took {report.elapsed_s:.0f} s.",
        "",
        "| torch | device | threads | C allocator | dtype | attention | torch.compile |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| {env.torch_version} | {env.device} | {env.threads} (interop {env.interop_threads}) "
        f"| {env.malloc} | {env.dtype} | {env.attention_backend} | {report.compile_status} |",
        "",
    ]
    return out


def _rows_section(report: BenchReport) -> list[str]:
    """``## Rows``: what the columns mean, then one table line per row."""
    return [
        "## Rows",
        "",
        "Peaks are of one whole training step (parameters, gradients, optimizer state, "
        "activations, temporaries). Error: measured / predicted - 1. Step times in ms: median "
        "[min, max]. Overhead: median per-round ratio to no checkpointing - 1 (the cost "
        "model's prediction in brackets). Gradients: the verify harness (compile rows: the "
        "first step against eager).",
        "",
        "| row | budget | predicted peak | measured peak (instrument) | error | step ms | "
        "overhead (predicted) | gradients | regions | options | compile |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *(_row_line(r) for r in report.rows),
        "",
    ]


def _findings_section(report: BenchReport) -> list[str]:
    """``## Findings``, then the rows whose gradients differ, if any do."""
    out = [
        "## Findings",
        "",
        *(_finding(f) for f in report.findings),
        "",
    ]
    differing = [r for r in report.rows if r.grads_match is False]
    if differing:
        out += ["Gradient mismatches:", ""]
        out += [f"- {r.key}: {r.grads_detail}" for r in differing]
        out += [""]
    return out


def _microbatch_section(micro: MicrobatchReport) -> list[str]:
    """``## Micro-batch under a budget``: the statement, then each strategy's micro-batch."""
    out = ["## Micro-batch under a budget", "", micro.statement[:1].upper()
           + micro.statement[1:] + ".", ""]
    if micro.rows:
        out += [
            f"Global batch {micro.global_batch} kept by gradient accumulation; micro-batch "
            f"predicted from the profile's batch scaling (profiled at "
            f"{micro.profiled_batch_sizes[0]} and {micro.profiled_batch_sizes[1]}), then "
            "confirmed by the measured peak of a whole accumulation step.",
            "",
            "| strategy | predicted micro-batch | confirmed | accumulation | predicted peak | "
            "measured peak | predicted samples/s | samples/s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for m in micro.rows:
            if m.status != "ok":
                out.append(f"| {m.strategy} | {m.status}: {m.reason} | | | | | | |")
                continue
            out.append(
                f"| {m.strategy} | {m.predicted_microbatch} | {m.microbatch} | "
                f"{m.accumulation_steps} | {_size(m.predicted_peak_bytes)} | "
                f"{_size(m.measured_peak_bytes)} | {m.predicted_samples_per_s or 0:.1f} | "
                f"{'-' if m.samples_per_s is None else f'{m.samples_per_s:.1f}'} |"
            )
        out += [""]
    return out


def _plots_section(plots: Sequence[Path], plots_note: str | None) -> list[str]:
    """``## Plots``: each plot's image, and why there are none if plots were skipped."""
    out = ["## Plots", ""]
    out += [f"![{p.stem}]({p.name})" for p in plots]
    if plots_note:
        out += [plots_note]
    return out


_HOW_MEASURED = [
    "",
    "## How each row was measured",
    "",
    "- tracker: remat's live-storage tracker (a dispatch mode), exact per storage; the "
    "torch.profiler figure of the same rows is in the JSON (`profiler_peak_bytes`).",
    "- torch.profiler: compiled rows, from the allocator events of "
    "`torch.profiler.profile(profile_memory=True)` (Dynamo does not compile under a "
    "dispatch mode, so the tracker would measure the eager model).",
    "- compile rows set `torch._functorch.config.activation_memory_budget` to the budget's "
    "fraction of the measured peak (torch reads it as a fraction of activation memory, a "
    "different base) and inductor's `fallback_random`, so dropout masks match eager.",
    "",
]


def write_report(report: BenchReport, folder: str | Path) -> ReportFiles:
    """Write ``bench.json``, ``README.md`` and the plots (skipped without matplotlib)."""
    target = Path(folder)
    try:
        target.mkdir(parents=True, exist_ok=True)
        json_path = target / "bench.json"
        write_text(json_path, json.dumps(report.to_dict(), indent=2) + "\n")
        plots: tuple[Path, ...] = ()
        note = None
        try:
            plots = plot_all(report, target)
        except UsageError:
            note = f"Plots were skipped: matplotlib is not installed ({PLOT_HINT})."
        md_path = target / "README.md"
        write_text(md_path, markdown(report, plots, note))
    except OSError as err:
        raise UsageError(
            f"cannot write the report to {str(folder)!r} ({err.strerror}); give a writable --out"
        ) from err
    return ReportFiles(json_path, md_path, plots, note)
