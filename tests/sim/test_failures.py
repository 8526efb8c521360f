"""Failure trails: the seed fixes them, rates match the MTBF, epochs share draws, traces and domains map to
the right groups, bad input is refused in one line."""

import math
import re

import numpy as np
import pytest

from trainguard.errors import TrainguardError
from trainguard.sim.failures import FailureSpec, FailureTrail, load_trace


def _events(spec, n_units, G, seed, t_end):
    tr = FailureTrail(spec, n_units, G, seed)
    tr.start_epoch(0.0, np.ones(n_units, dtype=bool))
    return tr.events_until(t_end)


@pytest.mark.parametrize("model,renewal", [("weibull", "failure"), ("exponential", "restart")])
def test_absolute_trails_are_fixed_by_the_seed_and_match_the_mtbf(model, renewal):
    spec = FailureSpec(model=model, renewal=renewal, gpu_mtbf_hours=1000.0)
    a = _events(spec, 50, 8, 3, 30 * 86400)
    # consuming in pieces gives the same events (windows are fixed, whatever a scheme consumes)
    tr = FailureTrail(spec, 50, 8, 3)
    b = []
    for t in np.linspace(0, 30 * 86400, 7)[1:]:
        b += tr.events_until(t)
    assert a == b and tr.absolute
    assert [t for t, _ in a] == sorted(t for t, _ in a)
    assert a != _events(spec, 50, 8, 4, 30 * 86400)
    expected = 50 * 8 * 30 * 24 / 1000.0  # stationary: rate = GPUs / MTBF
    assert abs(len(a) - expected) < 5 * math.sqrt(expected)
    assert {u for _, units in a for u in units} <= set(range(50))


def test_renewal_at_restart_crowds_failures_after_each_restart_and_shares_draws():
    spec = FailureSpec(model="weibull", weibull_shape=0.7, renewal="restart", gpu_mtbf_hours=1000.0)
    tr = FailureTrail(spec, 64, 8, 5)
    assert not tr.absolute
    used = np.ones(64, dtype=bool)
    tr.start_epoch(0.0, used)
    first = tr.events_until(1e12)
    tr.start_epoch(5000.0, used)  # the next epoch (restart at t = 5000 s)
    second = tr.events_until(1e12)
    assert len(first) == len(second) == 64  # each group fails once per epoch, then stays down
    # common random numbers: epoch e of another scheme restarting elsewhere sees the same offsets
    other = FailureTrail(spec, 64, 8, 5)
    other.start_epoch(100.0, used)
    other.events_until(1e12)
    other.start_epoch(9000.0, used)
    shifted = other.events_until(1e12)
    assert [u for _, u in shifted] == [u for _, u in second]
    assert [t - 9000.0 for t, _ in shifted] == pytest.approx([t - 5000.0 for t, _ in second])
    # infant mortality: with k < 1 the first failure after a restart comes much sooner than the mean spacing
    # m (an exponential model's mean first failure); here Gamma(1 + 1/k) 64^(-1/k) * 64 m ~ 0.17 m
    m = 1000.0 * 3600 / (64 * 8)
    firsts = []
    for _ in range(300):
        tr.start_epoch(0.0, used)
        firsts.append(tr.peek())
    assert np.mean(firsts) < m / 3
    tr.job_down()
    assert tr.peek() == math.inf


