"""Progress bars on stderr (so a command's ``--json`` stdout stays clean) and the CPU thread choice.

Library code that runs long loops takes a ``progress: bool`` and uses :class:`TaskBar`, which does
nothing when disabled, so loops need no ``if bar is not None``. Relies on rich and torch.
"""

from __future__ import annotations

import os

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

err_console = Console(stderr=True, highlight=False)


def progress(**kwargs) -> Progress:
    """A rich progress bar on stderr with a free-text ``info`` field per task."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
        console=err_console,
        transient=kwargs.pop("transient", False),
        **kwargs,
    )


class TaskBar:
    """One task on a :func:`progress` bar, or nothing when ``enabled`` is false (library use, tests).
    Call :meth:`stop` in a ``finally``."""

    def __init__(self, enabled: bool, description: str, total: int, **kwargs):
        self.bar = None
        if enabled:
            self.bar = progress(transient=True, **kwargs)
            self.task = self.bar.add_task(description, total=total, info="")
            self.bar.start()

    def advance(self, info: str = "") -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=1, info=info)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def pick_threads(n: int = 0) -> None:
    """Set torch's intra-op threads: ``n`` if > 0; else, on a small machine that is already busy, one
    thread (OpenMP threads competing with other processes for 2 cores made steps ~8x slower)."""
    import torch

    if n > 0:
        torch.set_num_threads(n)
        return
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    if cores <= 4 and load >= 0.75 * cores:
        torch.set_num_threads(1)
