"""DDP and FSDP2 with a plan on 2 gloo ranks of this CPU, against one process.

One launch of 2 ranks (``torch.multiprocessing.spawn``, a file rendezvous) runs every
distributed case and saves what it saw; the tests compare that with single-process
references. The reference of a step: each rank's shard of the global batch run as a
micro-batch from that rank's seed, gradients averaged (``loss / world`` accumulated), one
AdamW step: the full batch, with the same dropout masks the ranks draw.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import remat
from conftest import launch_ranks
from remat.core.errors import UsageError
from remat.core.plan_format import Plan, Region
from remat.core.planner import to_problem
from remat.core.solve import simulate
from remat.core.transforms import per_rank_problem
from remat.measure.step import make_optimizer
from remat.models import load_model
from remat.parallel import data_parallel as rd
from remat.parallel import gathers as rg
from remat.parallel.ranks import shard_batch

pytestmark = pytest.mark.distributed

WORLD = 2
STEPS = 3
GPT = dict(n_layer=4, n_embd=32, n_head=2, block_size=16, vocab_size=64, batch_size=8, dropout=0.1)
STAGES = tuple(f"blocks.{i}" for i in range(4))
#: Multi-stage regions, nested: [0, 4) holding [0, 2) and [2, 4).
NESTED = Plan(stages=STAGES, regions=(Region(0, 4), Region(0, 2), Region(2, 4)))
PER_STAGE = Plan(stages=STAGES, regions=tuple(Region(i, i + 1) for i in range(4)))
ONE_REGION = Plan(stages=STAGES, regions=(Region(0, 4),))
NONE = Plan(stages=STAGES)
#: Bigger blocks for the memory comparison (a few MiB per rank).
MEMORY_GPT = dict(GPT, n_embd=64, block_size=32, vocab_size=128)
#: Losses and parameters after 3 AdamW steps: float32 sums in another order only.
RTOL, ATOL = 1e-5, 1e-6
#: Standard wrapping against one process on the full batch: no dropout, so the ranks' step
#: is the full batch's step (test_reference_is_the_full_batch_without_dropout).
PLAIN_GPT = dict(GPT, dropout=0.0)
STANDARD_STEPS = 2
#: How each standard-wrapping case wraps: remat.apply after or before fully_shard, and
#: fully_shard's options for the blocks (the root keeps FSDP's default).
STANDARD = {
    "after": ("after", {}),
    "before": ("before", {}),
    "after_kept": ("after", {"reshard_after_forward": False}),
    "before_kept": ("before", {"reshard_after_forward": False}),
    "after_resharded": ("after", {}),
    "before_resharded": ("before", {}),
}
#: The nested plan with every unit a rebuild gathers resharded after its call (but the one
#: whose backward comes next), for the cases whose name says so.
NESTED_RESHARDED = dataclasses.replace(NESTED, reshard_after_rebuild=True)


def _seed(step: int, rank: int) -> None:
    torch.manual_seed(1000 * step + rank)


def _train(model: Any, batch: Any, loss_fn: Any, opt: Any, rank: int | None = None, *,
           steps: int = STEPS) -> list[float]:
    """The losses of ``steps`` training steps; each seeded for ``rank`` where one is given."""
    losses = []
    for step in range(steps):
        if rank is not None:
            _seed(step, rank)
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def _gathers(model: Any, batch: Any, loss_fn: Any) -> tuple[int, int]:
    """All-gathers in the forward and in the backward of one step (after a warm-up)."""
    loss_fn(model, batch).backward()
    model.zero_grad(set_to_none=True)
    with rg.count_all_gathers() as forward:
        loss = loss_fn(model, batch)
    with rg.count_all_gathers() as backward:
        loss.backward()
    model.zero_grad(set_to_none=True)
    return forward.calls, backward.calls


def _rank(rank: int, path: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=WORLD)
    result: dict[str, Any] = {}
    try:
        # DDP: the plan on the inner model, then the wrapper.
        model, batch, loss_fn = load_model("gpt", **GPT)
        batch = shard_batch(batch, rank, WORLD)
        remat.apply(model, NESTED)
        ddp = rd.wrap_ddp(model)
        result["ddp"] = (
            _train(ddp, batch, loss_fn, make_optimizer(model, "adamw"), rank),
            _full_params(model),
        )
        result["ddp_buckets"] = rd.ddp_bucket_bytes(ddp), rd.local_bytes(list(model.parameters()))
        # FSDP2: shard first (the stages of the multi-stage regions by their children).
        model, batch, loss_fn = load_model("gpt", **GPT)
        batch = shard_batch(batch, rank, WORLD)
        result["fsdp_units"] = rd.shard_stages(model, STAGES, NESTED)
        remat.apply(model, NESTED)
        result["fsdp"] = (
            _train(model, batch, loss_fn, make_optimizer(model, "adamw"), rank),
            _full_params(model),
        )
        # All-gathers, both wrap orders, with and without regions.
        for name, plan, unit_plan in (
            ("stage_unit_none", NONE, NONE),
            ("stage_unit_per_stage", PER_STAGE, PER_STAGE),  # (a) region inside the unit
            ("children_unit_none", NONE, ONE_REGION),
            ("children_unit_one_region", ONE_REGION, ONE_REGION),  # (b) units in the region
            ("children_unit_nested", NESTED, NESTED),
        ):
            model, batch, loss_fn = load_model("gpt", **GPT)
            rd.shard_stages(model, STAGES, unit_plan)
            remat.apply(model, plan)
            result[name] = _gathers(model, shard_batch(batch, rank, WORLD), loss_fn)
        dist.barrier()  # gloo can abort at exit when one rank tears down first
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


def _fully_shard_blocks(model: torch.nn.Module, mp_policy: Any = None, **options: Any) -> None:
    """The common FSDP2 set-up (torchtitan, accelerate): each block a unit, then the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = {"mp_policy": mp_policy or MixedPrecisionPolicy()}
    for name in STAGES:
        fully_shard(model.get_submodule(name), **options, **mp)
    fully_shard(model, **mp)


