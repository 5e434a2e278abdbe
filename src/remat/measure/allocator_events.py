"""The second memory instrument: the allocator's events, as torch.profiler records them.

The live-storage tracker (:mod:`remat.measure.tracker`) is a dispatch mode. Dynamo does
not compile a frame under one, and it does not follow FSDP2's parameters (DTensors whose
gathered storage is resized in place, outside any op). Where it cannot look, a step's
memory is read from ``torch.profiler.profile(profile_memory=True)`` instead: every
allocation (positive bytes) and free (negative bytes) on one device, in time order. The
caller adds the bytes alive when recording started (the profiler sees only changes).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import torch

__all__ = ["AllocatorEvents", "running_peak"]


@contextmanager
def _stderr_silenced() -> Iterator[None]:
    """Kineto prints a line to the C-level stderr when a profiler starts and stops."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


_primed = False


def _prime_unknown_free_warning() -> None:
    """Spend torch's one-time warning about freeing a block allocated before the profiler
    started, silently: windows over compiled calls (remat.measure.compiled_calls) free
    such blocks by design, and the tracker supplies those frees itself."""
    global _primed
    if _primed:
        return
    _primed = True
    from torch.profiler import profile

    with _stderr_silenced(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        block = torch.empty(1)
        with profile(profile_memory=True):
            del block


class AllocatorEvents:
    """Records the allocator's events on ``device`` while the ``with`` block runs.

    On a normal exit, :attr:`events` holds ``(start_ns, bytes)`` pairs sorted by time:
    positive for an allocation, negative for a free. A CUDA device with an index keeps
    only that device's events; ``torch.device("cuda")`` keeps every CUDA device's.
    :attr:`profile` keeps the finished ``torch.profiler.profile`` for readers that need
    more of each event (its address and thread: ``remat.distributed``).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.events: list[tuple[int, int]] = []
        self.profile: Any = None
        self._prof: Any = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def __enter__(self) -> AllocatorEvents:
        from torch.profiler import ProfilerActivity, profile

        _prime_unknown_free_warning()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._prof = profile(activities=activities, profile_memory=True)
        with _stderr_silenced():
            self._prof.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        prof, self._prof = self._prof, None
        with _stderr_silenced():
            prof.__exit__(None, None, None)
        if exc_type is None:
            self.events = self._read(prof)
            self.profile = prof

    def _read(self, prof: Any) -> list[tuple[int, int]]:
        from torch.autograd import DeviceType

        wanted = DeviceType.CUDA if self.cuda else DeviceType.CPU
        index = self.device.index if self.cuda else None
        results: Any = prof.profiler.kineto_results
        return sorted(
            (e.start_ns(), e.nbytes())
            for e in results.events()
            if e.name() == "[memory]" and e.device_type() == wanted
            and (index is None or e.device_index() == index)
        )

    def allocated_bytes(self) -> int:
        """Bytes allocated during the block and still alive at its end."""
        return sum(nbytes for _, nbytes in self.events)


def running_peak(start_bytes: int, events: Iterable[tuple[int, int]]) -> int:
    """The highest of ``start_bytes`` plus the running sum of the events' bytes."""
    live = peak = start_bytes
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak
