"""The DMR engine: every compute op verified by exactly one strategy; a fault injected into any phase is
detected and the iteration re-executed to the fault-free parameters, bitwise; clean runs raise no alarm."""

import pytest
import torch

from trainguard.data import PackedBatches
from trainguard.errors import SuspectedHardwareFault
from trainguard.faults import Fault, FaultModel, Injector, OpSite
from trainguard.sdc.dmr.config import DMRConfig
from trainguard.sdc.dmr.engine import attach
from trainguard.train import StepGuard, Trainer, TrainerConfig, Verdict

SMALL = ["--model.dim", "32", "--model.n_heads", "2", "--model.ffn_hidden", "64", "--train.steps", "3",
         "--data.max_bytes", "300000", "--data.seq_len", "16", "--data.batch_size", "4", "--train.eval_every", "0",
         "--output.dir", "", "--output.progress", "false"]


def tiny_cfg(*extra):
    return TrainerConfig.load(None, SMALL + list(extra))


@pytest.fixture(scope="module")
def batches():
    return PackedBatches.from_config(tiny_cfg().data)


def _trainer(batches, *extra):
    return Trainer(tiny_cfg(*extra), batches=batches)


def _params(t):
    return t.state_dict_for_compare()


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def clean(batches):
    t = _trainer(batches, "--train.activation_checkpoint", "full")
    for _ in range(3):
        t.train_step()
    return _params(t)


@pytest.mark.parametrize("system, ac, moe", [("naive", "none", False), ("sparetrain", "full", False),
                                             ("sparetrain", "selective", True), ("naive", "full", True)])
def test_clean_runs_verify_every_compute_op_once_and_raise_no_alarm(batches, system, ac, moe):
    extra = ["--model.n_experts", "4", "--model.top_k", "2"] if moe else []
    t = _trainer(batches, "--train.activation_checkpoint", ac, "--train.selective_ops", "attention,ffn", *extra)
    eng = attach(t, DMRConfig(enabled=True, system=system, coverage=True))
    results = [t.train_step() for _ in range(2)]
    assert [r.attempts for r in results] == [1, 1] and eng.totals["detected"] == 0
    report = eng.coverage_report()
    assert report["coverage"] == 1.0 and report["compute_ops"] > 50
    ids = [o["op"] for o in report["ops"] if o["op"] != "-"]
    assert len(ids) == len(set(ids))  # exactly one strategy per op
    if ac != "none" and system == "sparetrain":
        assert report["by_strategy"]["p-dmr"] > 0 and eng.counts["p-dmr-checked"] == eng.counts["p-dmr"]
    assert report["by_strategy"]["optimizer"] >= len(t.optimizer.param_groups)  # fused updates (+ foreach ops)


def test_coverage_with_abft_protected_attention(batches):
    from trainguard.sdc.abft import protect

    t = _trainer(batches, "--train.activation_checkpoint", "full")
    protect(t.model)
    eng = attach(t, DMRConfig(enabled=True, coverage=True))
    assert t.train_step().attempts == 1
    assert eng.coverage_report()["coverage"] == 1.0 and eng.totals["detected"] == 0


@pytest.mark.parametrize("phase, occurrence", [("forward", 7), ("recompute", 11), ("backward", 23), ("optimizer", 1)])
def test_a_bit_flip_in_each_phase_is_detected_and_rolled_back_bitwise(batches, clean, phase, occurrence):
    t = _trainer(batches, "--train.activation_checkpoint", "full")
    eng = attach(t, DMRConfig(enabled=True))
    # compute ops only (a view's output is its input's memory, not a computation DMR could repeat)
    fault = Fault(OpSite("*", phase, occurrence, compute_only=True), FaultModel("bitflip", field="exponent"), step=1)
    inj = Injector(fault, seed=5).attach(t)
    results = [t.train_step() for _ in range(3)]
    assert len(inj.records) == 1 and inj.records[0].phase == phase
    assert eng.totals["detected"] >= 1
    if phase == "optimizer":  # repaired by re-executing the update chunk (no copy of the optimizer state)
        assert eng.totals["repaired_optimizer"] == 1
    else:
        assert [r.attempts for r in results] == [1, 2, 1]
    assert _equal(_params(t), clean)


# (the seed draws the result: forward / recompute 0 the output, 1 the log-sum-exp; backward 0 dv, 4 dk)
@pytest.mark.parametrize("phase, seed", [("forward", 0), ("forward", 1), ("recompute", 1), ("backward", 0),
                                         ("backward", 4)])
