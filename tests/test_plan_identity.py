"""Plans know their model: ``made_for`` is recorded, checked by apply, verify and the CLI.

A plan records its stages' classes and parameter fingerprints (remat.core.model_identity);
``remat.apply`` refuses it on a model whose stages differ, before touching the model,
warns when the model has stages the plan leaves out, and ``force=True`` /
``--force-plan`` apply it anyway. Plans written before ``made_for`` existed still load.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat import plans
from remat.cli import main
from remat.core.errors import UsageError
from remat.core.model_identity import MadeFor, StageIdentity
from remat.core.plan_format import Plan, Region
from remat.core.planner import made_for
from remat.core.profile_format import LinearFit, Profile, Scaling
from remat.core.transforms import at_batch_size
from remat.models import load_model
from remat.runtime.identity import model_stages, stage_identity
from remat.runtime.install import applied

FIXTURES = Path(__file__).parent / "fixtures"
# Written by `remat plan` at main f0776c6, before plans recorded what they were made for:
#   remat plan --model gpt --set n_layer=4 --set n_embd=32 --set block_size=16
#     --set vocab_size=64 --batch-size 2 --budget 95% --json <this file>
OLD_PLAN = FIXTURES / "plan_gpt4_before_made_for.json"
OLD_PLAN_GPT = {"n_layer": 4, "n_embd": 32, "block_size": 16, "vocab_size": 64, "batch_size": 2}

TINY_GPT = {"n_embd": 32, "n_head": 4, "block_size": 16, "vocab_size": 64, "batch_size": 2}
pytestmark = pytest.mark.usefixtures("one_thread")

TINY_MLP = {"d_model": 32, "expansion": 4, "depth": 2, "batch_size": 2}


def gpt(n_layer: int) -> tuple[nn.Module, Any, Any]:
    return load_model("gpt", n_layer=n_layer, **TINY_GPT)


@pytest.fixture(scope="module")
def gpt8_profile() -> Profile:
    torch.set_num_threads(1)
    model, batch, loss_fn = gpt(8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return remat.profile(model, batch, loss_fn, repeats=1, description="gpt n_layer=8")


@pytest.fixture(scope="module")
def gpt8_plan(gpt8_profile: Profile) -> Plan:
    return remat.plan(gpt8_profile, None, "per-stage")


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Everything apply could change: the module tree, tensors, hooks, instance forwards."""
    return {
        "tree": repr(model),
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "hooks": [
            (name, len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
             "forward" in m.__dict__)
            for name, m in model.named_modules()
        ],
        "training": model.training,
    }


def assert_untouched(model: nn.Module, before: dict[str, Any]) -> None:
    after = snapshot(model)
    assert after["tree"] == before["tree"]
    assert after["hooks"] == before["hooks"]
    assert after["training"] == before["training"]
    assert after["state"].keys() == before["state"].keys()
    for key, value in before["state"].items():
        assert torch.equal(after["state"][key], value), key
    assert not applied(model)
    with pytest.raises(UsageError, match="no remat plan is applied"):
        remat.remove(model)


def identity_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [
        str(w.message) for w in record
        if "the plan" in str(w.message) or "made for" in str(w.message)
    ]


# -- what a plan records ----------------------------------------------------------------


def test_a_profiled_plan_records_its_model(gpt8_profile: Profile, gpt8_plan: Plan) -> None:
    made = gpt8_plan.made_for
    assert made is not None and made.stages is not None
    assert made.model == "gpt n_layer=8"
    assert made.model_stages == 8
    assert made.batch_shapes == ((2, 16), (2, 16))  # (idx, targets)
    assert made.profile_sha256 == gpt8_profile.digest() and len(made.profile_sha256) == 16
    assert {s.cls for s in made.stages} == {"Block"}
    assert made.stages[0].summary == "Block(32->128->32, 12.7K params)"
    assert len({s.fingerprint for s in made.stages}) == 1  # identical blocks
    # and it survives the round trip through JSON, with the profile's own identities
    assert Plan.from_json(gpt8_plan.to_json()) == gpt8_plan
    assert Profile.from_json(gpt8_profile.to_json()) == gpt8_profile
    assert gpt8_profile.stages[3].identity == made.stages[3]


