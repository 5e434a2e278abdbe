"""Collectives a plan's rebuilds repeat, on paper (remat.core.collectives): the rules
against hand-worked plans; tests/test_tensor_parallel.py checks them against DTensor."""

from __future__ import annotations

import pytest

from remat.core.collectives import StageComms, collective_seconds, rebuilt_collectives
from remat.core.errors import UsageError
from remat.core.plan_format import Plan, Region

AG, RS = ("all_gather_into_tensor", 8), ("reduce_scatter_tensor", 4)
#: a sequence-parallel block: attention and MLP each all-gather and reduce-scatter; a
#: one-stage rebuild stops before the last reduce-scatter
BLOCK = StageComms(forward=(AG, RS, AG, RS), rebuild_last=(AG, RS, AG))
NAMES = ("b0", "b1", "b2", "b3")


def test_a_region_rebuilds_its_inner_stages_whole_and_its_last_as_far_as_backward_needs(
) -> None:
    plan = Plan(NAMES, (Region(0, 3),))
    assert rebuilt_collectives(plan, [BLOCK] * 4) == [BLOCK.forward, BLOCK.forward,
                                                      BLOCK.rebuild_last, ()]


def test_save_collectives_repeats_none_and_other_selective_options_as_a_one_stage_region(
) -> None:
    plan = Plan(NAMES, (), ("selective:save-collectives", "selective:save-nothing",
                            "offload", "keep"))
    assert rebuilt_collectives(plan, [BLOCK] * 4) == [(), BLOCK.rebuild_last, (), ()]
    # inside a region the region rebuilds the stage, whatever its option
    inside = Plan(NAMES, (Region(0, 2),), ("selective:save-collectives",) * 4)
    assert rebuilt_collectives(inside, [BLOCK] * 4) == [BLOCK.forward, BLOCK.rebuild_last,
                                                        (), ()]


def test_nested_regions_and_bad_input_are_refused() -> None:
    with pytest.raises(UsageError, match="nested regions"):
        rebuilt_collectives(Plan(NAMES, (Region(0, 4), Region(1, 3))), [BLOCK] * 4)
    with pytest.raises(UsageError, match="one StageComms per stage"):
        rebuilt_collectives(Plan(NAMES), [BLOCK] * 3)
    with pytest.raises(UsageError, match="first part of its forward"):
        StageComms(forward=(AG, RS), rebuild_last=(RS,))
    with pytest.raises(UsageError, match="above zero"):
        collective_seconds([AG], 0.0)


def test_a_repeated_collective_costs_its_bytes_over_the_link() -> None:
    calls = rebuilt_collectives(Plan(NAMES, (Region(0, 1),)), [BLOCK] * 4)[0]
    assert collective_seconds(calls, 4.0) == pytest.approx((8 + 4 + 8) / 4.0)
