"""MeCeFO's gradient-sync policy and the baselines' (plans and recoveries, as the elastic strategy sees them), the
failure timeline built from the presets, and the cluster-throughput model."""

import dataclasses
import itertools
import math

import pytest

from trainguard.errors import ConfigError, TrainguardError
from trainguard.failover.mecefo.approx import MHA_GROUP, MeCeFOConfig
from trainguard.failover.mecefo.cluster import (
    ClusterAssumptions,
    StepCosts,
    _StepModel,
    checkpoint_period,
    cluster_throughput,
)
from trainguard.failover.mecefo.policy import (
    BambooPolicy,
    CheckpointRestartPolicy,
    GlobalRestart,
    MeCeFOPolicy,
    OobleckPolicy,
    ring_next,
    ring_prev,
)
from trainguard.failover.mecefo.timeline import Failure, FailureTimeline
from trainguard.models import build_model
from trainguard.models.config import model_config
from trainguard.train.parallel.elastic import StepView

NB = frozenset({"neighbor"})
PAPER = MeCeFOConfig(spread=1)  # the paper's single neighbor (spread has its own tests below)


def _view(live, step=0, replicas=4, k=2, failed=()):
    return StepView(step, frozenset(live), replicas, k, failed=frozenset(failed))


def _slices(plan, r, tagged=None):
    return [mb.index for mb in plan.work[r] if not mb.keep and (tagged is None or (("neighbor" in mb.tags) == tagged))]


def test_ring_neighbors():
    assert ring_next(1, [0, 2, 3], 4) == 2 and ring_next(3, [0, 1, 2], 4) == 0 and ring_next(2, [0, 1], 4) == 0
    assert ring_prev(2, [0, 2, 3], 4) == 0 and ring_prev(0, [0, 1, 3], 4) == 3 and ring_prev(1, [1], 4) == 1


def test_mecefo_without_failure_is_the_data_parallel_plan():
    plan = MeCeFOPolicy(PAPER).plan(_view(range(4)))
    assert {r: _slices(plan, r) for r in range(4)} == {r: [2 * r, 2 * r + 1] for r in range(4)}
    assert all(mb.weight == 1 / 8 and not mb.tags for mbs in plan.work.values() for mb in mbs)
    assert plan.group_weights == {} and plan.info["degraded_slices"] == 0


def test_the_neighbor_does_both_degraded_and_attention_is_averaged_over_the_exact_slices():
    pol = MeCeFOPolicy(PAPER)
    plan = pol.plan(_view({0, 2, 3}, failed={1}))  # worker 1 is gone: its neighbor in the ring is 2
    assert _slices(plan, 2, tagged=True) == [4, 5, 2, 3] and _slices(plan, 2, tagged=False) == []
    assert _slices(plan, 0, tagged=False) == [0, 1] and _slices(plan, 3, tagged=False) == [6, 7]
    assert sorted(plan.counted()) == list(range(8)) and set(plan.counted().values()) == {1 / 8}  # every slice, 1/n
    # attention: the groups that are neither failed nor neighbors (0 and 3): 4 slices, weight 1/4 each; 0 elsewhere
    assert plan.group_weights[MHA_GROUP] == {0: 0.25, 1: 0.25, 6: 0.25, 7: 0.25, 2: 0.0, 3: 0.0, 4: 0.0, 5: 0.0}
    assert plan.info["attention_slices"] == 4 and plan.info["neighbors"] == [2] and plan.info["hosts"] == {"1": 2}
    # a simulated failure (worker 3 in the quorum, but out at steps 5..6): its neighbor is 0 (the ring wraps)
    pol = MeCeFOPolicy(PAPER, timeline=FailureTimeline.of(Failure(3, 5, 7)))
    plan = pol.plan(_view(range(4), step=5))
    assert 3 not in plan.work and _slices(plan, 0, tagged=True) == [0, 1, 6, 7]
    assert pol.plan(_view(range(4), step=7)).group_weights == {}
    # skip-MHA off: nothing to weight apart; own slices exact when asked
    plan = MeCeFOPolicy(MeCeFOConfig(skip_mha=False, degrade_own=False, spread=1)).plan(_view({0, 2, 3}, failed={1}))
    assert plan.group_weights == {} and _slices(plan, 2, tagged=False) == [4, 5] and _slices(plan, 2, tagged=True) == [2, 3]


