"""The ``remat`` command line: one module per subcommand, each with ``add_parser`` and ``run``."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

from remat.core.errors import (
    INTERRUPTS,
    UNEXPECTED_EXIT_CODE,
    RematError,
    UsageError,
    UserCodeError,
)

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
        _USAGE.append(f"{message}; see {self.prog} --help")
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


# the last usage error argparse reported, for the --json error document
_USAGE: list[str] = []
#: Upper bounds of the counts of work (README's Commands): a larger one is a usage error
#: before any work. ``(option, attribute) -> most``.
COUNT_BOUNDS: dict[tuple[str, str], int] = {
    ("--repeats", "repeats"): 1000,
    ("--profile-repeats", "profile_repeats"): 1000,
    ("--warmup", "warmup"): 1000,
    ("--steps", "steps"): 10_000,
    ("--verify-steps", "verify_steps"): 10_000,
}


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


def _check_counts(args: argparse.Namespace) -> None:
    for (option, name), most in COUNT_BOUNDS.items():
        value = getattr(args, name, None)
        if isinstance(value, int) and value > most:
            raise UsageError(f"{option} {value} is above {most}, the most remat runs; give "
                             f"{most} or fewer")


def _json_after_usage_error(words: Sequence[str]) -> str | None:
    """The ``--json`` path of a command line argparse refused, where one is plain to see."""
    path = None
    for i, word in enumerate(words):
        if word.startswith("--json="):
            path = word.removeprefix("--json=")
        elif word == "--json" and i + 1 < len(words):
            following = words[i + 1]
            path = following if following == "-" or not following.startswith("-") else path
    return path or None


@contextmanager
def _watching_interrupts() -> Iterator[None]:
    """A SIGINT handler that records the Ctrl-C before raising KeyboardInterrupt, so that a
    KeyboardInterrupt the user's own code raises is told apart (exit 3, not 130)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupted(signum: int, frame: Any) -> None:
        INTERRUPTS.seen = True
        raise KeyboardInterrupt

    previous = signal.getsignal(signal.SIGINT)
    if previous in (signal.SIG_IGN, None):  # no Ctrl-C reaches this process
        handler = previous
    else:
        handler = interrupted
        signal.signal(signal.SIGINT, interrupted)
    INTERRUPTS.watching, INTERRUPTS.seen = True, False
    try:
        yield
    finally:
        INTERRUPTS.watching = False
        if handler is interrupted:
            signal.signal(signal.SIGINT, previous)


def main(argv: Sequence[str] | None = None) -> int:
    from remat.cli.output import json_on_stdout, reset_error_written

    parser = build_parser()
    words = join_negative_values(sys.argv[1:] if argv is None else list(argv))
    _USAGE.clear()
    reset_error_written()
    try:
        args = parser.parse_args(words)
    except SystemExit as exit_:  # --help, --version, or argparse's own usage error (2)
        code = exit_.code if isinstance(exit_.code, int) else 2
        path = _json_after_usage_error(words) if code == 2 and _USAGE else None
        command = next((w for w in words if w in COMMANDS), None)
        if path is not None and command is not None:
            _usage_error_json(command, path, _USAGE[-1])
        return code
    with (_watching_interrupts(), json_on_stdout(getattr(args, "json", None) == "-"),
          _warnings_on_one_line(debug=_debug(args))):
        return _run(args)


@contextmanager
def _warnings_on_one_line(debug: bool) -> Iterator[None]:
    """Print each Python warning as one ``warning: <message>`` line on stderr: the user
    ran a command, and the source path and the line of code under it (often torch's
    ``return fn(*args, **kwargs)``) tell them nothing. ``--debug`` keeps Python's form.
    Only the text is changed (``warnings.formatwarning``): filters, and callers that
    record warnings (``catch_warnings(record=True)``), see them as before."""
    if debug:
        yield
        return
    before = warnings.formatwarning

    def one_line(message: Warning | str, *_: Any, **__: Any) -> str:
        return "warning: " + " ".join(str(message).split()) + "\n"

    warnings.formatwarning = one_line
    try:
        yield
    finally:
        warnings.formatwarning = before


def _usage_error_json(command: str, path: str, message: str) -> None:
    from remat.cli.output import OutputRefused, check_paths, write_error

    args = argparse.Namespace(command=command, json=path)
    try:
        check_paths(args)
    except OutputRefused:
        return
    write_error(args, {"stage": "checking the options", "message": message, "exit_code": 2})


def _run(args: argparse.Namespace) -> int:
    """``args.run(args)``: what stops it becomes one line on stderr, an exit code and, with
    ``--json``, the error document."""
    from remat.cli.output import OutputRefused, check_paths, error_written, write_error

    stage: str | None = "checking the options"
    json_ok = True
    try:
        try:
            check_paths(args)
        except OutputRefused as err:
            json_ok = not err.json_at_fault
            raise
        _check_counts(args)
        stage = None
        return int(args.run(args))
    except BaseException as err:
        code, line, error = _verdict(args, err, stage)
        print(line, file=sys.stderr)
        if json_ok and not error_written():
            write_error(args, error)
        return code


def _verdict(args: argparse.Namespace, err: BaseException, stage: str | None
             ) -> tuple[int, str, dict[str, Any]]:
    """The exit code, the line on stderr and the error object for ``err``."""
    name = f"remat {args.command}"
    if isinstance(err, RematError):
        if _debug(args):
            traceback.print_exception(err)
        to_dict = getattr(err, "to_dict", None)  # a step of the main job that stopped
        error = to_dict() if callable(to_dict) else {
            "stage": stage, "message": str(err), "exit_code": err.exit_code}
        least = getattr(err, "minimum_budget_bytes", None)
        if least is not None:
            error["minimum_budget_bytes"] = least
        return err.exit_code, f"{name}: error: {err}", error
    if isinstance(err, KeyboardInterrupt) and not INTERRUPTS.raised_by_code():
        return 130, "remat: interrupted", {"stage": stage, "message": "interrupted",
                                           "exit_code": 130}
    if isinstance(err, (SystemExit, KeyboardInterrupt)):  # the user's code, not a way out
        if _debug(args):
            traceback.print_exception(err)
        from remat.benchmarking.stopping import exit_words

        message = (f"your own code (the model factory, forward or loss_fn) raised "
                   f"{exit_words(err)}; remove that call, or guard it with "
                   "if __name__ == '__main__' (--debug shows where)")
        return (UserCodeError.exit_code, f"{name}: error: {message}",
                {"stage": stage, "message": message, "exit_code": UserCodeError.exit_code})
    if _debug(args):  # a bug: one line, the traceback behind --debug
        traceback.print_exception(err)
    said = str(err).strip().splitlines()
    what = f"{type(err).__name__}: {said[0][:300]}" if said else type(err).__name__
    return (UNEXPECTED_EXIT_CODE,
            f"{name}: unexpected error: {what}; this is a bug in remat: rerun with --debug "
            "and report the traceback",
            {"stage": stage, "message": what, "exit_code": UNEXPECTED_EXIT_CODE})
