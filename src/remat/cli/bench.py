"""``remat bench``: every checkpointing strategy side by side, predicted against measured."""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich import box
from rich.table import Table

from remat.cli.common import (
    add_model_options,
    add_optimizer_option,
    check_threads,
    model_options,
    stage_list,
    torchrun_rank,
)
from remat.cli.output import add_json_option, console_for, progress_bar, rank_path, write_json
from remat.cli.shape_ranges import add_shapes_option, bench_range_table
from remat.core.errors import UsageError

if TYPE_CHECKING:
    from remat.benchmarking import BenchReport, Finding

# Literal copies of remat.bench's defaults: importing it here would import torch for
# every subcommand's --help (tests/test_bench.py checks they stay equal).
DEFAULT_BUDGETS = "100%,75%,50%,35%,25%"
DEFAULT_STRATEGIES = "none,per-stage,every-2,sqrt,selective,compile,remat"
# With --shapes: one budget, and no compile rows (remat.benchmarking.range_bench).
RANGE_BUDGET = "50%"
RANGE_STRATEGIES = "none,per-stage,every-2,sqrt,selective,remat"


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="benchmark checkpointing strategies side by side under memory budgets",
        description=(
            "Measure, in one process with interleaved repeats, no checkpointing, per-stage "
            "checkpointing, every-K, sqrt(n) segments, selective everywhere, torch.compile "
            "with its activation memory budget and remat's optimal plan at each budget: "
            "predicted and measured peak, step time, overhead, whether gradients match; "
            "then each strategy's largest micro-batch under one budget and its throughput. "
            "With --shapes: remat's plan set for a range of batch shapes against the other "
            "strategies at each bucket's smallest and largest shape. "
            "Exits 1 when a plan remat applied changed the gradients or went over its budget, "
            "or could not run (torch rejected a rebuild, or it raised): the summary says why."
        ),
    )
    add_model_options(p)
    # Options --shapes does not use default to None, so that giving one is refused there.
    p.add_argument("--budgets", default=None,
                   help=f"whole-step budgets, bytes or fractions (default {DEFAULT_BUDGETS}; "
                   "one budget with --shapes, default 50%)".replace("%", "%%"))
    p.add_argument("--strategies", default=None,
                   help=f"which strategies (default all: {DEFAULT_STRATEGIES}, and hf-gc on a "
                   "transformers model; with --shapes all but compile; every-K for any K); "
                   "none always runs")
    p.add_argument("--repeats", type=int, default=10,
                   help="timed rounds (default 10, at most 1000)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed rounds first (default 2, at most 1000)")
    p.add_argument("--verify-steps", type=int, default=None,
                   help="training steps of each row's gradient check (default 2, at most "
                   "10000)")
    p.add_argument("--profile-repeats", type=int, default=None,
                   help="timed steps of each kind while profiling (default 5; 8 with "
                   "--distributed; at most 1000)")
    p.add_argument("--compile-limit", type=float, default=None, metavar="SECONDS",
                   help="skip further compile rows once compiling took this long (default 600)")
    p.add_argument("--microbatch-budget", default=None, metavar="BUDGET",
                   help="budget of the micro-batch comparison, or 'off' (default 50%%)")
    p.add_argument("--no-matched", action="store_true",
                   help="skip remat's plans at each baseline's peak (the matched comparison)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for the run (default: torch's own)")
    add_optimizer_option(p)
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write the report folder (bench.json, README.md, PNG plots) here")
    p.add_argument("--distributed", choices=("ddp", "fsdp"), default=None,
                   help="under torchrun: run as one rank of a DDP or FSDP2 job and report "
                   "this rank's peaks (JSON and --out get a .rankN suffix)")
    add_shapes_option(p, outside=False)
    add_json_option(p)
    p.set_defaults(run=run)


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run, every option spelled out."""
    words = ["remat", "bench", "--model", args.model]
    for item in args.sets:
        words += ["--set", item]
    if args.batch_size is not None:
        words += ["--batch-size", str(args.batch_size)]
    if args.stages:
        words += ["--stages", args.stages]
    if args.shapes is not None:
        words += ["--shapes", args.shapes, "--budgets", args.budgets or RANGE_BUDGET]
    else:
        words += ["--budgets", args.budgets or DEFAULT_BUDGETS]
    words += ["--strategies", args.strategies or
              (RANGE_STRATEGIES if args.shapes is not None else DEFAULT_STRATEGIES),
              "--repeats", str(args.repeats), "--warmup", str(args.warmup)]
    if args.shapes is None:
        words += ["--microbatch-budget", args.microbatch_budget or "50%"]
    if args.profile_repeats is not None:
        words += ["--profile-repeats", str(args.profile_repeats)]
    if args.no_matched:
        words.append("--no-matched")
    if args.compile:
        words.append("--compile")
    if args.threads is not None:
        words += ["--threads", str(args.threads)]
    if args.malloc != "keep":
        words += ["--malloc", args.malloc]
    if args.optimizer != "adamw":
        words += ["--optimizer", args.optimizer]
    if args.out:
        words += ["--out", args.out]
    if getattr(args, "distributed", None):
        words = ["torchrun", "--nproc-per-node", os.environ.get("WORLD_SIZE", "N"), "-m",
                 *words, "--distributed", args.distributed]
    return shlex.join(words)


def _table(report: BenchReport) -> Table:
    from remat.benchmarking.bench_report import options_summary
    from remat.core.units import format_bytes

    def size(n: int | None) -> str:
        return "-" if n is None else format_bytes(n)

    def ms(s: float | None) -> str:
        return "-" if s is None else f"{s * 1e3:.1f}"

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False,
                  title=f"{report.model}: one training step per row; times in ms")
    for column in ("row", "predicted", "measured", "error", "step [min, max]", "overhead",
                   "grads", "regions / options"):
        table.add_column(column, justify="left" if column in ("row", "regions / options")
                         else "right")
    for r in report.rows:
        if r.status != "ok":
            table.add_row(r.key, "", "", "", "", "", "", f"{r.status}: {r.reason}")
            continue
        grads = "-" if r.grads_match is None else ("equal" if r.grads_match else "DIFFER")
        overhead = "-" if r.overhead is None else f"{r.overhead:+.0%}"
        if r.predicted_overhead is not None:
            overhead += f" ({r.predicted_overhead:+.0%})"
        table.add_row(
            r.key, size(r.predicted_peak_bytes),
            f"{size(r.measured_peak_bytes)}{'' if r.instrument == 'tracker' else ' *'}",
            "-" if r.peak_error is None else f"{r.peak_error:+.1%}",
            f"{ms(r.step_time_s)} [{ms(r.step_time_min_s)}, {ms(r.step_time_max_s)}]",
            overhead, grads,
            f"{' '.join(r.regions) or '-'} / {options_summary(r.options)}",
        )
    table.caption = ("measured: the live-storage tracker; * torch.profiler allocator events "
                     "(compiled rows); step: median [min, max]; overhead: median of per-round "
                     "ratios to no checkpointing (predicted: the same statistic over the "
                     "profile's timed rounds)")
    return table


# Rows remat's runtime does not run: their failures are findings, not remat's failing.
_NOT_REMAT = ("compile", "hf-gc")


def _failed(report: BenchReport) -> list[str]:
    """What makes ``remat bench`` exit 1, one line each: gradients a plan changed, a remat
    plan over its budget, a row remat applied that could not run (rows sharing a reason
    on one line)."""
    from remat.benchmarking.strategies import REMAT_COMPILE

    # remat+compile rows compare with eager, as compile rows do: float32 rounding apart
    bad = [r.key for r in report.rows if r.strategy != "compile" and r.grads_match is False
           and not (r.strategy == REMAT_COMPILE and r.grads_rounding_only)]
    over = [r.key for r in report.rows
            if r.strategy in ("remat", REMAT_COMPILE) and r.within_budget is False]
    reasons: dict[str, list[str]] = {}
    for r in report.rows:
        if r.status == "failed" and r.strategy not in _NOT_REMAT:
            reasons.setdefault(r.reason or "no reason was recorded", []).append(r.key)
    return ([f"gradients differ: {', '.join(bad)}"] if bad else []) + (
        [f"over budget: {', '.join(over)}"] if over else []) + [
        f"{', '.join(keys)} could not run: {reason}" for reason, keys in reasons.items()]


def run(args: argparse.Namespace) -> int:
    if args.shapes is not None:
        return _run_range(args)
    from remat.benchmarking import bench, parse_budgets, parse_strategies, write_report
    from remat.benchmarking.strategies import REMAT_COMPILE
    from remat.core.solve.budget import Budget

    strategies = parse_strategies(args.strategies or DEFAULT_STRATEGIES)
    if args.compile:  # remat's plans for the stage-compiled model, beside the others
        strategies = parse_strategies([*strategies, REMAT_COMPILE])
    budgets = parse_budgets(args.budgets or DEFAULT_BUDGETS)
    micro_text = args.microbatch_budget or "50%"
    micro = None if micro_text.strip().lower() == "off" else Budget.parse(micro_text)
    compile_limit = 600.0 if args.compile_limit is None else args.compile_limit
    if compile_limit < 0:
        raise UsageError(f"--compile-limit {compile_limit:g} is negative; give seconds >= 0")
    check_threads(args.threads)
    rank = torchrun_rank(args.distributed, "bench")
    with progress_bar("bench") as progress:
        report = bench(
            args.model, options=model_options(args), stages=stage_list(args.stages),
            budgets=budgets, strategies=strategies, optimizer=args.optimizer,
            repeats=args.repeats, warmup=args.warmup,
            verify_steps=2 if args.verify_steps is None else args.verify_steps,
            profile_repeats=args.profile_repeats, compile_limit_s=compile_limit,
            matched=not args.no_matched, microbatch_budget=micro, threads=args.threads,
            progress=progress,
            command=command_line(args),
            distributed=args.distributed,
            malloc=args.malloc,
        )
    json_path, out = rank_path(args.json, rank), rank_path(args.out, rank)
    console = console_for(json_path)
    if rank is not None:
        console.print(f"rank {rank} of {report.environment.world_size} ({args.distributed}): "
                      "peaks are this rank's")
    console.print(_table(report))
    _print_findings(console, report.findings)
    if out:
        files = write_report(report, out)
        written = [files.json_path, files.markdown_path, *files.plots]
        console.print(f"report: {', '.join(str(p) for p in written)}")
        if files.plots_skipped:
            console.print(files.plots_skipped)
    console.print(f"took {report.elapsed_s:.0f} s")
    write_json(report.to_dict(), json_path)
    failed = _failed(report)
    for line in failed:
        console.print(f"[bold red]check failed[/]: {line}")
    return 1 if failed else 0


def _print_findings(console: Any, findings: Sequence[Finding]) -> None:
    for f in findings:
        mark = {True: "[green]MET[/]", False: "[bold red]MISSED[/]", None: "note"}[f.met]
        console.print(f"{mark} {f.name}: {f.statement}")


#: Options ``--shapes`` does not use (their dest, their flag): giving one is refused.
_NOT_WITH_SHAPES = (("compile", "--compile"), ("distributed", "--distributed"),
                    ("microbatch_budget", "--microbatch-budget"), ("no_matched", "--no-matched"),
                    ("compile_limit", "--compile-limit"), ("verify_steps", "--verify-steps"))


def _run_range(args: argparse.Namespace) -> int:
    """``remat bench --shapes``: every strategy at each bucket's ends of the plan set
    (Note [Bench over a range] in remat.benchmarking.range_bench)."""
    from remat.benchmarking.range_bench import bench_range, write_range_report

    given = [flag for dest, flag in _NOT_WITH_SHAPES
             if getattr(args, dest, None) is not None and getattr(args, dest) is not False]
    if given:
        raise UsageError(
            "--shapes measures the plan set against the eager recipes at each bucket's ends, "
            "without the micro-batch comparison, matched rows, compile rows, ranks or the "
            f"verify harness; drop {', '.join(given)}")
    check_threads(args.threads)
    with progress_bar("bench --shapes") as progress:
        report = bench_range(
            args.model, shapes=args.shapes, budget=args.budgets or RANGE_BUDGET,
            options=model_options(args), stages=stage_list(args.stages),
            strategies=args.strategies or RANGE_STRATEGIES, optimizer=args.optimizer,
            repeats=args.repeats, warmup=args.warmup, profile_repeats=args.profile_repeats,
            threads=args.threads, progress=progress, command=command_line(args),
            malloc=args.malloc)
    console = console_for(args.json)
    for line in report.plan_set.describe():
        console.print(line)
    console.print(bench_range_table(report))
    _print_findings(console, report.findings)
    if args.out:
        written = write_range_report(report, args.out)
        console.print(f"report: {', '.join(str(p) for p in written)}")
    console.print(f"profiled the range in {report.profile_s:.1f} s; took "
                  f"{report.elapsed_s:.0f} s")
    write_json(report.to_dict(), args.json)
    failed = report.failed()
    for line in failed:
        console.print(f"[bold red]check failed[/]: {line}")
    return 1 if failed else 0
