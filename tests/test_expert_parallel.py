"""Expert parallelism on 2 gloo ranks (remat.models.ep): each block's two all-to-alls
are counted, a region's rebuild repeats both and save-collectives neither, as the
profile-free prediction says, and every plan trains what one process trains (experts'
gradients gathered from both ranks' tokens)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import launch_ranks, read_ranks

WORLD = 2
NAMES = ("layers.0", "layers.1")


def _loss(model: Any, batch: Any) -> torch.Tensor:
    tokens, target = batch
    return torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), target.flatten())


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    t = torch.randint(0, 64, (2, 9), generator=g)
    return t[:, :-1], t[:, 1:]


def _whole() -> Any:
    from remat.models.ep import EPModel

    torch.manual_seed(0)
    return EPModel()


def _plans() -> dict[str, Any]:
    from remat.core.plan_format import Plan, Region

    return {
        "none": Plan(NAMES),
        "per-stage": Plan(NAMES, (Region(0, 1), Region(1, 2))),
        "segment": Plan(NAMES, (Region(0, 2),)),
        "save-collectives": Plan(NAMES, (), ("selective:save-collectives",) * 2),
    }


def _rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    import remat
    from remat.core.collectives import rebuilt_collectives
    from remat.models.ep import EPModel
    from remat.parallel.tensor import count_collectives, stage_comms

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD)

    def mine() -> EPModel:  # the whole model's weights, this rank's experts
        whole, model = _whole(), EPModel(rank=rank, ranks=WORLD, group=dist.group.WORLD)
        model.load_state_dict({k: v for k, v in whole.state_dict().items()
                               if ".experts." not in k}, strict=False)
        for layer, theirs in zip(model.layers, whole.layers, strict=True):
            for e, expert in enumerate(layer.experts):
                expert.load_state_dict(theirs.experts[rank * layer.local + e].state_dict())
        return model

    comms = stage_comms(mine(), _batch(rank), _loss, NAMES)
    results: dict[str, Any] = {}
    for name, plan in _plans().items():
        model = mine()
        remat.apply(model, plan)
        count = count_collectives(model, _batch(rank), _loss, NAMES)
        results[name] = {
            "forward": [[c.op for c in count.stages[s].forward] for s in NAMES],
            "measured": [[c.op for c in count.stages[s].rebuild] for s in NAMES],
            "predicted": [[op for op, _ in calls] for calls in rebuilt_collectives(plan, comms)],
            "loss": float(_loss(model, _batch(rank)).detach()),
        }
        grads = {n: p.grad for n, p in model.named_parameters()}
        torch.save(grads, Path(out, f"grads_{rank}_{name}.pt"))
        remat.remove(model)
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launch_ranks(_rank, tmp_path_factory.mktemp("expert_parallel"), WORLD)


@pytest.fixture(scope="module")
def ranks(launched: Path) -> list[dict[str, Any]]:
    return read_ranks(launched, WORLD)


def test_a_blocks_two_all_to_alls_are_counted_and_repeated_as_predicted(
        ranks: list[dict[str, Any]]) -> None:
    a2a = ["all_to_all_single"] * 2
    for row in ranks:
        for name in _plans():
            assert row[name]["forward"] == [a2a, a2a]
            assert row[name]["measured"] == row[name]["predicted"], name
        # the block's output needs the second exchange: a rebuild repeats both
        assert row["per-stage"]["measured"] == [a2a, a2a]
        assert row["save-collectives"]["measured"] == [[], []]


@pytest.mark.parametrize("plan", list(_plans()))
def test_every_plan_trains_what_one_process_trains(launched: Path,
                                                   ranks: list[dict[str, Any]],
                                                   plan: str) -> None:
    whole = _whole()
    # the experts see both ranks' tokens: their gradients are those of both losses
    losses = [_loss(whole, _batch(r)) for r in range(WORLD)]
    sum(losses).backward()
    experts = {n: p.grad.clone() for n, p in whole.named_parameters() if ".experts." in n}
    for r in range(WORLD):
        assert ranks[r][plan]["loss"] == pytest.approx(float(losses[r]), rel=1e-5)
        whole.zero_grad()
        _loss(whole, _batch(r)).backward()  # the rest sees this rank's tokens only
        theirs = torch.load(launched / f"grads_{r}_{plan}.pt")
        for name, grad in theirs.items():
            if ".experts." in name:  # layers.{i}.experts.{e}.{leaf}: this rank's e
                _, i, _, e, leaf = name.split(".")
                local = len(whole.layers[int(i)].experts) // WORLD
                expected = experts[f"layers.{i}.experts.{r * local + int(e)}.{leaf}"]
            else:
                expected = dict(whole.named_parameters())[name].grad
            torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6, msg=name)