def _mixed_precision(rank: int) -> dict[str, Any]:
    """bfloat16 parameters in forward and backward (gradients reduced in float32), the
    standard wrapping without and with the nested plan."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    seen: dict[str, Any] = {}
    for name, plan in (("plain", None), ("nested", NESTED)):
        model, batch, loss_fn = load_model("gpt", **PLAIN_GPT)
        batch = shard_batch(batch, rank, WORLD)
        _fully_shard_blocks(model, policy)
        if plan is not None:
            remat.apply(model, plan)
        opt = make_optimizer(model, "adamw")
        seen[name] = (_train(model, batch, loss_fn, opt, steps=STANDARD_STEPS),
                      _full_params(model))
    return seen


class _Outer(torch.nn.Module):
    """A stage, then a module holding two more: ``fully_shard(inner)`` is a unit over two."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(8, 8)
        self.inner = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.first(x))


#: A region over ``first`` and the two stages of the unit ``inner``: it crosses the unit.
CROSSING = Plan(stages=("first", "inner.0", "inner.1"), regions=(Region(0, 3),))


def _hooks_and_forwards(model: torch.nn.Module) -> list[tuple[str, bool, int, int]]:
    return [
        (name, "forward" in m.__dict__, len(m._forward_pre_hooks), len(m._forward_hooks))
        for name, m in model.named_modules()
    ]


def _crossing_unit() -> dict[str, Any]:
    """The refused wrapping, both orders: the messages, and the model after remat.remove."""
    from torch.distributed.fsdp import fully_shard

    seen: dict[str, Any] = {}
    x = torch.randn(4, 8)
    model = _Outer()
    fully_shard(model.inner)
    fully_shard(model)
    before = _hooks_and_forwards(model)
    try:
        remat.apply(model, CROSSING)
    except UsageError as e:
        seen["after"] = str(e)
    seen["after_untouched"] = not remat.applied(model) and _hooks_and_forwards(model) == before
    model = _Outer()
    remat.apply(model, CROSSING)
    fully_shard(model.inner)
    fully_shard(model)
    try:
        model(x).sum().backward()
    except UsageError as e:
        seen["before"] = str(e)
    remat.remove(model)
    seen["before_removed"] = _hooks_and_forwards(model) == before
    model.reset_iter_state()  # FSDP's recovery after a forward that raised
    model(x).sum().backward()  # trains as FSDP alone
    seen["trains_after_remove"] = all(p.grad is not None for p in model.parameters())
    return seen


