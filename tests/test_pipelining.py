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
from torch import nn

from remat.models.gpt import GPTPart, logits_loss

WORLD = 2
MICRO = 4
OPTS = {"n_layer": 4, "n_embd": 64, "block_size": 32, "vocab_size": 128, "batch_size": 32,
        "dropout": 0.0}


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return logits_loss(out, target)


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
    from remat.pipelining import (
        apply_to_stage,
        profile_part,
        receive_buffers,
        schedule_buffers,
    )
    from remat.runtime.install import remove

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD)
    results = []
    for schedule_name, schedule_class in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        for planned in (False, True):
            model, (idx, target), _ = gpt(**OPTS)
            part = GPTPart(model, rank, WORLD)
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
            buffers = schedule_buffers(prof, part, micro, schedule=schedule_name,
                                       microbatches=MICRO, first=first, last=last)
            every = [None] * WORLD
            dist.all_gather_object(every, buffers)
            problem = to_problem(prof)
            shared: list[Any] = [None] * WORLD
            dist.all_gather_object(shared, problem.to_dict())
            problems = [Problem.from_dict(d) for d in shared]
            predicted = pipeline_step([plan] * WORLD, problems, schedule_name, MICRO,
                                      buffers=every).peaks[rank]
            # a fresh copy runs: profiling took optimizer steps on the first
            part = GPTPart(gpt(**OPTS)[0], rank, WORLD)
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
            torch.save({n: q.grad for n, q in part.named_parameters()},
                       Path(out, f"grads_{rank}_{schedule_name}_{int(planned)}.pt"))
            opt.step()
            part.zero_grad(set_to_none=True)
            gc.collect()
            tracker = LiveMemoryTracker()
            tracker.register_existing(part)
            tracker.register_existing(opt)
            tracker.register_existing([idx] if first else [target])
            tracker.register_existing(receive_buffers(stage))
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
def launched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("pipelining")
    with tempfile.TemporaryDirectory() as rendezvous:
        mp.spawn(_rank, args=(os.path.join(rendezvous, "store"), str(out)), nprocs=WORLD)
    return out


@pytest.fixture(scope="module")
def ranks(launched: Path) -> list[list[dict[str, Any]]]:
    return [json.loads((launched / f"rank{r}.json").read_text()) for r in range(WORLD)]


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


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("planned", [0, 1])
def test_the_ranks_gradients_are_the_whole_models(launched: Path, schedule: str,
                                                  planned: int) -> None:
    from remat.models.gpt import gpt

    model, (idx, target), _ = gpt(**OPTS)
    mb = OPTS["batch_size"] // MICRO
    # torch's schedules scale the gradients by 1 / micro-batches: the mean of their losses
    loss = sum(_loss(model(idx[i * mb:(i + 1) * mb]), target[i * mb:(i + 1) * mb])
               for i in range(MICRO)) / MICRO
    loss.backward()
    whole = {n: q.grad for n, q in model.named_parameters()}
    ranks = [torch.load(launched / f"grads_{r}_{schedule}_{planned}.pt") for r in range(WORLD)]
    per = OPTS["n_layer"] // WORLD
    seen = set()
    for r, grads in enumerate(ranks):
        for name, grad in grads.items():
            if name.startswith("blocks."):
                _, i, rest = name.split(".", 2)
                name = f"blocks.{r * per + int(i)}.{rest}"
            if name in ("wte.weight", "lm_head.weight"):
                continue  # one tied weight in the whole model, a copy on each end rank
            torch.testing.assert_close(grad, whole[name], rtol=1e-4, atol=1e-6, msg=name)
            seen.add(name)
    # the tied weight's gradient is the sum of its two copies'
    torch.testing.assert_close(ranks[0]["wte.weight"] + ranks[-1]["lm_head.weight"],
                               whole["wte.weight"], rtol=1e-4, atol=1e-6)
    assert seen | {"wte.weight"} == set(whole)


class _CheckpointedGPT(nn.Module):
    """gpt whose forward checkpoints every block itself (torch.utils.checkpoint), or
    calls them plainly (``own=False``)."""

    def __init__(self, model: nn.Module, own: bool = True) -> None:
        super().__init__()
        self.m = model
        self.own = own

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        m = self.m
        x = m.wte(idx) + m.wpe(torch.arange(idx.shape[1]))
        for block in m.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.own else block(x)
        return m.lm_head(m.ln_f(x))


def _scalar(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    out = model(batch)
    return (out[0] if isinstance(out, tuple) else out).float().pow(2).mean()


def test_checkpoint_calls_the_pipeline_export_dropped_are_named_and_a_plan_puts_them_back(
) -> None:
    from torch.distributed.pipelining import SplitPoint, pipeline

    from remat.core.plan_format import Plan, Region
    from remat.models.gpt import gpt
    from remat.pipelining import apply_to_stage, dropped_checkpoints
    from remat.runtime.existing import recomputed_stages
    from remat.runtime.install import remove

    model, (idx, _), _ = gpt(**{**OPTS, "batch_size": 2})
    net = _CheckpointedGPT(model)
    stages = [f"m.blocks.{i}" for i in range(OPTS["n_layer"])]
    pipe = pipeline(net, mb_args=(idx,), split_spec={"m.blocks.2": SplitPoint.BEGINNING})
    first = pipe.get_stage_module(0)
    assert dropped_checkpoints(net, idx, _scalar, first, stages) == ["m.blocks.0", "m.blocks.1"]
    assert recomputed_stages(first, idx, _scalar, ["m.blocks.0", "m.blocks.1"]) == []
    # the same model without its own checkpoint calls loses nothing
    plain = _CheckpointedGPT(gpt(**{**OPTS, "batch_size": 2})[0], own=False)
    plain_first = pipeline(plain, mb_args=(idx,),
                           split_spec={"m.blocks.2": SplitPoint.BEGINNING}).get_stage_module(0)
    assert dropped_checkpoints(plain, idx, _scalar, plain_first, stages) == []
    # remat's plan on the exported stage module rebuilds its blocks again
    plan = Plan(("m.blocks.0", "m.blocks.1"), (Region(0, 1), Region(1, 2)))
    apply_to_stage(first, plan)
    try:
        assert recomputed_stages(first, idx, _scalar, ["m.blocks.0", "m.blocks.1"]) == [
            "m.blocks.0", "m.blocks.1"]
    finally:
        remove(first)
