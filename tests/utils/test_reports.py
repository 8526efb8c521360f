"""Reports: a worker SIGKILLed at any moment, even halfway through a report, silences only itself.

The fault injected is the one that hung the SPARe runtime on a shared ``multiprocessing.Queue``: a worker
killed while its message is half written. Workers are real processes (spawn), killed with SIGKILL.
"""

import multiprocessing as mp
import os
import queue
import signal
import time

import pytest

from trainguard.utils.reports import Reports

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
