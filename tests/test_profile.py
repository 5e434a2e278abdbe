"""remat.profile: stage discovery, exact bytes of hand-computable stages, fixed costs, flags,
the Profile artifact, the no-checkpoint prediction, batch scaling and ``remat profile``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from remat import plans
from remat.cli import main
from remat.core.errors import UsageError
from remat.core.plan_format import Plan, Region
from remat.core.profile_format import OPTIONS, Profile
from remat.core.solve import simulate, solvers
from remat.core.solve.from_profile import no_checkpoint_plan, problem_from_profile
from remat.core.transforms import at_batch_size
from remat.measure import LiveMemoryTracker, measure_step
from remat.measure.tracker import iter_tensors
from remat.models import load_model
from remat.profiling.optimes import (
    link_parts,
    link_rounds,
    link_s,
    option_extra_s,
    region_link_rounds,
    region_link_s,
    region_overhead_s,
    spanning_regions,
)
from remat.profiling.passes import forward_pass
from remat.profiling.profiler import profile, profile_scaling
from remat.profiling.timing import StepTimes

F32 = 4
B, D, H = 4, 8, 16  # batch rows, model width, hidden width of the toy block
X = B * D * F32  # one boundary (B x D): 128 bytes
HID = B * H * F32  # one hidden activation (B x H): 256 bytes
BLOCK_PARAMS = (D * H + H + H * D + D) * F32  # lin1 and lin2 with biases: 1120 bytes


class Block(nn.Module):
    """lin2(2 * tanh(lin1(x))): keep saves tanh's output and lin2's input (2 x HID)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, H)
        self.lin2 = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.tanh(self.lin1(x)) * 2)


class Toy(nn.Module):
    """proj -> blocks -> head, summed to a scalar; optionally keeps every hidden state."""

    def __init__(self, n: int = 3, *, reverse: bool = False, keep_hidden: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block() for _ in range(n))
        self.head = nn.Linear(D, 1)
        self.reverse = reverse
        self.keep_hidden = keep_hidden
        self.hidden: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        self.hidden = []
        for block in reversed(self.blocks) if self.reverse else self.blocks:
            x = block(x)
            if self.keep_hidden:
                self.hidden.append(x)
        return self.head(x).sum()


