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
    model = Model(problem, 1)  # one-byte slots: every figure exact
    n = model.n
    # req[h][k][e]: least m for Seg; reqp: for SegP; INF: no plan.
    req = [[[INF] * (n + 1) for _ in range(n + 1)] for _ in range(2)]
    reqp = [[[INF] * (n + 1) for _ in range(n + 1)] for _ in range(2)]
    for e in range(n + 1):
        req[0][e][e] = req[1][e][e] = 0

    def ao_req(k: int, e: int) -> float:
        need = model.ao_need[k][e]
        return need if need >= 0 else INF

    def rest_req(kind: str, k: int, e: int) -> float:
        if kind == "AO":
            return ao_req(k, e)
        return (reqp if kind == "P" else req)[0][k][e]

    def seg_req(k: int, e: int, h: int, c: Choice) -> float:
        if c.kind == "stage":
            j = c.arg
            runs = c.rest != "AO" or model.kinds[k][j] == KEEP
            held = model.hold(k, j, h) if runs else model.hold_open(k, h)
            need = max(model.bwd(k, j, h), model.fwd(k, j, h, e) if runs else 0)
            return max(need, held + rest_req(c.rest, k + 1, e))
        stop = c.arg
        runs = c.rest != "AO"
        rh = model.hold_open(k, h)
        need = model.region_fwd(k, stop, h, e) if runs else 0
        return max(need, rh + model.ob + req[1][k][stop], rh + rest_req(c.rest, stop, e))

    for k, e, h in subproblems(n):
        best = min((seg_req(k, e, h, c) for c in seg_choices(model, k, e, h)), default=INF)
        reqp[h][k][e] = best
        req[h][k][e] = min(best, ao_req(k, e)) if model.early_stop else best

    def top_req(k: int, c: Choice, top: list[float]) -> float:
        if c.kind == "stage":
            j = c.arg
            return max(model.bwd(k, j, 0), model.fwd(k, j, 0, None) - model.gs,
                       model.hold(k, j, 0) + top[k + 1])
        stop = c.arg
        rh = model.hold_open(k, 0)
        return max(model.region_fwd(k, stop, 0, None) - model.gs, rh + model.ob + req[1][k][stop],
                   rh + top[stop])

    top: list[float] = [INF] * (n + 1)
    top[n] = model.post
    for k in range(n - 1, -1, -1):
        top[k] = min(top_req(k, c, top) for c in top_choices(model, k))
    assert top[0] < INF  # per-stage regions with keep always fit some memory
    # The events after the chain (Note [Gradients by position]) need the same whatever
    # the plan: they raise the minimum but choose nothing.
    need = max(0, int(top[0]), model.after)

    # Rebuild the plan: take the first choice reaching each requirement.
    regions: list[tuple[int, int]] = []
    options: list[Option] = [KEEP_OPTION] * n

    def seg(k: int, e: int, h: int, kind: str) -> None:
        if k == e:
            return
        if kind == "any" and model.early_stop and req[h][k][e] != reqp[h][k][e]:
            kind = "AO"
        if kind == "AO":
            for i in range(k, e):
                options[i] = OFFLOAD
            return
        target = reqp[h][k][e]
        c = next(c for c in seg_choices(model, k, e, h) if seg_req(k, e, h, c) == target)
        if c.kind == "stage":
            options[k] = model.opts[k][c.arg]
            seg(k + 1, e, 0, c.rest)
            return
        regions.append((k, c.arg))
        seg(k, c.arg, 1, "any")
        seg(c.arg, e, 0, c.rest)

    k = 0
    while k < n:
        c = next(c for c in top_choices(model, k) if top_req(k, c, top) == top[k])
        if c.kind == "stage":
            options[k] = model.opts[k][c.arg]
            k += 1
            continue
        regions.append((k, c.arg))
        seg(k, c.arg, 1, "any")
        k = c.arg
    return problem.backward_base_bytes + need, regions, options
