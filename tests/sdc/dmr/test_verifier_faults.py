"""Faults in the DMR engine's own work (its checker executions, copies and fingerprints), injected through
``OpSite(verifier=True)``. Hardware corrupts those as readily as the step's ops; flagged or not, the run must end
bitwise equal to the fault-free one. The engine's window worker runs under the injector's mode (it enters the
modes around its own), so faults reach the checkers it runs there as well. Fixtures ``batches`` and ``clean``: the
package's conftest (the windowed trainer's)."""

from __future__ import annotations

import fnmatch
import threading
import time
from unittest import mock

import pytest
import torch

from tests.sdc.dmr._windowed import equal, params, trainer, windowed
from trainguard.faults import Fault, FaultModel, Injector, OpSite
from trainguard.faults.injector import _CHECKER
from trainguard.train import run_lock


@pytest.fixture(scope="module")
def clean_held(batches):
    """The fault-free parameters for ``test_engine._held_trainer``'s configuration (without DMR)."""
    from tests.sdc.dmr.test_engine import _trainer

    ref = _trainer(batches, "--train.activation_checkpoint", "full")
    for _ in range(3):
        ref.train_step()
    return params(ref)


class _OnTheWorker(Injector):
    """Sees the verifier's own ops only where they run on a worker thread (the window's): its sites count and strike
    those alone. Which checks the worker reaches before its window closes depends on the host's load (the rest run
    on the main thread, in the drain), so an occurrence counted in one run may land on the main thread in the next;
    counted among the worker's ops alone, occurrence 0 is the first checker op the worker runs, whichever it is."""

    def _on_op(self, func, out, args=(), kwargs=None):
        if _CHECKER.active and threading.current_thread() is threading.main_thread():
            return None
        return super()._on_op(func, out, args, kwargs)


def _run(batches, faults: list[Fault], injector: type[Injector] = Injector, window_s: float = 0.1):
    t = trainer(batches)
    inj = injector(faults, seed=5).attach(t)
    eng = windowed(t, "thread", transfer=lambda: (lambda: time.sleep(window_s)))
    for _ in range(3):
        t.train_step()
    return t, eng, inj


def test_a_fault_in_a_checker_on_the_window_worker_is_detected_and_the_run_ends_bitwise(batches, clean):
    # the first checker mm the worker runs in step 1, and in step 2 too: a loaded host may leave a window's
    # worker no time for an mm in one step. Windows of 400 ms: in 100 ms ones, a slow host under the suite's load
    # (2026-12-02) spent both steps' windows on the fingerprints the worker takes first and reached no mm at all
    faults = [Fault(OpSite("aten.mm*", "any", 0, compute_only=True, verifier=True), FaultModel("bitflip", bit=30),
                    step=step) for step in (1, 2)]
    t, eng, inj = _run(batches, faults, _OnTheWorker, window_s=0.4)
    assert inj.records, "no checker mm ran on the window's worker in step 1 or 2"
    assert all(r.phase == "verifier" and r.target.startswith("aten.mm") and r.thread == "worker"
               for r in inj.records)
    # each fault made a checker disagree with a correct primary: its iteration ran again
    assert eng.totals["detected"] >= len(inj.records)
    assert equal(params(t), clean)


def test_a_fault_in_the_copy_of_the_state_before_the_held_update_is_copied_again_not_written_back(batches, clean):
    """The first held update copies the parameters and optimizer state (what a rollback or a repair restores).
    A fault in that copy, unverified, made the next held check disagree with the primary while the tie-breaker,
    run from the same corrupted copy, agreed with the checker: the engine 'repaired' the parameters with wrong
    values and reported the fault fixed. The copy is now compared with its source and taken again."""
    fault = Fault(OpSite("aten._foreach_copy_*", "any", 0, verifier=True), FaultModel("value", value=1e6), step=0)
    t, eng, inj = _run(batches, [fault])
    (rec,) = inj.records
    assert rec.phase == "verifier" and rec.target.startswith("aten._foreach_copy_") and rec.thread == "main"
    assert equal(params(t), clean)  # (the unverified copy: a 'repaired' update, not bitwise equal)
    assert eng.totals["copy_faults"] == 1 and eng.totals["repaired_optimizer"] == 0


