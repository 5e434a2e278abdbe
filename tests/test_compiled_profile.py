"""Profiling, planning and applying on compiled stages (docs/compile.md, "Planning a
compiled model"): the tracker counts a compiled stage as the allocator does, a profile
with ``compile=True`` prices the compiled program, and plans carry which program they
were priced for. Uses the tiny chain of ``test_compile`` (one compiled graph for its blocks).
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest
import torch

import remat
from conftest import mean_square
from remat import plans
from remat.benchmarking.runners import Runner
from remat.benchmarking.step_measures import by_profiler
from remat.core.errors import UsageError
from remat.core.plan_format import Plan
from remat.core.planner import to_problem
from remat.core.profile_format import OPTIONS
from remat.core.solve import simulate
from remat.measure import measure_step
from remat.profiling.timeline import split_step
from remat.runtime.compiled_stages import CompiledForward, compile_stages, stages_compiled
from test_compile import N_BLOCKS, _needs_inductor, make_chain  # noqa: F401 (fixture)

STAGES = [f"blocks.{i}" for i in range(N_BLOCKS)]


def chain() -> tuple[torch.nn.Module, torch.Tensor, Any]:
    """The tiny chain as a model factory, for the command line."""
    model, x = make_chain()
    return model, x, mean_square


def _counting_inductor(calls: list[int], compiles: list[int] | None = None) -> Any:
    """Inductor, counting each call of the forward graphs it compiled (and each compile)."""
    from torch._inductor.compile_fx import compile_fx

    def fw_compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        if compiles is not None:
            compiles.append(1)
        compiled = compile_fx(gm, example_inputs)

        def run(*args: Any) -> Any:
            calls.append(1)
            return compiled(*args)

        return run

    return fw_compiler


def _allocator_peak(model: torch.nn.Module, x: torch.Tensor) -> int:
    return by_profiler(Runner(model, x, mean_square, "adamw")).peak_bytes


@pytest.fixture(scope="module")
def compiled_profile() -> tuple[torch.nn.Module, torch.Tensor, remat.Profile]:
    model, x = make_chain()
    profile = remat.profile(model, x, mean_square, compile=True, repeats=1)
    return model, x, profile


def test_the_tracker_sees_a_compiled_stage_run_compiled_and_counts_it_as_the_allocator_does():
    model, x = make_chain()
    eager_peak = measure_step(copy.deepcopy(model), x, mean_square).peak_bytes
    calls: list[int] = []
    compile_stages(model, backend=_counting_inductor(calls))
    mean_square(model, x).backward()  # compile
    model.zero_grad(set_to_none=True)
    calls.clear()
    tracked = measure_step(model, x, mean_square).peak_bytes
    # each block's compiled graph ran in the warm-up step and in the tracked one
    assert len(calls) == 2 * N_BLOCKS
    assert tracked == _allocator_peak(model, x)
    assert tracked != eager_peak  # the compiled program's memory, not the eager one's


def test_measuring_a_compiled_model_never_compiles_its_stages_into_another_program():
    # hooks on modules inside a compiled stage are traced into its graph and guarded on:
    # each measurement that hooks every module would compile the stage again, and past
    # Dynamo's recompile limit it would run eagerly for good
    model, x = make_chain()
    calls: list[int] = []
    compiles: list[int] = []
    compile_stages(model, backend=_counting_inductor(calls, compiles))
    remat.profile(model, x, mean_square, repeats=1, options=["keep"])
    remat.apply(model, plans.per_stage(model))
    measure_step(model, x, mean_square)
    remat.remove(model)
    calls.clear()
    measure_step(model, x, mean_square)
    # the blocks' graph, twice: the first block's input (the batch) needs no gradient
    assert len(compiles) == 2
    assert len(calls) == 2 * N_BLOCKS  # still compiled: warm-up and measured step


def test_a_profile_with_compile_prices_the_compiled_program(
    compiled_profile: tuple[torch.nn.Module, torch.Tensor, remat.Profile],
) -> None:
    model, x, profile = compiled_profile
    assert profile.compiled and stages_compiled(model, STAGES)
    # selective ones too; not inductor's partitioner: the blocks draw dropout masks
    assert set(profile.stages[0].saved_bytes) == set(OPTIONS)
    eager = remat.profile(make_chain()[0], x, mean_square, repeats=1, options=["keep"])
    assert profile.stages[1].saved_bytes != eager.stages[1].saved_bytes
    assert profile.measured_peak_bytes == _allocator_peak(model, x)
    # as close as the eager profile of this chain comes to its own step (one hidden state
    # over), to a few bytes
    eager_gap = eager.predicted_peak_bytes - eager.measured_peak_bytes
    assert abs(profile.predicted_peak_bytes - profile.measured_peak_bytes - eager_gap) <= 64


@pytest.mark.parametrize("fraction", [0.5, 0.8])
def test_a_plan_of_the_compiled_profile_keeps_its_budget_on_the_compiled_model(
    compiled_profile: tuple[torch.nn.Module, torch.Tensor, remat.Profile], fraction: float
) -> None:
    model, x, profile = compiled_profile
    budget = int(profile.measured_peak_bytes * fraction)
    plan = remat.plan(profile, budget)
    assert plan.compiled and Plan.from_json(plan.to_json()).compiled
    remat.apply(model, plan)
    try:
        measured = _allocator_peak(model, x)
    finally:
        remat.remove(model)
    assert measured <= budget
    assert abs(measured / plan.predicted_peak_bytes - 1) <= 0.05


def test_apply_refuses_a_plan_priced_for_the_other_program(
    compiled_profile: tuple[torch.nn.Module, torch.Tensor, remat.Profile],
) -> None:
    model, x, profile = compiled_profile
    plan = remat.plan(profile, int(profile.measured_peak_bytes * 0.8))
    eager_model, _ = make_chain()
    with pytest.raises(UsageError, match="priced for compiled stages"):
        remat.apply(eager_model, plan)
    assert not remat.applied(eager_model) and "forward" not in eager_model.blocks[0].__dict__
    remat.apply(eager_model, plan, allow_compile_mismatch=True)
    remat.remove(eager_model)

    eager_profile = remat.profile(eager_model, x, mean_square, repeats=1, options=["keep"])
    eager_plan = remat.plan(eager_profile, int(eager_profile.measured_peak_bytes * 0.8))
    assert not eager_plan.compiled
    with pytest.raises(UsageError, match="priced for eager stages"):
        remat.apply(model, eager_plan)
    assert not remat.applied(model)
    # builder plans carry no price and apply to either
    remat.apply(model, plans.per_stage(model))
    remat.remove(model)
    assert stages_compiled(model, STAGES)  # remove leaves the compilation


def test_compile_stages_wraps_a_users_compiled_forward_and_uncompile_restores_it():
    model, _ = make_chain()
    own = torch.compile(model.blocks[0].forward)
    model.blocks[0].forward = own
    with pytest.raises(UsageError, match=r"compiled and stage 'blocks\.1' is not"):
        stages_compiled(model, STAGES)
    compile_stages(model)
    wrapped = model.blocks[0].__dict__["forward"]
    assert isinstance(wrapped, CompiledForward) and wrapped.compiled is own
    assert remat.uncompile_stages(model) == N_BLOCKS
    assert model.blocks[0].__dict__["forward"] is own
    assert all("forward" not in b.__dict__ for b in model.blocks[1:])


def test_compile_stages_refuses_a_model_with_a_plan_applied_and_changes_nothing():
    model, _ = make_chain()
    remat.apply(model, plans.per_stage(model))
    with pytest.raises(UsageError, match=r"remat\.remove"):
        compile_stages(model)
    with pytest.raises(UsageError, match=r"remat\.remove"):
        remat.profile(model, torch.randn(2, 3, 32), mean_square, compile=True)
    remat.remove(model)
    assert all("forward" not in b.__dict__ for b in model.blocks)


@pytest.mark.parametrize("option", ["selective:save-matmuls", "selective:save-nothing"])
def test_a_selective_option_is_compiled_into_the_stage_and_saves_what_the_profile_says(
    compiled_profile: tuple[torch.nn.Module, torch.Tensor, remat.Profile], option: str
) -> None:
    model, x, profile = compiled_profile
    stage = profile.stages[1]
    assert stage.saved_bytes[option] < stage.saved_bytes["keep"]
    plan = Plan(stages=profile.stage_names, options=(option,) * N_BLOCKS)
    predicted = simulate(plan, to_problem(profile)).peak_bytes
    remat.apply(model, plan)
    try:
        stage_forward = model.blocks[1].forward
        assert stages_compiled(model, STAGES)  # through the option's compiled graph
        measured = _allocator_peak(model, x)
    finally:
        remat.remove(model)
    # off by what the prediction of this chain's plain step is off by (one hidden state)
    plain_gap = profile.predicted_peak_bytes - profile.measured_peak_bytes
    assert abs(predicted - measured - plain_gap) <= 64, (measured, predicted)
    assert stage_forward is not model.blocks[1].forward
    # the eager selective machinery would save what keep saves here: it never sees the ops
    keep = simulate(Plan(stages=profile.stage_names), to_problem(profile)).peak_bytes
    assert measured < keep


def test_profile_checks_compile_is_a_bool():
    model, x = make_chain()
    with pytest.raises(UsageError, match="compile="):
        remat.profile(model, x, mean_square, compile="yes")  # type: ignore[arg-type]


def test_a_deep_copy_of_a_compiled_model_runs_its_own_parameters():
    model, x = make_chain()
    model.eval()  # no dropout: the compiled and eager calls below must agree
    compile_stages(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.blocks[0].parameters():
            p.add_(1.0)
    forward = twin.blocks[0].__dict__["forward"]
    assert isinstance(forward, CompiledForward) and forward.eager.__self__ is twin.blocks[0]
    expected = type(twin.blocks[0]).forward(twin.blocks[0], x)
    torch.testing.assert_close(twin.blocks[0](x), expected, rtol=1.3e-6, atol=1e-5)
    assert not torch.allclose(model.blocks[0](x), expected)


def test_verify_compares_compiled_twins_and_says_why_it_skips_the_value_check(
    compiled_profile: tuple[torch.nn.Module, torch.Tensor, remat.Profile],
) -> None:
    model, x, profile = compiled_profile
    plan = Plan(stages=profile.stage_names, regions=plans.per_stage(model).regions[:2],
                options=("keep", "keep", "selective:save-matmuls", "selective:save-nothing"))
    report = remat.verify(model, x, plan, mean_square, steps=2)
    assert report.ok
    values = next(c for c in report.checks if c.name == "rebuilt-values")
    assert values.status == "skip" and "compiled" in values.message


def test_the_cli_plans_a_compiled_model(tmp_path: Any) -> None:
    from remat.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--model", f"{__file__}:chain", "--compile", "--budget", "60%",
                 "--json", str(out)]) == 0
    assert Plan.load(out).compiled


def test_bench_compile_adds_remat_on_the_compiled_stages_beside_compile(tmp_path: Any) -> None:
    from remat.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "--model", f"{__file__}:chain", "--compile", "--strategies",
                 "compile", "--budgets", "60%", "--repeats", "1", "--warmup", "0",
                 "--profile-repeats", "1", "--microbatch-budget", "off",
                 "--json", str(out), "--out", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / "tradeoff.png").stat().st_size > 0  # plots render these rows
    rows = {r["key"]: r for r in json.loads(out.read_text())["rows"]}
    assert {"none", "compile@60%", "remat+compile@60%",
            "remat+compile@compile@60%"} <= set(rows)
    for key in ("remat+compile@60%", "remat+compile@compile@60%"):
        row = rows[key]
        assert row["status"] == "ok" and row["grads_match"], row
        assert row["measured_peak_bytes"] <= row["budget_bytes"]
        assert abs(row["measured_peak_bytes"] / row["predicted_peak_bytes"] - 1) <= 0.05
    assert rows["remat+compile@compile@60%"]["budget_bytes"] == \
        rows["compile@60%"]["measured_peak_bytes"]


class _ConvBlock(torch.nn.Module):
    """A UNet's resnet block in small: inductor saves its weights in a layout of its own."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.norm = torch.nn.GroupNorm(2, channels)
        self.conv = torch.nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(torch.nn.functional.silu(self.norm(x)))


