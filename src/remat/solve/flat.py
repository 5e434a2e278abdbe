"""The one-level segment solver: the fastest *flat* plan under a budget (torch-free).

A flat plan is a set of disjoint regions over the chain, none inside another, with every
stage under ``keep``: what ``segments-k`` and ``every-k`` choose from, at the best split.
It is the top-level recursion of :mod:`remat.solve.dp` (Note [The recursion]) with the
inside of each region fixed to bare keep stages, so a region ``[k, stop)`` is two
numbers: the time of its inside (its stages' rebuilds) and the least memory its inside
needs, built up stage by stage as ``stop`` grows. No table is indexed by pairs of stages.

Note [Flat records]
-------------------
With ``T[p]`` the inside times of the stages before ``p`` summed, region ``[k, stop)``
followed by the rest in ``m`` slots costs ``(ovh - T[k]) + V[stop, m - rh[k]]`` where
``V[stop, m'] = T[stop] + top[stop, m']`` does not depend on ``k``. Its need is monotone
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

from dataclasses import dataclass

import numpy as np

from remat.solve.dp import BREAK_BYTES, INF, KEEP, Model, _shift
from remat.solve.problem import Problem

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
    T: np.ndarray  # T[p]: the inside (rebuild) times of the stages before p summed

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
            # flat regions are all at the top level: with what the model's code holds
            nt=np.array([s.nosave_peak_extra_bytes for s in model.problem.stages], dtype=i64)
            + np.array(model.held, dtype=i64),
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
            fb_in=per_h(lambda p, j, h: model.inp(p, h) + model.a[p + 1] + model.tf[p][j])
            + _break_bytes(model.problem),
            T=np.concatenate(([0.0], np.cumsum([model.t_run[k][keep[k]] for k in range(n)]))),
        )


    @classmethod
    def build(cls, problem: Problem, slot_bytes: int, spare_bytes: int = 0) -> FlatInputs:
        """The same inputs as ``of(Model(problem, slot_bytes, spare_bytes))`` (tested equal),
        with numpy over the stages: a :class:`Model` prepares every option of every stage
        in Python, which at ten thousand stages costs more than the table itself."""
        q, n, st = slot_bytes, problem.n, problem.stages
        assert 0 <= spare_bytes < q, (spare_bytes, q)
        i64 = np.int64

        def ints(values: object) -> np.ndarray:
            return np.fromiter(values, dtype=i64, count=n)  # type: ignore[call-overload]

        def ceil(x: np.ndarray | int) -> np.ndarray:
            return -(-np.asarray(x, dtype=i64) // q)

        a = np.append(ints(s.boundary_bytes for s in st), i64(problem.output_bytes))
        sg = np.full(n + 1, problem.post_chain_grads_bytes, dtype=i64)
        sg[:n] += np.cumsum(ints(s.grad_bytes for s in st)[::-1])[::-1]
        sg[1:] += ints(s.pending_grad_bytes for s in st)  # as dp.Model's T(p)
        save = ints(s.saved_bytes["keep"] for s in st)
        tf = save + ints(s.fwd_transient_bytes for s in st)
        keeps = np.fromiter((s.keeps_input("keep") for s in st), dtype=bool, count=n)
        t_top = np.fromiter((s.extra_bwd_s.get("keep", 0.0) for s in st), dtype=float, count=n)
        t_run = np.fromiter((s.rebuild_s for s in st), dtype=float, count=n) + t_top
        bwd_tr = ints(s.bwd_transient_bytes for s in st)
        top_held = ints(iter(problem.held_in_forward))  # as dp.Model.held
        gs = (spare_bytes + problem.unattributed_grads_bytes) // q
        after = int(sg[0]) + problem.pre_chain_grads_bytes
        inp = np.stack([a[:n], np.zeros(n, dtype=i64)])  # [h, p]: h = 1, the region holds it
        held = np.where(keeps, inp, 0)
        bwd_in = ceil(held + save + a[1:] + a[:n] + bwd_tr + sg[1:])
        return cls(
            n=n,
            q=q,
            gs=gs,
            ob=int(ceil(problem.region_overhead_bytes)),
            ovh_s=problem.region_overhead_s,
            post=int(ceil(a[n] + problem.post_chain_peak_bytes + problem.held_at_chain_end)),
            after=int(ceil(max(0, int(a[0]) + after,
                               after + problem.optimizer_step_bytes - problem.pre_chain_bytes))),
            a=a,
            g=a + sg,
            nt=ints(s.nosave_peak_extra_bytes for s in st) + top_held,
            hold_b=ceil(held[0] + save),
            need_b=np.maximum(bwd_in[0], ceil(a[:n] + a[1:] + tf + top_held) - gs),
            t_b=t_top,
            rh=ceil(a[:n]),
            hold_in=ceil(held + save),
            bwd_in=bwd_in,
            fb_in=inp + a[1:] + tf + _break_bytes(problem),
            T=np.concatenate(([0.0], np.cumsum(t_run))),
        )


def _break_bytes(problem: Problem) -> np.ndarray:
    """``[h, p]``: a stage after a chain break, inside a region but not its first, makes
    the region's forward need :data:`BREAK_BYTES` (Note [Chain breaks] in dp)."""
    out = np.zeros((2, problem.n), dtype=np.int64)
    out[0, list(problem.breaks)] = BREAK_BYTES
    return out


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
    """``(ovh - T[k]) + (T[stop] + rest)``: region ``[k, stop)`` and the rest after it
    (``rest``: ``top`` of each stop, rows over slots or one slot each), added in the order
    the compiled kernel adds them (Note [Flat records])."""
    at_stop = fi.T[stops].reshape(-1, *(1,) * (rest.ndim - 1))
    return (fi.ovh_s - fi.T[k]) + (at_stop + rest)


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
        need = region_need(fi, k)
        stops = np.arange(k + 1, fi.n + 1)
        rest_m = m - int(fi.rh[k])
        ok = (need <= m) & (rest_m >= 0)
        values = np.where(ok, region_values(fi, k, stops, top[stops, max(rest_m, 0)]), INF)
        stop = k + 1 + int(np.flatnonzero(values == target)[0])
        regions.append((k, stop))
        m, k = rest_m, stop
    return regions
