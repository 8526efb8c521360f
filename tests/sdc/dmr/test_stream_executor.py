"""The stream executor (``[sdc.dmr] executor = "stream"``, the default on CUDA): a window's checkers are launched
on a side stream before the wait, the compute stream then waits for them, and comparisons whose outcome only
decides the verdict are left as device flags that the verdict reads in one transfer.

On CPU the side stream is torch.cpu's no-op one, so these tests check the executor's logic: what runs where and
in which order, that a detection decided at the verdict still retries (or rewinds, or repairs) the right
iteration, bitwise. Whether the checkers overlap a transfer on a GPU is not testable here (see docs/dmr.md)."""

import os
import threading
import time

import pytest

from tests.sdc.dmr._windowed import clean_params, equal, params, trainer, windowed
from trainguard.errors import SuspectedHardwareFault
from trainguard.faults import Fault, FaultModel, Injector, OpSite


def _windowed(batches, executor: str, **cfg):
    t = trainer(batches)
    return t, windowed(t, executor, **cfg)


@pytest.mark.parametrize("executor", ["thread", "stream"])
def test_clean_windowed_runs_raise_no_alarm_and_end_bitwise_with_either_executor(batches, clean, executor):
    # Each transfer lasts 100 ms and, once the plan exists, until the window has checked something (at most 10 s):
    # the thread executor's worker first checks the held update and takes fingerprints, and on a loaded host (the
    # suite's two test processes on two cores) those alone can outlast 100 ms; the window then leaves its planned
    # checks to the drain (tests/sdc/dmr/test_window_closes_early.py), and this test would see none run in it.
    def transfer():
        start = eng.counts["checked-in-pp"]

        def wait():
            time.sleep(0.1)
            deadline = time.monotonic() + 10
            while not eng._profiling and eng.counts["checked-in-pp"] == start and time.monotonic() < deadline:
                time.sleep(0.005)
        return wait

    t = trainer(batches)
    eng = windowed(t, executor, transfer=transfer, coverage=True)
    for _ in range(3):
        t.train_step()
    assert eng.totals["detected"] == 0 and eng.totals["stale"] == 0
    assert eng.coverage_report()["coverage"] == 1.0
    assert eng.counts["checked-in-pp"] > 0  # checks ran in the window
    assert (eng.counts["flags-read"] > 0) == (executor == "stream")  # and were decided at the verdict
    assert equal(params(t), clean)


# occurrences: the first micro-batch's ops of step 1 (checked in the window) and the last micro-batch's (carried
# past the update, checked in step 2)
@pytest.mark.parametrize("phase, occurrence", [("forward", 7), ("recompute", 11), ("backward", 23),
                                               ("forward", 60), ("backward", 70)])
def test_a_fault_decided_at_the_verdict_is_rolled_back_bitwise(batches, clean, phase, occurrence):
    t, eng = _windowed(batches, "stream")
    inj = Injector(Fault(OpSite("*", phase, occurrence, compute_only=True), FaultModel("bitflip", field="exponent"),
                         step=1), seed=5).attach(t)
    results = [t.train_step() for _ in range(3)]
    assert len(inj.records) == 1 and eng.totals["detected"] >= 1
    assert sum(r.attempts for r in results) >= 5  # step 0 profiled and re-executed; one more for the fault
    assert equal(params(t), clean)


def test_a_wrong_held_update_decided_at_the_verdict_is_written_back_bitwise(batches, clean):
    t, eng = _windowed(batches, "stream")
    Injector(Fault(OpSite("aten._fused_adamw_*", "optimizer", 0, compute_only=True),
                   FaultModel("bitflip", field="exponent"), step=1), seed=3).attach(t)
    attempts = [t.train_step().attempts for _ in range(3)]
    assert eng.totals["detected"] == 1 and eng.totals["repaired_optimizer"] == 1
    assert attempts == [2, 1, 2]  # step 2 read the wrong parameters: re-executed after the write-back
    assert equal(params(t), clean)


def test_two_faults_in_one_step_and_a_wrong_update_before_them_all_end_bitwise(batches, clean):
    t, eng = _windowed(batches, "stream")
    Injector([Fault(OpSite("aten._fused_adamw_*", "optimizer", 0, compute_only=True),
                    FaultModel("bitflip", field="exponent"), step=1),
              Fault(OpSite("*", "backward", 23, compute_only=True), FaultModel("bitflip", field="exponent"), step=2),
              Fault(OpSite("*", "forward", 60, compute_only=True), FaultModel("bitflip", field="exponent"), step=2)],
             seed=9).attach(t)
    for _ in range(3):
        t.train_step()
    assert eng.totals["detected"] >= 3 and eng.totals["repaired_optimizer"] == 1
    assert equal(params(t), clean)


def test_a_persistent_fault_is_suspected_hardware_with_the_stream_executor(batches):
    t, _ = _windowed(batches, "stream", system="naive")
    Injector(Fault(OpSite("aten.mm*", "backward", 4), FaultModel("nan"), step=0, persistent=True)).attach(t)
    with pytest.raises(SuspectedHardwareFault, match=r"dmr:backward:\d+:aten.mm"):
        t.train_step()


class _Recorder:
    """torch.cpu's stream API, with every call that orders work recorded (what a CUDA side stream is told)."""

    def __init__(self, eng):
        self.events: list[tuple] = []
        self.eng = eng
        rec = self

        class Stream:
            def __init__(self, name):
                self.name = name

            def wait_stream(self, other):
                rec.events.append(("wait_stream", self.name, other.name, threading.get_ident()))

        self.Stream = Stream
        self.compute, self.side = Stream("compute"), Stream("side")

    def current_stream(self):
        return self.compute

    def stream(self, s):
        rec = self

        class _Ctx:
            def __enter__(self):
                rec.events.append(("enter", s.name, rec.eng.counts["checked-in-pp"], threading.get_ident()))

            def __exit__(self, *exc):
                rec.events.append(("exit", s.name, rec.eng.counts["checked-in-pp"], threading.get_ident()))

        return _Ctx()