def test_the_verifier_campaign_strikes_only_the_engines_work_and_every_trial_ends_bitwise(batches):
    from tests.sdc.dmr.test_engine import SMALL
    from trainguard.sdc.dmr.campaign import run_rank

    overrides = [*SMALL, "--model.n_layers", "2", "--train.activation_checkpoint", "full", "--data.batch_size", "4"]
    res = run_rank({"overrides": overrides, "trials": 6, "seed": 4, "phase": "verifier", "steps": 2, "model": "tiny"})
    assert res["trials"] == 6 and res["silent"] == 0 and res["false_positives"] == 0
    assert res["rollback_bitwise_equal"] == 6 and res["detected"] + res["masked"] == 6
    fired = [r["fault"] for r in res["results"] if r["fault"]]
    assert fired and all(f["phase"] == "verifier" for f in fired)
    assert {r["phase"] for r in res["results"]} == {"verifier"}
    assert sum(res["faults_by_thread"].values()) == len(fired)



def _with_a_wrong_copy(eng, method: str) -> list[float]:
    """The engine's ``method`` runs with ``torch._foreach_copy_`` writing one wrong element once (the first element
    of the second tensor it writes that has more than one: a weight every token reads, where the first tensor is
    the embedding, whose first row no byte of text selects); returns the list that records the value it overwrote."""
    call, real, wrong = getattr(eng, method), torch._foreach_copy_, []

    def faulty_copy(dst, src):
        real(dst, src)
        if not wrong:
            target = next(d for d in dst[1:] if d.numel() > 1)
            wrong.append(target.view(-1)[0].item())
            target.view(-1)[0] += 1.0

    def wrapped(*args, **kwargs):
        with mock.patch.object(torch, "_foreach_copy_", faulty_copy):
            return call(*args, **kwargs)

    setattr(eng, method, wrapped)
    return wrong


@pytest.mark.parametrize("method, site, phase, carry", [
    # a backward op of step 1 whose check is carried into step 2: both steps are re-executed from the verified
    # state before step 1's update, which restore_before_update puts back
    ("restore_before_update", "*", "backward", "unbounded"),
    # a wrong held update of step 1, found by its check in step 2: the two executions that agree are written back.
    # With nothing carried: a carried check would read the verified copy and catch a wrong write-back a step later
    ("_apply_repair", "aten._fused_adamw_*", "optimizer", "windows"),
])
def test_a_fault_in_the_copy_that_writes_the_verified_state_back_is_copied_again(batches, clean_held, method, site,
                                                                                 phase, carry):
    """Two faults: one in the step, and one wrong element written by the copy that puts the verified state back
    afterwards (the trainer calls the engine between attempts, where no injector counts: the copy op itself is
    made to write it). The copy is compared with its source and taken again; the run ends bitwise equal."""
    from tests.sdc.dmr.test_engine import _held_trainer

    t, eng = _held_trainer(batches, carry_budget=carry)
    inj = Injector(Fault(OpSite(site, phase, 3 if phase == "backward" else 0, compute_only=True),
                         FaultModel("bitflip", field="exponent"), step=1), seed=7).attach(t)
    wrong = _with_a_wrong_copy(eng, method)
    results = [t.train_step() for _ in range(3)]
    assert len(inj.records) == 1 and len(wrong) == 1
    assert [r.attempts for r in results] == [2, 1, 2]
    assert equal(params(t), clean_held)
    assert eng.totals["copy_faults"] == 1


class _Counts(Injector):
    """Counts the verifier's ops of step 1 whose name starts with ``prefix`` (``n``), as a site of that pattern does."""

    def __init__(self, prefix: str, *a, **k):
        super().__init__(*a, **k)
        self.prefix, self.n = prefix, 0

    def _on_op(self, func, out, args=(), kwargs=None):
        if self.step == 1 and _CHECKER.active and str(func).startswith(self.prefix):
            self.n += 1
        return super()._on_op(func, out, args, kwargs)


