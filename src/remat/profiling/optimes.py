"""What a selective option costs in time: the stage's ops it does not save, rebuilt.

A stage under ``selective:<policy>`` runs in its own checkpoint frame: in backward,
torch replays its forward and every op the policy does not save runs again (the saved
ones come from the cache). So the option costs the time of those ops plus the frame's
fixed cost. Timing each op in a forward pass (:class:`OpTimer`) gives each op's share of
the stage's forward; the share of the ops a policy does not save, times the stage's
measured forward time, is what its rebuild costs. Shares rather than raw sums: per-op
timing runs under the tracker and adds its own per-call overhead, while ``fwd_s`` comes
from plain timed steps.

The ops a policy saves are the runtime's own (:func:`remat.runtime.policies.resolve`:
``MATMUL_OPS``, ``ATTENTION_OPS`` or the listed ops), so the charge follows what the
runtime really caches.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpTimer", "cuda_sync", "policy_op_names", "selective_extra_s", "unsaved_share"]


def policy_op_names(option: str, stage: str) -> frozenset[str]:
    """The aten ops (by name, ``aten.mm.default``) that ``option`` saves in ``stage``."""
    from remat.runtime.policies import resolve

    return frozenset(str(op) for op in resolve(option, stage).ops)


class OpTimer(TorchDispatchMode):
    """Seconds spent in each aten op while stage ``stage`` runs (``None``: not timing).

    Enter it *before* any other dispatch mode (the tracker, torch's selective-checkpoint
    cache): the mode entered first is the last one an op passes through, so the time
    around its ``func(*args)`` is the kernel's alone, not the other modes' bookkeeping.
    On CUDA the device is synchronized around each op (this is a measuring pass).
    """

    def __init__(self, n_stages: int, *, sync: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.stage: int | None = None
        self.seconds: list[dict[str, float]] = [{} for _ in range(n_stages)]
        self._sync = sync

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        stage = self.stage
        if stage is None:
            return func(*args, **kwargs)
        if self._sync is not None:
            self._sync()
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        if self._sync is not None:
            self._sync()
        elapsed = time.perf_counter() - t0
        found = self.seconds[stage]
        name = str(func)
        found[name] = found.get(name, 0.0) + elapsed
        return out


def unsaved_share(samples: Sequence[Mapping[str, float]], saved: frozenset[str]) -> float:
    """The share of a stage's forward time in ops not in ``saved``, in ``[0, 1]``.

    ``samples``: seconds per op from one or more forward passes; each op's time is its
    median over them (an op missing from a pass counts 0 there). No time at all: 1 (the
    whole forward is rebuilt).
    """
    ops = sorted({op for sample in samples for op in sample})
    median = {op: float(statistics.median([s.get(op, 0.0) for s in samples])) for op in ops}
    total = sum(median.values())
    if total <= 0:
        return 1.0
    return sum(t for op, t in median.items() if op not in saved) / total


def selective_extra_s(
    fwd_s: float,
    overhead_s: float,
    samples: Sequence[Mapping[str, float]],
    saved: frozenset[str],
) -> float:
    """Extra backward seconds of a selective option: its unsaved ops rebuilt, one frame."""
    return fwd_s * unsaved_share(samples, saved) + overhead_s


def cuda_sync(device: torch.device | None) -> Callable[[], None] | None:
    """A synchronize for ``device`` if it is an accelerator (else ``None``: CPU is in order)."""
    if device is None or device.type != "cuda":
        return None

    def sync() -> None:
        torch.cuda.synchronize(device)

    return sync
