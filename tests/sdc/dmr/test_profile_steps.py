"""``[sdc.dmr] profile_steps``: the first step is profiled several times and the plan takes each op's and window's
median time, so one op preempted while profiled (a loaded host) does not leave it checked at once for the run.

Windowed single-process trainer without activation checkpointing (``_windowed``): micro-batch 0's forward ops,
the attention among them, are planned into the window micro-batch 1 waits in."""

import os
import signal
import threading
import time

import pytest

import trainguard.sdc.dmr.engine.profiling as profiling_mod
from tests.sdc.dmr._windowed import clean_params, equal, params, trainer, windowed
from trainguard.sdc.dmr.engine import DMREngine
from trainguard.sdc.dmr.planner import plan_static
from trainguard.sdc.dmr.profile import OpRecord, Profile, Window, median_profile

NO_AC = ("--train.activation_checkpoint", "none")
WINDOW_S = 0.4  # (the planner fills 80% of it: 320 ms)


def _transfer():
    return lambda: time.sleep(WINDOW_S)


def _profiled(batches, steps: int):
    """A windowed trainer whose first step was profiled ``steps`` times, and the profiles the engine merged."""
    merged: list[list[Profile]] = []
    real = profiling_mod.median_profile
    t = trainer(batches, *NO_AC)
    eng = windowed(t, "thread", transfer=_transfer, coverage=True, profile_steps=steps)
    try:
        profiling_mod.median_profile = lambda ps: (merged.append(list(ps)), real(ps))[1]
        result = t.train_step()
    finally:
        profiling_mod.median_profile = real
    return t, eng, result, merged


def _attention(profile: Profile) -> OpRecord:
    return next(o for o in profile.ops if o.phase == "forward" and o.name.startswith("aten._scaled_dot_product_"))


def test_the_first_step_is_profiled_three_times_and_planned_from_the_medians(batches):
    clean = clean_params(batches, *NO_AC)
    t, eng, result, merged = _profiled(batches, 3)
    assert result.attempts == 4  # three profiled attempts, then the verified one under the plan
    assert [r["site"] for r in result.retries] == ["profile"] * 3 and all(r.get("planned") for r in result.retries)
    assert len(merged) == 1 and len(merged[0]) == 3
    runs = merged[0]
    assert all([o.id for o in p.ops] == [o.id for o in runs[0].ops] for p in runs)  # the same step each time
    for n, o in enumerate(eng.profile.ops):
        assert o.time_s == sorted(p.ops[n].time_s for p in runs)[1]
    assert [w.duration_s for w in eng.profile.windows] == \
        [sorted(p.windows[n].duration_s for p in runs)[1] for n in range(len(runs[0].windows))]
    assert eng.profile.peak_bytes == max(p.peak_bytes for p in runs)
    assert [t.train_step().attempts for _ in range(2)] == [1, 1]
    assert eng.totals["detected"] == 0 and eng.coverage_report()["coverage"] == 1.0
    assert equal(params(t), clean)


def test_profiled_attempts_do_not_count_against_max_retries(batches):
    t = trainer(batches, *NO_AC, "--train.max_retries", "0")
    windowed(t, "thread", transfer=_transfer, profile_steps=3)
    assert t.train_step().attempts == 4


def test_one_op_stalled_in_one_profile_stays_in_the_window(batches):
    """An attention op profiled 400 ms too long (longer than the window's room) in one of three profiles: planned
    from that profile alone it is checked at once; from the median of the three, in the window as before."""
    _, eng, _, merged = _profiled(batches, 3)
    copy = lambda p: Profile.from_json(p.to_json())
    att = _attention(merged[0][-1]).id
    stalled = [copy(p) for p in merged[0]]
    next(o for o in stalled[-1].ops if o.id == att).time_s += WINDOW_S  # (the last: the one whose ops are kept)
    cfg = eng.planner_config()
    assert plan_static(copy(merged[0][-1]), cfg).ops[att].strategy in ("agc", "d-inter")  # as profiled
    assert plan_static(copy(stalled[-1]), cfg).ops[att].strategy == "naive"  # no window has room for it
    assert plan_static(median_profile(stalled), cfg).ops[att].strategy in ("agc", "d-inter")


def _op(i: str, t: float) -> OpRecord:
    return OpRecord(id=i, name="aten.mm.default", phase="forward", kind="F", time_s=t)


def test_median_profile_matches_ops_and_windows_by_id():
    w = lambda d: Window("pp:0", "pp", 1.0, d, "forward:1")
    a = Profile(iteration_s=1.0, peak_bytes=10, memory_budget_bytes=110, ops=[_op("forward:0", 1.0)], windows=[w(0.1)])
    b = Profile(iteration_s=2.0, peak_bytes=30, memory_budget_bytes=90, ops=[_op("forward:0", 2.0)], windows=[w(0.3)])
    c = Profile(iteration_s=3.0, peak_bytes=20, memory_budget_bytes=70,
                ops=[_op("forward:0", 9.0), _op("forward:dyn:0", 5.0)], windows=[w(0.5)])
    m = median_profile([a, b, c])
    assert [(o.id, o.time_s) for o in m.ops] == [("forward:0", 2.0), ("forward:dyn:0", 5.0)]  # the last one's ops
    assert m.windows[0].duration_s == 0.3 and m.iteration_s == 2.0  # (the last one's: 9.0, 0.5 and 3.0)
    assert m.peak_bytes == 30 and m.memory_budget_bytes == 80  # the last one's headroom (50) above the largest peak
    assert [o.time_s for o in c.ops] == [9.0, 5.0]  # the inputs are left as they were
    assert median_profile([a]) is a
    with pytest.raises(ValueError, match="at least one profile"):
        median_profile([])


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_sigterm_during_a_profiled_attempt_checkpoints_after_the_step_and_the_resumed_run_profiles_again(
        batches, tmp_path, monkeypatch):
    """Preempted between two profiled attempts of the first step: the step is still finished (profiled three times,
    then verified under the plan) before the checkpoint, and the resumed process, which has no plan, profiles its
    first step again. Both end bitwise equal to a run without DMR and without the interruption."""
    steps = 3
    clean = clean_params(batches, *NO_AC, steps=steps)
    args = (*NO_AC, "--train.steps", str(steps), "--checkpoint.dir", str(tmp_path / "ck"), "--output.dir",
            str(tmp_path / "out"))
    real = DMREngine.finish_profile
    calls: list[int] = []

    def sigterm_after_the_first_profile(self, trainer_):
        calls.append(trainer_.step_idx)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # (the second profiled attempt runs with the stop pending)
        return real(self, trainer_)

    monkeypatch.setattr(DMREngine, "finish_profile", sigterm_after_the_first_profile)
    first = trainer(batches, *args)
    eng = windowed(first, "thread", transfer=_transfer, profile_steps=3)
    summary = first.run()
    assert summary.stop_reason == "preempted" and summary.end_step == 1 and summary.checkpoint.endswith("step_00000001")
    assert calls == [0, 0, 0] and eng.plan is not None and eng.totals["detected"] == 0
    resumed = trainer(batches, *args, "--checkpoint.resume", "true")
    assert resumed.step_idx == 1
    again = windowed(resumed, "thread", transfer=_transfer, profile_steps=3)
    resumed.run()
    assert calls == [0, 0, 0, 1, 1, 1]  # the resumed process planned from its own first step, profiled three times
    assert again.totals["detected"] == 0 and equal(params(resumed), clean)