def test_a_fault_in_the_update_stages_copy_of_an_input_does_not_outvote_a_correct_primary(batches):
    """Without windows the update is checked at once, in pieces: the checker and the tie-breaker both run on copies
    of the op's inputs (the gradients), taken before the primary. A fault in such a copy made the two agree on a wrong
    result against the correct primary, which the engine then overwrote ('repaired'). The tie-breaker's verdict
    now stands only where those copies still equal the inputs; otherwise the primary's state is kept."""
    from tests.sdc.dmr.test_engine import _trainer
    from trainguard.sdc.dmr.config import DMRConfig
    from trainguard.sdc.dmr.engine import attach

    def run(fault):
        t = _trainer(batches, "--train.activation_checkpoint", "full")
        eng = attach(t, DMRConfig(enabled=True))
        inj = _Counts("aten.copy_", [fault] if fault else [], seed=3).attach(t)
        first_input: list[int] = []
        copy = eng._copy

        def spy(key, src):  # (the next copy_ the injector counts is this one)
            if key[1] == "input" and inj.step == 1 and not first_input:
                first_input.append(inj.n)
            return copy(key, src)

        eng._copy = spy
        for _ in range(3):
            t.train_step()
        return t, eng, inj, first_input

    ref, _, _, (occurrence,) = run(None)  # (DMR without faults: bitwise the run without DMR, tested elsewhere)
    fault = Fault(OpSite("aten.copy_*", "any", occurrence, verifier=True), FaultModel("value", value=1e6), step=1)
    t, eng, inj, _ = run(fault)
    (rec,) = inj.records
    assert rec.phase == "verifier" and rec.target.startswith("aten.copy_")
    assert equal(params(t), params(ref))
    assert eng.totals["copy_faults"] == 1 and eng.totals["repaired_optimizer"] == 0


def _tensor_lr(t) -> None:
    """The learning rate as a tensor (``torch.optim`` then calls the fused kernels' ``tensor_lr`` overloads)."""
    for g in t.optimizer.param_groups:
        g["lr"] = torch.tensor(float(g["lr"]))


def test_with_the_learning_rate_a_tensor_the_update_is_held_and_a_fault_in_its_copy_cannot_outvote_it(batches):
    """``lr`` as a tensor: the fused AdamW is ``_fused_adamw_.tensor_lr``, which the engine did not know as a fused
    optimizer. It then checked the update at once while the plan still carried backward checks past it, expecting
    it held: a clean run failed (a carried check read the updated parameters, and the state to rewind to was not
    kept). Now the update is held as with a float ``lr``. The held check reads the ``lr`` the primary read from a
    copy, which the checker and the tie-breaker share: a fault in it is caught when it is taken (with nothing
    carried, which would also catch the wrong write-back a step later)."""
    ref = trainer(batches)
    _tensor_lr(ref)
    for _ in range(3):
        ref.train_step()

    def run(fault, carry="windows"):
        t = trainer(batches)
        _tensor_lr(t)
        inj = _Counts("aten._foreach_copy_", [fault] if fault else [], seed=3).attach(t)
        eng = windowed(t, "thread", carry_budget=carry)
        at: list[int] = []
        copy = eng._copy_verified

        def spy(dst, src):  # (the next _foreach_copy_ the injector counts is this one's)
            if inj.step == 1 and not at and any(s is t.optimizer.param_groups[0]["lr"] for s in src):
                at.append(inj.n)
            return copy(dst, src)

        eng._copy_verified = spy
        results = [t.train_step() for _ in range(3)]
        return t, eng, inj, at, results

    for carry in ("unbounded", "windows"):  # (the default carries: the clean run that failed)
        t, eng, _, at, results = run(None, carry)
        assert eng.totals["detected"] == 0 and [r.attempts for r in results] == [2, 1, 1]
        assert equal(params(t), params(ref))
    (occurrence,) = at
    fault = Fault(OpSite("aten._foreach_copy_*", "any", occurrence, verifier=True), FaultModel("value", value=1.0),
                  step=1)
    t, eng, inj, _, _ = run(fault)
    (rec,) = inj.records
    assert rec.phase == "verifier" and rec.target.startswith("aten._foreach_copy_") and rec.new == 1.0
    assert equal(params(t), params(ref))
    assert eng.totals["copy_faults"] == 1 and eng.totals["repaired_optimizer"] == 0


