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
