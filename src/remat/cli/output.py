"""Shared output helpers: rich tables to the terminal, JSON to a file or stdout.

Every file the command line writes is written atomically (a temporary file beside it,
then a rename: :func:`remat.core.artifact.write_text`), so a reader sees the old file or
the whole new one. With ``--json -`` the JSON document is all that reaches stdout: for the
run, ``sys.stdout`` is stderr (what the user's own code prints goes there) and the
document is written to the stdout the command started with (:func:`json_on_stdout`).
Output paths are checked before any work (:func:`check_paths`): writable, and never one
of the command's own inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console

from remat.cli.progress import progress_bar as progress_bar  # re-exported: cli/bench
from remat.core.artifact import write_text
from remat.core.errors import UsageError
from remat.core.solve.budget import Budget

# the stdout the command started with, while --json - has sys.stdout pointing at stderr
_REAL_STDOUT: list[TextIO] = []
# whether this run already wrote its error document (remat auto writes its own)
_ERROR_WRITTEN: list[bool] = [False]

#: What ``--out DIR`` holds after each command that writes a folder: a file given as an
#: input there would be replaced.
OUT_FILES: dict[str, tuple[str, ...]] = {
    "auto": ("auto.json", "plan.json", "profile.json", "profile.again.json", "auto.md"),
    "bench": ("bench.json", "README.md"),
}


def console_for(json_path: str | None) -> Console:
    """Where human-readable output goes: stderr when the JSON itself goes to stdout.

    Piped or captured output gets a wide page, so tables reach logs whole instead of
    being cut to rich's 80-column default for non-terminals.
    """
    console = Console(stderr=json_path == "-", highlight=False, soft_wrap=True)
    if not console.is_terminal:
        console = Console(stderr=json_path == "-", highlight=False, soft_wrap=True, width=160)
    return console


@contextmanager
def json_on_stdout(active: bool) -> Iterator[None]:
    """While ``active`` (``--json -``): ``sys.stdout`` is ``sys.stderr``, so whatever the
    user's factory, forward or ``loss_fn`` prints stays out of the JSON document, which
    :func:`write_json` writes to the stdout there was on entry."""
    if not active:
        yield
        return
    real = sys.stdout
    _REAL_STDOUT.append(real)
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout = real
        _REAL_STDOUT.pop()


def write_json(data: Any, path: str | None) -> None:
    """Write ``data`` as JSON to ``path``; ``-`` means stdout, ``None`` means nowhere."""
    if path is None:
        return
    text = json.dumps(data, indent=2, sort_keys=False) + "\n"
    if path == "-":
        out = _REAL_STDOUT[-1] if _REAL_STDOUT else sys.stdout
        out.write(text)
        out.flush()
        return
    target = Path(path)
    try:
        if target.parent != Path(""):
            target.parent.mkdir(parents=True, exist_ok=True)
        write_text(target, text)
    except OSError as err:
        raise UsageError(
            f"cannot write JSON to {path!r} ({err.strerror}); give a writable path"
        ) from err


def add_json_option(parser: Any) -> None:
    parser.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help="also write the result as JSON to PATH ('-': stdout, and the table goes to "
        "stderr); a run that stops early writes {\"ok\": false, \"error\": {...}} there",
    )


# -- the document of a run that stopped early -----------------------------------------------


def error_document(args: argparse.Namespace, error: dict[str, Any]) -> dict[str, Any]:
    """What ``--json`` gets from a run that stopped early: ``ok`` false, the command, what
    was asked (the model and the budget, where the command takes them), and ``error``
    (``stage``, ``message``, ``exit_code``, and ``minimum_budget_bytes`` for a budget no
    plan fits)."""
    document: dict[str, Any] = {"ok": False, "command": getattr(args, "command", None)}
    if getattr(args, "model", None) is not None:
        from remat.cli.common import describe, model_options

        try:
            document["model"] = describe(args.model, model_options(args))
        except UsageError:
            document["model"] = args.model
    for key in ("budget", "budgets", "profile", "plan"):
        value = getattr(args, key, None)
        if value is not None:  # a Budget read from --budget as given
            document[key] = str(value) if isinstance(value, Budget) else value
    document["error"] = error
    return document


def write_error(args: argparse.Namespace, error: dict[str, Any],
                path: str | None = None) -> None:
    """Write :func:`error_document` to ``path`` (default ``--json``), once per run; a path
    that cannot be written is left alone (the error line on stderr says what happened)."""
    target = getattr(args, "json", None) if path is None else path
    if target is None or _ERROR_WRITTEN[0]:
        return
    _ERROR_WRITTEN[0] = True
    with suppress(UsageError, OSError):
        write_json(error_document(args, error), target)


def error_written() -> bool:
    """Whether this run wrote its error document already."""
    return _ERROR_WRITTEN[0]


def reset_error_written() -> None:
    _ERROR_WRITTEN[0] = False


# -- output paths, checked before any work -----------------------------------------------------


class OutputRefused(UsageError):
    """An output path that cannot be written, or that is one of the command's inputs.

    ``json_at_fault``: the ``--json`` path itself, which then gets no error document."""

    def __init__(self, message: str, *, json_at_fault: bool = False) -> None:
        super().__init__(message)
        self.json_at_fault = json_at_fault


def _same_file(a: str, b: str) -> bool:
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    except OSError:
        pass
    return Path(a).resolve() == Path(b).resolve()


def _nearest_existing(path: Path) -> Path:
    here = path.absolute()
    while not here.exists() and here != here.parent:
        here = here.parent
    return here


def _check_writable(option: str, path: str, *, folder: bool) -> None:
    """A usage error unless ``path`` can be written (a file, or with ``folder`` a directory
    to write files in)."""
    target = Path(path)
    json_at_fault = option == "--json"
    if folder and target.exists() and not target.is_dir():
        raise OutputRefused(f"{option} {path!r} is a file, not a directory; give a directory "
                            "path (it is created if missing)")
    if not folder and target.is_dir():
        raise OutputRefused(f"{option} {path!r} is a directory; give a file path in it, e.g. "
                            f"{str(target / 'out.json')!r}", json_at_fault=json_at_fault)
    base = _nearest_existing(target if folder else target.parent)
    if not base.is_dir():
        raise OutputRefused(f"{option} {path!r} lies under {str(base)!r}, which is a file, "
                            "not a directory; give a path in a directory",
                            json_at_fault=json_at_fault)
    try:  # what the atomic write does: a file in that directory
        handle, probe = tempfile.mkstemp(prefix=".remat-probe-", dir=base)
        os.close(handle)
        os.unlink(probe)
    except OSError as err:
        raise OutputRefused(f"{option} {path!r} cannot be written: {str(base)!r} refuses a new "
                            f"file ({err.strerror}); give a writable path",
                            json_at_fault=json_at_fault) from None
    if not folder and target.is_file() and not os.access(target, os.W_OK):
        raise OutputRefused(f"{option} {path!r} is read-only; give a writable path or make it "
                            "writable", json_at_fault=json_at_fault)


def _model_file(spec: Any) -> str | None:
    if isinstance(spec, str) and ".py:" in spec:
        return spec.rpartition(".py:")[0] + ".py"
    return None


def _inputs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The files the command reads: ``(what it is, path)``."""
    found: list[tuple[str, str]] = []
    model = _model_file(getattr(args, "model", None))
    if model is not None:
        found.append(("the --model file", model))
    for key in ("profile", "plan"):
        value = getattr(args, key, None)
        if isinstance(value, str) and (os.path.isfile(value) or value.endswith(".json")):
            found.append((f"the --{key} file", value))
    if getattr(args, "device", None) is not None or args.command == "calibrate":
        from remat.core.devices import device_file

        table = getattr(args, "out", None) if args.command == "calibrate" else None
        found.append(("the device table", table or str(device_file())))
    return found