def test_when_every_worker_up_is_a_neighbor_their_own_slices_stay_exact():
    plan = MeCeFOPolicy(PAPER).plan(_view({1, 3}, failed={0, 2}))  # hosts: 1 (for 0) and 3 (for 2)
    assert _slices(plan, 1, tagged=False) == [2, 3] and _slices(plan, 1, tagged=True) == [0, 1]
    assert plan.group_weights[MHA_GROUP][2] == 0.25 and plan.info["attention_slices"] == 4
    with pytest.raises(TrainguardError, match="no worker is up"):
        MeCeFOPolicy(PAPER, timeline=FailureTimeline.of(Failure(0, 0, 2))).plan(_view({0}, replicas=2, k=1))


def test_a_worker_dying_mid_step_moves_its_slices_to_the_neighbor_and_recounts_attention():
    pol = MeCeFOPolicy(PAPER)
    plan = pol.plan(_view(range(4)))
    rec = pol.on_failure(_view({0, 1, 3}), frozenset({2}), plan)
    assert [(mb.index, mb.tags) for mb in rec.extra[3]] == [(4, NB), (5, NB)] and not rec.count and not rec.reweight
    # the neighbor's own slices were computed exactly before the failure: they count for the attention too
    assert rec.group_weights[MHA_GROUP] == {0: 1 / 6, 1: 1 / 6, 2: 1 / 6, 3: 1 / 6, 6: 1 / 6, 7: 1 / 6, 4: 0.0, 5: 0.0}
    assert rec.info["attention_slices"] == 6


def test_param_groups_name_the_attention_and_its_pre_norm():
    model = build_model(model_config("llama-tiny", dim=16, n_layers=2, n_heads=2, ffn_hidden=32), seed=0)
    groups = MeCeFOPolicy(PAPER).param_groups(model)
    assert sorted(groups) == [MHA_GROUP] and len(groups[MHA_GROUP]) == 2 * 5
    assert MeCeFOPolicy(MeCeFOConfig(skip_mha=False)).param_groups(model) == {}


def test_bamboo_computes_its_predecessors_work_and_counts_it_when_the_predecessor_dies():
    pol = BambooPolicy()
    plan = pol.plan(_view(range(4)))
    assert _slices(plan, 1) == [2, 3] and [mb.index for mb in plan.work[1] if mb.keep] == [0, 1]
    assert sorted(plan.counted()) == list(range(8))
    rec = pol.on_failure(_view({0, 2, 3}), frozenset({1}), plan)
    assert rec.count == {2: [2, 3]} and not rec.extra
    # worker 1 out for the next steps: 2 counts 1's slices and keeps a copy of its new predecessor's (0)
    plan = pol.plan(_view({0, 2, 3}, failed={1}))
    assert _slices(plan, 2) == [4, 5, 2, 3] and [mb.index for mb in plan.work[2] if mb.keep] == [0, 1]
    assert [mb.index for mb in plan.work[3] if mb.keep] == [4, 5, 2, 3]


def test_oobleck_rebalances_the_whole_batch_over_the_survivors():
    pol = OobleckPolicy()
    assert {r: _slices(pol.plan(_view(range(4))), r) for r in range(4)} == {r: [2 * r, 2 * r + 1] for r in range(4)}
    plan = pol.plan(_view({0, 2, 3}, failed={1}))
    assert [len(plan.work[r]) for r in (0, 2, 3)] == [3, 3, 2] and sorted(plan.counted()) == list(range(8))
    rec = pol.on_failure(_view({0, 1, 3}), frozenset({2}), pol.plan(_view(range(4))))
    assert sorted(mb.index for mbs in rec.extra.values() for mb in mbs) == [4, 5]
    assert {r: len(m) for r, m in rec.extra.items()} == {0: 1, 1: 1}


