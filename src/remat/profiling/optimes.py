"""What a selective option and a checkpoint region cost in time, from timed steps.

A stage under ``selective:<policy>`` runs in its own checkpoint frame under torch's
selective-checkpoint dispatch mode: its forward pays the mode's cost on every op, and its
backward replays the forward, running again every op the policy does not save. Pricing
that as the unsaved ops' share of the stage's forward (each aten op timed in a forward
pass, as remat did before) missed the mode's cost: on the built-in ``gpt`` the share
came to 0.6x a block's forward for ``save-matmuls`` while timed steps showed 0.9x, and
``bench`` measured selective-everywhere 20 points slower than predicted. So the profile
times training steps with each option applied to every stage, interleaved with plain
steps, and charges each stage what its forward and backward took beyond the plain ones
(:func:`option_extra_s`).

A region's fixed cost is measured on a chain of tiny stages (:mod:`.overhead`), which sees
the checkpoint frame but not what grows with the stage (a pack and an unpack hook per
saved tensor, the rebuilt stage's backward finding its inputs in fresh memory). The
profile's steps with one region per stage show the whole of it: their time beyond the
plain step and the stages' timed rebuilds, per region (:func:`region_overhead_s`).

Note [Links inside a region]: a region of several stages costs more than the sum of
single-stage figures. Its rebuild replays the model's code between its stages; every
stage but its last is rebuilt in full where a single-stage region's rebuild stopped
early; and each stage's backward reads tensors that the rebuild made for the whole
region (memory gone cold) rather than for one stage. On the built-in gpt (one thread, 25
interleaved rounds), one region over all 8 blocks cost 7.5 ms beyond its rebuilds,
against 1.8 ms for one single-stage region; its stages' backwards ran 0.8 ms slower each.
Priced as one single-stage region per region, multi-stage plans came out 2 to 10 points
under their measured overhead. So each profiling round also times one step with a
region over each longest run of stages that no break divides, and the cost beyond the
single-stage figures, per link inside those regions, is the profile's
``region_link_s`` (:func:`region_link_s`). It is at most a region's own cost less the
checkpoint frame's (the tiny chain's figure): the frame is paid whatever a region holds.

Note [Each link its own cost]: links differ. Code between two stages runs inside a
region through the glue recorder, which records each torch call in forward and replays
it in the rebuild (Note [Glue between stages] in remat/runtime/glue.py): diffusers'
mid-block attention left between two stages (0.55 ms of forward) made a region across it
cost 3.4 ms more than the two single-stage regions beside it, where a region elsewhere in
that UNet cost about what its single-stage figures add up to; and a stage whose own
rebuild stops early (an upsampling conv: 0.13 ms rebuilt against 0.31 ms forward) runs
in full before the next stage of its region. One average for every link under-priced
the regions a plan chose across such code (measured 17 points over the prediction in 8
runs, benchmarks/diffusers_time.md) and over-priced the rest. So the steps with spanning
regions also time, link by link (the hooks of :mod:`.timing`), what the model's code
before a stage took in forward (against the plain step's) and in the rebuild, and the
previous stage's rebuild in full (against its single-stage rebuild): a link's own part
(:func:`link_parts`). What the spanning step took beyond them all (cold memory, the
recorder's frame) is shared evenly, so that the links of a round add up to what the
round measured (:func:`link_rounds`); each link's figure is the median over rounds, at
least 0.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from remat.core.errors import UsageError
from remat.profiling.timing import StepTimes

__all__ = [
    "link_parts",
    "link_rounds",
    "link_s",
    "link_within",
    "option_extra_s",
    "policy_op_names",
    "region_link_rounds",
    "region_link_s",
    "region_overhead_rounds",
    "region_overhead_s",
    "spanning_regions",
]


def policy_op_names(option: str, stage: str) -> frozenset[str]:
    """The aten ops (by name, ``aten.mm.default``) that ``option`` saves in ``stage``."""
    from remat.runtime.policies import resolve

    return frozenset(str(op) for op in resolve(option, stage).ops)


def _rounds(plain: Sequence[StepTimes], other: Sequence[StepTimes]) -> None:
    if not plain or len(plain) != len(other):
        raise UsageError(
            f"need paired rounds, got {len(plain)} plain and {len(other)} other; "
            "pass one plain round for each round with the option"
        )


def option_extra_s(plain: Sequence[StepTimes], with_option: Sequence[StepTimes],
                   floor_s: float = 0.0) -> tuple[float, ...]:
    """Per stage: what its forward and backward took under the option beyond the plain
    step of the same round (round ``r`` of each list ran back to back), the median over
    rounds, at least ``floor_s`` (the checkpoint frame every selective stage opens: a
    noisy round can make a stage look free, and none is)."""
    _rounds(plain, with_option)
    n = len(plain[0].fwd_s)
    return tuple(
        max(floor_s, statistics.median(
            (o.fwd_s[i] + o.bwd_s[i]) - (p.fwd_s[i] + p.bwd_s[i])
            for p, o in zip(plain, with_option, strict=True)
        ))
        for i in range(n)
    )


def region_overhead_s(plain: Sequence[StepTimes], per_stage: Sequence[StepTimes],
                      floor_s: float) -> float:
    """Seconds one region costs beyond rebuilding its stage: per round, the step with one
    region per stage less the plain step and the timed rebuilds, over the number of
    regions; the median over rounds, at least ``floor_s`` (the tiny chain's figure)."""
    return max(floor_s, statistics.median(region_overhead_rounds(plain, per_stage)))


def region_overhead_rounds(plain: Sequence[StepTimes], per_stage: Sequence[StepTimes]
                           ) -> list[float]:
    """Per round: the step with one region per stage less the plain step and the timed
    rebuilds, over the number of regions (:func:`region_overhead_s` is their median)."""
    _rounds(plain, per_stage)
    n = len(plain[0].fwd_s)
    return [(r.step_s - p.step_s - sum(r.rebuild_s)) / n
            for p, r in zip(plain, per_stage, strict=True)]


def spanning_regions(breaks: Sequence[str | None]) -> tuple[tuple[int, int], ...]:
    """The longest runs of two stages or more that no break divides (``breaks[i]``: why no
    region may span the link into stage ``i``), as ``(start, stop)`` pairs."""
    runs, start = [], 0
    for i in range(1, len(breaks) + 1):
        if i == len(breaks) or breaks[i] is not None:
            if i - start >= 2:
                runs.append((start, i))
            start = i
    return tuple(runs)


def region_link_rounds(plain: Sequence[StepTimes], per_stage: Sequence[StepTimes],
                       spanning: Sequence[StepTimes], regions: Sequence[tuple[int, int]]
                       ) -> list[float]:
    """Per round: what each link inside a region costs beyond the stages' rebuilds and the
    regions' own cost (Note [Links inside a region]).

    ``spanning`` are steps with ``regions`` (several stages each) applied. Per round, their
    time beyond the plain step, the stages' rebuilds as the steps with one region per stage
    timed them and one single-stage region's whole cost per region, over the number of links
    inside the regions."""
    _rounds(plain, spanning)
    inside = [i for start, stop in regions for i in range(start, stop)]
    links = len(inside) - len(regions)
    if links < 1:
        raise UsageError(f"regions {list(regions)} have no link inside; give regions of two "
                         "stages or more")
    per_region = region_overhead_rounds(plain, per_stage)
    return [(s.step_s - p.step_s - sum(r.rebuild_s[i] for i in inside)
             - len(regions) * region) / links
            for p, r, s, region in zip(plain, per_stage, spanning, per_region, strict=True)]


def region_link_s(plain: Sequence[StepTimes], per_stage: Sequence[StepTimes],
                  spanning: Sequence[StepTimes], regions: Sequence[tuple[int, int]],
                  ceiling_s: float) -> float:
    """The median of :func:`region_link_rounds`, within :func:`link_within`."""
    return link_within(statistics.median(region_link_rounds(plain, per_stage, spanning,
                                                            regions)), ceiling_s)


def link_within(link_s: float, ceiling_s: float) -> float:
    """``link_s`` between 0 and ``ceiling_s`` (a region's own cost less the checkpoint
    frame's: the frame is paid whatever the region holds)."""
    return min(max(0.0, link_s), max(0.0, ceiling_s))


def link_parts(plain: StepTimes, per_stage: StepTimes, spanning: StepTimes,
               regions: Sequence[tuple[int, int]]) -> dict[int, float]:
    """One round's own part of each link inside ``regions`` (by the index of the stage
    before it, Note [Each link its own cost]): the code before the next stage in forward
    beyond the plain step's, that code replayed in the rebuild, and the stage rebuilt in
    full beyond its single-stage rebuild."""
    if not spanning.gap_s or not plain.gap_s:
        return {}
    return {i: ((spanning.gap_s[i + 1] - plain.gap_s[i + 1]) + spanning.rebuild_gap_s[i + 1]
                + (spanning.rebuild_s[i] - per_stage.rebuild_s[i]))
            for start, stop in regions for i in range(start, stop - 1)}


def link_rounds(plain: Sequence[StepTimes], per_stage: Sequence[StepTimes],
                spanning: Sequence[StepTimes], regions: Sequence[tuple[int, int]],
                ceiling_s: Sequence[float]) -> list[dict[int, float]]:
    """Per round, each link inside ``regions`` priced (Note [Each link its own cost]): its
    own part, plus an even share of what the round's spanning step took beyond all the
    parts, that share at most ``ceiling_s[r]`` (as :func:`link_within` bounds the average
    link). Empty dicts where the steps carry no per-link times."""
    totals = region_link_rounds(plain, per_stage, spanning, regions)
    found: list[dict[int, float]] = []
    for r, (p, s, t) in enumerate(zip(plain, per_stage, spanning, strict=True)):
        parts = link_parts(p, s, t, regions)
        if not parts:
            found.append({})
            continue
        share = min(totals[r] - sum(parts.values()) / len(parts), ceiling_s[r])
        found.append({i: part + share for i, part in parts.items()})
    return found


def link_s(rounds: Sequence[dict[int, float]], n: int) -> tuple[float, ...] | None:
    """Per stage, the median over rounds of the link from it into the next, at least 0
    (0 where no spanning region holds that link); None without per-link times."""
    if not rounds or not all(rounds):
        return None
    return tuple(max(0.0, statistics.median(r[i] for r in rounds)) if i in rounds[0] else 0.0
                 for i in range(n))