def check_paths(args: argparse.Namespace) -> None:
    """Refuse, before any work, an output path that cannot be written or that is one of
    the command's inputs (``remat plan --profile p.json --json p.json`` would replace the
    profile with the plan), however it is spelled."""
    outputs: list[tuple[str, str, bool]] = []  # option, path, is a folder
    json_path = getattr(args, "json", None)
    if json_path is not None and json_path != "-":
        outputs.append(("--json", json_path, False))
    out = getattr(args, "out", None)
    if out is not None:
        outputs.append(("--out", out, args.command in OUT_FILES))
    inputs = _inputs(args)
    for option, path, folder in outputs:
        if not path.strip():
            raise OutputRefused(f"{option} is empty; give a path",
                                json_at_fault=option == "--json")
        _check_writable(option, path, folder=folder)
        written = ([os.path.join(path, name) for name in OUT_FILES[args.command]]
                   if folder else [path])
        for source, given in inputs:
            if option == "--out" and source == "the device table":
                continue  # remat calibrate --out: the table it reads and adds its entry to
            for target in written:
                if _same_file(target, given):
                    where = "" if target == path else f" (in {path!r})"
                    raise OutputRefused(
                        f"{option} {path!r} would overwrite {given!r}{where}, {source} this "
                        f"command reads; give {option} another path",
                        json_at_fault=option == "--json")
    files = [(o, p) for o, p, folder in outputs if not folder]
    for i, (option, path) in enumerate(files):
        for other, second in files[i + 1:]:
            if _same_file(path, second):
                raise OutputRefused(f"{option} and {other} both name {path!r}; give them "
                                    "different paths", json_at_fault=True)


def rank_path(path: str | None, rank: int | None) -> str | None:
    """``bench.json`` -> ``bench.rank1.json`` (``-`` and no path stay as they are)."""
    if path is None or path == "-" or rank is None:
        return path
    stem, dot, ext = path.rpartition(".")
    if not dot or "/" in ext:
        return f"{path}.rank{rank}"
    return f"{stem}.rank{rank}.{ext}"