def _batch() -> torch.Tensor:
    return torch.randn(B, D, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def toy_profile() -> Profile:
    return profile(Toy(), _batch(), repeats=1)


# -- stages ------------------------------------------------------------------------------


def test_stages_are_discovered_in_call_order() -> None:
    result = profile(Toy(reverse=True), _batch(), repeats=1)
    assert result.stage_names == ("blocks.2", "blocks.1", "blocks.0")


def test_stages_given_out_of_call_order_are_refused() -> None:
    with pytest.raises(UsageError, match="order"):
        profile(Toy(), _batch(), stages=["blocks.1", "blocks.0", "blocks.2"], repeats=1)


# -- exact bytes of a hand-computable stage ----------------------------------------------


def test_boundary_and_output_bytes_are_exact(toy_profile: Profile) -> None:
    for stage in toy_profile.stages:
        assert (stage.boundary_bytes, stage.output_bytes) == (X, X)


def test_saved_bytes_per_option_are_exact(toy_profile: Profile) -> None:
    # keep: tanh's output and lin2's input (2 * tanh); save-matmuls caches lin1's addmm
    # output (lin2's is the stage output); nothing and attention (no attention op) keep 0.
    for stage in toy_profile.stages:
        assert dict(stage.saved_bytes) == {
            "keep": 2 * HID,
            "selective:save-matmuls": HID,
            "selective:save-attention": 0,
            "selective:save-nothing": 0,
        }
        assert stage.saves_input and not stage.saves_output


def test_options_without_their_ops_equal_an_explicit_pass() -> None:
    # The profile skips passes for policies whose ops a stage never runs and uses the
    # no-save pass instead; the runtime's real policies must keep exactly that.
    model, batch = Toy(), _batch()
    names = ["blocks.0", "blocks.1", "blocks.2"]
    nosave = forward_pass(model, batch, lambda m, b: m(b), names, device=None, save=False)
    for policy in ("save-nothing", "save-attention"):
        plan = plans.selective(model, policy, stages=names)
        applied = forward_pass(model, batch, lambda m, b: m(b), names, device=None, plan=plan)
        assert [s.kept_bytes for s in applied.stages] == [s.kept_bytes for s in nosave.stages]


def test_transients_and_gradients_of_the_toy_stage(toy_profile: Profile) -> None:
    for stage in toy_profile.stages:
        # without saving the peak is at tanh (lin1's output and tanh's); the simulator
        # adds the stage's output to this figure itself
        assert stage.nosave_transient_bytes == 2 * HID - X
        assert stage.grad_bytes == BLOCK_PARAMS
        assert not stage.output_kept_outside


# -- what selective options cost in time --------------------------------------------------


def _steps(fwd: list[float], bwd: list[float], step: float = 1.0,
           rebuild: list[float] | None = None) -> StepTimes:
    return StepTimes(step_s=step, fwd_s=tuple(fwd), bwd_s=tuple(bwd),
                     rebuild_s=tuple(rebuild or [0.0] * len(fwd)))


def test_an_options_extra_time_is_the_median_over_rounds_of_each_stages_excess() -> None:
    plain = [_steps([1, 2], [2, 4]), _steps([1, 2], [2, 4]), _steps([3, 2], [2, 4])]
    # stage 0: forward and backward beyond the same round's plain ones by 0.5, 1.5, -1
    # (a noisy round) -> median 0.5; stage 1 is faster with the option: at least 0
    with_option = [_steps([1.5, 2], [2, 3]), _steps([2, 2], [2.5, 3]), _steps([2, 2], [2, 3])]
    assert option_extra_s(plain, with_option) == (0.5, 0.0)
    assert option_extra_s(plain, with_option, 0.25) == (0.5, 0.25)  # at least one frame
    with pytest.raises(UsageError, match="paired rounds"):
        option_extra_s(plain, with_option[:2])


def test_a_regions_overhead_is_the_per_stage_steps_residual_per_region() -> None:
    plain = [_steps([1, 1], [1, 1], step=5.0), _steps([1, 1], [1, 1], step=6.0)]
    # rounds: (8 - 5 - 2) / 2 = 0.5 and (9 - 6 - 2.4) / 2 = 0.3 -> median 0.4
    per_stage = [_steps([1, 1], [2, 2], step=8.0, rebuild=[1.0, 1.0]),
                 _steps([1, 1], [2, 2], step=9.0, rebuild=[1.2, 1.2])]
    assert region_overhead_s(plain, per_stage, 0.1) == pytest.approx(0.4)
    assert region_overhead_s(plain, per_stage, 0.7) == 0.7  # never below the tiny chain's


def test_the_toy_profile_prices_options_and_regions_from_its_timed_steps(
    toy_profile: Profile,
) -> None:
    assert toy_profile.region_overhead_s > 0
    for stage in toy_profile.stages:
        assert set(stage.extra_bwd_s) == set(OPTIONS) - {"keep"}
        # never below the checkpoint frame the tiny chain measures (the profile's floor)
        assert all(t > 0 for t in stage.extra_bwd_s.values())
    # saving nothing replays every op of every stage: over the chain it costs time
    assert sum(s.extra_bwd_s["selective:save-nothing"] for s in toy_profile.stages) > 0
    problem = problem_from_profile(toy_profile)
    assert problem.stages[0].extra_bwd_s == toy_profile.stages[0].extra_bwd_s
    # Note [Links inside a region]: a region costs its own figure and each link inside it
    link = toy_profile.region_link_s
    assert link is not None and 0 <= link <= toy_profile.region_overhead_s
    assert problem.region_overhead_s == toy_profile.region_overhead_s
    for cost, measured in zip(problem.stages, toy_profile.stages, strict=True):
        assert cost.rebuild_s == measured.rebuild_s
    # each link timed on its own (Note [Each link its own cost])
    measured = [s.link_s for s in toy_profile.stages]
    assert all(t is not None and t >= 0 for t in measured) and measured[-1] == 0.0
    assert [s.link_s for s in problem.stages] == measured
    assert problem.region_s(0, problem.n) == pytest.approx(
        toy_profile.region_overhead_s + sum(t or 0.0 for t in measured))
    assert all(r.link_s is not None and len(r.link_s) == problem.n
               for r in toy_profile.timed_rounds or ())


def test_spanning_regions_are_the_longest_runs_no_break_divides() -> None:
    assert spanning_regions([None] * 4) == ((0, 4),)
    assert spanning_regions([None, None, "reads a value", None, None, None]) == ((0, 2), (2, 6))
    # a run of one stage has no link inside: no region for it
    assert spanning_regions([None, "x", None, "y"]) == ((1, 3),)
    assert spanning_regions([None, "x", "y"]) == ()


def test_a_links_cost_is_the_spanning_steps_residual_per_link() -> None:
    plain = [_steps([1, 1, 1], [1, 1, 1], step=10.0), _steps([1, 1, 1], [1, 1, 1], step=12.0)]
    # one region per stage: (16 - 10 - 3) / 3 = 1.0 and (18.6 - 12 - 3) / 3 = 1.2 per region
    per_stage = [_steps([1] * 3, [2] * 3, step=16.0, rebuild=[1.0] * 3),
                 _steps([1] * 3, [2] * 3, step=18.6, rebuild=[1.0] * 3)]
    # one region over all three (two links): (15 - 10 - 3 - 1.0) / 2 = 0.5 and
    # (16.6 - 12 - 3 - 1.2) / 2 = 0.2 -> median 0.35
    spanning = [_steps([1] * 3, [2] * 3, step=15.0), _steps([1] * 3, [2] * 3, step=16.6)]
    assert region_link_rounds(plain, per_stage, spanning, [(0, 3)]) == pytest.approx([0.5, 0.2])
    assert region_link_s(plain, per_stage, spanning, [(0, 3)], 1.0) == pytest.approx(0.35)
    # never above a region's cost less the frame's, never below nothing
    assert region_link_s(plain, per_stage, spanning, [(0, 3)], 0.3) == 0.3
    cheaper = [_steps([1] * 3, [2] * 3, step=13.0)] * 2
    assert region_link_s(plain, per_stage, cheaper, [(0, 3)], 1.0) == 0.0
    with pytest.raises(UsageError, match="no link inside"):
        region_link_rounds(plain, per_stage, spanning, [(0, 1)])


def test_each_link_is_priced_by_its_own_code_and_rebuild_and_the_links_add_up() -> None:
    def timed(step: float, rebuild: list[float], gap: list[float],
              rebuild_gap: list[float] | None = None) -> StepTimes:
        return StepTimes(step_s=step, fwd_s=(1.0,) * 4, bwd_s=(2.0,) * 4,
                         rebuild_s=tuple(rebuild), gap_s=tuple(gap),
                         rebuild_gap_s=tuple(rebuild_gap or [0.0] * 4))

    # a chain of four stages; the code before stage 2 takes 0.1 in a plain forward
    plain = timed(10.0, [0.0] * 4, [0, 0, 0.1, 0])
    # one region per stage: (15 - 10 - 4 * 0.75) / 4 = 0.5 a region
    per_stage = timed(15.0, [0.75] * 4, [0, 0, 0.1, 0])
    # one region over all four: that code takes 0.4 in forward (recorded) and 0.3 in the
    # rebuild; stage 1 runs in full in the rebuild (1.0 against its early-stopped 0.75)
    spanning = timed(18.0, [0.75, 1.0, 0.75, 0.75], [0, 0, 0.4, 0], [0, 0, 0.3, 0])
    parts = link_parts(plain, per_stage, spanning, [(0, 4)])
    assert parts == pytest.approx({0: 0.0, 1: 0.25 + 0.3 + 0.3, 2: 0.0})
    # the round's links cost 18 - 10 - 3 - 0.5 = 4.5 in all; beyond the parts (0.85), an
    # even share of 1.2166... each, at most the ceiling given
    (got,) = link_rounds([plain], [per_stage], [spanning], [(0, 4)], [5.0])
    assert sum(got.values()) == pytest.approx(4.5)
    assert got[1] - got[0] == pytest.approx(0.85) and got[2] == pytest.approx(got[0])
    (capped,) = link_rounds([plain], [per_stage], [spanning], [(0, 4)], [0.5])
    assert capped == pytest.approx({0: 0.5, 1: 1.35, 2: 0.5})
    # per stage, the median over rounds, at least 0, 0 for the last stage
    slower = {0: -0.5, 1: 2.0, 2: 1.0}
    assert link_s([got, slower, got], 4) == pytest.approx((got[0], got[1], got[2], 0.0))
    assert link_s([{0: -1.0, 1: 0.5, 2: 0.0}], 4) == (0.0, 0.5, 0.0, 0.0)
    # steps timed without per-link hooks: the average link prices every link
    bare = _steps([1.0] * 4, [2.0] * 4, step=18.0, rebuild=[0.75] * 4)
    assert link_rounds([plain], [per_stage], [bare], [(0, 4)], [5.0]) == [{}]
    assert link_s([{}], 4) is None


def test_a_link_inside_a_region_is_priced_and_a_single_stage_region_is_not(
    toy_profile: Profile,
) -> None:
    from dataclasses import replace

    # the average link: stages that carry no link of their own
    average = replace(toy_profile, stages=tuple(replace(s, link_s=None)
                                                for s in toy_profile.stages))
    priced = replace(average, region_link_s=0.25, region_overhead_s=1.0)
    free = replace(average, region_link_s=None, region_overhead_s=1.0)
    names = toy_profile.stage_names

    def step_s(profile: Profile, *regions: tuple[int, int]) -> float:
        plan = Plan(names, tuple(Region(*r) for r in regions))
        return simulate(plan, problem_from_profile(profile)).step_time_s

    single = [(i, i + 1) for i in range(len(names))]
    assert step_s(priced, *single) == pytest.approx(step_s(free, *single))
    # one region over three stages: two links inside
    assert step_s(priced, (0, 3)) == pytest.approx(step_s(free, (0, 3)) + 2 * 0.25)
    assert Profile.from_dict(priced.to_dict()).region_link_s == 0.25
    assert "region_link_s" not in free.to_dict()  # written only when set
    # a link measured on its own wins over the average, for the links inside the region
    own = replace(priced, stages=tuple(replace(s, link_s=0.5 + i)
                                       for i, s in enumerate(priced.stages)))
    assert step_s(own, (0, 3)) == pytest.approx(step_s(free, (0, 3)) + 0.5 + 1.5)
    assert step_s(own, *single) == pytest.approx(step_s(free, *single))
    assert Profile.from_dict(own.to_dict()).stages[1].link_s == 1.5


# -- outside the chain -------------------------------------------------------------------


def _tracker_fixed(model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer) -> dict:
    model(batch).backward()
    optimizer.step()
    tracker = LiveMemoryTracker()
    tracker.register_existing(model)
    tracker.register_existing(optimizer)
    tracker.register_existing(list(iter_tensors(batch)))
    return tracker.live_by_category.__dict__


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_fixed_bytes_equal_the_trackers_figures(name: str) -> None:
    result = profile(Toy(), _batch(), optimizer=name, repeats=1)
    model = Toy()
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params) if name == "adamw" else torch.optim.SGD(params, momentum=0.9)
    expected = _tracker_fixed(model, _batch(), opt)
    fixed = result.fixed
    param_bytes = sum(p.numel() * F32 for p in params)
    assert fixed.params_bytes == expected["parameters_bytes"] == param_bytes
    assert fixed.grads_bytes == expected["gradients_bytes"] == param_bytes
    assert fixed.optimizer_state_bytes == expected["optimizer_state_bytes"]
    # AdamW: two moments per parameter plus a float32 step counter per tensor; SGD: momentum
    state = 2 * param_bytes + F32 * len(params) if name == "adamw" else param_bytes
    assert fixed.optimizer_state_bytes == state
    assert fixed.inputs_bytes == X
    # gradients: proj before the chain, head after it, the blocks' own in each stage
    assert fixed.pre_chain_grads_bytes == (D * D + D) * F32
    assert fixed.post_chain_grads_bytes == (D + 1) * F32


