"""Fail-stop schedules: the mean inter-arrival time is the MTBF; Weibull shape < 1 is burstier."""

import numpy as np
import pytest

from trainguard.errors import TrainguardError
from trainguard.faults import FailureSchedule, kill_due


@pytest.mark.parametrize("kind", ["exponential", "weibull"])
def test_mean_interval_is_mtbf(kind):
    iv = FailureSchedule(kind, mtbf_hours=2.0, shape=0.7, seed=1).intervals(50_000)
    assert abs(iv.mean() - 2.0) / 2.0 < 0.03


def test_weibull_shape_controls_dispersion():
    cv = lambda s: (lambda x: x.std() / x.mean())(FailureSchedule("weibull", 1.0, s, 0).intervals(50_000))
    assert cv(0.5) > cv(1.0) > cv(2.0)
    assert abs(cv(1.0) - 1.0) < 0.05  # shape 1 is exponential


def test_presets_and_times():
    assert FailureSchedule.preset("low").mtbf_hours == 2.0 and FailureSchedule.preset("high").mtbf_hours == 0.5
    times = FailureSchedule.preset("mid", seed=3).times(500.0)
    assert np.all(np.diff(times) > 0) and times.max() < 500 and abs(len(times) - 500) < 80
    events = FailureSchedule.preset("mid", seed=3).events(8, 50.0)
    assert all(0 <= n < 8 for _, n in events)
    high = FailureSchedule.preset("high", seed=3)
    steps = high.to_steps(8, 10.0, step_time_s=60.0)
    events = high.events(8, 10.0)
    assert sum(len(v) for v in steps.values()) == len(events) == len(high.times(10.0)) > 10
    for step, nodes in steps.items():  # each failure in the one-minute step its time falls in, with its node
        assert nodes == [n for t, n in events if step * 60.0 <= t * 3600.0 < (step + 1) * 60.0], step


def test_bad_schedules_refused():
    with pytest.raises(TrainguardError):
        FailureSchedule("gaussian")
    with pytest.raises(TrainguardError):
        FailureSchedule("exponential", mtbf_hours=0)
    with pytest.raises(TrainguardError):
        FailureSchedule.preset("extreme")


def test_kill_due_kills_the_scheduled_worker():
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert kill_due(4, {4: [1]}, {1: proc.pid}) == [1]
        assert proc.wait(timeout=10) != 0
        assert kill_due(5, {4: [1]}, {1: proc.pid}) == []
    finally:
        proc.kill()
