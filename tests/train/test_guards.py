"""Step guards: a retry re-executes the step from its start and ends bitwise equal to a clean run; verdicts
that repeat at one site are reported as persistent hardware; aborts and exhausted retries stop the run."""

import json
import random

import pytest
import torch
from conftest import tiny_cfg

from trainguard.errors import StepAborted, SuspectedHardwareFault
from trainguard.faults import Fault, FaultModel, Injector, OpSite, TensorSite
from trainguard.train import StepGuard, Trainer, Verdict
from trainguard.train import snapshot as snap_mod
from trainguard.train.guards import Action, worst


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class GradFinite(StepGuard):
    """Before the update: every gradient is finite (a NaN injected into a backward op shows up here)."""

    name = "grad-finite"

    def __init__(self):
        self.looks = 0

    def before_update(self, ctx):
        self.looks += 1
        for n, p in ctx.trainer.model.named_parameters():
            if p.grad is not None and not torch.isfinite(p.grad).all():
                return Verdict.retry(site=n, reason="non-finite gradient")
        return Verdict.commit()


class ParamsFinite(StepGuard):
    """After the update: every parameter is finite (a NaN injected into the optimizer shows up here)."""

    name = "params-finite"
    inspects_update = True

    def after_update(self, ctx):
        bad = [n for n, p in ctx.trainer.model.named_parameters() if not torch.isfinite(p).all()]
        return Verdict.retry(site=bad[0], reason="non-finite parameter") if bad else Verdict.commit()


class Counter:
    """A registered component whose state changes every attempt (and draws from the global RNG)."""

    def __init__(self):
        self.n, self.draws = 0, []

    def on_step_start(self, trainer, step):
        self.n += 1
        self.draws.append(float(torch.rand(())))

    def state_dict(self):
        return {"n": self.n, "draws": list(self.draws)}

    def load_state_dict(self, sd):
        self.n, self.draws = sd["n"], list(sd["draws"])


def _clean(batches, steps=5, *extra):
    t = Trainer(tiny_cfg("--train.steps", str(steps), *extra), batches=batches)
    c = Counter()
    t.register_state("counter", c)
    t.callbacks.append(c)
    for _ in range(steps):
        t.train_step()
    return t, c


def test_retry_before_update_is_bitwise_equal_to_a_clean_run(batches):
    clean, clean_counter = _clean(batches)
    t = Trainer(tiny_cfg("--train.steps", "5"), batches=batches)
    counter, guard = Counter(), GradFinite()
    t.register_state("counter", counter)
    t.callbacks.append(counter)
    t.add_guard(guard)
    inj = Injector(Fault(OpSite("aten.mm*", "backward", 3), FaultModel("nan"), step=2)).attach(t)
    results = [t.train_step() for _ in range(5)]
    assert [r.attempts for r in results] == [1, 1, 2, 1, 1] and len(inj.records) == 1
    assert results[2].retries[0]["site"] and results[2].retries[0]["guard"] == "grad-finite"
    assert guard.looks == 6
    assert _equal(t.state_dict_for_compare(), clean.state_dict_for_compare())
    # the component and the RNG were rolled back too: the same draws as the clean run, not one more
    assert counter.state_dict() == clean_counter.state_dict()


def test_retry_after_update_restores_parameters_optimizer_and_schedule(batches):
    clean, _ = _clean(batches)
    t = Trainer(tiny_cfg("--train.steps", "5"), batches=batches)
    counter = Counter()
    t.register_state("counter", counter)
    t.callbacks.append(counter)
    t.add_guard(ParamsFinite())
    fault = Fault(TensorSite("optimizer-state", "layers.1.feed_forward.w2.weight", "exp_avg_sq"),
                  FaultModel("value", value=-1.0), step=3, index=0)
    Injector(fault).attach(t)
    results = [t.train_step() for _ in range(5)]
    assert [r.attempts for r in results] == [1, 1, 1, 2, 1]
    assert _equal(t.state_dict_for_compare(), clean.state_dict_for_compare())
    assert t.scheduler.state_dict()["last_epoch"] == clean.scheduler.state_dict()["last_epoch"] == 5


def test_a_guard_acting_before_the_update_never_copies_the_optimizer(batches, monkeypatch):
    def no_copy(*a, **k):
        raise AssertionError("the optimizer state was copied")

    monkeypatch.setattr(snap_mod, "capture", no_copy)
    t = Trainer(tiny_cfg(), batches=batches)
    t.add_guard(GradFinite())
    Injector(Fault(OpSite("aten.mm*", "backward", 0), FaultModel("nan"), step=1)).attach(t)
    assert [t.train_step().attempts for _ in range(3)] == [1, 2, 1]