def test_a_bit_flip_in_one_result_of_fused_attention_is_detected_and_rolled_back_bitwise(batches, clean, phase,
                                                                                          seed):
    # fused attention returns (output, log-sum-exp) and its backward (dq, dk, dv): the fault lands in one of them,
    # drawn by the seed; every result is compared, so any of them is caught
    t = _trainer(batches, "--train.activation_checkpoint", "full")
    eng = attach(t, DMRConfig(enabled=True))
    fault = Fault(OpSite("aten._scaled_dot_product*", phase, 1, compute_only=True),
                  FaultModel("bitflip", field="exponent"), step=1)
    inj = Injector(fault, seed=seed).attach(t)
    results = [t.train_step() for _ in range(3)]
    (rec,) = inj.records
    assert rec.target.startswith("aten._scaled_dot_product") and rec.phase == phase
    assert eng.totals["detected"] >= 1 and [r.attempts for r in results] == [1, 2, 1]
    assert _equal(_params(t), clean)


def test_the_same_op_failing_on_every_re_execution_is_suspected_hardware(batches):
    t = _trainer(batches)
    attach(t, DMRConfig(enabled=True, system="naive"))
    Injector(Fault(OpSite("aten.mm*", "backward", 4), FaultModel("nan"), step=0, persistent=True)).attach(t)
    with pytest.raises(SuspectedHardwareFault, match=r"dmr:backward:\d+:aten.mm"):
        t.train_step()


def test_a_forward_that_recompute_does_not_repeat_is_a_detection_not_a_crash(batches):
    t = _trainer(batches, "--train.activation_checkpoint", "full")
    eng = attach(t, DMRConfig(enabled=True))
    calls = {"n": 0}

    def extra_op_on_first_forward(module, nxt, h):
        calls["n"] += 1
        out = nxt(h)
        return out * 1.0 if calls["n"] == 1 else out  # one more op, only in the very first forward

    t.model.layers["0"].feed_forward.kernel.push(extra_op_on_first_forward, name="odd")
    r = t.train_step()
    assert r.attempts == 2 and eng.totals["detected"] >= 1


def test_optimizer_update_verified_in_chunks(batches, clean):
    t = _trainer(batches, "--train.activation_checkpoint", "full")
    eng = attach(t, DMRConfig(enabled=True, optimizer_chunk_mb=0.01))
    Injector(Fault(OpSite("aten._fused_adamw_*", "optimizer", 3), FaultModel("bitflip", bit=30), step=2)).attach(t)
    for _ in range(3):
        t.train_step()
    assert eng.counts["optimizer-chunks"] > 3 and eng.totals["repaired_optimizer"] == 1
    assert _equal(_params(t), clean)


def test_a_fault_in_gradient_clipping_is_repaired_in_the_update_stage(batches, clean):
    t = _trainer(batches, "--train.activation_checkpoint", "full")
    eng = attach(t, DMRConfig(enabled=True))
    # the clip coefficient (clamp of max_norm / norm) is computed after the guards passed: no retry possible,
    # a third execution decides and the result is written into the primary's output
    inj = Injector(Fault(OpSite("aten.clamp*", "any", 0), FaultModel("bitflip", bit=22), step=1)).attach(t)
    results = [t.train_step() for _ in range(3)]
    assert len(inj.records) == 1 and [r.attempts for r in results] == [1, 1, 1]
    assert eng.totals["repaired_optimizer"] == 1
    assert _equal(_params(t), clean)


def test_campaign_every_phase_detected_and_bitwise(batches):
    from trainguard.sdc.dmr.campaign import run_rank

    overrides = [*SMALL, "--model.n_layers", "2", "--train.activation_checkpoint", "full", "--data.batch_size", "4"]
    res = run_rank({"overrides": overrides, "trials": 8, "seed": 3, "phase": "any", "steps": 2, "model": "tiny"})
    assert res["trials"] == 8 and res["detected"] == 8 and res["silent"] == 0 and res["false_positives"] == 0
    assert res["rollback_bitwise_equal"] == 8 and res["unreached"] == 0
    assert res["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")
    assert len({r["phase"] for r in res["results"]}) >= 3