def _update_stage_faults(site: str, step: int, n: int) -> list[Fault]:
    """``n`` faults into the verifier's executions of ``site`` in ``step``, each writing a value of its own: the
    checker's (occurrence 0), then the tie-breakers' (each runs before the next piece's checker)."""
    return [Fault(OpSite(site, "any", k, verifier=True), FaultModel("value", value=(-3.0) ** k * 1e6), step=step)
            for k in range(n)]


def _at_once(batches, faults: list[Fault], **cfg):
    """Three steps with the update checked at once, in pieces (no windows): the trainer, the engine, the injector.
    The fault-free reference is ``clean_held`` (the same trainer without DMR)."""
    from tests.sdc.dmr.test_engine import _trainer
    from trainguard.sdc.dmr.config import DMRConfig
    from trainguard.sdc.dmr.engine import attach

    t = _trainer(batches, "--train.activation_checkpoint", "full")
    eng = attach(t, DMRConfig(enabled=True, **cfg))
    inj = Injector(faults, seed=3).attach(t)
    for _ in range(3):
        t.train_step()
    return t, eng, inj


# the fused AdamW's pieces (in place: the tie-breaker restores the piece's writes first) and the zeros its state
# starts from (step 0, out of place: every execution reads the same inputs)
UPDATE_OPS = [("aten._fused_adamw_*", 1), ("aten.zeros*", 0)]


@pytest.mark.parametrize("site, step", UPDATE_OPS)
def test_two_faults_in_an_update_ops_checker_and_tie_breaker_are_outvoted_by_another_execution(batches, clean_held,
                                                                                            site, step):
    """The update stage cannot be retried (it is under way), so two of three executions decide. Two faults, in the
    checker and in the tie-breaker, gave three results: the run stopped as a suspected hardware fault (found by
    ``campaign dmr --phase verifier --faults 2 --pp 2``). Another tie-breaker runs and sides with the primary."""
    t, eng, inj = _at_once(batches, _update_stage_faults(site, step, 2))
    assert [r.occurrence for r in inj.records] == [0, 1] and all(r.phase == "verifier" for r in inj.records)
    assert eng.totals["tie_breakers_again"] == 1  # (three results, all different: the case this is about)
    assert equal(params(t), clean_held)


@pytest.mark.parametrize("site, step", UPDATE_OPS)
def test_with_one_tie_breaker_the_same_two_faults_stop_the_run_as_suspected_hardware(batches, site, step):
    from trainguard.errors import SuspectedHardwareFault

    with pytest.raises(SuspectedHardwareFault, match=rf"3 executions of aten\.{site[5:-1]}\S* in the update stage "
                                                     rf"of step {step} all differ"):
        _at_once(batches, _update_stage_faults(site, step, 2), tie_breakers=1)


@pytest.mark.parametrize("site, step", UPDATE_OPS)
def test_an_update_op_whose_every_execution_differs_is_suspected_hardware_not_retried_forever(batches, site, step):
    """Four faults, in the checker and in each of the three tie-breakers: no two of five executions agree."""
    from trainguard.errors import SuspectedHardwareFault

    faults = _update_stage_faults(site, step, 4)
    with pytest.raises(SuspectedHardwareFault, match=rf"5 executions of aten\.{site[5:-1]}\S* in the update stage "
                                                     rf"of step {step} all differ"):
        _at_once(batches, faults)


def _held(batches, n: int, **cfg):
    t = trainer(batches)
    inj = Injector(_update_stage_faults("aten._fused_adamw_*", 1, n), seed=5).attach(t)
    eng = windowed(t, "thread", **cfg)
    for _ in range(3):
        t.train_step()
    return t, eng, inj


def test_two_faults_in_a_held_updates_checker_and_tie_breaker_are_outvoted_by_another_execution(batches, clean):
    """The held update (checked in the next iteration's windows): the same two faults, the same vote."""
    t, eng, inj = _held(batches, 2)
    assert [r.occurrence for r in inj.records] == [0, 1]
    assert eng.totals["tie_breakers_again"] == 1
    assert equal(params(t), clean)


def test_with_one_tie_breaker_a_held_updates_three_results_stop_the_run_at_the_next_verdict(batches):
    from trainguard.errors import SuspectedHardwareFault

    with pytest.raises(SuspectedHardwareFault, match=r"3 executions of aten\._fused_adamw_\S* in the update stage of "
                                                     r"step 0 all differ"):
        _held(batches, 2, tie_breakers=1)


