"""The optimal solver's tables compiled with numba (a dependency; numpy where it is missing).

The same candidates, in the same arithmetic, as :func:`remat.core.solve.dp.numpy_tables`
(Note [The recursion]): each value is ``t + rest`` or ``(t + inner) + rest`` in IEEE
double, with no fast-math, and ``min`` is exact, so the tables are bitwise equal to the
numpy and Python paths (tested). What differs is how much is evaluated.

Note [Pruning]
--------------
Every row is non-increasing in ``m`` (more memory never costs time), and so is each
candidate over its window ``[lo, hi]``: ``lo`` the first slot where it is feasible, ``hi``
the first from which both rows it reads are constant (``first`` and ``sat``, kept per
row), after which it stays at its least value ``vmin``. The kernel keeps the running
minimum ``best`` non-increasing by applying each candidate exactly (its window, then
``vmin`` beyond ``hi`` for as long as ``best`` is higher), so ``best`` exceeds ``vmin``
on a prefix of the slots: a candidate whose ``vmin`` is not below ``best[lo]`` is skipped
outright, and otherwise only the slots before ``best`` drops to ``vmin`` (found by
bisection) are evaluated. Skipping only slots where the candidate cannot be lower keeps
the tables exact.

The kernel (:mod:`remat.core.solve._dp_kernel`) compiles on first use, a few seconds, once:
numba caches it on disk. It fills the tables tile by tile in anti-diagonal waves (Note
[Table layout]), with :func:`solver_threads` threads sharing each wave; the order of the
cells changes nothing in them.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from remat.core.errors import UsageError
from remat.core.solve.dp import Model, Tables

if TYPE_CHECKING:
    from remat.core.solve.flat_inputs import FlatInputs

__all__ = ["available", "numba_flat", "numba_tables", "solver_threads"]

_KERNEL: Any = None
BLOCK = 16  # columns per tile (Note [Table layout])
ROWS = 8  # starts per tile


def solver_threads() -> int:
    """Threads for the table fill: ``REMAT_SOLVER_THREADS`` when set, else 2 when a core
    is idle (the one-minute load average is below the number of cores less one), else 1.

    Two threads fill the tables about 1.4x faster on an idle two-core machine, but when
    another job holds one of the cores, each wave waits for the thread that shares it
    and the fill took 1.7x as long as with one thread (benchmarks/solver_speed.md).
    """
    text = os.environ.get("REMAT_SOLVER_THREADS")
    if text is not None:
        if not text.strip().isdigit() or int(text) < 1:
            raise UsageError(
                f"REMAT_SOLVER_THREADS={text!r} is not a whole number >= 1; unset it or "
                "give a thread count such as 1 or 2"
            )
        return int(text)
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available on this platform
        return 1
    return 2 if cores >= 2 and load < cores - 1 else 1


def available() -> bool:
    """Whether numba can be imported."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def _kernel() -> Any:
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    cache = Path(__file__).with_name("__pycache__")
    if not any(cache.glob("_dp_kernel.fill-*.nbi")):
        print(
            "remat: compiling the optimal solver's numba kernel (once; cached on disk)...",
            file=sys.stderr,
            flush=True,
        )
    import remat.core.solve._dp_kernel as _dp_kernel

    _KERNEL = _dp_kernel
    return _KERNEL


def numba_tables(model: Model, max_slots: int, threads: int | None = None) -> Tables:
    """Fill the same tables as :func:`remat.core.solve.dp.numpy_tables` with a compiled loop
    (``threads``: default :func:`solver_threads`)."""
    with _torch_threads_kept():
        return _numba_tables(model, max_slots, threads)


class _torch_threads_kept:
    """torch's thread count as on entry, again on exit, if the caller imported torch.

    numba's OpenMP threading layer sets the process's OpenMP thread count, which torch's
    CPU ops share: after a solve under ``--threads 1`` torch ran on two threads (on a
    loaded two-core machine the measured steps then took up to 15x as long). Read
    through ``sys.modules``: the planning core never imports torch itself.
    """

    def __enter__(self) -> None:
        self.torch = sys.modules.get("torch")
        self.threads = self.torch.get_num_threads() if self.torch is not None else None

    def __exit__(self, *exc: object) -> None:
        if self.torch is not None and self.torch.get_num_threads() != self.threads:
            self.torch.set_num_threads(self.threads)


