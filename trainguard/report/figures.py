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


def _ok(v) -> bool:
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v)


def line_plot(path: str | Path, x: Sequence[float], series: dict[str, Sequence[float]], *, xlabel: str,
              ylabel: str, title: str = "", markers: bool = True, hline: float | None = None,
              logy: bool = False, bands: dict[str, Sequence[tuple[float, float]]] | None = None) -> Path:
    """One figure with one line per series (non-finite points are skipped); ``bands[name]`` gives a
    ``(lo, hi)`` interval per point, drawn as error bars. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.0, 4.0), dpi=120)
    styles = ["o-", "s--", "^-.", "d:", "v-", "x--"]
    for i, (name, ys) in enumerate(series.items()):
        band = (bands or {}).get(name)
        pts = [(a, b, band[j] if band else None) for j, (a, b) in enumerate(zip(x, ys)) if _ok(b)]
        if not pts:
            continue
        xs, vs, bs = zip(*pts)
        line = ax.plot(xs, vs, styles[i % len(styles)] if markers else "-", label=name)[0]
        if band:
            ex = [(a, v, lo, hi) for a, v, (lo, hi) in zip(xs, vs, [b if b else (None, None) for b in bs])
                  if _ok(lo) and _ok(hi)]
            if ex:
                xa, va, lo, hi = zip(*ex)
                ax.errorbar(xa, va, yerr=[[v - a for v, a in zip(va, lo)], [b - v for v, b in zip(va, hi)]],
                            fmt="none", ecolor=line.get_color(), capsize=2, lw=0.8)
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
