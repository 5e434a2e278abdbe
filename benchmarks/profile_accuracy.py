"""How well a profile predicts, and what profiling costs, on the built-in models at defaults.

For each of ``gpt``, ``mlp-hetero`` and ``convnet-bn`` with their default sizes:

1. the peak of one training step without checkpointing, measured by the tracker
   (``measure_step``) against the profile's prediction, which is the simulator's
   (``remat.core.solve.simulate`` of the no-checkpoint plan on ``problem_from_profile``);
   target within +-3%;
2. the wall time of ``remat.profile`` in units of one plain training step of the same
   model, timed in the same process before and after (median); target <= 10 steps;
3. a profile at batch ``b`` (the default) fitted with one at ``b/2`` predicts batch
   ``2b``: the simulator's peak on ``at_batch_size(2b)`` against ``measure_step`` at
   ``2b``; target within +-5%.

Run from the repository root::

    PYTHONPATH=src .venv/bin/python benchmarks/profile_accuracy.py

Prints the figures and writes them to ``benchmarks/profile_accuracy.md``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from remat.core.solve import simulate
from remat.core.solve.from_profile import no_checkpoint_plan, problem_from_profile
from remat.core.transforms import at_batch_size
from remat.core.units import format_bytes
from remat.measure import measure_step
from remat.measure.step import make_optimizer
from remat.models import load_model
from remat.profiling.profiler import fit_scaling, profile

COMMAND = "PYTHONPATH=src .venv/bin/python benchmarks/profile_accuracy.py"
MODELS = ("gpt", "mlp-hetero", "convnet-bn")


@dataclass(frozen=True)
class Row:
    spec: str
    batch_size: int
    stages: int
    measured_bytes: int
    predicted_bytes: int
    predicted_event: str
    measured_where: str
    grads_bytes: int
    grads_at_peak_bytes: int
    step_s: float
    step_cpu_s: float
    profile_s: float
    profile_cpu_s: float
    measured_2b_bytes: int
    predicted_2b_bytes: int

    @property
    def error(self) -> float:
        return self.predicted_bytes / self.measured_bytes - 1

    @property
    def error_2b(self) -> float:
        return self.predicted_2b_bytes / self.measured_2b_bytes - 1


def _step_times(spec: str, steps: int) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds of ``steps`` plain training steps (after one warm-up step)."""
    model, batch, loss_fn = load_model(spec)
    opt = make_optimizer(model, "adamw")
    wall, cpu = [], []
    for k in range(steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if k:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return wall, cpu


def measure(spec: str, steps: int) -> Row:
    wall_before, cpu_before = _step_times(spec, steps)
    model, batch, loss_fn = load_model(spec)
    t0, c0 = time.perf_counter(), time.process_time()
    result = profile(model, batch, loss_fn, description=spec)
    profile_s, profile_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    wall_after, cpu_after = _step_times(spec, steps)
    assert result.measured_peak_bytes is not None and result.predicted_peak_bytes is not None

    step = measure_step(model, batch, loss_fn)  # where the peak is, and what is alive there
    simulation = simulate(no_checkpoint_plan(result), problem_from_profile(result))
    phase = step.peak_phase.value if step.peak_phase is not None else "?"

    b = result.batch_size
    assert b is not None and b >= 2
    half = profile(*load_model(spec, batch_size=b // 2), description=spec)
    scaled = at_batch_size(replace(result, scaling=fit_scaling(result, half)), 2 * b)
    assert scaled.predicted_peak_bytes is not None
    measured_2b = measure_step(*load_model(spec, batch_size=2 * b)).peak_bytes

    return Row(
        spec=spec,
        batch_size=b,
        stages=len(result.stages),
        measured_bytes=result.measured_peak_bytes,
        predicted_bytes=result.predicted_peak_bytes,
        predicted_event=simulation.peak_event,
        measured_where=f"{phase} {step.peak_module_path or '(outside any module)'}",
        grads_bytes=result.fixed.grads_bytes,
        grads_at_peak_bytes=step.peak_by_category.gradients_bytes,
        step_s=statistics.median(wall_before + wall_after),
        step_cpu_s=statistics.median(cpu_before + cpu_after),
        profile_s=profile_s,
        profile_cpu_s=profile_cpu_s,
        measured_2b_bytes=measured_2b,
        predicted_2b_bytes=scaled.predicted_peak_bytes,
    )


def _mark(ok: bool) -> str:
    return "meets" if ok else "**misses**"


def report(rows: list[Row], steps: int) -> str:
    lines = [
        "# Profile accuracy and cost",
        "",
        f"Reproduce with `{COMMAND}`.",
        f"Measured with torch {torch.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()} CPU, {torch.get_num_threads()} threads, on a shared machine "
        "(times are noisy; memory figures are exact and deterministic).",
        "",
        "## No-checkpoint peak: the profile's prediction against the tracker (target +-3%)",
        "",
        "| model | batch | stages | measured | predicted | error | target | simulator's peak "
        "event | measured peak at | gradients alive there / all |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.spec} | {r.batch_size} | {r.stages} | {format_bytes(r.measured_bytes)} | "
            f"{format_bytes(r.predicted_bytes)} | {r.error:+.2%} | "
            f"{_mark(abs(r.error) <= 0.03)} | {r.predicted_event} | {r.measured_where} | "
            f"{format_bytes(r.grads_at_peak_bytes)} / {format_bytes(r.grads_bytes)} |"
        )
    lines += [
        "",
        "The cost model adds each part's parameter gradients right after its backward's "
        "peak (`grad_bytes` per stage, `post_chain_grads`, `pre_chain_grads`; those created "
        "before the peak are inside its measured transient), the optimizer step's "
        "temporaries at its event, and lets a stage that does not save its input "
        "(`saves_input`) free it after its forward (docs/cost-model.md). The last column is "
        "what the tracker saw alive of the gradients at the measured peak.",
        "",
        "## Profiling time in training steps (target <= 10)",
        "",
        f"One step: the median of {2 * steps} plain AdamW steps of the same model in the same "
        "process, half before and half after profiling (after a warm-up step each).",
        "",
        "| model | one step (wall) | profile (wall) | steps | target | one step (CPU) | "
        "profile (CPU) | steps (CPU) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio, cpu_ratio = r.profile_s / r.step_s, r.profile_cpu_s / r.step_cpu_s
        lines.append(
            f"| {r.spec} | {r.step_s * 1e3:.1f} ms | {r.profile_s:.2f} s | {ratio:.1f} | "
            f"{_mark(ratio <= 10)} | {r.step_cpu_s * 1e3:.1f} ms | {r.profile_cpu_s:.2f} s | "
            f"{cpu_ratio:.1f} |"
        )
    lines += [
        "",
        "## Batch scaling: predicting batch 2b from a profile at b fitted with b/2 (target +-5%)",
        "",
        "| model | b | measured at 2b | predicted at 2b | error | target |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.spec} | {r.batch_size} | {format_bytes(r.measured_2b_bytes)} | "
            f"{format_bytes(r.predicted_2b_bytes)} | {r.error_2b:+.2%} | "
            f"{_mark(abs(r.error_2b) <= 0.05)} |"
        )
    lines += [
        "",
        "The prediction at 2b goes through the same simulator on the fitted profile; "
        "what remains is the linear fit of each measured quantity in the batch size.",
        "",
    ]
    return "\n".join(lines)


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="plain steps timed before/after")
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".md")))
    args = parser.parse_args(argv)
    rows = []
    for spec in MODELS:
        row = measure(spec, args.steps)
        print(
            f"{spec}: measured {format_bytes(row.measured_bytes)}, predicted "
            f"{format_bytes(row.predicted_bytes)} ({row.error:+.2%}); profile "
            f"{row.profile_s / row.step_s:.1f} steps; 2b {row.error_2b:+.2%}",
            flush=True,
        )
        rows.append(row)
    text = report(rows, args.steps)
    Path(args.out).write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
