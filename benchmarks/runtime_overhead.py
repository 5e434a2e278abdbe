"""What the runtime costs by itself: the wrapped forward, and one checkpoint region.

1. Step-time overhead on the built-in gpt of a plan with no regions and every stage
   ``keep`` (so every block still goes through the wrapped forward) against the plain
   model: forward + backward, the two variants interleaved in one process, the median of
   the per-pair ratios.
2. The fixed cost of one region: a chain of tiny stages, the median step time with one
   single-stage region per stage minus the median with none, divided by the number of
   stages; also the cost of the wrapper alone per stage call.

Run from the repository root::

    PYTHONPATH=src .venv/bin/python benchmarks/runtime_overhead.py

Prints the figures and writes them to ``benchmarks/runtime_overhead.md``.
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
from torch import nn
from torch.utils.checkpoint import checkpoint

from remat.core.plan_format import Plan, Region
from remat.runtime import apply

COMMAND = "PYTHONPATH=src .venv/bin/python benchmarks/runtime_overhead.py"


def gpt_model() -> tuple[nn.Module, Any, Callable[[nn.Module, Any], torch.Tensor], str]:
    """The built-in gpt, or a stand-in with the same structure if it is not there."""
    try:
        from remat.models import load_model
    except ImportError:
        return _stand_in()
    model, batch, loss_fn = load_model("gpt")
    return model, batch, loss_fn, "built-in gpt (remat.models.load_model('gpt'), defaults)"


def _stand_in() -> tuple[nn.Module, Any, Callable[[nn.Module, Any], torch.Tensor], str]:
    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.mlp(self.ln(x))

    class StandIn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(512, 128)
            self.blocks = nn.ModuleList(Block(128) for _ in range(8))
            self.head = nn.Linear(128, 512)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.wte(idx)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        idx, targets = batch
        return nn.functional.cross_entropy(model(idx).flatten(0, 1), targets.flatten())

    torch.manual_seed(0)
    data = torch.randint(0, 512, (8, 129))
    return StandIn(), (data[:, :-1], data[:, 1:]), loss_fn, "stand-in gpt-like model"


def step_time(
    model: nn.Module, batch: Any, loss_fn: Callable[..., torch.Tensor]
) -> tuple[float, float]:
    """Wall-clock and process CPU seconds of one forward + backward."""
    wall, cpu = time.perf_counter(), time.process_time()
    loss_fn(model, batch).backward()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    model.zero_grad(set_to_none=True)
    return wall, cpu


Timer = Callable[[], tuple[float, float]]


def interleaved(variants: dict[str, Timer], repeats: int) -> dict[str, list[tuple[float, float]]]:
    """(wall, cpu) step times per variant; each round runs every variant once, rotating."""
    names = list(variants)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for name in names:  # warm-up
        variants[name]()
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(variants[name]())
    return times


def with_plan(
    model: nn.Module, batch: Any, loss_fn: Callable[..., torch.Tensor], plan: Plan | None
) -> Timer:
    """A timer of one step with ``plan`` applied (or the plain model for None)."""

    def timer() -> tuple[float, float]:
        handle = None if plan is None else apply(model, plan)
        try:
            return step_time(model, batch, loss_fn)
        finally:
            if handle is not None:
                handle.remove()

    return timer


def keep_all(names: list[str]) -> Plan:
    return Plan(tuple(names), (), ("keep",) * len(names), solver="keep-all")


def wrapper_overhead(repeats: int) -> dict[str, Any]:
    model, batch, loss_fn, label = gpt_model()
    model.train()
    names = [f"blocks.{i}" for i in range(len(model.blocks))]  # type: ignore[arg-type]
    variants = {
        "plain": with_plan(model, batch, loss_fn, None),
        "wrapped": with_plan(model, batch, loss_fn, keep_all(names)),
    }
    times = interleaved(variants, repeats)
    pairs = list(zip(times["wrapped"], times["plain"], strict=True))
    return {
        "model": label,
        "stages": len(names),
        "plain_ms": 1e3 * statistics.median(t[0] for t in times["plain"]),
        "wrapped_ms": 1e3 * statistics.median(t[0] for t in times["wrapped"]),
        "ratio": statistics.median(w[0] / p[0] for w, p in pairs),
        "cpu_ratio": statistics.median(w[1] / p[1] for w, p in pairs),
        "repeats": repeats,
    }


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class TinyChain(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Tiny() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def region_cost(n: int, repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyChain(n)
    x = torch.randn(4, 8)

    def loss_fn(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return m(batch).sum()

    names = [f"blocks.{i}" for i in range(n)]
    singles = Plan(tuple(names), tuple(Region(i, i + 1) for i in range(n)), solver="singles")
    def torch_loss(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        h = batch
        for block in m.blocks:  # type: ignore[union-attr]
            h = checkpoint(block, h, use_reentrant=False)
        return h.sum()

    times = interleaved(
        {
            "plain": with_plan(model, x, loss_fn, None),
            "wrapped": with_plan(model, x, loss_fn, keep_all(names)),
            "regions": with_plan(model, x, loss_fn, singles),
            "torch": with_plan(model, x, torch_loss, None),
        },
        repeats,
    )
    med = {name: statistics.median(t[0] for t in ts) for name, ts in times.items()}
    return {
        "stages": n,
        "plain_ms": 1e3 * med["plain"],
        "wrapped_ms": 1e3 * med["wrapped"],
        "regions_ms": 1e3 * med["regions"],
        "torch_ms": 1e3 * med["torch"],
        "per_call_us": 1e6 * (med["wrapped"] - med["plain"]) / n,
        "per_region_us": 1e6 * (med["regions"] - med["wrapped"]) / n,
        "per_region_vs_plain_us": 1e6 * (med["regions"] - med["plain"]) / n,
        "plain_us_per_stage": 1e6 * med["plain"] / n,
        "torch_per_region_us": 1e6 * (med["torch"] - med["plain"]) / n,
        "repeats": repeats,
    }


def report(over: dict[str, Any], cost: dict[str, Any]) -> str:
    env = (
        f"torch {torch.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    )
    verdict = "meets" if over["ratio"] <= 1.02 else "misses"
    return f"""# Runtime overhead

