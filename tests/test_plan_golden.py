"""Plans from the fixtures are byte-identical to the ones an earlier main wrote.

The files under ``tests/fixtures/plans/`` were written by ``remat plan`` (profile
fixtures) and ``remat.plan`` (problem fixtures) at commit e30cf25, before the planning
core moved into ``remat.core``; a refactor that changes any plan, any predicted figure or
any JSON key fails here. ``solve_time_s`` is a wall-clock reading, so both sides replace
it with 0.0 before comparing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from remat.cli import main

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN = FIXTURES / "plans"

# (golden file name, fixture, budget, solver, extra arguments)
CASES: list[tuple[str, str, str, str, tuple[str, ...]]] = [
    ("mlp_tiny_optimal_100", "profile_mlp_tiny.json", "100%", "optimal", ()),
    ("mlp_tiny_optimal_99KiB", "profile_mlp_tiny.json", "99KiB", "optimal", ()),
    ("mlp_tiny_per_stage", "profile_mlp_tiny.json", "100%", "per-stage", ()),
    ("mlp_tiny_every_2", "profile_mlp_tiny.json", "100%", "every-k", ("--k", "2")),
    ("mlp_tiny_min_peak", "profile_mlp_tiny.json", "100%", "min-peak", ()),
    ("tiny_optimal_45", "chain_tiny_3.json", "45", "optimal", ()),
    ("hetero_optimal_60", "chain_hetero_6.json", "60%", "optimal", ()),
    ("hetero_segments_2", "chain_hetero_6.json", "100%", "segments-k", ("--k", "2")),
    ("hetero_selective", "chain_hetero_6.json", "100%", "selective-everywhere", ()),
    ("uniform_optimal_50", "chain_uniform_8.json", "50%", "optimal", ()),
    ("gpt2_optimal_60", "chain_gpt2_12.json", "60%", "optimal", ()),
    ("gpt2_megatron_block", "chain_gpt2_12.json", "100%", "megatron-block",
     ("--num-layers", "6")),
]


def _without_clock(text: str) -> str:
    assert text.count('"solve_time_s"') == 1, "a plan file has exactly one solve time"
    return re.sub(r'"solve_time_s": [^,\n}]+', '"solve_time_s": 0.0', text)


def plan_json(tmp: Path, fixture: str, budget: str, solver: str,
              extra: tuple[str, ...]) -> str:
    """The plan JSON for one case: `remat plan` for a profile, remat.plan for a problem."""
    source = FIXTURES / fixture
    out = tmp / "plan.json"
    if fixture.startswith("profile_"):
        code = main(["plan", "--profile", str(source), f"--budget={budget}",
                     "--solver", solver, *extra, "--json", str(out)])
        assert code == 0, f"remat plan exited {code}"
        return out.read_text()
    import remat
    from remat.core.solve import Problem

    params = {extra[i].lstrip("-").replace("-", "_"): int(extra[i + 1])
              for i in range(0, len(extra), 2)}
    chosen = remat.plan(Problem.load(source), budget, solver, **params)
    return chosen.to_json()


@pytest.mark.parametrize(("name", "fixture", "budget", "solver", "extra"), CASES,
                         ids=[case[0] for case in CASES])
def test_plan_json_is_unchanged(tmp_path: Path, name: str, fixture: str, budget: str,
                                solver: str, extra: tuple[str, ...]) -> None:
    written = plan_json(tmp_path, fixture, budget, solver, extra)
    golden = (GOLDEN / f"{name}.json").read_text()
    assert _without_clock(written) == _without_clock(golden)