def test_campaign_with_three_faults_a_trial_strikes_three_distinct_ops_and_every_trial_ends_bitwise(batches):
    from trainguard.sdc.dmr.campaign import run_rank

    overrides = [*SMALL, "--model.n_layers", "2", "--train.activation_checkpoint", "full", "--data.batch_size", "4"]
    res = run_rank({"overrides": overrides, "trials": 4, "seed": 7, "phase": "any", "steps": 2, "model": "tiny",
                    "faults": 3})
    assert res["trials"] == res["detected"] == res["rollback_bitwise_equal"] == 4 and res["silent"] == 0
    assert res["faults_fired"] == 12 and res["unreached"] == 0 and res["false_positives"] == 0
    for r in res["results"]:
        sites = {(f["phase"], f["step"], f["target"], f["occurrence"]) for f in r["faults"]}
        assert len(r["draws"]) == len(r["faults"]) == len(sites) == 3


def test_determinism_report_and_tolerance_mode(batches, clean, tmp_path):
    from trainguard.sdc.dmr.determinism import load_tolerances, record, save

    t = _trainer(batches, "--train.activation_checkpoint", "full")
    eng = attach(t, DMRConfig(enabled=True))
    report = record(t, eng, steps=1)
    assert report["ops"] and report["nondeterministic_ops"] == []  # CPU: every op bitwise reproducible
    save(report, tmp_path / "det.json")
    assert load_tolerances(tmp_path / "det.json", 8.0) == {}
    # tolerance mode with a report: clean steps raise no alarm, an exponent flip is still caught
    cfg = DMRConfig(enabled=True, compare="tolerance", determinism_report=str(tmp_path / "det.json"))
    eng.cfg, eng.rtol = cfg, load_tolerances(cfg.determinism_report, cfg.tolerance_safety)
    Injector(Fault(OpSite("aten.mm*", "backward", 2), FaultModel("bitflip", bit=29), step=2)).attach(t)
    assert [t.train_step().attempts for _ in range(2)] == [1, 2]
    assert _equal(_params(t), clean)
    report["ops"]["aten.index.Tensor"] = "inf"
    save(report, tmp_path / "bad.json")
    from trainguard.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot be verified"):
        load_tolerances(tmp_path / "bad.json", 8.0)


def _held_trainer(batches, *extra, carry_budget="unbounded", phases=(1, 2, 3)):
    """A single-process trainer whose engine takes the pipeline path (fingerprints later, update held): no
    window ever opens, so every check runs in the drain, which exercises the same code. (``carry_budget =
    "windows"`` carries none here: no window has room.)"""
    t = _trainer(batches, "--train.activation_checkpoint", "full", *extra)
    eng = attach(t, DMRConfig(enabled=True, carry_budget=carry_budget, phases=phases))
    eng.deferrable = True
    return t, eng


def test_held_update_alternating_with_other_systems_raises_no_alarm_and_ends_bitwise(batches, clean):
    """``bench dmr`` alternates systems on one trainer: an update made by another system must not be taken for
    a fault by the held check's copy of the state (it is dropped when the system changes)."""
    t, eng = _held_trainer(batches)
    for system in ("sparetrain", "naive", "sparetrain"):
        eng.set_system(system)
        t.train_step()
    assert eng.totals["detected"] == 0 and _equal(_params(t), clean)


def test_a_wrong_held_update_is_written_back_and_the_next_step_retried_bitwise(batches, clean):
    t, eng = _held_trainer(batches)
    Injector(Fault(OpSite("aten._fused_adamw_*", "optimizer", 0, compute_only=True),
                   FaultModel("bitflip", field="exponent"), step=1), seed=3).attach(t)
    attempts = [t.train_step().attempts for _ in range(3)]
    assert eng.totals["detected"] == 1 and eng.totals["repaired_optimizer"] == 1
    # step 0: profiled and planned, then re-executed; step 2 read the wrong parameters: re-executed after the
    # write-back
    assert attempts == [2, 1, 2]
    assert _equal(_params(t), clean)


