"""``--shapes``: ``remat profile`` over a range of batch shapes, ``remat plan`` a plan set,
``remat auto`` and ``remat bench`` measuring it at each bucket's ends.

docs/shapes.md: a profile over a range fits every byte figure exactly (or steps it over a
ladder) and every time; a plan set gives each bucket of shapes its plan, every shape of
the range predicted within the budget.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from rich import box
from rich.table import Table

from remat.cli.common import load_for_profile
from remat.cli.output import console_for, write_json
from remat.core.errors import UsageError
from remat.core.profile_format import Profile
from remat.core.units import format_bytes

__all__ = ["add_shapes_option", "auto_range_command", "bench_range_table", "plan_range",
           "profile_range"]


def add_shapes_option(p: argparse.ArgumentParser, *, outside: bool) -> None:
    p.add_argument("--shapes", default=None, metavar="RANGE", help=(
        "a range of batch shapes to profile (and plan for), e.g. "
        "batch=1..16,seq=128..2048:8 (dimensions batch, seq, side, height, width, axisN; "
        "docs/shapes.md)"))
    if outside:
        p.add_argument("--outside", default="error", choices=("error", "conservative"),
                       help=("what a batch outside the range gets at run time: an error "
                             "(default), or the plan of least memory with one warning"))


def _ranged_profile(args: argparse.Namespace) -> Profile:
    from remat.profiling.shaped import profile_shapes

    if getattr(args, "fake", False):
        raise UsageError("--shapes profiles real steps at several shapes; drop --fake")
    if getattr(args, "compile", False):
        raise UsageError("--shapes does not compile the stages yet; drop --compile")
    model, batch, loss_fn, stages, _ = load_for_profile(args)
    console = console_for(args.json)
    began = time.perf_counter()
    with console.status("profiling the range") as status:
        def progress(what: str, done: int, total: int) -> None:
            status.update(f"profiling the range: {what} ({done + 1}/{total})")

        found = profile_shapes(model, batch, loss_fn, args.shapes, stages=stages,
                               optimizer=args.optimizer, repeats=getattr(args, "repeats", 2),
                               progress=progress)
    assert found.shapes is not None
    fit = found.shapes
    shapes = len({*fit.byte_points, *fit.time_points, *_ladder_shapes(fit)})
    console.print(
        f"profiled {found.model} over {fit.dims}: {shapes} shapes, {len(fit.time_points)} "
        f"of them timed, in {time.perf_counter() - began:.1f} s")
    return found


def _ladder_shapes(fit: Any) -> set[tuple[int, ...]]:
    import itertools

    return set(itertools.product(*fit.rungs))


def _fit_lines(prof: Profile) -> list[str]:
    fit = prof.shapes
    assert fit is not None
    lines = [
        f"bytes: {len(fit.bytes)} figures grow as exact polynomials (degree 1 in batch, 2 in "
        f"the others), {len(fit.envelopes)} are maxima of exact polynomials (peaks, fitted "
        f"op by op), {len(fit.steps)} are maxima read off a ladder of "
        f"{len(_ladder_shapes(fit))} shapes (exact there, never under between: "
        "docs/shapes.md), the rest do not change with the shape",
    ]
    for check in fit.checks:
        over = (f"; the stepped ones up to {format_bytes(check.most_over)} over"
                if check.most_over else "")
        lines.append(f"checked at {fit.dims.shape_text(check.shape)}, a shape the "
                     f"polynomials were not fitted at: {check.exact} of {check.fields} byte "
                     f"figures equal the fit's to the byte{over}")
    return lines


def profile_range(args: argparse.Namespace) -> int:
    """``remat profile --shapes``."""
    from remat.core.shape_profiles import at_shape

    prof = _ranged_profile(args)
    fit = prof.shapes
    assert fit is not None
    console = console_for(args.json)
    for line in _fit_lines(prof):
        console.print(line)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False,
                  title="a step without checkpointing across the range (predicted)")
    for title in ("shape", "peak", "step"):
        table.add_column(title, justify="right" if title != "shape" else "left")
    for shape in dict.fromkeys((fit.dims.lo, *fit.time_points, fit.dims.hi)):
        at = at_shape(prof, shape)
        table.add_row(fit.dims.shape_text(shape), format_bytes(at.predicted_peak_bytes or 0),
                      f"{at.step_s * 1e3:.2f} ms")
    console.print(table)
    write_json(prof.to_dict(), args.json)
    return 0


def plan_range(args: argparse.Namespace, source: Profile | None) -> int:
    """``remat plan --shapes`` (or ``--profile`` of a range): the plan set."""
    from remat.core.plan_set import box_text, plan_set

    if args.budget is None:
        raise UsageError("a plan set needs --budget, e.g. --budget 60% (of the peak at the "
                         "range's largest shape) or --budget 6GiB")
    if args.solver != "optimal" or args.world is not None or args.largest_batch:
        raise UsageError("a plan set is planned by the optimal solver for one process; drop "
                         "--solver, --world and --largest-batch")
    prof = source if source is not None else _ranged_profile(args)
    console = console_for(args.json)
    chosen = plan_set(prof, args.budget, outside=args.outside)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False,
                  title=f"plan set over {chosen.dims}, budget "
                        f"{format_bytes(chosen.budget_bytes)}")
    for title in ("plan", "shapes", "regions", "options", "predicted peak", "step"):
        table.add_column(title)
    for k, (plan, boxes) in enumerate(zip(chosen.plans, chosen.buckets, strict=True)):
        where = "; ".join(box_text(chosen.dims, b) for b in boxes[:3]) + (
            " ..." if len(boxes) > 3 else "")
        options = sorted({str(o) for o in plan.options} - {"keep"}) or ["keep"]
        t, t0 = plan.predicted_step_time_s, plan.baseline_step_time_s
        table.add_row(str(k), where, " ".join(str(r) for r in plan.regions) or "-",
                      " ".join(options), format_bytes(plan.predicted_peak_bytes or 0),
                      f"{t / t0 - 1:+.1%}" if t and t0 else "-")
    console.print(table)
    console.print(
        f"every one of the {chosen.shapes} shapes is predicted within the budget by the plan "
        f"that runs it; each plan is within {chosen.slowest_ratio - 1:.1%} of its shape's "
        f"best predicted time (solved at {chosen.solved} shapes); "
        + (f"the {chosen.between} shapes between the steps run the plan of the shape above "
           "them, each predicted within the budget; " if chosen.between else "")
        + f"a batch outside the range: {chosen.outside}; planned in "
        f"{chosen.solve_time_s:.1f} s")
    console.print("step: the plan's predicted step time over no checkpointing, at the shape "
                  "it was solved for")
    write_json(chosen.to_dict(), args.json)
    return 0


def auto_range_command(args: argparse.Namespace) -> int:
    """``remat auto --shapes``: the plan set, measured at each bucket's ends."""
    from remat.benchmarking.range_job import auto_range
    from remat.cli.common import check_threads, load
    from remat.core.solve.budget import Budget

    if args.distributed is not None or args.compile:
        raise UsageError("--shapes runs one process on eager stages; drop --distributed and "
                         "--compile")
    check_threads(args.threads)
    budget = Budget.parse(args.budget)  # read once, before the model is built
    model, batch, loss_fn, stages, description = load(args)
    console = console_for(args.json)
    with console.status("auto over the range") as status:
        report = auto_range(model, batch, loss_fn, args.shapes, budget,
                            stages=stages, optimizer=args.optimizer,
                            repeats=args.profile_repeats or 2, outside=args.outside,
                            progress=lambda what: status.update(what))
    chosen = report.plan_set
    dims = chosen.dims
    for line in _fit_lines(report.profile):
        console.print(line)
    for line in chosen.describe():
        console.print(line)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False,
                  title=f"{description} over {dims}: each plan at its bucket's ends, budget "
                        f"{format_bytes(chosen.budget_bytes)}")
    for title in ("shape", "plan", "predicted peak", "measured peak", "error", "within",
                  "gradients"):
        table.add_column(title)
    for row in report.rows:
        error = row.predicted_peak_bytes / row.measured_peak_bytes - 1
        table.add_row(dims.shape_text(row.shape), str(row.plan),
                      format_bytes(row.predicted_peak_bytes),
                      format_bytes(row.measured_peak_bytes), f"{error:+.2%}",
                      "yes" if row.measured_peak_bytes <= chosen.budget_bytes else "NO",
                      "equal" if row.grads_equal else "DIFFERENT")
    console.print(table)
    console.print(f"profiled the range in {report.profile_s:.1f} s; "
                  + ("every measured step within the budget, gradients equal"
                     if report.ok else "FAILED: a step over the budget or gradients differ"))
    write_json(report.to_dict(), args.json)
    return 0 if report.ok else 1



