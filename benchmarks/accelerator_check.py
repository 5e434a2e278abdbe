"""A fake profile for a device against a real profile on that device.

Issue 18 sizes steps for accelerators from fake tensors on a CPU, with the device's
attention and dropout kernels stood in (``remat.profiling.device_kernels``) and times from
a roofline over the device table's entry. Where an accelerator is at hand, this script
checks all three against the real thing, per model:

- bytes: per stage, what the real profile on the device counts (saved for backward with
  ``keep``, the boundary) against the fake profile sized for ``--target``; the fixed
  costs likewise;
- times: each stage's forward, and the per-stage regions' overhead through the simulator,
  estimated (roofline) against measured;
- a plan made from the fake profile at a budget halfway between the least peak and no
  checkpointing, applied to the real model on the device: its measured peak (the
  live-storage tracker, and on CUDA the allocator's peak) against the prediction, and its
  measured step-time overhead over no plan (medians of interleaved steps) against the
  prediction.

    PYTHONPATH=src python benchmarks/accelerator_check.py --on cuda --target h200
    PYTHONPATH=src .venv/bin/python benchmarks/accelerator_check.py --on cpu --target cpu --small

(the second is how this script is tried on a CPU-only machine: small sizes, the ``cpu``
entry as ``remat calibrate`` wrote it). Output: a markdown report on stdout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import traceback
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch.utils._pytree import tree_map

import remat
from remat.core.planner import to_problem
from remat.core.solve import simulate
from remat.measure import measure_step
from remat.models import load_model

# name, load_model options, default dtype
FULL: list[tuple[str, dict[str, Any], torch.dtype]] = [
    ("hf:llama", {"num_hidden_layers": 6, "hidden_size": 2048, "num_attention_heads": 16,
                  "num_key_value_heads": 4, "intermediate_size": 5632, "vocab_size": 32000,
                  "seq_len": 2048, "max_position_embeddings": 2048, "batch_size": 4},
     torch.bfloat16),
    ("gpt", {"n_layer": 6, "n_embd": 1024, "n_head": 16, "block_size": 1024,
             "vocab_size": 32000, "batch_size": 8, "dropout": 0.1}, torch.bfloat16),
    ("resnet", {"width": 64, "image_size": 64, "batch_size": 64}, torch.float32),
    ("hf:gpt2", {"n_layer": 4, "n_embd": 1024, "n_head": 16, "n_positions": 1024,
                 "vocab_size": 32000, "seq_len": 1024, "batch_size": 8}, torch.bfloat16),
]
SMALL: list[tuple[str, dict[str, Any], torch.dtype]] = [
    ("hf:llama", {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
                  "seq_len": 32, "max_position_embeddings": 64, "batch_size": 2},
     torch.float32),
    ("gpt", {"n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 32, "vocab_size": 128,
             "batch_size": 2, "dropout": 0.1}, torch.float32),
    ("resnet", {"width": 8, "image_size": 16, "batch_size": 4}, torch.float32),
    ("hf:gpt2", {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 64,
                 "vocab_size": 128, "seq_len": 32, "batch_size": 2}, torch.float32),
]
MIB = 1 << 20


def _build(name: str, options: dict[str, Any], dtype: torch.dtype, fake: bool) -> Any:
    torch.set_default_dtype(dtype)
    try:
        if fake:
            with remat.fake_mode():
                return load_model(name, **options)
        return load_model(name, **options)
    finally:
        torch.set_default_dtype(torch.float32)


def _on(device: torch.device, model: torch.nn.Module, batch: Any) -> Any:
    model.to(device)
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step_seconds(model: Any, batch: Any, loss_fn: Any, opt: Any, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    loss = loss_fn(model, batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    _sync(device)
    return time.perf_counter() - start


def _pct(a: float, b: float) -> str:
    return f"{100 * (a / b - 1):+.1f}%" if b else "n/a"


def check(name: str, options: dict[str, Any], dtype: torch.dtype, device: torch.device,
          target: str, rounds: int) -> None:
    print(f"\n## `{name}` ({dtype}, {options})\n", flush=True)
    t0 = time.perf_counter()
    model, batch, loss_fn = _build(name, options, dtype, fake=False)
    batch = _on(device, model, batch)
    real = remat.profile(model, batch, loss_fn, repeats=3)
    t1 = time.perf_counter()
    fake_model, fake_batch, fake_loss = _build(name, options, dtype, fake=True)
    fake = remat.profile(fake_model, fake_batch, fake_loss, fake=True, device=target)
    t2 = time.perf_counter()
    print(f"real profile {t1 - t0:.1f} s on {real.device}; fake profile for `{target}` "
          f"{t2 - t1:.1f} s; kernels assumed: {fake.kernels}\n")
    print("| stage | saved keep real MiB | fake | diff bytes | boundary real MiB | diff bytes "
          "| fwd real ms | estimated | error | bwd real ms | estimated | error |")
    print("| --- |" + " --- |" * 11)
    for r, f in zip(real.stages, fake.stages, strict=True):
        rs, fs = r.saved_bytes.get("keep", 0), f.saved_bytes.get("keep", 0)
        print(f"| {r.name} | {rs / MIB:.2f} | {fs / MIB:.2f} | {fs - rs:+d} | "
              f"{r.boundary_bytes / MIB:.2f} | {f.boundary_bytes - r.boundary_bytes:+d} | "
              f"{1e3 * r.fwd_s:.3f} | {1e3 * f.fwd_s:.3f} | {_pct(f.fwd_s, r.fwd_s)} | "
              f"{1e3 * r.bwd_s:.3f} | {1e3 * f.bwd_s:.3f} | {_pct(f.bwd_s, r.bwd_s)} |")
    fr, ff = real.fixed.to_dict(), fake.fixed.to_dict()
    differ = {k: (fr[k], ff.get(k)) for k in fr if fr[k] != ff.get(k)}
    print(f"\nfixed costs that differ (real, fake): {differ or 'none'}")
    print(f"peak without checkpointing: real profile's prediction "
          f"{real.predicted_peak_bytes / MIB:.1f} MiB, measured "
          f"{real.measured_peak_bytes / MIB:.1f}; fake's prediction "
          f"{fake.predicted_peak_bytes / MIB:.1f} MiB")

    per_stage = remat.plan(fake, None, solver="per-stage")
    for label, prof in (("real", real), ("estimated", fake)):
        prob = to_problem(prof)
        none = simulate(remat.plan(prof, None, solver="none"), prob).time.total_s
        got = simulate(per_stage, prob).time.total_s
        print(f"per-stage regions' overhead, {label} times: {_pct(got, none)}")

    least = remat.plan(fake, None, solver="min-peak").predicted_peak_bytes
    assert least is not None and fake.predicted_peak_bytes is not None
    budget = (least + fake.predicted_peak_bytes) // 2
    chosen = remat.plan(fake, budget)
    predicted = simulate(chosen, to_problem(fake))
    predicted_none = simulate(remat.plan(fake, None, solver="none"), to_problem(fake))
    print(f"\nplan from the fake profile at {budget / MIB:.1f} MiB: regions "
          f"{chosen.regions}, options {list(chosen.options)}")
    remat.apply(model, chosen)
    try:
        step = measure_step(model, batch, loss_fn)
    finally:
        remat.remove(model)
    line = (f"measured peak {step.peak_bytes / MIB:.1f} MiB (tracker) against "
            f"{predicted.peak_bytes / MIB:.1f} predicted "
            f"({_pct(step.peak_bytes, predicted.peak_bytes)}); within budget: "
            f"{step.peak_bytes <= budget}")
    if step.cuda_allocated_peak_bytes is not None:
        line += (f"; the CUDA allocator's peak {step.cuda_allocated_peak_bytes / MIB:.1f} MiB "
                 f"({_pct(step.cuda_allocated_peak_bytes, predicted.peak_bytes)})")
    print(line)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times: dict[str, list[float]] = {"none": [], "plan": []}
    for _ in range(2):  # warm-up, both
        _step_seconds(model, batch, loss_fn, opt, device)
    for _ in range(rounds):
        for which in ("none", "plan"):
            if which == "plan":
                remat.apply(model, chosen)
            try:
                times[which].append(_step_seconds(model, batch, loss_fn, opt, device))
            finally:
                if which == "plan":
                    remat.remove(model)
    ratios = [p / n for p, n in zip(times["plan"], times["none"], strict=True)]
    estimated = _pct(predicted.time.total_s, predicted_none.time.total_s)
    print(f"step: no plan {1e3 * statistics.median(times['none']):.2f} ms measured, "
          f"{1e3 * predicted_none.time.total_s:.2f} estimated; the plan's overhead "
          f"{100 * (statistics.median(ratios) - 1):+.1f}% measured (median of {rounds} "
          f"interleaved rounds) against {estimated} estimated", flush=True)
    del model, batch, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--on", default="cuda", help="where the real model runs")
    parser.add_argument("--target", default="h200", help="the device entry the fake sizes for")
    parser.add_argument("--small", action="store_true", help="small sizes (a CPU trial)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--models", nargs="*", default=None)
    args = parser.parse_args()
    device = torch.device(args.on)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
        where = torch.cuda.get_device_name(device)
    else:
        where = "CPU"
    print(f"# A fake profile for `{args.target}` against a real profile on {where}\n")
    print(f"torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for name, options, dtype in SMALL if args.small else FULL:
        if args.models and name not in args.models:
            continue
        try:
            check(name, options, dtype, device, args.target, args.rounds)
        except Exception:  # one model's failure is a finding, not the end of the report
            print("```\n" + traceback.format_exc() + "```", flush=True)


if __name__ == "__main__":
    main()