@pytest.mark.parametrize("occurrence", [3, 23, 40])
def test_a_wrong_backward_op_whose_check_was_carried_past_the_update_rewinds_both_steps_bitwise(
        batches, clean, occurrence):
    """With no window after them (here: no window at all), the plan's naive backward ops are checked in the next
    iteration, against the parameters as they were before the update: the fault of step 1 is found in step 2, the
    state goes back to the start of step 1 and both steps are re-executed; the result is the fault-free run's."""
    t, eng = _held_trainer(batches)
    inj = Injector(Fault(OpSite("*", "backward", occurrence, compute_only=True), FaultModel("bitflip", field="exponent"),
                         step=1), seed=7).attach(t)
    results = [t.train_step() for _ in range(3)]
    assert len(inj.records) == 1 and eng.totals["detected"] >= 1
    assert [r.attempts for r in results] == [2, 1, 2]  # (step 0: profiled, then re-executed under the plan)
    assert results[2].retries[0]["rewind"] and results[2].retries[0]["rewound_to"] == 1
    assert eng.counts["carried"] > 0 or eng.totals["detected"] >= 1
    assert _equal(_params(t), clean)


def test_a_repaired_update_whose_step_another_rank_rewinds_is_restored_from_before_it_bitwise(batches, clean):
    """Two faults at once, on two ranks: this rank's update of step 1 was wrong (found in step 2 by the held check;
    the tie-breaker agrees with the checker: repaired), and another rank's check of step 1, carried past its
    update, differs: every rank rewinds to the start of step 1. (Here a guard asks for that rewind, as the verdict
    of the other rank does.) Found by ``campaign dmr --pp 2 --faults 3`` (seed 410): the tie-breaker ran on the
    copy of the state from the start of step 1, so the rewind found it gone and the run stopped ("the state at the
    start of step 1 is no longer kept")."""
    t, eng = _held_trainer(batches)
    Injector(Fault(OpSite("aten._fused_adamw_*", "optimizer", 0, compute_only=True),
                   FaultModel("bitflip", field="exponent"), step=1), seed=3).attach(t)

    class OtherRanksRewind(StepGuard):
        name, may_rewind, asked = "other-rank", True, False

        def before_update(self, ctx):
            if ctx.step == 2 and not self.asked:
                self.asked = True
                return Verdict.retry(site="carried", reason="another rank's carried check differs", rewind=True)
            return Verdict.commit()

    t.add_guard(OtherRanksRewind())
    results = [t.train_step() for _ in range(3)]
    assert eng.totals["repaired_optimizer"] == 1  # (this rank's held check ran, differed and was repaired first)
    assert results[2].retries[0]["rewind"] and results[2].retries[0]["rewound_to"] == 1
    assert _equal(_params(t), clean)


def test_a_rewind_wins_over_another_guards_retry_of_the_same_step_and_the_run_ends_bitwise(batches, clean):
    """Two faults found in the same step: a carried check of step 1 differs in step 2 (DMR asks for a rewind) and
    another guard, registered first, asks to retry step 2 alone (as another rank's fresh mismatch does on a pipeline).
    The rewind must win, or step 1's wrong update stays in place. Found by ``campaign dmr --pp 2 --faults 3``: the
    first of two equally severe verdicts won, step 2 alone was retried, and DMR's pending rewind then failed the
    next attempt (``StopIteration``)."""
    t, eng = _held_trainer(batches)
    Injector(Fault(OpSite("*", "backward", 23, compute_only=True), FaultModel("bitflip", field="exponent"), step=1),
             seed=7).attach(t)

    class RetryStepTwoOnce(StepGuard):
        name, asked = "other", False

        def before_update(self, ctx):
            if ctx.step == 2 and not self.asked:
                self.asked = True
                return Verdict.retry(site="other", reason="a second fault, found by another check")
            return Verdict.commit()

    t.guards.insert(0, RetryStepTwoOnce())
    results = [t.train_step() for _ in range(3)]
    assert results[2].retries[0]["rewind"] and results[2].retries[0]["rewound_to"] == 1
    assert _equal(_params(t), clean)


@pytest.mark.parametrize("carry_budget, phases", [("windows", (1, 2, 3)), ("unbounded", (1,))])
def test_with_no_window_room_the_plan_carries_nothing_and_a_wrong_backward_op_is_retried_in_its_own_step(
        batches, clean, carry_budget, phases):
    """The plan's carry budget is the room the next iteration's windows leave: with no window at all it is 0, so
    the naive backward ops are checked at once (none is carried) and a fault is found in its own step. The same
    without Phase 3 (the ablation's Phase 1), whose plan carries nothing whatever the budget."""
    t, eng = _held_trainer(batches, carry_budget=carry_budget, phases=phases)
    inj = Injector(Fault(OpSite("*", "backward", 23, compute_only=True), FaultModel("bitflip", field="exponent"),
                         step=1), seed=7).attach(t)
    results = [t.train_step() for _ in range(3)]
    assert eng.plan.carry_budget_s == 0 and eng.plan.summary["carry_ops"] == 0
    assert len(inj.records) == 1 and eng.totals["detected"] == 1
    assert [r.attempts for r in results] == [2, 2, 1] and not results[1].retries[0].get("rewind")
    assert _equal(_params(t), clean)
    eng.cfg.coverage = True
    t.train_step()
    # nothing at all is carried: not even the list ops over every gradient, which no plan entry covers (the plan
    # carries them only with an unbounded carry, Plan.carry_lists)
    assert not [(name, phase) for _, name, phase, _, window in eng.coverage if window == "carry"]
    assert eng.counts["naive"] > 0


