"""Where deferred checks run (part of :class:`~trainguard.sdc.dmr.engine.DMREngine`): in a communication window, on a
worker thread while the main thread waits (CPU) or on a side stream ahead of the wait (CUDA), and whatever is left
in the end-of-iteration drain. Relies on torch (streams, dispatch modes) and threads.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from trainguard.sdc.dmr import ops as dops
from trainguard.sdc.dmr.agc import Tape
from trainguard.sdc.dmr.engine.common import Deferred, _checking, _entered, _Later, _record_on, _Stale
from trainguard.sdc.dmr.engine.modes import _DMRMode
from trainguard.sdc.dmr.plan import CARRY
from trainguard.sdc.dmr.profile import Window


def _idle_priority() -> None:
    """Run this thread (a window's checker worker) only on a core nothing else wants: Linux's SCHED_IDLE class. The
    checkers fill idle time; on a host whose cores the ranks share, the same class keeps them from taking a core
    from another rank's critical path, as a low-priority side stream does on a device. Elsewhere a no-op."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # (pid 0: this thread)
    except (AttributeError, OSError):
        pass


class WindowChecks:
    """The engine's windows and drain (a part of DMREngine: it reads and writes the engine's state)."""

    def window(self, kind: str, wait: Callable[[], Any]) -> Any:
        """Run queued checkers while ``wait()`` waits on communication; returns what ``wait`` returns.

        The n-th wait of a kind in an attempt is window ``kind:n`` (the ids of the profile and the plan).
        Checkers planned for this window all run; unplanned ones run one by one while the window lasts, dynamic
        ones as the dynamic planner decides. The thread executor (CPU) runs them on a worker thread while this
        thread waits (a waiting thread holds no core) and joins it when the communication completes. The stream
        executor (CUDA) launches them on a side stream before the wait (a device's communication runs on its own
        stream: the host does not wait, the compute stream does), so they overlap the transfer on the device; the
        compute stream then waits for them, as the join does."""
        if not self.active:
            return wait()
        if kind == "setup":  # (a handshake some steps run and others not: its ops are checked at once, ids apart)
            self._setup = True
            try:
                return wait()
            finally:
                self._setup = False
        wid = f"{kind}:{self._windows[kind]}"
        self._windows[kind] += 1
        if self._profiling:
            if self._sync is not None:
                self._sync()  # (on a device the wait returns at once: the window is the transfer still to finish)
            t0 = time.perf_counter()
            try:
                out = wait()
                if self._sync is not None:
                    self._sync()
                return out
            finally:
                self._window_records.append(Window(wid, kind, t0 - self._t0, time.perf_counter() - t0, self._last_op,
                                                   dynamic=kind == "ep"))
        todo = [d for d in self.queue if d.window == wid] + [d for d in self.queue if d.window is None]
        tapes = [t for t in self._tapes.values() if t.window == wid and t.complete and not t.replayed]
        if not todo and not tapes and not self.dynamic.queue and not self._later_fifo and not self._held \
                and not self._carried_due():
            return wait()
        ran: list[Deferred] = []
        try:
            if self._side is not None:
                return self._window_on_stream(wid, kind, todo, tapes, ran, wait)
            return self._window_on_thread(wid, kind, todo, tapes, ran, wait)
        finally:
            done = {id(d) for d in ran}
            self.queue = [d for d in self.queue if id(d) not in done]

    def _window_on_thread(self, wid: str, kind: str, todo: list[Deferred], tapes: list[Tape], ran: list[Deferred],
                          wait: Callable[[], Any]) -> Any:
        closed = threading.Event()
        failed: list[BaseException] = []
        outer = self._outer_modes()

        def work() -> None:
            if self.cfg.checker_priority == "idle":
                _idle_priority()
            try:
                with _entered(outer), _checking():
                    self._window_checks(wid, kind, todo, tapes, ran, lambda: not closed.is_set())
            except BaseException as err:  # handed to the main thread: a checker never fails silently
                failed.append(err)

        worker = threading.Thread(target=work, daemon=True)
        w = self._plan_window(wid)
        t0 = time.perf_counter()
        self._window_end = t0 + w.duration_s if w is not None else float("inf")  # (unplanned: while open)
        self._later_room = self._room_after.get(wid, 0.0)
        worker.start()
        try:
            return wait()
        finally:
            t1 = time.perf_counter()
            closed.set()
            worker.join()
            # (window, time the communication took, time the step then waited for the worker to stop)
            self.window_log.append((wid, t1 - t0, time.perf_counter() - t1))
            if failed:
                raise failed[0]

    def _window_on_stream(self, wid: str, kind: str, todo: list[Deferred], tapes: list[Tape], ran: list[Deferred],
                          wait: Callable[[], Any]) -> Any:
        # The host cannot see when the transfer completes, so the window's length is the profiled one: unplanned
        # checkers are launched while the estimated times of all launched so far (planned ones first, which all
        # are) fit in it.
        w = self._plan_window(wid)
        length = w.duration_s if w is not None else 0.0
        self._window_spent = 0.0
        side, cur = self._side, self._devmod.current_stream()
        side.wait_stream(cur)  # the checkers read what the compute stream produced before the window
        t0 = time.perf_counter()
        failed: BaseException | None = None
        self._on_side = side if self._sync is not None else None  # (CUDA: inputs released meanwhile are recorded)
        try:
            with _checking(), self._devmod.stream(side):
                self._window_checks(wid, kind, todo, tapes, ran, lambda: self._window_spent < length)
        except BaseException as err:  # raised after the wait: the transfer is always waited for
            failed = err
        finally:
            self._on_side = None
        t1 = time.perf_counter()
        try:
            return wait()
        finally:
            cur.wait_stream(side)  # what follows on the compute stream (it may write a checked input) comes after
            # (window, time the wait took on the host, time the checkers took to launch)
            self.window_log.append((wid, time.perf_counter() - t1, t1 - t0))
            if failed is not None:
                raise failed

    def _outer_modes(self) -> list[TorchDispatchMode]:
        """The dispatch modes this thread entered before the engine's (a fault injector's, whose mode is outermost):
        the window's worker runs its checkers under them too, as the main thread runs its own checks (a new thread
        starts with no mode). Empty where the engine's mode is not entered (a window outside a step)."""
        stack = _get_current_dispatch_mode_stack()
        for i, m in enumerate(stack):
            if type(m) is _DMRMode and m.engine is self:
                return stack[:i]
        return []

    def _plan_window(self, wid: str):
        try:
            return self.plan.window(wid) if self.plan is not None else None
        except KeyError:
            return None

    def _window_checks(self, wid: str, kind: str, todo: list[Deferred], tapes: list[Tape], ran: list[Deferred],
                       more: Callable[[], bool]) -> None:
        """The checks of window ``wid``: the held update's, fingerprints still to be taken, the planned AGC replays
        and deferred checks, unplanned ones and the previous iteration's carried ones while ``more()``. On a stream
        every deferred check planned here is launched even once ``more()`` turns false (ahead of a window the host
        cannot see end); on the thread executor those left when the window closes go to later windows (below)."""
        if not self._carried_due() and self._held_fits(more):
            self._check_held(self.step)  # the previous iteration's update, once its carried checks ran
        # fingerprints taken later next: they hold outputs alive (and P-DMR comparisons wait on them)
        self._settle(more if self._side is None else (lambda: True))  # (on a stream: launched, not waited for)
        for tape in tapes:  # planned for this window: they all run
            tape.replayed = True
            self._replay(tape, kind)
        for i, d in enumerate(todo):
            if not more() and (d.window != wid or self._side is None):
                # The window closed before its planned checks were done: it was shorter than profiled, or they ran
                # slower (a host slower for a while, a shorter transfer). The step does not wait for them: they join
                # the unplanned checks, which later windows run in the time their own leave, else the drain
                # (before the verdict, as always). Their inputs stay kept meanwhile, within the memory budget
                # they were admitted under.
                with self._lock:
                    for late in todo[i:]:
                        if late.window == wid:
                            late.window = None
                            self.counts["left-to-later-windows"] += 1
                break
            self._check(d, kind)
            ran.append(d)
        # the previous iteration's carried checks, in the time left (the rest in later windows or the drain)
        if self._check_carried(more=more):
            return  # one failed: both iterations are re-executed; the held update keeps its copy
        if not self._carried_due() and self._held_due():
            if self._held_fits(more):
                self._check_held(self.step)
            else:
                self.counts["held-left-to-later-windows"] += 1
        self.dynamic.at_dynamic_window(more, wid)

    def _check(self, d: Deferred, where: str) -> None:
        if self._on_side is not None and d.held is not None:
            _record_on(self._on_side, d.held["ins"])  # released by the check while the side stream still reads them
        try:
            got = d.run(before_update=self._before_update) if d.carried else d.run()
            got = self._fp(got) if isinstance(d.expect, (dops.Fingerprint, _Later)) else got
        except _Stale:
            self.counts["stale"] += 1  # an input changed in place: not checkable, counted against coverage
            self.totals["stale"] += 1
            got = None
        except Exception as err:  # a checker that cannot run is a detection, not a crash of the step
            self._mismatch(d.op_id, d.name, d.phase, d.strategy, f"checker failed: {err}")
            got = None
        self._window_spent += d.est_s

        def differs() -> None:
            self._mismatch(d.op_id, d.name, d.phase, d.strategy, f"deferred check ({where}) differs")
            if d.carried:
                self._rewind = True

        if got is None:
            pass
        elif isinstance(d.expect, (dops.Fingerprint, _Later)):
            self._compare(d.name, d.expect, got, differs)
        elif not dops.bitwise_equal(d.expect, got):
            differs()
        with self._lock:
            if d.carried:
                self.carried_bytes -= d.nbytes
            elif d.strategy != "dynamic":
                self.queued_bytes -= d.nbytes
            self.counts[f"checked-in-{where.split(':')[0]}"] += 1

    def drain(self) -> None:
        """Run every checker still queued, on this thread (the end of the iteration: nothing is left unchecked)."""
        todo, self.queue = self.queue, []
        carry = [d for d in todo if d.window == CARRY]
        todo = [d for d in todo if d.window != CARRY] if carry else todo
        self.queued_bytes = 0
        t0 = time.perf_counter()
        try:
            with _checking():
                if self._check_carried():  # (the previous iteration's, if no window ran them)
                    return  # both iterations are re-executed: nothing else of this one needs checking
                if self._carry_sync():
                    self._carry_sync_step = self.step
                # checked in the next iteration: the checks no window followed, and the fingerprints still to be taken
                # with the P-DMR comparisons waiting for them (whether or not the plan left backward ops naive)
                if carry or (self._later_fifo and self._carrying()):
                    self._carry(carry)
                self._check_held(self.step)  # (not this iteration's own update: the next one checks it)
                self._settle()
                for d in todo:
                    self._check(d, "drain")
                for tape in self._tapes.values():
                    if not tape.replayed:
                        tape.replayed = True
                        self._replay(tape, "drain")
                self.dynamic.drain()
        finally:
            self.drain_s += time.perf_counter() - t0