def test_tie_breakers_from_a_wrong_copy_of_the_state_agree_with_each_other_but_do_not_decide(batches):
    """Two faults: in the checker of a piece of the update, and in the copy of that piece's state before it (which
    every tie-breaker starts from). The tie-breakers then agree with each other on a wrong result, and with neither
    the primary nor the checker: that agreement decides nothing (it would write their result into the parameters and
    report it repaired), and the run stops as a suspected hardware fault instead."""
    from tests.sdc.dmr.test_engine import _trainer
    from trainguard.errors import SuspectedHardwareFault
    from trainguard.sdc.dmr.config import DMRConfig
    from trainguard.sdc.dmr.engine import attach

    def run(faults):
        t = _trainer(batches, "--train.activation_checkpoint", "full")
        eng = attach(t, DMRConfig(enabled=True))
        inj = _Counts("aten.copy_", faults, seed=3).attach(t)
        first_pre: list[int] = []
        copy, naive, adamw = eng._copy, eng._naive, []

        def spy(key, src):  # (the next copy_ the injector counts is this one)
            if key[1] == "pre" and inj.step == 1 and adamw[-1:] == [True] and not first_pre and src.numel() > 1:
                first_pre.append(inj.n)
            return copy(key, src)

        def in_adamw(op_id, phase, func, *a, **k):  # (the update's pieces: not clipping's, which come first)
            adamw[:] = [str(func).startswith("aten._fused_adamw_")]
            return naive(op_id, phase, func, *a, **k)

        eng._copy, eng._naive = spy, in_adamw
        for _ in range(3):
            t.train_step()
        return first_pre

    (occurrence,) = run([])
    faults = [Fault(OpSite("aten.copy_*", "any", occurrence, verifier=True), FaultModel("value", value=1e6), step=1),
              Fault(OpSite("aten._fused_adamw_*", "any", 0, verifier=True), FaultModel("value", value=-3e6), step=1)]
    with pytest.raises(SuspectedHardwareFault, match=r"5 executions of aten\._fused_adamw_\S* in the update stage"):
        run(faults)


def test_a_state_the_engine_gave_up_on_is_refused_to_readers_and_a_loaded_one_trains_on(batches, clean, tmp_path):
    """Once the engine stops the run (three results in the update stage), the live state is the primary's, right or
    wrong: reading it re-ran a step on the suspect device and handed out a state nobody verified, which a caller that
    catches the error could have saved as a checkpoint. Reads are refused now (no checkpoint is written); loading a
    state replaces it, and training from there ends bitwise equal to the fault-free run."""
    import copy

    from trainguard.errors import SuspectedHardwareFault

    t = trainer(batches, "--checkpoint.dir", str(tmp_path / "ckpt"))
    start = copy.deepcopy(t.state_dict())
    Injector(_update_stage_faults("aten._fused_adamw_*", 1, 2), seed=5).attach(t)
    eng = windowed(t, "thread", tie_breakers=1)
    with pytest.raises(SuspectedHardwareFault, match="3 executions"):
        for _ in range(3):
            t.train_step()
    for read in (t.state_dict, t.state_dict_for_compare, t.save_checkpoint, t.evaluate):
        with pytest.raises(SuspectedHardwareFault, match=r"the model state is not verified since the run stopped \(3 "):
            read()
    ckpt = tmp_path / "ckpt"
    assert not ckpt.exists() or not [p for p in ckpt.iterdir() if p.name not in (run_lock.LOCK, run_lock.RANKS_LOCK)]
    t.load_state_dict(start)
    for _ in range(3):
        t.train_step()
    assert equal(params(t), clean) and eng.totals["detected"] == 0
    t.save_checkpoint()  # (where a checkpoint goes: the check above is not vacuous)
    assert any(ckpt.iterdir())


