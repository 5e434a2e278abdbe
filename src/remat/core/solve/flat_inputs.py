"""The flat solver's per-stage inputs in slots (:class:`FlatInputs`), shared by the numpy
path in :mod:`remat.core.solve.flat` and the compiled one in
:mod:`remat.core.solve.dp_numba` (its own module so neither imports the other for it).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from remat.core.plan_format import KEEP as KEEP_OPTION
from remat.core.solve.dp import BREAK_BYTES, KEEP, Model
from remat.core.solve.problem import Problem

__all__ = ["FlatInputs"]


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
    # T[p]: the inside (rebuild) times of the stages before p summed, plus the links
    # before stage p - 1's (a region ending at p holds links k .. p-2); S[k]: the inside
    # times before k plus the links before k's. Region [k, stop) then costs
    # ovh - S[k] + T[stop] (Note [Flat records] in flat.py).
    T: np.ndarray
    S: np.ndarray

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
            **_sums(np.concatenate(([0.0], np.cumsum([model.t_run[k][keep[k]]
                                                       for k in range(n)]))), model.problem),
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
        sg = np.full(n + 1, problem.post_chain_grads_bytes + problem.backward_residue_bytes,
                     dtype=i64)
        sg[:n] += np.cumsum(ints(s.grad_bytes for s in st)[::-1])[::-1]
        sg[1:] += ints(s.pending_grad_bytes for s in st)  # as dp.Model's T(p)
        save = ints(s.saved_bytes[KEEP_OPTION] for s in st)
        tf = save + ints(s.fwd_transient_bytes for s in st)
        keeps = np.fromiter((s.keeps_input(KEEP_OPTION) for s in st), dtype=bool, count=n)
        t_top = np.fromiter((s.extra_bwd_s.get(KEEP_OPTION, 0.0) for s in st), dtype=float,
                            count=n)
        t_run = np.fromiter((s.rebuild_s for s in st), dtype=float, count=n) + t_top
        bwd_tr = ints(s.bwd_transient_bytes for s in st)
        top_held = ints(iter(problem.held_in_forward))  # as dp.Model.held
        gs = (spare_bytes + problem.backward_base_bytes - problem.forward_base_bytes) // q
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
                               after + problem.optimizer_step_bytes
                               - problem.gone_by_optimizer_step_bytes))),
            a=a,
            # as dp.Model.grads_during: and what a rebuild starts with
            g=a + sg + np.append(i64(0), ints(s.rebuild_grad_bytes for s in st)),
            nt=ints(s.nosave_peak_extra_bytes for s in st) + top_held,
            hold_b=ceil(held[0] + save),
            need_b=np.maximum(bwd_in[0], ceil(a[:n] + a[1:] + tf + top_held) - gs),
            t_b=t_top,
            rh=ceil(a[:n]),
            hold_in=ceil(held + save),
            bwd_in=bwd_in,
            fb_in=inp + a[1:] + tf + _break_bytes(problem),
            **_sums(np.concatenate(([0.0], np.cumsum(t_run))), problem),
        )


def _sums(inside: np.ndarray, problem: Problem) -> dict[str, np.ndarray]:
    """``T`` and ``S`` from the inside times summed (``inside[p]``: stages before p)."""
    links = np.array(problem.link_prefix)
    return {"T": inside + np.concatenate(([0.0], links[:-1])), "S": inside + links}


def _break_bytes(problem: Problem) -> np.ndarray:
    """``[h, p]``: a stage after a chain break, inside a region but not its first, makes
    the region's forward need :data:`BREAK_BYTES` (Note [Chain breaks] in dp)."""
    out = np.zeros((2, problem.n), dtype=np.int64)
    out[0, list(problem.breaks)] = BREAK_BYTES
    return out
