"""Time-to-train loop: failure-free baselines are exact, failures are masked, trails are shared by every
scheme, the batched loop equals the step-by-step one, repairs / spares / failure domains act as documented,
and SimGrid agrees where the network has no contention."""

import math

import numpy as np
import pytest

from trainguard.errors import TrainguardError
from trainguard.sim.simgrid_model import Platform, simgrid_available, simulate_in_subprocess
from trainguard.sim.timetotrain import ClusterParams, FastClock, compare, simulate

QUIET = dict(gpu_mtbf_hours=1e12, jitter=0.0, base_steps=200)
SMALL = dict(total_gpus=16 * 8, gpu_mtbf_hours=8 * 16 * 0.25, base_steps=120, restart_s=600, checkpoint_s=30,
             stack_compute_s=10, model_params=4e9, max_days=5)


@pytest.mark.parametrize("scheme,r,stacks", [("checkpoint", 1, 1), ("spare", 9, 1), ("replication", 2, 2)])
def test_failure_free_is_exact(scheme, r, stacks):
    p = ClusterParams(**QUIET)
    res = simulate(scheme, 200, r, 0, p)
    tc, ta = p.stack_compute_s, p.allreduce_time_s(200, 200)
    assert res.finished and res.global_restarts == 0 and res.failures == 0
    assert res.mean_stacks_per_step == stacks
    assert res.time_to_train_days * 86400 == pytest.approx(200 * (stacks * tc + ta), rel=1e-9)
    assert res.availability == pytest.approx(1.0)


def test_allreduce_follows_alpha_beta_not_group_count():
    # per-GPU gradient fixed (model scales with the group): the bandwidth term stays, only latency grows with N
    p_small, p_big = ClusterParams(total_gpus=8 * 64, model_params=4e9), ClusterParams(total_gpus=8 * 4096, model_params=4e9)
    small, big = p_small.allreduce_time_s(64, 64), p_big.allreduce_time_s(4096, 4096)
    beta = p_big.gpu_bandwidth_gbps * 1e9 / 8
    M = 4e9 * 2 / 8
    assert big - small == pytest.approx(2 * (4095 - 63) * p_big.hop_latency_s + 2 * M / beta * (1 / 64 - 1 / 4096), rel=1e-9)
    assert big < 1.1 * small + 0.05
    assert ClusterParams(allreduce_s=0.3).allreduce_time_s(10, 200) == 0.3


@pytest.mark.parametrize("scheme,r", [("spare", 3), ("replication", 2), ("checkpoint", 1)])
def test_batched_loop_equals_step_by_step(scheme, r):
    p = ClusterParams(**SMALL)
    a = simulate(scheme, 16, r, 4, p).as_dict()
    b = simulate(scheme, 16, r, 4, p, batch=False).as_dict()
    assert a == b
    assert a["failures"] > 0


def test_failures_masked_and_deterministic():
    p = ClusterParams(**SMALL)
    a = simulate("spare", 16, 3, 4, p)
    assert a.as_dict() == simulate("spare", 16, 3, 4, p).as_dict()
    assert a.finished and a.masked_failures > 0
    ck = simulate("checkpoint", 16, 1, 4, p)
    assert ck.global_restarts > a.global_restarts
    assert 0 < a.availability < 1 and a.mean_stacks_per_step > 1


class _Recorder(FastClock):
    """Fast clock that records the instants at which all-reduces fail (a failure was detected)."""

    def __init__(self):
        super().__init__()
        self.failed_at = []

    def allreduce(self, seconds, factor, deadline, failed_frac, units=None):
        ok = super().allreduce(seconds, factor, deadline, failed_frac, units)
        if not ok:
            self.failed_at.append(deadline)
        return ok


def test_schemes_share_the_failure_trail():
    # absolute failure times (renewal at a GPU's own failure): every failure a scheme detects is an event of
    # the one trail of the seed, whatever the scheme
    p = ClusterParams(**{**SMALL, "renewal": "failure"})
    seen = []
    for scheme, r in (("spare", 3), ("replication", 2), ("checkpoint", 1)):
        clock = _Recorder()
        simulate(scheme, 16, r, 7, p, clock=clock)
        seen.append(set(clock.failed_at))
    from trainguard.sim.failures import FailureTrail

    trail = FailureTrail(p.failure_spec(), 16, 8, 7)
    times = {t for t, _ in trail.events_until(5 * 86400)}
    for s in seen:
        assert s and s <= times
    assert len(seen[0] & seen[1]) > 0


def test_paper_scale_runs_and_spare_beats_replication():
    p = ClusterParams()
    sp = simulate("spare", 200, 9, 0, p)
    rep = simulate("replication", 200, 3, 0, p)
    assert sp.finished and rep.finished and sp.time_to_train_days < rep.time_to_train_days
    ck = simulate("checkpoint", 200, 1, 0, ClusterParams(max_days=3))
    assert not ck.finished and math.isinf(ck.time_to_train_days)  # restart-dominant: CKPT-only does not finish


