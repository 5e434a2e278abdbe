"""``remat demo``: run the four worked examples and print one PASS/FAIL line for each."""

from __future__ import annotations

import argparse
from typing import Any

from rich.text import Text

from remat.cli.output import add_json_option, console_for, write_json


def add_parser(subparsers: Any, name: str) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        name,
        help="compute and check four worked examples of activation checkpointing",
        description=(
            "Compute four worked examples at run time and check each: the memory table of a "
            "segmented chain, hand-derived MLP gradients, a hand-written checkpoint schedule, "
            "and dropout under rebuilding. Exits 1 if any check fails."
        ),
    )
    add_json_option(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    # Imported here so building the parser for other subcommands never imports torch.
    from remat.demo import all_passed, run_all

    checks = run_all()
    console = console_for(args.json)
    for check in checks:
        line = Text()
        line.append(
            "PASS" if check.passed else "FAIL", style="bold green" if check.passed else "bold red"
        )
        line.append(f" {check.name}: {check.summary}")
        console.print(line)
    ok = all_passed(checks)
    passed = sum(c.passed for c in checks)
    console.print(Text(f"{passed}/{len(checks)} checks passed", style="green" if ok else "red"))
    write_json({"ok": ok, "checks": [c.to_dict() for c in checks]}, args.json)
    return 0 if ok else 1