def test_the_fingerprint_follows_shapes_and_dtypes_not_values() -> None:
    a, b = nn.Linear(4, 8), nn.Linear(4, 8)
    assert stage_identity(a) == stage_identity(b)  # other random weights
    assert stage_identity(a).fingerprint != stage_identity(nn.Linear(4, 9)).fingerprint
    assert stage_identity(a).fingerprint != stage_identity(nn.Linear(4, 8).double()).fingerprint
    assert stage_identity(a).fingerprint != stage_identity(nn.Linear(4, 8, bias=False)).fingerprint
    assert stage_identity(nn.Linear(4, 8).double()).summary == "Linear(4->8, 40 params, float64)"


def test_the_profile_digest_changes_with_the_profile(gpt8_profile: Profile) -> None:
    other = replace(gpt8_profile, step_s=gpt8_profile.step_s + 1.0)
    assert other.digest() != gpt8_profile.digest()
    assert made_for(other).profile_sha256 == other.digest()


def test_batch_shapes_follow_the_batch_size_fit(gpt8_profile: Profile) -> None:
    # profile_scaling fits every number that differs between two batch sizes, the batch
    # shapes' leading sizes included; at_batch_size must set them like any other number
    fitted = replace(gpt8_profile, scaling=Scaling(
        (2, 4), {"batch_shapes.0.0": LinearFit(0.0, 1.0), "batch_shapes.1.0": LinearFit(0.0, 1.0)}
    ))
    assert at_batch_size(fitted, 6).batch_shapes == ((6, 16), (6, 16))


# -- apply refuses a plan made for another model -------------------------------------------


def test_a_gpt_plan_on_mlp_hetero_is_refused_with_one_sentence(gpt8_plan: Plan) -> None:
    model, _, _ = load_model("mlp-hetero", n_blocks=8, **TINY_MLP)
    before = snapshot(model)
    with pytest.raises(UsageError) as err:
        remat.apply(model, gpt8_plan)
    message = str(err.value)
    assert message == (
        "the plan made for gpt n_layer=8 does not fit this model: stage blocks.0 is "
        "Block(32->128->32, 12.7K params) in the plan and HeteroBlock(kind='w', 132 params) "
        "here (8 of 8 stages differ); make a plan for this model with remat plan, or pass "
        "--force-plan (force=True) to apply it anyway"
    )
    assert_untouched(model, before)


