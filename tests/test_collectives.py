"""Collectives a plan's rebuilds repeat, on paper (remat.core.collectives): the rules
against hand-worked plans; tests/test_tensor_parallel.py checks them against DTensor."""

from __future__ import annotations

import pytest

from remat.core.collectives import (
    StageComms,
    collective_seconds,
    link_bytes,
    rebuilt_collectives,
)
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


def test_a_repeated_collective_costs_what_a_ring_moves_over_the_link() -> None:
    # NCCL's bus bandwidth: over p ranks an all-gather of S bytes moves S (p-1)/p through
    # each link, a reduce-scatter to S/p shards the same, an all-reduce twice that
    p = 4
    assert link_bytes("all_gather_into_tensor", 8, p) == pytest.approx(8 * 3 / 4)
    assert link_bytes("reduce_scatter_tensor", 2, p) == pytest.approx(8 * 3 / 4)
    assert link_bytes("all_reduce", 8, p) == pytest.approx(2 * 8 * 3 / 4)
    assert link_bytes("all_reduce", 8, 1) == 0.0  # one rank moves nothing
    calls = rebuilt_collectives(Plan(NAMES, (Region(0, 1),)), [BLOCK] * 4)[0]  # AG RS AG
    assert collective_seconds(calls, 4.0, ranks=2) == pytest.approx((4 + 4 + 4) / 4.0)
    with pytest.raises(UsageError, match="not priced"):
        link_bytes("send", 8, 2)
    # the device table gives the links of the accelerators it lists
    from remat.core.devices import get_device

    assert get_device("h100-sxm").link_bytes_per_s == 450e9
    assert get_device("cpu").link_bytes_per_s is None


def test_a_stages_collectives_go_into_its_profile_record_and_back() -> None:
    from remat.core.profile_format import StageProfile

    assert StageComms.from_dict(BLOCK.to_dict()) == BLOCK
    with pytest.raises(UsageError, match="list of \\[op, bytes\\] pairs"):
        StageComms.from_dict({"forward": [["all_reduce", -1]], "rebuild_last": []})
    with pytest.raises(UsageError, match="forward and rebuild_last"):
        StageComms.from_dict({"forward": []})
    stage = StageProfile(name="b0", boundary_bytes=8, output_bytes=8,
                         saved_bytes={"keep": 8}, fwd_s=1.0, bwd_s=1.0, rebuild_s=1.0,
                         fwd_transient_bytes=0, bwd_transient_bytes=0,
                         nosave_transient_bytes=0, grad_bytes=0, output_kept_outside=False,
                         saves_input=False, saves_output=False, comms=BLOCK)
    assert StageProfile.from_dict(stage.to_dict()).comms == BLOCK
    assert "comms" not in StageProfile.from_dict({**stage.to_dict(), "comms": None}).to_dict()
