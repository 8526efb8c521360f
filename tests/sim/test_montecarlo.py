"""Monte-Carlo through the real controller agrees with Thm 4.1/4.2 and is reproducible."""

import pytest

from trainguard.errors import TrainguardError
from trainguard.sim.montecarlo import run_montecarlo


def test_montecarlo_matches_theory_small():
    res = run_montecarlo(100, 4, trials=150, seed=3, workers=1)
    # within 4 standard errors of the Poisson form, and close to the Gamma form
    assert abs(res.mean_failures_to_wipeout - res.theory_failures_poisson) < 4 * res.stderr_failures_to_wipeout + 0.5
    assert abs(res.rel_error_vs_theory) < 0.1
    assert abs(res.abs_error_allreduce_stack) < 0.03
    assert res.mean_stacks_with_patch >= res.mean_allreduce_stack
    assert 0 < res.patch_rate <= 1 and res.max_allreduce_stack_seen >= 2


def test_montecarlo_reproducible_and_worker_independent():
    a = run_montecarlo(31, 3, trials=24, seed=5, workers=1)
    b = run_montecarlo(31, 3, trials=24, seed=5, workers=2, show_progress=False)
    assert a.as_dict() == b.as_dict()
    c = run_montecarlo(31, 3, trials=24, seed=6, workers=1)
    assert c.mean_failures_to_wipeout != a.mean_failures_to_wipeout or c.mean_allreduce_stack != a.mean_allreduce_stack


def test_montecarlo_bad_input():
    with pytest.raises(TrainguardError):
        run_montecarlo(10, 5, trials=3)
    with pytest.raises(TrainguardError):
        run_montecarlo(31, 3, trials=0)