def test_a_window_launches_its_checkers_on_the_side_stream_before_the_wait_and_the_compute_stream_waits_after(
        batches):
    t, eng = _windowed(batches, "stream")
    rec = _Recorder(eng)
    t.train_step()  # (profiled and planned)
    eng._devmod, eng._side = rec, rec.side
    waits: list[tuple] = []
    real = eng.window

    def window(kind, wait):
        return real(kind, lambda: (waits.append((eng.counts["checked-in-pp"], threading.get_ident())), wait())[1])

    eng.window = window
    t.model._forward_pre_hooks.clear()
    calls = []
    t.model.register_forward_pre_hook(lambda m, i: (calls.append(1), len(calls) % 2 == 0 and
                                                    eng.window("pp", lambda: time.sleep(0.01))) and None)
    t.train_step()
    main = threading.get_ident()
    names = [e[:3] if e[0] == "wait_stream" else e[:2] for e in rec.events]
    assert names == [("wait_stream", "side", "compute"), ("enter", "side"), ("exit", "side"),
                     ("wait_stream", "compute", "side")]
    enter, leave = rec.events[1], rec.events[2]
    assert enter[2] == 0 and leave[2] > 0  # the window's checks ran inside the side stream's context
    assert len(waits) == 1 and waits[0][0] == leave[2]  # all of them before the wait began
    assert all(e[-1] == main for e in rec.events) and waits[0][1] == main  # on the calling thread


def test_tolerance_mode_comparisons_are_decided_at_the_verdict_too(batches, clean, tmp_path):
    """On a GPU the tolerance mode is the common one (non-deterministic kernels): its comparisons leave flags too.
    A report that gives matrix products a tolerance (CPU's are bitwise, so the clean run stays quiet) and an exponent
    flip in one of them: found at the verdict through the float sums, and rolled back bitwise."""
    from trainguard.sdc.dmr.determinism import FORMAT, save

    save({"format": FORMAT, "ops": {"aten.mm.default": 1e-7}}, tmp_path / "det.json")
    t, eng = _windowed(batches, "stream", compare="tolerance", determinism_report=str(tmp_path / "det.json"))
    assert eng.rtol == {"aten.mm.default": pytest.approx(8e-7)}
    inj = Injector(Fault(OpSite("aten.mm*", "backward", 3, compute_only=True), FaultModel("bitflip", field="exponent"),
                         step=1), seed=5).attach(t)
    results = [t.train_step() for _ in range(3)]
    assert len(inj.records) == 1 and eng.totals["detected"] >= 1 and results[1].attempts == 2
    assert eng.counts["flags-read"] > 0
    assert equal(params(t), clean)


def test_every_flag_is_acted_on_before_a_handler_that_raised_is_reported():
    """A held update's copies must follow its verdict whatever happens to another flag's handler: a handler that
    raises does not drop the flags after it (dropped, a held update's copy would go stale)."""
    import torch

    from trainguard.sdc.dmr.config import DMRConfig
    from trainguard.sdc.dmr.engine import DMREngine

    eng = DMREngine(DMRConfig(enabled=True, executor="stream"))
    eng._use_executor(torch.device("cpu"))
    ran = []

    def boom():
        raise RuntimeError("boom")

    eng._flag(torch.tensor(True), boom)
    eng._flag(torch.tensor(False), lambda: ran.append("differs"), lambda: ran.append("agrees"))
    eng._flag(torch.tensor(True), lambda: ran.append("differs2"))
    with pytest.raises(RuntimeError, match="boom"):
        eng._read_flags()
    assert ran == ["agrees", "differs2"] and eng._flags == []


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes")
@pytest.mark.parametrize("priority", ["idle", "normal"])
def test_window_checkers_run_in_the_idle_scheduling_class_and_the_step_does_not(batches, priority):
    t = trainer(batches)
    eng = windowed(t, "thread", checker_priority=priority)
    seen = []
    checks = eng._window_checks

    def recording(*args, **kwargs):
        seen.append(os.sched_getscheduler(0))
        return checks(*args, **kwargs)

    eng._window_checks = recording
    t.train_step()  # profiled, then planned
    t.train_step()
    assert seen and set(seen) == ({os.SCHED_IDLE} if priority == "idle" else {os.sched_getscheduler(0)})
    assert os.sched_getscheduler(0) != os.SCHED_IDLE


@pytest.mark.parametrize("executor", ["thread", "stream"])
def test_two_backward_faults_in_one_step_under_the_windows_carry_budget_end_bitwise(batches, executor):
    """``carry_budget = windows`` with a window of 100 ms: the first micro-batch's ops are checked in it, the last
    micro-batch's either carried (as far as the window's room goes) or checked at once. A bit flip in each, in the
    same step: found (by whichever check runs first), the step re-executed, no alarm after, bitwise in the end."""
    t, eng = _windowed(batches, executor, carry_budget="windows")
    inj = Injector([Fault(OpSite("*", "backward", k, compute_only=True), FaultModel("bitflip", field="exponent"),
                          step=1) for k in (23, 70)], seed=11).attach(t)
    results = [t.train_step() for _ in range(4)]
    assert len(inj.records) == 2 and eng.totals["detected"] >= 1
    assert eng.plan.carry_budget_s is not None and eng.cfg.carry_budget == "windows"
    assert results[-1].attempts == 1 and sum(r.attempts for r in results) >= 6  # (step 0: profiled, re-executed)
    assert equal(params(t), clean_params(batches, steps=4))
