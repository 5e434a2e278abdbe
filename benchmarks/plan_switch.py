"""What choosing a plan set's plan costs at each forward (issue 48, item 2: at most 1% of
a step). Run: ``python benchmarks/plan_switch.py`` (writes benchmarks/plan_switch.md).

Two figures, one process, one torch thread:

* the root hook alone (reading the batch's shape, the bucket lookup, switching the
  engine's layout), timed over 20,000 calls alternating two shapes of different plans;
* whole training steps alternating those two shapes under the plan set, against the same
  steps with each shape's plan applied on its own (no switching), interleaved, medians.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import remat
from remat.core.plan_set import plan_set
from remat.models.gpt import gpt
from remat.profiling.shaped import profile_shapes

HERE = Path(__file__).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=str(HERE / "plan_switch.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, batch, loss = gpt(n_layer=6, n_embd=128, n_head=4, block_size=256, batch_size=4,
                             dropout=0.0)
    began = time.perf_counter()
    prof = profile_shapes(model, batch, loss, "seq=32..256:32", repeats=1)
    profiled = time.perf_counter() - began
    chosen = plan_set(prof, "55%")
    short, long = 64, 256
    a, b = chosen.choose((short,)), chosen.choose((long,))
    assert a is not None and b is not None and a != b, chosen.describe()
    batches = {s: tuple(t[:, :s] for t in batch) for s in (short, long)}
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def step(seq: int) -> float:
        t0 = time.perf_counter()
        loss(model, batches[seq]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    handle = remat.apply(model, chosen)
    hook = next(h for h in model._forward_pre_hooks.values()
                if type(h).__name__ == "ShapeHook")
    inputs = {s: (batches[s][0],) for s in (short, long)}
    hook(model, inputs[short], {})
    hook(model, inputs[long], {})
    n = 20_000
    t0 = time.perf_counter()
    for k in range(n):
        hook(model, inputs[long if k % 2 else short], {})
    per_call = (time.perf_counter() - t0) / n
    for _ in range(2):
        step(short), step(long)
    handle.remove()
    switching, fixed = [], []
    singles = {short: chosen.plans[a], long: chosen.plans[b]}
    for _ in range(args.rounds):
        handle = remat.apply(model, chosen)
        switching.append(step(short) + step(long))
        handle.remove()
        total = 0.0
        for seq in (short, long):
            handle = remat.apply(model, singles[seq])
            total += step(seq)
            handle.remove()
        fixed.append(total)
    pair = statistics.median(fixed)
    ratios = [s / f for s, f in zip(switching, fixed, strict=True)]
    lines = [
        "# Choosing a plan set's plan at each forward",
        "",
        f"Command: `python benchmarks/plan_switch.py --rounds {args.rounds}`; "
        f"torch {torch.__version__}, one thread, {time.strftime('%Y-%m-%d')}.",
        "",
        f"Model: the built-in gpt (6 layers, width 128, batch 4), profiled over seq=32..256:32 "
        f"in {profiled:.1f} s; plan set under 55%: {len(chosen.plans)} plans.",
        "",
        *[f"- {line}" for line in chosen.describe()],
        "",
        f"- the root hook (shape read, bucket lookup, layout switch), alternating seq {short} "
        f"(plan {a}) and seq {long} (plan {b}): **{per_call * 1e6:.1f} us per forward**, "
        f"{per_call / (pair / 2):.4%} of the median step ({pair / 2 * 1e3:.1f} ms).",
        f"- whole steps, seq {short} then {long}, under the plan set against each shape's plan "
        f"applied alone, {args.rounds} interleaved rounds: median ratio "
        f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); the "
        "spread is this machine's noise, the hook's own cost is the line above.",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
