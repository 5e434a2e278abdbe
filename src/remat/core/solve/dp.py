"""The optimal solver's dynamic program over nested region trees with per-stage options.

Torch-free. It restates the simulator's arithmetic (:mod:`remat.core.solve.simulator`) as a
recursion over a *level* of the region tree (the top level, or the inside of one
region) split into its first item and the rest; the tests prove it equal to scoring
every plan of small chains with the simulator.

Note [The recursion]
--------------------
Write ``a_i`` for boundary bytes (``a_n``: the chain output), ``m`` for the memory left
to the part of the plan being decided (in slots), ``H(X)`` for what item ``X`` keeps from
its forward to its backward (its saved bytes, plus its input unless the enclosing
region already holds it: flag ``h``). Inside a region whose level ends at ``e``:

    Seg(h, k, e, m) = min over the first item X = [k, k') of
        time(X) + Seg(0, k', e, m - H(X))        when X's events fit in m

where X's forward events count the gradient of ``x_e`` (alive through the rebuild) and
X's backward events count the incoming and outgoing gradients; a region X adds
``region_overhead`` and ``Seg(1, k, k', m - H(X) - overhead_bytes)`` for its own inside
(``h = 1``: it holds ``x_k``; a region never repeats its parent's span). The top level is
the same recursion ``Top(k, m)`` except that its forward runs before backward: no
gradient of ``x_n`` yet and no parameter gradient (the DP's ``m`` is measured against
the backward base, so the top-level forward has ``gs`` more room), and ``Top(n, m)``
checks the post-chain (``a_n + post_chain_bytes``). ``Top(0, m)`` also checks the events
after the chain, which no plan changes (Note [Gradients by position]).

Note [Gradients by position]
----------------------------
Parameter gradients appear as backward goes (the simulator's ``param grads`` blocks) and
stay to the optimizer step: the unattributed ones from the post-chain's backward on (an
upper bound), the post-chain's right after its backward's peak, stage ``i``'s ``g_i``
right after its backward's peak (what a part creates before its peak is inside the
peak the profile measured: its transient), the pre-chain's at its backward. So what is
alive at an event depends on where in the chain it happens, not on the plan. ``m`` is
measured against the *backward base* (forward base + unattributed gradients,
``Problem.backward_base_bytes``), and each event adds the gradients alive then beyond
it, ``T(p) = post_chain_grads + g_p + ... + g_{n-1}`` (``T(n) = post_chain_grads``):

* the backward of stage ``k``: ``T(k + 1)`` (every later stage's and the post-chain's;
  ``g_k`` joins after its peak);
* a forward inside the level ``[., e)`` (rebuilt when backward reaches the enclosing
  region, after every stage from ``e`` on has had its backward): ``T(e)``. A child region
  ``[k, k')`` runs its own inside in its rebuild, so its events use ``T(k')`` through
  ``Seg(1, k, k')``; a level's rest ``Seg(0, k', e)`` keeps ``e``. The offsets depend only
  on ``(k, e)``, which every subproblem already names, so the tables keep their shape;
* the top-level forward: no gradient at all: ``gs`` (the unattributed gradients, in
  whole slots of the budget) more room than ``m``;
* ``Top(n)``, the post-chain's backward: none beyond the base;
* the backward residue (the loss the caller holds and its gradient,
  ``Problem.backward_residue_bytes``) joins with the post-chain's gradients and rides
  with ``T(p)`` to the pre-chain's backward;
* after the chain, with everything released: the pre-chain's backward
  (``a_0 + T(0) + pre_chain_grads``) and the optimizer step (``T(0) + pre_chain_grads +
  optimizer_step - pre_chain_bytes - residue``: the pre-chain's saved bytes and the loss
  are gone). Neither
  depends on the plan: ``Top(0, m)`` is infinite below them (``Model.after``).

Holding never makes ``m`` negative: whatever an item holds is alive at a later backward
event of its level (or the post-chain's) whose offset is at least 0. A stage that does not
``saves_input`` holds only its saved bytes under ``keep`` (``Model.keeps``).

Note [Early stop in the recursion]
----------------------------------
With early stop a rebuild runs its items only up to the last one that hands the region
something (Note [Nested non-reentrant regions]); later items are offloaded stages,
which hand over nothing. So the recursion keeps two values per subproblem: ``SegP``
(the rest contains a hand-over: X runs in the rebuild) and ``AO`` (the rest is all
offloaded stages: X is the last hand-over, it runs only if it is a keep stage, and the
rest runs not at all). ``Seg = min(SegP, AO)``.

Note [Chain breaks]
-------------------
A stage whose ``break_before`` is set cannot share a region with the stage before it: the
model's code between them cannot be replayed by a rebuild (the profile found it, Note
[Glue between stages] in ``remat/runtime/glue.py``). Rather than a constraint in every
table path, such a stage counts :data:`BREAK_BYTES` more in a region's forward when it is
not the region's first (the ``a[p] if p > k`` term of ``ns``, and ``fb_in[0, p]`` of the
one-level solver): no budget admits that region, and every path, exact or in slots, and
the smallest-peak search drop it the way they drop any region that does not fit.
Regions of one stage never span a link, so a plan always exists. The classic recipes
are cut at the breaks instead (:func:`remat.core.recipes.split_at_breaks`), and the simulator
refuses a plan whose region spans one.

Memory is counted in slots of ``slot_bytes``. Every quantity that stays alive across
events (an item's ``H``, a region's overhead) is rounded up on its own, and each
event's local bytes are rounded up as a sum, while the memory available is rounded
down: so a plan the DP accepts never exceeds the budget in the exact simulator.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from remat.core.plan_format import KEEP as KEEP_OPTION
from remat.core.plan_format import OFFLOAD, Option
from remat.core.solve.problem import Problem, StageCost

__all__ = [
    "INF",
    "KEEP",
    "OFF",
    "PAIR_SIDE_BYTES",
    "SEL",
    "Choice",
    "Model",
    "Tables",
    "fill_top",
    "nested_bytes",
    "nested_work",
    "numpy_tables",
    "python_tables",
    "reconstruct",
    "seg_choices",
    "segp_value",
    "subproblems",
    "top_choices",
]

INF = math.inf
KEEP, SEL, OFF = 0, 1, 2
# A region over a chain break needs this much memory: no budget admits it, and sums of
# it with a few real byte counts stay far inside int64 (Note [Chain breaks]).
BREAK_BYTES = 1 << 60


#: What the model's pair tables (``ns``, ``reb``, ``opens``, the all-offloaded suffixes,
#: Python lists and their numpy copies for the compiled path) and the compiled path's
#: first/saturated slots hold per pair of boundaries, about (Note [The tables' size]).
PAIR_SIDE_BYTES = 200


def nested_bytes(n: int, slots: int, early_stop: bool = True) -> int:
    """What the nested DP holds for ``n`` stages in ``slots`` slots (an estimate from above).

    Note [The tables' size]
    -----------------------
    :class:`Tables` holds ``seg0``, ``seg1`` and, with early stop, ``segp``: one row of
    ``slots + 1`` doubles per pair ``k <= e`` of boundaries, ``(n + 1)(n + 2) / 2`` pairs,
    and ``top`` (``n + 1`` rows). The model beside them keeps a few ``(n + 1)^2`` pair
    tables (:data:`PAIR_SIDE_BYTES` per pair in all). At 500 slots that is 6.1 GB for
    1,000 stages, 24 GB for 2,000 and 55 GB for 3,000: the solver checks it before it
    allocates anything (``remat.core.solve.solvers.nested_check``).
    """
    pairs = (n + 1) * (n + 2) // 2
    tables = (3 if early_stop else 2) * pairs + (n + 1)
    return 8 * tables * (slots + 1) + PAIR_SIDE_BYTES * (n + 1) ** 2


def nested_work(n: int, slots: int) -> int:
    """The nested DP's candidate slot updates, from above: every ``(k, stop, e)`` with
    ``k < stop <= e``, for both ``h``, over every slot (the compiled path skips many)."""
    return 2 * ((n + 2) * (n + 1) * n // 6) * (slots + 1)


def _ceil(nbytes: int, slot: int) -> int:
    return -(-nbytes // slot)


@dataclass(frozen=True)
class Choice:
    """One candidate for the first item of a level: a bare stage or a region."""

    kind: str  # "stage" | "region"
    arg: int  # option index for a stage, stop for a region
    rest: str  # "P" (rest hands over), "AO" (rest all offloaded), "any"


class _OptionFigures(NamedTuple):
    """One stage's figures under one option (:class:`Model`'s per-option tables)."""

    forward: int  # forward with grad, beyond input and output
    save: int  # kept on device from forward to backward
    dev_bwd: int  # saved bytes on device during its backward
    dev_open: int  # ... when a region's rebuild stopped before it (rebuilt in full)
    t_top: float  # extra time at the top level
    t_run: float  # extra time inside a region, run in its rebuild
    t_open: float  # ... not run in its rebuild (early stop)


def _option_figures(s: StageCost, o: Option, kind: int, bw: float | None) -> _OptionFigures:
    """Stage ``s``'s figures under option ``o`` of ``kind``."""
    if kind == OFF:
        assert bw is not None
        t = 2 * s.offload_bytes / bw + s.extra_bwd_s.get(o, 0.0)
        return _OptionFigures(s.nosave_peak_extra_bytes, 0, s.offload_bytes,
                              s.offload_bytes, t, s.rebuild_s + t, t)
    t = s.extra_bwd_s.get(o, 0.0)
    full = s.full_rebuild_option(o)  # Note [A selective stage rebuilt in full]
    return _OptionFigures(
        s.saved_bytes[o] + s.fwd_transient(o), s.saved_bytes[o],
        # bwd() adds keep's transient; a selective option's own replaces it
        s.saved_bytes[KEEP_OPTION] + s.bwd_transient(o) - s.bwd_transient_bytes,
        s.saved_bytes[KEEP_OPTION] + s.bwd_transient(full) - s.bwd_transient_bytes,
        t, s.rebuild_s + t,
        s.rebuild_s)  # a selective stage not run: rebuilt in full


