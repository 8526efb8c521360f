"""Fail-stop injection: kill a worker process for real (``SIGKILL``), at a chosen step and point of the step, at
a random time, or from outside.

* :class:`FailStop` -- a Trainer callback: ``trainer.callbacks.append(FailStop([KillPoint(5, "compute")]))``
  kills the process when step 5 reaches that point. Points: ``start`` (``on_step_start``, before the step's
  quorum), ``plan``, ``forward_backward``, ``update`` (the Trainer's ``on_stage`` stages) and ``compute`` (the
  elastic strategy's stage: local gradients ready, before the all-reduce). ``on_kill(point)`` runs first
  (to report the death) -- nothing can run after a ``SIGKILL``.
* :func:`kill_after` -- a timer thread that kills this process after a delay (a random one with
  :func:`random_delay`): a death at no particular point of the step.
* :class:`ExternalKiller` -- a thread in a launcher that kills target processes from outside at random
  moments (what a node failure looks like to the survivors), recording every kill.
* :func:`death_cause` -- how a child process that sent no word of its end died, from its exit code (a signal
  from outside, or a crash), for a launcher's death reports.

A killed process gets no chance to clean up: its sockets close, its heartbeats stop, its temporary files
stay. That is the point. Relies on the standard library (``os.kill``, ``signal``, ``threading``, ``random``).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from trainguard.errors import TrainguardError

POINTS = ("start", "plan", "compute", "forward_backward", "update")


@dataclass(frozen=True)
class KillPoint:
    """Kill at step ``step`` when it reaches ``point`` (one of :data:`POINTS`)."""

    step: int
    point: str = "compute"

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise TrainguardError(f"fail-stop point must be one of {', '.join(POINTS)}, got {self.point!r}")
        if self.step < 0:
            raise TrainguardError(f"fail-stop step must be >= 0, got {self.step}")


def kill_pid(pid: int, sig: int = signal.SIGKILL) -> bool:
    """Send ``sig`` (default ``SIGKILL``) to ``pid``; False if the process is already gone."""
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def death_cause(exitcode: int | None) -> tuple[str, str]:
    """How a child process ended that sent no word of it, from its exit code: ``("signal", "SIGKILL from
    outside")`` for a signal, ``("crash", "exit code N")`` otherwise."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return "signal", f"{name} from outside"
    return "crash", f"exit code {exitcode}"


def kill_self() -> None:
    """``SIGKILL`` this process (does not return)."""
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # the signal is delivered asynchronously; never run on


class FailStop:
    """A Trainer callback that ``SIGKILL``\\ s this process at the given points (each fires once)."""

    def __init__(self, points: list[KillPoint] | tuple[KillPoint, ...], on_kill: Callable[[KillPoint], None] | None = None,
                 kill: Callable[[], None] = kill_self):
        self.pending = {(p.step, p.point): p for p in points}
        self.on_kill = on_kill
        self._kill = kill

    def _fire(self, step: int, point: str) -> None:
        p = self.pending.pop((step, point), None)
        if p is None:
            return
        if self.on_kill is not None:
            self.on_kill(p)
        self._kill()

    def on_step_start(self, trainer, step: int) -> None:
        self._fire(step, "start")

    def on_stage(self, trainer, stage: str, step: int) -> None:
        self._fire(step, stage)


def random_delay(low_s: float, high_s: float, seed: int | None = None) -> float:
    """A delay drawn uniformly from [low_s, high_s] (seeded when ``seed`` is given)."""
    if not 0 <= low_s <= high_s:
        raise TrainguardError(f"random delay needs 0 <= low <= high, got {low_s}, {high_s}")
    return random.Random(seed).uniform(low_s, high_s)


def kill_after(delay_s: float, on_kill: Callable[[], None] | None = None, pid: int | None = None) -> threading.Timer:
    """Start a daemon timer that ``SIGKILL``\\ s ``pid`` (default: this process) after ``delay_s``; cancel it
    with ``.cancel()``. ``on_kill`` runs just before."""
    target = os.getpid() if pid is None else pid

    def fire() -> None:
        if on_kill is not None:
            on_kill()
        kill_pid(target)

    timer = threading.Timer(delay_s, fire)
    timer.daemon = True
    timer.start()
    return timer


@dataclass
class KillRecord:
    target: object  # what the caller named the process (a group id, ...)
    pid: int
    at_s: float  # seconds since the killer started


@dataclass
class ExternalKiller:
    """Kill ``count`` processes from outside at random moments.

    ``targets()`` returns ``{name: pid}`` of the processes that may be killed now (the killer picks one at
    random). Before each kill it waits until ``ready()`` (when given: e.g. "the run recovered from the last
    kill"), then a uniform random time in ``[min_gap_s, max_gap_s]``. Every kill is in :attr:`kills` and
    passed to ``on_kill``. ``start()`` runs it in a daemon thread; ``stop()`` ends it early."""

    targets: Callable[[], dict[object, int]]
    count: int
    min_gap_s: float = 0.2
    max_gap_s: float = 1.5
    seed: int = 0
    ready: Callable[[], bool] | None = None
    on_kill: Callable[[KillRecord], None] | None = None
    kills: list[KillRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.count < 0:
            raise TrainguardError(f"external killer: count must be >= 0, got {self.count}")
        random_delay(self.min_gap_s, self.max_gap_s)  # validates the gap
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> ExternalKiller:
        self._thread = threading.Thread(target=self._run, name="external-killer", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def done(self) -> bool:
        return len(self.kills) >= self.count

    def _run(self) -> None:
        rng = random.Random(self.seed)
        t0 = time.monotonic()
        while len(self.kills) < self.count:
            while self.ready is not None and not self.ready():
                if self._stop.wait(0.02):
                    return
            if self._stop.wait(rng.uniform(self.min_gap_s, self.max_gap_s)):
                return
            gone = {k.pid for k in self.kills}  # a killed process may linger as a zombie until it is reaped
            live = sorted(((n, p) for n, p in self.targets().items() if p not in gone), key=lambda kv: str(kv[0]))
            if not live:
                continue
            name, pid = live[rng.randrange(len(live))]
            with self._lock:
                if not kill_pid(pid):
                    continue
                record = KillRecord(name, pid, time.monotonic() - t0)
                self.kills.append(record)
            if self.on_kill is not None:
                self.on_kill(record)

    def killed(self, pid: int) -> bool:
        """Whether this killer killed ``pid``."""
        with self._lock:
            return any(k.pid == pid for k in self.kills)


__all__ = ["POINTS", "ExternalKiller", "FailStop", "KillPoint", "KillRecord", "kill_after", "kill_pid", "kill_self",
           "random_delay"]
