"""A budget that holds the step without checkpointing plans no checkpointing (issue 47, item 4).

The no-checkpoint peak is predicted to the byte (the loss and its gradient counted once:
docs/cost-model.md, assumption 14), so ``--budget 100%`` of the measured peak holds the
plan without checkpointing, and the solvers choose it: no region, every stage keeping.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import remat
from remat.core.errors import CheckFailed
from remat.core.plan_format import KEEP, Plan
from remat.core.profile_format import Profile
from remat.core.solve import Problem, simulate, solve
from remat.core.solve.from_profile import no_checkpoint_plan, problem_from_profile
from remat.measure.step import measure_step
from remat.models import load_model
from remat.profiling.profiler import profile

FIXTURES = Path(__file__).parent / "fixtures"
CHAINS = sorted(p.stem.removeprefix("chain_") for p in FIXTURES.glob("chain_*.json"))


def _checkpoints_nothing(plan: Plan) -> bool:
    return not plan.regions and all(o == KEEP for o in plan.options)


@pytest.mark.parametrize("solver", ["optimal", "segments-optimal"])
@pytest.mark.parametrize("slots", [3, 7, 500])
@pytest.mark.parametrize("name", CHAINS)
def test_budget_equal_to_the_no_checkpoint_peak_plans_no_checkpointing(
    name: str, slots: int, solver: str
) -> None:
    problem = Problem.load(FIXTURES / f"chain_{name}.json")
    problem = Problem.from_dict({**problem.to_dict(), "slots": slots})
    none = simulate(Plan(problem.stage_names), problem).peak_bytes
    plan = solve(solver, problem, none)
    assert _checkpoints_nothing(plan), (plan.regions, plan.options)
    assert plan.predicted_peak_bytes == none
    # a byte less: the solvers must checkpoint something (or, in a few slots, find nothing)
    try:
        tighter = solve(solver, problem, none - 1)
    except CheckFailed:
        return
    assert not _checkpoints_nothing(tighter)


def test_the_loss_is_counted_once_at_the_post_chain_events() -> None:
    """The post-chain's figures are measured from the chain's end with the loss alive; the
    backward residue joins after the post-chain's backward event, never in forward."""
    tiny = Profile.load(FIXTURES / "profile_mlp_tiny.json")
    residue = tiny.fixed.backward_residue_bytes
    assert residue > 0
    problem = problem_from_profile(tiny)
    assert problem.backward_residue_bytes == residue
    assert problem.pre_chain_bytes == tiny.fixed.pre_chain_bytes
    sim = simulate(no_checkpoint_plan(tiny), problem)
    lives = dict(zip(sim.labels, sim.live, strict=False))
    base = problem.params_bytes + problem.optimizer_state_bytes + problem.inputs_bytes
    assert lives["forward pre-chain"] == base + problem.pre_chain_bytes + \
        problem.stages[0].boundary_bytes
    backward = sim.labels.index("backward post-chain")
    after = sim.live[backward + 1]  # the last stage's backward: the residue is alive there
    without = Problem.from_dict({**problem.to_dict(), "backward_residue_bytes": 0})
    sim0 = simulate(no_checkpoint_plan(tiny), without)
    assert sim0.live[backward] == sim.live[backward]
    assert after - sim0.live[backward + 1] == residue


@pytest.fixture(scope="module")
def gpt2() -> Profile:
    model, batch, loss_fn = load_model("gpt", n_layer=2)
    return profile(model, batch, loss_fn, repeats=1)


def test_no_checkpoint_peak_of_gpt_predicted_to_the_byte(gpt2: Profile) -> None:
    problem = problem_from_profile(gpt2)
    sim = simulate(no_checkpoint_plan(gpt2), problem)
    # the peak is the post-chain's, where the loss used to be counted twice (8 bytes over)
    assert sim.peak_event.endswith("post-chain"), sim.peak_event
    assert gpt2.predicted_peak_bytes == sim.peak_bytes
    assert gpt2.predicted_peak_bytes == gpt2.measured_peak_bytes


def test_gpt_at_100_percent_plans_no_checkpointing(gpt2: Profile) -> None:
    plan = remat.plan(gpt2, "100%")
    assert _checkpoints_nothing(plan), (plan.regions, plan.options)
    assert plan.predicted_peak_bytes == gpt2.measured_peak_bytes


@pytest.mark.parametrize("spec, options", [
    ("mlp-hetero", dict(n_blocks=4, d_model=32, expansion=16, batch_size=32)),
    ("gpt", dict(n_layer=2, n_embd=32, n_head=2, block_size=64, vocab_size=64, batch_size=4)),
    # BatchNorm stages: keep's backward transient once carried the buffers a rebuild
    # clones (16 bytes per channel and 8 per BatchNorm over at the last block's backward)
    ("convnet-bn", dict(n_blocks=2, n_stages=1, channels=16, image_size=8)),
    ("resnet", dict(width=8, image_size=16, batch_size=4)),
])
def test_tiny_model_at_100_percent_plans_no_checkpointing(spec: str, options: dict) -> None:
    model, batch, loss_fn = load_model(spec, **options)
    measured = profile(model, batch, loss_fn, repeats=1)
    assert measured.predicted_peak_bytes == measured.measured_peak_bytes
    plan = remat.plan(measured, "100%")
    assert _checkpoints_nothing(plan), (plan.regions, plan.options)


class _Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def test_a_sequential_fed_the_batch_itself_counts_its_first_input_once() -> None:
    # README's "Your own model": the first stage's input is the batch, alive from the
    # step's start (Note [The first input at the start]); it was counted twice
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(_Block(32) for _ in range(4)))
    batch = torch.randn(64, 32)
    measured = profile(model, batch, lambda m, b: m(b).pow(2).mean(), repeats=1)
    assert measured.fixed.first_input_at_start_bytes == batch.nbytes
    assert measured.predicted_peak_bytes == measured.measured_peak_bytes
    plan = remat.plan(measured, "100%")
    assert _checkpoints_nothing(plan), (plan.regions, plan.options)


def test_a_sequential_fed_the_batch_is_exact_under_a_plan() -> None:
    # under a plan the peak moves to stage 0's backward, where the simulator counts the
    # input's gradient, which a batch that needs none never gets (README's example: 512 KiB
    # over at 'backward 0')
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(_Block(32) for _ in range(4)))
    batch = torch.randn(64, 32)

    def loss_fn(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b).pow(2).mean()

    measured = profile(model, batch, loss_fn, repeats=1)
    plan = Plan(measured.stage_names, ((1, 2), (2, 4)),
                ("selective:save-nothing", "keep", "keep", "keep"))
    predicted = simulate(plan, problem_from_profile(measured))
    assert predicted.peak_event == "backward 0", predicted.peak_event
    handle = remat.apply(model, plan)
    step = measure_step(model, batch, loss_fn, torch.optim.AdamW(model.parameters()))
    handle.remove()
    assert predicted.peak_bytes == step.peak_bytes
