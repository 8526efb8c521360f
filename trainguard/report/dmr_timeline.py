"""The DMR plan timeline figure: one training iteration on one rank, what runs where.

Lanes, top to bottom, on the iteration's time axis:

* compute: the primary ops, coloured by phase (forward, recompute, input-gradient, weight-gradient,
  optimizer);
* checkers: upper band, checkers that run at that point: naive (inline, right after the op) and P-DMR
  (the recompute ops are the checkers, and the last op of each P-DMR segment runs once more, dark green);
  lower band, ops whose checker runs later (AGC, deferred, dynamic; and the naive backward ops the plan marked
  for carrying past the update, pink: checked at once where the engine does not hold the update), at their
  primary execution;
* communication: the idle windows by kind (pp, tp, ep, dp; dynamic windows hatched), each filled by the
  AGC segments and deferred checkers placed in it;
* memory: the profiled memory curve, the curve with the plan's deferral, and the budget.

Thousands of ops stay readable: bars of one colour narrower than about three pixels are merged with their
neighbours (closer than a pixel) and drawn as one. Relies on matplotlib (Agg backend: files only).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

if TYPE_CHECKING:
    from trainguard.sdc.dmr.plan import Plan
    from trainguard.sdc.dmr.profile import Profile

PHASE_COLORS = {"forward": "#4c72b0", "recompute": "#8fb4e3", "B": "#dd8452", "W": "#a65628", "optimizer": "#8c8c8c",
                "comm": "#cccccc"}
STRATEGY_COLORS = {"naive": "#d62728", "p-dmr": "#2ca02c", "agc": "#9467bd", "d-inter": "#17becf", "d-intra": "#1f77b4",
                   "dynamic": "#ff7f0e", "none": "#eeeeee", "fingerprints": "#8c8c8c", "carried": "#e377c2"}
WINDOW_COLORS = {"pp": "#fde0dd", "tp": "#e5f5e0", "ep": "#fff7bc", "dp": "#efedf5"}


def _merge(bars: list[tuple[float, float]], gap: float, tiny: float | None = None) -> list[tuple[float, float]]:
    """(start, width) bars sorted by start; a bar narrower than ``tiny`` (default 3 x ``gap``, about three
    pixels) is merged with a neighbour closer than ``gap``, so thousands of tiny ops draw as a few bars
    while ops wide enough to see keep their own."""
    tiny = 3 * gap if tiny is None else tiny
    out: list[list[float]] = []
    for s, w in sorted(bars):
        if out and s <= out[-1][0] + out[-1][1] + gap and (w < tiny or out[-1][1] < tiny):
            out[-1][1] = max(out[-1][1], s + w - out[-1][0])
        else:
            out.append([s, w])
    return [(s, w) for s, w in out]


def _lane(ax, groups: dict[str, list[tuple[float, float]]], colors: dict[str, str], y: float, h: float, gap: float,
          min_w: float) -> None:
    for key, bars in groups.items():
        merged = [(s, max(w, min_w)) for s, w in _merge(bars, gap)]
        if merged:
            wide = min(w for _, w in merged) >= 8 * gap  # outline bars only where it does not wash them out
            ax.broken_barh(merged, (y, h), facecolors=colors.get(key, "#999999"), edgecolor="white",
                           linewidth=0.4 if wide else 0.0)


def draw_timeline(profile: Profile, plan: Plan, path: str | Path, *, title: str | None = None,
                  width_px: int = 1800) -> Path:
    """Draw ``plan`` over ``profile``'s iteration into ``path`` (PNG, SVG, PDF by suffix); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ends = [o.start_s + o.time_s for o in profile.ops] + [w.start_s + w.duration_s for w in profile.windows]
    timed = max(ends, default=0.0) > 0
    if timed:
        t0 = {o.id: o.start_s for o in profile.ops}
        dt = {o.id: o.time_s for o in profile.ops}
        span = max(ends)
    else:  # a profile without times: one unit per op
        t0 = {o.id: float(i) for i, o in enumerate(profile.ops)}
        dt = {o.id: 1.0 for o in profile.ops}
        span = float(len(profile.ops))
    gap = span / width_px  # about one pixel
    fig, (ax, axm) = plt.subplots(2, 1, figsize=(width_px / 120, 6.0), dpi=120, sharex=True,
                                  gridspec_kw={"height_ratios": [2.2, 1.0]})

    compute: dict[str, list[tuple[float, float]]] = {}
    here: dict[str, list[tuple[float, float]]] = {}  # checkers that run at this point of the timeline
    later: dict[str, list[tuple[float, float]]] = {}  # ops whose checker runs later, in a window
    for o in profile.ops:
        key = "comm" if o.kind == "C" else o.kind if o.kind in ("B", "W") else o.phase
        compute.setdefault(key, []).append((t0[o.id], dt[o.id]))
        p = plan.ops.get(o.id)
        if p is None or p.strategy in ("comm", "none"):
            continue
        if p.strategy == "naive" and p.window == "carry":  # (when the update is held: in the next iteration's windows)
            later.setdefault("carried", []).append((t0[o.id], dt[o.id]))
        elif p.strategy == "naive" or (p.strategy == "p-dmr" and o.phase == "recompute"):
            here.setdefault(p.strategy, []).append((t0[o.id], dt[o.id]))
        elif p.strategy != "p-dmr":
            later.setdefault(p.strategy, []).append((t0[o.id], dt[o.id]))
    # the extra run of each P-DMR segment's last op, at the end of its recompute (or of the op itself)
    runs = []
    for s in plan.pdmr_segments:
        if s.extra_run_s > 0:
            at = max((t0[k] + dt[k] for k in s.recompute_ops if k in t0), default=t0.get(s.last_op, 0.0) + dt.get(s.last_op, 0.0))
            runs.append((at, s.extra_run_s if timed else 1.0))
    _lane(ax, compute, PHASE_COLORS, 2.1, 0.8, gap, gap / 2)
    _lane(ax, here, STRATEGY_COLORS, 1.5, 0.45, gap, gap / 2)
    _lane(ax, later, STRATEGY_COLORS, 1.1, 0.3, gap, gap / 2)
    if runs:
        ax.broken_barh(_merge(runs, gap), (1.5, 0.45), facecolors="#145a14", edgecolor="none")

    # windows and what fills them
    wins = {w.id: w for w in plan.windows}
    for kind, color in WINDOW_COLORS.items():
        for dyn in (False, True):
            bars = [(w.start_s if timed else t0.get(w.after_op, 0.0) + 0.5, w.duration_s if timed else 0.5)
                    for w in wins.values() if w.kind == kind and w.dynamic == dyn]
            if bars:
                merged = _merge(bars, gap / 4)
                ax.broken_barh(merged, (0.1, 0.8), facecolors=color, edgecolor="#999999",
                               linewidth=0.2 if len(merged) < 300 else 0.0, hatch="///" if dyn else None)
    fills: dict[str, list[tuple[float, float]]] = {"fingerprints": [], "agc": [], "d-inter": [], "d-intra": []}
    for w in wins.values():
        if not w.used_s or not timed:
            continue
        start, end = w.start_s, w.start_s + w.duration_s
        # in the engine's order: the earlier outputs' fingerprints, the AGC replays, the deferred checks
        for key, used in (("fingerprints", w.settle_s), ("agc", w.agc_s),
                          ("d-inter" if w.kind in ("pp", "dp") else "d-intra", w.ops_s)):
            if used and end > start:
                fills[key].append((start, min(used, end - start)))
            start += used
    _lane(ax, fills, STRATEGY_COLORS, 0.3, 0.4, gap / 4, 0.0)

    ax.set_ylim(0, 3)
    ax.set_yticks([0.5, 1.25, 1.72, 2.5], ["windows", "checked later", "checker runs", "compute"])
    ax.set_xlim(0, span)
    ax.grid(True, axis="x", alpha=0.2)
    s = plan.summary
    ax.set_title(title or (f"DMR plan ({plan.baseline}, phases {','.join(map(str, plan.phases)) or '-'}): "
                           f"coverage {s.get('coverage', 0):.0%}, checker time on the critical path "
                           f"{s.get('checker_critical_s', 0):.4g}s (naive-only {s.get('naive_only_critical_s', 0):.4g}s), "
                           f"hidden {s.get('checker_hidden_s', 0):.4g}s"), fontsize=9, loc="left")
    legend = [Patch(color=PHASE_COLORS[k], label=label) for k, label in
              (("forward", "forward"), ("recompute", "recompute"), ("B", "input grad"), ("W", "weight grad"),
               ("optimizer", "optimizer"), ("comm", "comm op"))]
    legend += [Patch(color=STRATEGY_COLORS[k], label=k) for k in ("naive", "p-dmr", "agc", "d-inter", "d-intra", "dynamic")
               if any(p.strategy == k for p in plan.ops.values())]
    if later.get("carried"):
        legend.append(Patch(color=STRATEGY_COLORS["carried"], label="naive, or carried past a held update"))
    if any(w.settle_s for w in wins.values()):
        legend.append(Patch(color=STRATEGY_COLORS["fingerprints"], label="fingerprints taken in the window"))
    if runs:
        legend.append(Patch(color="#145a14", label="P-DMR extra run"))
    legend += [Patch(facecolor=c, edgecolor="#999999", label=f"{k} window") for k, c in WINDOW_COLORS.items()
               if any(w.kind == k for w in wins.values())]
    ax.legend(handles=legend, fontsize=7, ncol=min(8, len(legend)), loc="upper center", bbox_to_anchor=(0.5, -0.04),
              frameon=False)

    # memory
    top = max([plan.memory_budget_bytes] + [b for _, b in profile.memory_curve] + [b for _, b in plan.memory_curve])
    unit, scale = next(((u, 2.0**e) for u, e in (("GiB", 30), ("MiB", 20), ("KiB", 10)) if top >= 2.0**e), ("bytes", 1.0))
    for curve, color, label in ((profile.memory_curve, "#888888", "profiled"), (plan.memory_curve, "#1f77b4", "with deferral")):
        if timed and curve:
            xs, ys = zip(*sorted(curve))
            axm.step(list(xs) + [span], [y / scale for y in ys] + [ys[-1] / scale], where="post", color=color, lw=1.0,
                     label=label)
    if plan.memory_budget_bytes:
        axm.axhline(plan.memory_budget_bytes / scale, color="#d62728", ls="--", lw=1.0, label="budget")
    axm.set_ylabel(f"memory [{unit}]")
    axm.set_xlabel("time in the iteration [s]" if timed else "op index")
    axm.grid(True, alpha=0.2)
    if axm.get_legend_handles_labels()[0]:
        axm.legend(fontsize=7, loc="upper right")
    fig.subplots_adjust(left=0.09, right=0.99, top=0.94, bottom=0.08, hspace=0.42)
    fig.savefig(path)
    plt.close(fig)
    return path
