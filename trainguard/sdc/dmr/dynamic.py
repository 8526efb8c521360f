"""The dynamic DMR planner (SpareTrain section 5.3, "For MoE models"): Phase 3 at run time for ops whose
path is data dependent (MoE experts), and the best-fit subset choice the static planner shares.

The engine calls it; it knows nothing about torch. During the primary execution of an op the static plan
marks ``dynamic``, the engine ``enqueue``s an :class:`Entry` (op id, bytes the deferred check keeps alive,
estimated checker time, a callable that runs the checker and compares). Then:

* ``at_static_window(duration_s)`` (a window of known length, e.g. a TP collective): launches the subset
  of the queue whose estimated times best fill the window (:func:`best_fit`), all at once;
* ``at_dynamic_window(is_open)`` (a window of unknown length, e.g. an expert all-to-all): runs entries one
  by one, oldest first, while ``is_open()`` is true and the queue is not empty;
* memory monitoring: before an entry joins the queue (and whenever the engine calls
  :meth:`DynamicPlanner.check_memory`), if the retained bytes (or the device memory reported by
  ``memory_fn``) would pass ``near`` x the budget, queued checkers are run at once, shortest first (the
  static planner's demotion rule), and if that is not enough the new entry's checker runs immediately:
  naive DMR, on the critical path;
* ``drain()`` at the end of the iteration (before the optimizer step may consume what was checked): runs
  everything left.

Every entry runs exactly once; :attr:`DynamicPlanner.where` records where (``static``, ``dynamic``,
``naive`` or ``drain``) and :attr:`DynamicPlanner.counters` how many and how long. An exception raised by
a checker (a mismatch) propagates; the entry counts as run. Relies on the standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainguard.errors import ConfigError


def best_fit(times: Sequence[float], capacity: float, resolution: int = 2048) -> list[int]:
    """Indices of the subset of ``times`` whose sum fills ``capacity`` best without exceeding it.

    0/1 knapsack on time (subset sum), solved exactly on a grid: the capacity is split into
    ``resolution`` steps, each time rounded to the nearest step, all reachable sums computed with a bitset
    (dynamic programming), and the candidate subsets tried from the fullest down until one whose exact sum
    fits (so rounding never overfills a window). Zero-time items are always taken. Ties between subsets of
    equal (rounded) sum go to the earlier items.
    """
    if resolution < 1:
        raise ConfigError(f"knapsack resolution must be >= 1, got {resolution}")
    tol = 1e-12 * max(1.0, abs(capacity))
    idx = [i for i, t in enumerate(times) if t <= capacity + tol]
    if capacity <= 0 or not idx:
        return [i for i in idx if times[i] <= 0]
    if sum(times[i] for i in idx) <= capacity + tol:
        return idx
    q = capacity / resolution
    units = [max(0, round(times[i] / q)) for i in idx]
    mask = (1 << (resolution + 1)) - 1
    reach = [1]
    for u in units:
        reach.append((reach[-1] | (reach[-1] << u)) & mask)
    final = reach[-1]
    for target in range(resolution, -1, -1):
        if not (final >> target) & 1:
            continue
        chosen, rest = [], target
        for n in range(len(units) - 1, -1, -1):  # item n is in the subset iff rest is unreachable without it
            if (reach[n] >> rest) & 1:
                continue
            chosen.append(idx[n])
            rest -= units[n]
        if sum(times[i] for i in chosen) <= capacity + tol:
            return sorted(chosen)
    return []


@dataclass
class Entry:
    """One deferred checker: ``run()`` re-executes the op and compares (raising on a mismatch)."""

    op_id: str
    retained_bytes: int
    est_time_s: float
    run: Callable[[], Any]


@dataclass
class DynamicCounters:
    enqueued: int = 0
    static: int = 0  # launched at a static window
    dynamic: int = 0  # run one by one inside a dynamic window
    naive: int = 0  # forced by memory: run on the critical path
    drained: int = 0  # run by drain() at the end of the iteration
    static_s: float = 0.0
    dynamic_s: float = 0.0
    naive_s: float = 0.0
    drained_s: float = 0.0
    peak_retained_bytes: int = 0
    windows: dict[str, int] = field(default_factory=dict)  # window id -> entries run there

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__, windows=dict(self.windows))


_COUNTER = {"static": ("static", "static_s"), "dynamic": ("dynamic", "dynamic_s"), "naive": ("naive", "naive_s"),
            "drain": ("drained", "drained_s")}


class DynamicPlanner:
    """Runtime D-DMR queue for dynamic ops. ``budget_bytes``: bytes the queue may keep alive (or, with
    ``memory_fn``, the device memory budget that ``memory_fn()`` -- bytes in use now -- is held under);
    ``near`` in (0, 1]: the fraction of the budget at which checkers are forced."""

    def __init__(self, budget_bytes: int, *, near: float = 0.9, memory_fn: Callable[[], int] | None = None,
                 resolution: int = 2048) -> None:
        if budget_bytes < 0 or not math.isfinite(budget_bytes):
            raise ConfigError(f"dynamic planner budget must be >= 0 bytes, got {budget_bytes}")
        if not 0 < near <= 1:
            raise ConfigError(f"dynamic planner 'near' must be in (0, 1], got {near}")
        self.budget_bytes = int(budget_bytes)
        self.near = near
        self.memory_fn = memory_fn
        self.resolution = resolution
        self.queue: list[Entry] = []
        self.counters = DynamicCounters()
        self.where: dict[str, tuple[str, str | None]] = {}  # op id -> (how, window id)
        self._seen: set[str] = set()
        self._windows = 0

    # -- state ---------------------------------------------------------------------------------------
    @property
    def retained_bytes(self) -> int:
        return sum(e.retained_bytes for e in self.queue)

    @property
    def limit_bytes(self) -> float:
        return self.near * self.budget_bytes

    def _over(self, incoming: int) -> bool:
        """Would memory pass the limit? Without ``memory_fn``: the queue's bytes plus ``incoming``; with it:
        the device memory in use now (which already holds the incoming op's tensors)."""
        if self.memory_fn is not None:
            return float(self.memory_fn()) > self.limit_bytes
        return self.retained_bytes + incoming > self.limit_bytes

    # -- primary execution ---------------------------------------------------------------------------
    def enqueue(self, entry: Entry) -> None:
        """Keep ``entry`` for a later window; force checkers first if it would bring memory near the budget."""
        if entry.op_id in self._seen:
            raise ValueError(f"op {entry.op_id} was already enqueued in this iteration")
        if entry.retained_bytes < 0 or entry.est_time_s < 0:
            raise ValueError(f"op {entry.op_id}: negative bytes or time")
        self._seen.add(entry.op_id)
        self.counters.enqueued += 1
        self._make_room(entry.retained_bytes)
        if self._over(entry.retained_bytes):
            self._run(entry, "naive", None)  # does not fit even with an empty queue: naive DMR now
            return
        self.queue.append(entry)
        self.counters.peak_retained_bytes = max(self.counters.peak_retained_bytes, self.retained_bytes)

    def check_memory(self) -> int:
        """Force queued checkers (shortest first) while memory is above ``near`` x budget; returns how many ran."""
        return self._make_room(0)

    def _make_room(self, incoming: int) -> int:
        ran = 0
        while self.queue and self._over(incoming):
            e = min(self.queue, key=lambda x: x.est_time_s)  # first of the shortest (stable)
            self.queue.remove(e)
            self._run(e, "naive", None)
            ran += 1
        return ran

    # -- windows -------------------------------------------------------------------------------------
    def at_static_window(self, duration_s: float, window_id: str | None = None) -> list[Entry]:
        """Launch the best-fit subset of the queue for a window of known length; returns what ran."""
        wid = window_id or self._next_window("static")
        picked = best_fit([e.est_time_s for e in self.queue], duration_s, self.resolution)
        chosen = [self.queue[i] for i in picked]
        for e in chosen:
            self.queue.remove(e)
        for e in chosen:
            self._run(e, "static", wid)
        return chosen

    def at_dynamic_window(self, is_open: Callable[[], bool], window_id: str | None = None) -> list[Entry]:
        """Run queued checkers one by one, oldest first, while ``is_open()`` and the queue is not empty."""
        wid = window_id or self._next_window("dynamic")
        ran = []
        while self.queue and is_open():
            e = self.queue.pop(0)
            self._run(e, "dynamic", wid)
            ran.append(e)
        return ran

    def drain(self) -> list[Entry]:
        """End of the iteration: run everything still queued (in order); returns what ran."""
        ran = []
        while self.queue:
            e = self.queue.pop(0)
            self._run(e, "drain", None)
            ran.append(e)
        return ran

    def reset(self) -> None:
        """Start a new iteration (the queue must be empty: call :meth:`drain` first)."""
        if self.queue:
            raise RuntimeError(f"{len(self.queue)} checker(s) still queued: drain() before reset()")
        self._seen.clear()
        self.where.clear()
        self.counters = DynamicCounters()
        self._windows = 0

    # -- internals -----------------------------------------------------------------------------------
    def _next_window(self, kind: str) -> str:
        self._windows += 1
        return f"{kind}-{self._windows}"

    def _run(self, e: Entry, how: str, window: str | None) -> None:
        self.where[e.op_id] = (how, window)
        c = self.counters
        count, secs = _COUNTER[how]
        setattr(c, count, getattr(c, count) + 1)
        setattr(c, secs, getattr(c, secs) + e.est_time_s)
        if window is not None:
            c.windows[window] = c.windows.get(window, 0) + 1
        e.run()
