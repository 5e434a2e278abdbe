"""One name per quantity (issue 50, item 5): the problem's optimizer state and batch fields
have the profile's names, ``optimizer_state_bytes`` and ``inputs_bytes``; problem files
with the old keys (``optimizer_bytes``, ``input_bytes``) still load, and the old attribute
names still read.

``fixtures/problem_v2_written_by_7be8d88.json`` is ``problem_from_profile(...).save(...)``
of an ``mlp-hetero`` profile, written by remat at commit 7be8d88, before the rename.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remat.core.errors import UsageError
from remat.core.plan_format import Plan
from remat.core.solve.problem import Problem, StageCost
from remat.core.solve.simulator import simulate

FIXTURES = Path(__file__).parent / "fixtures"
OLD = FIXTURES / "problem_v2_written_by_7be8d88.json"
RENAMED = {"optimizer_bytes": "optimizer_state_bytes", "input_bytes": "inputs_bytes"}


def _with_new_keys(data: dict) -> dict:
    return {RENAMED.get(k, k): v for k, v in data.items()}


def test_a_problem_written_with_the_old_keys_loads_to_the_same_problem() -> None:
    written = json.loads(OLD.read_text())
    assert written["optimizer_bytes"] > 0 and written["input_bytes"] > 0  # what it tests
    old = Problem.load(OLD)
    new = Problem.from_dict(_with_new_keys(written))
    assert old == new
    assert old.optimizer_state_bytes == written["optimizer_bytes"]
    assert old.inputs_bytes == written["input_bytes"]
    # and it plans the same: the simulator counts both fields
    plan = Plan(old.stage_names)
    assert simulate(plan, old).peak_bytes == simulate(plan, new).peak_bytes
    assert old.measured_no_checkpoint_peak_bytes == simulate(plan, old).peak_bytes


def test_the_new_keys_are_written_and_the_old_ones_not() -> None:
    data = Problem.load(OLD).to_dict()
    assert {"optimizer_state_bytes", "inputs_bytes"} <= data.keys()
    assert not {"optimizer_bytes", "input_bytes"} & data.keys()
    assert Problem.from_dict(data) == Problem.load(OLD)


def test_a_schema_1_problem_with_the_old_keys_loads() -> None:
    data = json.loads((FIXTURES / "chain_tiny_3.json").read_text())
    assert data["schema_version"] == 1 and "optimizer_bytes" in data
    problem = Problem.from_dict(data)
    assert (problem.optimizer_state_bytes, problem.inputs_bytes) == (
        data["optimizer_bytes"], data["input_bytes"])


@pytest.mark.parametrize(("old", "new"), sorted(RENAMED.items()))
def test_a_file_with_both_names_of_a_field_is_an_error_naming_both(old: str, new: str) -> None:
    data = json.loads(OLD.read_text())
    data[new] = data[old]
    with pytest.raises(UsageError, match=rf"^the problem has both '{old}' and '{new}'.*"
                                         rf"keep only '{new}'$"):
        Problem.from_dict(data)


def test_the_old_attribute_names_read_the_new_fields() -> None:
    stage = StageCost("s0", 4, 4, {"keep": 8})
    problem = Problem((stage,), optimizer_state_bytes=24, inputs_bytes=3)
    assert problem.optimizer_bytes == problem.optimizer_state_bytes == 24
    assert problem.input_bytes == problem.inputs_bytes == 3
    loaded = Problem.load(OLD)
    assert loaded.optimizer_bytes == loaded.optimizer_state_bytes
    assert loaded.input_bytes == loaded.inputs_bytes
