"""The smallest peak any plan reaches, exactly, and a plan that reaches it (torch-free).

The recursion of :mod:`remat.core.solve.dp` (Note [The recursion], Note [Early stop in the
recursion]) with ``max`` over an item's events and ``min`` over choices, in whole bytes:
no slots, so no rounding. It answers "what is the smallest feasible budget", and gives
the optimal solver a plan when rounding to slots leaves none close to that minimum.
"""

from __future__ import annotations

from remat.core.plan_format import KEEP as KEEP_OPTION
from remat.core.plan_format import OFFLOAD, Option
from remat.core.solve.dp import INF, KEEP, Choice, Model, seg_choices, subproblems, top_choices
from remat.core.solve.problem import Problem

__all__ = ["min_peak_plan"]


def min_peak_plan(problem: Problem) -> tuple[int, list[tuple[int, int]], list[Option]]:
    """The smallest peak of any plan (bytes, exact) and one plan that reaches it.

    The same recursion as the tables with ``max`` for events and ``min`` over choices,
    in whole bytes: no slots, so no rounding.
    """
    least = _LeastPeaks(Model(problem, 1))  # one-byte slots: every figure exact
    least.fill()
    least.fill_top()
    # The events after the chain (Note [Gradients by position]) need the same whatever
    # the plan: they raise the minimum but choose nothing.
    need = max(0, int(least.top[0]), least.model.after)
    regions, options = least.plan()
    return problem.backward_base_bytes + need, regions, options


class _LeastPeaks:
    """The least requirement of every subproblem of ``model``'s chain, and the plan
    reaching them (the first choice reaching each requirement)."""

    def __init__(self, model: Model) -> None:
        self.model = model
        n = self.n = model.n
        # req[h][k][e]: least m for Seg; reqp: for SegP; INF: no plan.
        self.req = [[[INF] * (n + 1) for _ in range(n + 1)] for _ in range(2)]
        self.reqp = [[[INF] * (n + 1) for _ in range(n + 1)] for _ in range(2)]
        for e in range(n + 1):
            self.req[0][e][e] = self.req[1][e][e] = 0
        self.top: list[float] = [INF] * (n + 1)

    def ao_req(self, k: int, e: int) -> float:
        need = self.model.ao_need[k][e]
        return need if need >= 0 else INF

    def rest_req(self, kind: str, k: int, e: int) -> float:
        if kind == "AO":
            return self.ao_req(k, e)
        return (self.reqp if kind == "P" else self.req)[0][k][e]

    def seg_req(self, k: int, e: int, h: int, c: Choice) -> float:
        model = self.model
        if c.kind == "stage":
            j = c.arg
            runs = c.rest != "AO" or model.kinds[k][j] == KEEP
            held = model.hold(k, j, h) if runs else model.hold_open(k, h)
            need = max(model.bwd(k, j, h, runs), model.fwd(k, j, h, e) if runs else 0)
            return max(need, held + self.rest_req(c.rest, k + 1, e))
        stop = c.arg
        runs = c.rest != "AO"
        rh = model.hold_open(k, h)
        need = model.region_fwd(k, stop, h, e) if runs else 0
        return max(need, rh + model.ob + self.req[1][k][stop],
                   rh + self.rest_req(c.rest, stop, e))

    def fill(self) -> None:
        """``req`` and ``reqp`` of every subproblem below the top level."""
        model = self.model
        for k, e, h in subproblems(self.n):
            best = min((self.seg_req(k, e, h, c) for c in seg_choices(model, k, e, h)),
                       default=INF)
            self.reqp[h][k][e] = best
            self.req[h][k][e] = min(best, self.ao_req(k, e)) if model.early_stop else best

    def top_req(self, k: int, c: Choice) -> float:
        model, top = self.model, self.top
        if c.kind == "stage":
            j = c.arg
            return max(model.bwd(k, j, 0), model.fwd(k, j, 0, None) - model.gs,
                       model.hold(k, j, 0) + top[k + 1])
        stop = c.arg
        rh = model.hold_open(k, 0)
        return max(model.region_fwd(k, stop, 0, None) - model.gs,
                   rh + model.ob + self.req[1][k][stop], rh + top[stop])

    def fill_top(self) -> None:
        """``top[k]``: the least requirement of the top level from stage ``k`` on."""
        n, top = self.n, self.top
        top[n] = self.model.post
        for k in range(n - 1, -1, -1):
            top[k] = min(self.top_req(k, c) for c in top_choices(self.model, k))
        assert top[0] < INF  # per-stage regions with keep always fit some memory

    def plan(self) -> tuple[list[tuple[int, int]], list[Option]]:
        """Rebuild the plan: take the first choice reaching each requirement."""
        model = self.model
        regions: list[tuple[int, int]] = []
        options: list[Option] = [KEEP_OPTION] * self.n
        k = 0
        while k < self.n:
            c = next(c for c in top_choices(model, k) if self.top_req(k, c) == self.top[k])
            if c.kind == "stage":
                options[k] = model.opts[k][c.arg]
                k += 1
                continue
            regions.append((k, c.arg))
            self._seg(regions, options, k, c.arg, 1, "any")
            k = c.arg
        return regions, options

    def _seg(self, regions: list[tuple[int, int]], options: list[Option],
             k: int, e: int, h: int, kind: str) -> None:
        """Segment ``[k, e)``'s choices at depth ``h`` into ``regions`` and ``options``."""
        if k == e:
            return
        model, req, reqp = self.model, self.req, self.reqp
        if kind == "any" and model.early_stop and req[h][k][e] != reqp[h][k][e]:
            kind = "AO"
        if kind == "AO":
            for i in range(k, e):
                options[i] = OFFLOAD
            return
        target = reqp[h][k][e]
        c = next(c for c in seg_choices(model, k, e, h) if self.seg_req(k, e, h, c) == target)
        if c.kind == "stage":
            options[k] = model.opts[k][c.arg]
            self._seg(regions, options, k + 1, e, 0, c.rest)
            return
        regions.append((k, c.arg))
        self._seg(regions, options, k, c.arg, 1, "any")
        self._seg(regions, options, c.arg, e, 0, c.rest)