def test_same_site_on_consecutive_attempts_is_suspected_hardware(batches, tmp_path):
    class Stuck(StepGuard):
        name = "stuck"

        def before_update(self, ctx):
            return Verdict.retry(site="aten.mm#7", reason="mismatch") if ctx.step == 1 else Verdict.commit()

    cfg = tiny_cfg("--train.steps", "4", "--output.dir", str(tmp_path), "--output.metrics", "true")
    t = Trainer(cfg, batches=batches)
    t.add_guard(Stuck())
    with pytest.raises(SuspectedHardwareFault, match=r"rank 0, stuck:aten.mm#7 failed on 2 consecutive") as err:
        t.run()
    assert err.value.exit_code == 3 and "\n" not in str(err.value)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "rank 0" in summary["suspected_hardware"] and summary["end_step"] == 1
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [1]  # only committed steps are logged (step n: the n-th step)


def test_changing_sites_retry_until_the_limit_then_abort(batches):
    class Wandering(StepGuard):
        name = "wandering"

        def __init__(self):
            self.k = 0

        def before_update(self, ctx):
            self.k += 1
            return Verdict.retry(site=f"site{self.k}")

    t = Trainer(tiny_cfg("--train.max_retries", "2"), batches=batches)
    t.add_guard(Wandering())
    with pytest.raises(StepAborted, match="still failing after 2 re-executions") as err:
        t.train_step()
    assert err.value.exit_code == 4 and t.step_idx == 0


def test_abort_verdict_stops_at_once(batches):
    class Abort(StepGuard):
        def before_update(self, ctx):
            return Verdict.abort(site="loss", reason="loss exploded")

    t = Trainer(tiny_cfg(), batches=batches)
    t.add_guard(Abort())
    with pytest.raises(StepAborted, match="loss exploded"):
        t.train_step()


def test_retries_are_events_and_each_committed_step_is_logged_once(batches, tmp_path):
    cfg = tiny_cfg("--train.steps", "4", "--output.dir", str(tmp_path), "--output.metrics", "true")
    t = Trainer(cfg, batches=batches)
    t.add_guard(GradFinite())
    Injector(Fault(OpSite("aten.mm*", "backward", 0), FaultModel("nan"), step=2)).attach(t)
    s = t.run()
    assert s.retries == 1
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [1, 2, 3, 4]
    assert [(r["step"], r["guard"]) for r in lines if r.get("event") == "retry"] == [(3, "grad-finite")]


def test_state_dict_round_trip_continues_bitwise(batches):
    a = Trainer(tiny_cfg("--train.steps", "6"), batches=batches)
    for _ in range(3):
        a.train_step()
    sd = a.state_dict()
    random.random()
    b = Trainer(tiny_cfg("--train.steps", "6"), batches=batches)
    b.load_state_dict(sd)
    for _ in range(3):
        a.train_step()
        b.train_step()
    assert b.step_idx == 6 and _equal(a.state_dict_for_compare(), b.state_dict_for_compare())


def test_planned_re_executions_count_neither_against_the_limit_nor_as_a_persistent_fault(batches):
    """A guard's planned re-executions (DMR profiles the first step several times) at one site, past
    train.max_retries: the step commits; a failure among them still counts."""
    class Planned(StepGuard):
        name = "planned"

        def __init__(self, planned: int, fail_at: int | None = None):
            self.k, self.planned, self.fail_at = 0, planned, fail_at

        def before_update(self, ctx):
            self.k += 1
            if self.k == self.fail_at:
                return Verdict.retry(site="flip", reason="a real mismatch")
            if self.k <= self.planned:
                return Verdict.retry(site="profile", reason="profiled", planned=True)
            return Verdict.commit()

    t = Trainer(tiny_cfg("--train.max_retries", "0"), batches=batches)
    t.add_guard(Planned(3))
    assert t.train_step().attempts == 4  # three planned re-executions at one site, with no retry allowed
    t = Trainer(tiny_cfg("--train.max_retries", "0"), batches=batches)
    t.add_guard(Planned(3, fail_at=2))
    with pytest.raises(StepAborted, match="still failing after 0 re-executions"):
        t.train_step()  # the failure is not hidden among the planned re-executions
    t = Trainer(tiny_cfg("--train.max_retries", "1"), batches=batches)
    t.add_guard(Planned(3, fail_at=2))
    assert t.train_step().attempts == 4  # one failure allowed: planned, failed, planned, committed
    t = Trainer(tiny_cfg("--train.max_retries", "1", "--train.steps", "2"), batches=batches)
    t.add_guard(Planned(3, fail_at=2))
    s = t.run()  # the run summary counts the failure's re-execution apart from the planned ones
    assert (s.retries, s.planned_retries) == (1, 2)


