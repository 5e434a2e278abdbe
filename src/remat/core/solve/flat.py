"""The one-level segment solver: the fastest *flat* plan under a budget (torch-free).

A flat plan is a set of disjoint regions over the chain, none inside another, with every
stage under ``keep``: what ``segments-k`` and ``every-k`` choose from, at the best split.
It is the top-level recursion of :mod:`remat.core.solve.dp` (Note [The recursion]) with the
inside of each region fixed to bare keep stages, so a region ``[k, stop)`` is two
numbers: the time of its inside (its stages' rebuilds) and the least memory its inside
needs, built up stage by stage as ``stop`` grows. No table is indexed by pairs of stages.

Note [Flat records]
-------------------
With ``T[p]`` the inside times of the stages before ``p`` summed plus the links before
stage ``p - 1``'s, and ``S[k]`` those times before ``k`` plus the links before ``k``'s
(``StageCost.link_s``: a region ``[k, stop)`` holds links ``k .. stop-2``), region
``[k, stop)`` followed by the rest in ``m`` slots costs
``(ovh - S[k]) + V[stop, m - rh[k]]`` where ``V[stop, m'] = T[stop] + top[stop, m']``
does not depend on ``k``. Its need is monotone
in ``stop`` but for one term (the gradients alive at ``stop``), so for a slot ``m`` the
stops that fit are a prefix ``k+1..L(m)``, ``L`` read off the running maximum of the needs,
plus a few stops that fit early (their need is below the running maximum), which are
applied one by one. The minimum of ``V`` over a prefix that starts at the newest row is
kept per column as records (a stack: a new row removes every record it is not above), and
read by bisection. Adding the constant after taking the minimum gives the same float as
adding it to each candidate (rounding is monotone), so the compiled kernel, which takes
minima first, and the numpy path, which adds first, fill bitwise equal tables. Work:
``O(n (L + M log n))``, ``L`` the longest region that fits; memory ``O(n M)``.
"""
from __future__ import annotations

import numpy as np

from remat.core.solve.dp import INF, Model, _shift
from remat.core.solve.flat_inputs import FlatInputs

__all__ = ["FlatInputs", "FlatTables", "flat_plan", "flat_tables"]


class FlatTables:
    """``top[k, m]``: the least time of a flat plan for stages ``k..n-1`` in ``m`` slots."""

    def __init__(self, inputs: FlatInputs, top: np.ndarray) -> None:
        self.inputs = inputs
        self.top = top


def region_need(fi: FlatInputs, k: int) -> np.ndarray:
    """For every stop ``k+1..n``: the least memory region ``[k, stop)`` needs.

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
    return np.maximum(region_fwd, inner_need + fi.rh[k] + fi.ob)


def region_values(fi: FlatInputs, k: int, stops: np.ndarray, rest: np.ndarray) -> np.ndarray:
    """``(ovh - S[k]) + (T[stop] + rest)``: region ``[k, stop)`` and the rest after it
    (``rest``: ``top`` of each stop, rows over slots or one slot each), added in the order
    the compiled kernel adds them (Note [Flat records])."""
    at_stop = fi.T[stops].reshape(-1, *(1,) * (rest.ndim - 1))
    return (fi.ovh_s - fi.S[k]) + (at_stop + rest)


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
        need = region_need(fi, k)
        fits = np.flatnonzero(need <= M)
        if fits.size:
            stops = fits + k + 1
            rows = region_values(fi, k, stops, _shift(top[stops], int(fi.rh[k])))
            rows[ms[None, :] < need[fits, None]] = INF
            np.minimum(best, rows.min(axis=0), out=best)
        top[k] = best
    top[0, : min(fi.after, M + 1)] = INF  # the events after the chain
    return top


def flat_tables(model: Model | FlatInputs, max_slots: int, path: str = "auto") -> FlatTables:
    """Fill ``top`` (``path``: ``numba`` when installed, else ``numpy``; bitwise equal)."""
    fi = model if isinstance(model, FlatInputs) else FlatInputs.of(model)
    if path == "auto":
        import remat.core.solve.dp_numba as dp_numba

        path = "numba" if dp_numba.available() else "numpy"
    if path == "numba":
        import remat.core.solve.dp_numba as dp_numba

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
        need = region_need(fi, k)
        stops = np.arange(k + 1, fi.n + 1)
        rest_m = m - int(fi.rh[k])
        ok = (need <= m) & (rest_m >= 0)
        values = np.where(ok, region_values(fi, k, stops, top[stops, max(rest_m, 0)]), INF)
        stop = k + 1 + int(np.flatnonzero(values == target)[0])
        regions.append((k, stop))
        m, k = rest_m, stop
    return regions
