"""Argument types shared by the commands (argparse)."""

from __future__ import annotations

import argparse
import math


def finite_float(text: str) -> float:
    """A float flag's value: NaN and the infinities are refused in one line (argparse exits 2). No flag means either,
    and one let through fails far from the input (a budget of ``inf`` bytes in a worker process) or never ends (a
    simulated horizon of ``inf`` hours)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return v


SEED_LIMIT = 2**64


def seed_int(text: str) -> int:
    """A seed flag's value: an integer in [0, 2**64). numpy's generators refuse a negative seed and torch's one of
    2**64 or more, each with a traceback from deep inside the run; here it is one line (argparse exits 2)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not 0 <= v < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**64), got {text!r}")
    return v


def comma_items(text: str, flag: str) -> list[str]:
    """A comma list flag's items (spaces around them dropped). An empty item (``a,,b``, a trailing comma) or an
    item named twice is refused rather than skipped: it is most often a typo for a name left out."""
    from trainguard.errors import ConfigError

    items = [t.strip() for t in text.split(",")] if text.strip() else []
    if not all(items):
        raise ConfigError(f"{flag}: {text!r} has an empty item")
    twice = sorted({t for t in items if items.count(t) > 1})
    if twice:
        raise ConfigError(f"{flag}: {text!r} names {', '.join(twice)} twice")
    return items


FIGURE_SUFFIXES = (".png", ".svg", ".pdf")


def check_figure(path: str, flag: str) -> None:
    """A figure flag's path must name a format matplotlib writes (refused before any work, not after it)."""
    from pathlib import Path

    from trainguard.errors import ConfigError

    if Path(path).suffix.lower() not in FIGURE_SUFFIXES:
        raise ConfigError(f"{flag} must end in .png, .svg or .pdf, got {path!r}")


def check_output_file(path: str, flag: str) -> None:
    """An output flag's path must not name a folder (refused before any work, not after it)."""
    from pathlib import Path

    from trainguard.errors import ConfigError

    if Path(path).is_dir():
        raise ConfigError(f"{flag} names a folder, not a file: {path}")
