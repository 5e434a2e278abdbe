"""The progress bar every long command draws on stderr (only on a terminal).

Its own module so that the shared options (:mod:`remat.cli.common`) and the shared output
helpers (:mod:`remat.cli.output`, which re-exports it) both take it without importing each
other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["progress_bar"]


@contextmanager
def progress_bar(what: str) -> Iterator[Callable[[str, int, int], None]]:
    """A progress callback drawing a bar on stderr (shown only on a terminal)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    status = Console(stderr=True)
    bar = Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                   console=status, transient=True, disable=not status.is_terminal)
    with bar:
        task = bar.add_task(what, total=None)

        def update(text: str, done: int, total: int) -> None:
            bar.update(task, description=f"{what}: {text}", completed=done, total=total)

        yield update