def test_outputs_kept_in_a_list_are_flagged() -> None:
    with pytest.warns(UserWarning, match="stay referenced outside the chain"):
        result = profile(Toy(keep_hidden=True), _batch(), repeats=1)
    assert [s.output_kept_outside for s in result.stages] == [True, True, True]


# -- the artifact ------------------------------------------------------------------------


def test_profile_json_round_trip(toy_profile: Profile, tmp_path: Path) -> None:
    data = toy_profile.to_dict()
    for key in (
        "schema_version",
        "model",
        "batch_size",
        "stages",
        "fixed_bytes",
        "region_overhead_s",
        "region_overhead_bytes",
        "measured_peak_bytes",
        "predicted_peak_bytes",
        "device",
        "torch_version",
        "dtype",
        "scaling",
    ):
        assert key in data
    assert set(data["stages"][0]["saved_bytes"]) == set(OPTIONS)
    assert set(data["fixed_bytes"]) >= {
        "params",
        "grads",
        "optimizer_state",
        "buffers",
        "inputs",
        "pre_chain",
        "post_chain",
    }
    assert Profile.from_dict(json.loads(json.dumps(data))) == toy_profile
    path = tmp_path / "profile.json"
    toy_profile.save(path)
    assert Profile.load(path) == toy_profile
    with pytest.raises(UsageError, match="schema version"):
        Profile.from_dict({**data, "schema_version": 99})
    # version 1 had no extra_bwd_s: read with none (selective options then cost no time)
    old = json.loads(json.dumps(data))
    old["schema_version"] = 1
    with pytest.raises(UsageError, match=r"unknown key.*extra_bwd_s"):
        Profile.from_dict(old)
    for stage in old["stages"]:
        del stage["extra_bwd_s"]
    read = Profile.from_dict(old)
    # ... and its backward figures did not include the gradients created before the peak:
    # they are added, the upper bound version 1 predicted
    for was, now in zip(toy_profile.stages, read.stages, strict=True):
        assert now.extra_bwd_s == {}
        assert now.bwd_transient_bytes == was.bwd_transient_bytes + was.grad_bytes
    fixed = toy_profile.fixed
    assert read.fixed.post_chain_bytes == fixed.post_chain_bytes + fixed.post_chain_grads_bytes
    assert data["schema_version"] == 2
    with pytest.raises(UsageError, match="unknown key"):
        Profile.from_dict({**data, "extra": 1})