class _ConvChain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = torch.nn.ModuleList(_ConvBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return x


@pytest.fixture(scope="module")
def conv_profile() -> tuple[torch.nn.Module, torch.Tensor, remat.Profile]:
    torch.manual_seed(0)
    model, x = _ConvChain(), torch.randn(4, 3, 16, 16)
    return model, x, remat.profile(model, x, mean_square, compile=True, repeats=1)


def _backward_peaks_as_predicted(
    model: torch.nn.Module, x: torch.Tensor, profile: remat.Profile, options: tuple[str, ...]
) -> None:
    plan = Plan(stages=profile.stage_names, options=options)
    predicted = {e.label: e.live_bytes for e in simulate(plan, to_problem(profile)).events}
    remat.apply(model, plan)
    try:
        measured = measure_step(model, x, mean_square, timeline=True)
    finally:
        remat.remove(model)
    # this chain's prediction is a hidden state off after the chain (as eager), so
    # compare inside it: each block's backward, where the saved bytes are all alive
    spans = split_step(measured, profile.stage_names)
    for i, span in enumerate(spans.stage_backward):
        label = f"backward blocks.{i}"
        assert abs(span.peak_bytes - predicted[label]) <= 64, (options, label)


def test_a_compiled_option_that_saves_a_copy_of_its_input_is_priced_as_it_runs(
    conv_profile: tuple[torch.nn.Module, torch.Tensor, remat.Profile],
) -> None:
    # Compiled with save-nothing, a conv block saves a copy of its input and of its
    # weights (inductor's layout), not the input itself: measured in the option's own
    # pass, not taken from the no-save pass, and its input not counted twice. The built-in
    # UNet's plan was 4.6% under its measured peak without this, and 7.8% over with only
    # the first half.
    model, x, profile = conv_profile
    option = "selective:save-nothing"
    stage = profile.stages[1]
    assert option in stage.input_kept_by_option
    assert stage.saved_bytes[option] > 0  # the pass that saves nothing would say 0
    for options in [("keep",) * 3, (option,) * 3, ("keep", option, "keep")]:
        _backward_peaks_as_predicted(model, x, profile, options)


def test_inductors_partitioner_is_an_option_per_compiled_stage_priced_and_verified(
    conv_profile: tuple[torch.nn.Module, torch.Tensor, remat.Profile],
) -> None:
    model, x, profile = conv_profile
    option = "selective:budget=0.5"
    for stage in profile.stages:  # measured on every block (none draws random numbers)
        assert 0 < stage.saved_bytes[option] < stage.saved_bytes["keep"]
    for options in [(option,) * 3, ("keep", option, "selective:save-nothing")]:
        _backward_peaks_as_predicted(model, x, profile, options)
    plan = Plan(stages=profile.stage_names, options=(option,) * 3)
    report = remat.verify(model, x, plan, mean_square)
    assert report.ok, report.to_dict()


def test_a_partitioned_stage_compiles_under_its_own_budget() -> None:
    seen: list[float] = []

    def backend(gm: torch.fx.GraphModule, _example_inputs: Any) -> Any:
        import torch._functorch.config as functorch_config

        seen.append(functorch_config.activation_memory_budget)
        return gm.forward

    model, x = _ConvChain(), torch.randn(2, 3, 8, 8)
    compile_stages(model, backend=backend)
    mean_square(model, x).backward()
    assert seen and set(seen) == {1.0}  # keep: the stage's own graph, at the default
    seen.clear()
    plan = Plan(stages=tuple(f"blocks.{i}" for i in range(3)),
                options=("selective:budget=0.25",) * 3)
    remat.apply(model, plan)
    try:
        mean_square(model, x).backward()
    finally:
        remat.remove(model)
    assert seen and set(seen) == {0.25}  # a graph of its own, compiled under its budget


def test_inductors_partitioner_needs_compiled_stages() -> None:
    model, x = _ConvChain(), torch.randn(2, 3, 8, 8)
    with pytest.raises(UsageError, match="needs compiled stages"):
        remat.profile(model, x, mean_square, options=["keep", "selective:budget=0.5"])
    plan = Plan(stages=tuple(f"blocks.{i}" for i in range(3)),
                options=("keep", "selective:budget=0.5", "keep"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UsageError, match=re.escape(
            "'blocks.1' has option 'selective:budget=0.5', which needs the stage compiled")):
        remat.apply(model, plan)
    assert not remat.applied(model) and "forward" not in vars(model.blocks[1])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    for text in ["selective:budget=1", "selective:budget=-0.1", "selective:budget=half"]:
        with pytest.raises(UsageError, match="fraction from 0 up to"):
            Plan(stages=("blocks.0",), options=(text,))
