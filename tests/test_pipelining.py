"""remat on torch.distributed.pipelining stages (remat.parallel.pipeline), 2 gloo ranks.

One launch runs GPipe and 1F1B over 4 micro-batches, with no plan and with per-block
regions applied to each rank's half of a small GPT; every rank's peak, measured by the
live-storage tracker over the schedule's step and the optimizer step, is compared with
remat.core.pipeline's prediction from the rank's own profile, and the losses with the
same model run whole in one process. A second launch runs stages built by torch's
``pipeline()`` under 1F1B with per-block regions: gradients and peaks as above.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from conftest import launch_ranks, read_ranks
from remat.core.errors import UsageError
from remat.models.gpt import GPTPart, logits_loss

WORLD = 2
MICRO = 4
OPTS = {"n_layer": 4, "n_embd": 64, "block_size": 32, "vocab_size": 128, "batch_size": 32,
        "dropout": 0.0}


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return logits_loss(out, target)


#: (schedule, chunks per rank) the launch runs
CONFIGS = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2))


def _measured_step(step: Any, parts: list[nn.Module], stages: list[Any], opt: Any,
                   batch: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    """After a first ``step()`` and before the optimizer's step: that step, gradients
    cleared, then a second step and optimizer step under the live-storage tracker
    (:func:`remat.parallel.pipeline.rank_step_peak`); its peak and the losses it returned."""
    from remat.parallel.pipeline import rank_step_peak

    def step_and_update() -> list[torch.Tensor]:
        losses = step()
        opt.step()
        return losses

    opt.step()
    return rank_step_peak(step_and_update, parts, stages, held=[batch], optimizer=opt)


def _rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    from remat.core.pipeline import pipeline_step
    from remat.core.plan_format import Plan, Region
    from remat.core.planner import to_problem
    from remat.core.solve.problem import Problem
    from remat.models.gpt import gpt
    from remat.parallel.pipeline import apply_to_stage, profile_part, schedule_buffers
    from remat.runtime.install import remove

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD)
    classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
               "interleaved-1f1b": ScheduleInterleaved1F1B}
    results = []
    for schedule_name, chunks in CONFIGS:
        n = WORLD * chunks
        ids = [c * WORLD + rank for c in range(chunks)]  # this rank's virtual stages
        for planned in (False, True):
            model, (idx, target), _ = gpt(**OPTS)
            mb = OPTS["batch_size"] // MICRO
            plans, problems, buffers = [], [], []
            for s in ids:
                part = GPTPart(model, s, n)
                torch.manual_seed(1)
                micro = (idx[:mb] if part.first else
                         torch.randn(mb, OPTS["block_size"], OPTS["n_embd"], requires_grad=True))
                names = tuple(f"blocks.{i}" for i in range(len(part.blocks)))
                prof = profile_part(part, micro, last=part.last, loss_fn=_loss,
                                    target=target[:mb], stages=names, repeats=1)
                plans.append(Plan(names, tuple(Region(i, i + 1) for i in range(len(names))))
                             if planned else Plan(names))
                buffers.append(schedule_buffers(prof, part, micro, schedule=schedule_name,
                                                microbatches=MICRO, first=part.first,
                                                last=part.last))
                problems.append(to_problem(prof).to_dict())
            shared: list[Any] = [None] * WORLD
            dist.all_gather_object(shared, (plans, problems, buffers))
            # virtual stage s is chunk s // WORLD of rank s % WORLD
            every = [shared[s % WORLD] for s in range(n)]
            predicted = pipeline_step(
                [e[0][s // WORLD] for s, e in enumerate(every)],
                [Problem.from_dict(e[1][s // WORLD]) for s, e in enumerate(every)],
                schedule_name, MICRO, buffers=[e[2][s // WORLD] for s, e in enumerate(every)],
                chunks=chunks).peaks[rank]
            # a fresh copy runs: profiling took optimizer steps on the first
            model = gpt(**OPTS)[0]
            parts = [GPTPart(model, s, n) for s in ids]
            stages = [PipelineStage(part, s, n, torch.device("cpu"))
                      for s, part in zip(ids, parts, strict=True)]
            if planned:
                for stage, plan in zip(stages, plans, strict=True):
                    apply_to_stage(stage, plan)
            schedule = classes[schedule_name](stages if chunks > 1 else stages[0],
                                              n_microbatches=MICRO, loss_fn=_loss)
            opt = torch.optim.AdamW([q for part in parts for q in part.parameters()], lr=1e-3)
            first, last = parts[0].first, parts[-1].last

            def step(schedule: Any = schedule, first: bool = first, last: bool = last,
                     idx: Any = idx, target: Any = target) -> list[torch.Tensor]:
                losses: list[torch.Tensor] = []
                if first:
                    schedule.step(idx)
                elif last:
                    schedule.step(target=target, losses=losses)
                else:
                    schedule.step()
                return losses

            first_losses = step()
            torch.save({f"{s}.{name}": q.grad for s, part in zip(ids, parts, strict=True)
                        for name, q in part.named_parameters()},
                       Path(out, f"grads_{rank}_{schedule_name}_{int(planned)}.pt"))
            peak, losses = _measured_step(step, parts, stages, opt, idx if first else target)
            results.append({"schedule": schedule_name, "planned": planned,
                            "measured": peak, "predicted": predicted,
                            "losses": [float(x) for x in first_losses],
                            "measured_losses": len(losses)})
            if planned:
                for part in parts:
                    remove(part)
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launch_ranks(_rank, tmp_path_factory.mktemp("pipelining"), WORLD)


@pytest.fixture(scope="module")
def ranks(launched: Path) -> list[list[dict[str, Any]]]:
    return read_ranks(launched, WORLD)


def test_every_ranks_peak_is_predicted_within_5_percent(
        ranks: list[list[dict[str, Any]]]) -> None:
    for r, rows in enumerate(ranks):
        for row in rows:
            error = row["measured"] / row["predicted"] - 1
            assert abs(error) <= 0.05, (r, row, f"{error:+.1%}")


def test_per_block_regions_lower_every_ranks_peak(ranks: list[list[dict[str, Any]]]) -> None:
    for rows in ranks:
        for schedule, _ in CONFIGS:
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


def _whole_model_grads() -> dict[str, torch.Tensor]:
    """The gradients of the same model run whole in one process over the micro-batches
    (torch's schedules scale them by 1 / micro-batches: the mean of their losses)."""
    from remat.models.gpt import gpt

    model, (idx, target), _ = gpt(**OPTS)
    mb = OPTS["batch_size"] // MICRO
    loss = sum(_loss(model(idx[i * mb:(i + 1) * mb]), target[i * mb:(i + 1) * mb])
               for i in range(MICRO)) / MICRO
    loss.backward()
    return {n: q.grad for n, q in model.named_parameters()}


@pytest.mark.parametrize("schedule", [name for name, _ in CONFIGS])
@pytest.mark.parametrize("planned", [0, 1])
def test_the_ranks_gradients_are_the_whole_models(launched: Path, schedule: str,
                                                  planned: int) -> None:
    whole = _whole_model_grads()
    grads: dict[str, torch.Tensor] = {}  # "stage.name" over every rank's stages
    for r in range(WORLD):
        grads.update(torch.load(launched / f"grads_{r}_{schedule}_{planned}.pt"))
    per = OPTS["n_layer"] // (1 + max(int(k.split(".")[0]) for k in grads))
    seen = set()
    for key, grad in grads.items():
        stage, name = key.split(".", 1)
        if name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            name = f"blocks.{int(stage) * per + int(i)}.{rest}"
        if name in ("wte.weight", "lm_head.weight"):
            continue  # one tied weight in the whole model, a copy on each end stage
        torch.testing.assert_close(grad, whole[name], rtol=1e-4, atol=1e-6, msg=name)
        seen.add(name)
    # the tied weight's gradient is the sum of its two copies'
    last = max(k for k in grads if k.endswith("lm_head.weight"))
    torch.testing.assert_close(grads["0.wte.weight"] + grads[last],
                               whole["wte.weight"], rtol=1e-4, atol=1e-6)
    assert seen | {"wte.weight"} == set(whole)


@pytest.mark.parametrize(("ranks", "microbatches", "chunks"),
                         [(2, 4, 2), (2, 8, 4), (4, 8, 2), (4, 4, 3), (3, 6, 2), (4, 2, 2)])
def test_the_interleaved_order_is_torchs(ranks: int, microbatches: int, chunks: int) -> None:
    # remat.core.pipeline writes torch's ScheduleInterleaved1F1B order itself (torch-free);
    # torch's own, without its idle slots, for each rank (an instance without stages:
    # the order needs only these four counts)
    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    from remat.core.pipeline import schedule_order

    torch_schedule = object.__new__(ScheduleInterleaved1F1B)
    torch_schedule.pp_group_size = ranks
    torch_schedule.n_local_stages = chunks
    torch_schedule._n_microbatches = microbatches
    torch_schedule.microbatches_per_round = microbatches // max(1, microbatches // ranks)
    for rank in range(ranks):
        theirs = [("F" if a.computation_type.name == "FORWARD" else "B",
                   a.stage_index // ranks, a.microbatch_index)
                  for a in torch_schedule._calculate_single_rank_operations(rank)
                  if a is not None]
        assert schedule_order("interleaved-1f1b", rank, ranks, microbatches, chunks) == theirs


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
    from remat.parallel.pipeline import apply_to_stage, dropped_checkpoints
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


def _two_pass_step(planned: bool) -> tuple[int, dict[str, torch.Tensor], list[str]]:
    """One micro-batch on the second half of a gpt, its backward run as torch's
    zero-bubble schedules run it (their own two functions): the input's gradient first,
    the graph kept, then the weights' one parameter group at a time. Returns the
    tracker's peak, the gradients and remat's warnings."""
    import warnings

    from torch.distributed.pipelining._backward import (
        stage_backward_input,
        stage_backward_weight,
    )

    from remat.core.plan_format import Plan, Region
    from remat.measure.tracker import LiveMemoryTracker
    from remat.models.gpt import gpt
    from remat.runtime.install import apply, remove

    model, (_, target), _ = gpt(**{**OPTS, "batch_size": 8})
    part = GPTPart(model, 1, 2)
    names = tuple(f"blocks.{i}" for i in range(len(part.blocks)))
    if planned:
        apply(part, Plan(names, tuple(Region(i, i + 1) for i in range(len(names)))))
    torch.manual_seed(0)
    x = torch.randn(8, OPTS["block_size"], OPTS["n_embd"], requires_grad=True)
    params = list(part.parameters())
    tracker = LiveMemoryTracker()
    tracker.register_existing(part)
    tracker.register_existing([x, target])
    with warnings.catch_warnings(record=True) as caught, tracker:
        warnings.simplefilter("always")
        loss = _loss(part(x), target)
        _, groups = stage_backward_input([loss], None, [x], iter(params))
        del loss
        stage_backward_weight(iter(params), groups)
        del groups
    if planned:
        remove(part)
    named = {n: p.grad for n, p in part.named_parameters()} | {"x": x.grad}
    return tracker.peak_bytes, named, [str(w.message) for w in caught
                                       if str(w.message).startswith("remat:")]


def test_a_backward_in_passes_rebuilds_each_region_again_and_remat_says_so() -> None:
    # Note [Backward in passes]: torch's zero-bubble schedules run the input's gradient and
    # the weights' as separate passes; non-reentrant checkpoint rebuilds a region in each,
    # so regions there cost memory instead of saving it; remat warns once, names the
    # region and the schedules, and the gradients stay exact. pipeline_step refuses them
    # by name (remat.core.zero_bubble plans them from torch's order).
    from remat.core.pipeline import ZERO_BUBBLE, check_schedule

    plain_peak, plain, quiet = _two_pass_step(planned=False)
    peak, grads, said = _two_pass_step(planned=True)
    assert quiet == []
    assert len(said) == 1, said  # once per model
    assert re.match(r"remat: region blocks\.[01] was rebuilt a second time", said[0]), said
    assert "zero-bubble" in said[0]
    # measured: 9.5 MB against 4.6 MB, where one backward pass would be below the latter
    assert peak > 1.5 * plain_peak, (peak, plain_peak)
    for name, grad in plain.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)
    for schedule in ZERO_BUBBLE:
        with pytest.raises(UsageError, match=r"weight passes.*plan_split_pipeline"):
            check_schedule(schedule, 2, 4, 2)


def test_a_stage_built_by_pipeline_profiles_as_the_manual_split_and_keeps_its_prediction(
) -> None:
    # pipeline()'s exported stage modules keep the model's module paths: each profiles
    # (remat.parallel.pipeline.profile_part) to the bytes of the same blocks split by hand, and a
    # plan on the exported first stage measures the peak its profile predicts
    from torch.distributed.pipelining import SplitPoint, pipeline

    from remat.core.plan_format import Plan, Region
    from remat.core.planner import to_problem
    from remat.core.solve import simulate
    from remat.measure.step import measure_step
    from remat.models.gpt import gpt
    from remat.parallel.pipeline import apply_to_stage, part_loss, profile_part
    from remat.runtime.install import remove

    opts = {**OPTS, "batch_size": 8}
    model, (idx, target), _ = gpt(**opts)
    pipe = pipeline(_CheckpointedGPT(model, own=False), mb_args=(idx,),
                    split_spec={"m.blocks.2": SplitPoint.BEGINNING})
    x = torch.randn(8, OPTS["block_size"], OPTS["n_embd"], requires_grad=True)
    exported = [profile_part(pipe.get_stage_module(0), idx, last=False,
                             stages=("m.blocks.0", "m.blocks.1"), repeats=1),
                profile_part(pipe.get_stage_module(1), x, last=True, loss_fn=_loss,
                             target=target, stages=("m.blocks.2", "m.blocks.3"), repeats=1)]
    whole = gpt(**opts)[0]
    manual = [profile_part(GPTPart(whole, 0, 2), idx, last=False,
                           stages=("blocks.0", "blocks.1"), repeats=1),
              profile_part(GPTPart(whole, 1, 2), x, last=True, loss_fn=_loss, target=target,
                           stages=("blocks.0", "blocks.1"), repeats=1)]

    def figures(prof: Any) -> list[Any]:
        return [(s.boundary_bytes, s.output_bytes, dict(s.saved_bytes), s.grad_bytes)
                for s in prof.stages]

    for ours, theirs in zip(exported, manual, strict=True):
        assert figures(ours) == figures(theirs)
    first = pipe.get_stage_module(0)
    plan = Plan(("m.blocks.0", "m.blocks.1"), (Region(0, 1), Region(1, 2)))
    predicted = simulate(plan, to_problem(exported[0])).peak_bytes
    apply_to_stage(first, plan)
    try:
        measured = measure_step(first, idx, part_loss(first, idx, last=False)).peak_bytes
    finally:
        remove(first)
    assert measured == pytest.approx(predicted, rel=0.03)


def _built_rank(rank: int, store: str, out: str) -> None:
    # stages built by pipeline() and build_stage, per-block regions on each, under 1F1B
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    from remat.core.pipeline import pipeline_step
    from remat.core.plan_format import Plan, Region
    from remat.core.planner import to_problem
    from remat.core.solve.problem import Problem
    from remat.models.gpt import gpt
    from remat.parallel.pipeline import apply_to_stage, profile_part, schedule_buffers

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD)
    mb, half = OPTS["batch_size"] // MICRO, OPTS["n_layer"] // WORLD
    first, last = rank == 0, rank == WORLD - 1

    def built() -> tuple[Any, torch.Tensor, torch.Tensor]:
        model, (idx, target), _ = gpt(**OPTS)
        pipe = pipeline(_CheckpointedGPT(model, own=False), mb_args=(idx[:mb],),
                        split_spec={f"m.blocks.{half}": SplitPoint.BEGINNING})
        return pipe.build_stage(rank, torch.device("cpu")), idx, target

    stage, idx, target = built()
    names = tuple(f"m.blocks.{rank * half + i}" for i in range(half))
    plan = Plan(names, tuple(Region(i, i + 1) for i in range(half)))
    torch.manual_seed(1)
    micro = (idx[:mb] if first else
             torch.randn(mb, OPTS["block_size"], OPTS["n_embd"], requires_grad=True))
    prof = profile_part(stage.submod, micro, last=last, loss_fn=_loss, target=target[:mb],
                        stages=names, repeats=1)
    buffers = schedule_buffers(prof, stage.submod, micro, schedule="1f1b",
                               microbatches=MICRO, first=first, last=last)
    shared: list[Any] = [None] * WORLD
    dist.all_gather_object(shared, (plan, to_problem(prof).to_dict(), buffers))
    predicted = pipeline_step([s[0] for s in shared],
                              [Problem.from_dict(s[1]) for s in shared], "1f1b", MICRO,
                              buffers=[s[2] for s in shared]).peaks[rank]
    stage, idx, target = built()  # a fresh copy: profiling took optimizer steps
    apply_to_stage(stage, plan)
    schedule = Schedule1F1B(stage, n_microbatches=MICRO, loss_fn=_loss)
    opt = torch.optim.AdamW(stage.submod.parameters(), lr=1e-3)

    def step() -> list[torch.Tensor]:
        losses: list[torch.Tensor] = []
        if first:
            schedule.step(idx)
        else:
            schedule.step(target=target, losses=losses)
        return losses

    step()
    torch.save({name: q.grad for name, q in stage.submod.named_parameters()},
               Path(out, f"grads_{rank}.pt"))
    peak, _ = _measured_step(step, [stage.submod], [stage], opt, idx if first else target)
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"measured": peak, "predicted": predicted}))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launch_ranks(_built_rank, tmp_path_factory.mktemp("built"), WORLD)


def test_stages_built_by_pipeline_train_the_whole_models_gradients_under_a_plan(
        built: Path) -> None:
    whole = _whole_model_grads()
    tied = torch.zeros_like(whole["wte.weight"])  # the embedding and the head's copies
    seen = set()
    for r in range(WORLD):
        for key, grad in torch.load(built / f"grads_{r}.pt").items():
            name = key.removeprefix("m.")
            if name in ("wte.weight", "lm_head.weight"):
                if grad is not None:  # the first stage's copy of the head is unused
                    tied += grad
                continue
            torch.testing.assert_close(grad, whole[name], rtol=1e-4, atol=1e-6, msg=name)
            seen.add(name)
    torch.testing.assert_close(tied, whole["wte.weight"], rtol=1e-4, atol=1e-6)
    assert seen | {"wte.weight", "lm_head.weight"} >= set(whole)


def test_stages_built_by_pipeline_keep_each_ranks_predicted_peak(built: Path) -> None:
    for r, row in enumerate(read_ranks(built, WORLD)):
        error = row["measured"] / row["predicted"] - 1
        assert abs(error) <= 0.05, (r, row, f"{error:+.1%}")
