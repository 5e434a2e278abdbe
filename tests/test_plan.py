"""remat.core.plan_format: validation, the region tree, JSON; importable without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from remat.core.errors import UsageError
from remat.core.plan_format import POLICIES, SCHEMA_VERSION, Option, Plan, Region, parse_option

SRC = Path(__file__).resolve().parents[1] / "src"
NAMES = tuple(f"h.{i}" for i in range(8))
TREE = Plan(
    NAMES,
    regions=(Region(4, 8), Region(0, 4), Region(0, 8), Region(2, 4), Region(0, 2), Region(6, 7)),
    options=("keep", "selective:save-matmuls", "offload", "selective:mm,addmm.default")
    + ("keep",) * 4,
)


def test_plan_module_imports_with_torch_unavailable() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any `import torch` now raises
        "from remat.core.plan_format import Plan, Region\n"
        "p = Plan(('a', 'b'), (Region(0, 2),))\n"
        "assert Plan.from_json(p.to_json()) == p\n"
        "assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules"
        " if sys.modules[m] is not None)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(SRC)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


# -- Region and options -----------------------------------------------------------------


@pytest.mark.parametrize("start,stop", [(2, 2), (3, 1), (-1, 2), (0.0, 1), (True, 2)])
def test_region_rejects_empty_negative_and_non_integer_bounds(start: object, stop: object) -> None:
    with pytest.raises(UsageError, match="region"):
        Region(start, stop)  # type: ignore[arg-type]


def test_region_basics() -> None:
    r = Region(2, 5)
    assert str(r) == "[2, 5)" and len(r) == 3
    assert 2 in r and 4 in r and 5 not in r and 1 not in r
    assert r.covers(Region(3, 5)) and r.covers(r) and not r.covers(Region(1, 3))


@pytest.mark.parametrize(
    "text,parts",
    [
        ("keep", ("keep", None, ())),
        ("offload", ("offload", None, ())),
        *[(f"selective:{p}", ("selective", p, ())) for p in POLICIES],
        ("selective:mm", ("selective", None, ("mm",))),
        ("selective:mm,addmm,bmm", ("selective", None, ("mm", "addmm", "bmm"))),
        ("selective:convolution.default", ("selective", None, ("convolution.default",))),
    ],
)
def test_parse_option_accepts(text: str, parts: tuple[str, str | None, tuple[str, ...]]) -> None:
    parsed = parse_option(text)
    assert isinstance(parsed, Option) and parsed == text  # a str, equal to what was written
    assert (parsed.kind, parsed.policy, parsed.ops) == parts
    assert (parsed.is_keep, parsed.is_offload, parsed.is_selective) == (
        parts[0] == "keep", parts[0] == "offload", parts[0] == "selective")
    assert parse_option(parsed) is parsed  # parsed once


@pytest.mark.parametrize("text,budget", [("selective:budget=0.5", 0.5),
                                         ("selective:budget=0", 0.0),
                                         ("selective:budget=.25", 0.25)])
def test_parse_option_reads_a_partitioner_budget(text: str, budget: float) -> None:
    parsed = parse_option(text)
    assert parsed == text and parsed.is_selective and parsed.is_partitioned
    assert (parsed.budget, parsed.policy, parsed.ops) == (budget, None, ())
    assert not parse_option("selective:save-nothing").is_partitioned


@pytest.mark.parametrize("text", ["selective:budget=1", "selective:budget=1.0",
                                  "selective:budget=-0.5", "selective:budget=",
                                  "selective:budget=x", "selective:budget=0.5,mm"])
def test_parse_option_rejects_a_budget_outside_0_to_1(text: str) -> None:
    with pytest.raises(UsageError, match=r"fraction from 0 up to \(not including\) 1"):
        parse_option(text)


def test_a_plan_parses_its_options_once_and_they_stay_strings() -> None:
    import json
    import pickle

    plan = Plan(NAMES[:3], options=("keep", "selective:save-matmuls", "offload"))
    assert all(isinstance(o, Option) for o in plan.options)
    assert plan.option(1).policy == "save-matmuls" and plan.option(2).is_offload
    assert plan.options == ("keep", "selective:save-matmuls", "offload")
    assert json.loads(plan.to_json())["options"] == list(plan.options)
    again = pickle.loads(pickle.dumps(plan))  # torchrun ranks broadcast plans
    assert again == plan and again.option(1).is_selective
    with pytest.raises(AttributeError):
        plan.option(0).kind = "offload"  # type: ignore[misc]


@pytest.mark.parametrize(
    "text",
    ["", "Keep", "keep ", "selective", "selective:", "selective:mm,", "selective:m m",
     "selective:mm..x", "selective:1mm", "offload:cpu", None, 3],
)
def test_parse_option_rejects(text: object) -> None:
    with pytest.raises(UsageError, match="is not valid; use keep, offload, or selective"):
        parse_option(text)


# -- Plan validation ----------------------------------------------------------------------


def test_plan_normalizes_regions_and_defaults_options() -> None:
    plan = Plan(list(NAMES[:4]), [(2, 4), (0, 4), [0, 2]])  # type: ignore[arg-type]
    assert plan.stages == NAMES[:4]
    assert plan.regions == (Region(0, 4), Region(0, 2), Region(2, 4))
    assert plan.options == ("keep",) * 4
    assert plan.solver == "manual" and plan.budget_bytes is None


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"regions": [(0, 4), (2, 6)]},
         r"^regions \[0, 4\) and \[2, 6\) overlap partially; regions must nest or be disjoint$"),
        ({"regions": [(0, 3), (1, 4), (1, 2)]}, r"regions \[0, 3\) and \[1, 4\) overlap"),
        ({"regions": [(1, 3), (1, 3)]}, r"region \[1, 3\) is listed twice"),
        ({"regions": [(4, 9)]}, r"region \[4, 9\) reaches past the last stage"),
        ({"regions": ["0-2"]}, r"is not a Region or a \(start, stop\) pair"),
        ({"options": ("keep",) * 7}, r"7 options for 8 stages"),
        ({"options": ("keep",) * 7 + ("selective:",)}, r"stage 'h.7': option 'selective:'"),
        ({"stages": ("a", "b", "a")}, r"stage 'a' is listed twice"),
        ({"stages": ("a", "")}, r"stage 1 has name ''"),
        ({"stages": "abc"}, r"is not a list"),
        ({"solver": ""}, r"solver=''"),
        ({"budget_bytes": -1}, r"budget_bytes=-1 is not a byte count"),
        ({"predicted_peak_bytes": 1.5}, r"predicted_peak_bytes=1.5"),
        ({"solve_time_s": float("nan")}, r"solve_time_s=nan is not a time"),
    ],
)
def test_plan_validation_names_the_offender(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"stages": NAMES, **kwargs}
    with pytest.raises(UsageError, match=message):
        Plan(**args)  # type: ignore[arg-type]


# -- The region tree ----------------------------------------------------------------------


def test_children_parent_and_depth_on_a_three_level_tree() -> None:
    assert TREE.regions[:3] == (Region(0, 8), Region(0, 4), Region(0, 2))
    assert TREE.children() == (Region(0, 8),)
    assert TREE.children(Region(0, 8)) == (Region(0, 4), Region(4, 8))
    assert TREE.children(Region(0, 4)) == (Region(0, 2), Region(2, 4))
    assert TREE.children(Region(4, 8)) == (Region(6, 7),)
    assert TREE.children(Region(0, 2)) == ()
    assert TREE.parent(Region(0, 8)) is None
    assert TREE.parent(Region(2, 4)) == Region(0, 4)
    assert TREE.parent(Region(6, 7)) == Region(4, 8)
    assert [TREE.depth(i) for i in range(8)] == [3, 3, 3, 3, 2, 2, 3, 2]
    with pytest.raises(UsageError, match=r"region \[1, 2\) is not in this plan"):
        TREE.parent(Region(1, 2))
    with pytest.raises(UsageError, match="stage index 8 is out of range"):
        TREE.depth(8)


intervals = st.lists(
    st.tuples(st.integers(0, 7), st.integers(1, 4)).map(lambda t: (t[0], min(8, t[0] + t[1]))),
    max_size=7,
)


@given(intervals)
def test_tree_helpers_agree_with_brute_force(pairs: list[tuple[int, int]]) -> None:
    regions = [Region(*p) for p in pairs]
    laminar = len(set(regions)) == len(regions) and all(
        a.stop <= b.start or b.stop <= a.start or a.covers(b) or b.covers(a)
        for a in regions
        for b in regions
    )
    if not laminar:
        with pytest.raises(UsageError):
            Plan(NAMES, tuple(regions))
        return
    plan = Plan(NAMES, tuple(regions))
    assert sorted(plan.regions) == sorted(regions)
    for i in range(8):
        assert plan.depth(i) == sum(i in r for r in regions)
    for r in regions:
        containers = [c for c in regions if c != r and c.covers(r)]
        assert plan.parent(r) == (min(containers, key=len) if containers else None)
        assert set(plan.children(r)) == {c for c in regions if plan.parent(c) == r}
    assert set(plan.children()) == {r for r in regions if plan.parent(r) is None}
    assert Plan.from_json(plan.to_json()) == plan


# -- JSON -----------------------------------------------------------------------------------


def test_to_dict_has_the_documented_keys_and_round_trips(tmp_path: Path) -> None:
    plan = Plan(
        NAMES, TREE.regions, TREE.options, solver="dp", budget_bytes=1 << 30,
        predicted_peak_bytes=123, predicted_step_time_s=0.5, baseline_step_time_s=0.4,
        solve_time_s=0.01,
    )
    data = plan.to_dict()
    assert list(data) == [
        "schema_version", "solver", "budget_bytes", "predicted_peak_bytes",
        "predicted_step_time_s", "baseline_step_time_s", "solve_time_s", "stages", "regions",
        "options",
    ]
    assert data["schema_version"] == SCHEMA_VERSION == 1
    assert data["regions"][:2] == [[0, 8], [0, 4]]
    assert Plan.from_dict(json.loads(json.dumps(data))) == plan
    assert Plan.from_json(plan.to_json()) == plan
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    assert json.loads(path.read_text()) == data


def _data(**changes: object) -> dict[str, object]:
    data = TREE.to_dict()
    data.update(changes)
    return data


@pytest.mark.parametrize(
    "data,message",
    [
        (_data(schema_version=2), r"plan schema version 2 is not supported"),
        ({k: v for k, v in _data().items() if k not in ("options", "solver")},
         r"missing key\(s\) solver, options"),
        ({k: v for k, v in _data().items() if k != "schema_version"}, r"missing key\(s\) schema"),
        (_data(extra=1), r"unknown key\(s\) extra"),
        (_data(regions=[[0, 2, 3]]), r"region \[0, 2, 3\] is not a \[start, stop\] pair"),
        (_data(stages="h.0"), r"plan key 'stages' must be a list"),
        (_data(regions=[[0, 4], [2, 6]]), r"overlap partially"),
        ([1, 2], r"must be a JSON object"),
    ],
)
def test_from_dict_rejects_bad_data(data: object, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        Plan.from_dict(data)  # type: ignore[arg-type]


def test_from_json_and_load_report_unreadable_input(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not valid JSON"):
        Plan.from_json("{")
    with pytest.raises(UsageError, match="cannot read plan file"):
        Plan.load(tmp_path / "missing.json")
