"""Closed forms: replica pairs, Thm 4.1 forms, stack bound, checkpoint period optimality."""

import math

import numpy as np
import pytest

from trainguard.errors import TrainguardError
from trainguard.sim import theory
from trainguard.sim.checkpoint_period import availability, optimal_period, plan_checkpoint, young_period


@pytest.mark.parametrize("b", [1, 2, 3, 10, 50, 100])
def test_replica_pairs_formula(b):
    assert theory.mean_failures_replication(2 * b, 2) == pytest.approx(theory.replica_pairs_mnfti(b), rel=1e-9)
    assert theory.replica_pairs_mnfti(b) == pytest.approx(4**b / math.comb(2 * b, b), rel=1e-9)


def test_replication_exact_by_enumeration():
    # N = 6, r = 3: two sets of 3; average over all failure orders of the index of the first whole-set loss
    import itertools

    sets = [0, 0, 0, 1, 1, 1]
    tot = cnt = 0
    for perm in itertools.permutations(range(6)):
        dead = [0, 0]
        for k, g in enumerate(perm):
            dead[sets[g]] += 1
            if dead[sets[g]] == 3:
                tot += k + 1
                cnt += 1
                break
    assert theory.mean_failures_replication(6, 3) == pytest.approx(tot / cnt)
    assert theory.replication_stacks(200, 3) == pytest.approx(200 / 66)


def test_thm41_forms():
    assert theory.mean_failures_asymptotic(200, 2) == pytest.approx(math.gamma(1.5) * math.sqrt(200))
    for n, r in [(200, 5), (600, 8), (1000, 12)]:
        a, p = theory.mean_failures_asymptotic(n, r), theory.mean_failures_poisson(n, r)
        assert abs(a - p) / p < 0.03  # the Gamma form is the continuum limit of the Poisson sum
    s = theory.survival_poisson(100, 3)
    assert s[0] == 1.0 and s[-1] == 0.0 and (np.diff(s) <= 1e-15).all()


def test_stack_bound_and_patch():
    assert list(theory.stack_lower_bound(10, np.arange(10))) == [1, 2, 2, 2, 2, 2, 3, 4, 5, 10]
    assert theory.patch_probability(100, 0) == 1.0
    assert theory.patch_probability(100, 10) == pytest.approx(10 / 90)
    lb = theory.allreduce_stack_lower_bound(200, 9)
    assert 2.0 < lb < 2.2
    assert theory.mean_overhead(200, 9) > lb
    with pytest.raises(TrainguardError):
        theory.allreduce_stack_lower_bound(200, 9, "nope")


def test_thm43():
    assert theory.optimal_redundancy_formula(200) == pytest.approx((math.log(200) + theory.EULER_GAMMA) / math.log(2))
    assert theory.optimal_redundancy_transition(200) == 9
    assert theory.optimal_redundancy_transition(1000) == 11


def test_checkpoint_period_is_optimal_and_tends_to_young():
    for d, M, R in [(60, 3600, 1800), (30, 86400, 600), (300, 20000, 3000)]:
        T = optimal_period(d, M, R)
        A = availability(T, d, M, R)
        for f in (0.8, 0.95, 1.05, 1.25):
            assert availability(T * f, d, M, R) <= A + 1e-15
    assert optimal_period(1, 1e9, 10) / young_period(1, 1e9) == pytest.approx(1.0, rel=1e-3)
    plan = plan_checkpoint(60, 3600, 1800)
    assert plan.availability >= plan.availability_at_young
    with pytest.raises(TrainguardError):
        optimal_period(0, 10, 10)


def _replication_by_enumeration(n, r):
    import itertools

    sizes = theory.replica_set_sizes(n, r)
    sets = [i for i, m in enumerate(sizes) for _ in range(m)]
    tot = cnt = 0
    for perm in itertools.permutations(range(n)):
        dead = [0] * len(sizes)
        for k, g in enumerate(perm):
            dead[sets[g]] += 1
            if dead[sets[g]] == sizes[sets[g]]:
                tot += k + 1
                cnt += 1
                break
    return tot / cnt


@pytest.mark.parametrize("n,r", [(5, 2), (6, 4), (7, 3), (7, 5), (8, 3)])
def test_replication_mean_closed_form_by_enumeration(n, r):
    # uneven set sizes included (extra groups dealt round-robin; sizes sum to N)
    assert sum(theory.replica_set_sizes(n, r)) == n
    assert theory.mean_failures_replication(n, r) == pytest.approx(_replication_by_enumeration(n, r), rel=1e-9)


@pytest.mark.parametrize("n,r", [(31, 8), (200, 3), (203, 4), (600, 5), (1000, 8)])
def test_replication_mean_matches_exact_survival(n, r):
    assert theory.mean_failures_replication(n, r) == pytest.approx(float(theory.survival_replication(n, r).sum()),
                                                                   rel=1e-8)


def test_theory_scales_to_hundreds_of_thousands_of_gpus():
    # 200,000 GPUs in groups of 8: the polynomial form underflows there, the integral does not
    n = 25_000
    rep = [theory.mean_failures_replication(n, r) for r in range(2, 9)]
    assert all(math.isfinite(x) and x > 0 for x in rep) and rep == sorted(rep)
    assert theory.mean_failures_replication(n, 2) == pytest.approx(theory.replica_pairs_mnfti(n // 2), rel=1e-9)
    row = theory.scheme_theory("spare", n, 28, 60.0, 60.0, 1800.0)
    assert row["system_mtbf_s"] > 0 and 0 < row["availability"] < 1
