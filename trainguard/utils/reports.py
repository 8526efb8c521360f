"""A launcher and its worker processes, talking in ways that survive a worker's ``SIGKILL`` at any moment:
reports up (:class:`Reports`), a start gate down (:class:`StartGate`).

Why not ``multiprocessing.Queue``: its writers share one pipe and one lock, and each writer's background
feeder thread holds that lock while it writes a message. A worker killed while its feeder holds the lock
(halfway through a report) leaves the lock held for good: no other worker's report reaches the launcher
again, and every other worker hangs at exit waiting for its feeder. The fault-tolerant runtimes kill workers
at random moments on purpose, so this happened.

Here every worker process has a pipe of its own (:meth:`Reports.sender`), written from the calling thread
(:meth:`ReportSender.put` returns once the whole message is in the pipe). A worker killed halfway through a
report leaves a truncated message on its own pipe, which the launcher reads as the end of that pipe; the
other pipes are untouched.

Why not ``multiprocessing.Barrier`` or ``Event`` to hold workers until all are up: both wake their waiters
through a ``Condition`` that waits for each sleeper to acknowledge its wake-up, so once a waiting worker is
SIGKILLed, ``abort()`` / ``set()`` block for good (the launcher hangs in the call that should have let the
others go on). :class:`StartGate` is a pipe per worker that the launcher writes to (or closes) to open it.

Relies on the standard library (``multiprocessing.connection``).

Use::

    reports = Reports(ctx)
    sender = reports.sender()
    p = ctx.Process(target=work, args=(sender,)); p.start()
    reports.started(sender)         # the launcher's copy of the write end is closed: a dead worker's pipe ends
    kind, who, info = reports.get(timeout=0.5)   # queue.Empty when nothing came

    gate = StartGate(ctx)
    waiter = gate.waiter()          # to the worker, which calls waiter.wait(timeout) where it must hold
    gate.started(waiter)            # after the worker's start, as for a sender
    gate.open()                     # once every worker reported it is there, or is gone
"""

from __future__ import annotations

import collections
import pickle
import queue
import time
from multiprocessing.connection import Connection, wait
from typing import Any


class _WorkerEnd:
    """A worker's end of one pipe (picklable into a child process's arguments)."""

    def __init__(self, conn: Connection):
        self._conn = conn

    def close(self) -> None:
        self._conn.close()


def _started(end: _WorkerEnd) -> None:
    """Close the launcher's copy of a started worker's end, so that the worker's death ends the pipe (a truncated
    message then reads as the end, instead of blocking the launcher)."""
    end.close()


class ReportSender(_WorkerEnd):
    """A worker's end of its report pipe."""

    def put(self, message: Any) -> None:
        """Send ``message`` now; once this returns the message outlives the sending process."""
        self._conn.send(message)


class Reports:
    """The launcher's side: one pipe per worker process, read as one stream of messages."""

    def __init__(self, ctx):
        self._ctx = ctx
        self._readers: list[Connection] = []
        self._ready: collections.deque = collections.deque()
        self.ended = 0  # pipes that reached their end (a worker exited, or died mid-report)

    def sender(self) -> ReportSender:
        """A new pipe for one worker process; pass the sender to it, then call :meth:`started`."""
        reader, writer = self._ctx.Pipe(duplex=False)
        self._readers.append(reader)
        return ReportSender(writer)

    started = staticmethod(_started)

    def get(self, timeout: float) -> Any:
        """The next message from any worker; ``queue.Empty`` when none came within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self._ready:
            left = deadline - time.monotonic()
            if left <= 0:
                raise queue.Empty
            if not self._readers:
                time.sleep(left)
                continue
            for conn in wait(self._readers, timeout=left):
                try:
                    self._ready.append(conn.recv())
                except (EOFError, OSError, pickle.UnpicklingError):  # the worker is gone (maybe mid-message)
                    self._readers.remove(conn)
                    conn.close()
                    self.ended += 1
        return self._ready.popleft()

    def close(self) -> None:
        for conn in self._readers:
            conn.close()
        self._readers.clear()


class GateWaiter(_WorkerEnd):
    """A worker's end of a start gate."""

    def wait(self, timeout: float) -> bool:
        """Hold until the gate opens (or the launcher is gone); False if ``timeout`` seconds passed first."""
        return self._conn.poll(timeout)


class StartGate:
    """The launcher's side of a gate that holds worker processes until :meth:`open` (module docstring)."""

    def __init__(self, ctx):
        self._ctx = ctx
        self._writers: list[Connection] = []
        self.opened = False

    def waiter(self) -> GateWaiter:
        """A gate end for one more worker process; pass it to the worker, then call :meth:`started`."""
        reader, writer = self._ctx.Pipe(duplex=False)
        self._writers.append(writer)
        if self.opened:  # a worker that comes after the opening does not wait
            self._release(writer)
        return GateWaiter(reader)

    started = staticmethod(_started)

    def open(self) -> None:
        """Let every waiting worker go on (and any that reaches the gate later). Idempotent."""
        if not self.opened:
            self.opened = True
            for writer in self._writers:
                self._release(writer)

    @staticmethod
    def _release(writer: Connection) -> None:
        try:  # a dead worker's end is gone: nothing to tell it
            writer.send_bytes(b"open")
        except OSError:
            pass
        writer.close()


__all__ = ["GateWaiter", "ReportSender", "Reports", "StartGate"]
