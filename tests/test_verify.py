"""remat.verify: twins, comparisons, tolerances, the first divergence, the value check, CLI."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from conftest import Block, mean_square
from remat import plans
from remat.cli import main
from remat.core.errors import UsageError
from remat.core.plan_format import Plan, Region
from remat.models import load_model
from remat.runtime import apply
from remat.runtime.install import applied, observe
from remat.verification import CHECK_NAMES, Tolerance, ValueCheck, parse_tolerance, verify
from remat.verification.compare import diff
from remat.verification.fingerprint import Fingerprint, checksum, compare_call

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_GPT = {
    "n_layer": 3, "n_embd": 16, "n_head": 2, "block_size": 8, "vocab_size": 32, "batch_size": 2,
}
CLI_GPT = [f"--set={key}={value}" for key, value in TINY_GPT.items()]


def gpt(**options: Any) -> tuple[nn.Module, Any, Any]:
    return load_model("gpt", **{**TINY_GPT, **options})


class Chain(nn.Module):
    def __init__(self, n: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dropout=dropout) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


# ---------------------------------------------------------------------------------------
# Plans that change nothing pass every check


NESTED = Plan(
    stages=("blocks.0", "blocks.1", "blocks.2"),
    regions=(Region(0, 3), Region(0, 2)),
    options=("selective:save-matmuls", "keep", "offload"),
)


@pytest.mark.parametrize(
    "make_plan",
    [plans.per_stage, plans.segments, plans.selective, lambda m: NESTED],
    ids=["per-stage", "segments", "selective", "nested"],
)
def test_a_plan_that_changes_nothing_passes_every_check(make_plan: Any) -> None:
    model, batch, loss_fn = gpt()
    report = verify(model, batch, make_plan(model), loss_fn)
    assert report.ok, report.to_dict()
    assert [c.name for c in report.checks] == list(CHECK_NAMES)
    assert {c.name: c.status for c in report.checks} == {
        **dict.fromkeys(CHECK_NAMES, "pass"), "input-gradients": "skip",  # token ids only
    }
    assert report.value_check is not None
    assert report.value_check.rebuilt_calls >= 3 and report.value_check.ops_compared > 50
    assert report.first_divergence is None and report.hazards == ()


def test_exact_tolerance_holds_on_cpu_and_a_plan_without_regions_rebuilds_nothing() -> None:
    model, batch, loss_fn = gpt()
    report = verify(model, batch, plans.per_stage(model), loss_fn, tolerance="exact")
    assert report.ok and report.tolerance == "exact"
    assert all(c.max_abs_error in (None, 0.0) for c in report.checks if c.name != "rebuilt-values")
    nothing = verify(model, batch, plans.none(model), loss_fn)
    assert nothing.ok and nothing.check("rebuilt-values").status == "skip"


def test_floating_point_inputs_get_their_gradients_compared() -> None:
    torch.manual_seed(0)
    report = verify(Chain(), torch.randn(4, 8), plans.per_stage, mean_square, steps=1)
    check = report.check("input-gradients")
    assert (check.status, check.compared, check.worst) == ("pass", 1, "batch")


# ---------------------------------------------------------------------------------------
# The reference article's dropout example


def test_dropout_with_rng_preservation_off_is_caught_and_the_stage_named() -> None:
    model, batch, loss_fn = gpt(dropout=0.1)
    plan = Plan(stages=("blocks.0", "blocks.1", "blocks.2"), regions=(Region(1, 2),))
    on = verify(model, batch, plan, loss_fn)
    off = verify(model, batch, plan, loss_fn, preserve_rng_state=False)
    assert on.ok, on.to_dict()

    assert not off.ok
    # The loss is plausible (the forward is the same); the gradients are not.
    assert off.check("loss").status == "pass"
    assert off.check("parameter-gradients").status == "fail"
    assert off.check("trajectory-losses").status == "fail"
    d = off.first_divergence
    assert d is not None and (d.stage, d.quantity) == ("blocks.1", "rebuilt-value")
    assert d.op is not None and "bernoulli" in d.op
    assert off.value_check is not None and off.value_check.first is not None
    first = off.value_check.first
    assert (first.stage, first.kind, first.region) == ("blocks.1", "value", "[1, 2)")
    (hazard,) = off.hazards
    assert (hazard.kind, hazard.stage) == ("randomness", "blocks.1")
    assert "RNG preservation is off" in hazard.details[0]


def test_the_first_divergence_is_the_region_not_the_stages_before_it() -> None:
    # Backward carries the wrong gradient of blocks.2 into blocks.0 and blocks.1 too; only
    # blocks.2 was rebuilt, with other dropout masks.
    torch.manual_seed(0)
    chain = Chain(dropout=0.5)
    plan = Plan(stages=tuple(f"blocks.{i}" for i in range(4)), regions=(Region(2, 3),))
    report = verify(chain, torch.randn(16, 8), plan, mean_square, preserve_rng_state=False)
    assert report.check("parameter-gradients").status == "fail"
    assert report.first_divergence is not None
    assert report.first_divergence.stage == "blocks.2"
    assert report.first_divergence.max_abs_error > 0


def test_gradient_divergence_is_located_in_backward_order_when_values_agree() -> None:
    # A gradient hook of blocks.1's output scales the gradient blocks.1 passes back:
    # outputs agree, the gradient blocks.1 received agrees, its input gradient does not.
    class Scaled(Chain):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for k, block in enumerate(self.blocks):
                if k == 1 and x.requires_grad and applied(self):
                    x.register_hook(lambda g: g * 2)
                x = block(x)
            return x

    torch.manual_seed(0)
    report = verify(Scaled(), torch.randn(4, 8), plans.per_stage, mean_square, steps=1)
    d = report.first_divergence
    assert d is not None
    assert (d.stage, d.quantity) == ("blocks.1", "input-gradient")


# ---------------------------------------------------------------------------------------
# Tolerances


def test_tolerances_follow_the_dtype() -> None:
    auto = parse_tolerance("auto")
    f64, f32 = auto.for_dtype(torch.float64), auto.for_dtype(torch.float32)
    bf16, f16 = auto.for_dtype(torch.bfloat16), auto.for_dtype(torch.float16)
    assert f64.rtol < f32.rtol < f16.rtol < bf16.rtol
    assert auto.for_dtype(torch.int64).exact and parse_tolerance("exact").for_dtype(
        torch.bfloat16
    ).exact
    assert parse_tolerance(1e-3).for_dtype(torch.float64) == Tolerance(1e-3, 1e-3)
    assert parse_tolerance("0").mode == "exact"
    for bad in ("loose", -1, float("nan"), True):
        with pytest.raises(UsageError, match="tolerance"):
            parse_tolerance(bad)


def test_a_difference_passes_or_fails_by_tolerance() -> None:
    b = torch.linspace(-1, 1, 11)
    a = b + 1e-7
    assert diff(a, b, parse_tolerance("auto")).ok
    assert not diff(a, b, parse_tolerance("exact")).ok
    assert not diff(b + 1e-3, b, parse_tolerance("auto")).ok
    assert diff(b.double() + 1e-7, b.double(), parse_tolerance("auto")).ok is False
    nan = torch.tensor([float("nan"), 1.0])
    assert diff(nan, nan.clone(), parse_tolerance("exact")).ok  # NaNs in the same places
    assert not diff(None, b, parse_tolerance("auto")).ok
    d = diff(b * 1.5, b, parse_tolerance("auto"))
    assert d.max_abs_error == pytest.approx(0.5) and d.max_rel_error == pytest.approx(0.5)


# ---------------------------------------------------------------------------------------
# The user's model, RNG and inputs


def test_the_users_model_and_rng_are_left_exactly_as_given() -> None:
    model, batch, loss_fn = gpt(dropout=0.1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch_rng, python_rng = torch.get_rng_state(), random.getstate()
    verify(model, batch, plans.per_stage(model), loss_fn, steps=2)
    assert not applied(model)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    for module in model.modules():
        assert "forward" not in vars(module)
        assert not module._forward_hooks and not module._forward_pre_hooks
    assert torch.equal(torch.get_rng_state(), torch_rng) and random.getstate() == python_rng


def test_a_factory_may_return_the_triple() -> None:
    report = verify(gpt, None, plans.per_stage, steps=1)
    assert report.ok and report.steps == 1


def test_usage_errors_are_one_sentence_and_change_nothing() -> None:
    model, batch, loss_fn = gpt()
    handle = apply(model, plans.per_stage(model))
    with pytest.raises(UsageError, match=r"remove it with remat\.remove"):
        verify(model, batch, plans.per_stage(model), loss_fn)
    handle.remove()
    with pytest.raises(UsageError, match="steps=0"):
        verify(model, batch, plans.per_stage(model), loss_fn, steps=0)
    with pytest.raises(UsageError, match="optimizer 'lion'"):
        verify(model, batch, plans.per_stage(model), loss_fn, optimizer="lion")
    with pytest.raises(UsageError, match="pass a remat Plan"):
        verify(model, batch, "per-stage", loss_fn)
    with pytest.raises(UsageError, match="factory returned int"):
        verify(lambda: 3, batch, plans.per_stage, loss_fn)
    with pytest.raises(UsageError, match="preserve_rng_state"):
        apply(model, plans.per_stage(model), preserve_rng_state="no")  # type: ignore[arg-type]
    assert not applied(model)


def test_remat_verify_is_a_plain_function_that_verifies() -> None:
    import types

    import remat.verification
    import remat.verification.hazards  # importing its package's modules changes nothing

    assert type(remat.verify) is types.FunctionType
    assert remat.verify is remat.verification.verify
    model, batch, loss_fn = gpt(n_layer=2)
    report = remat.verify(model, batch, plans.per_stage(model), loss_fn, steps=1)
    assert isinstance(report, remat.verification.VerifyReport) and report.ok
    assert [c.name for c in report.checks if not c.passed] == []


# ---------------------------------------------------------------------------------------
# The value check: fingerprints and the debug mode


def fp(op: str, total: float = 1.0, dtype: torch.dtype = torch.float32) -> Fingerprint:
    return Fingerprint(op, ((2,),), (dtype,), ((total, 1.0, total),))


def test_compare_call_names_the_first_difference_and_where_the_path_split() -> None:
    forward = [fp("aten.mm.default"), fp("aten.tanh.default"), fp("aten.add.Tensor")]
    auto = parse_tolerance("auto")
    assert compare_call(forward, forward, auto) == (None, None)
    assert compare_call(forward, forward[:2], auto) == (None, None)  # early stop: a prefix
    assert compare_call(forward, forward[1:], auto, frozenset({"aten.mm.default"})) == (None, None)

    first, path = compare_call(forward, [forward[0], fp("aten.relu.default")], auto)
    assert first == path and path is not None
    assert (path.kind, path.op_index, path.forward_op) == ("op", 1, "aten.tanh.default")

    first, path = compare_call(forward, [*forward, fp("aten.mul.Tensor")], auto)
    assert first is not None and (first.kind, first.forward_op, first.op_index) == ("op", None, 3)

    other = [fp("aten.mm.default", 2.0), fp("aten.relu.default")]
    first, path = compare_call(forward, other, auto)
    assert first is not None and path is not None
    assert (first.kind, first.op_index, path.kind, path.op_index) == ("value", 0, "op", 1)
    assert first.max_abs_error == 1.0

    close = [fp("aten.mm.default", 1.0 + 1e-9)]
    assert compare_call(forward, close, auto) == (None, None)
    assert compare_call(forward, close, parse_tolerance("exact"))[0] is not None


def test_checksums_see_values_moved_elsewhere_and_leave_the_rng_alone() -> None:
    rng = torch.get_rng_state()
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0])
    moved = torch.tensor([1.0, 1.0, 0.0, 1.0])  # same count, other places: like two masks
    assert checksum(mask) == checksum(mask.clone())
    a, b = checksum(mask), checksum(moved)
    assert a is not None and b is not None
    assert a[:2] == b[:2] and a[2] != b[2]
    assert torch.equal(torch.get_rng_state(), rng)


class RandomScale(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x)) * random.random()


def test_value_check_as_a_debug_mode_names_stage_and_op() -> None:
    torch.manual_seed(0)
    model = Chain()
    model.blocks[2] = RandomScale()
    stages = tuple(f"blocks.{i}" for i in range(4))
    handle = apply(model, Plan(stages=stages, regions=(Region(0, 2), Region(2, 4))))
    x = torch.randn(4, 8)
    with ValueCheck(handle) as check:
        mean_square(model, x).backward()
    result = check.result()
    assert result.rebuilt_calls == 4 and not result.ok
    # blocks.3 is rebuilt from blocks.2's other output: the first in forward order is named.
    assert [m.stage for m in result.mismatches] == ["blocks.2", "blocks.3"]
    first = result.first
    assert first is not None
    assert (first.stage, first.region, first.kind, first.rebuilt_op) == (
        "blocks.2", "[2, 4)", "value", "aten.mul.Tensor"
    )
    with ValueCheck(handle) as again:  # the observer was removed at the end of the block
        pass
    assert again.result().rebuilt_calls == 0
    handle.remove()


def test_the_runtime_observer_sees_forward_calls_and_rebuilds() -> None:
    torch.manual_seed(0)
    model = Chain()
    seen: list[tuple[int, bool]] = []

    class Recorder:
        def stage_started(self, stage: int, rebuild: bool, args: Any, kwargs: Any) -> None:
            seen.append((stage, rebuild))

        def stage_finished(self, stage: int, rebuild: bool, output: Any) -> None:
            pass

    plan = Plan(stages=tuple(f"blocks.{i}" for i in range(4)), regions=(Region(1, 3),))
    handle = apply(model, plan)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False), observe(model, Recorder()):
        with pytest.raises(UsageError, match="already observed"), observe(model, Recorder()):
            pass
        mean_square(model, torch.randn(2, 8)).backward()
    assert seen == [(0, False), (1, False), (2, False), (3, False), (1, True), (2, True)]
    handle.remove()


# ---------------------------------------------------------------------------------------
# The command line


def test_cli_verify_passes_and_writes_the_documented_json(tmp_path: Path) -> None:
    out = tmp_path / "verify.json"
    assert main(["verify", *CLI_GPT, "--plan", "segments", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {"ok", "checks", "hazards", "first_divergence", "value_check"} <= set(data)
    assert data["ok"] is True and data["first_divergence"] is None
    assert [c["name"] for c in data["checks"]] == list(CHECK_NAMES)
    assert data["model"] == "gpt" and data["plan_source"] == "segments"


def test_cli_verify_fails_with_rng_preservation_off(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", *CLI_GPT, "--plan", "every:2", "--no-preserve-rng-state",
                 "--json", "-"]) == 1
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["ok"] is False and data["first_divergence"]["stage"] == "blocks.0"
    assert "FAILED" in captured.err and "HAZARD randomness blocks.0" in captured.err


def test_cli_verify_reads_plan_files_and_rejects_bad_plans(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, _, _ = gpt()
    path = tmp_path / "plan.json"
    plans.uniform_groups(model, 2).save(path)
    assert main(["verify", *CLI_GPT, "--plan", str(path), "--steps", "1"]) == 0
    assert "OK: equivalent and hazard-free" in capsys.readouterr().out
    assert main(["verify", *CLI_GPT, "--plan", "sometimes"]) == 2
    assert "neither a plan file nor a builder" in capsys.readouterr().err
    assert main(["verify", *CLI_GPT, "--plan", "every:x"]) == 2
    assert main(["verify", *CLI_GPT]) == 2  # --plan or --budget is required


def test_cli_budget_profiles_plans_and_verifies(tmp_path: Path) -> None:
    out = tmp_path / "verify.json"
    assert main(["verify", *CLI_GPT, "--budget", "1GiB", "--steps", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["ok"] is True and data["plan_source"] == "budget 1GiB"
    assert data["plan"]["solver"] == "optimal"


# ---------------------------------------------------------------------------------------
# Optimizer steps that amplify rounding (Note [Optimizer steps that amplify rounding])


class Nudged(nn.Module):
    """A linear layer that, once remat wraps its forward, adds a constant times its
    weight.s sum: gradients 1e-9 apart (rounding-sized, as a compiled selective graph's
    are), which Adam turns into steps about 1e-4 apart where the plain gradient is 0.
    ``shift_bias`` also moves the planned twin's bias by 1e-4 in its first forward."""

    def __init__(self, shift_bias: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.shift_bias = shift_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if "forward" not in vars(self):  # the plain twin
            return y
        if self.shift_bias:
            self.shift_bias = False
            with torch.no_grad():
                self.lin.bias.add_(1e-4)
        return y + 1e-8 * self.lin.weight.sum()


def _nudged_chain(shift_bias: bool = False) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(Nudged(), Nudged(shift_bias))
    x = torch.randn(16, 8)
    x[:, 3] = 0  # the weights' column 3 gets no gradient in the plain model
    return model, x


def _nudged_plan() -> Plan:
    return Plan(stages=("0", "1"), options=("selective:save-nothing", "keep"))


def test_adam_amplifying_gradient_rounding_passes_and_says_why() -> None:
    model, x = _nudged_chain()
    report = verify(model, x, _nudged_plan(), mean_square, optimizer="adamw", steps=3)
    assert report.check("parameter-gradients").status == "pass"
    assert report.check("sgd-step").status == "pass"
    for name in ("adamw-step", "trajectory-parameters"):
        check = report.check(name)
        assert check.status == "pass", report.to_dict()
        assert "adamw amplifies their rounding" in check.message
    # the models did step apart: the raw difference is in the message, above the tolerance
    assert "differ by up to" in report.check("adamw-step").message
    assert report.ok, report.to_dict()


def test_a_parameter_that_differs_besides_the_gradients_still_fails_the_steps() -> None:
    model, x = _nudged_chain(shift_bias=True)
    report = verify(model, x, _nudged_plan(), mean_square, optimizer="adamw", steps=3)
    assert report.check("parameter-gradients").status == "pass", report.to_dict()
    for name in ("sgd-step", "adamw-step"):
        check = report.check(name)
        assert check.status == "fail", (name, report.to_dict())
        assert "not from the gradients alone" in check.message, check.message
        assert check.message.endswith("worst '1.lin.bias'")
    # the later losses differ too (the bias moved), so nothing is explained there
    assert report.check("trajectory-losses").status == "fail"
    trajectory = report.check("trajectory-parameters")
    assert trajectory.status == "fail" and "amplifies" not in trajectory.message
    assert not report.ok


class _MarksItsInput(nn.Module):
    """Sets requires_grad on a view of its input, as wav2vec2's feature encoder does."""

    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x[:, None].squeeze(1)
        h.requires_grad = True  # torch refuses this on a non-leaf: x must not require grad
        for block in self.blocks:
            h = block(h)
        return h


def test_a_model_that_refuses_a_batch_that_requires_grad_is_verified_without_input_grads(
) -> None:
    torch.manual_seed(0)
    model, batch = _MarksItsInput(), torch.randn(4, 8, 16)
    report = verify(model, batch, plans.per_stage(model), mean_square, steps=2)
    checks = {c.name: c for c in report.checks}
    assert report.ok, [str(c) for c in report.checks]
    assert checks["input-gradients"].status == "skip"
    assert "requires grad" in checks["input-gradients"].message
    assert checks["parameter-gradients"].passed and checks["trajectory-losses"].passed
