"""Matplotlib helpers (Agg backend: figures go to files, never to a screen).

Relies on matplotlib.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def line_plot(path: str | Path, x: Sequence[float], series: dict[str, Sequence[float]], *, xlabel: str,
              ylabel: str, title: str = "", markers: bool = True, hline: float | None = None,
              logy: bool = False) -> Path:
    """One figure with one line per series (non-finite points are skipped); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.0, 4.0), dpi=120)
    styles = ["o-", "s--", "^-.", "d:", "v-", "x--"]
    for i, (name, ys) in enumerate(series.items()):
        pts = [(a, b) for a, b in zip(x, ys) if b is not None and math.isfinite(b)]
        if not pts:
            continue
        xs, vs = zip(*pts)
        ax.plot(xs, vs, styles[i % len(styles)] if markers else "-", label=name)
    if hline is not None:
        ax.axhline(hline, color="grey", lw=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    if logy:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
