"""The one-level segment solver: the fastest *flat* plan under a budget (torch-free).

A flat plan is a set of disjoint regions over the chain, none inside another, with every
stage under ``keep``: what ``segments-k`` and ``every-k`` choose from, at the best split.
It is the top-level recursion of :mod:`remat.solve.dp` (Note [The recursion]) with the
inside of each region fixed to bare keep stages, so a region ``[k, stop)`` is two
numbers: the time of its inside (its stages' rebuilds, summed as the tables sum them)
and the least memory its inside needs. That makes it ``O(n^2)`` work for those and
``O(n^2 M)`` for the top level (``M`` slots), one vector operation per stage, with
no ``O(n^3)`` term: for chains too long for the nested solver.
"""

from __future__ import annotations

import numpy as np

from remat.solve.dp import INF, KEEP, Model, _shift

__all__ = ["flat_plan", "flat_tables"]


class FlatTables:
    """``top[k, m]``: the least time of a flat plan for stages ``k..n-1`` in ``m`` slots."""

    def __init__(self, model: Model, top: np.ndarray, inner_s: np.ndarray,
                 inner_need: np.ndarray, keep: list[int]) -> None:
        self.model = model
        self.top = top
        self.inner_s = inner_s
        self.inner_need = inner_need
        self.keep = keep


def _region_rows(t: FlatTables, k: int, m_all: np.ndarray) -> np.ndarray:
    """One row per stop ``k+1..n``: the time of region ``[k, stop)`` first at each ``m``."""
    model = t.model
    rh = model.hold_open(k, 0)
    stops = np.arange(k + 1, model.n + 1)
    v = (model.ovh_s + t.inner_s[k, stops])[:, None] + _shift(t.top[k + 1:], rh)
    ns = np.array(model.ns[k][k + 1:], dtype=np.int64)
    fwd = -(-(model.inp(k, 0) + ns) // model.q) - model.gs
    need = np.maximum(fwd, t.inner_need[k, stops] + rh + model.ob)
    v[m_all[None, :] < need[:, None]] = INF
    return v


def flat_tables(model: Model, max_slots: int) -> FlatTables:
    n, M = model.n, max_slots
    ms = np.arange(M + 1)
    keep = [model.kinds[k].index(KEEP) for k in range(n)]
    # Inside a region [k, stop) every stage is bare and keeps (h = 1 for the first): its
    # time t_run[k] + (t_run[k+1] + (... + 0.0)), summed from the right as the tables do,
    # and its least memory: the largest event over the stages, each on top of what the
    # stages before it hold.
    inner_s = np.full((n + 1, n + 1), INF)
    inner_need = np.zeros((n + 1, n + 1), dtype=np.int64)
    t_run = np.array([model.t_run[k][keep[k]] for k in range(n)])
    g = np.array([model.grads_during(e) for e in range(n + 1)], dtype=np.int64)
    inner_s[n, n] = 0.0
    for k in range(n - 1, -1, -1):
        inner_s[k, k] = 0.0
        inner_s[k, k + 1:] = t_run[k] + inner_s[k + 1, k + 1:]
    for k in range(n):
        # Stage p of [k, stop): its events on top of what k..p-1 hold (H_p). Its forward
        # is ceil((inp + a_{p+1} + tf + g(stop)) / q) and H_p is whole slots, so the
        # largest forward over p is ceil((max_p(H_p q + fwd bytes) + g(stop)) / q).
        ps = range(k, n)
        hs = [1 if p == k else 0 for p in ps]
        holds = np.array([model.hold(p, keep[p], h) for p, h in zip(ps, hs, strict=True)],
                         dtype=np.int64)
        before = np.concatenate(([0], np.cumsum(holds)[:-1]))
        bwd = np.array([model.bwd(p, keep[p], h) for p, h in zip(ps, hs, strict=True)],
                       dtype=np.int64)
        fb = np.array([model.inp(p, h) + model.a[p + 1] + model.tf[p][keep[p]]
                       for p, h in zip(ps, hs, strict=True)], dtype=np.int64)
        worst_b = np.maximum.accumulate(before + bwd)
        worst_f = np.maximum.accumulate(before * model.q + fb)
        stops = np.arange(k + 1, n + 1)
        inner_need[k, k + 1:] = np.maximum(worst_b, -(-(worst_f + g[stops]) // model.q))
    top = np.full((n + 1, M + 1), INF)
    top[n] = np.where(ms >= model.post, 0.0, INF)
    t = FlatTables(model, top, inner_s, inner_need, keep)
    for k in range(n - 1, -1, -1):
        j = keep[k]
        need = max(model.bwd(k, j, 0), model.fwd(k, j, 0, None) - model.gs)
        best = model.t_top[k][j] + _shift(top[k + 1], model.hold(k, j, 0))
        best[ms < need] = INF
        np.minimum(best, _region_rows(t, k, ms).min(axis=0), out=best)
        top[k] = best
    top[0] = np.where(ms >= model.after, top[0], INF)
    return t


def flat_plan(t: FlatTables, m: int) -> list[tuple[int, int]]:
    """The regions of the flat plan behind ``t.top[0, m]`` (every stage keeps)."""
    model = t.model
    regions: list[tuple[int, int]] = []
    all_m = np.arange(t.top.shape[1])
    assert np.isfinite(t.top[0, m])
    k = 0
    while k < model.n:
        target = t.top[k, m]
        j = t.keep[k]
        need = max(model.bwd(k, j, 0), model.fwd(k, j, 0, None) - model.gs)
        held = m - model.hold(k, j, 0)
        if m >= need and held >= 0 and model.t_top[k][j] + t.top[k + 1, held] == target:
            m, k = held, k + 1
            continue
        rows = _region_rows(t, k, all_m)[:, m]
        stop = k + 1 + int(np.flatnonzero(rows == target)[0])
        regions.append((k, stop))
        m, k = m - model.hold_open(k, 0), stop
    return regions
