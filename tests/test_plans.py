"""Plan builders: the classic recipes as Plans over the discovered stages."""

from __future__ import annotations

import pytest
from torch import nn

from remat import plans
from remat.core.errors import UsageError
from remat.core.plan_format import Plan, Region


def chain(n: int) -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(n))
    return model


def spans(plan: Plan) -> list[tuple[int, int]]:
    return [(r.start, r.stop) for r in plan.regions]


def test_none_and_per_stage() -> None:
    model = chain(4)
    p = plans.none(model)
    assert p.stages == ("layers.0", "layers.1", "layers.2", "layers.3")
    assert p.regions == () and set(p.options) == {"keep"}
    assert p.solver == "none"
    assert spans(plans.per_stage(model)) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_every_k_checkpoints_every_kth_stage_alone() -> None:
    model = chain(7)
    assert spans(plans.every(model, 2)) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert spans(plans.every(model, 3)) == [(0, 1), (3, 4), (6, 7)]
    assert spans(plans.every(model, 1)) == spans(plans.per_stage(model))


def test_segments_default_to_sqrt_n_near_equal_regions() -> None:
    assert spans(plans.segments(chain(16))) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert spans(plans.segments(chain(10), 3)) == [(0, 3), (3, 7), (7, 10)]
    assert spans(plans.segments(chain(5), 5)) == [(i, i + 1) for i in range(5)]
    with pytest.raises(UsageError, match="from 1 to 5, got 6"):
        plans.segments(chain(5), 6)


def test_uniform_groups_last_group_shorter() -> None:
    assert spans(plans.uniform_groups(chain(10), 4)) == [(0, 4), (4, 8), (8, 10)]


def test_selective_sets_every_option() -> None:
    p = plans.selective(chain(3))
    assert p.regions == ()
    assert p.options == ("selective:save-matmuls",) * 3
    assert plans.selective(chain(2), "save-attention").options[0] == "selective:save-attention"


def test_stages_override_and_errors() -> None:
    model = chain(4)
    p = plans.per_stage(model, stages=["layers.1", "layers.3"])
    assert p.stages == ("layers.1", "layers.3")
    assert p.regions == (Region(0, 1), Region(1, 2))
    with pytest.raises(UsageError, match="no submodule"):
        plans.none(model, stages=["layers.9"])
    for bad in (0, -1, 1.5, True):
        with pytest.raises(UsageError, match="whole number from 1 to 4"):
            plans.every(model, bad)  # type: ignore[arg-type]


def test_plans_round_trip_through_json() -> None:
    for p in (plans.segments(chain(9)), plans.every(chain(5), 2), plans.selective(chain(2))):
        assert Plan.from_json(p.to_json()) == p