def test_a_failure_outranks_a_planned_re_execution_on_one_rank():
    planned = Verdict.retry(site="profile", planned=True)
    failed = Verdict.retry(site="flip")
    assert worst([planned, failed]) is failed and worst([failed, planned]) is failed
    assert worst([planned, Verdict.abort(site="x")]).action == Action.ABORT
    assert Verdict.from_dict(planned.to_dict(), 3) == Verdict(Action.RETRY, "profile", "", "", 3, False, True)


@pytest.mark.parametrize("limit", [1024, 300, 120])
def test_a_verdict_too_long_for_its_row_keeps_its_action_and_flags_and_loses_only_message_text(limit):
    # quotes, backslashes and non-ASCII escape to several bytes each in JSON: the cut must still fit
    reason = 'persistent fault: "aten.mm#12" \\ différent 5 of 5 times ' * 60
    cases = [Verdict.suspect("dmr:aten.mm#12", reason),
             Verdict(Action.RETRY, "dmr:" + "x\u00e9" * 400, reason, "dmr", 1, rewind=True, planned=True),
             Verdict.abort("site", "short")]
    for v in cases:
        v = Verdict(v.action, v.site, v.reason, "dmr", 3, v.rewind, v.planned)
        blob = v.to_json(limit)
        assert len(blob) <= limit and blob.isascii()
        back = Verdict.from_dict(json.loads(blob.decode()), 3)
        assert (back.action, back.guard, back.rank, back.rewind, back.planned) == (v.action, "dmr", 3, v.rewind,
                                                                                    v.planned)
        for got, full in ((back.site, v.site), (back.reason, v.reason)):
            assert got == full or (full.startswith(got.removesuffix("...")) and len(got) < len(full))
        if len(json.dumps(v.to_dict())) <= limit:
            assert back == v  # nothing is cut from a verdict that fits
    with pytest.raises(ValueError, match="does not fit in 20 bytes"):
        cases[0].to_json(20)


def test_an_elastic_replica_s_long_suspect_verdict_reaches_its_peer_as_a_suspect_not_a_retry():
    from types import SimpleNamespace

    from trainguard.train.parallel.elastic import ElasticStrategy

    peer = Verdict(Action.SUSPECT, "dmr:aten.addmm#7", "the same op failed on re-execution: " + "y" * 3000, "dmr", 1)

    class Group:  # the quorum's collectives, with replica 1's contribution added as the network would
        def allreduce_max(self, t):
            t.copy_(torch.maximum(t, torch.tensor([float(int(peer.action))], dtype=t.dtype)))
            return True

        def allreduce_sum(self, rows):
            blob = peer.to_json(rows.shape[1])
            rows[1, : len(blob)] += torch.tensor(list(blob), dtype=rows.dtype)
            return True

    s = ElasticStrategy()
    s.group, s.replicas, s.replica_id = Group(), 2, 0
    got = s.reduce_verdicts(SimpleNamespace(device=torch.device("cpu")), Verdict.commit())
    assert len(got) == 1 and got[0].action == Action.SUSPECT and got[0].rank == 1
    assert got[0].site == peer.site and peer.reason.startswith(got[0].reason.removesuffix("..."))
    assert worst(got).action == Action.SUSPECT  # the run stops, as on the replica that found it


def test_a_rewind_outranks_a_retry_of_the_step_alone_in_either_order_and_across_ranks():
    retry, rewind = Verdict.retry(site="flip"), Verdict.retry(site="carried", rewind=True)
    assert worst([retry, rewind]) is rewind and worst([rewind, retry]) is rewind
    assert worst([Verdict.retry(site="profile", planned=True), rewind]) is rewind
    assert worst([rewind, Verdict.abort(site="x")]).action == Action.ABORT
    # as every rank's verdicts arrive after the reduction (rank order): the rewind survives the trip
    gathered = [Verdict.from_dict(v.to_dict(), r) for r, v in enumerate((retry, rewind))]
    assert worst(gathered).rewind and worst(gathered).rank == 1
