"""Reports and the start gate: a worker SIGKILLed at any moment (halfway through a report, waiting at the
gate) silences or blocks only itself.

The faults injected: a worker killed while its message is half written (what hung the SPARe runtime on a
shared ``multiprocessing.Queue``), and a worker killed while it waits at the gate (after which a
``multiprocessing`` Barrier's ``abort`` or Event's ``set`` blocks for good). Workers are real processes
(spawn), killed with SIGKILL.
"""

import multiprocessing as mp
import os
import queue
import signal
import threading
import time

import pytest

from trainguard.utils.reports import Reports, StartGate

BIG = 8 << 20  # far beyond a pipe's buffer: the writer blocks halfway through the message


def _send_big(sender, sending) -> None:
    sending.set()
    sender.put(("big", b"x" * BIG))


def _send_two_and_exit(sender) -> None:
    sender.put(("b", 1))
    sender.put(("b", 2))


def _last_words_then_sigkill(sender, who: int) -> None:
    sender.put(("killed", who))
    os.kill(os.getpid(), signal.SIGKILL)  # no flush, no exit handlers


def _wait_at_gate(gate, sender, who: int) -> None:
    sender.put(("ready", who))
    sender.put(("through", who, gate.wait(60)))


def _drain(reports: Reports, want: int, timeout_s: float) -> list:
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        try:
            got.append(reports.get(timeout=0.2))
        except queue.Empty:
            pass
    return got


@pytest.fixture
def ctx():
    return mp.get_context("spawn")


def test_a_worker_killed_halfway_through_a_report_does_not_block_the_others(ctx):
    reports = Reports(ctx)
    sending = ctx.Event()
    sa, sb = reports.sender(), reports.sender()
    a = ctx.Process(target=_send_big, args=(sa, sending), daemon=True)
    a.start()
    reports.started(sa)
    assert sending.wait(60), "worker A did not start"
    time.sleep(0.5)  # A is now blocked in the middle of its message: nobody reads its pipe yet
    os.kill(a.pid, signal.SIGKILL)
    a.join(10)
    b = ctx.Process(target=_send_two_and_exit, args=(sb,), daemon=True)
    b.start()
    reports.started(sb)
    got = _drain(reports, 2, 60)
    b.join(30)
    assert got == [("b", 1), ("b", 2)], "the other worker's reports must arrive, A's half message must not"
    assert b.exitcode == 0, "the other worker must exit normally (not hang on a lock the dead one held)"
    assert a.exitcode == -signal.SIGKILL
    with pytest.raises(queue.Empty):
        reports.get(timeout=0.5)
    assert reports.ended == 2  # both pipes read to their end: A's truncated, B's after its last report
    reports.close()


def test_the_last_report_before_a_sigkill_always_arrives(ctx):
    reports = Reports(ctx)
    procs = []
    for who in range(4):
        s = reports.sender()
        p = ctx.Process(target=_last_words_then_sigkill, args=(s, who), daemon=True)
        p.start()
        reports.started(s)
        procs.append(p)
    got = _drain(reports, 4, 60)
    for p in procs:
        p.join(10)
        assert p.exitcode == -signal.SIGKILL
    assert sorted(got) == [("killed", w) for w in range(4)]
    reports.close()


def test_get_without_any_message_raises_empty_after_its_timeout(ctx):
    reports = Reports(ctx)
    t0 = time.monotonic()
    with pytest.raises(queue.Empty):
        reports.get(timeout=0.3)
    assert time.monotonic() - t0 >= 0.3
    sender = reports.sender()  # a pipe nobody writes to: still nothing
    with pytest.raises(queue.Empty):
        reports.get(timeout=0.2)
    sender.close()
    with pytest.raises(queue.Empty):  # its end is read, not mistaken for a message
        reports.get(timeout=0.2)
    assert reports.ended == 1


def test_a_worker_killed_while_waiting_at_the_gate_does_not_block_its_opening(ctx):
    reports, gate = Reports(ctx), StartGate(ctx)
    procs = []
    for who in range(2):
        s, w = reports.sender(), gate.waiter()
        p = ctx.Process(target=_wait_at_gate, args=(w, s, who), daemon=True)
        p.start()
        reports.started(s)
        gate.started(w)
        procs.append(p)
    assert sorted(_drain(reports, 2, 60)) == [("ready", 0), ("ready", 1)]
    time.sleep(0.5)  # both are inside wait()
    os.kill(procs[0].pid, signal.SIGKILL)
    procs[0].join(10)
    opener = threading.Thread(target=gate.open, daemon=True)
    opener.start()
    opener.join(10)
    assert not opener.is_alive(), "opening the gate blocked on the killed waiter"
    assert _drain(reports, 1, 30) == [("through", 1, True)]
    procs[1].join(10)
    assert procs[1].exitcode == 0
    reports.close()


def test_the_gate_holds_until_opened_and_a_late_waiter_goes_straight_through(ctx):
    gate = StartGate(ctx)
    w = gate.waiter()
    assert w.wait(0.2) is False  # closed: the wait times out
    gate.open()
    assert w.wait(0.0) is True
    gate.open()  # idempotent
    assert gate.waiter().wait(0.0) is True  # created after the opening
