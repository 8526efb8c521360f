"""The run-time D-DMR queue for dynamic (MoE) ops: best fit at static windows, one by one in dynamic windows,
forced naive execution near the memory budget, drain, and every checker run exactly once."""

import pytest

from trainguard.errors import ConfigError
from trainguard.sdc.dmr.dynamic import DynamicPlanner, Entry


class Log:
    def __init__(self):
        self.ran: list[str] = []

    def entry(self, op, nbytes=1, t=1.0, fail=False):
        def run():
            self.ran.append(op)
            if fail:
                raise RuntimeError(f"mismatch in {op}")

        return Entry(op, nbytes, t, run)


def test_static_window_launches_the_best_fit_subset():
    log, dp = Log(), DynamicPlanner(budget_bytes=1000)
    for op, t in (("a", 2.0), ("b", 3.0), ("c", 1.5), ("d", 4.0)):
        dp.enqueue(log.entry(op, t=t))
    ran = dp.at_static_window(5.5, "tp0")
    assert sorted(e.op_id for e in ran) == sorted(log.ran) == ["c", "d"]  # 1.5 + 4 fills 5.5; a + b only 5
    assert {dp.where[k] for k in log.ran} == {("static", "tp0")}
    assert dp.counters.static == 2 and dp.counters.static_s == 5.5 and dp.counters.windows == {"tp0": 2}
    assert [e.op_id for e in dp.queue] == [k for k in "abcd" if k not in log.ran]
    assert dp.at_static_window(0.5) == [] and len(dp.queue) == 2  # nothing fits


def test_dynamic_window_runs_one_by_one_until_it_closes():
    log, dp = Log(), DynamicPlanner(budget_bytes=1000)
    for op in "abcde":
        dp.enqueue(log.entry(op))
    polls = iter([True, True, False])
    ran = dp.at_dynamic_window(lambda: next(polls), "ep0")
    assert [e.op_id for e in ran] == ["a", "b"] == log.ran  # oldest first, stops when closed
    assert [e.op_id for e in dp.queue] == ["c", "d", "e"]
    assert dp.counters.dynamic == 2 and dp.where["b"] == ("dynamic", "ep0")
    ran = dp.at_dynamic_window(lambda: True)  # open longer than the queue: empties it
    assert [e.op_id for e in ran] == ["c", "d", "e"] and not dp.queue


def test_memory_near_the_budget_forces_naive_execution():
    log, dp = Log(), DynamicPlanner(budget_bytes=10, near=0.9)  # checkers forced above 9 bytes
    dp.enqueue(log.entry("a", nbytes=4, t=2.0))
    dp.enqueue(log.entry("b", nbytes=4, t=1.0))
    assert log.ran == [] and dp.retained_bytes == 8
    dp.enqueue(log.entry("c", nbytes=4, t=3.0))  # 12 > 9: the shortest queued checker runs now
    assert log.ran == ["b"] and dp.where["b"] == ("naive", None)
    assert [e.op_id for e in dp.queue] == ["a", "c"] and dp.retained_bytes == 8
    dp.enqueue(log.entry("huge", nbytes=50, t=0.1))  # over the limit even alone: naive at once
    assert log.ran == ["b", "a", "c", "huge"] and not dp.queue
    assert dp.counters.naive == 4 and dp.counters.peak_retained_bytes <= 9


def test_memory_fn_monitoring():
    in_use = {"bytes": 0}
    log = Log()
    dp = DynamicPlanner(budget_bytes=100, near=0.5, memory_fn=lambda: in_use["bytes"])
    for op in "abc":
        dp.enqueue(log.entry(op))
    assert log.ran == []
    in_use["bytes"] = 80  # something else filled the device
    assert dp.check_memory() == 3 and log.ran == ["a", "b", "c"]  # forced until the queue is empty
    assert dp.counters.naive == 3


def test_drain_runs_everything_once_and_reset():
    log, dp = Log(), DynamicPlanner(budget_bytes=1000)
    for op in "abcd":
        dp.enqueue(log.entry(op))
    dp.at_static_window(1.0, "tp0")
    with pytest.raises(RuntimeError, match="drain"):
        dp.reset()
    dp.drain()
    assert sorted(log.ran) == list("abcd") and len(log.ran) == 4 and not dp.queue
    assert dp.counters.drained == 3 and dp.counters.enqueued == 4
    with pytest.raises(ValueError, match="already enqueued"):
        dp.enqueue(log.entry("a"))
    dp.reset()
    dp.enqueue(log.entry("a"))  # a new iteration
    assert dp.counters.enqueued == 1


def test_a_mismatch_propagates_and_the_entry_is_not_rerun():
    log, dp = Log(), DynamicPlanner(budget_bytes=1000)
    dp.enqueue(log.entry("bad", fail=True))
    dp.enqueue(log.entry("ok"))
    with pytest.raises(RuntimeError, match="mismatch in bad"):
        dp.drain()
    dp.drain()
    assert log.ran == ["bad", "ok"]


def test_bad_settings():
    with pytest.raises(ConfigError):
        DynamicPlanner(budget_bytes=-1)
    with pytest.raises(ConfigError):
        DynamicPlanner(budget_bytes=10, near=0)