def test_checkpoint_restart_answers_every_failure_with_a_global_restart():
    pol = CheckpointRestartPolicy(FailureTimeline.of(Failure(2, 3, 5)))
    assert sorted(pol.plan(_view(range(4), step=2)).counted()) == list(range(8))
    with pytest.raises(GlobalRestart, match=r"\[2\] failed at step 3"):
        pol.plan(_view(range(4), step=3))
    with pytest.raises(GlobalRestart):
        pol.plan(_view({0, 1, 3}, step=1))
    with pytest.raises(GlobalRestart):
        pol.on_failure(_view({0, 1, 3}), frozenset({2}), pol.plan(_view(range(4))))


def test_failure_timeline_from_a_preset():
    tl = FailureTimeline.from_preset("high", nodes=4, steps=100, hours=10.0, recovery_min=10.0, seed=0, real=2)
    again = FailureTimeline.from_preset("high", nodes=4, steps=100, hours=10.0, recovery_min=10.0, seed=0, real=2)
    assert tl.failures == again.failures  # a pure function of its arguments
    assert 10 <= len(tl.failures) + tl.absorbed <= 35  # ~20 failures in 10 h at one every 0.5 h
    assert tl.step_s == 360.0 and all(f.until - f.step == 2 for f in tl.failures)  # 10 min = 2 steps of 6 min
    assert sum(f.real for f in tl.failures) == 2 and all(f.step >= 1 for f in tl.real())
    for s in range(100):  # never a worker twice, never everyone
        out = [f.node for f in tl.failures if f.covers(s)]
        assert len(out) == len(set(out)) < 4
    assert tl.down(tl.real()[0].step) == frozenset(f.node for f in tl.simulated() if f.covers(tl.real()[0].step))
    low = FailureTimeline.from_preset("low", nodes=4, steps=100, hours=10.0, recovery_min=10.0)
    assert len(low.failures) < len(tl.failures)
    assert FailureTimeline.from_preset("none", 4, 100, 10.0, 10.0).failures == ()
    with pytest.raises(TrainguardError, match="unknown failure preset"):
        FailureTimeline.from_preset("often", 4, 10, 1.0, 1.0)


COSTS = StepCosts(normal=1.0, neighbor=1.4, bamboo=2.0, bamboo_cover=3.0, optimizer=0.05, rebalanced={5: 1.25},
                  batch=4, svd_s=0.5, tau=200)


def test_cluster_model_without_failures_and_its_orderings():
    none = cluster_throughput(COSTS, "none", ClusterAssumptions(horizon_h=50), tokens_per_worker_step=1000)
    assert none["modelled"] is True
    for m in ("mecefo", "bamboo", "oobleck", "checkpoint_restart"):
        assert none[m]["throughput_drop"] == pytest.approx(0.0, abs=1e-12)
    assert none["mecefo"]["tokens_per_s_no_failure"] == pytest.approx(32 * 1000 / 1.0)
    assert none["bamboo"]["tokens_per_s_no_failure"] == pytest.approx(32 * 1000 / 2.0)
    drops = {p: cluster_throughput(COSTS, p, ClusterAssumptions(horizon_h=200), 1000) for p in ("low", "mid", "high")}
    for m in ("mecefo", "bamboo", "oobleck", "checkpoint_restart"):
        assert 0 < drops["low"][m]["throughput_drop"] < drops["mid"][m]["throughput_drop"] < drops["high"][m]["throughput_drop"] < 1
    high = drops["high"]
    # with a worker out, MeCeFO's step is the neighbor's: the time with a worker out times (1 - normal/neighbor)
    frac = high["mecefo"]["time_with_a_worker_out"]
    assert high["mecefo"]["throughput_drop"] == pytest.approx(frac * (1 - 1 / 1.4), rel=0.15)
    quick = cluster_throughput(COSTS, "high", ClusterAssumptions(horizon_h=200, recovery_min=1), 1000)
    assert quick["mecefo"]["throughput_drop"] < high["mecefo"]["throughput_drop"]


