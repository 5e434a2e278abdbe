"""Does the profile's predicted overhead follow the machine, or the sample? One process.

``remat auto`` predicts a plan's overhead from the profile's rounds and then measures it
from interleaved pairs; on the shared two-core machine the two sometimes disagree by more
than either's noise (Note [Machine state between phases] in
``remat/benchmarking/main_job.py``). Here one process profiles the built-in gpt again and
again, each time predicting the overhead of the plan auto chooses at 50% (the median of
per-round ratios) and then measuring it (the median of 12 interleaved per-pair ratios),
with each round's rebuild-over-forward ratio of the first block: if the profile's method
drifted by itself, the gap would move with the iteration; if the machine moved, it moves
with the rebuild ratio.

Run from the repository root::

    PYTHONPATH=src .venv/bin/python benchmarks/noise_phases.py [--iterations 10]
        [--out benchmarks/noise_phases.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from remat.benchmarking.factory import make_factory
from remat.benchmarking.runners import EagerRunner, Runner
from remat.benchmarking.step_measures import interleaved, paired
from remat.core.planner import plan as make_plan
from remat.core.planner import to_problem
from remat.core.solve.paired import round_overheads
from remat.measure.malloc import set_malloc
from remat.profiling.profiler import profile

PAIRS = 12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".md")))
    args = parser.parse_args()
    torch.set_num_threads(1)
    set_malloc("keep")
    factory, _ = make_factory("gpt", None)
    net, batch, loss_fn = factory(None)
    load = os.getloadavg()
    lines = [
        "# The profile's prediction against the measurement, in one process", "",
        "Command (repository root):", "", "```console",
        f"$ PYTHONPATH=src .venv/bin/python benchmarks/noise_phases.py --iterations "
        f"{args.iterations}", "```", "",
        f"Started {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; torch "
        f"{torch.__version__}; one torch thread; load average {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f} at the start. Built-in gpt, budget 50%.", "",
        "| iteration | predicted (rounds) | each round's rebuild / forward, blocks.0 | "
        f"measured ({PAIRS} pairs) | gap (pts) | plain step |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    plan = None
    gaps = []
    for it in range(1, args.iterations + 1):
        prof = profile(net, batch, loss_fn, None, "adamw")
        if plan is None:
            plan = make_plan(to_problem(prof), "50%", "optimal")
        rounds = round_overheads(plan, prof)
        rebuilds = [r.rebuild_s[0] / r.fwd_s[0] for r in prof.timed_rounds or ()]
        plain = Runner(*factory(None), "adamw")
        planned = EagerRunner(*factory(None), "adamw", plan)
        try:
            times = interleaved({"plain": plain.step, "planned": planned.step},
                                repeats=PAIRS, warmup=1)
        finally:
            planned.close()
            plain.close()
        measured = paired(times["planned"], times["plain"])[0] - 1
        predicted = statistics.median(rounds)
        gaps.append(measured - predicted)
        line = (f"| {it} | {predicted:+.1%} ({len(rounds)}) | "
                f"{' '.join(f'{x:.2f}' for x in rebuilds)} | {measured:+.1%} | "
                f"{(measured - predicted) * 100:+.1f} | "
                f"{statistics.median(times['plain']) * 1e3:.0f} ms |")
        print(line, flush=True)
        lines.append(line)
    regions = " ".join(f"[{r.start},{r.stop})" for r in plan.regions) if plan else "-"
    lines += ["", f"Plan: regions {regions}. Largest gap "
              f"{max(abs(g) for g in gaps) * 100:.1f} points over {len(gaps)} iterations; "
              f"finished {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}.", ""]
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
