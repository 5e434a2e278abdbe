"""Shared output helpers: rich tables to the terminal, JSON to a file or stdout."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from remat.core.errors import UsageError


def console_for(json_path: str | None) -> Console:
    """Where human-readable output goes: stderr when the JSON itself goes to stdout.

    Piped or captured output gets a wide page, so tables reach logs whole instead of
    being cut to rich's 80-column default for non-terminals.
    """
    console = Console(stderr=json_path == "-", highlight=False, soft_wrap=True)
    if not console.is_terminal:
        console = Console(stderr=json_path == "-", highlight=False, soft_wrap=True, width=160)
    return console


def write_json(data: Any, path: str | None) -> None:
    """Write ``data`` as JSON to ``path``; ``-`` means stdout, ``None`` means nowhere."""
    if path is None:
        return
    text = json.dumps(data, indent=2, sort_keys=False) + "\n"
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    target = Path(path)
    try:
        if target.parent != Path(""):
            target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    except OSError as err:
        raise UsageError(
            f"cannot write JSON to {path!r} ({err.strerror}); give a writable path"
        ) from err


def add_json_option(parser: Any) -> None:
    parser.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help="also write the result as JSON to PATH ('-': stdout, and the table goes to stderr)",
    )
