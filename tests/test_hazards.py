"""remat.verify's hazard detectors: each one triggered by a model, and silent on a clean one."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from conftest import TanhBlock, mean_square
from remat.core.plan_format import Plan, Region
from remat.verification import Hazard, VerifyReport, verify

pytestmark = pytest.mark.usefixtures("one_thread")

D = 8  # TanhBlock's default width


class Chain(nn.Module):
    def __init__(self, middle: nn.Module) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([TanhBlock(), middle, TanhBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


STAGES = ("blocks.0", "blocks.1", "blocks.2")
ONE_REGION = Plan(stages=STAGES, regions=(Region(0, 3),))


def run(
    middle: nn.Module,
    plan: Plan = ONE_REGION,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] = mean_square,
    model: nn.Module | None = None,
) -> VerifyReport:
    torch.manual_seed(0)
    model = model if model is not None else Chain(middle)
    return verify(model, torch.randn(4, D), plan, loss_fn, steps=2)


def of_kind(report: VerifyReport, kind: str) -> list[Hazard]:
    return [h for h in report.hazards if h.kind == kind]


# ---------------------------------------------------------------------------------------
# Randomness torch does not restore


class PythonRandom(TanhBlock):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x)) * random.random()


class NumpyRandom(TanhBlock):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x)) * float(np.random.rand())


class OwnGenerator(TanhBlock):
    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x)) + 0.1 * torch.randn(x.shape, generator=self.gen)


class TorchDropout(TanhBlock):
    """Randomness from torch's default generator, which the rebuild restores: clean."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.fc(x)))


@pytest.mark.parametrize(
    ("middle", "source"),
    [
        (PythonRandom, "Python's random module"),
        (NumpyRandom, "NumPy's global generator"),
        (OwnGenerator, "an explicit torch.Generator (aten.randn.generator)"),
    ],
)
def test_randomness_torch_does_not_restore_is_found(middle: type[TanhBlock], source: str) -> None:
    report = run(middle())
    (hazard,) = of_kind(report, "randomness")
    assert (hazard.stage, hazard.region, hazard.details) == ("blocks.1", "[0, 3)", (source,))
    assert not hazard.covered and not report.ok
    # The other numbers drawn in the rebuild show up as values and gradients too.
    assert report.check("parameter-gradients").status == "fail"
    assert report.value_check is not None and report.value_check.first is not None
    assert report.value_check.first.stage == "blocks.1"


def test_dropout_from_torchs_generator_is_not_a_randomness_hazard() -> None:
    report = run(TorchDropout())
    assert report.ok, report.to_dict()
    assert report.hazards == ()


# ---------------------------------------------------------------------------------------
# Buffers mutated inside a region


class Norm(TanhBlock):
    def __init__(self, kind: type[nn.Module]) -> None:
        super().__init__()
        self.norm = kind(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.norm(self.fc(x)))


