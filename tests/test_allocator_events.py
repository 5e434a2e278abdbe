"""remat.measure.allocator_events: the allocator's events, as bench and distributed read them."""

from __future__ import annotations

import pytest
import torch

from remat.measure.allocator_events import AllocatorEvents, running_peak


def test_a_kept_and_a_freed_tensor_give_the_bytes_alive_and_the_peak() -> None:
    with AllocatorEvents("cpu") as recording:
        kept = torch.empty(1 << 16, dtype=torch.uint8)  # 64 KiB, alive at the end
        freed = torch.empty(1 << 18, dtype=torch.uint8)  # 256 KiB, freed inside
        del freed
    assert kept.numel() == 1 << 16
    assert recording.allocated_bytes() == 1 << 16
    times = [t for t, _ in recording.events]
    assert times == sorted(times)
    assert running_peak(1000, recording.events) == 1000 + (1 << 16) + (1 << 18)


def test_a_block_that_raises_leaves_no_events() -> None:
    recording = AllocatorEvents(torch.device("cpu"))
    try:
        with recording:
            torch.empty(1 << 10)
            raise KeyError("inside")
    except KeyError:
        pass
    assert recording.events == [] and not recording.cuda


def test_the_running_peak_is_the_highest_running_sum_from_the_start() -> None:
    assert running_peak(5, []) == 5
    assert running_peak(5, [(0, 3), (1, -8), (2, 4)]) == 8


def test_the_profilers_start_and_stop_lines_stay_off_stderr(
    capfd: pytest.CaptureFixture[str],
) -> None:
    capfd.readouterr()
    with AllocatorEvents("cpu"):
        torch.empty(1 << 10)
    assert capfd.readouterr().err == ""
