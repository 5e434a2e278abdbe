"""One module called several times in a forward: each call a stage (``path#k``).

ALBERT runs one shared layer group num_hidden_layers times; looped and recurrent-depth
transformers apply one block N times. Note [Stages that are calls of one module] in
remat.core.stage_names.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.core.errors import UsageError
from remat.core.plan_format import Plan, Region
from remat.core.solve import simulate, solvers
from remat.core.solve.from_profile import problem_from_profile
from remat.measure import measure_step
from remat.runtime.stages import discover_stages, resolve_stages

DEPTH = 6
CALLS = tuple(f"layer#{k}" for k in range(DEPTH))


class Looped(nn.Module):
    """An embedding, one shared encoder layer applied ``depth`` times in a loop, a head."""

    def __init__(self, vocab: int = 64, width: int = 32, depth: int = DEPTH) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.1,
                                                batch_first=True)
        self.depth = depth
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for _ in range(self.depth):
            h = self.layer(h)
        return self.head(h)


def looped(batch_size: int = 4) -> tuple[nn.Module, torch.Tensor, Any]:
    torch.manual_seed(0)
    model = Looped()
    ids = torch.randint(0, 64, (batch_size, 16))

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(m(b).flatten(0, 1), b.flatten())

    return model, ids, loss_fn


def _state(model: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    return dict(model.__dict__), {n: dict(m._forward_pre_hooks) | dict(m._forward_hooks)
                                  for n, m in model.named_modules()}


def _train_equal(plan: Plan, steps: int = 3) -> None:
    """Losses and gradients bitwise equal to the plain model over ``steps`` AdamW steps,
    dropout on; and remove leaves the model as it was."""
    model, batch, loss_fn = looped()
    plain = copy.deepcopy(model)
    before = _state(model.layer)
    handle = remat.apply(model, plan)
    assert "forward" in model.layer.__dict__
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, plain)]
    for step in range(steps):
        losses = []
        for m in (model, plain):
            torch.manual_seed(step)
            loss = loss_fn(m, batch)
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(*losses)
        for (name, a), b in zip(model.named_parameters(), plain.parameters(), strict=True):
            assert a.grad is not None and torch.equal(a.grad, b.grad), name
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert handle.rebuilds > 0 or not plan.regions
    remat.remove(model)
    assert _state(model.layer) == before
    assert "forward" not in model.layer.__dict__


def test_stage_names_carry_a_call_index() -> None:
    from remat.core.stage_names import call_index, module_path, split_stage_name

    assert split_stage_name("enc.layer#3") == ("enc.layer", 3)
    assert split_stage_name("enc.layer") == ("enc.layer", None)
    assert module_path("enc.layer#0") == "enc.layer" and call_index("enc.layer#10") == 10
    for bad in ("enc.layer#", "enc.layer#x", "enc.layer#01", "#2", "enc.layer#-1"):
        with pytest.raises(UsageError, match="malformed call index"):
            split_stage_name(bad)


@pytest.mark.parametrize("regions, options", [
    ((Region(0, 2), Region(2, 3), Region(3, 6), Region(4, 5)), ("keep",) * DEPTH),
    ((Region(1, 4),), ("keep", "selective:save-matmuls", "keep", "keep",
                       "selective:save-nothing", "keep")),
])
def test_each_call_of_a_shared_layer_is_a_stage_with_equal_gradients(
    regions: tuple[Region, ...], options: tuple[str, ...]
) -> None:
    _train_equal(Plan(stages=CALLS, regions=regions, options=options))


def test_calls_must_be_named_all_and_in_order() -> None:
    model, _, _ = looped()
    assert resolve_stages(model, list(CALLS)) == list(CALLS)
    for stages in (["layer#1", "layer#0"], ["layer#0", "layer#2"], ["layer", "layer#1"]):
        with pytest.raises(UsageError, match="in call order: layer#0, layer#1"):
            resolve_stages(model, stages)
        with pytest.raises(UsageError, match="layer#0, layer#1"):
            remat.apply(model, Plan(stages=tuple(stages)))
    assert not remat.applied(model)


def test_a_loop_calling_the_layer_more_often_than_the_plan_says_is_refused() -> None:
    model, batch, loss_fn = looped()
    remat.apply(model, Plan(stages=CALLS[:4], regions=(Region(0, 4),)))
    with pytest.raises(UsageError, match="after the last stage"):
        loss_fn(model, batch)
    remat.remove(model)
    loss_fn(model, batch).backward()  # no stale state left


@pytest.fixture(scope="module")
def looped_profile() -> Any:
    model, batch, loss_fn = looped()
    prof = remat.profile(model, batch, loss_fn, repeats=1)
    return model, batch, loss_fn, prof


def test_discovery_makes_each_call_a_stage(looped_profile: Any) -> None:
    model, batch, loss_fn, prof = looped_profile
    assert discover_stages(model, batch, loss_fn) == list(CALLS)
    assert prof.stage_names == CALLS
    # the shared parameters are counted once, at the last call (backward meets it first)
    params = sum(p.numel() * p.element_size() for p in model.layer.parameters())
    assert [s.grad_bytes for s in prof.stages] == [0] * (DEPTH - 1) + [params]
    assert all(s.bwd_s > 0 for s in prof.stages)


@pytest.mark.parametrize("budget", ["75%", "minimum"])
def test_plans_over_calls_run_within_budget_as_predicted(looped_profile: Any,
                                                          budget: str) -> None:
    model, batch, loss_fn, prof = looped_profile
    problem = problem_from_profile(prof)
    if budget == "minimum":
        limit = solvers.minimum_budget(problem)
    else:
        limit = int(0.75 * simulate(Plan(stages=prof.stage_names), problem).peak_bytes)
    plan = solvers.optimal(problem, limit)
    assert isinstance(plan, Plan) and plan.regions
    applied = copy.deepcopy(model)
    handle = remat.apply(applied, plan)
    measured = measure_step(applied, batch, loss_fn).peak_bytes
    handle.remove()
    predicted = simulate(plan, problem).peak_bytes
    assert measured <= limit
    assert abs(measured - predicted) <= 0.01 * predicted
    _train_equal(plan)


def test_verify_passes_on_a_plan_over_calls(looped_profile: Any) -> None:
    model, batch, loss_fn, _ = looped_profile
    plan = Plan(stages=CALLS, regions=(Region(0, 3), Region(3, 6)),
                options=("keep",) * 5 + ("selective:save-matmuls",))
    report = remat.verify(model, batch, plan, loss_fn, steps=2)
    assert report.ok, report.to_dict()


def test_hf_albert_runs_its_shared_layer_group_as_call_stages() -> None:
    pytest.importorskip("transformers")
    from remat.models import load_model

    model, batch, loss_fn = load_model("hf:albert")
    group = "albert.encoder.albert_layer_groups.0"
    layers = model.config.num_hidden_layers
    stages = discover_stages(model, batch, loss_fn)
    assert stages == [f"{group}#{k}" for k in range(layers)]
    plan = Plan(stages=tuple(stages), regions=(Region(0, 2), Region(2, layers)),
                options=("keep",) * (layers - 1) + ("selective:save-matmuls",))
    report = remat.verify(model, batch, plan, loss_fn, steps=2)
    assert report.ok, report.to_dict()


def test_a_deep_copy_runs_the_calls_of_its_own_layer() -> None:
    model, batch, loss_fn = looped()
    plain = copy.deepcopy(model)
    remat.apply(model, Plan(stages=CALLS, regions=(Region(0, 3), Region(3, 6))))
    twin = copy.deepcopy(model)
    assert remat.applied(twin) and twin.layer.forward.engine is not model.layer.forward.engine
    for m in (twin, plain):
        torch.manual_seed(0)
        loss_fn(m, batch).backward()
    for (name, a), b in zip(twin.named_parameters(), plain.parameters(), strict=True):
        assert a.grad is not None and torch.equal(a.grad, b.grad), name
    assert all(p.grad is None for p in model.parameters())
    remat.remove(twin)
    assert "forward" not in twin.layer.__dict__ and remat.applied(model)
