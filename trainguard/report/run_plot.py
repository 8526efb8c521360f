"""One training run as a figure: loss, validation loss, throughput and fault events against the step.

Reads the run's output folder (``metrics.jsonl``, see docs/outputs.md): step records give the training
loss and throughput, ``eval`` events the validation loss, ``resume`` events a dashed line. Fault events are
drawn on a third panel, one row per kind:

* detections and corrections: increments of the cumulative counters named ``*_detected`` / ``*_corrected``
  that techniques add to step records (ABFT: ``abft_AS_detected``, ...);
* retries: ``retry`` events (a step guard asked for a re-execution), and ``suspected_hardware``;
* failovers: ``failure`` / ``failover`` / ``healed`` events and step records whose ``failed`` list is not
  empty (elastic runs);
* preemptions: ``preempted`` events (SIGTERM).

Relies on matplotlib (Agg) and the metrics reader of :mod:`trainguard.train.metrics`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from trainguard.errors import TrainguardError
from trainguard.train.metrics import read_numbered_records

ROWS = ("detections", "corrections", "retries", "failovers", "preemptions")
_EVENT_ROW = {"retry": "retries", "suspected_hardware": "retries", "failure": "failovers", "failover": "failovers",
              "healed": "failovers", "preempted": "preemptions"}


@dataclass
class RunCurves:
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    throughput: list[tuple[int, float]] = field(default_factory=list)
    val: list[tuple[int, float]] = field(default_factory=list)
    resumes: list[int] = field(default_factory=list)
    events: dict[str, list[tuple[int, int]]] = field(default_factory=lambda: {r: [] for r in ROWS})  # (step, count)
    # lines of metrics.jsonl left out (from 1): no JSON object (cut short by a crash, damaged), or no integer step
    skipped_lines: list[int] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return {row: sum(n for _, n in pts) for row, pts in self.events.items()}


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def read_run(run_dir: str | Path) -> RunCurves:
    """The curves and fault events of a run folder; TrainguardError (one line) when there is nothing to read."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        raise TrainguardError(f"not a run folder but a file: {run_dir} (give the run's --output.dir)")
    if not run_dir.is_dir():
        raise TrainguardError(f"run folder not found: {run_dir}")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise TrainguardError(f"{run_dir} has no metrics.jsonl (was it written with --output.metrics false?)")
    c = RunCurves()
    try:
        records = read_numbered_records(path, c.skipped_lines)
    except OSError as err:
        raise TrainguardError(f"cannot read {path}: {err.strerror or err}") from None
    last_counter: dict[str, float] = {}
    for number, r in records:
        step = r.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            c.skipped_lines.append(number)
            continue
        kind = r.get("event")
        if kind is None and "loss" in r:
            loss = _num(r.get("loss"))
            c.steps.append(step)
            c.loss.append(loss if loss is not None else float("nan"))
            tps = _num(r.get("tokens_per_s"))
            if tps is not None:
                c.throughput.append((step, tps))
            for k, v in r.items():
                v = _num(v)
                if v is None or not (k.endswith("_detected") or k.endswith("_corrected")):
                    continue
                delta = v - last_counter.get(k, 0.0)
                last_counter[k] = v
                if delta > 0:
                    c.events["detections" if k.endswith("_detected") else "corrections"].append((step, int(delta)))
            if isinstance(r.get("failed"), list) and r["failed"]:
                c.events["failovers"].append((step, len(r["failed"])))
        elif kind == "eval":
            v = _num(r.get("val_loss"))
            if v is not None:
                c.val.append((step, v))
        elif kind == "resume":
            c.resumes.append(step)
            last_counter.clear()  # counters restart with the process
        elif kind in _EVENT_ROW:
            c.events[_EVENT_ROW[kind]].append((step, 1))
    c.skipped_lines.sort()
    if not c.steps:
        raise TrainguardError(f"{path} holds no step records" + (
            f" ({describe_lines(c.skipped_lines)} {'is no record' if len(c.skipped_lines) == 1 else 'are no records'})"
            if c.skipped_lines else ""))
    return c


def describe_lines(numbers: list[int], most: int = 8) -> str:
    """``line 3``, ``lines 3, 7, 9``, ``lines 3, 7, ... (12 in all)``: for a one-line message."""
    shown = ", ".join(str(n) for n in numbers[:most])
    more = f", ... ({len(numbers)} in all)" if len(numbers) > most else ""
    return f"line{'s' if len(numbers) > 1 else ''} {shown}{more}"


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> tuple[Path, RunCurves]:
    """Draw the run into a PNG (default ``<run_dir>/run.png``); returns its path and the curves."""
    run_dir = Path(run_dir)
    c = read_run(run_dir)
    out = Path(out) if out is not None else run_dir / "run.png"
    fig, (ax_loss, ax_tps, ax_ev) = plt.subplots(3, 1, figsize=(8.0, 7.5), dpi=110, sharex=True,
                                                 gridspec_kw={"height_ratios": [3, 1.4, 1.6]})
    ax_loss.plot(c.steps, c.loss, "-", lw=1.2, label="train loss")
    if c.val:
        xs, ys = zip(*c.val)
        ax_loss.plot(xs, ys, "o--", ms=4, label="validation loss")
    for i, s in enumerate(c.resumes):
        for ax in (ax_loss, ax_tps, ax_ev):
            ax.axvline(s, color="grey", ls=":", lw=1, label="resumed" if (i == 0 and ax is ax_loss) else None)
    ax_loss.set_ylabel("loss")
    ax_loss.grid(True, alpha=0.3)
    ax_loss.legend(loc="upper right")
    ax_loss.set_title(f"{run_dir.name or run_dir}: {len(c.steps)} steps")
    if c.throughput:
        xs, ys = zip(*c.throughput)
        ax_tps.plot(xs, ys, "-", lw=1, color="tab:green")
    ax_tps.set_ylabel("tokens/s")
    ax_tps.grid(True, alpha=0.3)
    colors = {"detections": "tab:orange", "corrections": "tab:blue", "retries": "tab:red", "failovers": "tab:purple",
              "preemptions": "black"}
    for y, row in enumerate(ROWS):
        pts = c.events[row]
        if pts:
            xs, ns = zip(*pts)
            ax_ev.scatter(xs, [y] * len(xs), s=[20 + 10 * min(n, 10) for n in ns], color=colors[row], marker="|" if
                          row == "preemptions" else "o")
    ax_ev.set_yticks(range(len(ROWS)), [f"{r} ({n})" for r, n in c.counts().items()])
    ax_ev.set_ylim(-0.7, len(ROWS) - 0.3)
    ax_ev.set_xlabel("step (optimizer steps done)")
    ax_ev.grid(True, axis="x", alpha=0.3)
    if not any(c.events.values()):
        ax_ev.text(0.5, 0.5, "no fault events", transform=ax_ev.transAxes, ha="center", va="center", color="grey")
    fig.tight_layout()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out)
    except OSError as err:
        raise TrainguardError(f"cannot write {out}: {err.strerror or err}") from None
    finally:
        plt.close(fig)
    return out, c
