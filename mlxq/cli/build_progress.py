"""A progress bar while `mlxq model tiny` draws weights (a minute for llama3-1b): on a terminal only.

Piped or redirected output stays plain lines: the command prints when the build starts and ends,
and nothing in between (no carriage returns or escape codes in a log file).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from mlxq.models.tiny import Progress


@contextmanager
def build_progress(name: str) -> Iterator[Progress | None]:
    """A ``progress(done, total)`` callback drawing a bar on stderr when it is a terminal; else None."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                   console=Console(stderr=True), transient=True)
    with bar:
        task = bar.add_task(f"drawing {name}'s weights", total=None)

        def update(done: int, total: int) -> None:
            saving = done == total  # the last tensor is drawn; the file write follows (seconds at 1B)
            bar.update(task, completed=done, total=total,
                       description=f"writing {name}'s model.safetensors" if saving else None)

        yield update
