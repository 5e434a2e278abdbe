"""A real variable-length fine-tuning run under one memory budget (issue 48, item 6).

A small ``hf:llama`` is fine-tuned with AdamW for ``--steps`` steps on batches padded
dynamically (each batch to its longest sequence rounded up to a multiple of 8, with
``attention_mask`` and ``labels`` at -100 on the padding), the sequence lengths drawn
from a log-normal distribution clipped to ``[--seq-lo, --seq-hi]`` (seeded), as
instruction-tuning sets look; ``--group-by-length`` batches them in the order
transformers' ``group_by_length=True`` does (groups of 50 batches sorted by length), so
each batch is padded to about its own sequences' length. Every configuration sees the same
batches, from the same initial weights, at the same budget:

* ``p``: per-layer checkpointing, transformers' own ``model.gradient_checkpointing_enable()``;
* ``a``: remat's single plan for the longest shape (profiled and planned at ``--seq-hi``,
  applied for every step);
* ``s``: remat's plan set over ``seq=<lo>..<hi>:8`` (``profile_shapes`` + ``plan_set``):
  each step runs the plan of its batch's shape.

The budget is per-layer checkpointing's measured peak of a whole training step at
``--seq-hi`` (so all three fit there), the tightest budget (b) runs under; ``--budget F``
sets it to the fraction ``F`` of the plain model's measured peak there instead (at least
per-layer checkpointing's). Memory: one pass over all steps per configuration
(and the plain model, for reference) with remat's live-storage tracker around each whole
step, as ``measure_step`` counts it (parameters, gradients, optimizer state, the batch,
activations). Time: untracked passes, ``--runs`` runs; in each, the three configurations
train from identical initial weights *step by step interleaved* (batch k's step of p, a
and s, in an order that rotates every step), each configuration's total the sum of its
step times. The machine's speed moves by 2x within minutes; whole passes one after the
other (the first recorded runs) let that move into the ratios, steps side by side do not.
Losses of every pass are compared bitwise with the plain model's, step by step.

Run from the repository root::

    PYTHONPATH=src .venv/bin/python benchmarks/variable_length.py

writes ``benchmarks/variable_length.json`` and ``benchmarks/variable_length.md``;
``--quick`` (a tiny model, a few steps, seq 32..128) is what the test runs.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import math
import platform
import random
import statistics
import subprocess
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import remat
from remat.core.plan_format import Plan
from remat.core.plan_set import PlanSet, plan_set
from remat.core.shape_profiles import at_shape
from remat.core.solve.from_profile import problem_from_profile
from remat.core.solve.simulator import simulate
from remat.measure.malloc import MALLOC_MODES, set_malloc
from remat.measure.tracker import LiveMemoryTracker
from remat.models import load_model
from remat.models.hf import hf_loss
from remat.profiling.shaped import profile_shapes

HERE = Path(__file__).resolve().parent
COMMAND = "PYTHONPATH=src .venv/bin/python benchmarks/variable_length.py"
CONFIGS = ("p", "a", "s")
NAMES = {
    "plain": "no checkpointing (reference, over the budget)",
    "p": "per-layer checkpointing (transformers' gradient_checkpointing_enable)",
    "a": "remat, one plan for the longest shape",
    "s": "remat, plan set over the range",
}
TARGET = 0.85  # (s) / (a) total time


def settings(quick: bool) -> dict[str, Any]:
    if quick:
        return {"hidden": 32, "layers": 2, "heads": 2, "vocab": 1000, "batch": 4,
                "steps": 6, "runs": 1, "seq_lo": 32, "seq_hi": 128, "mu": math.log(48),
                "sigma": 0.9, "seed": 0, "lr": 1e-4, "repeats": 1}
    return {"hidden": 128, "layers": 4, "heads": 2, "vocab": 1000, "batch": 4,
            "steps": 200, "runs": 3, "seq_lo": 32, "seq_hi": 1024, "mu": math.log(128),
            "sigma": 0.9, "seed": 0, "lr": 1e-4, "repeats": 2}


def round8(n: int) -> int:
    return -(-n // 8) * 8


def draw_lengths(cfg: dict[str, Any]) -> list[int]:
    """``steps * batch`` lengths: log-normal(mu, sigma), rounded, clipped to the range."""
    rng = random.Random(cfg["seed"])
    n = cfg["steps"] * cfg["batch"]
    return [min(cfg["seq_hi"], max(cfg["seq_lo"], round(rng.lognormvariate(cfg["mu"],
                                                                           cfg["sigma"]))))
            for _ in range(n)]


#: examples per group of --group-by-length, in batches (transformers' LengthGroupedSampler
#: sorts groups of 50 batches by length)
GROUP_BATCHES = 50


def grouped_by_length(lengths: list[int], batch: int, seed: int) -> list[int]:
    """``lengths`` in the order transformers' ``group_by_length=True`` trains them: shuffled,
    cut into groups of ``GROUP_BATCHES`` batches, each group sorted longest first, and the
    batch holding the longest sequence of all moved to the front (so a run that will not
    fit fails at once)."""
    order = list(lengths)
    random.Random(seed + 2).shuffle(order)
    size = GROUP_BATCHES * batch
    out = [n for k in range(0, len(order), size)
           for n in sorted(order[k:k + size], reverse=True)]
    batches = [out[k:k + batch] for k in range(0, len(out), batch)]
    longest = max(range(len(batches)), key=lambda j: max(batches[j]))
    batches.insert(0, batches.pop(longest))
    return [n for b in batches for n in b]


def padded(lengths: list[int], seq: int, vocab: int, gen: torch.Generator
           ) -> dict[str, torch.Tensor]:
    """One right-padded batch of ``seq`` tokens: pad id 0, mask 0 and labels -100 there."""
    ids = torch.randint(1, vocab, (len(lengths), seq), generator=gen)
    mask = (torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def make_batches(cfg: dict[str, Any], lengths: list[int]) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(cfg["seed"])
    out = []
    for k in range(cfg["steps"]):
        chunk = lengths[k * cfg["batch"]:(k + 1) * cfg["batch"]]
        out.append(padded(chunk, min(cfg["seq_hi"], round8(max(chunk))), cfg["vocab"], gen))
    return out


def example(cfg: dict[str, Any], seq: int) -> dict[str, torch.Tensor]:
    """A padded batch of ``seq`` tokens whose rows are seq, 3/4, 1/2 and 1/4 of it long: the
    mask has padding (as every real batch here has), so the model takes the same path."""
    rows = [max(1, seq * (4 - k) // 4) for k in range(cfg["batch"] % 4 or 4)]
    rows = (rows * cfg["batch"])[:cfg["batch"]]
    return padded(rows, seq, cfg["vocab"], torch.Generator().manual_seed(cfg["seed"] + 1))


def build_model(cfg: dict[str, Any]) -> nn.Module:
    model, _, _ = load_model(
        "hf:llama", hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"], max_position_embeddings=cfg["seq_hi"],
        vocab_size=cfg["vocab"], dropout=0.0, seq_len=cfg["seq_lo"], seed=cfg["seed"])
    return model


def per_layer(model: nn.Module) -> None:
    with warnings.catch_warnings():  # transformers 5 renamed it; the old name still works
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()


def setup(name: str, init: nn.Module, plan_a: Plan, plans: PlanSet) -> tuple[nn.Module, Any]:
    """A copy of the initial model in configuration ``name``, and remat's handle (or None)."""
    model = copy.deepcopy(init)
    model.train()
    handle = None
    if name == "p":
        per_layer(model)
    elif name == "a":
        handle = remat.apply(model, plan_a)
    elif name == "s":
        handle = remat.apply(model, plans)
    return model, handle


