"""Output conventions shared by every command.

* Human output uses ``rich`` (tables, progress bars) on stderr-safe consoles.
* With ``--json`` a command prints exactly one JSON object as the last line of stdout.
"""

from __future__ import annotations

import json
import math
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


def add_json_flag(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line of stdout")


def _clean(value: Any) -> Any:
    """Make a value JSON-safe: NaN/inf become strings (JSON has no such numbers), tuples become lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return _clean(value.item())
    return value


def emit_json(result: dict) -> None:
    print(json.dumps(_clean(result), sort_keys=False))


def table(title: str, rows: dict[str, Any] | list[tuple], columns: tuple[str, ...] = ("key", "value")) -> Table:
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c)
    items = rows.items() if isinstance(rows, dict) else rows
    for row in items:
        t.add_row(*(_fmt(v) for v in row))
    return t


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def progress(**kwargs):
    """A rich progress bar on stderr (so ``--json`` stdout stays clean)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

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
    """One task on a :func:`progress` bar, or nothing when ``enabled`` is false (library use, tests), so that
    long loops need no ``if bar is not None`` around every update. Call :meth:`stop` in a ``finally``."""

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
    import os

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
