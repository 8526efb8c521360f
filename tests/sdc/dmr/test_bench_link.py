"""The bench's emulated link: held at the target idle share through the timed rounds while the host's speed
drifts (``trainguard.sdc.dmr.bench.held_delay``), on a model of a pipeline step."""

from __future__ import annotations

import random

import pytest

from trainguard.sdc.dmr.bench import CALIBRATION_TOLERANCE, HOLD_MAX_FACTOR, _rescaled_delay, held_delay, paired_by_round

WAITS = 6  # transfers a step waits on


def idle_share(delay: float, compute_s: float) -> float:
    """A step that computes ``compute_s`` and waits ``WAITS`` transfers of ``delay`` each, less the part of each
    delay the other stage's compute hides (a tenth of the compute, per wait)."""
    waited = WAITS * max(0.0, delay - 0.1 * compute_s / WAITS)
    return waited / (compute_s + waited)


def test_a_round_at_the_target_keeps_the_link():
    assert held_delay(0.8, 0.68, 0.68) == 0.8
    assert held_delay(0.8, 0.68 + CALIBRATION_TOLERANCE * 0.9, 0.68) == 0.8


@pytest.mark.parametrize("idle", [0.60, 0.64, 0.72, 0.76])
def test_a_round_off_the_target_moves_the_link_half_way_towards_it(idle):
    delay = 0.8
    full = _rescaled_delay(delay, idle, 0.68)
    new = held_delay(delay, idle, 0.68)
    assert (full > delay) == (idle < 0.68)  # more delay where the step idled too little
    assert new == pytest.approx((delay * full) ** 0.5)  # half the correction, on a log scale
    assert min(delay, full) < new < max(delay, full)


@pytest.mark.parametrize("idle", [0.0, 1e-6, 0.05, 0.99, 1.0])
def test_one_wild_round_moves_the_link_by_at_most_the_bound(idle):
    """A round that read an idle share near 0 or 1 (a stalled peer, a paused host) moves the link by at most
    ``HOLD_MAX_FACTOR``, in the direction it asks for; unbounded, an idle share of 0 multiplied it by ~46,000."""
    delay = 0.8
    got = held_delay(delay, idle, 0.68)
    assert delay / HOLD_MAX_FACTOR - 1e-12 <= got <= delay * HOLD_MAX_FACTOR + 1e-12
    assert (got > delay) if idle < 0.68 else (got < delay)
    if idle in (0.0, 1.0):
        assert got == pytest.approx(delay * HOLD_MAX_FACTOR if idle == 0.0 else delay / HOLD_MAX_FACTOR)


def test_the_held_link_keeps_a_drifting_host_at_the_target():
    """Compute time drifts by up to 7% between rounds and each round's measurement is noisy (+-0.01): the link
    held round by round stays near the target, where the link calibrated once follows the drift."""
    rng = random.Random(4)
    target, compute = 0.68, 1.8
    # the warm-up's calibration: the delay that gives the target on the warm-up's host
    delay = 0.5
    for _ in range(40):
        delay = _rescaled_delay(delay, idle_share(delay, compute), target)
    assert idle_share(delay, compute) == pytest.approx(target, abs=1e-6)
    fixed, held = delay, delay
    fixed_off, held_off = [], []
    for _ in range(12):  # rounds: the host drifts (a slow trend and a random walk), then the round is measured
        compute *= 1.02 + rng.uniform(-0.05, 0.05)
        fixed_off.append(abs(idle_share(fixed, compute) - target))
        true = idle_share(held, compute)
        held_off.append(abs(true - target))
        held = held_delay(held, true + rng.uniform(-0.01, 0.01), target)
    assert max(fixed_off[4:]) > 0.05  # calibrated once: the drift takes the rounds away from the target
    assert sum(held_off) / len(held_off) < 0.5 * sum(fixed_off) / len(fixed_off)
    assert max(held_off[4:]) < 0.03


def test_round_by_round_figures_pair_the_systems_of_each_round():
    """The second round ran on a host twice as slow: each round's figures come from that round's own steps (the run's
    pooled medians would mix the two speeds), and the worst round of each is reported."""
    r0 = {"none": {"step_s_by_round": [1.0, 2.0]}, "sparetrain": {"step_s_by_round": [1.1, 2.4]},
          "naive": {"step_s_by_round": [1.5, 3.0]}}
    got = paired_by_round(r0)
    assert got["by_round"]["overhead_vs_no_dmr"] == pytest.approx([0.1, 0.2])
    assert got["by_round"]["gain_vs_naive"] == pytest.approx([1.5 / 1.1 - 1, 3.0 / 2.4 - 1])
    assert got["overhead_vs_no_dmr_worst_round"] == pytest.approx(0.2)
    assert got["gain_vs_naive_worst_round"] == pytest.approx(0.25)
    assert paired_by_round({"none": {"step_s_by_round": [1.0]}}) == {}  # (a system missing: nothing to pair)
