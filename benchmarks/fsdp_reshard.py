"""FSDP2 units kept gathered from a rebuild to their backward, or resharded and gathered
again: per-rank peaks, all-gathers and step times, predicted and measured (2 gloo ranks).

Issue 15 item 4 (Note [Resharding after a rebuild] in ``remat/core/solve/simulator.py``,
Note [Keep or reshard after a rebuild] in ``remat/core/solve/solvers.py``). Each run is
one fresh 2-process job per model; every block is an FSDP2 unit, then the root (the
common wrapping). The per-rank problem is built as ``remat bench --distributed fsdp``
builds it: memory from rank 0's profile of its shard, times from rank 0's profile of the
wrapped model, each unit's gather after a reshard timed (``rg.time_unit_gathers``).
Plans: one region over the blocks, ``[0,2) [2,4)``, and ``[0,4)`` holding both, each
kept and resharded; then ``optimal`` over a sweep of budgets, and where it reshards, the
budget where that gains most, its plan and the fastest plan keeping units there. Per
plan: both ranks' peak of one step (``rd.plan_rank_memory``), the backward's all-gathers
(``rg.count_all_gathers``), and the median of ``--rounds`` interleaved steps with the
overhead as the median of the per-round ratios to the step without a plan. Writes
``benchmarks/fsdp_reshard.md``.

Run from the repository root::

    PYTHONPATH=src .venv/bin/python benchmarks/fsdp_reshard.py [--runs 2] [--rounds 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from remat.benchmarking.bench_report import plan_summary
from remat.core.errors import CheckFailed
from remat.core.plan_format import Plan, Region
from remat.core.planner import to_problem
from remat.core.solve import simulate, solvers
from remat.core.transforms import per_rank_problem, with_times_of
from remat.parallel import data_parallel as rd
from remat.parallel import gathers as rg
from remat.parallel.ranks import rank_zeros

sys.path.insert(0, str(Path(__file__).parent))
from distributed_peaks import MODELS, WORLD, command_line, models_text
from distributed_time import interleaved_steps, paired_overhead, spawn, start_rank

COMMAND = "PYTHONPATH=src .venv/bin/python benchmarks/fsdp_reshard.py"
REGIONS = {
    "[0,4)": ((0, 4),),
    "[0,2) [2,4)": ((0, 2), (2, 4)),
    "[0,4) > [0,2) [2,4)": ((0, 4), (0, 2), (2, 4)),
}


SWEEP = 40  # budgets from the least peak to the peak without a plan


def _sweep(problem: Any) -> tuple[str, Plan | None, Plan | None]:
    """What ``optimal`` chose over the sweep's budgets, in words; the resharded plan at the
    budget where resharding gained most against the fastest plan keeping units, and that
    plan (None where no plan keeping units fits that budget)."""
    least = solvers.minimum_budget(problem)
    most = simulate(Plan(problem.stage_names), problem).peak_bytes
    solved = faster = only = 0
    best: tuple[float, Plan, Plan | None] | None = None
    for k in range(SWEEP):
        budget = least + (most - least) * k // (SWEEP - 1)
        try:
            plan = solvers.optimal(problem, budget)
        except CheckFailed:
            continue
        solved += 1
        if not plan.reshard_after_rebuild:
            continue
        try:
            kept: Plan | None = solvers.optimal(problem, budget, reshard_after_rebuild=False)
        except CheckFailed:
            kept = None
        if kept is None:
            only += 1
            gain = 0.0
        else:
            faster += 1
            assert kept.predicted_step_time_s and plan.predicted_step_time_s
            gain = kept.predicted_step_time_s - plan.predicted_step_time_s
        if best is None or gain > best[0] or (best[2] is None and kept is not None):
            best = (gain, plan, kept)
    words = (f"`optimal` solved {solved} of the sweep's {SWEEP} budgets and resharded at "
             f"{faster + only} ({faster} faster than the fastest plan keeping units, {only} "
             "where no plan keeping units fits)")
    return words, None if best is None else best[1], None if best is None else best[2]


def _plans(problem: Any) -> tuple[dict[str, Plan], str]:
    names = problem.stage_names
    out = {"none": Plan(names)}
    for label, regions in REGIONS.items():
        plan = Plan(names, tuple(Region(*r) for r in regions))
        out[f"{label} kept"] = plan
        out[f"{label} resharded"] = dataclasses.replace(plan, reshard_after_rebuild=True)
    note, chosen, kept = _sweep(problem)
    if chosen is not None:
        budget = f"{chosen.budget_bytes:,}"
        out[f"optimal at {budget}"] = chosen
        if kept is not None:
            out[f"optimal at {budget}, units kept"] = kept
        note += f"; measured at {budget} bytes, where resharding gained most"
    return out, note


def _rank(rank: int, path: str, out: str, model_name: str, rounds: int) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import remat
    from remat.measure.step import make_optimizer

    build, stages = start_rank(rank, path, model_name)

    def wrapped(plan: Plan) -> tuple[Any, Any, Any, Any]:
        model, batch, loss_fn = build()
        for name in stages:
            fully_shard(model.get_submodule(name))
        fully_shard(model)
        remat.apply(model, plan)
        return model, batch, loss_fn, make_optimizer(model, "adamw")

    try:
        model, batch, loss_fn = build()
        base = rank_zeros(to_problem(remat.profile(model, batch, loss_fn, stages=stages,
                                                   repeats=2)))
        bare = [rg.time_all_gather(s.grad_bytes) for s in base.stages]
        model, batch, loss_fn = build()
        timed = rank_zeros(to_problem(rd.profile_as_run(model, batch, loss_fn, wrap="fsdp",
                                                        stages=stages, repeats=2)))
        shared: list[Any] = [rg.time_unit_gathers(model, stages)]  # as remat bench does
        dist.broadcast_object_list(shared, src=0)
        gathers = shared[0]
        problem = per_rank_problem(base, world_size=WORLD, strategy="fsdp", gather_s=gathers)
        problem = with_times_of(problem, timed)
        plans, note = _plans(problem)
        peaks, counts = {}, {}
        for key, plan in plans.items():
            model, batch, loss_fn = build()
            peaks[key] = rd.plan_rank_peak(model, batch, loss_fn, plan, wrap="fsdp",
                                           stages=stages, group_regions=False)[0]
            m, b, lf, opt = wrapped(plan)
            lf(m, b).backward()
            opt.zero_grad(set_to_none=True)
            loss = lf(m, b)
            with rg.count_all_gathers() as backward:
                loss.backward()
            opt.zero_grad(set_to_none=True)
            counts[key] = backward.calls
        times = interleaved_steps({key: wrapped(plan) for key, plan in plans.items()}, rounds)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sims = {k: simulate(p, problem) for k, p in plans.items()}
    result = {
        "predicted_peak": {k: s.peak_bytes for k, s in sims.items()},
        "predicted_s": {k: s.step_time_s for k, s in sims.items()},
        "peak": peaks,
        "gathers": counts,
        "times": times,
        "gather_ms": [1e3 * g for g in gathers],
        "bare_ms": [1e3 * g for g in bare],
        "sweep": note,
        "plans": {k: _plan_text(p) for k, p in plans.items()},
    }
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


def measure(model_name: str, rounds: int) -> list[dict[str, Any]]:
    return spawn(_rank, model_name, rounds)


def _plan_text(plan: Plan) -> str:
    return (f"{plan_summary(plan).removesuffix('; FSDP units resharded after rebuilds')}; "
            f"{'resharded' if plan.reshard_after_rebuild else 'kept'}")


def _pairs(keys: list[str]) -> list[tuple[str, str]]:
    """(kept, resharded) row keys of the same regions."""
    out = [(k, k.replace(" kept", " resharded")) for k in keys
           if k.endswith(" kept") and k.replace(" kept", " resharded") in keys]
    out += [(k, k.removesuffix(", units kept")) for k in keys if k.endswith(", units kept")]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--out", default=str(Path(__file__).with_name("fsdp_reshard.md")))
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    began = time.perf_counter()
    rows = ["| model | run | plan | predicted peak | measured rank 0, 1 | backward all-gathers "
            "rank 0, 1 | predicted step (ms) | measured rank 0, 1 | predicted overhead "
            "| measured rank 0, 1 |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    notes: list[str] = []
    costs = ["| model | run | resharded plan | predicted (ms) | measured rank 0, 1 (ms) |",
             "|---|---|---|---|---|"]
    for model_name in args.models:
        for run in range(1, args.runs + 1):
            ranks = measure(model_name, args.rounds)
            r0 = ranks[0]
            ms = ", ".join(f"{g:.2f}" for g in r0["gather_ms"])
            bare = ", ".join(f"{g:.2f}" for g in r0["bare_ms"])
            notes.append(f"- {model_name}, run {run}: a block's unit gathered again "
                         f"(`rg.time_unit_gathers`) {ms} ms, a bare all-gather of its bytes "
                         f"(`rg.time_all_gather`) {bare} ms; {r0['sweep']}")
            for key, peak in r0["predicted_peak"].items():
                step = r0["predicted_s"][key]
                base = r0["predicted_s"]["none"]
                measured = [r["peak"][key] for r in ranks]
                medians = [statistics.median(r["times"][key]) for r in ranks]
                ovh = [paired_overhead(r["times"][key], r["times"]["none"]) for r in ranks]
                label = key if not key.startswith("optimal") else f"{key}: {r0['plans'][key]}"
                rows.append(
                    f"| {model_name} | {run} | {label} | {peak:,} | "
                    f"{measured[0]:,} ({measured[0] / peak - 1:+.2%}), "
                    f"{measured[1]:,} ({measured[1] / peak - 1:+.2%}) | "
                    f"{ranks[0]['gathers'][key]}, {ranks[1]['gathers'][key]} | "
                    f"{step * 1e3:.1f} | {medians[0] * 1e3:.1f}, {medians[1] * 1e3:.1f} | "
                    f"{100 * (step / base - 1):+.1f}% | {ovh[0]:+.1f}%, {ovh[1]:+.1f}% |")
                print(rows[-1], flush=True)
            for kept, resharded in _pairs(list(r0["predicted_s"])):
                predicted = 1e3 * (r0["predicted_s"][resharded] - r0["predicted_s"][kept])
                paired = [1e3 * statistics.median(
                    [a - b for a, b in zip(r["times"][resharded], r["times"][kept], strict=True)])
                    for r in ranks]
                costs.append(f"| {model_name} | {run} | {resharded} | {predicted:+.1f} | "
                             f"{paired[0]:+.1f}, {paired[1]:+.1f} |")
                print(costs[-1], flush=True)
            _write(args, rows, costs, notes, began)
    print(f"written to {args.out}")


def _write(args: argparse.Namespace, rows: list[str], costs: list[str], notes: list[str],
           began: float) -> None:
    lines = [
        "# FSDP2 units kept or resharded after a rebuild: predicted against measured",
        "",
        command_line(COMMAND, began) +
        f"torch {torch.__version__}, gloo, {WORLD} processes, one torch thread each, on a "
        f"2-core CPU shared with other jobs). Models: {models_text(args.models)}; AdamW; "
        f"`fully_shard` on every block, then the root. Each run is one fresh {WORLD}-process "
        f"job; {args.rounds} interleaved rounds after one warm-up, each starting one plan later "
        "than the one before; glibc keeps freed memory "
        "in each rank.",
        "",
        "Predicted: the simulator on the per-rank problem (memory from rank 0's profile of "
        "its shard, times from its profile of the wrapped model, each unit's gather after a "
        "reshard timed: `rg.time_unit_gathers`). `kept`: a region's units stay gathered from "
        "its rebuild to their backward (FSDP2's own behaviour); `resharded`: "
        "`Plan.reshard_after_rebuild`, each resharded after its call in the rebuild and "
        "gathered again for its backward. Measured: each rank's peak of one step "
        "(`rd.plan_rank_memory`), the backward's all-gathers, each rank's median step and "
        "the median of its per-round ratios to the step without a plan.",
        "",
        *rows,
        "",
        "What resharding costs a step: the predicted step of the resharded plan less the "
        "kept one's, against the median over the rounds of each rank's resharded step less "
        "its kept step in the same round.",
        "",
        *costs,
        "",
        f"The planner's choice: `optimal` solved at {SWEEP} budgets from the least peak any "
        "plan reaches to the peak without a plan; where it resharded, the budget where that "
        "gained most against the fastest plan keeping units (`optimal(..., "
        "reshard_after_rebuild=False)`) is measured above as two rows.",
        "",
        *notes,
        "",
    ]
    Path(args.out).write_text("\n".join(lines))


if __name__ == "__main__":
    main()
