"""The optimal solver's compiled kernel (imported only when numba is installed).

Module-level functions, so numba's on-disk cache finds them again in a new process
(functions defined inside a function get a fresh identity each time and never hit it).
:mod:`remat.core.solve.dp_numba` prepares the arrays and explains the arithmetic.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from remat.core.solve.dp import KEEP, OFF

__all__ = ["fill", "fill_top", "flat_fill"]


@numba.njit(cache=True, nogil=True, inline="always")
def first_at_most(best: Any, lo: int, M: int, v: float) -> int:
    """The first ``m >= lo`` with ``best[m] <= v`` (``M + 1`` if none); ``best`` is
    non-increasing, so a bisection."""
    hi = M + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if best[mid] <= v:
            hi = mid
        else:
            lo = mid + 1
    return lo

@numba.njit(cache=True, nogil=True, inline="always")
def first_finite(row: Any, M: int) -> int:
    """The first ``m`` with a finite ``row[m]`` (``M + 1`` if none); non-increasing."""
    lo, hi = 0, M + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if row[mid] < np.inf:
            hi = mid
        else:
            lo = mid + 1
    return lo

@numba.njit(cache=True, nogil=True, inline="always")
def spread(best: Any, hi: int, end: int, v: float) -> None:
    """A candidate is constant ``v`` from ``hi`` on; ``best`` exceeds it before ``end``."""
    for m in range(hi + 1, end):
        best[m] = v

@numba.njit(cache=True, nogil=True)
def subproblem(k: int, e: int, h: int, best: Any, seg0: Any, seg1: Any, segp0: Any,
               kbase: Any, ebase: Any, first: Any, sat: Any, M: int, early_stop: bool, q: int,
               nopt: Any, kinds: Any, t_run: Any, t_open: Any, bwd: Any, fwd_base: Any,
               hold: Any, hold_open: Any, inp: Any, a: Any, sg: Any, reb: Any, ns: Any,
               ao_cost: Any, ao_need: Any, opens: Any, ob: int) -> None:
    inf = np.inf
    best[:] = inf
    g = a[e] + sg[e]
    pr = 2 if early_stop else 0  # first/sat index of the "P" rest rows
    # -- stage k under each option ---------------------------------------------
    for j in range(nopt[k]):
        kind = kinds[k, j]
        for c in range(3):  # 0: "any", 1: "P", 2: "AO"
            if not early_stop:
                if c != 0:
                    continue
            elif c == 0 or (c == 1 and not k + 1 < e) or (c == 2 and kind == OFF):
                continue
            runs = c != 2 or kind == KEEP
            need = bwd[k, j, h, 1 if runs else 0]
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
                if lo > M:
                    continue
                v = tv + ao_cost[k + 1, e]
                if v < best[lo]:
                    spread(best, lo - 1, first_at_most(best, lo, M, v), v)
                continue
            r = ebase[e] + k + 1
            s = pr if c == 1 else 0
            lo = max(need, shift + first[s, r])
            if lo > M:
                continue
            hi = min(M, max(lo, shift + sat[s, r]))
            row = segp0[r] if c == 1 else seg0[r]
            vmin = tv + row[hi - shift]
            if not vmin < best[lo]:
                continue  # best is non-increasing: never below this candidate's least
            end = first_at_most(best, lo, M, vmin)
            cnt = min(hi + 1, end) - lo
            b = best[lo: lo + cnt]
            x = row[lo - shift: lo - shift + cnt]
            for i in range(cnt):
                b[i] = min(tv + x[i], b[i])
            spread(best, hi, end, vmin)
    # -- a region [k, stop) first ----------------------------------------------
    rh = hold_open[k, h]
    last = e if h == 0 else e - 1
    sh = rh + ob
    for stop in range(k + 1, last + 1):
        ri = kbase[k] + stop
        lo_in = sh + first[1, ri]
        if lo_in > M:
            continue
        hi_in = sh + sat[1, ri]
        inner = seg1[ri]
        ov = opens[k, stop]
        if early_stop:
            an = ao_need[stop, e]
            if an >= 0:
                lo = max(lo_in, rh + an)
                if lo <= M:
                    cost = ao_cost[stop, e]
                    hi = min(M, max(lo, hi_in))
                    vmin = (ov + inner[hi - sh]) + cost
                    if vmin < best[lo]:
                        end = first_at_most(best, lo, M, vmin)
                        cnt = min(hi + 1, end) - lo
                        b = best[lo: lo + cnt]
                        x = inner[lo - sh: lo - sh + cnt]
                        for i in range(cnt):
                            b[i] = min((ov + x[i]) + cost, b[i])
                        spread(best, hi, end, vmin)
            if stop == e:
                continue
        need = -(-(inp[k, h] + ns[k, stop] + g) // q)
        r = ebase[e] + stop
        s = pr
        lo = max(need, lo_in, rh + first[s, r])
        if lo > M:
            continue
        hi = min(M, max(lo, hi_in, rh + sat[s, r]))
        rv = reb[k, stop]
        rest = segp0[r]
        vmin = (rv + inner[hi - sh]) + rest[hi - rh]
        if not vmin < best[lo]:
            continue
        end = first_at_most(best, lo, M, vmin)
        # Slices indexed from 0, so the loop has no negative-index wraparound and
        # vectorizes (about 10x faster than indexing best[m], inner[m - sh]).
        cnt = min(hi + 1, end) - lo
        b = best[lo: lo + cnt]
        x = inner[lo - sh: lo - sh + cnt]
        y = rest[lo - rh: lo - rh + cnt]
        for i in range(cnt):
            b[i] = min((rv + x[i]) + y[i], b[i])
        spread(best, hi, end, vmin)
    # -- store, with the first finite and the first constant slot --------------
    p = kbase[k] + e if h == 1 else ebase[e] + k
    out = seg1[p] if h == 1 else seg0[p]
    an = ao_need[k, e] if early_stop else -1
    cost = ao_cost[k, e]
    out[:] = best
    if an >= 0:
        tail = out[an:]
        for i in range(tail.shape[0]):
            tail[i] = min(cost, tail[i])
    if h == 0:
        if early_stop:
            segp0[p, :] = best
        first[2, p] = first_finite(best, M)
        m = M
        while m > 0 and best[m - 1] == best[M]:
            m -= 1
        sat[2, p] = m
    first[h, p] = first_finite(out, M)
    m = M
    while m > 0 and out[m - 1] == out[M]:
        m -= 1
    sat[h, p] = m

@numba.njit(cache=True, nogil=True)
def fill_top(top: Any, seg1: Any, kbase: Any, first1: Any, n: int, M: int, post: int,
             after: int, gs: int, q: int, nopt: Any, t_top: Any, need_top: Any, hold0: Any,
             hold_open0: Any, inp0: Any, ns: Any, opens: Any, ob: int) -> None:
    """``dp.fill_top`` compiled: the same sums in the same order, so the same floats."""
    inf = np.inf
    for m in range(M + 1):
        top[n, m] = 0.0 if m >= post else inf
    for k in range(n - 1, -1, -1):
        best = top[k]
        best[:] = inf
        nxt = top[k + 1]
        for j in range(nopt[k]):
            sh = hold0[k, j]
            tv = t_top[k, j]
            for m in range(max(need_top[k, j], sh), M + 1):
                best[m] = min(tv + nxt[m - sh], best[m])
        rh = hold_open0[k]
        sh = rh + ob
        for stop in range(k + 1, n + 1):
            ri = kbase[k] + stop
            need = -(-(inp0[k] + ns[k, stop]) // q) - gs
            lo = max(need, sh + first1[ri], 0)
            inner = seg1[ri]
            rest = top[stop]
            ov = opens[k, stop]
            for m in range(lo, M + 1):
                best[m] = min((ov + inner[m - sh]) + rest[m - rh], best[m])
    for m in range(min(after, M + 1)):
        top[0, m] = inf  # the events after the chain


@numba.njit(cache=True, nogil=True, parallel=True)
def fill(seg0: Any, seg1: Any, segp0: Any, kbase: Any, ebase: Any, first: Any, sat: Any,
         n: int, M: int, block: int, rows: int, workers: int, early_stop: bool, q: int,
         nopt: Any, kinds: Any, t_run: Any, t_open: Any, bwd: Any, fwd_base: Any, hold: Any,
         hold_open: Any, inp: Any, a: Any, sg: Any, reb: Any, ns: Any, ao_cost: Any,
         ao_need: Any, opens: Any, ob: int) -> None:
    # Note [Table layout]: tiles of ``block`` columns e by ``rows`` starts k. Cell (k, e)
    # reads (stop, e) for every stop > k (same column, a larger k) and (k, stop) for
    # every stop < e (same row, a smaller e). So within a tile, k runs from the top and e
    # from the left, and tile (B, j) (column block B, row chunk j) needs tiles (B, j + 1)
    # and (B - 1, j) first: the tiles of one anti-diagonal t = B + (top chunk - j) are
    # independent, and ``workers`` threads share each one (a wavefront), with the
    # diagonal's end as the barrier. Within a tile one k's inside rows serve every e, and
    # its columns stay in cache across k.
    nb = (n + block - 1) // block  # column block B: e in [1 + B * block, 1 + (B + 1) * block)
    nr = (n + rows - 1) // rows  # row chunk j: k in [j * rows, (j + 1) * rows)
    tile_b = np.empty(nb * nr, dtype=np.int64)
    tile_j = np.empty(nb * nr, dtype=np.int64)
    for t in range(nb + nr - 1):
        count = 0
        for b in range(nb):
            e1 = min(n + 1, 1 + (b + 1) * block)
            top_chunk = (e1 - 2) // rows
            j = top_chunk - (t - b)
            if 0 <= j <= top_chunk:
                tile_b[count] = b
                tile_j[count] = j
                count += 1
        for w in numba.prange(workers):
            best = np.empty(M + 1)
            for i in range(w, count, workers):
                e0 = 1 + tile_b[i] * block
                e1 = min(n + 1, e0 + block)
                j = tile_j[i]
                for k in range(min(e1 - 2, (j + 1) * rows - 1), j * rows - 1, -1):
                    for e in range(max(e0, k + 1), e1):
                        for h in (1, 0):
                            subproblem(k, e, h, best, seg0, seg1, segp0, kbase, ebase, first,
                                       sat, M, early_stop, q, nopt, kinds, t_run, t_open, bwd,
                                       fwd_base, hold, hold_open, inp, a, sg, reb, ns,
                                       ao_cost, ao_need, opens, ob)


@numba.njit(cache=True, nogil=True)
def flat_fill(top: Any, M: int, q: int, gs: int, ob: int, ovh_s: float, post: int, after: int,
              a: Any, g: Any, nt: Any, hold_b: Any, need_b: Any, t_b: Any, rh: Any,
              hold_in: Any, bwd_in: Any, fb_in: Any, T: Any, S: Any) -> None:
    """The one-level solver's ``top`` (:mod:`remat.core.solve.flat`, Note [Flat records]):
    per start a stop loop for the regions' needs, then one range minimum per slot."""
    n = top.shape[0] - 1
    inf = np.inf
    top[n, :] = inf
    if post <= M:
        top[n, post:] = 0.0
    # Per column m': the records of V[., m'] = T[.] + top[., m'] from the newest row on,
    # stops falling and values rising with the index (the newest row, k + 1, last).
    depth = np.zeros(M + 1, dtype=np.int64)
    rec_stop = np.empty((M + 1, n + 1), dtype=np.int32)
    rec_val = np.empty((M + 1, n + 1))
    mark = np.empty(M + 1, dtype=np.int64)
    out_stop = np.empty(n + 1, dtype=np.int64)
    out_lo = np.empty(n + 1, dtype=np.int64)
    out_hi = np.empty(n + 1, dtype=np.int64)
    best = np.empty(M + 1)
    # ceil((worst forward + g) / q) from quotients and remainders: integer division is the
    # slowest operation of the stop loop
    fbq = fb_in // q
    fbr = fb_in - fbq * q
    gq = g // q
    gr = g - gq * q
    for k in range(n - 1, -1, -1):
        i = k + 1
        ti = T[i]
        row = top[i]
        for mp in range(M + 1):
            v = ti + row[mp]
            d = depth[mp]
            while d > 0 and rec_val[mp, d - 1] >= v:
                d -= 1
            rec_val[mp, d] = v
            rec_stop[mp, d] = i
            depth[mp] = d + 1
        # -- stage k bare ----------------------------------------------------------------
        best[:] = inf
        shift = hold_b[k]
        tv = t_b[k]
        for m in range(max(need_b[k], shift), M + 1):
            best[m] = tv + row[m - shift]
        # -- a region [k, stop): its need, the running maximum of the needs --------------
        r = rh[k]
        mark[:] = k
        nout = 0
        before = 0
        worst_b = 0
        wq = 0  # the largest forward so far is wq * q + wr bytes (no division per stop)
        wr = 0
        peak = 0
        region_fwd = -(-a[k] // q) - gs
        nstar = 0
        for stop in range(k + 1, n + 1):
            p = stop - 1
            h = 1 if p == k else 0
            worst_b = max(worst_b, before + bwd_in[h, p])
            cq = before + fbq[h, p]
            if cq > wq or (cq == wq and fbr[h, p] > wr):
                wq = cq
                wr = fbr[h, p]
            before += hold_in[h, p]
            own = (a[p] if p > k else 0) + a[p + 1] + nt[p]
            if own > peak:
                peak = own
                region_fwd = -(-(a[k] + peak) // q) - gs
            floor = max(region_fwd, max(worst_b, wq + (1 if wr > 0 else 0)) + r + ob)
            if floor > M:
                break  # floor only grows with stop, and every need is at least floor
            rest = wr + gr[stop]
            up = wq + gq[stop] + (0 if rest == 0 else 1 if rest <= q else 2)
            need = max(region_fwd, max(worst_b, up) + r + ob)
            if need > nstar:
                nstar = need
            if nstar <= M:
                mark[nstar] = stop
            if need < nstar:  # fits from need on, before the running maximum lets it in
                out_stop[nout] = stop
                out_lo[nout] = max(need, r)
                out_hi[nout] = min(nstar, M + 1)
                nout += 1
        cst = ovh_s - S[k]
        last = k
        for m in range(M + 1):
            if mark[m] > last:
                last = mark[m]
            if last == k or m < r:
                continue
            mp = m - r
            # The deepest record at or before stop ``last``: gallop down from the newest
            # (few records lie within a region's reach), then bisect.
            hi = depth[mp] - 1
            step = 1
            probe = hi - 1
            while probe >= 0 and rec_stop[mp, probe] <= last:
                hi = probe
                step *= 2
                probe = hi - step
            lo = max(probe + 1, 0)
            while lo < hi:
                mid = (lo + hi) // 2
                if rec_stop[mp, mid] <= last:
                    hi = mid
                else:
                    lo = mid + 1
            c = cst + rec_val[mp, lo]
            if c < best[m]:
                best[m] = c
        for o in range(nout):
            s = out_stop[o]
            ts = T[s]
            srow = top[s]
            for m in range(out_lo[o], out_hi[o]):
                c = cst + (ts + srow[m - r])
                if c < best[m]:
                    best[m] = c
        top[k, :] = best
    top[0, : min(after, M + 1)] = inf  # the events after the chain
