"""The ``remat`` command line: one module per subcommand, each with ``add_parser`` and ``run``."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from remat.core.errors import UNEXPECTED_EXIT_CODE, RematError

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
    "calibrate": "remat.cli.calibrate",
}

EXIT_CODES = (
    "exit codes: 0 success; 1 a check failed (gradients differ, over budget, no plan fits); "
    "2 a usage error; 3 your own code failed (the model factory, forward, loss_fn or "
    "backward); 4 an unexpected error inside remat (a bug: please report it with the "
    "traceback --debug prints); 130 interrupted. Errors are one line on stderr; --debug "
    "(or REMAT_DEBUG=1) adds the full traceback."
)
DEBUG_HELP = "on an error, print the full traceback as well (or set REMAT_DEBUG=1)"
# A value that starts with a minus sign and a digit (-5%, -1e9, -2GiB): argparse takes it
# for an option and answers "expected one argument"; no remat option looks like that.
_NEGATIVE = re.compile(r"^-\.?[0-9]")


class _Parser(argparse.ArgumentParser):
    """argparse's parser with its usage errors on one line, as all of remat's are."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    from remat.core import __version__

    parser = _Parser(
        prog="remat",
        description="Budget-optimal, automatic and verified activation checkpointing for PyTorch.",
        epilog=EXIT_CODES,
    )
    parser.add_argument("--version", action="version", version=f"remat {__version__}")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_parser(sub, name)
        command = sub.choices[name]
        command.epilog = EXIT_CODES
        # SUPPRESS: an absent flag here keeps what the main parser read (remat --debug plan)
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help=DEBUG_HELP)
    return parser


def join_negative_values(argv: Sequence[str]) -> list[str]:
    """``--budget -5%`` as ``--budget=-5%``, so the value reaches remat's own check."""
    out: list[str] = []
    for word in argv:
        previous = out[-1] if out else ""
        if (_NEGATIVE.match(word) and previous.startswith("--") and "=" not in previous
                and previous != "--"):
            out[-1] = f"{previous}={word}"
        else:
            out.append(word)
    return out


def _debug(args: argparse.Namespace | None) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get("REMAT_DEBUG", "") not in (
        "", "0")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    words = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parser.parse_args(join_negative_values(words))
    except SystemExit as exit_:  # --help, --version, or argparse's own usage error (2)
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        return int(args.run(args))
    except RematError as err:
        if _debug(args):
            traceback.print_exception(err)
        print(f"remat {args.command}: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("remat: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # a bug: one line, the traceback behind --debug
        if _debug(args):
            traceback.print_exception(err)
        said = str(err).strip().splitlines()
        what = f"{type(err).__name__}: {said[0][:300]}" if said else type(err).__name__
        print(f"remat {args.command}: unexpected error: {what}; this is a bug in remat: "
              "rerun with --debug and report the traceback", file=sys.stderr)
        return UNEXPECTED_EXIT_CODE