def test_profile_format_and_adapter_import_without_torch(toy_profile: Profile) -> None:
    code = (
        "import sys, json\n"
        "sys.modules['torch'] = None\n"
        "from remat.core.profile_format import Profile\n"
        "from remat.core.solve.from_profile import predict_no_checkpoint_peak\n"
        "p = Profile.from_dict(json.loads(sys.stdin.read()))\n"
        "assert predict_no_checkpoint_peak(p) == p.predicted_peak_bytes\n"
        "assert 'torch' not in {m.split('.')[0] for m in sys.modules if sys.modules[m]}\n"
    )
    src = str(Path(__file__).resolve().parents[1] / "src")
    done = subprocess.run(
        [sys.executable, "-c", code],
        input=toy_profile.to_json(),
        capture_output=True,
        text=True,
        env={"PYTHONPATH": src},
        check=False,
    )
    assert done.returncode == 0, done.stderr


def test_prediction_comes_from_the_simulator(toy_profile: Profile) -> None:
    problem = problem_from_profile(toy_profile)
    peak = simulate(no_checkpoint_plan(toy_profile), problem).peak_bytes
    assert toy_profile.predicted_peak_bytes == peak
    assert problem.measured_no_checkpoint_peak_bytes == toy_profile.measured_peak_bytes


