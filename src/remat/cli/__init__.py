"""The ``remat`` command line: one module per subcommand, each with ``add_parser`` and ``run``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from remat.errors import RematError

# Subcommand name -> module under remat.cli; imported lazily so `remat estimate` never
# pays for importing torch.
COMMANDS: dict[str, str] = {
    "estimate": "remat.cli.estimate",
    "demo": "remat.cli.demo",
    "profile": "remat.cli.profile",
    "plan": "remat.cli.plan",
    "verify": "remat.cli.verify",
    "bench": "remat.cli.bench",
    "auto": "remat.cli.auto",
}


def build_parser() -> argparse.ArgumentParser:
    from remat import __version__

    parser = argparse.ArgumentParser(
        prog="remat",
        description="Budget-optimal, automatic and verified activation checkpointing for PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"remat {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_parser(sub, name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version, or argparse's own usage error (2)
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        return int(args.run(args))
    except RematError as err:
        print(f"remat {args.command}: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("remat: interrupted", file=sys.stderr)
        return 130