def test_checkpoint_period_is_the_availability_optimal_one():
    assert checkpoint_period(30.0, 1800.0, 300.0) == pytest.approx(30 + math.sqrt(2 * 30 * 2100 + 900))
    assert checkpoint_period(0.0, 1800.0, 300.0) == math.inf
    with pytest.raises(TrainguardError, match="workers"):
        ClusterAssumptions(workers=1).validate()


# --------------------------------------------------------------------------------------------------
# spread: an out worker's micro-batches over several ring neighbors


def _paper_plan(live_up, replicas, k):
    """The paper's plan, written out independently: every out worker's slices to the next worker up, which runs
    its own degraded too unless every worker up is a neighbor."""
    out = [d for d in range(replicas) if d not in live_up]
    host = {d: min(live_up, key=lambda r: ((r - d) % replicas, r)) for d in out}
    degrade_own = bool(set(live_up) - set(host.values()))
    work = {r: [(r * k + m, r in host.values() and degrade_own) for m in range(k)] for r in sorted(live_up)}
    for d in out:
        work[host[d]] += [(d * k + m, True) for m in range(k)]
    return work


def _up_sets(replicas):
    return [frozenset(c) for n in range(1, replicas + 1) for c in itertools.combinations(range(replicas), n)]


def _check_partition_and_attention(work, weights, n, skip_mha=True):
    counted = [mb for mbs in work.values() for mb in mbs if not mb.keep]
    assert sorted(mb.index for mb in counted) == list(range(n))  # every slice once: none lost, none twice
    assert all(mb.weight == 1 / n for mb in counted)
    degraded = {mb.index for mb in counted if NEIGHBOR_TAG in mb.tags}
    exact = {mb.index for mb in counted} - degraded
    if degraded and skip_mha:
        assert exact, "nobody computes the attention gradient"
        assert {t for t, w in weights.items() if w > 0} == exact and {t for t, w in weights.items() if w == 0} == degraded
        assert all(weights[t] == pytest.approx(1 / len(exact)) for t in exact)  # the mean over the exact slices
    else:
        assert not weights


NEIGHBOR_TAG = "neighbor"


def test_spread_one_reproduces_the_papers_plans():
    for replicas, k in [(2, 1), (3, 2), (4, 1), (4, 4), (5, 3)]:
        for up in _up_sets(replicas):
            plan = MeCeFOPolicy(PAPER).plan(_view(range(replicas), replicas=replicas, k=k)) if len(up) == replicas \
                else MeCeFOPolicy(PAPER).plan(_view(up, replicas=replicas, k=k))
            got = {r: [(mb.index, NEIGHBOR_TAG in mb.tags) for mb in mbs] for r, mbs in plan.work.items()}
            assert got == _paper_plan(sorted(up), replicas, k), (replicas, k, sorted(up))
            assert plan.info["spread"] == 1


