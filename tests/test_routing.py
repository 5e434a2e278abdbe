"""Mixture-of-experts routing under checkpointing: regions and selective options over a
stage that routes keep its routing decisions, verify names a rebuild whose router chose
other experts than its forward (where remat did not see the stage route), and
selective:save-routing keeps the forward's choices there (issue 20, item 3)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.core.plan_format import Plan, Region

DIM, EXPERTS, TOKENS = 8, 4, 16


class MoE(nn.Module):
    """Top-1 routing over ``EXPERTS`` linear experts, dense (every expert runs, the
    router's choice masks them), so a changed choice changes values, not shapes. The
    gate's rows are equal and experts 2 and 3 start 9 lower: every token ties between
    experts 0 and 1. With
    ``nudged``, a run inside backward (a rebuild) adds 1e-6 to expert 0's logit, as a
    kernel that rounds differently when run again would: far inside the value check's
    tolerance, and enough to flip every tie. The experts are the ``experts`` child
    remat recognises a routing stage by, or, ``hidden``, called ``ffns``."""

    def __init__(self, nudged: bool, hidden: bool) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        with torch.no_grad():
            self.gate.weight[1:] = self.gate.weight[0]
        experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(EXPERTS))
        setattr(self, "ffns" if hidden else "experts", experts)
        self.ffn_list = experts
        self.nudged = nudged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        again = self.nudged and torch._C._current_graph_task_id() != -1  # inside backward
        logits = self.gate(x) + torch.tensor([1e-6 if again else 0.0, 0.0, -9.0, -9.0])
        weight, chosen = torch.topk(logits.softmax(-1), 1, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.ffn_list):
            out = out + (chosen == e).to(x.dtype) * weight * expert(x)
        return x + out


class Net(nn.Module):
    def __init__(self, nudged: bool, hidden: bool) -> None:
        super().__init__()
        self.pre = nn.Linear(DIM, DIM)
        self.moe = MoE(nudged, hidden)
        self.post = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.moe(torch.tanh(self.pre(x))))


def _factory(nudged: bool, hidden: bool = True) -> Any:
    def make() -> tuple[nn.Module, torch.Tensor, Any]:
        torch.manual_seed(0)
        model = Net(nudged, hidden)
        batch = torch.randn(TOKENS, DIM)
        return model, batch, lambda m, b: m(b).pow(2).mean()
    return make


STAGES = ("pre", "moe", "post")
REGION = Plan(STAGES, (Region(0, 2),))
SAVED = Plan(STAGES, (Region(0, 1),), ("keep", "selective:save-routing", "keep"))


def _kinds(report: Any) -> set[str]:
    return {h.kind for h in report.hazards if not h.covered}


def test_a_rebuild_that_routes_otherwise_is_named() -> None:
    report = remat.verify(_factory(nudged=True), None, REGION)
    assert not report.ok
    assert "routing" in _kinds(report)
    flip = next(h for h in report.hazards if h.kind == "routing")
    assert flip.stage == "moe" and "aten.topk" in flip.message
    assert "selective:save-routing" in flip.message
    # a difference of 1e-6 in the logits is within the value check's tolerance: only
    # the chosen indices differ there
    assert [m.forward_op for m in report.value_check.routing] == ["aten.topk.default"]


def test_saving_the_routing_keeps_the_forwards_experts() -> None:
    report = remat.verify(_factory(nudged=True), None, SAVED)
    assert "routing" not in _kinds(report)
    assert report.ok, report
    # the same stage saving nothing rebuilds its router, which routes otherwise
    nothing = Plan(STAGES, (Region(0, 1),), ("keep", "selective:save-nothing", "keep"))
    assert "routing" in _kinds(remat.verify(_factory(nudged=True), None, nothing))


@pytest.mark.parametrize("plan", [REGION, Plan(STAGES, (Region(0, 1),),
                                                 ("keep", "selective:save-nothing", "keep"))],
                         ids=["region", "save-nothing"])
def test_a_stage_with_experts_keeps_its_routing_in_regions_and_selective_options(
        plan: Plan) -> None:
    report = remat.verify(_factory(nudged=True, hidden=False), None, plan)
    assert report.ok, report
    assert report.value_check is not None and report.value_check.routing == ()


def test_a_router_that_routes_the_same_raises_nothing() -> None:
    report = remat.verify(_factory(nudged=False), None, REGION)
    assert report.ok, report
    assert report.value_check is not None and report.value_check.routing == ()


@pytest.mark.parametrize("policy", ["save-routing"])
def test_the_policy_saves_topk(policy: str) -> None:
    from remat.runtime.policies import resolve

    ops = {str(op) for op in resolve(f"selective:{policy}", "moe").ops}
    assert {"aten.topk.default", "aten.argmax.default"} <= ops


def test_mixtrals_rebuilds_take_the_forwards_experts_and_its_in_place_weights_are_fine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # transformers' Mixtral normalises its top-k weights in place (routing_weights /= ...);
    # the rebuild of a region over its layers replays the forward's choices: no topk runs
    # in backward (as an outer dispatch mode sees it), and verify passes
    from torch.utils._python_dispatch import TorchDispatchMode

    from remat.models import load_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, batch, loss_fn = load_model("hf:mixtral")[:3]
    stages = tuple(f"model.layers.{i}" for i in range(len(model.model.layers)))
    plan = Plan(stages, tuple(Region(i, i + 1) for i in range(len(stages))))

    class Topk(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            self.calls += func is torch.ops.aten.topk.default
            return func(*args, **(kwargs or {}))

    handle = remat.apply(model, plan)
    try:
        loss = loss_fn(model, batch)
        with Topk() as seen:
            loss.backward()
        assert seen.calls == 0 and handle.rebuilds == len(stages)
    finally:
        remat.remove(model)
    report = remat.verify(lambda: load_model("hf:mixtral")[:3], None, plan)
    assert report.ok, report