class HiddenCounter(TanhBlock):
    """Counts calls in a buffer through ``.data``: no version bump, so the runtime misses it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.data.add_(1)
        return super().forward(x)


def test_batchnorm_statistics_are_reported_as_covered_and_change_once() -> None:
    report = run(Norm(nn.BatchNorm1d))
    (hazard,) = of_kind(report, "buffer-mutation")
    assert hazard.covered and hazard.stage == "blocks.1"
    assert set(hazard.details) == {
        "blocks.1.norm.running_mean", "blocks.1.norm.running_var",
        "blocks.1.norm.num_batches_tracked",
    }
    # Covered: verification passes, buffers included in the trajectory comparison.
    assert report.ok, report.to_dict()
    assert report.check("trajectory-parameters").status == "pass"


def test_a_buffer_update_the_runtime_cannot_see_is_an_uncovered_hazard() -> None:
    report = run(HiddenCounter())
    (hazard,) = of_kind(report, "buffer-mutation")
    assert (hazard.stage, hazard.details) == ("blocks.1", ("blocks.1.calls",))
    assert not hazard.covered
    assert not report.ok
    # The counter moved twice per step with the plan: the trajectory sees it too.
    assert report.check("trajectory-parameters").status == "fail"
    assert report.check("trajectory-parameters").worst == "blocks.1.calls"


def test_layernorm_has_no_buffers_to_mutate() -> None:
    report = run(Norm(nn.LayerNorm))
    assert report.ok and report.hazards == ()


# ---------------------------------------------------------------------------------------
# In-place modification between forward and rebuild


class Shifted(TanhBlock):
    def forward(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x + shift))


class ShiftChain(nn.Module):
    """Passes one ``shift`` tensor to every block; ``bump`` changes it in place afterwards."""

    def __init__(self, bump: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Shifted() for _ in range(3)])
        self.bump = bump

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shift = torch.ones(D)
        for block in self.blocks:
            x = block(x, shift=shift)
        if self.bump:
            shift.add_(1)  # `x + shift` saves nothing, so plain autograd does not mind
        return x


@pytest.mark.parametrize("bump", [True, False])
def test_an_argument_modified_in_place_before_the_rebuild(bump: bool) -> None:
    report = run(nn.Identity(), model=ShiftChain(bump))
    found = of_kind(report, "inplace-modification")
    if not bump:
        assert report.ok and not found
        return
    (hazard,) = found  # one tensor, passed to three stages: reported once
    assert hazard.details == ("keyword 'shift'",) and hazard.stage == "blocks.0"
    assert "version 0 -> 1" in hazard.message
    # The rebuild refuses to replay from the changed value instead of giving wrong gradients.
    runs = report.check("runs")
    assert not report.ok and runs.status == "error" and "changed in place" in runs.message


class EditsRegionInput(nn.Module):
    """Writes into the region's input after the forward, behind autograd's back."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(D, D)
        self.blocks = nn.ModuleList([TanhBlock() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        y = h
        for block in self.blocks:
            y = block(y)
        h.data.mul_(2)
        return y


def test_the_region_input_written_through_data_is_found() -> None:
    report = run(nn.Identity(), model=EditsRegionInput())
    (hazard,) = of_kind(report, "inplace-modification")
    assert hazard.details == ("argument 0",) and hazard.region == "[0, 3)"
    assert hazard.message.startswith("the input of region [0, 3)")


class StepsDuringBackward(Chain):
    """Edits blocks.0's weight from a gradient hook, before region [0, 1) is rebuilt."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, block in enumerate(self.blocks):
            x = block(x)
            if k == 1 and x.requires_grad:
                x.register_hook(self._edit)
        return x

    def _edit(self, grad: torch.Tensor) -> None:
        self.blocks[0].fc.weight.data.mul_(0.5)


def test_a_parameter_edited_during_backward_before_its_rebuild() -> None:
    plan = Plan(stages=STAGES, regions=(Region(0, 1), Region(1, 3)))
    report = run(nn.Identity(), plan=plan, model=StepsDuringBackward(TanhBlock()))
    (hazard,) = of_kind(report, "inplace-modification")
    assert hazard.details == ("blocks.0.fc.weight",) and hazard.stage == "blocks.0"
    assert of_kind(report, "parameter-changed") == []  # unchanged when backward began


# ---------------------------------------------------------------------------------------
# Data-dependent control flow


class BranchOnStepCount(TanhBlock):
    """Branches on a step counter it updates: the rebuild sees the updated count."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        odd = bool(self.steps % 2)
        self.steps += 1
        y = self.fc(x)
        return x + (torch.relu(y) if odd else torch.tanh(y))


class BranchOnInput(TanhBlock):
    """Branches on its input, which the rebuild sees unchanged: clean."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return x + (torch.relu(y) if bool(x.mean() > 0) else torch.tanh(y))


def test_a_branch_on_changed_state_takes_another_path_in_the_rebuild() -> None:
    report = run(BranchOnStepCount())
    (hazard,) = of_kind(report, "control-flow")
    assert hazard.stage == "blocks.1"
    assert hazard.details == ("aten.tanh.default", "aten.relu.default")
    assert "ran aten.relu.default where the forward ran aten.tanh.default" in hazard.message
    assert not report.ok


def test_a_branch_on_the_input_takes_the_same_path() -> None:
    report = run(BranchOnInput())
    assert report.ok and report.hazards == ()


# ---------------------------------------------------------------------------------------
# Python side effects repeated by the rebuild

LOG: list[int] = []


class SideEffects(TanhBlock):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.fc.register_forward_hook(lambda _m, _a, _o: None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        LOG.append(1)
        self.calls += 1
        return super().forward(x)


class LocalBookkeeping(TanhBlock):
    """Appends only to lists it creates: nothing outlives the call, clean."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [x]
        parts.append(torch.tanh(self.fc(x)))
        return parts[0] + parts[1]


def test_side_effects_repeated_by_the_rebuild_are_counted() -> None:
    report = run(SideEffects())
    (hazard,) = of_kind(report, "python-side-effect")
    assert hazard.stage == "blocks.1" and hazard.count == 3
    assert set(hazard.details) == {
        "list.append: 1", "forward hooks of blocks.1.fc: 1", "attribute blocks.1.calls: 1",
    }
    assert not report.ok
    assert report.check("parameter-gradients").status == "pass"  # harmless to the math


def test_hooks_of_stages_outside_regions_and_local_lists_are_not_side_effects() -> None:
    plan = Plan(stages=STAGES, regions=(Region(0, 1),))  # blocks.1 is never rebuilt
    assert of_kind(run(SideEffects(), plan=plan), "python-side-effect") == []
    report = run(LocalBookkeeping())
    assert report.ok and report.hazards == ()


# ---------------------------------------------------------------------------------------
# Parameters changed before backward


def edits_weight_before_backward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = mean_square(model, x)
    model.blocks[1].fc.weight.data.mul_(1.5)  # e.g. an optimizer step before backward
    return loss


def test_parameters_changed_between_forward_and_backward() -> None:
    report = run(TanhBlock(), loss_fn=edits_weight_before_backward)
    (hazard,) = of_kind(report, "parameter-changed")
    assert hazard.details == ("blocks.1.fc.weight",) and hazard.count == 1
    assert "the rebuilds of 'blocks.1' read the new values" in hazard.message
    assert of_kind(report, "inplace-modification") == []  # reported once, as the cause


def test_an_unchanged_model_has_no_hazards() -> None:
    report = run(TanhBlock())
    assert report.ok and report.hazards == ()
