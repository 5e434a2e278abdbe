"""Fixtures and toy models shared by several test files.

Test files import the toy models with ``from conftest import ...`` (pytest puts this
folder on ``sys.path``) and use the fixtures by name.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread in each of pytest-xdist's workers: two workers with two threads
    each on a two-core machine ran the suite slower than one process (12:00 against 11:32)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread for the module's tests, then the count it had before.

    Tiny tensors: threads only add contention on a shared machine. Use it with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Block(nn.Module):
    """x + dropout(tanh(fc(x))): saves little beyond its input (one tensor per stage)."""

    def __init__(self, d: int = 8, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.fc(x)))


class TanhBlock(nn.Module):
    """x + tanh(fc(x)): a clean stage with no dropout module at all."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def mean_square(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The toy loss: the mean of the model's output squared."""
    return model(x).square().mean()


#: What the process server imports once for every launch (a fresh interpreter per launch
#: spent about 3 s importing these on this machine: 0.05 s once the server has them).
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp",
            "torch.distributed.pipelining", "torch.distributed.tensor", "remat",
            "remat.models.gpt"]


def planned_peak(model: nn.Module, batch: Any, loss_fn: Any, plan: Any) -> int:
    """The measured peak of one whole training step of a copy of ``model`` with ``plan``
    applied (the model itself untouched)."""
    import copy

    import remat
    from remat.measure import measure_step

    applied = copy.deepcopy(model)
    handle = remat.apply(applied, plan)
    try:
        return measure_step(applied, batch, loss_fn).peak_bytes
    finally:
        handle.remove()


def stage_maxima(model: nn.Module, batch: Any, loss_fn: Any, plan: Any, phase: Any
                 ) -> dict[str, int]:
    """The most the tracker saw live, per stage of ``plan``, while that stage's ops ran in
    ``phase`` (a ``remat.measure.records.Phase``) of one step of ``model`` with ``plan``
    applied (and removed after)."""
    import remat
    from remat.measure import measure_step

    handle = remat.apply(model, plan)
    try:
        step = measure_step(model, batch, loss_fn, timeline=True)
    finally:
        handle.remove()
    assert step.timeline is not None
    found: dict[str, int] = {}
    for event in step.timeline:
        for name in plan.stages:
            if event.phase is phase and (
                    event.module_path == name or event.module_path.startswith(name + ".")):
                found[name] = max(found.get(name, 0), event.live_bytes)
    return found


def start_ranks(fn: Any, args: tuple[Any, ...], nprocs: int) -> None:
    """``mp.spawn(fn, args, nprocs)``, the processes forked from a server that imported
    torch and remat once (a clean interpreter as spawn's is: it holds nothing the test
    process made, only those modules); spawned where there is no fork server (Windows)."""
    import torch.multiprocessing as mp

    method = "spawn"
    if "forkserver" in multiprocessing.get_all_start_methods():
        method = "forkserver"
        multiprocessing.set_forkserver_preload(_PRELOAD)  # read when the server starts
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method=method)


def launch_ranks(fn: Any, out: Path, world: int, *args: Any) -> Path:
    """Run ``fn(rank, store, out, *args)`` in ``world`` processes (``start_ranks``;
    ``store`` is a file to rendezvous at) and return ``out``, where each rank writes its
    figures."""
    with tempfile.TemporaryDirectory() as rendezvous:
        start_ranks(fn, (os.path.join(rendezvous, "store"), str(out), *args), world)
    return out


def read_ranks(out: Path, world: int) -> list[Any]:
    """Each rank's ``rank{r}.json`` under ``out``."""
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
