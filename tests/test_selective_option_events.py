"""A selective stage's own events to the byte (Notes [A selective stage's forward] and [A
selective stage rebuilt in full] in remat/core/solve/simulator.py).

A selective stage's checkpoint frame saves nothing as its forward goes, so that forward
peaks as a forward that saves nothing does, not as keep's (everything saved alive); and a
selective stage its region's rebuild stops before replays its whole forward in its own
backward, as save-nothing does, whatever its option caches.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import remat
from conftest import planned_peak, stage_maxima
from remat.core.plan_format import Plan, Region
from remat.core.solve import Problem, simulate
from remat.core.solve.from_profile import problem_from_profile
from remat.measure.records import Phase
from test_mixed_precision import _gpt

pytestmark = pytest.mark.usefixtures("one_thread")

NOTHING, MATMULS = "selective:save-nothing", "selective:save-matmuls"


@pytest.fixture(scope="module", params=["fp32", "autocast-bf16"])
def gpt(request: pytest.FixtureRequest) -> tuple[Any, Any, Any, Problem]:
    torch.set_num_threads(1)
    model, batch, loss_fn = _gpt(request.param)
    profile = remat.profile(model, batch, loss_fn, repeats=1)
    return model, batch, loss_fn, problem_from_profile(profile)


def _without(problem: Problem, name: str) -> Problem:
    """``problem`` with every stage's ``name`` mapping emptied (keep's figure charged)."""
    return dataclasses.replace(problem, stages=tuple(
        dataclasses.replace(s, **{name: {}}) for s in problem.stages))


def test_a_selective_stages_forward_is_predicted_to_the_byte(gpt) -> None:
    model, batch, loss_fn, problem = gpt
    plan = Plan(problem.stage_names, (), (NOTHING, MATMULS, "keep"))
    events = dict(simulate(plan, problem).events)
    measured = stage_maxima(model, batch, loss_fn, plan, Phase.FORWARD)
    assert {name: events[f"forward {name}"] for name in plan.stages} == measured
    # keep's transient charged to a save-nothing block: short by most of its activations
    short = dict(simulate(plan, _without(problem, "fwd_transient_by_option")).events)
    assert short["forward blocks.0"] < measured["blocks.0"] - 100_000


def test_a_selective_stage_its_regions_rebuild_stops_before_is_rebuilt_in_full(gpt) -> None:
    model, batch, loss_fn, problem = gpt
    # the region's rebuild stops at block 1's opening; block 1 then replays all of its
    # forward in its backward, as under save-nothing, whatever its option caches
    in_region = Plan(problem.stage_names, (Region(1, 2),), ("keep", MATMULS, "keep"))
    predicted = simulate(in_region, problem).peak_bytes
    measured = planned_peak(model, batch, loss_fn, in_region)
    assert measured == planned_peak(
        model, batch, loss_fn, Plan(problem.stage_names, (), ("keep", NOTHING, "keep")))
    assert measured <= predicted <= measured * 1.005, (measured, predicted)
