"""Output conventions shared by every command.

* Human output uses ``rich`` (tables, progress bars) on stderr-safe consoles.
* With ``--json`` a command prints exactly one JSON object as the last line of stdout.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from trainguard.utils.jsonout import emit_json, json_safe
from trainguard.utils.progress import TaskBar, err_console, pick_threads, progress

console = Console(highlight=False)
__all__ = ["TaskBar", "add_json_flag", "console", "emit_json", "err_console", "json_safe", "pick_threads",
           "progress", "table"]


def add_json_flag(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line of stdout")


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


