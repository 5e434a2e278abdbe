"""``remat plan``: the fastest checkpoint plan under a memory budget, from a model or profile."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from rich import box
from rich.table import Table

from remat.cli.common import (
    add_fake_option,
    add_model_options,
    add_optimizer_option,
    device_note,
    fake_device,
    kernel_lines,
    load_for_profile,
    padded_batches,
    profile_with_progress,
    runs_one_thread,
    stage_list,
)
from remat.cli.output import add_json_option, console_for, write_json
from remat.cli.shape_ranges import add_shapes_option, plan_range
from remat.core.coverage import coverage_lines
from remat.core.errors import CheckFailed, UsageError
from remat.core.profile_format import Profile
from remat.core.solve.budget import Budget
from remat.core.solve.uncertainty import noise_lines, steadiest_and_uncertainty
from remat.core.units import format_bytes

MAX_SLOTS = 100_000  # about a second for a 12-stage chain


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="choose the fastest checkpoint plan that fits a memory budget",
        description=(
            "Profile a model (or read a profile written by `remat profile --json`) and choose "
            "its checkpoint plan under a memory budget: the peak of a whole training step, "
            "in bytes (6GiB, 512MiB) or as a fraction of the measured peak without "
            "checkpointing (50%, 0.5). Exits 1 when no plan fits, naming the smallest "
            "budget that does."
        ),
    )
    add_model_options(p, default=None)
    p.add_argument("--profile", default=None, metavar="PATH", help="a profile JSON to plan from")
    p.add_argument("--budget", default=None, help=(
        "memory budget: bytes or a fraction (e.g. 50%%); with --fake --device, the device's "
        "memory by default"))
    p.add_argument(
        "--solver",
        default="optimal",
        help=(
            "optimal (default), none, per-stage, every-k, segments-k, megatron-uniform, "
            "megatron-block, selective-everywhere, min-peak"
        ),
    )
    p.add_argument("--k", type=int, default=None, help="k for every-k and segments-k")
    p.add_argument("--num-layers", type=int, default=None, help="layers for megatron-*")
    p.add_argument("--slots", type=int, default=None, help="memory slots of the optimal solver")
    add_optimizer_option(p)
    add_fake_option(p)
    p.add_argument(
        "--world",
        default=None,
        metavar="STRATEGY=N",
        help=(
            "plan one rank of a data-parallel job on paper: fsdp=N (parameters, gradients "
            "and optimizer state sharded over N ranks) or ddp=N; with --device, FSDP's "
            "all-gathers priced on its link, no other collective times (docs/distributed.md)"
        ),
    )
    p.add_argument(
        "--largest-batch",
        action="store_true",
        help=(
            "with --fake: for no checkpointing, per-layer checkpointing and remat's plan, "
            "the largest micro-batch whose step is predicted within the budget (bytes), "
            "from fake profiles at two micro-batches fitted linearly (docs/fake.md)"
        ),
    )
    add_shapes_option(p, outside=True)
    add_json_option(p)
    p.set_defaults(run=run)


def _scaled(args: argparse.Namespace, first: Any) -> Any:
    """``first`` with batch scaling: the model profiled again at twice its micro-batch."""
    import copy
    from dataclasses import replace

    from remat.profiling.profiler import fit_scaling

    size = first.batch_size
    if not size:
        raise UsageError("--largest-batch needs the model's micro-batch; pass --batch-size")
    twice = copy.copy(args)
    twice.batch_size = 2 * size
    model, batch, loss_fn, stages, description = load_for_profile(twice)
    second = profile_with_progress(
        model, batch, loss_fn, stages, optimizer=args.optimizer, description=description,
        malloc=args.malloc, fake=True, device=fake_device(args),
        padded_batches=padded_batches(args),
    )
    return replace(first, scaling=fit_scaling(first, second))


def _bytes_budget(budget: Budget) -> int:
    """``budget`` as bytes; a fraction is refused (of which micro-batch's step?)."""
    if budget.nbytes is None:
        raise UsageError(
            f"budget {budget.text!r} is a fraction of the measured peak without "
            "checkpointing, which this problem does not have; give bytes such as 6GiB instead")
    return budget.nbytes


def _largest_batches(args: argparse.Namespace, source: Any, world: Any, console: Any) -> int:
    """``--largest-batch``: each strategy's largest micro-batch under the budget."""
    from rich.table import Table

    from remat.benchmarking.bench_report import plan_summary
    from remat.core.sizing import STRATEGIES, Fit, fastest_batch, largest_batch

    budget = _bytes_budget(args.budget)
    scaled = _scaled(args, source)
    target = fake_device(args)
    transform = None if world is None else (
        lambda pr: _per_rank(pr, scaled, world[0], world[1], target))
    where = "" if world is None else f" on one rank of {world[0]} over {world[1]}"
    table = Table(title=f"largest micro-batch within {format_bytes(budget)}{where}")
    timed = scaled.times_estimated  # else the times are the fake run's dispatch
    columns = ["strategy", "micro-batch", "predicted peak",
               *(["step (estimated)", "samples/s"] if timed else []), "plan"]
    for column in columns:
        table.add_column(column)
    rows = []
    fits = [largest_batch(scaled, budget, strategy, transform=transform)
            for strategy in STRATEGIES]
    remat_fit = fits[-1]
    if timed and remat_fit.batch_size is not None:  # where remat trains fastest
        fastest = fastest_batch(scaled, budget, remat_fit.batch_size, transform=transform)
        if fastest.batch_size != remat_fit.batch_size:
            fits.append(Fit("remat-fastest", fastest.batch_size, fastest.plan))
    for fit in fits:
        strategy = fit.strategy
        peak = None if fit.plan is None else fit.plan.predicted_peak_bytes
        step = None if fit.plan is None else fit.plan.predicted_step_time_s
        rate = fit.batch_size / step if step and fit.batch_size else None
        table.add_row(
            _STRATEGY_NAMES[strategy],
            "none fits" if fit.batch_size is None else str(fit.batch_size),
            "-" if peak is None else format_bytes(peak),
            *([("-" if step is None else f"{step:.3g} s"), ("-" if rate is None
               else f"{rate:.3g}")] if timed else []),
            "-" if fit.plan is None else plan_summary(fit.plan))
        rows.append({"strategy": strategy, "batch_size": fit.batch_size,
                     "predicted_peak_bytes": peak,
                     "predicted_step_time_s": step if timed else None,
                     "plan": None if fit.plan is None else fit.plan.to_dict()})
    console.print(table)
    console.print(f"profiled at micro-batches {scaled.batch_size} and {2 * scaled.batch_size} "
                  "(fake tensors), every other size fitted linearly through them")
    for text in kernel_lines(scaled):
        console.print(text)
    note = device_note(target)
    write_json({"budget_bytes": budget, "world": None if world is None else list(world),
                "fits": rows, **({"device_note": note} if note else {})}, args.json)
    return 0


_STRATEGY_NAMES = {"none": "no checkpointing", "per-stage": "per-layer checkpointing",
                   "optimal": "remat (optimal)", "remat-fastest": "remat, most samples/s"}


def _problem_source(args: argparse.Namespace) -> Any:
    if args.profile is not None:
        if (args.model is not None or args.sets or args.stages or args.batch_size
                or args.fake):
            raise UsageError(
                "--profile already fixes the model; drop --model, --set, --stages, "
                "--batch-size and --fake"
            )
        if args.device is not None:
            raise UsageError("--device sizes a fake profile as it is made; with --profile "
                             "make that profile with --fake --device instead")
        from remat.core.profile_format import Profile

        return Profile.load(args.profile)
    if args.model is None:
        args.model = "gpt"
    model, batch, loss_fn, stages, description = load_for_profile(args)
    return profile_with_progress(
        model, batch, loss_fn, stages, optimizer=args.optimizer, description=description,
        malloc=args.malloc, fake=args.fake, device=fake_device(args),
        padded_batches=padded_batches(args),
    )


def _world(text: str | None) -> tuple[str, int] | None:
    """``--world fsdp=8`` as ``("fsdp", 8)``; UsageError on anything else."""
    if text is None:
        return None
    strategy, _, count = text.partition("=")
    if strategy not in ("fsdp", "ddp") or not count.isdigit() or int(count) < 1:
        raise UsageError(f"--world {text!r} is not valid; give fsdp=N or ddp=N with N >= 1, "
                         "e.g. --world fsdp=8")
    return strategy, int(count)


def _per_rank(problem: Any, source: Any, strategy: str, world_size: int,
              target: Any = None) -> Any:
    """The problem of one rank (:func:`remat.core.transforms.per_rank_problem`), budgets as
    fractions taken of that rank's step without checkpointing. With a ``target`` device
    that has a link bandwidth, FSDP's all-gathers are priced on it (what a plan resharding
    units after rebuilds pays again); without, collectives take no time."""
    from dataclasses import replace

    from remat.core.collectives import collective_seconds
    from remat.core.plan_format import Plan
    from remat.core.profile_format import Profile
    from remat.core.solve import simulate
    from remat.core.transforms import per_rank_problem

    buffers = source.fixed.buffers_bytes if isinstance(source, Profile) else 0
    gathers = [0.0] * problem.n
    link = _link(target, strategy)
    if link is not None:
        gathers = [collective_seconds([("all_gather_into_tensor", s.grad_bytes)], link,
                                      world_size) for s in problem.stages]
    ranked = per_rank_problem(problem, world_size=world_size, strategy=strategy,
                              replicated_bytes=buffers, backend="nccl", gather_s=gathers)
    base = simulate(Plan(stages=ranked.stage_names), ranked).peak_bytes
    return replace(ranked, measured_no_checkpoint_peak_bytes=base)


def _link(target: Any, strategy: str) -> float | None:
    """The link bandwidth FSDP's all-gathers are priced on: the target device's, if any."""
    return None if target is None or strategy != "fsdp" else target.link_bytes_per_s


def _solver_params(args: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if args.k is not None:
        if args.solver not in ("every-k", "segments-k"):
            raise UsageError("--k only applies to --solver every-k or segments-k")
        params["k"] = args.k
    if args.num_layers is not None:
        if not args.solver.startswith("megatron-"):
            raise UsageError("--num-layers only applies to --solver megatron-uniform or -block")
        params["num_layers"] = args.num_layers
    return params


def plan_table(plan: Any) -> Table:
    """Stages with their option and the regions that hold them, outermost first."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("#", justify="right")
    table.add_column("stage", no_wrap=True)
    table.add_column("option")
    table.add_column("regions (outermost first)")
    for i, (name, option) in enumerate(zip(plan.stages, plan.options, strict=True)):
        holding = [str(r) for r in plan.regions if r.start <= i < r.stop]
        table.add_row(str(i), name, option, " ".join(holding) or "-")
    return table


def _no_limit(plan: Any) -> bool:
    """Whether a budget-driven solver checkpointed nothing because the budget needs none."""
    return (
        plan.solver in ("optimal", "segments-optimal")
        and plan.checkpoints_nothing
        and plan.budget_bytes is not None
        and plan.predicted_peak_bytes is not None
        and plan.predicted_peak_bytes <= plan.budget_bytes
    )


def run(args: argparse.Namespace) -> int:
    # Every option is checked before profiling, which takes a while and trains the model.
    params, target, world = _checked_options(args)
    if args.shapes is not None:
        return _plan_shapes(args)
    source = _problem_source(args)
    if isinstance(source, Profile) and source.shapes is not None:
        return plan_range(args, source)
    console = console_for(args.json)
    note = device_note(target)
    if note is not None:
        console.print(note)
    if args.largest_batch:
        return _largest_batches(args, source, world, console)
    problem = _problem(args, source, world, target, console)
    result = _solved(problem, args, params)
    found = None
    fake = isinstance(source, Profile) and source.fake
    measured = isinstance(source, Profile) and not fake and world is None
    if measured:
        # the simplest of the plans tied within the noise
        result, found = steadiest_and_uncertainty(source, result, slots=problem.slots)
    result = _with_notes(result, source, note, console)
    _print_plan(console, result, problem, fake)
    _print_times(console, result, source, fake)
    _print_closing_notes(console, result, source, measured, found)
    write_json(result.to_dict(), args.json)
    return 0


def _checked_options(
    args: argparse.Namespace,
) -> tuple[dict[str, Any], Any, tuple[str, int] | None]:
    """The solver's parameters, the fake target device and ``--world``, every option checked
    (and ``args.budget`` read into a :class:`Budget`) before anything is profiled."""
    from remat.core.solve import SOLVERS

    if args.solver not in SOLVERS:
        raise UsageError(
            f"--solver {args.solver!r} is not known; choose one of {', '.join(SOLVERS)}"
        )
    params = _solver_params(args)
    target = fake_device(args)
    padded_batches(args)
    if args.budget is None and target is not None:  # the whole device, by default
        args.budget = str(target.memory_bytes)
    if args.budget is not None:  # read once, here: the steps below take the Budget
        args.budget = Budget.parse(args.budget)
    if args.largest_batch:
        if not args.fake:
            raise UsageError("--largest-batch works on fake profiles; add --fake (and "
                             "--device NAME for an accelerator)")
        if args.budget is None:
            raise UsageError("--largest-batch needs a budget in bytes (e.g. --budget 80GiB, "
                             "or --device NAME for that device's memory)")
        _bytes_budget(args.budget)  # before profiling
    if args.budget is None and args.solver in ("optimal", "segments-optimal"):
        raise UsageError(
            f"--solver {args.solver} needs --budget, e.g. --budget 50% or --budget 6GiB"
        )
    world = _world(args.world)
    if args.slots is not None and not 1 <= args.slots <= MAX_SLOTS:
        raise UsageError(
            f"--slots {args.slots} is outside 1..{MAX_SLOTS} (default 500); the solver's "
            "tables grow with it (a million slots take 2.6 GB for 12 stages)"
        )
    return params, target, world


def _plan_shapes(args: argparse.Namespace) -> int:
    """``--shapes``: plans over a range of input shapes, the model profiled across it."""
    if args.profile is not None:
        raise UsageError("--profile already fixes the range its shapes cover; drop "
                         "--shapes, or profile the model again with --shapes")
    if args.model is None:
        args.model = "gpt"
    return plan_range(args, None)


def _problem(args: argparse.Namespace, source: Any, world: tuple[str, int] | None,
             target: Any, console: Any) -> Any:
    """The problem to solve: the profile's coverage told first, then, with ``--world``, the
    problem of one rank."""
    from remat.core.planner import to_problem

    if isinstance(source, Profile):  # before solving, so it shows when no plan fits
        given = None if args.profile is not None else stage_list(args.stages) is not None
        for text in coverage_lines(source, given=given):
            console.print(text)
    problem = to_problem(source, slots=args.slots)
    if world is not None:
        problem = _per_rank(problem, source, world[0], world[1], target)
        timed = ("all-gathers priced on the device's link, other collectives take no time"
                 if _link(target, world[0]) is not None else "no collective times")
        console.print(f"one rank of {world[0]} over {world[1]} ranks, on paper: parameters, "
                      f"gradients and optimizer state as that rank holds them; {timed}")
    return problem


def _solved(problem: Any, args: argparse.Namespace, params: dict[str, Any]) -> Any:
    """The solver's plan for ``problem``; when none fits, the error names the least budget."""
    from remat.core.planner import plan as make_plan

    try:
        return make_plan(problem, args.budget, args.solver, **params)
    except CheckFailed as err:  # no plan fits: the JSON error names the least budget
        if args.solver == "optimal":
            from remat.core.solve import minimum_budget

            err.minimum_budget_bytes = minimum_budget(problem)  # type: ignore[attr-defined]
        raise


def _with_notes(result: Any, source: Any, note: str | None, console: Any) -> Any:
    """``result`` made for ``source``, its notes printed and the device's note added."""
    from remat.core.planner import with_made_for

    result = with_made_for(result, source)
    for text in result.notes:  # what the solver chose on its own (a chain too long)
        console.print(f"note: {text}")
    if note is not None:  # printed above; the plan file says it too
        result = replace(result, notes=(*result.notes, note))
    return result


def _print_plan(console: Any, result: Any, problem: Any, fake: bool) -> None:
    """The plan's table, then its predicted peak against the budget and the baseline."""
    console.print(plan_table(result))
    if result.reshard_after_rebuild:
        console.print("FSDP2 units: each one a rebuild gathers is resharded after its call and "
                      "gathered again for its backward (less memory than keeping it gathered "
                      "from the rebuild, one more all-gather each; docs/distributed.md)")
    peak, base = result.predicted_peak_bytes, problem.measured_no_checkpoint_peak_bytes
    assert peak is not None  # every solver fills in its prediction
    line = f"solver {result.solver}: predicted peak {format_bytes(peak)}"
    if result.budget_bytes is not None:
        line += f" against a budget of {format_bytes(result.budget_bytes)}"
    if base:
        how = "counted on fake tensors" if fake else "measured"
        line += f" ({how} without checkpointing: {format_bytes(base)})"
    console.print(line)
    if _no_limit(result):
        console.print(
            "the budget holds the whole step without checkpointing, so nothing is "
            "checkpointed (no limit)"
        )


def _print_times(console: Any, result: Any, source: Any, fake: bool) -> None:
    """The predicted step time against no checkpointing, and what kind of figure it is."""
    t, t0 = result.predicted_step_time_s, result.baseline_step_time_s
    if fake and source.times_estimated and t and t0:
        console.print(
            f"predicted step {t * 1e3:.2f} ms against {t0 * 1e3:.2f} ms without "
            f"checkpointing ({t / t0 - 1:+.1%}): the roofline's estimate for {source.device}, "
            "an estimate (docs/fake.md)")
    elif fake:
        console.print("fake profile: the plan is chosen by memory exactly; its times are the "
                      "fake run's dispatch, not this machine's kernels (docs/fake.md)")
    elif t and t0:
        console.print(
            f"predicted step {t * 1e3:.2f} ms against {t0 * 1e3:.2f} ms without "
            f"checkpointing ({t / t0 - 1:+.1%}); solved in {result.solve_time_s:.3f} s"
        )
    if fake:
        for text in kernel_lines(source):
            console.print(text)


def _print_closing_notes(console: Any, result: Any, source: Any, measured: bool,
                         found: Any) -> None:
    """A profile without stage identities, and a measured profile's noise and ties."""
    if result.made_for is not None and result.made_for.stages is None:
        console.print(
            "note: the profile records no stage identities (an older remat wrote it), so "
            "remat.apply cannot check this plan against the model; profile again to add them"
        )
    if measured:  # JSON stays a plan
        for text in noise_lines(source, one_thread=runs_one_thread()):
            console.print(text)
        if found is not None:
            console.print(found.sentence())
