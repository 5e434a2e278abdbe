"""The one-level segment solver: the fastest *flat* plan under a budget (torch-free).

A flat plan is a set of disjoint regions over the chain, none inside another, with every
stage under ``keep``: what ``segments-k`` and ``every-k`` choose from, at the best split.
It is the top-level recursion of :mod:`remat.solve.dp` (Note [The recursion]) with the
inside of each region fixed to bare keep stages, so a region ``[k, stop)`` is two
numbers: the time of its inside (its stages' rebuilds, summed from ``k``) and the least
memory its inside needs, both built up stage by stage as ``stop`` grows. No table is
indexed by pairs of stages: the memory is ``O(n M)`` and the work ``O(n L M)`` at most,
``L`` the longest region that fits (every stage a region holds takes at least a slot, so
``L <= M``), and far less with the compiled kernel's pruning (Note [Pruning] in
:mod:`remat.solve.dp_numba`). Chains of ten thousand stages solve in well under a second.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from remat.solve.dp import INF, KEEP, Model, _shift

__all__ = ["FlatInputs", "FlatTables", "flat_plan", "flat_tables"]


@dataclass(frozen=True)
class FlatInputs:
    """Per-stage numbers (each stage under ``keep``) in slots, from the :class:`Model`.

    ``*_in[h, p]``: stage ``p`` inside a region, ``h = 1`` when it is the region's first
    (the region holds its input). ``g[e]``: gradients alive during a forward in a level
    ending at ``e``.
    """

    n: int
    q: int
    gs: int
    ob: int
    ovh_s: float
    post: int
    after: int
    a: np.ndarray
    g: np.ndarray
    nt: np.ndarray
    hold_b: np.ndarray
    need_b: np.ndarray
    t_b: np.ndarray
    rh: np.ndarray
    hold_in: np.ndarray
    bwd_in: np.ndarray
    fb_in: np.ndarray
    t_in: np.ndarray

    @classmethod
    def of(cls, model: Model) -> FlatInputs:
        n = model.n
        keep = [model.kinds[k].index(KEEP) for k in range(n)]
        i64 = np.int64

        def per_h(f: object) -> np.ndarray:
            return np.array(
                [[f(p, keep[p], h) for p in range(n)] for h in (0, 1)],  # type: ignore[operator]
                dtype=i64,
            )

        return cls(
            n=n,
            q=model.q,
            gs=model.gs,
            ob=model.ob,
            ovh_s=model.ovh_s,
            post=model.post,
            after=model.after,
            a=np.array(model.a, dtype=i64),
            g=np.array([model.grads_during(e) for e in range(n + 1)], dtype=i64),
            nt=np.array([s.nosave_peak_extra_bytes for s in model.problem.stages], dtype=i64),
            hold_b=np.array([model.hold(k, keep[k], 0) for k in range(n)], dtype=i64),
            need_b=np.array(
                [
                    max(model.bwd(k, keep[k], 0), model.fwd(k, keep[k], 0, None) - model.gs)
                    for k in range(n)
                ],
                dtype=i64,
            ),
            t_b=np.array([model.t_top[k][keep[k]] for k in range(n)]),
            rh=np.array([model.hold_open(k, 0) for k in range(n)], dtype=i64),
            hold_in=per_h(model.hold),
            bwd_in=per_h(model.bwd),
            fb_in=per_h(lambda p, j, h: model.inp(p, h) + model.a[p + 1] + model.tf[p][j]),
            t_in=np.array([model.t_run[k][keep[k]] for k in range(n)]),
        )


class FlatTables:
    """``top[k, m]``: the least time of a flat plan for stages ``k..n-1`` in ``m`` slots."""

    def __init__(self, inputs: FlatInputs, top: np.ndarray) -> None:
        self.inputs = inputs
        self.top = top


def region_row(fi: FlatInputs, k: int) -> tuple[np.ndarray, np.ndarray]:
    """For every stop ``k+1..n``: the time of region ``[k, stop)`` beyond its rest (its
    overhead and its stages' rebuilds, summed from ``k``) and the least memory it needs.

    A stage ``p`` of the region runs its events on top of what ``k..p-1`` hold; the
    largest forward over ``p`` is ``ceil((max_p(H_p q + fwd bytes) + g(stop)) / q)``
    since each ``H_p`` is whole slots.
    """
    n, q = fi.n, fi.q
    ps = np.arange(k, n)
    h = (ps == k).astype(np.int64)
    holds = fi.hold_in[h, ps]
    before = np.concatenate(([0], np.cumsum(holds)[:-1]))
    worst_b = np.maximum.accumulate(before + fi.bwd_in[h, ps])
    worst_f = np.maximum.accumulate(before * q + fi.fb_in[h, ps])
    inner_need = np.maximum(worst_b, -(-(worst_f + fi.g[ps + 1]) // q))
    own = np.where(ps > k, fi.a[ps], 0) + fi.a[ps + 1] + fi.nt[ps]
    region_fwd = -(-(fi.a[k] + np.maximum.accumulate(own)) // q) - fi.gs
    need = np.maximum(region_fwd, inner_need + fi.rh[k] + fi.ob)
    return fi.ovh_s + np.cumsum(fi.t_in[k:]), need


def _bare(fi: FlatInputs, top: np.ndarray, k: int) -> np.ndarray:
    best = fi.t_b[k] + _shift(top[k + 1], int(fi.hold_b[k]))
    best[: min(int(fi.need_b[k]), best.shape[0])] = INF
    return best


def numpy_flat(fi: FlatInputs, max_slots: int) -> np.ndarray:
    """The ``top`` table with one vector operation per start (the reference path)."""
    n, M = fi.n, max_slots
    ms = np.arange(M + 1)
    top = np.full((n + 1, M + 1), INF)
    top[n] = np.where(ms >= fi.post, 0.0, INF)
    for k in range(n - 1, -1, -1):
        best = _bare(fi, top, k)
        cost, need = region_row(fi, k)
        fits = np.flatnonzero(need <= M)
        if fits.size:
            stops = fits + k + 1
            rows = cost[fits, None] + _shift(top[stops], int(fi.rh[k]))
            rows[ms[None, :] < need[fits, None]] = INF
            np.minimum(best, rows.min(axis=0), out=best)
        top[k] = best
    top[0, : min(fi.after, M + 1)] = INF  # the events after the chain
    return top


def flat_tables(model: Model, max_slots: int, path: str = "auto") -> FlatTables:
    """Fill ``top`` (``path``: ``numba`` when installed, else ``numpy``; bitwise equal)."""
    fi = FlatInputs.of(model)
    if path == "auto":
        from remat.solve import dp_numba

        path = "numba" if dp_numba.available() else "numpy"
    if path == "numba":
        from remat.solve import dp_numba

        return FlatTables(fi, dp_numba.numba_flat(fi, max_slots))
    return FlatTables(fi, numpy_flat(fi, max_slots))


def flat_plan(t: FlatTables, m: int) -> list[tuple[int, int]]:
    """The regions of the flat plan behind ``t.top[0, m]`` (every stage keeps)."""
    fi, top = t.inputs, t.top
    regions: list[tuple[int, int]] = []
    assert np.isfinite(top[0, m])
    k = 0
    while k < fi.n:
        target = top[k, m]
        held = m - int(fi.hold_b[k])
        if m >= fi.need_b[k] and held >= 0 and fi.t_b[k] + top[k + 1, held] == target:
            m, k = held, k + 1
            continue
        cost, need = region_row(fi, k)
        rh = int(fi.rh[k])
        stops = np.arange(k + 1, fi.n + 1)
        ok = (need <= m) & (m - rh >= 0)
        values = np.where(ok, cost + top[stops, max(m - rh, 0)], INF)
        stop = k + 1 + int(np.flatnonzero(values == target)[0])
        regions.append((k, stop))
        m, k = m - rh, stop
    return regions