def step_peak(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> tuple[float, int]:
    """One training step inside the live-storage tracker (as ``measure_step`` counts it)."""
    tracker = LiveMemoryTracker(device=torch.device("cpu"))
    tracker.register_existing(model)
    tracker.register_existing(opt)
    tracker.register_existing(list(batch.values()))
    tracker.watch(model)
    tracker.watch(opt)
    with tracker:
        loss = hf_loss(model, batch)
        value = loss.item()
        loss.backward()
        del loss
        opt.step()
    opt.zero_grad(set_to_none=True)
    return value, tracker.report().peak_bytes


def tracked_pass(name: str, init: nn.Module, plan_a: Plan, plans: PlanSet,
                 batches: list[Any], lr: float) -> dict[str, Any]:
    model, handle = setup(name, init, plan_a, plans)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, peaks, ran = [], [], []
    began = time.perf_counter()
    for batch in batches:
        loss, peak = step_peak(model, opt, batch)
        losses.append(loss)
        peaks.append(peak)
        if name == "s":
            ran.append(plans.plans.index(handle.running))
    out = {"losses": losses, "peaks": peaks, "seconds": time.perf_counter() - began,
           "final": [p.detach().clone() for p in model.parameters()]}
    if ran:
        out["plan_index"] = ran
    return out


def timed_interleaved(init: nn.Module, plan_a: Plan, plans: PlanSet, batches: list[Any],
                      lr: float, first: int) -> dict[str, dict[str, Any]]:
    """Every configuration trained over ``batches`` at once, step by step: batch k's step
    of each, in ``CONFIGS`` order rotated by ``first + k``; per configuration the sum of
    its step times (the loss's ``item()`` included), the step times and the losses."""
    runs = {}
    for name in CONFIGS:
        model, _ = setup(name, init, plan_a, plans)
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=lr), [], [])
    gc.collect()
    for k, batch in enumerate(batches):
        shift = (first + k) % len(CONFIGS)
        for name in CONFIGS[shift:] + CONFIGS[:shift]:
            model, opt, times, losses = runs[name]
            t = time.perf_counter()
            loss = hf_loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            times.append(time.perf_counter() - t)
    return {name: {"total_s": sum(times), "step_s": times, "losses": losses}
            for name, (_, _, times, losses) in runs.items()}


