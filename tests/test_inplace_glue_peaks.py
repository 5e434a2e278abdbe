"""Exact peaks on a flat conv/ReLU(inplace)/pool ``nn.Sequential`` (VGG's ``features``):
the in-place ReLUs stay glue between the stages (docs/stages.md rule 8), and their
backward, which holds the result they saved, the gradient they were handed and the one
they make after the stage after them is done, is an event of its own (Note [The backward
of the code between stages] in ``remat.core.solve.simulator``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from conftest import planned_peak
from remat.core.plan_format import Plan
from remat.core.profile_format import Profile
from remat.core.solve import simulate, solvers
from remat.core.solve.from_profile import no_checkpoint_plan, problem_from_profile

pytestmark = pytest.mark.usefixtures("one_thread")


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def _flat(dropout: bool) -> tuple[nn.Sequential, tuple[torch.Tensor, torch.Tensor]]:
    """Four convolutions at 32x32, a pool, two at 16x16 (with ``dropout``, a ``Dropout``
    after the last ReLU: it saves its mask, not its input), a pool and a linear head."""
    torch.manual_seed(0)
    c = 8
    model = nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(c, c, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(c, c, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(c, c, 3, padding=1), nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.ReLU(inplace=True),
        *([nn.Dropout(0.1)] if dropout else []),
        nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * c * 8 * 8, 10),
    )
    batch = (torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,)))
    return model, batch


Profiled = tuple[nn.Module, Any, Profile]


@pytest.fixture(scope="module", params=[False, True], ids=["flat", "dropout"])
def profiled(request: pytest.FixtureRequest) -> Profiled:
    model, batch = _flat(request.param)
    return model, batch, remat.profile(model, batch, _loss, repeats=1)


def _measured(model: nn.Module, batch: Any, plan: Plan) -> int:
    return planned_peak(model, batch, _loss, plan)


def test_the_relus_are_glue_and_their_backward_is_measured(profiled: Profiled) -> None:
    model, _, prof = profiled
    relus = {str(k) for k, m in enumerate(model) if isinstance(m, nn.ReLU)}
    assert not relus & set(prof.stage_names)
    # after a convolution and its ReLU: the ReLU's saved result and the gradient it makes
    # are alive at its backward's peak beyond what the previous stage's backward starts with
    after_relu = [s for s in prof.stages if str(int(s.name) - 1) in relus]
    assert len(after_relu) == 6
    for s in after_relu:
        assert s.link_backward_bytes == 2 * s.boundary_bytes, s.name
        assert s.saves_input and s.pending_grad_bytes == 0, s.name


@pytest.mark.parametrize("where", ["none", "75%", "60%", "minimum"])
def test_a_flat_conv_relu_pool_chain_is_predicted_within_one_percent(
    profiled: Profiled, where: str,
) -> None:
    # Before the ReLUs' backward was an event: 1.6% over without checkpointing, 2.1% at
    # 75% (over the budget) and 2.9% at 60%.
    model, batch, prof = profiled
    problem = problem_from_profile(prof)
    budget = {"none": None, "75%": int(0.75 * prof.measured_peak_bytes),
              "60%": int(0.60 * prof.measured_peak_bytes),
              "minimum": solvers.minimum_budget(problem)}[where]
    plan = no_checkpoint_plan(prof) if budget is None else solvers.optimal(problem, budget)
    if where != "none":
        assert plan.regions, where  # a plan that checkpoints
    measured = _measured(model, batch, plan)
    predicted = simulate(plan, problem).peak_bytes
    assert abs(measured - predicted) <= 0.01 * predicted, (measured, predicted, plan.regions)
    if budget is not None:
        assert measured <= budget, (measured, budget)
    if where == "minimum":
        assert measured <= predicted, (measured, predicted)
