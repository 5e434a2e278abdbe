"""The second memory instrument: the allocator's events, as torch.profiler records them.

The live-storage tracker (:mod:`remat.measure.tracker`) is a dispatch mode. Dynamo does
not compile a frame under one, and it does not follow FSDP2's parameters (DTensors whose
gathered storage is resized in place, outside any op). Where it cannot look, a step's
memory is read from ``torch.profiler.profile(profile_memory=True)`` instead: every
allocation (positive bytes) and free (negative bytes) on one device, in time order. The
caller adds the bytes alive when recording started (the profiler sees only changes).

Where threads other than the step's allocate too (a data-parallel rank's collectives),
the events are read with their addresses and threads (:meth:`AllocatorEvents.allocations`)
and accounted by address (:func:`account_step`, Note [Steady per-rank peaks]).

Note [Steady per-rank peaks]
----------------------------
``remat.parallel.data_parallel.rank_step_memory`` reads a rank's step from
torch.profiler's allocator events, which record every allocation and free made on a
thread that carries the profiler's state, the step's own thread and the threads a
collective runs on alike. Summed in time order they gave a different peak from run to
run of the same code: what other threads allocate lands before or after the step's own
high point as the scheduler decides, and a free of a block allocated before the
recording (whose size the profiler still knows from an earlier recording) lowers the sum
although the start never counted it. So the events are read with their addresses and
threads and accounted by address (:func:`account_step`):

- the step's threads (the one that ran the step, and any that ran autograd's engine) make
  the peak: the bytes alive at the start plus the highest running sum of their
  allocations and of the frees of those allocations or of storages counted at the start;
- what other threads allocate (gloo's workers) is reported apart, as the most they held
  at once (``other_thread_bytes``), and not added: the per-rank problem does not model
  a backend's internal copies, and where they fall against the step's peak is timing;
- a free of a block that was neither counted at the start nor allocated in the step is
  a leftover of earlier work, left out (``ignored_free_bytes`` says how much);
- a block allocated again at an address still held was freed where no event recorded it,
  so it leaves the sum then.

That last case is the one the accounting cannot place in time: a gloo collective's work
object holds its tensors (FSDP2's all-gather output, its reduce-scatter input), and when
the worker thread drops the work after the step's thread dropped the tensor, the block
is freed on a thread without the profiler's state and no event says so (2 gloo ranks,
FSDP2 with one region per block: in about one step of three, one block's parameters or
gradients, 199,936 bytes, stayed in the sum until its address came back, +6%). A missing
free can only raise a reading, and a clean step shows none: nothing the step's threads
allocated is found again at its address or still counted at the end of a whole training
step. So ``rank_step_memory`` records the step again until every rank has a clean
reading (all ranks run the same steps) and reports how many it took.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

__all__ = ["Allocation", "AllocatorEvents", "EventStepMemory", "account_step", "running_peak"]

#: The autograd engine's per-node annotation; its threads run the step's backward (CUDA).
_ENGINE_MARK = "autograd::engine::evaluate_function"


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
    more of each event (its address and thread: :meth:`allocations`).
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

    def allocations(self, step_mark: str) -> tuple[list[Allocation], set[int]]:
        """Every allocator event on the device in time order, with its address and thread,
        and the threads that ran the step: the one that opened ``step_mark`` (a
        ``record_function`` around the step) and any that ran autograd's engine.

        Read from the profiler's event tree, which has each event's address and thread.
        """
        from torch._C._profiler import _EventType

        if self.profile is None:
            raise RuntimeError("no finished recording to read; call it after the with block")
        events: list[Allocation] = []
        step_threads: set[int] = set()
        pending = list(self.profile.profiler.kineto_results.experimental_event_tree())
        while pending:
            event = pending.pop()
            pending.extend(event.children)
            kind, fields = event.typed
            if kind == _EventType.Allocation:
                if fields.device.type == self.device.type and (
                    self.device.index is None or fields.device.index == self.device.index
                ):
                    events.append(Allocation(event.start_time_ns, fields.alloc_size,
                                             fields.ptr, event.start_tid))
            elif kind == _EventType.TorchOp and (
                event.name == step_mark or event.name.startswith(_ENGINE_MARK)
            ):
                step_threads.add(event.start_tid)
        events.sort(key=lambda e: e.time_ns)
        return events, step_threads


def running_peak(start_bytes: int, events: Iterable[tuple[int, int]]) -> int:
    """The highest of ``start_bytes`` plus the running sum of the events' bytes."""
    live = peak = start_bytes
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


