"""A P-DMR segment's tail (``[sdc.dmr] pdmr_tail``): torch's checkpoint stops recomputing after the last tensor
autograd saved, so the recompute never replays a block's FFN down projection and residual add. With ``defer`` (the
default) the plan checks those ops where they ran, in a window or at once, and the recompute stops early as it does
without DMR; with ``recompute`` (the paper's P-DMR) the recompute replays the whole segment, its last ops included.

Windowed single-process trainer (``_windowed``): micro-batch 0's tails have a window after them (micro-batch 1
waits for its input), micro-batch 1's have none before the backward."""

import time

import pytest

from tests.sdc.dmr._spy import spy_mismatches
from tests.sdc.dmr._windowed import equal, params, trainer, windowed
from trainguard.faults import Fault, FaultModel, Injector, OpSite


def _transfer():
    return lambda: time.sleep(0.4)


def _planned(batches, executor="thread", **cfg):
    """A windowed trainer after its profiled first step (the plan is made from it). The window is 400 ms, not the
    harness's 100 ms: the planner fills 80% of it, and with micro-batch 0's checks and P-DMR fingerprints taking
    all of 80 ms, a loaded host's profile left its tails no room (no ``d-inter`` tail planned: seen once in the
    suite, on an AVX-512 host); 400 ms holds them at several times this host's profiled cost."""
    t = trainer(batches)
    eng = windowed(t, executor, transfer=_transfer, coverage=True, **cfg)
    assert t.train_step().attempts == 2  # profiled, then re-executed under the plan
    return t, eng


def _tail_mms(eng) -> list[tuple[int, str]]:
    """Each tail's matrix product: (its occurrence among the step's forward ``aten.mm`` ops, its strategy)."""
    mms = [o.id for o in eng.profile.ops if o.phase == "forward" and o.name == "aten.mm.default"]
    return [(mms.index(k), eng.plan.ops[k].strategy) for s in eng.plan.pdmr_segments for k in s.tail_ops if k in mms]


def _recomputed_unchecked_by_pdmr(eng) -> int:
    """Compute ops of the recompute that P-DMR did not compare (the coverage report lists only those)."""
    return sum(1 for row in eng.coverage if row[2] == "recompute" and row[0] != "-")


def test_the_recompute_stops_early_and_the_tails_are_checked_where_they_ran(batches, clean):
    t, eng = _planned(batches)
    assert eng.plan.pdmr_early_stop
    assert all(s.tail_ops and s.extra_run_s == 0 for s in eng.plan.pdmr_segments)
    tails = _tail_mms(eng)
    # one down projection per block and micro-batch; micro-batch 0's deferred into the window, micro-batch 1's at once
    assert len(tails) == len(eng.plan.pdmr_segments) and {s for _, s in tails} == {"d-inter", "naive"}
    for _ in range(2):
        t.train_step()
    # the recompute ran exactly the ops P-DMR compares: none of the tails (with early stop off it runs them too)
    assert eng.counts["p-dmr-checked"] == eng.counts["p-dmr"] == sum(len(s.ops) - len(s.tail_ops)
                                                                    for s in eng.plan.pdmr_segments)
    assert _recomputed_unchecked_by_pdmr(eng) == 0
    assert eng.totals["detected"] == 0 and eng.totals["stale"] == 0 and eng.coverage_report()["coverage"] == 1.0
    assert equal(params(t), clean)


@pytest.mark.parametrize("executor", ["thread", "stream"])
@pytest.mark.parametrize("strategy", ["d-inter", "naive"])
def test_a_bit_flip_in_a_tail_is_detected_and_rolled_back_bitwise(batches, clean, executor, strategy):
    t, eng = _planned(batches, executor)
    occurrence = next(k for k, s in _tail_mms(eng) if s == strategy)
    inj = Injector(Fault(OpSite("aten.mm.default", "forward", occurrence, compute_only=True),
                         FaultModel("bitflip", field="exponent"), step=1), seed=3).attach(t)
    attempts = [t.train_step().attempts for _ in range(2)]
    assert len(inj.records) == 1 and eng.totals["detected"] == 1 and attempts == [2, 1]
    assert equal(params(t), clean)


def test_the_papers_extra_run_replays_the_whole_segment(batches, clean):
    """``pdmr_tail = "recompute"``: no tails; the recompute replays every op of each segment and P-DMR compares them
    all, the down projection included, so a flip in it is found by its comparison with the recompute."""
    t, eng = _planned(batches, pdmr_tail="recompute")
    assert not eng.plan.pdmr_early_stop and not any(s.tail_ops for s in eng.plan.pdmr_segments)
    mms = [o.id for o in eng.profile.ops if o.phase == "forward" and o.name == "aten.mm.default"]
    last = [s.ops[-2] for s in eng.plan.pdmr_segments]  # (each block ends with its down projection, then the add)
    assert all(k in mms and eng.plan.ops[k].strategy == "p-dmr" for k in last)
    inj = Injector(Fault(OpSite("aten.mm.default", "forward", mms.index(last[0]), compute_only=True),
                         FaultModel("bitflip", field="exponent"), step=1), seed=3).attach(t)
    found = spy_mismatches(eng)
    attempts = [t.train_step().attempts for _ in range(2)]
    assert len(inj.records) == 1
    # Found by the P-DMR comparison of that down projection with its recompute: in the step (retried at once), or,
    # where the fingerprint of its forward output was left for a window that a loaded host did not give it, after
    # the update (the next step rewinds). Which of the two depends on wall time; the op and the comparison do not.
    assert (found[:1], attempts) in (([(last[0], "p-dmr")], [2, 1]), ([(last[0], "carried")], [1, 2])), (found,
                                                                                                           attempts)
    assert eng.counts["p-dmr-checked"] == sum(len(s.ops) for s in eng.plan.pdmr_segments)
    assert _recomputed_unchecked_by_pdmr(eng) == 0
    assert equal(params(t), clean)


@pytest.mark.parametrize("executor", ["thread", "stream"])
def test_faults_in_both_tails_and_the_backward_of_one_step_and_the_recompute_of_the_next(batches, clean, executor):
    """Several faults where they meet: a deferred tail, a tail checked at once and a backward op in the same step,
    then a fault in the next step's recompute. Each step is retried once and the run ends bitwise equal."""
    t, eng = _planned(batches, executor)
    tails = dict((s, k) for k, s in _tail_mms(eng))
    flip = FaultModel("bitflip", field="exponent")
    faults = [Fault(OpSite("aten.mm.default", "forward", tails["d-inter"], compute_only=True), flip, step=1),
              Fault(OpSite("aten.mm.default", "forward", tails["naive"], compute_only=True), flip, step=1),
              Fault(OpSite("*", "backward", 9, compute_only=True), flip, step=1),
              Fault(OpSite("*", "recompute", 4, compute_only=True), flip, step=2)]
    inj = Injector(faults, seed=4).attach(t)
    attempts = [t.train_step().attempts for _ in range(2)]  # (steps 1 and 2: step 0 was the profiled one)
    assert len(inj.records) == 4 and eng.totals["detected"] >= 4 and attempts == [2, 2], attempts
    assert eng.totals["stale"] == 0
    assert equal(params(t), clean)