def predictions(prof: Any, plan_a: Plan, plans: PlanSet, shapes: list[int]
                ) -> dict[int, dict[str, Any]]:
    """Per distinct padded length: each remat plan's predicted peak and step time there."""
    out = {}
    for seq in sorted(set(shapes)):
        problem = problem_from_profile(at_shape(prof, (seq,)))
        k = plans.choose((seq,))
        sa, ss = simulate(plan_a, problem), simulate(plans.plans[k], problem)
        out[seq] = {"plan": k, "a_peak": sa.peak_bytes, "a_time_s": sa.step_time_s,
                    "s_peak": ss.peak_bytes, "s_time_s": ss.step_time_s,
                    "plain_time_s": simulate(Plan(plans.stages), problem).step_time_s}
    return out


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def commit() -> str:
    """The commit the run's code is at, ``+`` where the tree differs from it (read when the
    run starts: a commit made while it runs is not the code it ran)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=HERE).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True, cwd=HERE).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+" if dirty.strip() else "")


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def bins_of(seqs: list[int], hi: int) -> list[tuple[int, int]]:
    edges = [0, hi // 8, hi // 4, hi // 2, hi]
    return [(edges[k] + 1, edges[k + 1]) for k in range(len(edges) - 1)]


def run(cfg: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    torch.set_num_threads(1)
    lengths = draw_lengths(cfg)
    if cfg.get("group_by_length"):
        lengths = grouped_by_length(lengths, cfg["batch"], cfg["seed"])
    batches = make_batches(cfg, lengths)
    seqs = [int(b["input_ids"].shape[1]) for b in batches]
    at_commit = commit()
    init = build_model(cfg)
    hi, lo = cfg["seq_hi"], cfg["seq_lo"]
    shapes = f"seq={lo}..{hi}:8"

    # the budget: per-layer checkpointing's measured peak of a whole step at the longest shape
    from remat.measure.step import measure_step
    gc.collect()
    probe = copy.deepcopy(init)
    per_layer(probe)
    layer_peak = measure_step(probe, example(cfg, hi), hf_loss, "adamw").peak_bytes
    plain_peak = measure_step(copy.deepcopy(init), example(cfg, hi), hf_loss, "adamw").peak_bytes
    del probe
    budget = layer_peak
    rule = f"per-layer checkpointing's measured peak of a whole step at seq {hi}"
    if cfg.get("budget") is not None:
        budget = int(cfg["budget"] * plain_peak)
        rule = (f"{cfg['budget']:.0%} of the plain model's measured peak of a whole step at seq "
                f"{hi} (per-layer checkpointing's there: {mib(layer_peak)})")
        if budget < layer_peak:
            raise SystemExit(f"--budget {cfg['budget']} is {mib(budget)}, under per-layer "
                             f"checkpointing's peak {mib(layer_peak)}: give a larger fraction")
    log(f"budget {mib(budget)} ({rule}); plain {mib(plain_peak)}")

    # one-off costs: (a) profile at the longest shape + plan; (s) profile the range + plan set
    t0 = time.perf_counter()
    prof_a = remat.profile(copy.deepcopy(init), example(cfg, hi), hf_loss,
                           repeats=cfg["repeats"])
    t1 = time.perf_counter()
    plan_a = remat.plan(prof_a, budget)
    t2 = time.perf_counter()
    prof_s = profile_shapes(copy.deepcopy(init), example(cfg, lo), hf_loss, shapes,
                            repeats=cfg["repeats"])
    t3 = time.perf_counter()
    plans = plan_set(prof_s, budget)
    t4 = time.perf_counter()
    one_off = {"a": {"profile_s": t1 - t0, "plan_s": t2 - t1},
               "s": {"profile_s": t3 - t2, "plan_s": t4 - t3}}
    log(f"profiled+planned: a {t2 - t0:.1f} s, s {t4 - t2:.1f} s; plan set:")
    for line in plans.describe():
        log("  " + line)
    predicted = predictions(prof_s, plan_a, plans, seqs)

    # memory: one tracked pass per configuration (and the plain model, for its losses)
    tracked = {}
    for name in ("plain", *CONFIGS):
        gc.collect()
        tracked[name] = tracked_pass(name, init, plan_a, plans, batches, cfg["lr"])
        worst = max(tracked[name]["peaks"])
        log(f"tracked {name}: worst step {mib(worst)} of {mib(budget)} "
            f"({tracked[name]['seconds']:.0f} s)")
    reference = tracked["plain"]["losses"]

    # time: untracked runs, the configurations interleaved step by step, identical
    # initial weights
    runs = []
    for r in range(cfg["runs"]):
        got = timed_interleaved(init, plan_a, plans, batches, cfg["lr"], r)
        log(f"run {r + 1}: " + ", ".join(f"{n} {got[n]['total_s']:.2f} s" for n in CONFIGS))
        order = CONFIGS[r % 3:] + CONFIGS[:r % 3]
        runs.append({"order": "".join(order), **{n: got[n] for n in CONFIGS}})

    # --- figures ---
    memory = {}
    for name, t in tracked.items():
        peaks = t["peaks"]
        worst = max(range(len(peaks)), key=lambda k: peaks[k])
        memory[name] = {
            "worst_peak_bytes": peaks[worst], "worst_step": worst, "worst_seq": seqs[worst],
            "worst_over_budget": peaks[worst] / budget,
            "steps_over_budget": sum(p > budget for p in peaks),
            "losses_equal_plain": t["losses"] == reference,
            "final_weights_equal_plain": all(
                torch.equal(x, y) for x, y in zip(t["final"], tracked["plain"]["final"],
                                                  strict=True)),
            "tracked_pass_s": t["seconds"],
        }
    s_index = tracked["s"]["plan_index"]
    over = [(k, seqs[k], s_index[k], tracked["s"]["peaks"][k], predicted[seqs[k]]["s_peak"])
            for k in range(len(seqs)) if tracked["s"]["peaks"][k] > budget]
    mismatch = [(k, seqs[k], s_index[k], plans.choose((seqs[k],)))
                for k in range(len(seqs)) if s_index[k] != plans.choose((seqs[k],))]
    s_err = max(tracked["s"]["peaks"][k] - predicted[seqs[k]]["s_peak"]
                for k in range(len(seqs)))
    a_err = max(tracked["a"]["peaks"][k] - predicted[seqs[k]]["a_peak"]
                for k in range(len(seqs)))

    per_run = []
    for r in runs:
        tot = {n: r[n]["total_s"] for n in CONFIGS}
        per_run.append({"order": r["order"], "total_s": tot,
                        "s_over_a": tot["s"] / tot["a"], "s_over_p": tot["s"] / tot["p"],
                        "losses_equal_plain": {n: r[n]["losses"] == reference
                                               for n in CONFIGS}})
    median_total = {n: statistics.median(r["total_s"][n] for r in per_run) for n in CONFIGS}
    timing = {
        "runs": per_run,
        "median_total_s": median_total,
        "median_s_over_a": statistics.median(r["s_over_a"] for r in per_run),
        "median_s_over_p": statistics.median(r["s_over_p"] for r in per_run),
        "ratio_of_median_totals_s_over_a": median_total["s"] / median_total["a"],
        "ratio_of_median_totals_s_over_p": median_total["s"] / median_total["p"],
        "target_s_over_a": TARGET,
        "runs_meeting_target": sum(r["s_over_a"] <= TARGET for r in per_run),
    }
    # where the time goes: per length bin, median over runs of the summed step times
    bins = []
    for a, b in bins_of(seqs, hi):
        idx = [k for k, s in enumerate(seqs) if a <= s <= b]
        row = {"seq": [a, b], "steps": len(idx)}
        for n in CONFIGS:
            row[n + "_s"] = statistics.median(sum(r[n]["step_s"][k] for k in idx) for r in runs)
        row["plans_run"] = dict(Counter(s_index[k] for k in idx))
        row["pred_a_s"] = sum(predicted[seqs[k]]["a_time_s"] for k in idx)
        row["pred_s_s"] = sum(predicted[seqs[k]]["s_time_s"] for k in idx)
        row["pred_plain_s"] = sum(predicted[seqs[k]]["plain_time_s"] for k in idx)
        bins.append(row)
    pred_total = {n: sum(predicted[s][n + "_time_s"] for s in seqs) for n in ("a", "s", "plain")}
    usage = Counter(s_index)
    return {
        "command": cfg["command"],
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "commit": at_commit,
        "threads": torch.get_num_threads(),
        "settings": {k: v for k, v in cfg.items() if k != "command"},
        "distribution": (f"log-normal(mu=ln({math.exp(cfg['mu']):.0f}), sigma={cfg['sigma']}) "
                         f"per sequence, rounded, clipped to [{lo}, {hi}], "
                         f"random.Random({cfg['seed']}); batches of {cfg['batch']} padded "
                         "to their longest rounded up to a multiple of 8"
                         + (f"; grouped by length as transformers' group_by_length=True "
                            f"(groups of {GROUP_BATCHES} batches sorted longest first, the "
                            "longest batch first)" if cfg.get("group_by_length") else "")),
        "lengths": {"median": statistics.median(lengths), "max": max(lengths),
                    "padded_median": statistics.median(seqs), "padded_mean": statistics.mean(seqs),
                    "padded_max": max(seqs), "distinct_padded": len(set(seqs)),
                    "steps_at_max": sum(s == hi for s in seqs)},
        "budget_bytes": budget,
        "budget_rule": rule,
        "plain_peak_at_max_bytes": plain_peak,
        "memory": memory,
        "s_steps_over_budget": [{"step": k, "seq": s, "plan": j, "measured": m,
                                 "predicted": p} for k, s, j, m, p in over],
        "s_plan_choice_mismatches": mismatch,
        "s_most_measured_over_predicted_bytes": s_err,
        "a_most_measured_over_predicted_bytes": a_err,
        "timing": timing,
        "time_by_length": bins,
        "predicted_total_s": pred_total,
        "predicted_s_over_a": pred_total["s"] / pred_total["a"],
        "one_off": one_off,
        "plan_a": {"regions": [str(x) for x in plan_a.regions],
                   "options": list(plan_a.options),
                   "predicted_peak_bytes": plan_a.predicted_peak_bytes},
        "plan_set": {"describe": plans.describe(), "plans": len(plans.plans),
                     "shapes": plans.shapes, "solved": plans.solved,
                     "slowest_ratio": plans.slowest_ratio,
                     "regions": [[str(x) for x in p.regions] for p in plans.plans],
                     "steps_per_plan": {str(k): usage.get(k, 0)
                                        for k in range(len(plans.plans))}},
        "stages": list(plans.stages),
        "per_step": {"seq": seqs, "s_plan": s_index,
                     **{f"{n}_peak": tracked[n]["peaks"] for n in ("plain", *CONFIGS)},
                     "a_predicted_peak": [predicted[x]["a_peak"] for x in seqs],
                     "s_predicted_peak": [predicted[x]["s_peak"] for x in seqs],
                     "plain_loss": reference},
    }


def markdown(res: dict[str, Any]) -> str:
    st, tm, mem = res["settings"], res["timing"], res["memory"]
    budget = res["budget_bytes"]
    out = [
        "# A real variable-length run: per-layer checkpointing vs remat's plan vs its plan set",
        "",
        "Issue 48, item 6. Written by `benchmarks/variable_length.py`; every figure is in "
        f"`{res.get('json_name', 'variable_length.json')}` beside this file.",
        "",
        "```console",
        f"$ {res['command']}",
        "```",
        "",
        f"- machine: {res['machine']}; `torch.set_num_threads({res['threads']})`; allocator: "
        f"{st.get('malloc', 'glibc defaults')}",
        f"- torch {res['torch']}, transformers {res['transformers']}, Python {res['python']}, "
        f"remat at commit {res['commit']}",
        f"- date: {res['date']}",
        f"- runs: {len(tm['runs'])} timed runs (p, a and s interleaved step by step, the "
        "order rotating every step; 'order' is the first step's) after one "
        "tracked pass per configuration",
        "",
        "## The run",
        "",
        f"- model: `hf:llama`, hidden {st['hidden']}, {st['layers']} layers, {st['heads']} "
        f"heads, vocabulary {st['vocab']}, dropout 0, random weights (seed {st['seed']}); "
        f"AdamW lr {st['lr']}, {st['steps']} steps",
        f"- lengths: {res['distribution']}",
        f"- sequence lengths: median {res['lengths']['median']}, longest "
        f"{res['lengths']['max']}; padded batch lengths: median "
        f"{res['lengths']['padded_median']}, mean {res['lengths']['padded_mean']:.1f}, "
        f"{res['lengths']['distinct_padded']} distinct, {res['lengths']['steps_at_max']} "
        f"steps at {st['seq_hi']}",
        f"- budget: **{mib(budget)}** ({budget} bytes) = {res['budget_rule']}; the plain "
        f"model's peak there is {mib(res['plain_peak_at_max_bytes'])} (the budget is "
        f"{budget / res['plain_peak_at_max_bytes']:.0%} of it)",
        "",
        "## Memory: every step's measured peak (live-storage tracker, whole step)",
        "",
        "| configuration | most any step reached | step (seq) | / budget | steps over "
        "budget | losses = plain's, step by step | final weights = plain's |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in ("p", "a", "s", "plain"):
        m = mem[name]
        out.append(f"| {name}: {NAMES[name]} | {mib(m['worst_peak_bytes'])} | "
                   f"{m['worst_step']} ({m['worst_seq']}) | {m['worst_over_budget']:.3f} | "
                   f"{m['steps_over_budget']} | {m['losses_equal_plain']} | "
                   f"{m['final_weights_equal_plain']} |")
    out += [
        "",
        f"remat's measured step peaks over its predicted ones, the most on any step: "
        f"a {res['a_most_measured_over_predicted_bytes']} bytes, "
        f"s {res['s_most_measured_over_predicted_bytes']} bytes "
        f"(s steps over budget: {len(res['s_steps_over_budget'])}; "
        f"plan chosen at run time differing from `plan_set.choose`: "
        f"{len(res['s_plan_choice_mismatches'])}).",
    ]
    over = res["s_steps_over_budget"]
    if over:
        seen: dict[int, dict[str, Any]] = {}
        for o in over:
            seen.setdefault(o["seq"], {**o, "count": 0})["count"] += 1
        out += [
            "",
            f"**(s) went over the budget on {len(over)} steps** (by padded length; predicted "
            "= the simulator's peak of the plan the set chose, at that shape):",
            "",
            "| seq | steps | plan | measured | predicted | measured - predicted | "
            "measured - budget |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for seq, o in sorted(seen.items()):
            out.append(f"| {seq} | {o['count']} | {o['plan']} | {o['measured']} | "
                       f"{o['predicted']} | {o['measured'] - o['predicted']} | "
                       f"{o['measured'] - budget} |")
    out += [
        "",
        "## Time: the steps' summed wall time (untracked, interleaved step by step)",
        "",
        "| run | order | p (s) | a (s) | s (s) | s / a | s / p | s/a <= "
        f"{TARGET} | losses bitwise = plain's (p, a, s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k, r in enumerate(tm["runs"]):
        t = r["total_s"]
        eq = ", ".join(str(r["losses_equal_plain"][n]) for n in CONFIGS)
        out.append(f"| {k + 1} | {r['order']} | {t['p']:.2f} | {t['a']:.2f} | {t['s']:.2f} | "
                   f"{r['s_over_a']:.3f} | {r['s_over_p']:.3f} | "
                   f"{'yes' if r['s_over_a'] <= TARGET else 'no'} | {eq} |")
    med = tm["median_total_s"]
    out += [
        f"| median | | {med['p']:.2f} | {med['a']:.2f} | {med['s']:.2f} | "
        f"{tm['median_s_over_a']:.3f} | {tm['median_s_over_p']:.3f} | | |",
        "",
        f"Target (s) / (a) <= {TARGET}: met in **{tm['runs_meeting_target']} of "
        f"{len(tm['runs'])}** runs (median of the per-run ratios {tm['median_s_over_a']:.3f}; "
        f"ratio of the median totals {tm['ratio_of_median_totals_s_over_a']:.3f}). "
        f"remat's cost model predicted s / a = {res['predicted_s_over_a']:.3f} for these "
        f"batches (predicted totals: a {res['predicted_total_s']['a']:.1f} s, s "
        f"{res['predicted_total_s']['s']:.1f} s, no checkpointing "
        f"{res['predicted_total_s']['plain']:.1f} s).",
        "",
        "### Where the time goes, by padded length (median over runs of the summed step times)",
        "",
        "| padded length | steps | p (s) | a (s) | s (s) | s / a | plan-set plans run "
        "(plan: steps) | predicted a / s / none (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for b in res["time_by_length"]:
        if not b["steps"]:
            continue
        plans_run = ", ".join(f"{k}: {v}" for k, v in sorted(b["plans_run"].items()))
        ratio = b["s_s"] / b["a_s"] if b["a_s"] else float("nan")
        out.append(f"| {b['seq'][0]}..{b['seq'][1]} | {b['steps']} | {b['p_s']:.2f} | "
                   f"{b['a_s']:.2f} | {b['s_s']:.2f} | {ratio:.3f} | {plans_run} | "
                   f"{b['pred_a_s']:.2f} / {b['pred_s_s']:.2f} / {b['pred_plain_s']:.2f} |")
    oo = res["one_off"]
    ps = res["plan_set"]
    out += [
        "",
        "## One-off costs and plans",
        "",
        "| | profiling (s) | planning (s) |",
        "| --- | --- | --- |",
        f"| a: `remat.profile` at seq {st['seq_hi']} + `remat.plan` | "
        f"{oo['a']['profile_s']:.1f} | {oo['a']['plan_s']:.2f} |",
        f"| s: `profile_shapes(seq={st['seq_lo']}..{st['seq_hi']}:8)` + `plan_set` | "
        f"{oo['s']['profile_s']:.1f} | {oo['s']['plan_s']:.2f} |",
        "",
        f"Stages: {', '.join(res['stages'])}.",
        "",
        f"Plan (a): regions {' '.join(res['plan_a']['regions']) or 'none'}, options "
        f"{', '.join(res['plan_a']['options'])}, predicted peak "
        f"{mib(res['plan_a']['predicted_peak_bytes'] or 0)}.",
        "",
        f"Plan set (s): {ps['plans']} plans over {ps['shapes']} shapes ({ps['solved']} "
        f"solved), slowest shape {ps['slowest_ratio']:.3f}x its own best; `describe()`:",
        "",
        "```",
        *ps["describe"],
        "```",
        "",
        "Steps each plan of the set ran: "
        + ", ".join(f"plan {k}: {v}" for k, v in ps["steps_per_plan"].items()) + ".",
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model, a few steps, seq 32..128 (the test's run)")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--runs", type=int)
    parser.add_argument("--malloc", choices=MALLOC_MODES, default="system",
                        help="what glibc does with freed memory for the whole run: its "
                             "defaults (system, the recorded runs' setting) or keep (as "
                             "remat's CLI and auto_checkpoint set on CPU; docs/bench.md)")
    parser.add_argument("--budget", type=float, metavar="F",
                        help="the budget as a fraction of the plain model's peak at the longest "
                             "shape (default: per-layer checkpointing's peak there)")
    parser.add_argument("--group-by-length", action="store_true",
                        help="batch sequences of similar length together, as transformers' "
                             "group_by_length=True does (default: in the order drawn)")
    parser.add_argument("--out", type=Path, default=HERE / "variable_length",
                        help="writes OUT.json and OUT.md (default benchmarks/variable_length)")
    args = parser.parse_args(argv)
    cfg = settings(args.quick)
    if args.budget is not None and not 0 < args.budget <= 1:
        parser.error(f"--budget is a fraction in (0, 1], got {args.budget}")
    for key in ("steps", "runs", "budget"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    cfg["group_by_length"] = args.group_by_length
    cfg["malloc"] = set_malloc(args.malloc)
    extra = (" --quick" if args.quick else "") + "".join(
        f" --{k} {getattr(args, k)}" for k in ("steps", "runs", "budget")
        if getattr(args, k) is not None) + (" --malloc keep" if args.malloc == "keep" else "") + (
        " --group-by-length" if args.group_by_length else "")
    if args.out != HERE / "variable_length":
        extra += f" --out {args.out}"
    cfg["command"] = COMMAND + extra

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    began = time.perf_counter()
    res = run(cfg, log)
    res["wall_s"] = time.perf_counter() - began
    res["json_name"] = args.out.with_suffix(".json").name
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    text = markdown(res) + f"\nWhole benchmark: {res['wall_s']:.0f} s.\n"
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