@dataclass(frozen=True)
class Allocation:
    """One allocator event: ``nbytes`` > 0 allocates the block at ``ptr``, < 0 frees it.

    ``thread`` is the profiler's number for the thread that made it (not the OS's).
    """

    time_ns: int
    nbytes: int
    ptr: int
    thread: int


@dataclass(frozen=True)
class EventStepMemory:
    """One training step, read from the allocator's events by address and thread.

    Note [Steady per-rank peaks] says what each figure counts.
    """

    #: The bytes alive at the start plus the highest running sum of the step's threads.
    peak_bytes: int
    #: What was alive at the start: this rank's storages and ``resident_bytes``.
    start_bytes: int
    #: What the wrapper keeps between steps (DDP's buckets), included in ``start_bytes``.
    resident_bytes: int
    #: The most bytes that threads other than the step's (gloo's workers) held at once.
    other_thread_bytes: int
    #: Frees of blocks neither counted at the start nor allocated in the step.
    ignored_free_bytes: int
    #: The reading before the accounting: the start plus the running sum of every event
    #: in time order, whatever its thread or address (for comparison only).
    summed_peak_bytes: int
    #: Bytes the step's threads allocated whose free no event recorded (found again at the
    #: same address, or still counted when the step ended); 0 in a clean reading.
    unmatched_bytes: int = 0
    #: Steps recorded to get this reading (the first clean one, else the lowest).
    attempts: int = 1


def account_step(start_bytes: int, start_storages: dict[int, int],
                 events: Iterable[Allocation], step_threads: set[int], *,
                 resident_bytes: int = 0) -> EventStepMemory:
    """A step's figures from its allocator events (Note [Steady per-rank peaks]).

    ``start_storages`` maps the address of each storage counted in ``start_bytes`` to its
    bytes, so that a free of one of them lowers the sum and a free of anything else older
    than the step does not.
    """
    live: dict[int, tuple[int, bool]] = {}  # address -> (bytes, allocated by the step)
    known = dict(start_storages)
    held = {True: 0, False: 0}
    highest = {True: 0, False: 0}
    ignored = summed = highest_summed = unmatched = 0
    for event in events:
        summed += event.nbytes
        highest_summed = max(highest_summed, summed)
        if event.nbytes > 0:
            stale = live.pop(event.ptr, None)  # freed where no event recorded it
            if stale is not None:
                held[stale[1]] -= stale[0]
                unmatched += stale[0] if stale[1] else 0
            elif event.ptr in known:
                held[True] -= known.pop(event.ptr)
            mine = event.thread in step_threads
            live[event.ptr] = (event.nbytes, mine)
            held[mine] += event.nbytes
            highest[mine] = max(highest[mine], held[mine])
        elif event.ptr in live:
            nbytes, mine = live.pop(event.ptr)
            held[mine] -= nbytes
        elif event.ptr in known:
            held[True] -= known.pop(event.ptr)
        else:
            ignored -= event.nbytes
    return EventStepMemory(
        peak_bytes=start_bytes + highest[True],
        start_bytes=start_bytes,
        resident_bytes=resident_bytes,
        other_thread_bytes=highest[False],
        ignored_free_bytes=ignored,
        summed_peak_bytes=start_bytes + highest_summed,
        unmatched_bytes=unmatched + sum(n for n, mine in live.values() if mine),
    )


