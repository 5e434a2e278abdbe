"""The optimal solver's tables compiled with numba (optional: ``pip install remat[fast]``).

The same candidates, in the same arithmetic, as :func:`remat.solve.dp.numpy_tables`
(Note [The recursion]): each value is ``t + rest`` or ``(t + inner) + rest`` in IEEE
double, with no fast-math, and ``min`` is exact, so the tables are bitwise equal to the
numpy and Python paths (tested). Only the order of the loops differs: one compiled loop
over every subproblem, candidate and slot, skipping the slots below the first finite
entry of the row a candidate reads (everything there is infinite: an exact window).

The kernel compiles on first use (a few seconds; cached on disk afterwards).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from remat.solve.dp import KEEP, OFF, Model, Tables, fill_top

__all__ = ["available", "numba_tables"]

_KERNEL: Any = None


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
    import numba

    cache = Path(__file__).with_name("__pycache__")
    if not any(cache.glob("dp_numba.*fill*.nbi")):
        print("remat: compiling the optimal solver's numba kernel (once; cached on disk)...",
              file=sys.stderr, flush=True)

    @numba.njit(cache=True, nogil=True)
    def fill(seg: Any, segp: Any, first: Any, sat: Any, n: int, M: int, early_stop: bool,
             q: int, nopt: Any, kinds: Any, t_run: Any, t_open: Any, bwd: Any,
             fwd_base: Any, hold: Any, hold_open: Any, inp: Any, a: Any, sg: Any, reb: Any,
             ns: Any, ao_cost: Any, ao_need: Any, ovh_s: float, ob: int) -> None:
        inf = np.inf
        best = np.empty(M + 1)
        tail = np.empty(M + 2)  # tail[m]: the least constant a candidate holds from m on
        for span in range(1, n + 1):
            for k in range(n - span + 1):
                e = k + span
                for h in (1, 0):
                    best[:] = inf
                    tail[:] = inf
                    g = a[e] + sg[e]
                    # -- stage k under each option -----------------------------------
                    for j in range(nopt[k]):
                        kind = kinds[k, j]
                        for c in range(3):  # 0: "any", 1: "P", 2: "AO"
                            if not early_stop:
                                if c != 0:
                                    continue
                            elif c == 0 or (c == 1 and not k + 1 < e) or (c == 2 and kind == OFF):
                                continue
                            runs = c != 2 or kind == KEEP
                            need = bwd[k, j, h]
                            if runs:
                                f = -(-(fwd_base[k, j, h] + g) // q)
                                if f > need:
                                    need = f
                                shift = hold[k, j, h]
                                tv = t_run[k, j]
                            else:
                                shift = hold_open[k, h]
                                tv = t_open[k, j]
                            if c == 2:
                                an = ao_need[k + 1, e]
                                if an < 0:
                                    continue
                                lo = max(need, shift + an)
                                if lo <= M:
                                    v = tv + ao_cost[k + 1, e]
                                    if v < tail[lo]:
                                        tail[lo] = v
                                continue
                            hr = 0 if c == 0 else 1  # 0: seg, 1: segp
                            lo = max(need, shift + first[hr, 0, k + 1, e])
                            if lo > M:
                                continue
                            hi = min(M, max(lo, shift + sat[hr, 0, k + 1, e]))
                            row = segp[0, k + 1, e] if hr else seg[0, k + 1, e]
                            for m in range(lo, hi + 1):
                                best[m] = min(best[m], tv + row[m - shift])
                            v = tv + row[hi - shift]
                            if v < tail[hi]:
                                tail[hi] = v
                    # -- a region [k, stop) first ---------------------------------------
                    rh = hold_open[k, h]
                    last = e if h == 0 else e - 1
                    sh = rh + ob
                    for stop in range(k + 1, last + 1):
                        lo_in = sh + first[0, 1, k, stop]
                        if lo_in > M:
                            continue
                        hi_in = sh + sat[0, 1, k, stop]
                        if early_stop:
                            an = ao_need[stop, e]
                            if an >= 0:
                                lo = max(lo_in, rh + an)
                                if lo <= M:
                                    cost = ao_cost[stop, e]
                                    hi = min(M, max(lo, hi_in))
                                    inner = seg[1, k, stop]
                                    for m in range(lo, hi + 1):
                                        best[m] = min(best[m], (ovh_s + inner[m - sh]) + cost)
                                    v = (ovh_s + inner[hi - sh]) + cost
                                    if v < tail[hi]:
                                        tail[hi] = v
                            if stop == e:
                                continue
                        need = -(-(inp[k, h] + ns[k, stop] + g) // q)
                        hr = 1 if early_stop else 0
                        lo = max(need, lo_in, rh + first[hr, 0, stop, e])
                        if lo > M:
                            continue
                        hi = min(M, max(lo, hi_in, rh + sat[hr, 0, stop, e]))
                        rv = reb[k, stop]
                        inner = seg[1, k, stop]
                        rest = segp[0, stop, e] if hr else seg[0, stop, e]
                        for m in range(lo, hi + 1):
                            best[m] = min(best[m], (rv + inner[m - sh]) + rest[m - rh])
                        v = (rv + inner[hi - sh]) + rest[hi - rh]
                        if v < tail[hi]:
                            tail[hi] = v
                    # -- store, with the first finite and the first constant slot ------
                    fp = M + 1
                    fs = M + 1
                    run = inf
                    an = ao_need[k, e] if early_stop else -1
                    for m in range(M + 1):
                        if tail[m] < run:
                            run = tail[m]
                        b = best[m]
                        if run < b:
                            b = run
                        segp[h, k, e, m] = b
                        v = b
                        if an >= 0 and m >= an and ao_cost[k, e] < v:
                            v = ao_cost[k, e]
                        seg[h, k, e, m] = v
                        if fp > M and b < inf:
                            fp = m
                        if fs > M and v < inf:
                            fs = m
                    first[1, h, k, e] = fp
                    first[0, h, k, e] = fs
                    m = M
                    while m > 0 and segp[h, k, e, m - 1] == segp[h, k, e, M]:
                        m -= 1
                    sat[1, h, k, e] = m
                    m = M
                    while m > 0 and seg[h, k, e, m - 1] == seg[h, k, e, M]:
                        m -= 1
                    sat[0, h, k, e] = m

    _KERNEL = fill
    return fill


def numba_tables(model: Model, max_slots: int) -> Tables:
    """Fill the same tables as :func:`remat.solve.dp.numpy_tables` with a compiled loop."""
    fill = _kernel()
    t = Tables(model, max_slots)
    n, M = model.n, max_slots
    width = max(len(o) for o in model.kinds)
    nopt = np.array([len(o) for o in model.kinds], dtype=np.int64)
    kinds = np.full((n, width), -1, dtype=np.int64)
    t_run = np.zeros((n, width))
    t_open = np.zeros((n, width))
    bwd = np.zeros((n, width, 2), dtype=np.int64)
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
                bwd[k, j, h] = model.bwd(k, j, h)
                hold[k, j, h] = model.hold(k, j, h)
                # fwd(k, j, h, e) = ceil((this + a_e + T(e)) / q)
                fwd_base[k, j, h] = model.inp(k, h) + model.a[k + 1] + model.tf[k][j]
    # first[s, h, k, e]: the first finite slot of seg (s = 0) and segp (s = 1).
    first = np.full((2, 2, n + 1, n + 1), M + 1, dtype=np.int64)
    for e in range(n + 1):
        first[0, :, e, e] = 0  # seg[h, e, e] = 0; segp[h, e, e] is never read
    # sat[s, h, k, e]: the first slot from which the row is constant up to M.
    sat = np.zeros((2, 2, n + 1, n + 1), dtype=np.int64)
    fill(t.seg, t.segp, first, sat, n, M, model.early_stop, model.q, nopt, kinds, t_run, t_open,
         bwd, fwd_base, hold, hold_open, inp, np.array(model.a, dtype=np.int64),
         np.array(model.sg, dtype=np.int64), np.array(model.reb),
         np.array(model.ns, dtype=np.int64),
         np.array(model.ao_cost), np.array(model.ao_need, dtype=np.int64), model.ovh_s, model.ob)
    fill_top(t)
    return t

