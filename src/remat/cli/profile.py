"""``remat profile``: measure a model's chain of stages and print what each one costs."""

from __future__ import annotations

import argparse
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from remat.cli.common import (
    add_fake_option,
    add_model_options,
    add_optimizer_option,
    device_note,
    fake_device,
    kernel_lines,
    load,
    load_for_profile,
    padded_batches,
    profile_with_progress,
    runs_one_thread,
)
from remat.cli.output import add_json_option, console_for, write_json
from remat.cli.shape_ranges import add_shapes_option, profile_range
from remat.core.coverage import coverage_lines
from remat.core.plan_format import Option
from remat.core.profile_format import OPTIONS
from remat.core.solve.uncertainty import noise_lines
from remat.core.units import format_bytes

# the options every profile measures, under their column titles
_OPTION_COLUMNS = tuple(zip(OPTIONS, ("keep", "matmuls", "attn", "nothing"), strict=True))


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="measure what each stage of a model saves, its boundary and its times",
        description=(
            "Profile one training step of a model: per stage its input (boundary), what it "
            "saves for backward when kept and under each selective policy, its forward, "
            "backward and rebuild times; outside the chain parameters, gradients, optimizer "
            "state and the pre- and post-chain; and the peak of a step without "
            "checkpointing, measured and as the cost model predicts it."
        ),
    )
    add_model_options(p)
    add_optimizer_option(p)
    p.add_argument("--repeats", type=int, default=2,
                   help="timed rounds of steps (default 2, at most 1000)")
    add_fake_option(p)
    add_shapes_option(p, outside=False)
    add_json_option(p)
    p.set_defaults(run=run)


def _unit(data: dict[str, Any]) -> tuple[str, int]:
    """One byte unit for the whole table, so the columns stay narrow and comparable."""
    largest = max(max(s["boundary_bytes"], *s["saved_bytes"].values()) for s in data["stages"])
    for name, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if largest >= scale:
            return name, scale
    return "B", 1


def _table(data: dict[str, Any]) -> Table:
    unit, scale = _unit(data)

    def size(n: int) -> str:
        return f"{n / scale:.2f}" if scale > 1 else str(n)

    table = Table(
        title=(
            f"Stages of {data['model']}"
            + (" (compiled)" if data.get("compiled") else "")
            + f", batch size {data['batch_size']}: "
            f"bytes in {unit}, times in ms"
        ),
        caption=(
            "keep, matmuls, attn, nothing: bytes saved for backward beyond the stage's "
            "input and output, kept and under selective:save-matmuls, save-attention, "
            "save-nothing; * the output stays referenced outside the chain; fwd, bwd, "
            "rebuild: medians over the rounds, pooled over identical stages (= k: the "
            "same as stage k); budget f: inductor's partitioner at "
            "activation_memory_budget f (compiled stages without random ops; - where "
            "not offered)"
        ),
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    table.add_column("stage", no_wrap=True)
    table.add_column("boundary", justify="right")
    partitioned = {Option(o): None for s in data["stages"] for o in s["saved_bytes"]
                   if Option(o).is_partitioned}
    columns = [*_OPTION_COLUMNS, *((o, f"budget {o.budget:g}") for o in partitioned)]
    for _, title in columns:
        table.add_column(title, justify="right")
    for title in ("fwd", "bwd", "rebuild"):
        table.add_column(title, justify="right")
    for s in data["stages"]:
        saved = s["saved_bytes"]
        same = s.get("same_as")
        table.add_row(
            s["name"] + (" *" if s["output_kept_outside"] else "")
            + ("" if same is None else f" (= {same})"),
            size(s["boundary_bytes"]),
            *(size(saved[o]) if o in saved else "-" for o, _ in columns),
            f"{s['fwd_s'] * 1e3:.2f}",
            f"{s['bwd_s'] * 1e3:.2f}",
            f"{s['rebuild_s'] * 1e3:.2f}",
        )
    return table


def _summary(console: Console, data: dict[str, Any]) -> None:
    f = data["fixed_bytes"]
    console.print(
        f"outside the chain: parameters {format_bytes(f['params'])}, buffers "
        f"{format_bytes(f['buffers'])}, gradients {format_bytes(f['grads'])}, optimizer "
        f"state ({data['optimizer']}) {format_bytes(f['optimizer_state'])}, batch "
        f"{format_bytes(f['inputs'])}, pre-chain {format_bytes(f['pre_chain'])}, "
        f"post-chain {format_bytes(f['post_chain'])}"
    )
    console.print(
        f"one checkpoint region: {data['region_overhead_s'] * 1e6:.0f} us, "
        f"{format_bytes(data['region_overhead_bytes'])}"
        + (f", and {data['region_link_s'] * 1e6:.0f} us per link inside it"
           if data.get("region_link_s") is not None else "")
        + "; step without checkpointing "
        f"{data['step_s'] * 1e3:.2f} ms; profiling took {data['profile_s']:.1f} s"
    )
    measured, predicted = data["measured_peak_bytes"], data["predicted_peak_bytes"]
    error = f" ({predicted / measured - 1:+.1%})" if measured else ""
    console.print(
        f"peak of a step without checkpointing: measured {format_bytes(measured)}, "
        f"predicted {format_bytes(predicted)}{error}"
    )
    kept = [s["name"] for s in data["stages"] if s["output_kept_outside"]]
    if kept:
        console.print(
            f"note: the outputs of {', '.join(kept)} stay referenced outside the chain, so "
            "checkpointing those stages frees less than planned"
        )


def run(args: argparse.Namespace) -> int:
    if args.shapes is not None:
        return profile_range(args)
    device = fake_device(args)
    model, batch, loss_fn, stages, description = load_for_profile(args)
    result = profile_with_progress(
        model,
        batch,
        loss_fn,
        stages,
        optimizer=args.optimizer,
        repeats=args.repeats,
        description=description,
        malloc=args.malloc,
        fresh=None if args.fake else lambda: load(args, check_step=False)[:3],
        fake=args.fake,
        device=device,
        padded_batches=padded_batches(args),
    )
    data = result.to_dict()
    console = console_for(args.json)
    console.print(_table(data))
    _summary(console, data)
    for line in coverage_lines(result, given=stages is not None):
        console.print(line)
    from remat.runtime.stages import last_chain  # torch: only once a model is loaded

    chain = None if stages is not None else last_chain(model)
    for line in chain.rejected if chain is not None else ():
        console.print(line, markup=False, highlight=False)
    if result.fake and result.times_estimated:
        console.print(f"fake profile: bytes as the real step's; the times are the roofline's "
                      f"estimates for {result.device} from the step's counted FLOPs, bytes "
                      "and ops (docs/fake.md)")
    elif result.fake:
        console.print("fake profile: bytes as the real step's; the times are the fake run's "
                      "dispatch, not this machine's kernels (docs/fake.md)")
    for line in kernel_lines(result):
        console.print(line)
    note = device_note(device)
    if note is not None:
        console.print(note)
    for line in noise_lines(result, one_thread=runs_one_thread()):
        console.print(line)
    write_json(data, args.json)
    return 0
