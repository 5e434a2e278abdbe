"""Mixture-of-experts routing under checkpointing: verify names a rebuild whose router
chose other experts than its forward, and selective:save-routing keeps the forward's
choices (issue 20, item 3)."""

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
    tolerance, and enough to flip every tie."""

    def __init__(self, nudged: bool) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        with torch.no_grad():
            self.gate.weight[1:] = self.gate.weight[0]
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(EXPERTS))
        self.nudged = nudged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        again = self.nudged and torch._C._current_graph_task_id() != -1  # inside backward
        logits = self.gate(x) + torch.tensor([1e-6 if again else 0.0, 0.0, -9.0, -9.0])
        weight, chosen = torch.topk(logits.softmax(-1), 1, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + (chosen == e).to(x.dtype) * weight * expert(x)
        return x + out


class Net(nn.Module):
    def __init__(self, nudged: bool) -> None:
        super().__init__()
        self.pre = nn.Linear(DIM, DIM)
        self.moe = MoE(nudged)
        self.post = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.moe(torch.tanh(self.pre(x))))


def _factory(nudged: bool) -> Any:
    def make() -> tuple[nn.Module, torch.Tensor, Any]:
        torch.manual_seed(0)
        model = Net(nudged)
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


def test_a_router_that_routes_the_same_raises_nothing() -> None:
    report = remat.verify(_factory(nudged=False), None, REGION)
    assert report.ok, report
    assert report.value_check is not None and report.value_check.routing == ()


@pytest.mark.parametrize("policy", ["save-routing"])
def test_the_policy_saves_topk(policy: str) -> None:
    from remat.runtime.policies import resolve

    ops = {str(op) for op in resolve(f"selective:{policy}", "moe").ops}
    assert {"aten.topk.default", "aten.argmax.default"} <= ops
