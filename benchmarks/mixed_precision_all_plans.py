"""Every plan of a small gpt, predicted against measured, under one precision (issue 48,
item 5).

The two budgets of ``mixed_precision.py`` test the plans the solver picks; those change
with the timings of each profile. This takes one profile and applies every plan the chain
allows (every nested set of regions times every option per stage: 48 x 4^3 = 3,072 for
3 blocks with keep and three selective options), measuring each whole step's peak with
the live-storage tracker (``measure_step``), so no plan shape can hide.

Run: .venv/bin/python benchmarks/mixed_precision_all_plans.py --precision autocast-bf16
(precisions as in mixed_precision.py; ``--limit N``: the first N plans only.)
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Iterator

import torch
from mixed_precision import PRECISIONS, build, measured_peak

import remat
from remat.core.plan_format import Plan, Region
from remat.core.solve import Problem, simulate
from remat.core.solve.from_profile import problem_from_profile

# the gpt of tests/test_mixed_precision.py: blocks of 32, batch 4 x 64
GPT = {"n_layer": 3, "n_embd": 32, "n_head": 2, "block_size": 64, "vocab_size": 64,
       "batch_size": 4}


def region_sets(start: int, stop: int, inside: bool = False) -> Iterator[list[Region]]:
    """Every list of nested regions over ``[start, stop)`` (``inside``: within a region
    that spans it, which is not repeated)."""
    if start == stop:
        yield []
        return
    yield from region_sets(start + 1, stop)  # the first stage outside any region here
    for end in range(start + 1, stop + 1):
        if inside and end == stop:
            continue
        for within in region_sets(start, end, inside=True):
            for rest in region_sets(end, stop):
                yield [Region(start, end), *within, *rest]


def every_plan(problem: Problem) -> Iterator[Plan]:
    for regions in region_sets(0, problem.n):
        for options in itertools.product(*(problem.options(i) for i in range(problem.n))):
            yield Plan(problem.stage_names, tuple(regions), options)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=PRECISIONS, default="autocast-bf16")
    parser.add_argument("--limit", type=int, default=None, help="the first N plans only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, batch, loss_fn = build("gpt", GPT, args.precision)
    problem = problem_from_profile(remat.profile(model, batch, loss_fn, repeats=1))
    start = time.perf_counter()
    rows = []
    for plan in itertools.islice(every_plan(problem), args.limit):
        measured, _ = measured_peak(model, batch, loss_fn, plan)
        rows.append((plan, simulate(plan, problem).peak_bytes, measured))
    over = [(p, pred, m) for p, pred, m in rows if pred > m]
    under = [(p, pred, m) for p, pred, m in rows if m > pred]
    print(f"torch {torch.__version__}, one thread, CPU; gpt {GPT}, {args.precision}")
    print(f"{len(rows)} plans measured in {time.perf_counter() - start:.0f} s")
    print(f"predicted to the byte: {len(rows) - len(over) - len(under)}")
    for name, found in (("predicted over the measured peak", over),
                        ("measured over the prediction", under)):
        worst = max(found, key=lambda r: abs(r[1] - r[2]) / r[2], default=None)
        print(f"{name}: {len(found)}"
              + (f"; most {worst[1] - worst[2]:+,} bytes "
                 f"({(worst[1] - worst[2]) / worst[2]:+.2%}), regions "
                 f"{[(r.start, r.stop) for r in worst[0].regions]}, options "
                 f"{', '.join(worst[0].options)}" if worst else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