def _grads_by_position(problem: Problem) -> list[int]:
    """``sg[p]``: T(p), the parameter gradients beyond the base once backward has passed
    stage p (Note [Gradients by position])."""
    n, st = problem.n, problem.stages
    sg = [0] * (n + 1)
    # the backward residue (the loss and its gradient) joins with the post-chain's
    # gradients and stays to the pre-chain's backward: it rides with T(p)
    sg[n] = problem.post_chain_grads_bytes + problem.backward_residue_bytes
    for k in range(n - 1, -1, -1):
        sg[k] = sg[k + 1] + st[k].grad_bytes
    # Pending gradients ride with T(p): those alive at stage p - 1's backward, and at
    # the rebuild forwards of a level ending at p (none after the chain: T(0)).
    for p in range(1, n + 1):
        sg[p] += st[p - 1].pending_grad_bytes
    return sg


class Model:
    """The chain's numbers in slots of ``slot_bytes``, shared by both table paths.

    ``spare_bytes``: the memory available beyond the backward base minus its whole slots
    (``avail - m * slot_bytes``, in ``[0, slot_bytes)``); it decides how many whole slots
    the gradients not yet created free for the top-level forward (``gs``). With one-byte
    slots it is 0 and every figure is exact.
    """

    def __init__(self, problem: Problem, slot_bytes: int, spare_bytes: int = 0) -> None:
        self.problem = problem
        self.n = n = problem.n
        self.q = q = slot_bytes
        assert 0 <= spare_bytes < q, (spare_bytes, q)
        self.early_stop = problem.early_stop
        st = problem.stages
        a = [s.boundary_bytes for s in st] + [problem.output_bytes]
        self.a = a
        self.sg = _grads_by_position(problem)  # sg[p]: T(p)
        # rg[e]: what the backward of stage e - 1 made before asking a region ending at e
        # for its rebuild, alive through that rebuild (Note [What a rebuild starts with]
        # in remat.core.solve.simulator)
        self.rg = [0] + [s.rebuild_grad_bytes for s in st]
        # The top-level forward's room over the backward base: no gradient exists yet, and
        # what the forward lets go of at its return is still alive (Note [What the forward
        # lets go of at its return] in remat.core.solve.simulator); in whole slots of the
        # budget, rounded down, so a plan accepted here fits in bytes.
        self.gs = (spare_bytes + problem.backward_base_bytes - problem.forward_base_bytes) // q
        # The events after the chain (pre-chain backward, optimizer step), plan-independent.
        after = self.sg[0] + problem.pre_chain_grads_bytes
        self.after = _ceil(max(0, a[0] + after,
                               after + problem.optimizer_step_bytes
                               - problem.gone_by_optimizer_step_bytes), q)
        # What the model's code holds during the top-level forward (an upper bound of the
        # simulator's exact holding: Problem.held_in_forward).
        self.held = problem.held_in_forward
        self._options(problem)
        self.ovh_s = problem.region_overhead_s
        self.ob = _ceil(problem.region_overhead_bytes, q)
        self.post = _ceil(a[n] + problem.post_chain_peak_bytes + problem.held_at_chain_end, q)

    def _options(self, problem: Problem) -> None:
        """Each stage's options, their kinds, and their figures (bytes exact)."""
        st = problem.stages
        self.opts = [problem.options(k) for k in range(problem.n)]
        self.kinds = [[KEEP if o.is_keep else OFF if o.is_offload else SEL for o in os]
                      for os in self.opts]
        # keeps[k][j]: stage k holds its input from forward to backward under option j.
        self.keeps = [[s.keeps_input(o) for o in os] for s, os in zip(st, self.opts, strict=True)]
        bw = problem.offload_bandwidth_bytes_per_s
        self.can_offload = bw is not None
        rows = [[_option_figures(s, o, kind, bw) for o, kind in zip(os, ks, strict=True)]
                for s, os, ks in zip(st, self.opts, self.kinds, strict=True)]
        # Bytes (exact) and seconds per stage and option, one table per _OptionFigures field
        self.tf: list[list[int]] = [[f.forward for f in row] for row in rows]
        self.save: list[list[int]] = [[f.save for f in row] for row in rows]
        self.dev_bwd: list[list[int]] = [[f.dev_bwd for f in row] for row in rows]
        self.dev_open: list[list[int]] = [[f.dev_open for f in row] for row in rows]
        self.t_top: list[list[float]] = [[f.t_top for f in row] for row in rows]
        self.t_run: list[list[float]] = [[f.t_run for f in row] for row in rows]
        self.t_open: list[list[float]] = [[f.t_open for f in row] for row in rows]

    # The pair tables are O(n^2): built when a nested solver first asks, so the one-level
    # solver (remat.core.solve.flat) can take chains of ten thousand stages.

    @functools.cached_property
    def _spans(self) -> tuple[list[list[int]], list[list[float]]]:
        n, st = self.n, self.problem.stages
        a = np.array(self.a, dtype=np.int64)
        inside = a[:n] + np.array([BREAK_BYTES * (s.break_before is not None) for s in st])
        nt = np.array([s.nosave_peak_extra_bytes for s in st], dtype=np.int64)
        rebuild = np.array([s.rebuild_s for s in st])
        ns = [[0] * (n + 1) for _ in range(n + 1)]
        reb_t = [[0.0] * (n + 1) for _ in range(n + 1)]
        opens = self.opens
        for k in range(n):
            own = a[k + 1 : n + 1] + nt[k:]
            own[1:] += inside[k + 1 : n]  # (a[p] if p > k else 0) + a[p + 1] + nt[p]
            ns[k][k + 1 :] = np.maximum.accumulate(own).tolist()
            # cumsum adds left to right, as a running sum from k does
            reb_t[k][k + 1 :] = (opens[k, k + 1 :] + np.cumsum(rebuild[k:])).tolist()
        return ns, reb_t

    @functools.cached_property
    def opens(self) -> np.ndarray:
        """``opens[k, l]``: what region ``[k, l)`` costs beyond its stages' rebuilds,
        ``Problem.region_s(k, l)`` in the same float operations (0 where ``l <= k``)."""
        n = self.n
        prefix = np.array(self.problem.link_prefix)
        out = np.zeros((n + 1, n + 1))
        out[:, 1:] = self.ovh_s + (prefix[None, :n] - prefix[:, None])
        return np.triu(out, 1)

    @functools.cached_property
    def ns_top(self) -> list[list[int]]:
        """``ns`` for a region at the top level, whose forward also has the model's code
        holding boundaries (``held``)."""
        if not any(self.held):
            return self.ns
        n = self.n
        a = np.array(self.a, dtype=np.int64)
        st = self.problem.stages
        inside = a[:n] + np.array([BREAK_BYTES * (s.break_before is not None) for s in st])
        nt = np.array([s.nosave_peak_extra_bytes for s in st], dtype=np.int64)
        nt += np.array(self.held, dtype=np.int64)
        ns = [[0] * (n + 1) for _ in range(n + 1)]
        for k in range(n):
            own = a[k + 1 : n + 1] + nt[k:]
            own[1:] += inside[k + 1 : n]
            ns[k][k + 1 :] = np.maximum.accumulate(own).tolist()
        return ns

    @property
    def ns(self) -> list[list[int]]:
        """``ns[k][l]``: peak extra of running stages ``k..l-1`` without saving (input held
        apart)."""
        return self._spans[0]

    @property
    def reb(self) -> list[list[float]]:
        """``reb[k][l]``: the time of region ``[k, l)`` when it runs in a rebuild."""
        return self._spans[1]

    @functools.cached_property
    def _all_offloaded(self) -> tuple[list[list[float]], list[list[int]]]:
        """All-offloaded suffix ``[k, e)``: its cost and the memory its backward events need
        (``-1``: not possible)."""
        n = self.n
        ao_cost = [[0.0] * (n + 1) for _ in range(n + 1)]
        ao_need = [[0 if k == e else -1 for e in range(n + 1)] for k in range(n + 1)]
        if self.can_offload:
            js = [self.kinds[k].index(OFF) for k in range(n)]
            t = np.array([self.t_top[k][j] for k, j in enumerate(js)])
            b = np.array([self.bwd(k, j, 0) for k, j in enumerate(js)], dtype=np.int64)
            for e in range(1, n + 1):
                # from e - 1 down to k: cost = t[k] + cost (IEEE addition commutes, so a
                # cumulative sum of the reversed run is the same number), need a running max
                costs = np.cumsum(t[e - 1 :: -1])[::-1].tolist()
                needs = np.maximum.accumulate(b[e - 1 :: -1])[::-1].tolist()
                for k in range(e):
                    ao_cost[k][e] = costs[k]
                    ao_need[k][e] = needs[k]
        return ao_cost, ao_need

    @property
    def ao_cost(self) -> list[list[float]]:
        return self._all_offloaded[0]

    @property
    def ao_need(self) -> list[list[int]]:
        return self._all_offloaded[1]

    # -- event sizes in slots ----------------------------------------------------------------

    def inp(self, k: int, h: int) -> int:
        """The input's bytes if this item must pay for it (the parent does not hold it)."""
        return self.a[k] if h == 0 else 0

    def hold(self, k: int, j: int, h: int) -> int:
        held = self.inp(k, h) if self.keeps[k][j] else 0
        return _ceil(held + self.save[k][j], self.q)

    def hold_open(self, k: int, h: int) -> int:
        return _ceil(self.inp(k, h), self.q)

    def bwd(self, k: int, j: int, h: int, runs: bool = True) -> int:
        """Backward of stage ``k`` (Note [Gradients by position]: ``T(k + 1)`` alive);
        ``runs`` false: its region's rebuild stopped before it."""
        held = self.inp(k, h) if self.keeps[k][j] else 0
        st = self.problem.stages[k]
        dev = self.dev_bwd[k][j] if runs else self.dev_open[k][j]
        local = held + dev + self.a[k + 1] + self.a[k] + st.bwd_transient_bytes
        return _ceil(local + self.sg[k + 1], self.q)

    def grads_during(self, e: int | None) -> int:
        """Gradients beyond the base during a forward in the level ending at ``e``: those of
        ``x_e`` and ``T(e)`` (None: the top-level forward, none)."""
        return 0 if e is None else self.a[e] + self.sg[e] + self.rg[e]

    def fwd(self, k: int, j: int, h: int, e: int | None) -> int:
        """Forward with grad; ``e`` is the level's end (None at the top: no gradient yet,
        and the model's code may hold boundaries, ``held``)."""
        local = self.inp(k, h) + self.a[k + 1] + self.tf[k][j]
        if e is None:
            local += self.held[k]
        return _ceil(local + self.grads_during(e), self.q)

    def region_fwd(self, k: int, stop: int, h: int, e: int | None) -> int:
        ns = self.ns_top if e is None else self.ns
        return _ceil(self.inp(k, h) + ns[k][stop] + self.grads_during(e), self.q)


