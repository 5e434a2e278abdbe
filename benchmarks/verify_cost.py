"""What ``remat verify`` costs, in training steps of the same model measured in the same process.

On the built-in gpt (defaults) with a plan, each round times, in rotating order:

* one plain training step (forward, backward, AdamW step): the unit;
* one training step with the plan applied (for scale: what a rebuild costs);
* ``remat.verify(model, batch, plan, loss_fn)`` with its defaults (3 steps per twin, the
  value check and the hazard detectors in step 1);
* the same with ``check_rebuilds=False`` (the twin comparisons alone).

Medians over the rounds, and the median of the per-round ratios to the plain step.

Run from the repository root::

    PYTHONPATH=src .venv/bin/python benchmarks/verify_cost.py [--plan segments] [--threads 1]

Prints the figures and writes them to ``benchmarks/verify_cost.md``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from remat.cli.verify import build_plan
from remat.core.plan_format import Plan
from remat.measure.step import make_optimizer
from remat.models import load_model
from remat.runtime import apply
from remat.verification.harness import verify

COMMAND = "PYTHONPATH=src .venv/bin/python benchmarks/verify_cost.py"
VARIANTS = ("plain step", "step with the plan", "verify", "verify, check_rebuilds=False")


def timers(plan_name: str) -> tuple[dict[str, Callable[[], float]], Plan]:
    model, batch, loss_fn = load_model("gpt")
    model.train()
    plan = build_plan(plan_name, model)
    opt = make_optimizer(model, "adamw")

    def step() -> None:
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def plain() -> None:
        step()

    def planned() -> None:
        handle = apply(model, plan)
        try:
            step()
        finally:
            handle.remove()

    def verified(check_rebuilds: bool) -> Callable[[], None]:
        def run() -> None:
            report = verify(model, batch, plan, loss_fn, check_rebuilds=check_rebuilds)
            if not report.ok:
                sys.exit(f"verify failed on the benchmark model: {report.to_dict()}")

        return run

    funcs: dict[str, Callable[[], None]] = {
        VARIANTS[0]: plain,
        VARIANTS[1]: planned,
        VARIANTS[2]: verified(True),
        VARIANTS[3]: verified(False),
    }

    def timed(fn: Callable[[], None]) -> Callable[[], float]:
        def run() -> float:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start

        return run

    return {name: timed(fn) for name, fn in funcs.items()}, plan


def measure(plan_name: str, rounds: int) -> dict[str, Any]:
    variants, plan = timers(plan_name)
    names = list(variants)
    for name in names:  # warm-up: imports, allocator, optimizer state
        variants[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            # Steps are short: take the median of five for each entry of a round.
            reps = 5 if "step" in name else 1
            times[name].append(statistics.median(variants[name]() for _ in range(reps)))
    unit = times[VARIANTS[0]]
    return {
        "plan": plan_name,
        "regions": len(plan.regions),
        "rounds": rounds,
        "median_s": {name: statistics.median(t) for name, t in times.items()},
        "steps": {
            name: statistics.median(t / u for t, u in zip(times[name], unit, strict=True))
            for name in names
        },
    }


def render(result: dict[str, Any], threads: int) -> str:
    steps, median = result["steps"], result["median_s"]
    rows = "\n".join(
        f"| {name} | {1e3 * median[name]:.1f} ms | {steps[name]:.2f} |" for name in VARIANTS
    )
    total, bare = steps[VARIANTS[2]], steps[VARIANTS[3]]
    floor = 3 + 3 * steps[VARIANTS[1]]  # 3 plain steps and 3 steps with the plan
    return f"""# Cost of `remat verify`

Reproduce with `{COMMAND} --plan {result['plan']} --threads {threads}`.
Measured with torch {torch.__version__}, Python {platform.python_version()},
{platform.machine()} CPU, {threads} thread(s) (other jobs share this machine's two cores, and
two threads then stall each other), in one process: compare the ratios, not the absolute
times. Built-in gpt with its defaults (8 blocks, 128 wide, batch 8 x 128 tokens, dropout
0.1), plan `{result['plan']}` ({result['regions']} regions), {result['rounds']} rounds; in each
round every variant runs once (a step: the median of five), rotating the order. The unit is
one plain training step (forward, backward, AdamW step).

| variant | median time | in plain training steps |
|---|---|---|
{rows}

`remat verify` with its defaults takes **{total:.1f} plain training steps**:

- it runs **6 training steps** (3 of each twin); a step with the plan costs
  {steps[VARIANTS[1]]:.2f} plain steps (its rebuilds), so those 6 steps are
  {floor:.1f} plain-step units;
- deep copies, the per-stage records, one SGD and one AdamW step from step 1's gradients
  and the comparisons add {bare - floor:.1f} (verify with `check_rebuilds=False` takes
  {bare:.1f});
- the fingerprint pass (the value check of every rebuilt op and the hazard detectors,
  riding on step 1 of the twin with the plan) adds **{total - bare:.1f}**.

Target: at most about 6 steps plus the fingerprint pass.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default="segments", help="a builder or plan file (segments)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default torch's)")
    parser.add_argument("--out", default=str(Path(__file__).with_name("verify_cost.md")))
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    result = measure(args.plan, args.rounds)
    text = render(result, torch.get_num_threads())
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
