"""Pipeline ranks on gloo: each rank's peak against its prediction, per-rank plans
against one uniform plan.

Run under torchrun, one process per pipeline rank (repository root)::

    PYTHONPATH=src .venv/bin/torchrun --nproc-per-node 2 benchmarks/pipeline_ranks.py \\
        [--microbatches 4 8] [--schedules gpipe 1f1b interleaved-1f1b] [--chunks 2]
        [--rounds 6] [--out FILE]

The model is remat's gpt (8 blocks, hidden 64, sequence 32, batch 32), split evenly
over the ranks (``remat.models.gpt.GPTPart``), or under interleaved 1F1B over
ranks x ``--chunks`` virtual stages, chunk ``c`` of rank ``r`` being stage
``c * ranks + r``; AdamW over the rank's parts. Per schedule and micro-batch count:
every rank profiles its part on one micro-batch (``remat.parallel.pipeline.profile_part``), the
ranks share their problems, and three plans run: no checkpointing, every rank per-block
(the uniform setting users run today), and remat's per-rank plans
(``remat.core.pipeline.plan_pipeline``) at the per-rank budget the uniform plan needs
(its largest predicted rank peak, so the uniform plan fits). Each rank's peak is measured
by the live-storage tracker over ``schedule.step`` and the optimizer step. Then
``--rounds`` interleaved rounds time a step of the uniform plan and one of remat's (a
barrier before each; rank 0's wall time, which waits for the whole pipeline); the
figure is the median of the per-round ratios. Rank 0 prints every rank's figures and
writes them to ``--out`` (markdown) when given.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from remat.core.pipeline import SINGLE_STAGE, pipeline_step, plan_pipeline
from remat.core.plan_format import Plan, Region
from remat.core.planner import to_problem
from remat.core.solve.problem import Problem
from remat.models.gpt import GPTPart, gpt, logits_loss
from remat.parallel.pipeline import apply_to_stage, profile_part, rank_step_peak, schedule_buffers

OPTS = {"n_layer": 8, "n_embd": 64, "block_size": 32, "vocab_size": 128, "batch_size": 32,
        "dropout": 0.0}
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
             "interleaved-1f1b": ScheduleInterleaved1F1B}
MIB = 2**20
#: The uniform plan's budget is its largest predicted rank peak and this share more
#: (the peaks are measured within 3% of their prediction).
MARGIN = 0.05


class Runner:
    """One rank's parts (one per chunk) under their plans, in their stages and schedule."""

    def __init__(self, rank: int, world: int, schedule: str, micro: int, chunks: int,
                 plans: list[Plan] | None, idx: torch.Tensor, target: torch.Tensor) -> None:
        model = gpt(**OPTS)[0]
        ids = [c * world + rank for c in range(chunks)]
        self.parts = [GPTPart(model, s, world * chunks) for s in ids]
        for part, plan in zip(self.parts, plans or [], strict=False):
            apply_to_stage(part, plan)
        self.stages = [PipelineStage(part, s, world * chunks, torch.device("cpu"))
                       for s, part in zip(ids, self.parts, strict=True)]
        self.schedule = SCHEDULES[schedule](self.stages if chunks > 1 else self.stages[0],
                                            n_microbatches=micro, loss_fn=logits_loss)
        self.opt = torch.optim.AdamW([q for part in self.parts for q in part.parameters()],
                                     lr=1e-3)
        self.first, self.last = self.parts[0].first, self.parts[-1].last
        self.idx, self.target = idx, target

    def _train(self) -> None:
        """One training step: the schedule's step on this rank, then the optimizer's."""
        if self.first:
            self.schedule.step(self.idx)
        elif self.last:
            self.schedule.step(target=self.target, losses=[])
        else:
            self.schedule.step()
        self.opt.step()

    def _zero(self) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=True)

    def step(self) -> None:
        self._zero()
        self._train()

    def peak(self) -> int:
        self.step()  # allocates the receive buffers
        peak, _ = rank_step_peak(self._train, self.parts, self.stages, optimizer=self.opt,
                                 held=[self.idx] if self.first else [self.target])
        return peak


def _gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _timed(runner: Runner) -> float:
    dist.barrier()
    start = time.perf_counter()
    runner.step()
    return time.perf_counter() - start


def _label(plan: Plan) -> str:
    regions = " ".join(f"[{r.start},{r.stop})" for r in plan.regions) or "none"
    options = sorted({o for o in plan.options if o != "keep"})
    return regions + (f" + {', '.join(options)}" if options else "")