class Tables:
    """The DP tables: ``Seg(0, k, e)``, ``Seg(1, k, e)``, ``SegP(0, k, e)`` and ``Top(k)``.

    Each row is a C-contiguous run of ``M + 1`` slots, and only pairs ``k <= e`` exist
    (a triangle). ``seg1`` (the inside of a region ``[k, e)``) is stored by ``k``:
    ``seg1[k1(k, e)]``, so one ``k``'s rows over every stop are adjacent; ``seg0`` and
    ``segp`` (the rest of a level ending at ``e``) are stored by ``e``: ``seg0[k0(k, e)]``,
    so one ``e``'s rows over every start are adjacent. That is the order the recursion
    reads them in (Note [Table layout] in :mod:`remat.core.solve._dp_kernel`). ``SegP(1, .)``
    is not stored: nothing reads it but the reconstruction, which re-decides it at one
    slot (:func:`segp_value`); without early stop ``segp`` is ``seg0`` itself. ``inf``
    marks no plan. Every path fills the same arrays with bitwise equal values.
    """

    def __init__(self, model: Model, max_slots: int) -> None:
        n = model.n
        self.model = model
        self.M = max_slots
        # k1(k, e) = kbase[k] + e: row k of the triangle follows every k' < k (n + 1 - k'
        # rows each); k0(k, e) = ebase[e] + k: column e follows every e' < e (e' + 1 each).
        self.kbase = np.array([k * (n + 1) - k * (k - 1) // 2 - k for k in range(n + 1)],
                              dtype=np.int64)
        self.ebase = np.array([e * (e + 1) // 2 for e in range(n + 1)], dtype=np.int64)
        pairs = (n + 1) * (n + 2) // 2
        # Every row but (e, e) is written by the fill (np.empty: no pass over the tables).
        self.seg0 = np.empty((pairs, max_slots + 1))
        self.seg1 = np.empty((pairs, max_slots + 1))
        self.segp = np.empty((pairs, max_slots + 1)) if model.early_stop else self.seg0
        self.top = np.full((n + 1, max_slots + 1), INF)
        for e in range(n + 1):
            self.seg0[self.k0(e, e)] = 0.0
            self.seg1[self.k1(e, e)] = 0.0
            if model.early_stop:
                self.segp[self.k0(e, e)] = INF  # never read

    def k0(self, k: int, e: int) -> int:
        """The row of ``(k, e)`` in ``seg0`` and ``segp`` (by ``e``)."""
        return int(self.ebase[e]) + k

    def k1(self, k: int, e: int) -> int:
        """The row of ``(k, e)`` in ``seg1`` (by ``k``)."""
        return int(self.kbase[k]) + e

    def seg_row(self, h: int, k: int, e: int) -> np.ndarray:
        return self.seg1[self.k1(k, e)] if h else self.seg0[self.k0(k, e)]

    @property
    def nbytes(self) -> int:
        """The memory the tables hold."""
        own = self.segp.nbytes if self.segp is not self.seg0 else 0
        return int(self.seg0.nbytes + self.seg1.nbytes + own + self.top.nbytes)

    def ao(self, k: int, e: int, m: int) -> float:
        need = self.model.ao_need[k][e]
        return self.model.ao_cost[k][e] if 0 <= need <= m else INF

    def rest(self, kind: str, k: int, e: int, m: int) -> float:
        if m < 0:
            return INF
        if kind == "AO":
            return self.ao(k, e, m)
        table = self.segp if kind == "P" else self.seg0
        return float(table[self.k0(k, e), m])

    def inner(self, k: int, stop: int, m: int) -> float:
        return float(self.seg1[self.k1(k, stop), m]) if m >= 0 else INF


# -- candidates (scalar): the one definition both paths and the reconstruction follow --------


def stage_choices(model: Model, k: int, e: int, j: int) -> Iterator[Choice]:
    """Stage ``k`` under option ``j`` as the first item of ``Seg(h, k, e)``."""
    if not model.early_stop:
        yield Choice("stage", j, "any")
        return
    if k + 1 < e:
        yield Choice("stage", j, "P")
    if model.kinds[k][j] != OFF:  # an offloaded stage hands over nothing: never the last
        yield Choice("stage", j, "AO")


def seg_choices(model: Model, k: int, e: int, h: int) -> Iterator[Choice]:
    """The first-item candidates of ``Seg(h, k, e)`` in tie-break order."""
    for j in range(len(model.kinds[k])):
        yield from stage_choices(model, k, e, j)
    for stop in range(k + 1, e + 1):
        if h == 1 and stop == e:
            continue  # the parent region itself
        if not model.early_stop:
            yield Choice("region", stop, "any")
            continue
        if stop < e:
            yield Choice("region", stop, "P")
        yield Choice("region", stop, "AO")


def _seg_value(t: Tables, k: int, e: int, h: int, m: int, c: Choice) -> float:
    model = t.model
    if c.kind == "stage":
        j = c.arg
        runs = c.rest != "AO" or model.kinds[k][j] == KEEP
        if m < model.bwd(k, j, h, runs) or (runs and m < model.fwd(k, j, h, e)):
            return INF
        if runs:
            return model.t_run[k][j] + t.rest(c.rest, k + 1, e, m - model.hold(k, j, h))
        return model.t_open[k][j] + t.rest(c.rest, k + 1, e, m - model.hold_open(k, h))
    stop = c.arg
    runs = c.rest != "AO"
    if runs and m < model.region_fwd(k, stop, h, e):
        return INF
    rh = model.hold_open(k, h)
    cost = model.reb[k][stop] if runs else model.opens[k, stop]
    return (cost + t.inner(k, stop, m - rh - model.ob)) + t.rest(c.rest, stop, e, m - rh)


def top_choices(model: Model, k: int) -> Iterator[Choice]:
    for j in range(len(model.kinds[k])):
        yield Choice("stage", j, "top")
    for stop in range(k + 1, model.n + 1):
        yield Choice("region", stop, "top")


def _top_value(t: Tables, k: int, m: int, c: Choice) -> float:
    model = t.model
    if c.kind == "stage":
        j = c.arg
        if m < model.bwd(k, j, 0) or m + model.gs < model.fwd(k, j, 0, None):
            return INF
        held = m - model.hold(k, j, 0)
        return model.t_top[k][j] + (float(t.top[k + 1, held]) if held >= 0 else INF)
    stop = c.arg
    if m + model.gs < model.region_fwd(k, stop, 0, None):
        return INF
    rh = model.hold_open(k, 0)
    rest = float(t.top[stop, m - rh]) if m - rh >= 0 else INF
    return (model.opens[k, stop] + t.inner(k, stop, m - rh - model.ob)) + rest


def subproblems(n: int) -> Iterator[tuple[int, int, int]]:
    """Subproblems in dependency order: by span, then ``h = 1`` before ``h = 0``."""
    for span in range(1, n + 1):
        for k in range(n - span + 1):
            yield k, k + span, 1
            yield k, k + span, 0


def python_tables(model: Model, max_slots: int) -> Tables:
    """Fill the tables with plain loops (the reference path)."""
    t = Tables(model, max_slots)
    n, M = model.n, max_slots
    for k, e, h in subproblems(n):
        choices = list(seg_choices(model, k, e, h))
        for m in range(M + 1):
            best = INF
            for c in choices:
                v = _seg_value(t, k, e, h, m, c)
                if v < best:
                    best = v
            if h == 0:
                t.segp[t.k0(k, e), m] = best
            row = t.seg_row(h, k, e)
            row[m] = min(best, t.ao(k, e, m)) if model.early_stop else best
    for m in range(M + 1):
        t.top[n, m] = 0.0 if m >= model.post else INF
    for k in range(n - 1, -1, -1):
        choices = list(top_choices(model, k))
        for m in range(M + 1):
            t.top[k, m] = min((_top_value(t, k, m, c) for c in choices), default=INF)
    for m in range(min(model.after, M + 1)):
        t.top[0, m] = INF  # the events after the chain do not fit
    return t


# -- the numpy path --------------------------------------------------------------------------


def _shift(v: np.ndarray, s: int) -> np.ndarray:
    """``out[..., m] = v[..., m - s]``, ``inf`` where ``m - s`` is out of range."""
    if s == 0:
        return v
    out = np.full_like(v, INF)
    if s < v.shape[-1]:
        out[..., s:] = v[..., : v.shape[-1] - s]
    return out


def _shift_rows(cost: np.ndarray, need: np.ndarray, s: int, ms: np.ndarray) -> np.ndarray:
    """Rows of all-offloaded rests shifted by ``s``: ``cost`` where ``m - s >= need >= 0``."""
    ok = (need[:, None] >= 0) & (ms[None, :] - s >= need[:, None])
    return np.where(ok, cost[:, None], INF)


def numpy_tables(model: Model, max_slots: int) -> Tables:
    """Fill the same tables with one vector operation per candidate (the fast path)."""
    t = Tables(model, max_slots)
    n, M = model.n, max_slots
    ms = np.arange(M + 1)
    reb = np.array(model.reb)
    opens = model.opens
    ns = np.array(model.ns, dtype=np.int64)
    ao_cost = np.array(model.ao_cost)
    ao_need = np.array(model.ao_need, dtype=np.int64)
    ao_vec: dict[tuple[int, int], np.ndarray] = {}

    def ao(k: int, e: int) -> np.ndarray:
        if (k, e) not in ao_vec:
            need = model.ao_need[k][e]
            ok = (ms >= need) if need >= 0 else np.zeros(M + 1, bool)
            ao_vec[k, e] = np.where(ok, model.ao_cost[k][e], INF)
        return ao_vec[k, e]

    def rest(kind: str, k: int, e: int, shift: int) -> np.ndarray:
        if kind == "AO":
            return _shift(ao(k, e), shift)
        table = t.segp if kind == "P" else t.seg0
        return _shift(table[t.k0(k, e)], shift)

    for k, e, h in subproblems(n):
        best = np.full(M + 1, INF)
        for j, kind in enumerate(model.kinds[k]):
            for c in stage_choices(model, k, e, j):
                runs = c.rest != "AO" or kind == KEEP
                need = max(model.bwd(k, j, h, runs), model.fwd(k, j, h, e) if runs else 0)
                if runs:
                    v = model.t_run[k][j] + rest(c.rest, k + 1, e, model.hold(k, j, h))
                else:
                    v = model.t_open[k][j] + rest(c.rest, k + 1, e, model.hold_open(k, h))
                np.minimum(best, np.where(ms >= need, v, INF), out=best)
        rh = model.hold_open(k, h)
        last = e if h == 0 else e - 1  # stops k+1..last (a region never repeats its parent)
        if last > k:
            # Every stop at once, one row each: the same elementwise sums as the scalar
            # path, and min is exact, so the tables stay bitwise equal.
            first = t.k1(k, k + 1)
            rows = _shift(t.seg1[first: first + last - k], rh + model.ob)
            run = last if not model.early_stop else min(last, e - 1)
            if model.early_stop:
                stops = np.arange(k + 1, last + 1)
                ao_rest = _shift_rows(ao_cost[stops, e], ao_need[stops, e], rh, ms)
                v2 = (opens[k, k + 1: last + 1, None] + rows) + ao_rest
                np.minimum(best, v2.min(axis=0), out=best)
            if run > k:
                table = t.segp if model.early_stop else t.seg0
                rest2 = _shift(table[t.k0(k + 1, e): t.k0(run, e) + 1], rh)
                v2 = (reb[k, k + 1: run + 1, None] + rows[: run - k]) + rest2
                needs = -(-(model.inp(k, h) + ns[k, k + 1: run + 1] + model.grads_during(e))
                          // model.q)
                v2[ms[None, :] < needs[:, None]] = INF
                np.minimum(best, v2.min(axis=0), out=best)
        if h == 0:
            t.segp[t.k0(k, e)] = best
        t.seg_row(h, k, e)[:] = np.minimum(best, ao(k, e)) if model.early_stop else best
    fill_top(t)
    return t


def fill_top(t: Tables) -> None:
    """Fill ``t.top`` from the filled ``t.seg`` (both vector paths share it)."""
    model = t.model
    n, M = model.n, t.M
    ms = np.arange(M + 1)
    ns = np.array(model.ns_top, dtype=np.int64)
    opens = model.opens
    t.top[n] = np.where(ms >= model.post, 0.0, INF)
    for k in range(n - 1, -1, -1):
        best = np.full(M + 1, INF)
        for j in range(len(model.kinds[k])):
            need = max(model.bwd(k, j, 0), model.fwd(k, j, 0, None) - model.gs)
            v = model.t_top[k][j] + _shift(t.top[k + 1], model.hold(k, j, 0))
            np.minimum(best, np.where(ms >= need, v, INF), out=best)
        rh = model.hold_open(k, 0)
        inner = _shift(t.seg1[t.k1(k, k + 1): t.k1(k, n) + 1], rh + model.ob)
        v2 = (opens[k, k + 1:, None] + inner) + _shift(t.top[k + 1:], rh)  # one row per stop
        needs = -(-(model.inp(k, 0) + ns[k, k + 1:]) // model.q) - model.gs
        v2[ms[None, :] < needs[:, None]] = INF
        np.minimum(best, v2.min(axis=0), out=best)
        t.top[k] = best
    t.top[0] = np.where(ms >= model.after, t.top[0], INF)  # the events after the chain


# -- reconstruction --------------------------------------------------------------------------


def segp_value(t: Tables, k: int, e: int, h: int, m: int) -> float:
    """``SegP(h, k, e, m)``: stored for ``h = 0``, re-decided from the candidates for 1."""
    if h == 0:
        return float(t.segp[t.k0(k, e), m])
    return min((_seg_value(t, k, e, h, m, c) for c in seg_choices(t.model, k, e, h)),
               default=INF)


def reconstruct(t: Tables, m: int) -> tuple[list[tuple[int, int]], list[Option]]:
    """The plan behind ``t.top[0, m]``: regions as (start, stop) and one option per stage."""
    model = t.model
    regions: list[tuple[int, int]] = []
    options: list[Option] = [KEEP_OPTION] * model.n

    def pick(target: float, candidates: Iterator[tuple[float, Choice]]) -> Choice:
        for value, c in candidates:
            if value == target:
                return c
        raise AssertionError("no candidate reproduces the table value")

    def seg(k: int, e: int, h: int, m: int, kind: str) -> None:
        if k == e:
            return
        target = segp_value(t, k, e, h, m)
        if kind == "any" and model.early_stop and t.seg_row(h, k, e)[m] != target:
            kind = "AO"
        if kind == "AO":
            for i in range(k, e):
                options[i] = OFFLOAD
            return
        c = pick(target, ((_seg_value(t, k, e, h, m, c), c) for c in seg_choices(model, k, e, h)))
        if c.kind == "stage":
            j = c.arg
            options[k] = model.opts[k][j]
            runs = c.rest != "AO" or model.kinds[k][j] == KEEP
            held = model.hold(k, j, h) if runs else model.hold_open(k, h)
            seg(k + 1, e, 0, m - held, c.rest)
            return
        rh = model.hold_open(k, h)
        regions.append((k, c.arg))
        seg(k, c.arg, 1, m - rh - model.ob, "any")
        seg(c.arg, e, 0, m - rh, c.rest)

    def top(k: int, m: int) -> None:
        if k == model.n:
            return
        target = float(t.top[k, m])
        c = pick(target, ((_top_value(t, k, m, c), c) for c in top_choices(model, k)))
        if c.kind == "stage":
            options[k] = model.opts[k][c.arg]
            top(k + 1, m - model.hold(k, c.arg, 0))
            return
        rh = model.hold_open(k, 0)
        regions.append((k, c.arg))
        seg(k, c.arg, 1, m - rh - model.ob, "any")
        top(c.arg, m - rh)

    assert math.isfinite(t.top[0, m])
    top(0, m)
    return regions, options