def test_a_carried_check_that_fails_when_the_state_is_read_re_executes_the_last_step_first(batches, clean):
    t, eng = _held_trainer(batches)
    Injector(Fault(OpSite("*", "backward", 23, compute_only=True), FaultModel("bitflip", field="exponent"), step=2),
             seed=7).attach(t)
    results = [t.train_step() for _ in range(3)]
    assert [r.attempts for r in results] == [2, 1, 1] and eng._carried  # the fault's check is still pending
    assert _equal(_params(t), clean)  # (reading the state settles it: step 2 is re-executed first)
    assert eng.totals["detected"] == 1 and not eng._carried


def test_no_check_is_carried_past_the_last_step_of_a_run(batches, clean):
    t, eng = _held_trainer(batches)
    t.run(3)
    assert not eng._carried and eng.totals["detected"] == 0
    assert _equal(_params(t), clean)


@pytest.fixture(scope="module")
def clean_accum(batches):
    t = _trainer(batches, "--train.activation_checkpoint", "full", "--train.grad_accum", "2")
    for _ in range(3):
        t.train_step()
    return _params(t)


# (occurrences of the out-of-place add in backward that are the second micro-batch's gradient accumulation: with the
# swapped op's check removed, these three faults go undetected and the run ends wrong)
@pytest.mark.parametrize("occurrence", [27, 30, 33])
def test_a_bit_flip_in_a_gradient_accumulated_out_of_place_is_detected_and_rolled_back_bitwise(
        batches, clean_accum, occurrence):
    """``p.grad.add_`` of the second micro-batch runs out of place and ``p.grad`` takes the result's storage; its
    check is deferred like any other op's. A bit flip in that result is found and the step re-executed."""
    t, eng = _held_trainer(batches, "--train.grad_accum", "2")
    inj = Injector(Fault(OpSite("aten.add.Tensor", "backward", occurrence, compute_only=True),
                         FaultModel("bitflip", field="exponent"), step=1), seed=7).attach(t)
    attempts = [t.train_step().attempts for _ in range(3)]
    assert len(inj.records) == 1 and eng.totals["detected"] == 1 and attempts == [2, 1, 2]
    assert eng.counts["gradient-swapped"] > 0 and eng.totals["stale"] == 0
    assert _equal(_params(t), clean_accum)


def test_clean_gradient_swaps_raise_no_alarm_and_match_in_place_accumulation_bitwise(batches, clean_accum):
    t, eng = _held_trainer(batches, "--train.grad_accum", "2")
    for _ in range(3):
        t.train_step()
    assert eng.counts["gradient-swapped"] > 0
    assert eng.totals["detected"] == 0 and eng.totals["stale"] == 0
    assert _equal(_params(t), clean_accum)  # (the run without DMR accumulates in place)


def test_only_a_parameters_own_gradient_is_swapped_and_only_where_the_values_stay_the_same():
    from trainguard.sdc.dmr.engine import DMREngine

    model = torch.nn.Linear(4, 4)
    eng = DMREngine(DMRConfig(enabled=True))
    eng._model = model
    add_, add = torch.ops.aten.add_.Tensor, torch.ops.aten.add.Tensor
    model.weight.grad = torch.ones(4, 4)
    assert eng._grad_swap(add_, (model.weight.grad, torch.ones(4, 4)), {}) is add
    assert eng._grad_swap(add_, (torch.ones(4, 4), torch.ones(4, 4)), {}) is None  # not a gradient
    assert eng._grad_swap(add_, (model.weight.grad, torch.ones(4, 4, dtype=torch.float64)), {}) is None  # promotes
    assert eng._grad_swap(add_, (model.weight.grad, torch.ones(4)), {}) is None  # broadcasts
    assert eng._grad_swap(torch.ops.aten.copy_.default, (model.weight.grad, torch.ones(4, 4)), {}) is None
    bucket = torch.zeros(32)
    model.weight.grad = bucket[:16].view(4, 4)  # DDP's gradient as a view of its bucket: shares the storage
    assert eng._grad_swap(add_, (model.weight.grad, torch.ones(4, 4)), {}) is None