@pytest.mark.parametrize("spread", [1, 2, 3, 4, 5, "auto"])
def test_spread_plans_and_mid_step_kills_partition_the_global_batch_and_count_attention_exactly(spread):
    checked = 0
    for replicas, k in [(2, 2), (3, 3), (4, 4), (4, 1), (5, 2), (6, 4)]:
        pol = MeCeFOPolicy(MeCeFOConfig(spread=spread))
        n = replicas * k
        for up in _up_sets(replicas):
            plan = pol.plan(_view(up, replicas=replicas, k=k))
            _check_partition_and_attention(plan.work, plan.group_weights.get(MHA_GROUP, {}), n)
            assert set(plan.work) == set(up) and plan.info["degraded_slices"] == sum(
                NEIGHBOR_TAG in mb.tags for mbs in plan.work.values() for mb in mbs)
            # a neighbor carries at most ceil(k / spread) of each out worker's slices
            if spread != "auto":
                for d, hosts in plan.info["spread_hosts"].items():
                    assert len(hosts) == min(spread, k, len(up)) and int(d) not in hosts and set(hosts) <= up
            # every non-empty set of the workers up killed mid-step (one survivor at least)
            for dead in _up_sets(replicas):
                if not dead <= up or dead == up:
                    continue
                rec = pol.on_failure(_view(up - dead, replicas=replicas, k=k), dead, plan)
                assert set(rec.extra) <= up - dead
                after = {r: [mb for mb in plan.work.get(r, []) if not mb.keep] + rec.extra.get(r, [])
                         for r in up - dead}
                weights = dict(plan.group_weights.get(MHA_GROUP, {}))
                weights.update(rec.group_weights.get(MHA_GROUP, {}))
                weights = {t: w for t, w in weights.items() if t in {mb.index for mbs in after.values() for mb in mbs}}
                _check_partition_and_attention(after, weights if rec.group_weights or plan.group_weights else {}, n)
                checked += 1
    assert checked > 100


def test_spread_wraps_the_ring_and_skips_failed_neighbors():
    # 4 workers x 4 micro-batches; 2 and 3 out: the next two workers up after each are 0 and 1 (the ring wraps)
    plan = MeCeFOPolicy(MeCeFOConfig(spread=2)).plan(_view({0, 1}, k=4))
    assert plan.info["spread_hosts"] == {"2": [0, 1], "3": [0, 1]} and plan.info["hosts"] == {"2": 0, "3": 0}
    assert _slices(plan, 0, tagged=True) == [8, 10, 12, 14] and _slices(plan, 1, tagged=True) == [9, 11, 13, 15]
    # both up workers are neighbors: their own slices stay exact, the attention is their mean
    assert _slices(plan, 0, tagged=False) == [0, 1, 2, 3] and plan.info["attention_slices"] == 8
    # worker 1 out, spread 4 over 3 workers up: capped at 3; everyone up is a neighbor, so own slices exact
    plan = MeCeFOPolicy(MeCeFOConfig(spread=4)).plan(_view({0, 2, 3}, k=4))
    assert plan.info["spread"] == 3 and plan.info["spread_hosts"] == {"1": [2, 3, 0]}
    assert _slices(plan, 2, tagged=True) == [4, 7] and _slices(plan, 3, tagged=True) == [5] and _slices(plan, 0, tagged=True) == [6]


def test_auto_spread_is_the_fewest_neighbors_no_slower_than_a_normal_worker():
    # 32 workers x 4 micro-batches, one out: a neighbor carrying e extra runs (4 + e) degraded micro-batches
    def k(cost, up=frozenset(range(32)) - {5}, replicas=32, spread="auto"):
        return MeCeFOPolicy(MeCeFOConfig(spread=spread, degraded_cost=cost)).plan(_view(up, replicas=replicas, k=4)).info["spread"]

    assert k(0.5) == 1  # 8 x 0.5 = 4: the single neighbor is not slower
    assert k(0.6) == 2  # 6 x 0.6 = 3.6 <= 4, 8 x 0.6 > 4
    assert k(0.75) == 4  # 5 x 0.75 <= 4 needs one extra each
    assert k(0.95) == 4  # never fast enough: the most it may spread
    # 4 workers, one out: capped so that one worker up is nobody's neighbor (it computes the attention gradient)
    assert k(0.75, up=frozenset({0, 2, 3}), replicas=4) == 2
    # 3 and 5 out of 6: spread 3 would make every worker up a neighbor, so auto stops at 2 (worker 2 stays free)
    plan = MeCeFOPolicy(MeCeFOConfig(spread="auto")).plan(_view({0, 1, 2, 4}, replicas=6, k=4))
    assert plan.info["spread"] == 2 and plan.info["neighbors"] == [0, 1, 4] and plan.info["attention_slices"] == 4
    with pytest.raises(ConfigError, match="spread"):
        MeCeFOConfig(spread=0).validate()
    with pytest.raises(ConfigError, match="spread"):
        MeCeFOConfig(spread="many").validate()
    assert MeCeFOConfig(spread="3").validate().spread == 3


