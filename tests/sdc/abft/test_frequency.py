"""Algorithm 1 (adaptive ABFT frequency): targets met, frequencies in [0, 1], monotone in the error
rate, and a small case checked by hand."""

import math

import pytest

from trainguard.errors import ConfigError
from trainguard.sdc.abft.frequency import PHI_TABLE, AttentionShape, coverage, optimize_frequencies, section_terms

TARGET = 1 - 1e-11


@pytest.mark.parametrize("rate", [1e-26, 2e-24, 1e-22, 1e-21, 1e-20, 1e-19])
def test_target_met_and_frequencies_valid(rate):
    p = optimize_frequencies(rate, TARGET)
    assert all(0.0 <= f <= 1.0 for f in p.frequencies.values())
    assert p.met and p.coverage >= TARGET
    assert p.coverage_unprotected <= p.coverage <= p.coverage_full


def test_no_checks_when_unprotected_already_meets_target():
    p = optimize_frequencies(1e-27, TARGET)
    assert p.coverage_unprotected >= TARGET and p.frequencies == {"AS": 0.0, "CL": 0.0, "O": 0.0}
    assert p.overhead_fraction == 0.0


def test_monotone_in_error_rate():
    rates = [1e-23, 3e-23, 1e-22, 3e-22, 1e-21, 1e-20]
    overheads = [optimize_frequencies(r, TARGET).overhead_fraction for r in rates]
    assert overheads == sorted(overheads) and overheads[-1] > overheads[0]


def test_greedy_checks_the_most_efficient_section_first():
    p = optimize_frequencies(1e-22, TARGET)
    first = p.order[0]
    assert p.fce[first] == max(p.fce.values())
    partial = [s for s in p.order if 0 < p.frequencies[s] < 1]
    assert len(partial) <= 1  # greedy: full sections, then at most one partial, then none
    if partial:
        i = p.order.index(partial[0])
        assert all(p.frequencies[s] == 1.0 for s in p.order[:i]) and all(p.frequencies[s] == 0.0 for s in p.order[i + 1:])


def test_hand_computed_section_terms():
    shape = AttentionShape(batch=1, seq=2, hidden=2, heads=1, layers=1)
    lam = 1e-3
    t = section_terms(shape, {"inf": lam, "nan": 0.0, "near-inf": 0.0}, PHI_TABLE["bert"])
    flops = shape.flops()  # O: 2*m*k*n with (m, k, n) = (2, 2, 2) -> 16 flops
    assert flops["output"] == 16
    r_free, one, harmful = t["O"]
    assert r_free == pytest.approx(math.exp(-lam * 16))
    assert one == pytest.approx(lam * 16 * r_free)
    assert harmful == pytest.approx(lam * 16 * r_free * 1.0)  # phi(INF in O) = 1 for BERT
    # FC_O at f = 1: no error or one (handled) error.
    fc_full = coverage({"AS": 1.0, "CL": 1.0, "O": 1.0}, {"O": t["O"]})
    assert fc_full == pytest.approx(r_free * (1 + lam * 16))


def test_bad_input():
    with pytest.raises(ConfigError):
        optimize_frequencies(1e-22, 1.5)
    with pytest.raises(ConfigError):
        optimize_frequencies(-1.0, TARGET)
    with pytest.raises(ConfigError):
        optimize_frequencies(1e-22, TARGET, model="t5")


def test_measured_probabilities_and_costs():
    measured = {e: {"q": 0.9, "k": 0.9, "v": 0.0, "scores": 0.0, "context": 0.0} for e in ("inf", "nan", "near-inf")}
    p = optimize_frequencies(1e-21, TARGET, phi=measured)  # output takes context's value
    assert p.met and p.frequencies["CL"] == 0.0 and p.frequencies["O"] == 0.0  # harmless there: never checked
    costs = {"AS": 4.0, "CL": 1.0, "O": 1.0}
    q = optimize_frequencies(1e-21, TARGET, section_cost=costs, attention_cost=50.0)
    assert q.met and q.overhead_fraction_full == pytest.approx(6.0 / 50.0)
    with pytest.raises(ConfigError):
        optimize_frequencies(1e-21, TARGET, phi={"inf": {"q": 2.0}})
    with pytest.raises(ConfigError):
        optimize_frequencies(1e-21, TARGET, section_cost=costs)  # no attention cost to relate them to
