"""Times without measuring: the roofline calibrated on one model, checked on the others.

Issue 18, item 3's check on this CPU: ``remat calibrate`` on the built-in gpt (its ops'
rates and the cost of a call, and a reference convolutional network's ops' rates), run
again right before and right after each measurement (the machine's speed moves within
minutes; the estimate is the geometric mean of the two), then for each model, in three
rounds, a real profile (one thread) and
the work of one step counted (``remat.profiling.op_costs``): each stage's forward time
as the roofline predicts it against the measured one, and the per-stage plan's overhead
(one region per stage) with the estimated times against the measured times, both through
the simulator. Targets: forward times within 25%, overhead within 10 points.

Run from the repository root::

    PYTHONPATH=src .venv/bin/python benchmarks/roofline_cpu.py

Prints a table and writes it to ``benchmarks/roofline_cpu.md``.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

import remat
from remat.core.plan_format import Plan, Region
from remat.core.solve import simulate
from remat.core.solve.from_profile import problem_from_profile
from remat.measure.malloc import set_malloc
from remat.models import load_model
from remat.profiling.device_calibration import calibrate_device
from remat.profiling.estimated_times import with_estimated_times
from remat.profiling.op_costs import count_work

COMMAND = "PYTHONPATH=src .venv/bin/python benchmarks/roofline_cpu.py"
CALIBRATION = "gpt"
ROUNDS = 3
PROFILE_REPEATS = 3
MODELS = ["mlp-hetero", "convnet-bn", "resnet", "unet", "encdec", "hf:llama"]


def overhead(profile: remat.Profile) -> float:
    problem = problem_from_profile(profile)
    names = profile.stage_names
    none = simulate(Plan(names), problem).step_time_s
    per_stage = Plan(names, tuple(Region(i, i + 1) for i in range(len(names))))
    return simulate(per_stage, problem).step_time_s / none - 1


def main() -> None:
    torch.set_num_threads(1)
    # as remat calibrate and remat profile run (--malloc keep): under glibc's adaptive
    # thresholds mlp-hetero's wide blocks faulted their 15 MiB in again in some steps and
    # not others (8.0 against 2.3 ms), and one run read them at -75.6%
    allocator = set_malloc("keep")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    calibration = load_model(CALIBRATION)
    device, fit = calibrate_device(*calibration, description=CALIBRATION)
    tries = [fit["attempts"]]  # per calibration: the model's measurements it took
    drifts: list[float] = []  # per round: matmul rate after the profile over before it
    before = device
    lines = ["| model | stages | forward error, median | forward error, largest | "
             "per-stage overhead measured | estimated | gap (pts), median (range) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in MODELS:
        model, batch, loss_fn = load_model(name)
        ratios: list[list[float]] = []  # per round, per stage: estimated over measured
        gaps: list[tuple[float, float]] = []  # per round: measured and estimated overhead
        # calibrated right before and right after each measurement (the after one is the
        # next round's before, the next model's too): this shared machine's speed moves by
        # up to 2x within minutes, a calibration holds for the minutes around it, and the
        # two bracket the profile in time; each estimate is the geometric mean of the two
        # calibrations', each figure the median of the rounds'
        for _ in range(ROUNDS):
            # three timed rounds: the median sets aside one a slow spell caught (two
            # gave their mean)
            profile = remat.profile(model, batch, loss_fn, repeats=PROFILE_REPEATS)
            after, later = calibrate_device(*calibration, description=CALIBRATION)
            tries.append(later["attempts"])
            drifts.append(after.peak_flops["float32"] / before.peak_flops["float32"])
            work = count_work(model, batch, loss_fn, profile.stage_names, profile.optimizer)
            bracket = [with_estimated_times(profile, work, d) for d in (before, after)]
            ratios.append([math.sqrt(e1.fwd_s * e2.fwd_s) / m.fwd_s if m.fwd_s > 0 else 1.0
                           for e1, e2, m in zip(*(b.stages for b in bracket), profile.stages,
                                                strict=True)])
            gaps.append((overhead(profile), statistics.mean(overhead(b) for b in bracket)))
            before = after
        errors = [statistics.median(r[i] for r in ratios) - 1 for i in range(len(ratios[0]))]
        worst = max(errors, key=abs)
        measured_o = statistics.median(m for m, _ in gaps)
        estimated_o = statistics.median(e for _, e in gaps)
        spread = [100 * (e - m) for m, e in gaps]
        row = (f"| `{name}` | {len(errors)} | {statistics.median(abs(e) for e in errors):.0%} "
               f"| {worst:+.1%} | {measured_o:+.1%} | {estimated_o:+.1%} | "
               f"{statistics.median(spread):+.1f} ({min(spread):+.1f} to {max(spread):+.1f}) |")
        lines.append(row)
        print(row, flush=True)
    text = "\n".join([
        "# The roofline on this CPU: calibrated on gpt, checked on the other models",
        "",
        f"Command: `{COMMAND}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared), torch "
        f"{torch.__version__}, Python {platform.python_version()}; one thread; {allocator}; "
        f"{started}. "
        f"Calibration on `{CALIBRATION}`: matmul {device.peak_flops['float32'] / 1e9:.0f} "
        f"GFLOP/s, add {device.bandwidth_bytes_per_s / 1e9:.1f} GB/s, {len(fit) and fit['ops']}"
        f" ops' rates, a call {1e6 * device.call_seconds('forward'):.1f} us in forward and "
        f"{1e6 * device.call_seconds('backward'):.1f} us in backward; its own stage times "
        f"within {fit['median_abs_error']:.0%} (median). Forward error: the estimated stage "
        "forward time over the measured median, less 1, per stage. Overhead: one region per "
        "stage against no checkpointing, through the simulator, on measured and on "
        f"estimated times. Each model is measured in {ROUNDS} rounds, each bracketed by a "
        "calibration right before and one right after it (the machine's speed moves within "
        "minutes; the figures above are the first calibration's), its estimates the "
        "geometric mean of the two calibrations' (overheads: the mean): a stage's error is "
        "the median of its rounds' ratios, an overhead the median of its rounds'. The "
        "matmul rate moved by "
        f"{min(drifts) - 1:+.0%} to {max(drifts) - 1:+.0%} between a round's two "
        f"calibrations. Each model's profile: {PROFILE_REPEATS} timed rounds. The "
        f"calibrations measured gpt {sum(tries)} times for {len(tries)} entries (Note [A "
        "calibration is retaken while its model's own stages disagree]: "
        f"{sum(t > 1 for t in tries)} retaken). One run of the script.",
        "",
        *lines,
        "",
    ])
    out = Path(__file__).with_suffix(".md")
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