Reproduce with `{COMMAND}`.
Measured with {env}. Times are medians over interleaved runs in one process on a shared
machine: compare the ratios, not the absolute times.

## Wrapped forward, no regions, every stage `keep`

{over['model']}, {over['stages']} stages, forward + backward, {over['repeats']} rounds.

| variant | median step |
|---|---|
| plain model | {over['plain_ms']:.2f} ms |
| plan applied (no regions, all keep) | {over['wrapped_ms']:.2f} ms |

Median per-round ratio wrapped / plain: **{over['ratio']:.4f}** wall-clock ({verdict} the
<= 1.02 target); {over['cpu_ratio']:.4f} in process CPU time, which other jobs on a shared
machine disturb less. A ratio below 1 is noise: the wrapper cannot make a step faster.

## Fixed cost of one region

{cost['stages']} tiny stages (Linear(8, 8) on a 4x8 input), {cost['repeats']} rounds.

| variant | median step |
|---|---|
| plain | {cost['plain_ms']:.3f} ms |
| plan, no regions | {cost['wrapped_ms']:.3f} ms |
| plan, one single-stage region per stage | {cost['regions_ms']:.3f} ms |
| `torch.utils.checkpoint` around every stage, no plan | {cost['torch_ms']:.3f} ms |

- wrapper alone: **{cost['per_call_us']:.1f} us** per stage call;
- one region (open and close in forward, rebuild in backward) beyond the wrapper:
  **{cost['per_region_us']:.1f} us** ({cost['per_region_vs_plain_us']:.1f} us against the
  plain model). This includes running the tiny stage's forward once more in the rebuild;
  its whole plain forward + backward takes {cost['plain_us_per_stage']:.1f} us per stage.
  For scale, `torch.utils.checkpoint(use_reentrant=False)` on the same stages costs
  {cost['torch_per_region_us']:.1f} us per call against the plain model.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="rounds for the gpt step")
    parser.add_argument("--tiny-repeats", type=int, default=200, help="rounds for the chain")
    parser.add_argument("--stages", type=int, default=64, help="tiny stages in the chain")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).with_name("runtime_overhead.md")
    )
    args = parser.parse_args(argv)
    over = wrapper_overhead(args.repeats)
    cost = region_cost(args.stages, args.tiny_repeats)
    text = report(over, cost)
    print(text)
    args.out.write_text(text, encoding="utf-8")
    print(f"written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
