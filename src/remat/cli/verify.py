"""``remat verify``: prove a plan changes memory and time only, never the training."""

from __future__ import annotations

import argparse
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text

from remat.cli.common import (
    add_model_options,
    add_optimizer_option,
    load,
    profile_with_progress,
)
from remat.cli.output import add_json_option, console_for, write_json
from remat.core.errors import UsageError

if TYPE_CHECKING:
    from torch import nn

    from remat.core.plan_format import Plan
    from remat.verification.verify_report import Hazard, VerifyReport

#: The seeds --seed takes: torch's 64-bit range, less the steps added to it per step.
SEEDS = (-(2**63), 2**63 - 1 - 10_000)
PLAN_BUILDERS = "none, per-stage, every:K, segments[:K], groups:SIZE, selective[:POLICY]"


def add_parser(sub: Any, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(
        name,
        help="prove a plan changes memory and time only: gradients, steps, rebuilt values, hazards",
        description=(
            "Train a plain copy and a copy with the plan from one state and compare the loss, "
            "input and parameter gradients, one SGD and one AdamW step and a short trajectory; "
            "check every rebuilt tensor against its forward fingerprint and look for hazards "
            "(randomness, mutated buffers, in-place changes, control flow, side effects). "
            "Exits 0 only when equivalent and hazard-free, 1 otherwise."
        ),
    )
    add_model_options(p)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--plan", metavar="PLAN",
        help=f"a plan JSON file, or a builder: {PLAN_BUILDERS}",
    )
    which.add_argument(
        "--budget", metavar="B",
        help="profile and plan under this memory budget first: bytes (6GiB) or a fraction of "
        "the peak without checkpointing (50%%, 0.5)",
    )
    p.add_argument(
        "--force-plan", action="store_true",
        help="apply a plan file even when its stages differ from the model's (it was made "
        "for another model)",
    )
    p.add_argument("--steps", type=int, default=3,
                   help="training steps per copy (default 3, at most 10000)")
    add_optimizer_option(
        p, help="optimizer of the trajectory and of the profile for --budget (default adamw)")
    p.add_argument(
        "--tolerance", default="auto",
        help="auto (by dtype), exact, or a number used as rtol and atol (default auto)",
    )
    p.add_argument("--seed", type=int, default=0,
                   help="seed of every step's RNG (default 0; a 64-bit integer)")
    p.add_argument(
        "--no-preserve-rng-state", action="store_true",
        help="debugging: apply the plan with RNG preservation off (rebuilds draw other "
        "dropout masks), to see verify catch it",
    )
    add_json_option(p)
    p.set_defaults(run=run)
    return p