# -- the no-checkpoint peak ---------------------------------------------------------------

SMALL = {
    "gpt": dict(n_layer=2, n_embd=32, n_head=2, block_size=64, vocab_size=64, batch_size=4),
    "mlp-hetero": dict(n_blocks=4, d_model=32, expansion=16, batch_size=32),
    "convnet-bn": dict(n_blocks=3, channels=8, image_size=16, batch_size=4),
}
@pytest.fixture(scope="module")
def small_profiles() -> dict[str, Profile]:
    found = {}
    for spec, options in SMALL.items():
        model, batch, loss_fn = load_model(spec, **options)
        found[spec] = profile(model, batch, loss_fn, repeats=1)
    return found


@pytest.mark.parametrize("spec", list(SMALL))
def test_no_checkpoint_peak_predicted_within_3_percent(
    spec: str, small_profiles: dict[str, Profile]
) -> None:
    result = small_profiles[spec]
    assert result.prediction_error is not None
    assert abs(result.prediction_error) <= 0.03, result.prediction_error


@pytest.mark.parametrize("spec", list(SMALL))
def test_gradient_parts_add_up_to_the_trackers_total(
    spec: str, small_profiles: dict[str, Profile]
) -> None:
    # The cost model charges each part at its creator's backward; none is left over to
    # charge early (Problem.unattributed_grads_bytes), and the optimizer step has its own.
    result = small_profiles[spec]
    fixed = result.fixed
    parts = sum(s.grad_bytes for s in result.stages)
    assert parts > 0 and fixed.post_chain_grads_bytes > 0
    assert parts + fixed.pre_chain_grads_bytes + fixed.post_chain_grads_bytes == fixed.grads_bytes
    problem = problem_from_profile(result)
    assert problem.unattributed_grads_bytes == 0
    assert problem.optimizer_step_bytes == fixed.optimizer_step_bytes > 0
    assert [s.saves_input for s in problem.stages] == [s.saves_input for s in result.stages]


