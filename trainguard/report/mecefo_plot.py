"""The figure of ``trainguard bench mecefo``: modelled cluster throughput per method and failure frequency, and
the validation perplexity of the real runs per method (without failures and under the chosen preset).

Relies on matplotlib (Agg: the figure goes to a file).
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

METHODS = ("mecefo", "bamboo", "oobleck", "checkpoint_restart")
LABELS = {"mecefo": "MeCeFO", "bamboo": "Bamboo", "oobleck": "Oobleck", "checkpoint_restart": "checkpoint-restart"}
PRESETS = ("none", "low", "mid", "high")


def _ok(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def plot_mecefo(result: dict, path: str | Path) -> Path:
    """Two panels from a ``bench mecefo`` result: throughput (tokens/s, modelled) per method for every preset, and
    validation perplexity per method without failures and under ``result["failures"]`` (real runs)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11.0, 4.2), dpi=120)
    by = result.get("by_preset", {})
    width = 0.8 / len(PRESETS)
    for j, preset in enumerate(PRESETS):
        r = by.get(preset, {})
        ys = [r.get(m, {}).get("tokens_per_s_no_failure" if preset == "none" else "tokens_per_s_failures")
              for m in METHODS]
        xs = [i + (j - (len(PRESETS) - 1) / 2) * width for i in range(len(METHODS))]
        ax1.bar([x for x, y in zip(xs, ys) if _ok(y)], [y for y in ys if _ok(y)], width,
                label="no failure" if preset == "none" else f"{preset} frequency")
    ax1.set_xticks(range(len(METHODS)), [LABELS[m] for m in METHODS], rotation=10)
    ax1.set_ylabel("tokens/s (modelled)")
    ax1.set_title(f"{result.get('workers', '?')} workers, {result.get('model', '')}: throughput (modelled from measured "
                  "step costs)", fontsize=8)
    ax1.legend(fontsize=7)
    ax1.grid(True, axis="y", alpha=0.3)
    base = [result.get(m, {}).get("val_ppl_no_failure") for m in METHODS]
    fail = [result.get(m, {}).get("val_ppl_failures") for m in METHODS]
    xs = range(len(METHODS))
    ax2.bar([x - 0.2 for x, y in zip(xs, base) if _ok(y)], [y for y in base if _ok(y)], 0.4, label="no failure")
    if result.get("failures", "none") != "none":
        ax2.bar([x + 0.2 for x, y in zip(xs, fail) if _ok(y)], [y for y in fail if _ok(y)], 0.4,
                label=f"{result.get('failures')} frequency")
    vals = [v for v in base + fail if _ok(v)]
    if vals:
        lo, hi = min(vals), max(vals)
        ax2.set_ylim(lo - 0.1 * (hi - lo + 1e-9) - 0.02 * lo, hi + 0.1 * (hi - lo + 1e-9) + 0.02 * hi)
    ax2.set_xticks(range(len(METHODS)), [LABELS[m] for m in METHODS], rotation=10)
    q = result.get("quality", {})
    ax2.set_ylabel("validation perplexity")
    ax2.set_title(f"real runs: {q.get('run_workers', '?')} workers, {q.get('token_budget', '?')} tokens", fontsize=8)
    ax2.legend(fontsize=7)
    ax2.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


__all__ = ["plot_mecefo"]
