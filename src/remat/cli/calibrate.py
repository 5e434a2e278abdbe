"""``remat calibrate``: measure this machine and write its entry of the device table."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from remat.cli.common import add_model_options, check_threads, load
from remat.cli.output import add_json_option, console_for, write_json
from remat.core.errors import UsageError


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="measure this machine's FLOP/s, bandwidth and op cost into the device table",
        description=(
            "Time a matmul, an elementwise add, a tiny op and a convolution, profile one "
            "model and time each of its ops as it runs (each op's rate, and what a call "
            "costs beyond its kernel); write the entry (default name cpu) into the device "
            "table ($REMAT_DEVICES or ~/.config/remat/devices.json) for fake profiles' "
            "times (docs/fake.md)."
        ),
    )
    add_model_options(p)
    p.add_argument("--name", default="cpu", help=(
        "the entry's name (default cpu, which replaces the built-in placeholder); another "
        "built-in device's name needs --replace-builtin"))
    p.add_argument("--replace-builtin", action="store_true", help=(
        "let --name be a built-in accelerator's (h100-sxm, h200, a100-80gb, mi300x): this "
        "machine's figures then stand for that device in every plan for it"))
    p.add_argument("--repeats", type=int, default=3,
                   help="timed rounds of the profile (3, at most 1000)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads while measuring (default: torch's)")
    p.add_argument("--out", default=None, metavar="PATH",
                   help="the device table to write (default $REMAT_DEVICES or "
                        "~/.config/remat/devices.json)")
    add_json_option(p)
    p.set_defaults(run=run)


#: The built-in entry calibrate writes over by default: a placeholder for this machine.
PLACEHOLDER = "cpu"


def check_name(name: str, *, replace_builtin: bool = False) -> None:
    """A usage error for a ``--name`` that is no entry's name, or that would shadow a
    built-in accelerator's entry without ``--replace-builtin``."""
    from remat.core.devices import BUILT_IN

    if not name or name != name.strip() or any(c.isspace() for c in name):
        raise UsageError(f"--name {name!r} is not a device name; give one word, e.g. --name "
                         "my-cpu")
    if name in BUILT_IN and name != PLACEHOLDER and not replace_builtin:
        raise UsageError(
            f"--name {name} is a built-in device ({BUILT_IN[name].notes}), and this machine's "
            f"figures would replace it in every plan for {name}; give another name, e.g. "
            "--name my-cpu, or add --replace-builtin to mean it"
        )


def run(args: argparse.Namespace) -> int:
    import torch

    from remat.core.devices import save_device
    from remat.core.units import format_bytes
    from remat.measure.malloc import set_malloc
    from remat.profiling.device_calibration import STEADY, calibrate_device

    if args.repeats < 1:
        raise UsageError(f"--repeats {args.repeats} is below 1; give 1 or more")
    check_name(args.name, replace_builtin=args.replace_builtin)  # before measuring
    check_threads(args.threads)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, batch, loss_fn, _stages, description = load(args)
    # the allocator remat profile and remat bench time under (--malloc, default keep): an
    # entry taken under glibc's adaptive thresholds prices page faults that come and go
    # with the process's history (mlp-hetero's wide blocks: 8.0 ms faulting 15 MiB in a
    # fresh process, 2.3 ms without)
    allocator = set_malloc(args.malloc)
    device, report = calibrate_device(model, batch, loss_fn, name=args.name,
                                      repeats=args.repeats, description=description,
                                      allocator=allocator)
    path = save_device(device, None if args.out is None else Path(args.out))
    console = console_for(args.json)
    console.print(
        f"{device.name}: matmul {device.peak_flops['float32'] / 1e9:.1f} GFLOP/s, add "
        f"{device.bandwidth_bytes_per_s / 1e9:.1f} GB/s, a call beyond its kernel "
        f"{device.call_seconds('forward') * 1e6:.1f} us in forward and "
        f"{device.call_seconds('backward') * 1e6:.1f} us in backward, a rebuild "
        f"{device.pack_seconds() * 1e6:.1f} us per saved tensor beyond its forward; "
        f"{report['ops']} ops' "
        f"rates from {description}, whose {report['rows']} stage times it prices within "
        f"{report['median_abs_error']:.0%} (median), "
        f"{report['max_abs_error']:.0%} (largest) in "
        f"{report['attempts']} {'try' if report['attempts'] == 1 else 'tries'}; "
        f"memory {format_bytes(device.memory_bytes)}")
    if report["median_abs_error"] > STEADY:
        console.print(
            f"warning: the machine's speed moved while measuring (its own stages priced "
            f"{report['median_abs_error']:.0%} off after {report['attempts']} tries); "
            f"run remat calibrate again when it is quieter")
    console.print(f"wrote {device.name} to {path}")
    write_json({"device": device.name, **device.to_dict(), "fit": report}, args.json)
    return 0