def bench_range_table(report: Any) -> Table:
    """``remat bench --shapes``: one row per strategy at each bucket end; the first row of
    a bucket names the plan and the shapes it runs."""
    from remat.benchmarking.bench_report import options_summary

    def size(n: int | None) -> str:
        return "-" if n is None else format_bytes(n)

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:+.1%}"

    chosen = report.plan_set
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False,
                  title=f"{report.model} over {chosen.dims}: every row at each bucket's ends, "
                        f"budget {report.budget} = {format_bytes(chosen.budget_bytes)}; times "
                        "in ms")
    for title in ("plan: shapes", "shape", "row", "predicted", "measured", "error", "within",
                  "step", "overhead", "grads", "regions / options"):
        table.add_column(title, justify="left" if title in (
            "plan: shapes", "shape", "row", "regions / options") else "right")
    last_plan, last_shape = None, None
    for r in report.rows:
        row = r.row
        head = f"{r.plan}: {r.bucket}" if r.plan != last_plan else ""
        where = r.shape_text if r.shape != last_shape else ""
        last_plan, last_shape = r.plan, r.shape
        if row.status != "ok":
            table.add_row(head, where, row.key, "", "", "", "", "", "", "",
                          f"{row.status}: {row.reason}")
            continue
        overhead = pct(row.overhead) + ("" if row.predicted_overhead is None
                                        else f" ({pct(row.predicted_overhead)})")
        table.add_row(
            head, where, row.key, size(row.predicted_peak_bytes), size(row.measured_peak_bytes),
            pct(row.peak_error), {True: "yes", False: "OVER", None: "-"}[row.within_budget],
            "-" if row.step_time_s is None else f"{row.step_time_s * 1e3:.1f}", overhead,
            {True: "equal", False: "DIFFER", None: "-"}[row.grads_match],
            f"{' '.join(row.regions) or '-'} / {options_summary(row.options)}")
    table.caption = ("measured: the live-storage tracker; error: measured / predicted - 1; "
                     "within: measured against the budget; step: median; overhead: median "
                     "per-round ratio to none at the same shape (predicted); remat: the plan "
                     "set applied, the runtime running the bucket's plan")
    return table
