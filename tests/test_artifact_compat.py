"""Every artifact an earlier remat wrote still reads, and reads back to what it wrote.

``tests/fixtures/written_by_e30cf25/`` holds a plan (with ``made_for``), two profiles
(schema 2: one fitted at two batch sizes with timed rounds; a UNet with reads, holds,
identities and spreads) and a per-rank FSDP2 problem, all written by remat at commit
e30cf25, before the record stack was shared (issue 16). The other fixtures are older
(profile schema 1, problem schema 1 and 2, a plan from before ``made_for``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from remat.core.plan_format import Plan
from remat.core.profile_format import Profile, StageProfile
from remat.core.solve.from_profile import problem_from_profile
from remat.core.solve.problem import Problem, StageCost
from remat.core.stage_record import StageRecord

FIXTURES = Path(__file__).parent / "fixtures"
WRITTEN = FIXTURES / "written_by_e30cf25"
KINDS = {"plan": Plan, "profile": Profile, "problem": Problem}


def _kind(path: Path) -> type[Plan] | type[Profile] | type[Problem]:
    return KINDS[path.name.split("_")[0]]


#: Top-level keys renamed since: the problem's took the profile's names (issue 50, item 5).
RENAMED = {"problem": {"optimizer_bytes": "optimizer_state_bytes", "input_bytes": "inputs_bytes"}}


@pytest.mark.parametrize("path", sorted(WRITTEN.glob("*.json")), ids=lambda p: p.name)
def test_files_written_by_an_earlier_main_read_back_to_the_same_json(path: Path) -> None:
    written = json.loads(path.read_text())
    kind = _kind(path)
    artifact = kind.load(path)
    renamed = RENAMED.get(kind.artifact, {})
    assert artifact.to_dict() == {renamed.get(k, k): v for k, v in written.items()}


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.json")), ids=lambda p: p.name)
def test_older_fixtures_still_read(path: Path) -> None:
    kind = Problem if path.name.startswith("chain_") else _kind(path)
    artifact = kind.load(path)
    assert kind.from_dict(artifact.to_dict()) == artifact  # and round-trip in today's schema


def test_the_profile_stage_and_the_problem_stage_are_one_record() -> None:
    shared = {f.name for f in dataclasses.fields(StageRecord)}
    assert issubclass(StageProfile, StageRecord) and issubclass(StageCost, StageRecord)
    # each shared field is declared once, on the base record, not again on a subclass
    for record in (StageProfile, StageCost):
        assert not shared & set(vars(record).get("__annotations__", {})), record.__name__
    # the one function that derives a problem stage from a profile stage keeps the rest
    profile = Profile.load(WRITTEN / "profile_v2_unet.json")
    problem = problem_from_profile(profile)
    for ours, theirs in zip(profile.stages, problem.stages, strict=True):
        for name in shared - {"boundary_bytes", "output_bytes", "saved_bytes", "rebuild_s",
                              "extra_bwd_s"}:
            assert getattr(ours, name) == getattr(theirs, name), name


def test_a_bad_shared_field_is_named_alike_in_both_records() -> None:
    from remat.core.errors import UsageError

    base = {"name": "h.0", "boundary_bytes": 8, "output_bytes": 8, "saved_bytes": {"keep": 4}}
    with pytest.raises(UsageError, match=r"^profile stage 'h.0' fwd_s=-1 is not a time"):
        StageProfile(**base, fwd_s=-1)
    with pytest.raises(UsageError, match=r"^stage 'h.0' fwd_s=-1 is not a time"):
        StageCost(**base, fwd_s=-1)
    with pytest.raises(UsageError, match=r"^stage 'h.0' grad_bytes=-3 is not a byte count"):
        StageCost(**base, grad_bytes=-3)
    assert StageCost(**{**base, "grad_bytes": "1KiB"}).grad_bytes == 1024  # problems take sizes
    with pytest.raises(UsageError, match=r"^profile stage 'h.0' grad_bytes='1KiB' is not a byte"):
        StageProfile(**{**base, "grad_bytes": "1KiB"})