class _CopiesBeforeTheTieBreaker(Injector):
    """Counts the verifier's copy ops of step 0 (``aten.copy_``, ``aten._foreach_copy_``) as a site of that pattern
    does, and notes the count when the second verifier execution of ``aten.zeros`` (the tie-breaker) runs."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.copies, self.zeros, self.at = 0, 0, None

    def _on_op(self, func, out, args=(), kwargs=None):
        if self.step == 0 and _CHECKER.active and not self._injecting:
            name = str(func)
            # (the injector's own filter: a tensor returned must be floating point; a list op returns None)
            counted = out.is_floating_point() if isinstance(out, torch.Tensor) else out is None or isinstance(out, list)
            if fnmatch.fnmatchcase(name, "aten.*copy_*") and counted:
                self.copies += 1
            elif name.startswith("aten.zeros"):
                self.zeros += 1
                if self.zeros == 2:
                    self.at = self.copies
        return super()._on_op(func, out, args, kwargs)


def test_a_fault_in_the_copy_that_writes_the_outvoting_result_into_an_update_op_is_copied_again(batches, clean_held):
    """A wrong primary of an out-of-place update op (the zeros AdamW's state starts from), outvoted by the checker and
    the tie-breaker: their result is copied into the primary's output. That copy was not compared with its source, so
    a fault in it wrote a wrong value into the optimizer's state and reported the op repaired."""
    from tests.sdc.dmr.test_engine import _trainer
    from trainguard.sdc.dmr.config import DMRConfig
    from trainguard.sdc.dmr.engine import attach

    wrong_primary = Fault(OpSite("aten.zeros*", "optimizer", 0, compute_only=True), FaultModel("value", value=7.0),
                          step=0)

    def run(faults):
        t = _trainer(batches, "--train.activation_checkpoint", "full")
        eng = attach(t, DMRConfig(enabled=True))
        inj = _CopiesBeforeTheTieBreaker(faults, seed=3).attach(t)
        inj.count_verifier = True  # (the verifier's ops reach _on_op without a verifier site of their own)
        for _ in range(3):
            t.train_step()
        return t, eng, inj

    _, eng, counted = run([wrong_primary])
    assert counted.at is not None and eng.totals["repaired_optimizer"] == 1  # (outvoted and written back)
    wrong_copy = Fault(OpSite("aten.*copy_*", "any", counted.at, verifier=True), FaultModel("value", value=-5.0),
                       step=0)
    t, eng, inj = run([wrong_primary, wrong_copy])
    assert [r.phase for r in inj.records] == ["optimizer", "verifier"] and "copy_" in inj.records[1].target
    assert equal(params(t), clean_held)
    assert eng.totals["copy_faults"] == 1 and eng.totals["repaired_optimizer"] == 1


def test_a_trial_that_stops_as_suspected_hardware_is_counted_stopped_and_the_campaign_goes_on(monkeypatch):
    """A single-process campaign's trial whose run stops (``SuspectedHardwareFault``: no two executions of an update op
    agreed) ended the whole campaign, every other trial's outcome with it. It is an outcome of its own now: nothing
    wrong was kept, the state is not read (the trainer refuses), and the next trial runs."""
    from tests.sdc.dmr.test_engine import SMALL
    from trainguard.errors import SuspectedHardwareFault
    from trainguard.sdc.dmr import campaign
    from trainguard.train import Trainer

    steps, calls = 2, [0]

    class StopsOnce(Trainer):
        def train_step(self, *a, **k):
            calls[0] += 1
            if calls[0] == steps + 2:  # (after the reference run: the second step of the first trial)
                raise SuspectedHardwareFault("test: five executions of an update op all differ")
            return super().train_step(*a, **k)

    monkeypatch.setattr(campaign, "Trainer", StopsOnce)
    overrides = [*SMALL, "--model.n_layers", "1", "--train.activation_checkpoint", "full"]
    res = campaign.run_rank({"overrides": overrides, "trials": 3, "seed": 4, "phase": "forward", "steps": steps,
                             "model": "tiny"})
    assert res["trials"] == 3 and res["stopped"] == 1 and res["silent"] == 0
    assert res["detected"] + res["masked"] + res["stopped"] == 3 and res["rollback_bitwise_equal"] == 2
    first = res["results"][0]
    assert first["outcome"] == "stopped" and "five executions" in first["stopped"] and not first["bitwise_equal"]
    assert [r["outcome"] for r in res["results"][1:]] == ["detected", "detected"]