def run(schedule: str, micro: int, rounds: int, chunks: int) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    n = world * chunks
    model, (idx, target), _ = gpt(**OPTS)
    mb = OPTS["batch_size"] // micro
    mine = []  # this rank's chunks: (problem, buffers)
    for c in range(chunks):
        part = GPTPart(model, c * world + rank, n)
        torch.manual_seed(1)
        microbatch = (idx[:mb] if part.first else
                      torch.randn(mb, OPTS["block_size"], OPTS["n_embd"], requires_grad=True))
        names = tuple(f"blocks.{i}" for i in range(len(part.blocks)))
        prof = profile_part(part, microbatch, last=part.last, loss_fn=logits_loss,
                            target=target[:mb], stages=names, repeats=2)
        mine.append((to_problem(prof).to_dict(),
                     schedule_buffers(prof, part, microbatch, schedule=schedule,
                                      microbatches=micro, first=part.first, last=part.last)))
    shared = _gather(mine)
    # virtual stage s is chunk s // world of rank s % world
    problems = [Problem.from_dict(shared[s % world][s // world][0]) for s in range(n)]
    buffers = [shared[s % world][s // world][1] for s in range(n)]
    del model, part

    per_block = [Plan(p.stage_names, tuple(Region(i, i + 1) for i in range(p.n)))
                 for p in problems]
    none = [Plan(p.stage_names) for p in problems]
    uniform = pipeline_step(per_block, problems, schedule, micro, buffers=buffers,
                            chunks=chunks)
    plain = pipeline_step(none, problems, schedule, micro, buffers=buffers, chunks=chunks)
    # budgets where the uniform plan fits: with the margin its largest rank's peak is
    # measured within, and half-way to the least no-checkpointing rank peak
    tight = int(max(uniform.peaks) * (1 + MARGIN))
    budgets = [tight, (tight + min(plain.peaks)) // 2]

    rows: list[str] = []

    def label(plans: list[Plan], r: int) -> str:
        return " / ".join(_label(plans[c * world + r]) for c in range(chunks))

    def measured(name: str, plans: list[Plan], step: Any, budget: int | None) -> Runner:
        runner = Runner(rank, world, schedule, micro, chunks,
                        [plans[c * world + rank] for c in range(chunks)], idx, target)
        peaks = _gather(runner.peak())
        if rank == 0:
            for r in range(world):
                error = peaks[r] / step.peaks[r] - 1
                fits = ("-" if budget is None else
                        f"{budget / MIB:.3f} " + ("yes" if peaks[r] <= budget else "**no**"))
                rows.append(f"| {schedule} | {micro} | {name} | {r} | {label(plans, r)} | "
                            f"{step.in_flight[r]} | {step.peaks[r] / MIB:.3f} | "
                            f"{peaks[r] / MIB:.3f} | {error:+.1%} | {fits} |")
        return runner

    measured("none", none, plain, None)
    base = measured("per-block", per_block, uniform, tight)
    for budget in budgets:
        ours, predicted = plan_pipeline(problems, budget, schedule, micro, buffers=buffers,
                                        chunks=chunks)
        runner = measured(f"remat @ {budget / MIB:.2f} MiB", ours, predicted, budget)
        ratios = []
        for k in range(rounds):
            pair = (("per-block", base), ("remat", runner))
            took = {name: _timed(r) for name, r in (pair if k % 2 == 0 else pair[::-1])}
            ratios.append(took["remat"] / took["per-block"])
        if rank == 0:
            ratio = statistics.median(ratios)
            expected = predicted.step_s / uniform.step_s
            rows.append(f"| {schedule} | {micro} | time @ {budget / MIB:.2f} MiB | - | "
                        f"remat / per-block step | - | {expected:.3f} | {ratio:.3f} | "
                        f"{ratio / expected - 1:+.1%} | {rounds} rounds |")
    return rows


HEADER = ("| schedule | micro-batches | plan | rank | regions | in flight | predicted (MiB) "
          "| measured (MiB) | error | budget (MiB), fits |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES),
                        choices=list(SCHEDULES))
    parser.add_argument("--chunks", type=int, default=2,
                        help="stages per rank under interleaved-1f1b (default 2)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("run under torchrun, one process per pipeline rank (see --help)")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = []
    for schedule in args.schedules:
        for micro in args.microbatches:
            chunks = 1 if schedule in SINGLE_STAGE else args.chunks
            rows += run(schedule, micro, args.rounds, chunks)
            if dist.get_rank() == 0:
                print(f"{schedule} x {micro}: done", flush=True)
    if dist.get_rank() == 0:
        text = (f"{dist.get_world_size()} ranks, gloo, one torch thread each, torch "
                f"{torch.__version__}, started {began}; model gpt {OPTS}, AdamW; "
                f"interleaved-1f1b: {args.chunks} chunks per rank (regions per chunk).\n\n"
                + HEADER + "\n" + "\n".join(rows) + "\n")
        print("\n" + text)
        if args.out:
            Path(args.out).write_text(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