def _standard_rank(rank: int, path: str, out: str) -> None:
    """Standard wrapping with the nested plan, both orders: losses, parameters, collectives."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=WORLD)
    result: dict[str, Any] = {}
    try:
        for name, (order, options) in STANDARD.items():
            plan = NESTED_RESHARDED if name.endswith("_resharded") else NESTED
            model, batch, loss_fn = load_model("gpt", **PLAIN_GPT)
            batch = shard_batch(batch, rank, WORLD)
            if order == "before":
                handle = remat.apply(model, plan)
            _fully_shard_blocks(model, **options)
            if order == "after":
                handle = remat.apply(model, plan)
            opt = make_optimizer(model, "adamw")
            losses = []
            for _ in range(STANDARD_STEPS):  # the collectives of the last step are kept
                with rg.count_all_gathers() as forward:
                    loss = loss_fn(model, batch)
                with rg.count_all_gathers() as backward, rg.count_reduce_scatters() as scatters:
                    loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
            result[name] = {
                "losses": losses,
                "params": _full_params(model),
                "collectives": (forward.calls, backward.calls, scatters.calls),
                "rebuilds": handle.rebuilds,
            }
        result["crossing"] = _crossing_unit()
        result["mixed"] = _mixed_precision(rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


PEAK_PLANS = {"none": NONE, "per_stage": PER_STAGE,
              "segments": Plan(stages=STAGES, regions=(Region(0, 2), Region(2, 4))),
              "one_region_resharded": dataclasses.replace(ONE_REGION, reshard_after_rebuild=True)}


def _peak_rank(rank: int, path: str, out: str, wrap: str, name: str) -> None:
    """One per-rank peak, in a process that measures nothing else."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=WORLD)
    plan = PEAK_PLANS[name]
    try:
        model, batch, loss_fn = load_model("gpt", **MEMORY_GPT)
        batch = shard_batch(batch, rank, WORLD)
        # one unit per block, the common wrapping
        peak, resident = rd.plan_rank_peak(model, batch, loss_fn, plan, wrap=wrap, stages=STAGES,
                                           group_regions=False)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save({"peak": peak, "resident": resident}, os.path.join(out, f"rank{rank}.pt"))


def _timed_rank(rank: int, path: str, out: str, wrap: str) -> None:
    """This rank's profile of the wrapped model (rd.profile_as_run), with noisy rounds."""
    import torch.distributed as dist

    from remat.profiling import measurements

    torch.set_num_threads(1)
    # a rank left waiting in a collective fails after a minute instead of hanging the suite
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    try:
        # rank 1 asks for rounds, rank 0 for none: the rounds run must agree or the ranks'
        # collectives hang (the test's timeout ends it)
        measurements.PAIRED_SE = -1.0 if rank == 1 else 1e9
        model, batch, loss_fn = load_model("gpt", **GPT)
        batch = shard_batch(batch, rank, WORLD)
        prof = rd.profile_as_run(model, batch, loss_fn, wrap=wrap, stages=STAGES, repeats=1)
        gathers = rg.time_unit_gathers(model, STAGES) if wrap == "fsdp" else []
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save({"stages": prof.stage_names, "steps": len(prof.timed_rounds or ()),
                "fwd_s": [s.fwd_s for s in prof.stages], "gathers": gathers},
               os.path.join(out, f"rank{rank}.pt"))