def _numba_tables(model: Model, max_slots: int, threads: int | None) -> Tables:
    import numba

    workers = solver_threads() if threads is None else threads
    workers = max(1, min(workers, numba.get_num_threads()))
    fill = _kernel().fill
    t = Tables(model, max_slots)
    n, M = model.n, max_slots
    width = max(len(o) for o in model.kinds)
    nopt = np.array([len(o) for o in model.kinds], dtype=np.int64)
    kinds = np.full((n, width), -1, dtype=np.int64)
    t_run = np.zeros((n, width))
    t_open = np.zeros((n, width))
    bwd = np.zeros((n, width, 2, 2), dtype=np.int64)  # [..., runs]
    fwd_base = np.zeros((n, width, 2), dtype=np.int64)
    hold = np.zeros((n, width, 2), dtype=np.int64)
    hold_open = np.zeros((n, 2), dtype=np.int64)
    inp = np.zeros((n + 1, 2), dtype=np.int64)
    for k in range(n):
        for h in (0, 1):
            hold_open[k, h] = model.hold_open(k, h)
            inp[k, h] = model.inp(k, h)
        for j, kind in enumerate(model.kinds[k]):
            kinds[k, j] = kind
            t_run[k, j] = model.t_run[k][j]
            t_open[k, j] = model.t_open[k][j]
            for h in (0, 1):
                bwd[k, j, h, 0] = model.bwd(k, j, h, runs=False)
                bwd[k, j, h, 1] = model.bwd(k, j, h)
                hold[k, j, h] = model.hold(k, j, h)
                # fwd(k, j, h, e) = ceil((this + a_e + T(e)) / q)
                fwd_base[k, j, h] = model.inp(k, h) + model.a[k + 1] + model.tf[k][j]
    pairs = t.seg0.shape[0]
    # first[s, r]: the first finite slot of row r of seg0 (s = 0), seg1 (1) and segp (2);
    # sat[s, r]: the first slot from which that row is constant up to M.
    first = np.full((3, pairs), M + 1, dtype=np.int64)
    sat = np.zeros((3, pairs), dtype=np.int64)
    for e in range(n + 1):
        first[0, t.k0(e, e)] = 0  # Seg(h, e, e) = 0; SegP(e, e) is never read
        first[1, t.k1(e, e)] = 0
    ns = np.array(model.ns, dtype=np.int64)
    fill(t.seg0, t.seg1, t.segp, t.kbase, t.ebase, first, sat, n, M, BLOCK, ROWS, workers,
         model.early_stop, model.q, nopt, kinds, t_run, t_open, bwd, fwd_base, hold, hold_open, inp,
         np.array(model.a, dtype=np.int64),
         # the kernel reads sg only in a level's forward, with the rebuild's gradients
         np.array(model.sg, dtype=np.int64) + np.array(model.rg, dtype=np.int64),
         np.array(model.reb), ns,
         np.array(model.ao_cost), np.array(model.ao_need, dtype=np.int64), model.opens, model.ob)
    need_top = np.full((n, width), M + 1, dtype=np.int64)
    t_top = np.zeros((n, width))
    for k in range(n):
        for j in range(len(model.kinds[k])):
            need_top[k, j] = max(model.bwd(k, j, 0), model.fwd(k, j, 0, None) - model.gs)
            t_top[k, j] = model.t_top[k][j]
    _kernel().fill_top(t.top, t.seg1, t.kbase, first[1], n, M, model.post, model.after, model.gs,
                       model.q, nopt, t_top, need_top, hold[:, :, 0], hold_open[:, 0], inp[:, 0],
                       np.array(model.ns_top, dtype=np.int64), model.opens, model.ob)
    return t


def numba_flat(fi: FlatInputs, max_slots: int) -> np.ndarray:
    """The one-level solver's ``top`` table, bitwise equal to ``flat.numpy_flat``."""
    with _torch_threads_kept():
        return _numba_flat(fi, max_slots)


def _numba_flat(fi: FlatInputs, max_slots: int) -> np.ndarray:
    top = np.empty((fi.n + 1, max_slots + 1))
    _kernel().flat_fill(top, max_slots, fi.q, fi.gs, fi.ob, fi.ovh_s, fi.post, fi.after, fi.a,
                        fi.g, fi.nt, fi.hold_b, fi.need_b, fi.t_b, fi.rh, fi.hold_in, fi.bwd_in,
                        fi.fb_in, fi.T, fi.S)
    return top
