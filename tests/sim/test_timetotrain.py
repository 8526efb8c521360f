"""Time-to-train loop: failure-free baselines are exact, failures are masked, SimGrid agrees."""

import pytest

from trainguard.errors import TrainguardError
from trainguard.sim.simgrid_model import run_in_subprocess, simgrid_available
from trainguard.sim.timetotrain import ClusterParams, compare, simulate

QUIET = dict(gpu_mtbf_hours=1e12, jitter=0.0, base_steps=200)
SMALL = dict(total_gpus=16 * 8, gpu_mtbf_hours=8 * 16 * 0.25, base_steps=120, restart_s=600, checkpoint_s=30,
             stack_compute_s=10, allreduce_per_group_s=0.2, max_days=5)


@pytest.mark.parametrize("scheme,r,stacks", [("checkpoint", 1, 1), ("spare", 9, 1), ("replication", 2, 2)])
def test_failure_free_is_exact(scheme, r, stacks):
    p = ClusterParams(**QUIET)
    res = simulate(scheme, 200, r, 0, p)
    tc, ta = p.stack_compute_s, p.allreduce_s(200)
    assert res.finished and res.global_restarts == 0 and res.failures == 0
    assert res.mean_stacks_per_step == stacks
    assert res.time_to_train_days * 86400 == pytest.approx(200 * (stacks * tc + ta), rel=1e-9)
    assert res.availability == pytest.approx(1.0)


def test_failures_masked_and_deterministic():
    p = ClusterParams(**SMALL)
    a = simulate("spare", 16, 3, 4, p)
    b = simulate("spare", 16, 3, 4, p)
    assert a.as_dict() == b.as_dict()
    assert a.finished and a.masked_failures > 0
    ck = simulate("checkpoint", 16, 1, 4, p)
    assert ck.global_restarts > a.global_restarts
    assert 0 < a.availability < 1 and a.mean_stacks_per_step > 1


def test_paper_scale_runs_and_spare_beats_replication():
    res = compare(200, [0], ClusterParams(), r_max=9, rep_r_max=4)
    assert res["best_spare"]["time_to_train_days"] < res["best_replication"]["time_to_train_days"]
    assert not res["checkpoint_only"]["finished"]  # restart-dominant: CKPT-only does not finish


def test_bad_scheme():
    with pytest.raises(TrainguardError):
        simulate("raid", 16, 2)
    with pytest.raises(TrainguardError):
        simulate("spare", 10, 5)


_ok, _why = simgrid_available()


@pytest.mark.skipif(not _ok, reason=f"SimGrid 3.32 Python binding not importable: {_why}")
@pytest.mark.parametrize("scheme,r", [("spare", 3), ("replication", 2), ("checkpoint", 1)])
def test_simgrid_cross_check(scheme, r):
    p = ClusterParams(**SMALL)
    fast = simulate(scheme, 16, r, 3, p, max_steps=60).as_dict()
    sg = run_in_subprocess(scheme, 16, r, 3, p, max_steps=60)
    assert sg["simgrid_activities"] > 0
    for key in ("global_restarts", "masked_failures", "failures", "checkpoints", "steps_executed", "finished"):
        assert sg[key] == fast[key], key
    assert sg["time_to_train_days"] == pytest.approx(fast["time_to_train_days"], rel=1e-9)
    assert sg["availability"] == pytest.approx(fast["availability"], rel=1e-9)
