"""Tensor and sequence parallelism on gloo: what each plan's rebuilds communicate again,
each rank's peak against its prediction, and the step time.

Run under torchrun, one process per tensor-parallel rank (repository root)::

    PYTHONPATH=src .venv/bin/torchrun --nproc-per-node 2 benchmarks/tp_collectives.py \\
        [--layers 4] [--dim 128] [--seq 64] [--batch 8] [--rounds 5] [--out FILE]

The model is ``remat.models.tp``'s decoder, parallelized the torchtitan way
(``remat.models.tp.parallelize``), with sequence parallelism (``sp``) and without
(``tp``). Per mode, every rank profiles the parallelized model (its own shard:
``remat.profile(..., ranks_agree=True)``), measures each stage's collectives
(``remat.parallel.tensor.stage_comms``), and runs: no checkpointing, per-stage regions,
two segments, ``selective:save-nothing`` and ``selective:save-collectives`` on every
stage, and remat's optimal plan half-way between the least peak and no checkpointing
(rank 0's, on every rank: ``agreed_plan``). For each: the collectives the rebuilds
issued again (``count_collectives``) against ``rebuilt_collectives``' prediction, each
rank's peak (the live-storage tracker over the step and the optimizer step) against the
simulator's, and the step time over ``--rounds`` interleaved rounds (rank 0's wall time
after a barrier), as the median ratio to no checkpointing.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import remat
from remat.core.collectives import rebuilt_collectives
from remat.core.plan_format import Plan, Region
from remat.core.planner import to_problem
from remat.core.solve import simulate, solvers
from remat.measure.tracker import LiveMemoryTracker
from remat.models.tp import parallelize, tp_transformer
from remat.parallel.tensor import agreed_plan, count_collectives, stage_comms

MIB = 2**20


def _loss(model: Any, batch: Any) -> torch.Tensor:
    tokens, target = batch
    return torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), target.flatten())


def _gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _label(plan: Plan) -> str:
    regions = " ".join(f"[{r.start},{r.stop})" for r in plan.regions) or "no regions"
    options = sorted({o for o in plan.options if o != "keep"})
    return regions + (f"; {', '.join(options)}" if options else "")


class Runner:
    def __init__(self, opts: dict[str, int], mesh: Any, sp: bool, plan: Plan) -> None:
        self.model, self.batch = tp_transformer(**opts)
        parallelize(self.model, mesh, sequence_parallel=sp)
        remat.apply(self.model, plan)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def step(self) -> None:
        self.model.zero_grad(set_to_none=True)
        _loss(self.model, self.batch).backward()
        self.opt.step()

    def peak(self) -> int:
        self.step()
        self.model.zero_grad(set_to_none=True)
        gc.collect()
        tracker = LiveMemoryTracker()
        tracker.register_existing(self.model)
        tracker.register_existing(self.opt)
        tracker.register_existing(list(self.batch))
        with tracker:
            _loss(self.model, self.batch).backward()
            self.opt.step()
        return tracker.peak_bytes

    def timed(self) -> float:
        dist.barrier()
        start = time.perf_counter()
        self.step()
        return time.perf_counter() - start


def run(opts: dict[str, int], mesh: Any, sp: bool, rounds: int) -> list[str]:
    names = tuple(f"layers.{i}" for i in range(opts["layers"]))
    n = len(names)
    model, batch = tp_transformer(**opts)
    parallelize(model, mesh, sequence_parallel=sp)
    comms = stage_comms(model, batch, _loss, names)
    prof = remat.profile(model, batch, _loss, stages=names, repeats=2, ranks_agree=True)
    problem = to_problem(prof)
    del model
    plans = {
        "none": Plan(names),
        "per-stage": Plan(names, tuple(Region(i, i + 1) for i in range(n))),
        "segments": Plan(names, (Region(0, n // 2), Region(n // 2, n))),
        "save-nothing": Plan(names, (), ("selective:save-nothing",) * n),
        "save-collectives": Plan(names, (), ("selective:save-collectives",) * n),
    }
    least = solvers.minimum_budget(problem)
    budget = (least + simulate(plans["none"], problem).peak_bytes) // 2
    plans["optimal"] = agreed_plan(remat.plan(prof, budget))
    runners = {}
    rows = []
    mode = "sp" if sp else "tp"
    for name, plan in plans.items():
        runner = Runner(opts, mesh, sp, plan)
        remat.remove(runner.model)  # counted on a fresh step with the plan applied again
        remat.apply(runner.model, plan)
        count = count_collectives(runner.model, runner.batch, _loss, names)
        predicted = rebuilt_collectives(plan, comms)
        agree = [[c.op for c in count.stages[s].rebuild] for s in names] == [
            [op for op, _ in calls] for calls in predicted]
        peaks = _gather((runner.peak(), simulate(plan, problem).peak_bytes))
        runners[name] = runner
        if dist.get_rank() == 0:
            peak_text = " ".join(f"{m / MIB:.2f}/{p / MIB:.2f} ({m / p - 1:+.1%})"
                                 for m, p in peaks)
            rows.append([mode, name, _label(plan), str(count.rebuilt),
                         f"{count.rebuilt_bytes / MIB:.3f}",
                         str(sum(len(c) for c in predicted)), "yes" if agree else "**no**",
                         peak_text])
    times: dict[str, list[float]] = {name: [] for name in plans}
    for k in range(rounds):
        order = list(plans) if k % 2 == 0 else list(plans)[::-1]
        for name in order:
            times[name].append(runners[name].timed())
    for row, name in zip(rows, plans, strict=False):
        ratios = [t / base for t, base in zip(times[name], times["none"], strict=True)]
        row.append(f"{statistics.median(ratios):.2f}")
    return [f"| {' | '.join(row)} |" for row in rows]


HEADER = ("| mode | plan | regions; options | rebuild collectives | rebuild MiB | predicted "
          "| same ops | per rank: measured/predicted peak MiB | step / none |\n"
          "|---|---|---|---|---|---|---|---|---|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 4), ("dim", 128), ("seq", 64), ("batch", 8),
                          ("rounds", 5)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("run under torchrun, one process per tensor-parallel rank (see --help)")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    opts = {"layers": args.layers, "dim": args.dim, "seq": args.seq, "batch": args.batch}
    began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = run(opts, mesh, True, args.rounds) + run(opts, mesh, False, args.rounds)
    if dist.get_rank() == 0:
        text = (f"{dist.get_world_size()} ranks, gloo, one torch thread each, torch "
                f"{torch.__version__}, started {began}; remat.models.tp {opts}, AdamW; "
                f"{args.rounds} rounds.\n\n" + HEADER + "\n" + "\n".join(rows) + "\n")
        print("\n" + text)
        if args.out:
            Path(args.out).write_text(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