def _whole(text: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        name = what.partition(":")[0]
        example = {"groups": "groups:2", "segments": "segments:3"}.get(name, f"{name}:2")
        raise UsageError(
            f"{what} {text!r} is not a whole number; write e.g. {example}"
        ) from None
    return value


def _plan_set_file(text: str | None) -> Any:
    """The plan set in ``text``'s file, or None where it names no plan-set file."""
    if text is None or not Path(text).is_file():
        return None
    from remat.core.artifact import loads
    from remat.core.plan_set import PlanSet

    try:
        data = loads(Path(text).read_text(encoding="utf-8"), f"the plan {text!r}")
    except (OSError, UnicodeDecodeError):
        return None  # Plan.load names what is wrong with the file
    return PlanSet.from_dict(data) if isinstance(data, dict) and "buckets" in data else None


def _verify_plan_set(args: argparse.Namespace, model: nn.Module, batch: Any, loss_fn: Any,
                     plan_set: Any) -> int:
    """Each plan of a plan set verified at the largest shape of its bucket
    (docs/shapes.md)."""
    from remat.profiling.shaped import batch_axes, resize
    from remat.verification.harness import verify

    dims = plan_set.dims
    axes = batch_axes(batch, dims)
    console = console_for(args.json)
    rows, ok = [], True
    for k, plan in enumerate(plan_set.plans):
        shape = plan_set.ends(k)[1]
        sized = resize(batch, axes, dict(zip(dims.names, shape, strict=True)))
        report = verify(model, sized, plan, loss_fn, steps=args.steps,
                        optimizer=args.optimizer, tolerance=args.tolerance, seed=args.seed,
                        preserve_rng_state=not args.no_preserve_rng_state,
                        force=args.force_plan)
        failed = [c.name for c in report.checks if not c.passed] + [
            h.kind for h in report.blocking_hazards]
        ok = ok and report.ok
        console.print(f"plan {k} at {dims.shape_text(shape)}: "
                      + ("verify OK" if report.ok else f"verify FAILED: {', '.join(failed)}"))
        rows.append({"plan": k, "shape": list(shape), "ok": report.ok, "failed": failed})
    console.print(f"{'every' if ok else 'not every'} plan of the set verified at the largest "
                  f"shape of its bucket ({len(rows)} plans over {dims})")
    write_json({"plan_set": True, "ok": ok, "plans": rows}, args.json)
    return 0 if ok else 1


def build_plan(text: str, model: nn.Module, stages: list[str] | None = None) -> Plan:
    """A plan from a JSON file or a builder name (``per-stage``, ``segments:3``, ...)."""
    import remat.plans as plans
    from remat.core.plan_format import Plan

    name, _, arg = text.partition(":")
    if name == "none" and not arg:
        return plans.none(model, stages=stages)
    if name == "per-stage" and not arg:
        return plans.per_stage(model, stages=stages)
    if name == "every" and arg:
        return plans.every(model, _whole(arg, "every:K"), stages=stages)
    if name == "segments":
        return plans.segments(model, _whole(arg, "segments:K") if arg else None, stages=stages)
    if name == "groups" and arg:
        return plans.uniform_groups(model, _whole(arg, "groups:SIZE"), stages=stages)
    if name == "selective":
        return plans.selective(model, arg or "save-matmuls", stages=stages)
    path = Path(text)
    if path.suffix == ".json" or path.exists():
        return Plan.load(path)
    raise UsageError(
        f"--plan {text!r} is neither a plan file nor a builder; give a .json path or one of "
        f"{PLAN_BUILDERS}"
    )


def _plan_for_budget(
    args: argparse.Namespace, model: nn.Module, batch: Any, loss_fn: Any,
    stages: list[str] | None, description: str,
) -> Plan:
    import copy

    from remat.core.planner import plan as make_plan

    # Profiling trains the model it measures; verify must start from the untouched state.
    profile = profile_with_progress(
        copy.deepcopy(model), batch, loss_fn, stages,
        optimizer=args.optimizer, description=description, malloc=args.malloc,
    )
    return make_plan(profile, args.budget)


def _error(value: float | None) -> str:
    return "" if value is None else f"{value:.2g}"


def render(report: VerifyReport, console: Any) -> None:
    """The checks table, one line per hazard found, where it diverged, and the verdict."""
    table = Table(title="checks", title_justify="left")
    for column in ("check", "result", "abs err", "rel err", "detail"):
        table.add_column(column, justify="right" if column.endswith("err") else "left")
    styles = {"pass": "green", "skip": "dim", "fail": "bold red", "error": "bold red"}
    for c in report.checks:
        table.add_row(
            c.name, Text(c.status.upper(), style=styles[c.status]),
            _error(c.max_abs_error), _error(c.max_rel_error), c.message,
        )
    console.print(table)
    groups: dict[tuple[str, bool, tuple[str, ...]], list[Hazard]] = {}
    for h in report.hazards:  # one line per kind of finding, not one per stage
        groups.setdefault((h.kind, h.covered, h.details), []).append(h)
    for (kind, covered, _), hazards in groups.items():
        line = Text("note " if covered else "HAZARD ", style="dim" if covered else "bold red")
        first = hazards[0]
        where = f" {first.stage} {first.region or ''}".rstrip() if first.stage else ""
        line.append(f"{kind}{where} (x{first.count}): ", style="bold")
        line.append(first.message)
        if len(hazards) > 1:
            others = ", ".join(h.stage or "?" for h in hazards[1:])
            line.append(f"; the same in {others}")
        console.print(line)
    d = report.first_divergence
    if d is not None and d.quantity == "rebuilt-value":
        console.print(f"first divergence: {d.message}")
    elif d is not None:
        where = f"stage {d.stage!r}" if d.stage is not None else "outside the stages"
        console.print(
            f"first divergence: {where}, {d.quantity} {d.tensor!r}: max abs error "
            f"{d.max_abs_error:.3g}, relative {d.max_rel_error:.3g}; {d.message}"
        )
    first_mismatch = report.value_check.first if report.value_check is not None else None
    if first_mismatch is not None and (d is None or d.quantity != "rebuilt-value"):
        console.print(f"first rebuilt mismatch: {first_mismatch.message}")
    blocking = len(report.blocking_hazards)
    if report.ok:
        verdict = Text("OK: equivalent and hazard-free", style="bold green")
    else:
        failed = sum(not c.passed for c in report.checks)
        verdict = Text(
            f"FAILED: {failed} check(s) failed, {blocking} hazard(s) found", style="bold red"
        )
    verdict.append(
        f" ({report.steps} step(s), {report.optimizer}, tolerance {report.tolerance}, "
        f"{report.elapsed_s:.1f} s)",
        style="default",
    )
    console.print(verdict)


def run(args: argparse.Namespace) -> int:
    # Imported here so building the parser for other subcommands never imports torch.
    import copy

    from remat.benchmarking.stopping import first_step
    from remat.cli.common import model_options
    from remat.runtime.identity import plan_notes
    from remat.verification.harness import verify

    if args.steps < 1:
        raise UsageError(f"--steps {args.steps} is below 1; give at least one step")
    if not SEEDS[0] <= args.seed <= SEEDS[1]:
        raise UsageError(f"--seed {args.seed} does not fit torch's 64-bit seeds with a step "
                         "added to it; give a whole number from -2**63 to 2**63-10001, e.g. "
                         "--seed 0")
    if args.budget is not None:
        from remat.core.solve.budget import Budget

        args.budget = Budget.parse(args.budget)  # before profiling, which takes a while
    model, batch, loss_fn, stages, description = load(args, check_step=False)
    # the user's own code fails here, named, on a copy: verify starts from the untouched model
    first_step(copy.deepcopy(model), batch, loss_fn)
    plan_set = _plan_set_file(args.plan)
    if plan_set is not None:
        return _verify_plan_set(args, model, batch, loss_fn, plan_set)
    if args.plan is not None:
        if stages is None and not Path(args.plan).exists():  # a builder: the whole chain
            from remat.runtime.stages import discover_stages

            stages = discover_stages(model, batch, loss_fn)
        plan = build_plan(args.plan, model, stages)
        source = args.plan
    else:
        plan = _plan_for_budget(args, model, batch, loss_fn, stages, description)
        source = f"budget {args.budget}"
    console = console_for(args.json)
    notes = plan_notes(model, plan, force=args.force_plan)  # a plan for another model stops here
    if plan.made_for is None and args.plan is not None:
        notes += (
            f"{args.plan} records no model identity (an older remat or a person wrote it), so "
            "its stages were not checked against this model",
        )
    for note in notes:
        console.print(f"note: {note}")
    with warnings.catch_warnings():
        for note in notes:  # shown above; apply would repeat them
            warnings.filterwarnings("ignore", message=re.escape(note))
        report = verify(
            model, batch, plan, loss_fn,
            steps=args.steps,
            optimizer=args.optimizer,
            tolerance=args.tolerance,
            seed=args.seed,
            preserve_rng_state=not args.no_preserve_rng_state,
            force=args.force_plan,
        )
    render(report, console)
    write_json(
        {
            "model": args.model, "options": model_options(args), "plan_source": source,
            **report.to_dict(),
        },
        args.json,
    )
    return 0 if report.ok else 1
