"""remat under tensor and sequence parallelism (DTensor on 2 gloo ranks): losses and
gradients equal one process for every plan, the collectives each plan's rebuilds repeat
equal the prediction from the profile's per-stage collectives, save-collectives repeats
none, and the profile counts each rank's shard of the parameters.

One launch (``mp.spawn``, 2 processes, about 20 s) runs remat.models.tp's decoder
(4 blocks) parallelized the torchtitan way, with and without sequence parallelism, and
writes each rank's figures; the tests read them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import launch_ranks, read_ranks, start_ranks

WORLD = 2
NAMES = tuple(f"layers.{i}" for i in range(4))


def _loss(model: Any, batch: Any) -> torch.Tensor:
    tokens, target = batch
    return torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), target.flatten())


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # a DTensor's, or t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _figures(prof: Any) -> dict[str, Any]:
    """What a fake profile must reproduce of a real one (docs/tensor-parallel.md)."""
    return {
        "stages": [{"boundary": s.boundary_bytes, "output": s.output_bytes,
                    "saved": dict(s.saved_bytes), "grad": s.grad_bytes,
                    "comms": s.comms.to_dict() if s.comms is not None else None}
                   for s in prof.stages],
        "fixed": [prof.fixed.params_bytes, prof.fixed.grads_bytes,
                  prof.fixed.optimizer_state_bytes],
    }


def _fake_rank(rank: int, out: str) -> None:
    """Rank 0 of 2 on torch's fake process group, the model built without weights."""
    from torch.distributed.device_mesh import init_device_mesh

    import remat
    from remat.models.tp import parallelize, tp_transformer
    from remat.parallel.tensor import init_fake_ranks

    torch.set_num_threads(1)
    init_fake_ranks(WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))  # outside the fake mode: its ranks are real
    with remat.fake_mode():
        model, batch = tp_transformer()
        parallelize(model, mesh)
    # on a device with a link, the collectives are priced into the stage's times
    import dataclasses

    from remat.core.collectives import collective_seconds
    from remat.core.devices import get_device

    h100 = get_device("h100-sxm")
    # (no attention dropout here: the device's attention stand-in keeps what CPU
    # attention keeps, so the bytes are the CPU profile's)
    priced, bare = (remat.profile(model, batch, _loss, stages=NAMES, fake=True, device=d)
                    for d in (h100, dataclasses.replace(h100, link_bytes_per_s=None)))
    figures = _figures(bare)
    a, b = priced.stages[0], bare.stages[0]
    assert a.comms is not None and h100.link_bytes_per_s is not None
    figures["priced"] = {
        "forward": [a.fwd_s - b.fwd_s, a.bwd_s - b.bwd_s, a.rebuild_s - b.rebuild_s],
        "expected_forward": collective_seconds(a.comms.forward, h100.link_bytes_per_s, WORLD),
        "replay": {o: a.extra_bwd_s[o] - b.extra_bwd_s[o] for o in a.extra_bwd_s},
        "expected_replay": collective_seconds(a.comms.rebuild_last, h100.link_bytes_per_s,
                                              WORLD),
    }
    Path(out, "fake.json").write_text(json.dumps(figures))


def _plans() -> dict[str, Any]:
    from remat.core.plan_format import Plan, Region

    return {
        "none": Plan(NAMES),
        "per-stage": Plan(NAMES, tuple(Region(i, i + 1) for i in range(4))),
        "segments": Plan(NAMES, (Region(0, 2), Region(2, 4))),
        "save-collectives": Plan(NAMES, (), ("selective:save-collectives",) * 4),
        "mixed": Plan(NAMES, (Region(0, 2),),
                      ("keep", "keep", "selective:save-nothing", "selective:save-collectives")),
    }


def _rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import remat
    from remat.core.collectives import rebuilt_collectives
    from remat.core.planner import to_problem
    from remat.core.solve import simulate, solvers
    from remat.models.tp import parallelize, tp_transformer
    from remat.parallel.tensor import agreed_plan, count_collectives, stage_comms

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    results: dict[str, Any] = {}
    for sp in (True, False):
        model, batch = tp_transformer()
        parallelize(model, mesh, sequence_parallel=sp)
        comms = stage_comms(model, batch, _loss, NAMES)
        plans = _plans()
        if sp:  # remat's optimal plan half-way between the least peak and no checkpointing
            prof = remat.profile(model, batch, _loss, stages=NAMES, repeats=1,
                                 ranks_agree=True)
            results["options"] = sorted({o for s in prof.stages for o in s.saved_bytes})
            results["figures"] = _figures(prof)
            # the profile records each stage's collectives: the plans' predictions below
            # come from it (the same as stage_comms measures on its own)
            results["profile_comms_equal"] = [st.comms for st in prof.stages] == comms
            comms = [st.comms for st in prof.stages]
            results["profile_round_trip"] = (
                type(prof).from_dict(prof.to_dict()).stages[0].comms == comms[0])
            results["params_bytes"] = prof.fixed.params_bytes
            results["local_params_bytes"] = sum(
                _local(p).numel() * p.element_size() for p in model.parameters())
            results["whole_params_bytes"] = sum(
                p.numel() * p.element_size() for p in model.parameters())
            problem = to_problem(prof)
            least = solvers.minimum_budget(problem)
            most = simulate(plans["none"], problem).peak_bytes
            budget = (least + most) // 2
            plans["optimal"] = agreed_plan(remat.plan(prof, budget))
            results["optimal"] = plans["optimal"].to_dict()
            results["save_collectives_fits"] = (
                simulate(plans["save-collectives"], problem).peak_bytes <= budget)
        for name, plan in plans.items():
            model, batch = tp_transformer()
            parallelize(model, mesh, sequence_parallel=sp)
            remat.apply(model, plan)
            count = count_collectives(model, batch, _loss, NAMES)
            grads = {n: _whole(p.grad) for n, p in model.named_parameters()}
            loss = _loss(model, batch)  # a second step's loss: the same weights
            key = f"{'sp' if sp else 'tp'}:{name}"
            results[key] = {
                "loss": float(loss.detach()),
                "measured": [[c.op for c in count.stages[s].rebuild] for s in NAMES],
                "predicted": [[op for op, _ in calls]
                              for calls in rebuilt_collectives(plan, comms)],
                "forward": [[c.op for c in count.stages[s].forward] for s in NAMES],
                "plan": plan.to_dict(),
            }
            if rank == 0:
                torch.save(grads, Path(out, f"grads_{key.replace(':', '_')}.pt"))
            remat.remove(model)
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launch_ranks(_rank, tmp_path_factory.mktemp("tensor_parallel"), WORLD)