def test_compare_is_paired_with_intervals():
    p = ClusterParams(**SMALL)
    res = compare(16, [0, 1, 2], p, r_max=3, rep_r_max=2)
    bs, br = res["best_spare"], res["best_replication"]
    gains = [1 - a / b for a, b in zip(bs["per_seed_days"], br["per_seed_days"])]
    assert res["gain_vs_replication"] == pytest.approx(np.mean(gains))
    lo, hi = res["gain_vs_replication_ci"]
    assert lo < res["gain_vs_replication"] < hi
    for row in res["rows"]:
        assert len(row["per_seed_days"]) == 3


def test_repair_delays_restarts_and_hot_spares_cover():
    base = dict(SMALL, repair_s=3600.0)
    none = simulate("checkpoint", 16, 1, 2, ClusterParams(**base))
    spares = simulate("checkpoint", 16, 1, 2, ClusterParams(**base, hot_spares=4))
    assert none.global_restarts > 0 and none.repair_wait_s > 0
    assert spares.repair_wait_s < none.repair_wait_s
    assert simulate("checkpoint", 16, 1, 2, ClusterParams(**SMALL)).repair_wait_s == 0


def test_domain_aware_placement_survives_rack_failures():
    # racks of 4 groups fail, GPUs never do: with copies in one rack (contiguous layout) every rack failure
    # wipes a type out; spread over racks, one rack failure never does
    kw = dict(total_gpus=64 * 8, gpu_mtbf_hours=1e12, gpus_per_domain=32, domain_mtbf_hours=16 * 6.0,
              base_steps=400, restart_s=600, checkpoint_s=30, stack_compute_s=10, model_params=4e9, max_days=20)
    aware = simulate("spare", 64, 2, 1, ClusterParams(**kw))
    naive = simulate("spare", 64, 2, 1, ClusterParams(**kw, domain_aware=False))
    assert naive.failures > 0 and naive.global_restarts >= 1
    assert aware.global_restarts < naive.global_restarts
    assert aware.masked_failures > naive.masked_failures


def test_bad_scheme_and_params():
    with pytest.raises(TrainguardError):
        simulate("raid", 16, 2)
    with pytest.raises(TrainguardError):
        simulate("spare", 10, 5)
    with pytest.raises(TrainguardError, match="restart_s"):
        simulate("spare", 16, 2, 0, ClusterParams(restart_s=-1))
    with pytest.raises(TrainguardError, match="renewal"):
        simulate("spare", 16, 2, 0, ClusterParams(renewal="sometimes"))


_ok, _why = simgrid_available()
_needs_simgrid = pytest.mark.skipif(not _ok, reason=f"SimGrid 3.32 Python binding not available: {_why}")
SG = dict(total_gpus=8 * 4, gpu_mtbf_hours=8 * 4 * 0.25, base_steps=120, restart_s=600, checkpoint_s=30,
          stack_compute_s=10, model_params=2e9, hop_latency_s=2e-6, max_days=5)


@_needs_simgrid
@pytest.mark.parametrize("scheme,r", [("spare", 3), ("checkpoint", 1)])
def test_simgrid_agrees_without_contention(scheme, r):
    # one rail pod: every all-reduce message crosses two links of 1 us, nothing shares a link -> alpha-beta
    p = ClusterParams(**SG)
    fast = simulate(scheme, 8, r, 3, p, max_steps=30, batch=False).as_dict()
    sg = simulate_in_subprocess(scheme, 8, r, 3, p, Platform(nodes_per_leaf=32, gpus_per_node=4), max_steps=30)
    assert sg["simgrid_transfers"] > 0
    for key in ("global_restarts", "masked_failures", "failures", "checkpoints", "steps_executed", "finished"):
        assert sg[key] == fast[key], key
    assert sg["time_to_train_days"] == pytest.approx(fast["time_to_train_days"], rel=1e-6)


@_needs_simgrid
def test_simgrid_contention_slows_the_run():
    p = ClusterParams(**SG)
    fast = simulate("spare", 8, 3, 3, p, max_steps=25, batch=False)
    plat = Platform(topology="fat-tree", nodes_per_leaf=1, oversubscription=4, gpus_per_node=4)
    sg = simulate_in_subprocess("spare", 8, 3, 3, p, plat, max_steps=25)
    assert sg["time_to_train_days"] > fast.time_to_train_days * 1.02


def test_a_trace_that_only_hits_a_dead_group_ends(tmp_path):
    # every failure of the (repeating) trace hits group 0: once it is down, nothing else can fail until a
    # restart, so the run must finish (it used to scan the endless trace for a relevant failure)
    path = tmp_path / "t.csv"
    path.write_text("time_s,group\n" + "\n".join(f"{600 * i + 300},0" for i in range(5)) + "\n")
    p = ClusterParams(**{**SMALL, "failure_model": "trace", "trace_path": str(path)})
    res = simulate("spare", 16, 3, 0, p)
    assert res.finished and res.failures == 1 and res.global_restarts == 0
    ck = simulate("checkpoint", 16, 1, 0, p)  # CKPT-only restarts at each failure and meets them all
    assert ck.failures > 1 and ck.global_restarts == ck.failures