def test_a_mid_step_kill_that_would_leave_no_exact_slice_is_recomputed_exactly():
    # 4 x 2: 1 out, auto spreads over 2 and 3; 0 is the only exact worker; it dies mid-step: its slices are
    # computed exactly (by its ring successor: with two workers left, auto keeps one of them free) so the
    # attention still has slices to average over
    pol = MeCeFOPolicy(MeCeFOConfig(spread="auto"))
    plan = pol.plan(_view({0, 2, 3}, k=2))
    assert plan.info["neighbors"] == [2, 3] and _slices(plan, 0, tagged=False) == [0, 1]
    rec = pol.on_failure(_view({2, 3}, k=2), frozenset({0}), plan)
    assert {r: [(mb.index, mb.tags) for mb in mbs] for r, mbs in rec.extra.items()} == {2: [(0, frozenset()), (1, frozenset())]}
    assert rec.group_weights[MHA_GROUP][0] == rec.group_weights[MHA_GROUP][1] == 0.5 and rec.info["attention_slices"] == 2


def test_cluster_model_spreads_the_load_as_the_policy_and_says_which_loads_were_measured():
    costs = dataclasses.replace(COSTS, parts=4, neighbor_extra={1: 0.98, 2: 1.1, 3: 1.25}, spread=1)
    a = ClusterAssumptions(horizon_h=200)
    single = cluster_throughput(costs, "high", a, 1000)
    auto = cluster_throughput(dataclasses.replace(costs, spread="auto"), "high", a, 1000)
    two = cluster_throughput(dataclasses.replace(costs, spread=2), "high", a, 1000)
    frac = single["mecefo"]["time_with_a_worker_out"]
    # the fixed costs per failure and rejoin (detection, healing) come on top of the slower steps
    fixed = (a.detect_s + a.heal_s) * auto["mecefo"]["failures_applied"] / (a.horizon_h * 3600)
    svd = 0.5 / 200
    assert single["mecefo"]["throughput_drop"] == pytest.approx(frac * (1 - 1 / (1.4 + svd)) + fixed, rel=0.1)
    assert two["mecefo"]["throughput_drop"] == pytest.approx(frac * (1 - 1 / (1.1 + svd)) + fixed, rel=0.1)
    # auto: 4 neighbors carry one micro-batch each, measured no slower than a normal step: only the fixed costs
    # and the SVD refresh are left
    assert auto["mecefo"]["throughput_drop"] < single["mecefo"]["throughput_drop"] / 5
    assert auto["mecefo"]["throughput_drop"] == pytest.approx(frac * (1 - 1 / (1.0 + svd)) + fixed, rel=0.1)
    assert not any("carrying 1/4" in e for e in auto["extrapolated"])  # measured, not composed
    assert not any("carrying 4/4" in e for e in single["extrapolated"])
    # a load that was not measured (two out workers' micro-batches on one neighbor) is composed and said so
    model = _StepModel(dataclasses.replace(costs, spread=1), 4, 0.0)
    t = model("mecefo", frozenset({1, 2}))
    assert t == pytest.approx(0.05 + (12 * (1.4 - 0.05) / 2) / 4 + 0.5 / 200)
    assert model.extrapolated == {"mecefo neighbor carrying 8/4 of a share"}
    # spread 2 with 1 out of 4: 2 and 3 carry 2 each, measured
    model = _StepModel(dataclasses.replace(costs, spread=2), 4, 0.0)
    assert model("mecefo", frozenset({1})) == pytest.approx(1.1 + 0.5 / 200) and not model.extrapolated