def test_a_plan_naming_paths_the_model_lacks_is_refused_naming_its_model(
    gpt8_plan: Plan, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A plan made for a model whose stages live elsewhere (a UNet's down_blocks.0.resnets.0
    # on an MLP): remat.verify had looked the paths up for its compile check before apply
    # checked them, and `remat verify` ended in "unexpected error: AttributeError".
    elsewhere = replace(gpt8_plan, stages=tuple(f"layers.{i}" for i in range(8)))
    expected = ("the plan made for gpt n_layer=8 does not fit this model: it names stage "
                "'layers.0', which HeteroMLP has no submodule at; make a plan for this model "
                "with remat plan")
    model, batch, loss_fn = load_model("mlp-hetero", n_blocks=8, **TINY_MLP)
    before = snapshot(model)
    for run in (lambda: remat.apply(model, elsewhere),
                lambda: remat.verify(model, batch, elsewhere, loss_fn, steps=1)):
        with pytest.raises(UsageError) as err:
            run()
        assert str(err.value) == expected
        assert_untouched(model, before)
    path = tmp_path / "plan.json"
    elsewhere.save(path)
    hetero = ["--model", "mlp-hetero", "--set", "n_blocks=8", "--set", "d_model=32",
              "--set", "expansion=4", "--set", "depth=2", "--batch-size", "2"]
    assert main(["verify", *hetero, "--plan", str(path), "--steps", "1"]) == 2
    assert capsys.readouterr().err.strip() == f"remat verify: error: {expected}"


def test_a_plan_for_wider_blocks_is_refused(gpt8_plan: Plan) -> None:
    model, _, _ = load_model("gpt", n_layer=8, **{**TINY_GPT, "n_embd": 64})
    before = snapshot(model)
    with pytest.raises(UsageError, match=re.escape(
        "stage blocks.0 is Block(32->128->32, 12.7K params) in the plan and "
        "Block(64->256->64, 50.0K params) here"
    )):
        remat.apply(model, gpt8_plan)
    assert_untouched(model, before)


def test_another_dtype_is_refused(gpt8_plan: Plan) -> None:
    model = gpt(8)[0].to(torch.bfloat16)
    with pytest.raises(UsageError, match=re.escape("Block(32->128->32, 12.7K params, bfloat16)")):
        remat.apply(model, gpt8_plan)
    assert not applied(model)


class Scaled(nn.Module):
    """Same parameters whatever ``n``; a buffer of length ``n``: the summary cannot tell."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("table", torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.table.sum()


def test_a_difference_the_summary_does_not_show_names_the_fingerprints() -> None:
    made = nn.Sequential(Scaled(3), Scaled(3))
    plan = plans.per_stage(made)
    other = nn.Sequential(Scaled(3), Scaled(5))
    with pytest.raises(UsageError, match=r"stage 1 is Scaled\(4->4, 20 params\) in the plan and "
                       r"here, but its parameter or buffer shapes or dtypes differ \(fingerprint "
                       r"[0-9a-f]{12} in the plan, [0-9a-f]{12} here\)"):
        remat.apply(other, plan)
    remat.apply(copy.deepcopy(made), plan).remove()  # the model it was made for is fine


def test_a_saved_builder_plan_is_checked_too(tmp_path: Path) -> None:
    model, _, _ = gpt(4)
    path = tmp_path / "plan.json"
    plans.every(model, 2).save(path)
    plan = Plan.load(path)
    assert plan.made_for is not None and plan.made_for.profile_sha256 is None
    assert plan.made_for.model_stages == 4
    hetero, _, _ = load_model("mlp-hetero", n_blocks=4, **TINY_MLP)
    with pytest.raises(UsageError, match=r"stage blocks\.0 is Block"):
        remat.apply(hetero, plan)
    remat.apply(model, plan).remove()


# -- the same model, and one with more stages -----------------------------------------------


def test_the_same_model_passes_without_a_word(gpt8_plan: Plan) -> None:
    model, batch, loss_fn = gpt(8)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        handle = remat.apply(model, gpt8_plan)
    assert identity_warnings(record) == []
    loss_fn(model, batch).backward()
    assert handle.rebuilds == 8  # per-stage: each region rebuilt once
    handle.remove()


def test_a_model_with_more_stages_is_reported(gpt8_plan: Plan) -> None:
    model, batch, loss_fn = gpt(12)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        handle = remat.apply(model, gpt8_plan)
    assert identity_warnings(record) == [
        "the plan names 8 stages; this model has 12 (blocks.8..blocks.11 are not "
        "checkpointed); make a plan for this model to include them"
    ]
    loss_fn(model, batch).backward()
    assert handle.rebuilds == 8
    handle.remove()


def test_a_plan_over_part_of_the_chain_is_not_reported_on_its_own_model() -> None:
    model, _, _ = gpt(8)
    plan = plans.per_stage(model, stages=["blocks.0", "blocks.1"])
    assert plan.made_for is not None and plan.made_for.model_stages == 8
    assert model_stages(model, plan.stages) == tuple(f"blocks.{i}" for i in range(8))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        remat.apply(model, plan).remove()
    assert identity_warnings(record) == []
    bigger, _, _ = gpt(10)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        remat.apply(bigger, plan).remove()
    assert identity_warnings(record) == [
        "the plan names 2 stages; this model has 10 (blocks.2..blocks.9 are not "
        "checkpointed); make a plan for this model to include them"
    ]


# -- the override ---------------------------------------------------------------------------


def test_force_applies_a_plan_made_for_another_model(gpt8_plan: Plan) -> None:
    model, batch, loss_fn = load_model("mlp-hetero", n_blocks=8, **TINY_MLP)
    before = snapshot(model)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        handle = remat.apply(model, gpt8_plan, force=True)
    assert [w for w in identity_warnings(record) if "(forced)" in w] == [
        "applied a plan made for gpt n_layer=8 that does not fit this model (forced): stage "
        "blocks.0 is Block(32->128->32, 12.7K params) in the plan and HeteroBlock(kind='w', "
        "132 params) here (8 of 8 stages differ)"
    ]
    loss_fn(model, batch).backward()
    assert handle.rebuilds == 8
    handle.remove()
    assert_untouched(model, before)  # removing the forced plan restores the model too


def test_force_must_be_a_bool(gpt8_plan: Plan) -> None:
    model, _, _ = gpt(8)
    with pytest.raises(UsageError, match="force='yes' is not a bool"):
        remat.apply(model, gpt8_plan, force="yes")  # type: ignore[arg-type]


def test_verify_refuses_and_force_verifies(gpt8_plan: Plan) -> None:
    model, batch, loss_fn = load_model("mlp-hetero", n_blocks=8, **TINY_MLP)
    before = snapshot(model)
    with pytest.raises(UsageError, match="does not fit this model"):
        remat.verify(model, batch, gpt8_plan, loss_fn, steps=1)
    assert_untouched(model, before)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = remat.verify(model, batch, gpt8_plan, loss_fn, steps=1, force=True)
    assert report.ok
    assert_untouched(model, before)


# -- plans from before made_for ---------------------------------------------------------------


def test_an_old_plan_loads_and_applies_unchecked() -> None:
    data = json.loads(OLD_PLAN.read_text())
    assert "made_for" not in data and data["schema_version"] == 1
    plan = Plan.load(OLD_PLAN)
    assert plan.made_for is None
    assert plan.to_dict() == data  # written back as it was: no made_for key appears
    model, batch, loss_fn = load_model("gpt", **OLD_PLAN_GPT)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        handle = remat.apply(model, plan)
        loss_fn(model, batch).backward()
        handle.remove()
        # nothing to check it against: it applies to another model as it always did
        hetero, _, _ = load_model("mlp-hetero", n_blocks=4, **TINY_MLP)
        remat.apply(hetero, plan).remove()
    assert identity_warnings(record) == []
    assert handle.rebuilds == 1  # its one region [1, 2)


def test_a_plan_from_an_old_profile_records_what_it_can(gpt8_profile: Profile) -> None:
    data = gpt8_profile.to_dict()
    for stage in data["stages"]:
        del stage["identity"]
    del data["model_stages"], data["batch_shapes"]
    old = Profile.from_dict(data)
    plan = remat.plan(old, None, "per-stage")
    assert plan.made_for == MadeFor(model="gpt n_layer=8", profile_sha256=old.digest())
    hetero, _, _ = load_model("mlp-hetero", n_blocks=8, **TINY_MLP)
    remat.apply(hetero, plan).remove()  # no stage identities: nothing to refuse


# -- the plan format --------------------------------------------------------------------------


def _with_made_for(made: dict[str, Any]) -> dict[str, Any]:
    data = Plan(("a", "b"), (Region(0, 2),)).to_dict()
    data["made_for"] = made
    return data


STAGE = {"class": "Block", "fingerprint": "0123456789ab", "summary": "Block(4->4)"}
MADE = {"model": "m", "model_stages": 2, "batch_shapes": [[2, 3]], "profile_sha256": None,
        "stages": [STAGE, STAGE]}


def test_made_for_round_trips_and_null_means_unknown() -> None:
    plan = Plan.from_dict(_with_made_for(MADE))
    assert plan.made_for == MadeFor(
        model="m", model_stages=2, batch_shapes=((2, 3),),
        stages=(StageIdentity("Block", "0123456789ab", "Block(4->4)"),) * 2,
    )
    assert plan.to_dict()["made_for"] == MADE
    assert Plan.from_dict(_with_made_for(None)).made_for is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "made,message",
    [
        ({**MADE, "stages": [STAGE]}, r"made_for names 1 stage identities for 2 stages"),
        ({**MADE, "model_stages": 1}, r"made_for model_stages=1 is below the plan's 2 stages"),
        ({**MADE, "extra": 1}, r"made_for has unknown key\(s\) extra"),
        ({k: v for k, v in MADE.items() if k != "model"}, r"missing key\(s\) model"),
        ({**MADE, "stages": [{**STAGE, "fingerprint": "XYZ"}] * 2}, r"not a hex digest"),
        ({**MADE, "batch_shapes": [[2, -1]]}, r"is not a list of shapes"),
        ([1], r"made_for must be a JSON object"),
    ],
)
def test_bad_made_for_is_named(made: Any, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        Plan.from_dict(_with_made_for(made))


def test_made_for_and_the_planner_need_no_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any `import torch` now raises
        "from remat.core.model_identity import MadeFor, StageIdentity\n"
        "from remat.core.plan_format import Plan\n"
        "from remat.core.planner import made_for\n"
        "s = StageIdentity('Block', '0123456789ab', 'Block(4->4)')\n"
        "p = Plan(('a', 'b'), made_for=MadeFor(model='m', stages=(s, s), model_stages=3))\n"
        "assert Plan.from_json(p.to_json()) == p\n"
        "assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules"
        " if sys.modules[m] is not None)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(Path(__file__).parents[1] / "src")},
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stderr


# -- the command line -------------------------------------------------------------------------


def _tiny_gpt_args(n_layer: int) -> list[str]:
    args = ["--model", "gpt", "--set", f"n_layer={n_layer}"]
    for key, value in TINY_GPT.items():
        args += ["--batch-size", str(value)] if key == "batch_size" else ["--set", f"{key}={value}"]
    return args


def test_cli_verify_refuses_names_the_override_and_force_plan_runs(
    gpt8_plan: Plan, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "plan.json"
    gpt8_plan.save(path)
    hetero = ["--model", "mlp-hetero", "--set", "n_blocks=8", "--set", "d_model=32",
              "--set", "expansion=4", "--set", "depth=2", "--batch-size", "2"]
    assert main(["verify", *hetero, "--plan", str(path), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert err.startswith("remat verify: error: the plan made for gpt n_layer=8 does not fit")
    assert "pass --force-plan" in err
    assert main(["verify", *hetero, "--plan", str(path), "--steps", "1", "--force-plan"]) == 0
    out = capsys.readouterr().out
    assert "note: applied a plan made for gpt n_layer=8 that does not fit this model" in out


def test_cli_verify_reports_more_stages_and_notes_an_old_plan(
    gpt8_plan: Plan, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "plan.json"
    gpt8_plan.save(path)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert main(["verify", *_tiny_gpt_args(12), "--plan", str(path), "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "note: the plan names 8 stages; this model has 12 (blocks.8..blocks.11" in out
    assert identity_warnings(record) == []  # said once, as a note, not again as a warning
    old = ["--set", f"n_layer={OLD_PLAN_GPT['n_layer']}", "--set", "n_embd=32", "--set",
           "block_size=16", "--set", "vocab_size=64", "--batch-size", "2"]
    assert main(["verify", "--model", "gpt", *old, "--plan", str(OLD_PLAN), "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "records no model identity" in out


def test_cli_plan_writes_made_for(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    args = ["plan", *_tiny_gpt_args(4), "--solver", "per-stage", "--json", str(out)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(args) == 0
    made = json.loads(out.read_text())["made_for"]
    assert made["model_stages"] == 4 and len(made["stages"]) == 4
    assert made["batch_shapes"] == [[2, 16], [2, 16]]
    assert made["stages"][0]["class"] == "Block"


# -- wrappers that change the class -----------------------------------------------------------


def test_an_fsdp2_sharded_stage_keeps_its_identity(tmp_path: Path) -> None:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model, _, _ = gpt(2)
        before = stage_identity(model.blocks[0])
        fully_shard(model.blocks[0])
        assert type(model.blocks[0]).__name__ == "FSDPBlock"
        assert stage_identity(model.blocks[0]) == before
    finally:
        dist.destroy_process_group()


def test_cli_plan_from_an_old_profile_says_it_cannot_be_checked(
    gpt8_profile: Profile, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = gpt8_profile.to_dict()
    for stage in data["stages"]:
        del stage["identity"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert main(["plan", "--profile", str(path), "--solver", "per-stage"]) == 0
    assert "note: the profile records no stage identities" in capsys.readouterr().out
    gpt8_profile.save(path)
    assert main(["plan", "--profile", str(path), "--solver", "per-stage"]) == 0
    assert "no stage identities" not in capsys.readouterr().out
