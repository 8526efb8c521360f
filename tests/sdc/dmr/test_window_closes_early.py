"""A window that closes before its planned checks are done (shorter than profiled, or its checks slower: a host
slower for a while): on the thread executor the step does not wait for the rest; they are left to later windows,
else the drain, and are checked there before the verdict, as every check is."""

import time

from tests.sdc.dmr._windowed import equal, params, trainer, windowed
from trainguard.faults import Fault, FaultModel, Injector, OpSite


def _closing_early(batches, executor: str = "thread"):
    """Profiled with 300 ms windows (checks are planned into them), then run with transfers that are already done:
    every window closes as it opens."""
    length = [0.3]
    t = trainer(batches)
    eng = windowed(t, executor, transfer=lambda: (lambda: time.sleep(length[0])))
    t.train_step()  # profiled (and re-executed under the plan made from it)
    assert sum(1 for a in eng.plan.ops.values() if a.window) > 20  # checks planned into the window
    length[0] = 0.0
    return t, eng


def test_planned_checks_a_window_had_no_time_for_are_checked_by_the_drain_and_the_run_ends_bitwise(batches, clean):
    t, eng = _closing_early(batches)
    for _ in range(2):
        t.train_step()
        left = eng.counts["left-to-later-windows"]
        assert left > 0  # the window closed with planned checks to go: the step did not wait for them
        assert eng.counts["checked-in-drain"] >= left and eng.queue == []  # they were checked before the verdict
    assert eng.totals["detected"] == 0 and eng.totals["stale"] == 0
    assert equal(params(t), clean)


def test_the_stream_executor_still_launches_every_planned_check_in_its_window(batches, clean):
    # (launched before the wait: the host cannot see the window end, and a device runs them beside the transfer)
    t, eng = _closing_early(batches, "stream")
    for _ in range(2):
        t.train_step()
        assert eng.counts["left-to-later-windows"] == 0 and eng.counts["checked-in-pp"] > 0
    assert equal(params(t), clean)


def test_a_fault_whose_check_was_left_to_the_drain_is_found_there_and_rolled_back_bitwise(batches, clean):
    t, eng = _closing_early(batches)
    # the first micro-batch's backward: its checks are planned into the window before the second one's forward
    Injector(Fault(OpSite("*", "backward", 23, compute_only=True), FaultModel("bitflip", field="exponent"), step=1),
             seed=5).attach(t)
    found = []
    real = eng._mismatch
    eng._mismatch = lambda op_id, name, phase, strategy, detail: (found.append((phase, detail)),
                                                                   real(op_id, name, phase, strategy, detail))
    results = [t.train_step() for _ in range(2)]
    assert ("backward", "deferred check (drain) differs") in found
    assert eng.totals["detected"] >= 1 and results[0].attempts == 2
    assert equal(params(t), clean)