@pytest.fixture(scope="module")
def ranks(launched: Path) -> list[dict[str, Any]]:
    return read_ranks(launched, WORLD)


def _one_process() -> tuple[float, dict[str, torch.Tensor]]:
    from remat.models.tp import tp_transformer

    model, batch = tp_transformer()
    loss = _loss(model, batch)
    loss.backward()
    return float(loss), {n: p.grad for n, p in model.named_parameters()}


KEYS = [f"{mode}:{name}" for mode in ("sp", "tp") for name in _plans()] + ["sp:optimal"]


@pytest.mark.parametrize("key", KEYS)
def test_losses_and_gradients_equal_one_process(launched: Path, ranks: list[dict[str, Any]],
                                                key: str) -> None:
    loss, grads = _one_process()
    for row in ranks:
        assert row[key]["loss"] == pytest.approx(loss, rel=1e-5)
    theirs = torch.load(launched / f"grads_{key.replace(':', '_')}.pt")
    assert set(theirs) == set(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(theirs[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("key", KEYS)
def test_the_collectives_a_plan_repeats_are_the_predicted_ones(
        ranks: list[dict[str, Any]], key: str) -> None:
    for row in ranks:
        assert row[key]["measured"] == row[key]["predicted"], row[key]["plan"]


def test_sequence_parallel_blocks_gather_and_scatter_twice_and_a_rebuild_repeats_three(
        ranks: list[dict[str, Any]]) -> None:
    row = ranks[0]
    ag, rs, ar = "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"
    assert row["sp:none"]["forward"] == [[ag, rs, ag, rs]] * 4
    assert row["sp:none"]["measured"] == [[]] * 4
    # torch's early stop: the block's last reduce-scatter is not needed by its backward
    assert row["sp:per-stage"]["measured"] == [[ag, rs, ag]] * 4
    assert row["tp:none"]["forward"] == [[ar, ar]] * 4
    assert row["tp:per-stage"]["measured"] == [[ar]] * 4
    for mode in ("sp", "tp"):
        assert row[f"{mode}:save-collectives"]["measured"] == [[]] * 4


def test_where_saving_collectives_fits_the_optimal_plan_repeats_fewer_than_per_stage(
        ranks: list[dict[str, Any]]) -> None:
    for row in ranks:
        assert row["save_collectives_fits"]
        repeated = {name: sum(map(len, row[f"sp:{name}"]["measured"]))
                    for name in ("optimal", "per-stage")}
        assert repeated["optimal"] < repeated["per-stage"], (row["optimal"], repeated)


def test_one_process_with_fake_ranks_profiles_a_rank_as_the_real_ranks_do(
        ranks: list[dict[str, Any]], tmp_path: Path) -> None:
    start_ranks(_fake_rank, (str(tmp_path),), 1)
    fake = json.loads((tmp_path / "fake.json").read_text())
    priced = fake.pop("priced")
    assert fake == ranks[0]["figures"]
    # and for a device with a link, its collectives are priced into its times: the
    # forward's in forward, backward and rebuild, a one-stage rebuild's in every
    # selective replay but save-collectives'
    assert priced["expected_forward"] > 0
    assert priced["forward"] == pytest.approx([priced["expected_forward"]] * 3)
    for option, extra in priced["replay"].items():
        expected = 0.0 if option == "selective:save-collectives" else priced["expected_replay"]
        assert extra == pytest.approx(expected, abs=1e-15), option


def test_the_profile_counts_each_ranks_shard_and_offers_save_collectives(
        ranks: list[dict[str, Any]]) -> None:
    for row in ranks:
        assert row["profile_comms_equal"] and row["profile_round_trip"]
        assert row["params_bytes"] == row["local_params_bytes"] < row["whole_params_bytes"]
        assert "selective:save-collectives" in row["options"]
