"""``remat auto``: the main job: profile, plan, apply, verify, measure, in one command."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich import box
from rich.table import Table

from remat.cli.common import (
    add_model_options,
    add_optimizer_option,
    check_threads,
    model_options,
    runs_one_thread,
    stage_list,
    torchrun_rank,
)
from remat.cli.output import add_json_option, console_for, write_error, write_json
from remat.cli.progress import progress_bar
from remat.cli.shape_ranges import add_shapes_option, auto_range_command
from remat.core.artifact import write_text
from remat.core.errors import UNEXPECTED_EXIT_CODE, RematError, UsageError

if TYPE_CHECKING:
    from rich.console import Console

    from remat.benchmarking.auto_report import AutoReport


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="the main job: profile, plan under a budget, apply, verify and measure a model",
        description=(
            "Profile a model, choose remat's fastest plan under a memory budget, apply it, "
            "verify that training is unchanged and measure it against the plain model: "
            "predicted against measured peak, the step-time overhead, whether gradients are "
            "equal, and where the memory went. Exits 0 only when every step ran, verify "
            "passed and the measured peak is within the budget and within 5% of the "
            "prediction; 1 otherwise. With --json, a run that stops early writes the step it "
            "stopped at and why in an error object."
        ),
    )
    add_model_options(p)
    p.add_argument("--budget", default="50%",
                   help="whole-step budget: bytes or a fraction of the peak without "
                   "checkpointing (default 50%%)")
    add_optimizer_option(p)
    p.add_argument("--repeats", type=int, default=6,
                   help="timed steps of each model, interleaved (default 6, at most 1000)")
    p.add_argument("--profile-repeats", type=int, default=None,
                   help="timed rounds of each profile (default 2; 8 with --distributed; at "
                   "most 1000)")
    p.add_argument("--verify-steps", type=int, default=2,
                   help="training steps the verify harness compares (default 2, at most "
                   "10000)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for the run (default: torch's own)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write auto.json, plan.json, profile.json and auto.md here (and "
                        "profile.again.json when auto profiled a second time)")
    p.add_argument("--distributed", choices=("ddp", "fsdp"), default=None,
                   help="under torchrun: each rank runs the job on its shard of the batch "
                   "under DDP or FSDP2 and reports its own peaks (docs/distributed.md)")
    add_shapes_option(p, outside=True)
    add_json_option(p)
    p.set_defaults(run=run)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f}"


def _categories(report: AutoReport) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False,
                  title="where the memory went, at each step's peak (MiB)")
    for column in ("category", "without checkpointing", "with the plan", "change"):
        table.add_column(column, justify="left" if column == "category" else "right")
    base, ours = report.baseline_peak_by_category, report.peak_by_category
    for name in base:
        a, b = base.get(name, 0), ours.get(name, 0)
        if a or b:
            table.add_row(name, _mib(a), _mib(b), f"{(b - a) / (1 << 20):+.2f}")
    table.add_row("total", _mib(report.baseline_peak_bytes), _mib(report.measured_peak_bytes),
                  f"{(report.measured_peak_bytes - report.baseline_peak_bytes) / (1 << 20):+.2f}")
    return table


def _step_lines(report: AutoReport, one_thread: bool = False) -> list[str]:
    """The step time and the overhead, each saying which statistic it is."""
    from remat.core.solve.uncertainty import noise_lines

    lines = [
        f"step: median {report.step_time_s * 1e3:.1f} ms with the plan against "
        f"{report.baseline_step_time_s * 1e3:.1f} ms without checkpointing "
        f"({report.overhead_of_medians:+.1%}, ratio of the medians)"
    ]
    low, high = report.overhead_range
    pairs = len(report.overhead_pairs)
    line = (f"overhead: {report.overhead:+.1%} (median of {pairs} interleaved per-pair "
            f"ratios, interquartile {low:+.1%}..{high:+.1%})")
    if report.predicted_overhead is not None:
        line += (f"; predicted {report.predicted_overhead:+.1%} "
                 f"({report.predicted_overhead_statistic})")
        u = report.uncertainty
        if u is not None:
            line += f" ({u.overhead_low:+.1%}..{u.overhead_high:+.1%} within the timing noise)"
    lines.append(line)
    if abs(report.overhead_of_medians - report.overhead) > 0.05:
        lines.append(
            f"note: the ratio of the medians and the median of the per-pair ratios differ by "
            f"{abs(report.overhead_of_medians - report.overhead) * 100:.0f} points: the "
            "machine's speed moved during the measurement (each pair ran back to back, so "
            "the per-pair figure is the steadier one)"
        )
    first = report.first_attempt
    if first is not None:
        u, (low, high) = first.prediction, first.overhead_range
        agrees = "agree" if not report.prediction_disagrees else "disagree too"
        lines.append(
            f"note: the first profile predicted {u.overhead:+.1%} ({u.overhead_low:+.1%}.."
            f"{u.overhead_high:+.1%} within its timing noise) and the first measurement gave "
            f"{first.overhead:+.1%} (interquartile {low:+.1%}..{high:+.1%}): over 5 points or "
            f"their ranges apart, so remat "
            f"profiled the plain model and timed the pairs again: the figures above are the "
            f"second ones, which {agrees} (the plan was chosen on the first profile)"
        )
    if report.prediction_disagrees and report.uncertainty is not None:
        u, gap = report.uncertainty, report.overhead - (report.predicted_overhead or 0.0)
        lines.append(
            f"note: the measured overhead is {abs(gap) * 100:.1f} points "
            f"{'above' if gap > 0 else 'below'} the prediction, outside its range within "
            f"the timing noise ({u.overhead_low:+.1%}..{u.overhead_high:+.1%}): either the "
            "machine changed between profiling and measuring, or the cost model misses "
            "something on this model; run remat auto again: a gap that repeats is the model's"
        )
    if report.profile is not None:
        # per rank, the plain profile leaves the collectives out: the prediction's plain
        # step is the per-rank problem's, timed on the wrapped model (Note [Per-rank time])
        per_rank = report.environment is not None and report.environment.distributed
        profiled_s = (report.plan.baseline_step_time_s or 0.0) if per_rank \
            else report.profile.step_s
        speed = report.baseline_step_time_s / profiled_s if profiled_s > 0 else 1.0
        if not 2 / 3 <= speed <= 1.5:
            lines.append(
                f"note: the plain step took {speed:.1f}x as long while measuring as while "
                f"profiling ({report.baseline_step_time_s * 1e3:.1f} ms against "
                f"{profiled_s * 1e3:.1f} ms): the prediction and the measurement "
                "saw differently loaded machines, so they may disagree by more than the model"
            )
        # the warning, when there is one
        lines += noise_lines(report.profile, one_thread=one_thread)[1:]
    if report.uncertainty is not None and report.uncertainty.uncertain:
        lines.append(report.uncertainty.sentence())
    return lines


def render(report: AutoReport, console: Console, *, one_thread: bool = False) -> None:
    from remat.benchmarking.bench_report import plan_summary
    from remat.core.coverage import coverage_lines
    from remat.core.units import format_bytes

    plan = report.plan
    console.print(f"remat auto: {report.model}, budget {report.budget} = "
                  f"{format_bytes(report.budget_bytes)}")
    if report.profile is not None:
        for line in coverage_lines(report.profile):
            console.print(line)
    console.print(f"plan: {plan_summary(plan)}")
    verdict = "within the budget" if report.within_budget else "[bold red]OVER the budget[/]"
    console.print(
        f"peak: predicted {format_bytes(report.predicted_peak_bytes)}, measured "
        f"{format_bytes(report.measured_peak_bytes)} ({report.peak_error:+.1%}), {verdict}; "
        f"without checkpointing {format_bytes(report.baseline_peak_bytes)} "
        f"({report.measured_peak_bytes / report.baseline_peak_bytes - 1:+.0%})"
    )
    for line in _step_lines(report, one_thread):
        console.print(line)
    grads = ("[bold red]not comparable[/]" if report.verify_detail.startswith("finite:")
             else "equal" if report.grads_match else "[bold red]DIFFERENT[/]")
    console.print(f"gradients: {grads}; verify {'passed' if report.verify_ok else 'FAILED'}: "
                  f"{report.verify_detail}")
    console.print(_categories(report))
    where = f" in {report.peak_module}" if report.peak_module else ""
    if report.peak_phase is None:  # per rank: the allocator's events name no phase
        console.print(f"the cost model puts the peak at '{report.predicted_peak_event}'")
    else:
        console.print(f"the measured peak is in the {report.peak_phase} phase{where}; the "
                      f"cost model puts it at '{report.predicted_peak_event}'")
    for problem in report.problems:
        console.print(f"[bold red]problem[/]: {problem}")
    t = report.timings_s
    console.print(
        f"{'OK' if report.ok else 'NOT OK'}; took {report.elapsed_s:.0f} s (profile "
        f"{t.get('profile_s', 0):.0f} s, plan {t.get('plan_s', 0):.1f} s, verify "
        f"{t.get('verify_s', 0):.0f} s, measure {t.get('measure_s', 0):.0f} s)"
    )


def _write_folder(report: AutoReport, folder: str, text: str) -> list[Path]:
    target = Path(folder)
    try:
        target.mkdir(parents=True, exist_ok=True)
        paths = [target / "auto.json", target / "plan.json", target / "auto.md"]
        write_text(paths[0], json.dumps(report.to_dict(), indent=2) + "\n")
        report.plan.save(paths[1])
        write_text(paths[2], f"# remat auto: {report.model}\n\n```text\n{text}```\n")
        # Note [Profiling again]: profile.json is the plan's (its made_for names it), a
        # second attempt's profile.again.json
        first = report.first_attempt
        saved = {"profile.json": report.profile if first is None else first.profile,
                 "profile.again.json": None if first is None else report.profile}
        for name, found in saved.items():
            if found is not None:
                paths.append(target / name)
                found.save(paths[-1])
    except OSError as err:
        raise UsageError(
            f"cannot write to {folder!r} ({err.strerror}); give a writable --out"
        ) from err
    return paths


def run(args: argparse.Namespace) -> int:
    from remat.benchmarking import auto
    from remat.benchmarking.factory import failure
    from remat.benchmarking.stopping import Stopped
    from remat.core.solve.budget import Budget

    if args.shapes is not None:
        return auto_range_command(args)
    try:
        with progress_bar("auto") as progress:
            check_threads(args.threads)
            budget = Budget.parse(args.budget)
            torchrun_rank(args.distributed, "auto")
            report = auto(
                args.model, options=model_options(args), stages=stage_list(args.stages),
                budget=budget, optimizer=args.optimizer, repeats=args.repeats,
                profile_repeats=args.profile_repeats, verify_steps=args.verify_steps,
                progress=progress, malloc=args.malloc,
                threads=args.threads, distributed=args.distributed, compile=args.compile,
            )
    except Stopped as err:
        write_error(args, err.to_dict())
        raise
    except RematError as err:  # an option, before any step ran
        write_error(args, {"stage": "checking the options", "message": str(err),
                           "exit_code": err.exit_code})
        raise
    except Exception as err:  # a bug: main says so in one line, and the JSON too
        write_error(args, {"stage": None, "message": failure(err),
                           "exit_code": UNEXPECTED_EXIT_CODE})
        raise
    _report(args, report)
    return 0 if report.ok else 1


def _report(args: argparse.Namespace, report: AutoReport) -> None:
    from rich.console import Console

    from remat.cli.output import rank_path

    env = report.environment
    rank = env.rank if env is not None and args.distributed else None
    json_path, out = rank_path(args.json, rank), rank_path(args.out, rank)
    console = console_for(json_path)
    if rank is not None and env is not None:
        console.print(f"rank {rank} of {env.world_size} ({args.distributed}): peaks and "
                      "times are this rank's")
    one_thread = runs_one_thread(args.threads)
    render(report, console, one_thread=one_thread)
    if out:
        recorder = Console(record=True, width=110, file=io.StringIO())
        render(report, recorder, one_thread=one_thread)
        paths = _write_folder(report, out, recorder.export_text())
        console.print(f"wrote {', '.join(str(p) for p in paths)}")
    write_json(report.to_dict(), json_path)