def _spawn(fn: Any, *args: Any, tmp: Path) -> list[dict[str, Any]]:
    launch_ranks(fn, tmp, WORLD, *args)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def peaks(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], list[dict[str, Any]]]:
    return {
        (wrap, name): _spawn(_peak_rank, wrap, name, tmp=tmp_path_factory.mktemp(wrap + name))
        for wrap in ("fsdp",)
        for name in PEAK_PLANS
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn(_rank, tmp=tmp_path_factory.mktemp("ranks"))


@pytest.fixture(scope="module")
def standard(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn(_standard_rank, tmp=tmp_path_factory.mktemp("standard"))


def _full_batch(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the plain model, the whole global batch each step."""
    model, batch, loss_fn = load_model("gpt", **PLAIN_GPT)
    opt = make_optimizer(model, "adamw")
    losses = _train(model, batch, loss_fn, opt, steps=steps)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("case", list(STANDARD))
def test_standard_wrapping_with_nested_regions_trains_like_one_process(
    standard: list[dict[str, Any]], case: str
) -> None:
    """Each block its own FSDP2 unit inside regions [0,4) > [0,2), [2,4), the plan applied
    after fully_shard or before it, blocks resharded after forward or kept gathered: two
    AdamW steps equal one process on the full batch. Tolerance as for DDP above: the ranks'
    gradients are the full batch's summed in another order (each rank's half of the batch,
    then gloo's sum of the two), about one float32 rounding apart, and AdamW's first steps
    move every parameter by about lr whatever the gradient's size."""
    losses, params = _full_batch(STANDARD_STEPS)
    got = [standard[r][case] for r in range(WORLD)]
    # every rank's loss is the mean over its half of the tokens: their mean is the batch's
    mean = [sum(g["losses"][s] for g in got) / WORLD for s in range(STANDARD_STEPS)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(losses), rtol=RTOL, atol=ATOL)
    for r in range(WORLD):
        assert got[r]["rebuilds"] == STANDARD_STEPS * len(NESTED.regions)  # the regions ran
        assert got[r]["params"].keys() == params.keys()
        for name, value in params.items():
            torch.testing.assert_close(
                got[r]["params"][name], value, rtol=RTOL, atol=ATOL,
                msg=lambda m, n=name, k=r: f"{case} rank {k} {n}: {m}",
            )


def test_standard_wrapping_gathers_and_reduces_as_without_a_plan(
    standard: list[dict[str, Any]]
) -> None:
    """Per step: forward gathers the 4 block units and the root; backward gathers each
    block once (the rebuild of [0, 4) gathers blocks 0 to 2 and they stay gathered for
    their own backward; block 3 by its pre-backward hook), or never when blocks stay
    gathered after forward; every unit's gradients are reduce-scattered exactly once,
    though the rebuilds ran the blocks again (3 region rebuilds per step)."""
    for r in range(WORLD):
        for case in ("after", "before"):
            assert standard[r][case]["collectives"] == (5, 4, 5), case
        for case in ("after_kept", "before_kept"):
            assert standard[r][case]["collectives"] == (5, 0, 5), case


def test_resharding_after_rebuilds_gathers_each_resharded_unit_again(
    standard: list[dict[str, Any]]
) -> None:
    """Note [Resharding after a rebuild]: the nested plan's rebuilds reshard blocks 0, 1
    and 2 ([0, 4)), 0 ([0, 2)) and 2 ([2, 4)) after their calls, each gathered again for
    its backward: 4 + 5 all-gathers in backward, as the simulator counts; still one
    reduce-scatter per unit."""
    for r in range(WORLD):
        for case in ("after_resharded", "before_resharded"):
            assert standard[r][case]["collectives"] == (5, 9, 5), case


def test_mixed_precision_with_nested_regions_changes_nothing(
    standard: list[dict[str, Any]]
) -> None:
    """Under a bfloat16 policy FSDP casts each block's inputs in its pre-hook; the rebuild
    calls the block through that hook again, so it computes what forward computed: the
    same losses and parameters as the same wrapping without a plan, bit for bit."""
    for r in range(WORLD):
        (plain_losses, plain), (losses, got) = standard[r]["mixed"].values()
        assert losses == plain_losses
        assert all(torch.equal(got[k], v) for k, v in plain.items())


def test_a_region_crossing_a_unit_of_several_stages_is_refused(
    standard: list[dict[str, Any]]
) -> None:
    """fully_shard(model.inner) over two stages, a region over those and one before: at
    apply when the unit exists, else at the first forward; remove leaves FSDP alone."""
    for r in range(WORLD):
        seen = standard[r]["crossing"]
        for order in ("after", "before"):
            assert seen[order].startswith("region [0, 3) crosses the FSDP unit 'inner'")
            assert "'inner.0', 'inner.1'" in seen[order]
        assert seen["after_untouched"] and seen["before_removed"]
        assert seen["trains_after_remove"]


def _reference(plan: Plan | None = None, **options: Any) -> tuple[list[list[float]], dict]:
    """One process, the plain model (or ``plan``): per step, each rank's shard in turn."""
    model, batch, loss_fn = load_model("gpt", **{**GPT, **options})
    if plan is not None:
        remat.apply(model, plan)
    opt = make_optimizer(model, "adamw")
    shards = [shard_batch(batch, r, WORLD) for r in range(WORLD)]
    losses: list[list[float]] = [[] for _ in range(WORLD)]
    for step in range(STEPS):
        for r, shard in enumerate(shards):
            _seed(step, r)
            loss = loss_fn(model, shard)
            (loss / WORLD).backward()
            losses[r].append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_training_equals_one_process(ranks: list[dict[str, Any]], strategy: str) -> None:
    losses, params = _reference()
    for r in range(WORLD):
        got_losses, got_params = ranks[r][strategy]
        torch.testing.assert_close(
            torch.tensor(got_losses), torch.tensor(losses[r]), rtol=RTOL, atol=ATOL
        )
        assert got_params.keys() == params.keys()
        for name, value in params.items():
            torch.testing.assert_close(
                got_params[name],
                value,
                rtol=RTOL,
                atol=ATOL,
                msg=lambda m, n=name, k=r: f"{strategy} rank {k} {n}: {m}",
            )
    # dropout really is on: another seed gives another loss
    assert losses[0][0] != losses[1][0]


def test_reference_is_the_full_batch_without_dropout() -> None:
    """The shard-by-shard reference is one full-batch step when no randomness is drawn."""
    _, shards = _reference(dropout=0.0)
    model, batch, loss_fn = load_model("gpt", **{**GPT, "dropout": 0.0})
    opt = make_optimizer(model, "adamw")
    for _ in range(STEPS):
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(shards[name], value, rtol=RTOL, atol=ATOL)


def test_fsdp_units_follow_the_plan(ranks: list[dict[str, Any]]) -> None:
    # every stage is in a multi-stage region: its children are the unit
    assert ranks[0]["fsdp_units"] == [f"{s}.* (children as one unit)" for s in STAGES] + ["<root>"]


def test_all_gathers_for_both_wrap_orders(ranks: list[dict[str, Any]]) -> None:
    """One gather per unit in forward and one per stage unit in backward, whatever the order.

    4 stage units and the root: the root gathers in forward only (FSDP keeps the root
    gathered until backward ends). (a) a single-stage region inside each stage's unit
    rebuilds after the unit's pre-backward gather; (b) units inside a region [0, 4) (and
    nested regions) are gathered by the rebuild and stay gathered for their backward:
    with torch 2.13 no order gathers again.
    """
    for r in range(WORLD):
        got = ranks[r]
        assert got["stage_unit_none"] == (5, 4)
        assert got["stage_unit_per_stage"] == (5, 4)  # (a)
        assert got["children_unit_none"] == (5, 4)
        assert got["children_unit_one_region"] == (5, 4)  # (b)
        assert got["children_unit_nested"] == (5, 4)


def test_ddp_buckets_read_from_the_reducer_are_one_copy_of_the_gradients(
    ranks: list[dict[str, Any]],
) -> None:
    """What rank_step_memory counts for DDP between steps (gradient_as_bucket_view off)."""
    for r in range(WORLD):
        buckets, params = ranks[r]["ddp_buckets"]
        assert buckets == params > 0


def test_shard_stages_picks_the_stages_of_multi_stage_regions() -> None:
    """The stages shard_stages makes units by their children (Note [FSDP units and
    regions]): those inside a multi-stage region; no ranks needed."""
    assert rd._in_multi_stage_region(NESTED, STAGES) == set(STAGES)
    assert rd._in_multi_stage_region(PER_STAGE, STAGES) == set()


@pytest.fixture(scope="module")
def rank_problem() -> Any:
    model, batch, loss_fn = load_model("gpt", **MEMORY_GPT)
    return to_problem(remat.profile(model, shard_batch(batch, 0, WORLD), loss_fn, repeats=1))


def test_fsdp_sharding_and_regions_lower_the_measured_peak(
    peaks: dict[Any, Any], rank_problem: Any
) -> None:
    """Sharding and regions lower the measured peak (the prediction's accuracy: below)."""
    single = simulate(NONE, rank_problem).peak_bytes
    for r in range(WORLD):
        measured = peaks["fsdp", "none"][r]["peak"]
        assert measured < 0.9 * single  # sharding saved memory
        assert peaks["fsdp", "per_stage"][r]["peak"] < 0.9 * measured  # and regions more


@pytest.mark.parametrize("name", ["per_stage", "segments", "one_region_resharded"])
def test_per_rank_prediction_equals_the_measured_peak(
    peaks: dict[Any, Any], rank_problem: Any, name: str
) -> None:
    """FSDP2, one unit per block: the per-rank problem's predicted peak within 3% of each
    rank's measured one (every plan and both models: benchmarks/distributed_peaks.md)."""
    problem = per_rank_problem(rank_problem, world_size=WORLD, strategy="fsdp")
    predicted = simulate(PEAK_PLANS[name], problem).peak_bytes
    for r in range(WORLD):
        assert peaks["fsdp", name][r]["peak"] == pytest.approx(predicted, rel=0.03)


def _chain() -> Any:
    from remat.core.solve import Problem, StageCost

    stages = tuple(
        StageCost(
            f"s{i}",
            boundary_bytes=100,
            output_bytes=100,
            saved_bytes={"keep": 400},
            fwd_s=1.0,
            bwd_s=2.0,
            rebuild_s=1.0,
            grad_bytes=1000,
        )
        for i in range(4)
    )
    return Problem(
        stages=stages,
        params_bytes=4200,
        grads_bytes=4200,
        optimizer_state_bytes=8400,
        inputs_bytes=10,
        pre_chain_grads_bytes=100,
        post_chain_grads_bytes=100,
    )


def test_per_rank_problem_arithmetic() -> None:
    from remat.core.errors import UsageError

    base = _chain()
    fsdp = per_rank_problem(base, world_size=2, strategy="fsdp", replicated_bytes=0)
    assert fsdp.params_bytes == 2100 and fsdp.optimizer_state_bytes == 4200
    assert [s.grad_bytes for s in fsdp.stages] == [500] * 4
    # each stage a unit of its 1000 bytes, reduce-scattering 1000 bytes of gradients
    assert [(s.unit_bytes, s.reduce_bytes) for s in fsdp.stages] == [(1000, 1000)] * 4
    # the root's 200 bytes: gathered (unsharded) from its forward to the end of backward,
    # its gradients unsharded to then
    assert fsdp.root_unit_bytes == 200 and fsdp.pre_chain_bytes == 200
    assert fsdp.pre_chain_grads_bytes == fsdp.post_chain_grads_bytes == 100
    assert fsdp.grads_bytes == 4 * 500 + 200
    assert fsdp.collective_copies
    assert not per_rank_problem(base, world_size=2, strategy="fsdp",
                                backend="nccl").collective_copies
    # the transients are the stages' own: the simulator keeps the units
    assert [s.fwd_transient_bytes for s in fsdp.stages] == [0] * 4
    ddp = per_rank_problem(base, world_size=2, strategy="ddp")
    assert ddp.params_bytes == 4200 + 4200 and ddp.optimizer_state_bytes == 8400
    # a rebuild that gathers again costs its gather in every rebuild run
    plan = Plan(stages=base.stage_names, regions=(Region(0, 4),))
    slow = per_rank_problem(base, world_size=2, strategy="fsdp", gather_s=0.5, rebuild_gathers=1)
    fast = per_rank_problem(base, world_size=2, strategy="fsdp", gather_s=0.5)
    runs = sum(simulate(plan, fast).forward_runs) - base.n
    assert _step_s(plan, slow) - _step_s(plan, fast) == pytest.approx(0.5 * runs)
    assert _step_s(plan, fast) - _step_s(plan, base) == pytest.approx(4 * (0.5 + 0.5))
    with pytest.raises(UsageError, match="strategy"):
        per_rank_problem(base, world_size=2, strategy="zero3")
    with pytest.raises(UsageError, match="exceed params_bytes"):
        per_rank_problem(base, world_size=2, strategy="fsdp", replicated_bytes=1000)


@pytest.mark.parametrize("wrap", ["fsdp", "ddp"])
def test_the_wrapped_profile_runs_the_same_rounds_on_every_rank(tmp_path: Path,
                                                                 wrap: str) -> None:
    """Note [Per-rank time]: ranks whose steps communicate profile in step (ranks_agree)."""
    ranks = _spawn(_timed_rank, wrap, tmp=tmp_path)
    prefix = "module." if wrap == "ddp" else ""
    assert ranks[0]["stages"] == ranks[1]["stages"] == tuple(f"{prefix}{s}" for s in STAGES)
    assert ranks[0]["steps"] == ranks[1]["steps"] >= 2  # rank 1's added round, on both
    assert all(t > 0 for r in ranks for t in r["fwd_s"])
    if wrap == "fsdp":  # each block's gather after a reshard (rg.time_unit_gathers)
        assert all(len(r["gathers"]) == len(STAGES) and all(t > 0 for t in r["gathers"])
                   for r in ranks)


def test_with_times_of_takes_every_time_and_keeps_the_memory() -> None:
    from dataclasses import replace

    from remat.core.errors import UsageError
    from remat.core.transforms import with_times_of

    base = per_rank_problem(_chain(), world_size=2, strategy="fsdp")
    timed = replace(_chain(), outside_chain_s=0.25, region_overhead_s=0.125, stages=tuple(
        replace(s, fwd_s=1.0 + i, bwd_s=2.0 + i, rebuild_s=1.5 + i, name=f"module.{s.name}")
        for i, s in enumerate(_chain().stages)))
    both = with_times_of(base, timed)
    assert [(s.fwd_s, s.bwd_s, s.rebuild_s) for s in both.stages] == [
        (1.0 + i, 2.0 + i, 1.5 + i) for i in range(4)]
    assert (both.outside_chain_s, both.region_overhead_s) == (0.25, 0.125)
    assert replace(both, stages=base.stages, outside_chain_s=base.outside_chain_s,
                   region_overhead_s=base.region_overhead_s) == base  # memory untouched
    assert both.stage_names == base.stage_names
    with pytest.raises(UsageError, match="same chain"):
        with_times_of(base, replace(timed, stages=timed.stages[:3]))


def _step_s(plan: Plan, problem: Any) -> float:
    return simulate(plan, problem).step_time_s


def _unit_bytes_at(plan: Plan, label: str) -> int:
    """What the FSDP2 units add at the event ``label``: the per-rank problem against the
    same problem with its units taken away."""
    from dataclasses import replace

    fsdp = per_rank_problem(_chain(), world_size=2, strategy="fsdp", backend="nccl")
    bare = replace(fsdp, root_unit_bytes=0, stages=tuple(
        replace(s, unit_bytes=0, reduce_bytes=0) for s in fsdp.stages))
    with_units = dict(simulate(plan, fsdp).events)
    return with_units[label] - dict(simulate(plan, bare).events)[label]


def test_simulator_keeps_fsdp_units_as_fsdp2_does() -> None:
    """Note [FSDP2 units]: u = 1000 per stage, r = 1000 per reduce-scatter input."""
    # forward: the unit's flat all-gather buffer and its unsharded parameters
    assert _unit_bytes_at(NONE_CHAIN, "forward s1") == 2000
    # backward of the last stage: itself, and the one before it prefetched
    assert _unit_bytes_at(NONE_CHAIN, "backward s3") == 2000
    # further on, also the reduce-scatter input of the stage after it
    assert _unit_bytes_at(NONE_CHAIN, "backward s2") == 3000
    assert _unit_bytes_at(PER_STAGE_CHAIN, "backward s1") == 3000
    # a rebuild gathers the region's units, and they stay gathered to their backward
    assert _unit_bytes_at(ONE_REGION_CHAIN, "backward s2") == 4000
    assert _unit_bytes_at(ONE_REGION_CHAIN, "backward s3") == 4000
    # the first stage's backward: no unit before it to prefetch
    assert _unit_bytes_at(NONE_CHAIN, "backward s0") == 2000


def test_resharding_after_a_rebuild_frees_its_units_for_a_gather_each() -> None:
    """Note [Resharding after a rebuild]: the rebuild of [0, 4) reshards s0, s1 and s2
    after their calls (s3's backward is next), so s3's backward holds its own unit only,
    not all four, and each of the three pays one more all-gather."""
    resharded = dataclasses.replace(ONE_REGION_CHAIN, reshard_after_rebuild=True)
    assert _unit_bytes_at(ONE_REGION_CHAIN, "backward s3") == 4000
    assert _unit_bytes_at(resharded, "backward s3") == 1000
    # s2 gathered again by its pre-backward, s1 prefetched, s3's reduce-scatter input
    assert _unit_bytes_at(resharded, "backward s2") == 3000
    fsdp = per_rank_problem(_chain(), world_size=2, strategy="fsdp", gather_s=0.5)
    assert _step_s(resharded, fsdp) - _step_s(ONE_REGION_CHAIN, fsdp) == pytest.approx(3 * 0.5)
    # one-stage regions: the unit of each is the one whose backward comes next
    per_stage = dataclasses.replace(PER_STAGE_CHAIN, reshard_after_rebuild=True)
    assert simulate(per_stage, fsdp).live == simulate(PER_STAGE_CHAIN, fsdp).live
    assert _step_s(per_stage, fsdp) == _step_s(PER_STAGE_CHAIN, fsdp)


def test_the_optimal_plan_reshards_after_rebuilds_only_where_that_is_faster() -> None:
    """Note [Keep or reshard after a rebuild]: a budget that [0, 2) fits only with its
    unit resharded gets that plan (one gather more beats a second region's overhead);
    one that it fits kept gets it kept."""
    from remat.core.solve import solve, solvers

    base = _chain()
    base = dataclasses.replace(base, region_overhead_s=3.0, stages=tuple(
        dataclasses.replace(s, saved_bytes={"keep": 3000}) for s in base.stages))
    fsdp = per_rank_problem(base, world_size=2, strategy="fsdp", backend="nccl", gather_s=0.5)
    first_two = Plan(stages=fsdp.stage_names, regions=(Region(0, 2),))
    kept = simulate(first_two, fsdp)
    resharded = simulate(dataclasses.replace(first_two, reshard_after_rebuild=True), fsdp)
    assert resharded.peak_bytes < kept.peak_bytes  # 16,010 against 17,010 bytes
    tight = solve("optimal", fsdp, resharded.peak_bytes)
    assert (tight.regions, tight.reshard_after_rebuild) == ((Region(0, 2),), True)
    assert tight.predicted_step_time_s == pytest.approx(resharded.step_time_s)
    # further from that peak the tables' first plan overshoots (they do not count units)
    # and the overshoot taken off whole lands on a slower plan; the bisection after it
    # (Note [Reads from before a region] in solvers.py) finds [0, 2) again
    between = resharded.peak_bytes + (kept.peak_bytes - resharded.peak_bytes) * 7 // 10
    assert solve("optimal", fsdp, between).regions == (Region(0, 2),)
    roomy = solve("optimal", fsdp, kept.peak_bytes)
    assert (roomy.regions, roomy.reshard_after_rebuild) == ((Region(0, 2),), False)
    # every budget from the least any plan reaches up: as fast as the fastest plan that
    # fits, kept or resharded, found by trying them all (the tables do not count units,
    # so a fill overshoots and is tightened, then bisected: Note [Reads from before a
    # region] in solvers.py)
    from test_solve import all_plans

    scores = [(sim.peak_bytes, sim.step_time_s) for plan in all_plans(fsdp)
              for sim in (simulate(dataclasses.replace(plan, reshard_after_rebuild=r), fsdp)
                          for r in (False, True))]
    most = simulate(Plan(stages=fsdp.stage_names), fsdp).peak_bytes
    for budget in range(solvers.minimum_budget(fsdp), most + 1, 50):
        best = min(t for peak, t in scores if peak <= budget)
        assert solve("optimal", fsdp, budget).predicted_step_time_s == pytest.approx(best), budget
    # told to keep units at the tight budget: a slower plan
    kept_only = solve("optimal", fsdp, resharded.peak_bytes, reshard_after_rebuild=False)
    assert not kept_only.reshard_after_rebuild
    assert kept_only.predicted_step_time_s > tight.predicted_step_time_s
    # a plan says so in its JSON, and only when it reshards
    assert Plan.from_dict(tight.to_dict()) == tight and "reshard_after_rebuild" not in (
        roomy.to_dict())
    with pytest.raises(UsageError, match="reshard_after_rebuild"):
        Plan(stages=fsdp.stage_names, reshard_after_rebuild="yes")  # type: ignore[arg-type]


NONE_CHAIN = Plan(stages=tuple(f"s{i}" for i in range(4)))
PER_STAGE_CHAIN = Plan(stages=NONE_CHAIN.stages, regions=tuple(Region(i, i + 1) for i in range(4)))
ONE_REGION_CHAIN = Plan(stages=NONE_CHAIN.stages, regions=(Region(0, 4),))


# -- remat auto per rank (Note [auto per rank] in remat/benchmarking/main_job.py) -------------


def test_auto_runs_per_rank_under_torchrun_and_every_rank_reports(tmp_path: Path) -> None:
    out = tmp_path / "auto.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
           "-m", "remat", "auto", "--model", "gpt", "--set", "n_layer=2", "--set", "n_embd=32",
           "--set", "batch_size=8", "--distributed", "fsdp", "--budget", "80%", "--repeats",
           "2", "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    reports = [json.loads((tmp_path / f"auto.rank{r}.json").read_text()) for r in range(WORLD)]
    for rank, report in enumerate(reports):
        assert report["environment"]["rank"] == rank, report
        assert report["environment"]["distributed"] == "fsdp"
        assert report["verify_ok"] and report["grads_match"], report["verify_detail"]
        assert report["within_budget"], (report["measured_peak_bytes"], report["budget_bytes"])
        assert report["predicted_overhead_statistic"] == "ratio of the profile's medians"
        # per-rank times take more profile rounds by default (8 under --distributed, not 2)
        noise = report["timing_noise"]
        assert noise["rounds"] - noise["extra_rounds"] == 8, noise
    # one plan and one budget on every rank: their collectives must match
    plans = [{k: v for k, v in r["plan"].items() if k != "solve_time_s"} for r in reports]
    assert plans[0] == plans[1] and plans[0]["regions"] is not None
    assert reports[0]["budget_bytes"] == reports[1]["budget_bytes"]
    assert done.returncode == (0 if all(r["ok"] for r in reports) else 1), done.stderr[-2000:]
    assert done.stdout.count("peaks and times are this rank's") == WORLD


def test_auto_distributed_without_torchrun_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from remat.cli import main

    env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
    try:
        assert main(["auto", "--model", "gpt", "--distributed", "ddp"]) == 2
    finally:
        os.environ.update(env)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torchrun" in err[0] and "--distributed ddp" in err[0], err
