"""remat on torch.distributed.pipelining stages (remat.pipelining), 2 gloo ranks.

One launch runs GPipe and 1F1B over 4 micro-batches, with no plan and with per-block
regions applied to each rank's half of a small GPT; every rank's peak, measured by the
live-storage tracker over the schedule's step and the optimizer step, is compared with
remat.core.pipeline's prediction from the rank's own profile, and the losses with the
same model run whole in one process.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

WORLD = 2
MICRO = 4
OPTS = {"n_layer": 4, "n_embd": 64, "block_size": 32, "vocab_size": 128, "batch_size": 32,
        "dropout": 0.0}


class _Half(nn.Module):
    """A manual split of remat's gpt: the first rank embeds, the last normalises and
    projects (the torchtitan way: each rank keeps its own modules)."""

    def __init__(self, model: nn.Module, rank: int) -> None:
        super().__init__()
        per = len(model.blocks) // WORLD
        self.first, self.last = rank == 0, rank == WORLD - 1
        if self.first:
            self.wte, self.wpe = model.wte, model.wpe
        self.blocks = nn.ModuleList(model.blocks[rank * per:(rank + 1) * per])
        if self.last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.size(-1)), target.reshape(-1))


def _rank(rank: int, store: str, out: str) -> None:
    import gc

    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from remat.core.pipeline import pipeline_step
    from remat.core.plan_format import Plan, Region
    from remat.core.planner import to_problem
    from remat.core.solve.problem import Problem
    from remat.measure.tracker import LiveMemoryTracker
    from remat.models.gpt import gpt
    from remat.pipelining import apply_to_stage, profile_part, schedule_buffers
    from remat.runtime.install import remove

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD)
    results = []
    for schedule_name, schedule_class in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        for planned in (False, True):
            model, (idx, target), _ = gpt(**OPTS)
            part = _Half(model, rank)
            first, last = part.first, part.last
            mb = OPTS["batch_size"] // MICRO
            torch.manual_seed(1)
            micro = idx[:mb] if first else torch.randn(mb, OPTS["block_size"], OPTS["n_embd"],
                                                       requires_grad=True)
            names = tuple(f"blocks.{i}" for i in range(len(part.blocks)))
            prof = profile_part(part, micro, last=last, loss_fn=_loss, target=target[:mb],
                                stages=names, repeats=1)
            plan = (Plan(names, tuple(Region(i, i + 1) for i in range(len(names))))
                    if planned else Plan(names))
            buffers = schedule_buffers(part, micro, first=first, last=last)
            every = [None] * WORLD
            dist.all_gather_object(every, buffers)
            problem = to_problem(prof)
            shared: list[Any] = [None] * WORLD
            dist.all_gather_object(shared, problem.to_dict())
            problems = [Problem.from_dict(d) for d in shared]
            predicted = pipeline_step([plan] * WORLD, problems, schedule_name, MICRO,
                                      buffers=every).peaks[rank]
            # a fresh copy runs: profiling took optimizer steps on the first
            part = _Half(gpt(**OPTS)[0], rank)
            stage = PipelineStage(part, rank, WORLD, torch.device("cpu"))
            handle = apply_to_stage(stage, plan) if planned else None
            schedule = schedule_class(stage, n_microbatches=MICRO, loss_fn=_loss)
            opt = torch.optim.AdamW(part.parameters(), lr=1e-3)

            def step(schedule: Any = schedule, first: bool = first, idx: Any = idx,
                     target: Any = target) -> list[torch.Tensor]:
                losses: list[torch.Tensor] = []
                if first:
                    schedule.step(idx)
                else:
                    schedule.step(target=target, losses=losses)
                return losses

            first_losses = step()
            opt.step()
            part.zero_grad(set_to_none=True)
            gc.collect()
            tracker = LiveMemoryTracker()
            tracker.register_existing(part)
            tracker.register_existing(opt)
            tracker.register_existing([idx] if first else [target])
            with tracker:
                losses = step()
                opt.step()
            results.append({"schedule": schedule_name, "planned": planned,
                            "measured": tracker.peak_bytes, "predicted": predicted,
                            "losses": [float(x) for x in first_losses],
                            "measured_losses": len(losses)})
            if handle is not None:
                remove(part)
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("pipelining")
    with tempfile.TemporaryDirectory() as rendezvous:
        mp.spawn(_rank, args=(os.path.join(rendezvous, "store"), str(out)), nprocs=WORLD)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_every_ranks_peak_is_predicted_within_5_percent(
        ranks: list[list[dict[str, Any]]]) -> None:
    for r, rows in enumerate(ranks):
        for row in rows:
            error = row["measured"] / row["predicted"] - 1
            assert abs(error) <= 0.05, (r, row, f"{error:+.1%}")


def test_per_block_regions_lower_every_ranks_peak(ranks: list[list[dict[str, Any]]]) -> None:
    for rows in ranks:
        for schedule in ("gpipe", "1f1b"):
            plain, planned = (next(x for x in rows if x["schedule"] == schedule
                                   and x["planned"] == p) for p in (False, True))
            assert planned["measured"] < 0.8 * plain["measured"]


def test_the_pipeline_trains_the_loss_of_the_whole_model(
        ranks: list[list[dict[str, Any]]]) -> None:
    from remat.models.gpt import gpt

    model, (idx, target), _ = gpt(**OPTS)
    mb = OPTS["batch_size"] // MICRO
    # the first step's loss of each micro-batch, as the last rank saw them
    with torch.no_grad():
        expected = [float(_loss(model(idx[i * mb:(i + 1) * mb]), target[i * mb:(i + 1) * mb]))
                    for i in range(MICRO)]
    for row in ranks[-1]:
        assert row["losses"] == pytest.approx(expected, rel=1e-5), row["schedule"]
        assert row["measured_losses"] == MICRO
