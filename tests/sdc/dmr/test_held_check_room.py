"""The held check of the previous update (a copy of the optimizer state and a second fused update: the longest single
check there is) starts, on the thread executor, only in a window whose profiled end leaves room for it, where a later
window of the plan has that room: started late, it would outlast the window and the step would wait for it.

Two windows a step here (four micro-batches, every second forward waits): the first profiled at 100 ms, the second
at 1.2 s; each held check is made to take 300 ms (two fused calls, 150 ms each). Nothing is carried past the update
here: a window runs the previous iteration's carried checks before it decides on the held check, and on a slow host
they outlasted the 100 ms window, which then never came to decide (the placement of the held check is what these
tests are about; carried checks have tests of their own)."""

import threading
import time

import pytest

from tests.sdc.dmr._windowed import clean_params, equal, params, trainer, windowed
from trainguard.faults import Fault, FaultModel, Injector, OpSite

ACCUM = ("--train.grad_accum", "4")
STEPS = 4


@pytest.fixture(scope="module")
def clean4(batches):
    return clean_params(batches, *ACCUM, steps=STEPS)


def _two_windows(batches, second_closed: bool = False, second_s: float = 1.2, first_s: float = 0.1):
    """A trainer whose held checks take 150 ms a call, and where each ran: (window count of the attempt, whether on
    the main thread). ``second_closed``: after profiling, the second window of a step is closed before any of its
    checks starts (a transfer already done), so what was left to it goes to the drain. ``second_s``: the second
    window's length, ``first_s`` the first's."""
    t = trainer(batches, *ACCUM)
    lengths = [first_s, second_s]
    n = [0]

    def transfer():
        n[0] += 1
        s = lengths[(n[0] - 1) % 2]
        return lambda: time.sleep(s)

    eng = windowed(t, "thread", transfer=transfer)
    eng.cfg.carry_last = False  # (see the module's docstring)
    where: list[tuple[int, bool]] = []
    real_one, real_checks = eng._check_one, eng._window_checks

    def slow_held(h):
        where.append((eng._windows["pp"], threading.current_thread() is threading.main_thread()))
        time.sleep(0.15)
        real_one(h)

    def window_checks(wid, kind, todo, tapes, ran, more):
        if second_closed and wid == "pp:1" and eng.plan is not None:
            more = lambda: False
        real_checks(wid, kind, todo, tapes, ran, more)

    eng._check_one, eng._window_checks = slow_held, window_checks
    return t, eng, where


def test_a_held_check_waits_for_the_later_window_with_room_and_the_first_window_ends_on_time(batches, clean4):
    t, eng, where = _two_windows(batches)
    results = [t.train_step() for _ in range(STEPS)]
    assert [r.attempts for r in results] == [2, 1, 1, 1]
    # the first held check (nothing measured yet) may start in the first window; every later one in the second
    later = where[2:]
    assert len(later) >= 4 and all(w == (2, False) for w in later), where
    assert eng.counts["held-left-to-later-windows"] >= 1  # (the counts are the last step's)
    # the short window no longer waits for a held check at its end (it did by ~200 ms before)
    firsts = [wait for wid, _, wait in eng.window_log[-2 * (STEPS - 2):] if wid == "pp:0"]
    assert firsts and max(firsts) < 0.1, eng.window_log
    assert eng.totals["detected"] == 0
    assert equal(params(t), clean4)


def test_a_held_check_no_window_started_is_checked_by_the_drain_and_the_run_ends_bitwise(batches, clean4):
    t, eng, where = _two_windows(batches, second_closed=True)
    for _ in range(STEPS):
        t.train_step()
    later = where[2:]
    assert len(later) >= 4 and all(main for _, main in later), where  # the drain, on the main thread
    assert eng.counts["held-left-to-later-windows"] >= 1 and eng.totals["detected"] == 0
    assert equal(params(t), clean4)


def test_a_wrong_update_whose_check_was_left_to_a_later_window_is_written_back_bitwise(batches, clean4):
    # a 2 s second window: on a loaded host (the suite's other worker) the checks planned into a 1.2 s one were
    # profiled long enough to leave it less room than the held check, which then started in the first window
    t, eng, where = _two_windows(batches, second_s=2.0)
    site = OpSite("aten._fused_adamw_*", "optimizer", 0, compute_only=True)
    Injector(Fault(site, FaultModel("bitflip", field="exponent"), step=2), seed=1).attach(t)
    results = [t.train_step() for _ in range(STEPS)]
    assert eng.totals["detected"] == 1 and eng.totals["repaired_optimizer"] == 1
    assert (2, False) in where[2:]  # checked in the second window, as in the clean run
    # step 0: profiled, then re-executed with the plan; step 3 read the wrong parameters: re-executed
    assert [r.attempts for r in results] == [2, 1, 1, 2]
    assert equal(params(t), clean4)


def test_where_no_window_has_room_the_held_check_still_starts_in_one_rather_than_on_the_critical_path(batches, clean4):
    # both windows 250 ms, shorter than the held check: no later one has room, so a window starts it (the step
    # waits only for its overrun; the drain would take all of it). The first, unless it closed before its worker
    # got to the held check (the previous iteration's carried checks run first): on a loaded host it is left to the
    # second, which has no later room either. (At 100 ms, three busy processes beside this one closed both first.)
    t, eng, where = _two_windows(batches, first_s=0.25, second_s=0.25)
    for _ in range(STEPS):
        t.train_step()
    assert len(where) >= 6 and all(not main for _, main in where), where
    assert equal(params(t), clean4)


def test_two_faults_at_once_a_wrong_update_and_a_backward_fault_in_the_step_that_checks_it_end_bitwise(batches, clean4):
    # step 1's update is wrong (its check, left to step 2's second window, writes it back) and step 2's backward is
    # hit too: step 2 is retried once for both (it read the wrong parameters), nothing else is re-executed
    t, eng, where = _two_windows(batches)
    adam = OpSite("aten._fused_adamw_*", "optimizer", 0, compute_only=True)
    Injector(Fault(adam, FaultModel("bitflip", field="exponent"), step=1), seed=1).attach(t)
    Injector(Fault(OpSite("*", "backward", 23, compute_only=True), FaultModel("bitflip", field="exponent"), step=2),
             seed=5).attach(t)
    results = [t.train_step() for _ in range(STEPS)]
    assert eng.totals["detected"] == 2 and eng.totals["repaired_optimizer"] == 1
    assert [r.attempts for r in results] == [2, 1, 2, 1]
    assert equal(params(t), clean4)