def test_a_systems_warm_up_stops_once_a_step_no_longer_grows_the_heap(monkeypatch):
    from trainguard.sdc.dmr import bench

    class Steps:
        n = 0

        def train_step(self):
            self.n += 1

    for growth, most, ran in (([0, 9000, 100, 50, 9000], 8, 4), ([9000] * 8, 4, 4), ([0, 0, 0], 8, 2),
                              ([1999, 1999], 8, 2), ([2000, 0, 0], 8, 3), ([0, 9000] * 4, 6, 6), ([0, 0], 1, 1)):
        reads = [0]

        def page_faults(reads=reads, growth=growth):  # (read before and after each step: the k-th step adds growth[k])
            k, after = divmod(reads[0], 2)
            reads[0] += 1
            return sum(growth[:k + after])
        monkeypatch.setattr(bench, "_page_faults", page_faults)
        monkeypatch.setattr(bench, "_set_system", lambda *a: None)
        t = Steps()
        assert bench._warm_up(None, t, "sparetrain", None, most) == ran == t.n, (growth, most)


def test_bench_reports_each_systems_own_peak_heap_and_says_how_memory_was_measured(monkeypatch):
    """One bench rank in a single process (no pipeline, so no idle windows): every system gets its own peak."""
    import itertools
    import platform
    import sys

    from trainguard.sdc.dmr import bench
    from trainguard.sdc.dmr.bench import merge, run_rank

    switches: list[tuple[str, int]] = []
    cfgs = []
    monkeypatch.setattr(bench, "attach", lambda trainer, cfg: (cfgs.append(cfg), attach(trainer, cfg))[1])
    set_system = bench._set_system
    monkeypatch.setattr(bench, "_set_system", lambda engine, trainer, s, plans=None: (
        switches.append((s, trainer.step_idx)), set_system(engine, trainer, s, plans))[-1])
    systems = ["none", "naive", "sparetrain"]
    res = run_rank({"overrides": SMALL + ["--train.activation_checkpoint", "full"], "systems": systems,
                    "rounds": 1, "steps": 1, "warmup": 1, "system_warmup": 2, "profile_steps": 2})
    # after the warm-up and the profiled step: each system's untimed steps (until its heap stops growing: two
    # quiet steps, which is also the most allowed here), then the round (1 + 1 each)
    first = next(i for i, (s, _) in enumerate(switches) if s == "sparetrain")
    warm, timed = switches[first + 1:first + 4], switches[first + 4:first + 7]
    assert [s for s, _ in warm] == systems and [s for s, _ in timed] == systems
    assert [b - a for (_, a), (_, b) in zip(warm, warm[1:] + timed[:1])] == [res["warm_up_steps"][s] for s in systems]
    assert all(n == 2 for n in res["warm_up_steps"].values())
    assert [b - a for (_, a), (_, b) in itertools.pairwise(timed)] == [2, 2]
    out = merge([res], systems)
    # profile_steps reaches the engine; one process has no window to plan for, so nothing is profiled
    assert [c.profile_steps for c in cfgs] == [2] and out["profiled_attempts"] == res["profiled_attempts"] == 0
    assert out["warm_up_steps"] == res["warm_up_steps"]
    assert out["coverage"] == 1.0 and out["detected_in_clean_runs"] == 0
    assert out["idle_held"] is False and out["idle_by_round"] == []  # (no emulated link without a pipeline)
    # one round of one step: the round's pair is the run's figure
    assert out["by_round"]["gain_vs_naive"] == [pytest.approx(out["gain_vs_naive"])]
    assert out["overhead_vs_no_dmr_worst_round"] == pytest.approx(out["overhead_vs_no_dmr"])
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        assert out["memory_measure"].startswith("heap")
        assert all(res["systems"][s]["peak_heap_bytes"] == out["peak_memory_bytes"][s] > 0 for s in systems)
    else:
        assert out["memory_measure"].startswith("resident")