@pytest.mark.parametrize("spec", list(SMALL))
def test_planner_keeps_everything_when_the_memory_allows(
    spec: str, small_profiles: dict[str, Profile]
) -> None:
    result = small_profiles[spec]
    problem = problem_from_profile(result)
    none = simulate(no_checkpoint_plan(result), problem)
    # 20 slots above the peak: the DP rounds what each stage holds up to whole slots
    budget = none.peak_bytes + (none.peak_bytes - problem.backward_base_bytes) // 25
    plan = solvers.optimal(problem, budget)
    assert plan.regions == () and plan.options == ("keep",) * problem.n
    # every selective option costs time now, saving nothing the most
    nothing = solvers.selective_everywhere(problem, "save-nothing")
    assert seconds(nothing) > none.step_time_s
    # so saving memory is never free: a little less than the peak costs something (half
    # way down to the least peak: on convnet-bn that is 97% of the peak, once the
    # selective replays that need more than keep's backward are not offered)
    tighter = solvers.optimal(
        problem, (none.peak_bytes + solvers.minimum_budget(problem)) // 2
    )
    assert seconds(tighter) > none.step_time_s


def seconds(plan: Any) -> float:
    assert plan.predicted_step_time_s is not None
    return float(plan.predicted_step_time_s)


# -- batch scaling -----------------------------------------------------------------------


def _mlp(batch_size: int) -> Any:
    return load_model("mlp-hetero", **{**SMALL["mlp-hetero"], "batch_size": batch_size})


def test_scaling_predicts_twice_the_batch_within_5_percent() -> None:
    b = SMALL["mlp-hetero"]["batch_size"]
    fitted = profile_scaling(_mlp, (b, b // 2), repeats=1)
    assert fitted.batch_size == b and fitted.scaling is not None
    assert at_batch_size(fitted, b).stages == fitted.stages  # the fit passes through b
    model, batch, loss_fn = _mlp(2 * b)
    measured = measure_step(model, batch, loss_fn).peak_bytes
    predicted = at_batch_size(fitted, 2 * b)
    assert predicted.predicted_peak_bytes is not None
    assert abs(predicted.predicted_peak_bytes / measured - 1) <= 0.05
    # activations scale exactly: the fitted saved bytes at 2b match a profile at 2b
    direct = profile(*_mlp(2 * b), repeats=1)
    for a, c in zip(predicted.stages, direct.stages, strict=True):
        assert a.saved_bytes == c.saved_bytes and a.boundary_bytes == c.boundary_bytes
    assert predicted.fixed.params_bytes == direct.fixed.params_bytes


# -- the command line --------------------------------------------------------------------

TINY_GPT = [
    "--model",
    "gpt",
    "--set",
    "n_layer=2",
    "--set",
    "n_embd=32",
    "--set",
    "block_size=16",
    "--set",
    "vocab_size=64",
    "--batch-size",
    "2",
    "--repeats",
    "1",
]


def test_cli_prints_the_table_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "p.json"
    assert main(["profile", *TINY_GPT, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    for text in (
        "blocks.0",
        "blocks.1",
        "boundary",
        "keep",
        "matmuls",
        "measured",
        "predicted",
        "optimizer state",
    ):
        assert text in out
    data = json.loads(path.read_text())
    assert data["batch_size"] == 2 and data["model"].startswith("gpt")
    assert [s["name"] for s in data["stages"]] == ["blocks.0", "blocks.1"]
    assert Profile.from_dict(data).stage_names == ("blocks.0", "blocks.1")


def test_cli_bad_stage_path_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", *TINY_GPT, "--stages", "blocks.0,blocks.9"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("remat profile: error:") and "blocks.9" in err
    assert "\n" not in err and "Traceback" not in err
    assert captured.out == ""


def test_a_selective_option_profiles_without_save_nothing_asked_for() -> None:
    """The replay save-nothing's step measures (for stages an option does not touch) is
    not priced when save-nothing itself was not asked for."""
    model, batch, loss_fn = load_model("gpt", n_layer=2, n_embd=32, n_head=2, block_size=16,
                                       vocab_size=64, batch_size=2)
    found = profile(model, batch, loss_fn, repeats=1,
                    options=["keep", "selective:save-attention"])
    assert all(set(s.saved_bytes) == {"keep", "selective:save-attention"}
               for s in found.stages)