def test_trace_replay_maps_gpus_to_groups_and_repeats(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("time_h,gpu\n1.0,17\n2.5,3\n2.0,40\n")
    trace = load_trace(path)
    assert list(trace.times_s) == [3600.0, 7200.0, 9000.0]
    spec = FailureSpec(model="trace", trace_path=str(path))
    ev = _events(spec, 6, 8, 0, 2 * 9000.0)
    assert [u for _, u in ev] == [(2,), (5,), (0,), (2,), (5,), (0,)]  # gpu 17 -> group 2, 40 -> 5, 3 -> 0
    assert [t for t, _ in ev][3:] == [t + 9000.0 for t, _ in ev][:3]
    with pytest.raises(TrainguardError, match="names GPU 40"):
        _events(spec, 4, 8, 0, 1.0)
    (tmp_path / "bad.csv").write_text("when,gpu\n1,2\n")
    with pytest.raises(TrainguardError, match="time_s or time_h"):
        load_trace(tmp_path / "bad.csv")
    (tmp_path / "bad2.csv").write_text("time_s\nsoon\n")
    with pytest.raises(TrainguardError, match="line 2"):
        load_trace(tmp_path / "bad2.csv")
    with pytest.raises(TrainguardError, match="cannot read"):
        load_trace(tmp_path / "missing.csv")


@pytest.mark.parametrize("content, msg", [
    (b"time_h,gpu\n1,\xff\xfe\n", "is not a text (UTF-8) CSV file"),  # (was a UnicodeDecodeError traceback)
    (b"time_h,gpu,gpu\n1,2,3\n", "names the column gpu twice"),  # (the first gpu column was dropped unread)
    (b"time_h,GPU,gpu\n1,2,3\n", "names the column gpu twice"),
    (b"time_h,gpu\n1,2,extra\n", "line 2 has more fields than its header (2)"),  # (the extra field was ignored)
    (b"time_h\n1e308\n", "times must be finite and >= 0"),  # (hours overflowing to inf seconds)
    (b'time_h\n"1\n', "is not a valid CSV file"),  # (an unclosed quote was read as a value)
])
def test_a_trace_file_that_cannot_be_read_as_written_is_refused(tmp_path, content, msg):
    path = tmp_path / "trace.csv"
    path.write_bytes(content)
    with pytest.raises(TrainguardError, match=re.escape(msg)):
        load_trace(path)


def test_trace_without_ids_hits_seeded_random_groups(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("time_s\n" + "\n".join(str(60 * i) for i in range(1, 40)) + "\n")
    spec = FailureSpec(model="trace", trace_path=str(path))
    a, b = _events(spec, 10, 8, 1, 3000), _events(spec, 10, 8, 1, 3000)
    assert a == b and len({u for _, u in a}) > 3


def test_domain_failures_take_down_whole_domains():
    spec = FailureSpec(model="exponential", gpu_mtbf_hours=1e15, gpus_per_domain=32, domain_mtbf_hours=10.0)
    ev = _events(spec, 12, 8, 2, 50 * 3600)  # 12 groups of 8 GPUs, racks of 4 groups
    assert ev and all(len(u) == 4 and u[0] % 4 == 0 and list(u) == list(range(u[0], u[0] + 4)) for _, u in ev)
    big = FailureSpec(model="exponential", gpu_mtbf_hours=1e15, gpus_per_domain=4, domain_mtbf_hours=10.0)
    ev = _events(big, 3, 8, 2, 50 * 3600)  # a group spans two domains: one domain takes down one group
    assert ev and all(len(u) == 1 and 0 <= u[0] < 3 for _, u in ev)
    with pytest.raises(TrainguardError, match="multiple of the group size"):
        _events(FailureSpec(gpus_per_domain=12, domain_mtbf_hours=1.0), 4, 8, 0, 1.0)


def test_bad_specs():
    for kw, msg in [({"model": "gamma"}, "failure model"), ({"renewal": "never"}, "renewal"),
                    ({"weibull_shape": 0.0}, "shape"), ({"gpu_mtbf_hours": -1.0}, "MTBF"),
                    ({"repair_s": -5.0}, "repair"), ({"model": "trace"}, "trace file")]:
        with pytest.raises(TrainguardError, match=msg):
            FailureSpec(**kw).validate()


def test_looking_ahead_does_not_consume(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("time_s,group\n10,0\n20,1\n30,0\n")
    tr = FailureTrail(FailureSpec(model="trace", trace_path=str(path)), 4, 8, 0)
    assert tr.next_matching(lambda u: 1 in u, t_max=100.0) == 20.0
    assert tr.next_matching(lambda u: 3 in u, t_max=100.0) == math.inf  # bounded by t_max, even though it repeats
    assert tr.pop()[0] == 10.0 and tr.pop()[0] == 20.0
