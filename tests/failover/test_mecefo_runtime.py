"""MeCeFO on the elastic strategy with real worker processes (torchft, gloo), torchft's test pattern: replicas as
processes under one lighthouse, a step-keyed fault (a real SIGKILL in the middle of a step, or a simulated failure
from the timeline), equal final state.

* a worker killed mid-run: the survivors finish that step without a restart (its slices recomputed, degraded, by
  its neighbor), no step is lost or applied twice, the restarted worker heals and ends bitwise equal to the others;
* without failure, a MeCeFO run is bitwise the plain elastic run;
* with failures, the run is bitwise a one-process replay of the planned slices with MeCeFO's degraded mode and
  the attention weights (so the count used in the attention average is the one the plan states), and its
  deviation from the fault-free run is bounded (the gradient's relative error on every monitored step) and
  reported.
"""

import math
import time

import pytest
import torch

from trainguard.failover.mecefo.approx import MHA_GROUP, NEIGHBOR, MeCeFO, MeCeFOConfig, mha_parameter_names
from trainguard.failover.mecefo.policy import MeCeFOPolicy
from trainguard.failover.mecefo.runtime import FailoverRunConfig, run_failover, trainer_config
from trainguard.failover.mecefo.timeline import Failure, FailureTimeline
from trainguard.faults.failstop import kill_pid
from trainguard.train.parallel import MicroBatch, StepPlan, Strategy
from trainguard.train.parallel.elastic import StepView
from trainguard.train.trainer import Trainer

TINY = dict(dim=32, n_layers=2, n_heads=2, ffn_hidden=64)


def _cfg(**kw) -> FailoverRunConfig:
    base = dict(workers=4, steps=8, model_overrides=TINY, seq_len=16, corpus_max_bytes=300_000,
                mecefo=MeCeFOConfig(rank=8, monitor_every=1), timeout_s=20.0)
    base.update(kw)
    return FailoverRunConfig(**base)


@pytest.mark.slow
def test_a_worker_killed_mid_step_the_run_finishes_and_the_returning_worker_is_bitwise_equal():
    # worker 1 is SIGKILLed at step 2 after computing its gradients, before the all-reduce; back at step 4.
    # worker 3 is out (simulated) at steps 6 and 7.
    steps = 10
    cfg = _cfg(steps=steps, timeline=FailureTimeline.of(Failure(1, 2, 4, real=True), Failure(3, 6, 8)), eval_batches=2,
               mecefo=MeCeFOConfig(rank=8, tau=1, monitor_every=1, defer_projection=False), return_state=True)
    # (projection per micro-batch: the bitwise replay below projects per micro-batch; deferred it is the same sum
    # up to rounding, test_mecefo_approx)
    res = run_failover(cfg)
    assert not res.errors and res.global_restarts == 0
    assert [(d["worker"], d["step"], d["cause"]) for d in res.deaths] == [(1, 2, "kill")]
    # every step committed exactly once, none lost
    assert [lg["step"] for lg in res.step_logs] == list(range(steps))
    kill = res.step_logs[2]
    assert kill["live"] == [0, 2, 3] and kill["failed"] == [1]
    assert [e["event"] for e in kill["events"]] == ["failure"] and kill["events"][0]["recovery_s"] > 0
    assert kill["work"] == {"0": 1, "2": 2, "3": 1}  # the neighbor finished worker 1's slice in the same step
    assert kill["roles"]["2"] == "neighbor" and kill["roles"]["0"] == "normal"
    assert kill["attention_weights"] == [0.0, round(1 / 3, 12)]  # its own slice was exact: 3 attention slices
    assert res.step_logs[3]["neighbors"] == [2] and res.step_logs[3]["attention_weights"] == [0.0, 0.5]
    # the restarted worker rejoined (healed from a peer) at or after its recovery step and trained to the end
    [rejoin] = res.rejoins
    assert rejoin["worker"] == 1 and 4 <= rejoin["step"] < steps
    assert all(lg["live"] == [0, 1, 2, 3] for lg in res.step_logs[rejoin["step"]:])
    assert res.step_logs[6]["out"] == [3] and res.step_logs[6]["neighbors"] == [0]
    assert res.step_logs[6]["roles"]["3"] == "idle"
    # the same final state everywhere, and every update applied once
    assert sorted(res.final) == [0, 1, 2, 3] and res.agree
    for f in res.final.values():
        assert (f["adam_steps"], f["scheduler_steps"], f["step"], f["torchft_step"]) == ([steps], steps, steps, steps)
    # the monitor measured the gradient's relative error on the degraded steps
    errs = [lg["grad_rel_error"] for lg in res.step_logs if "grad_rel_error" in lg]
    assert len(errs) == sum(1 for lg in res.step_logs if lg["attention_weights"]) and all(0 < e < 1 for e in errs)
    assert math.isfinite(res.val_ppl)
    # and the run did the math its steps state, bitwise: the killed worker's slice recomputed degraded by its
    # neighbor in the same step, the survivors' attention gradients re-weighted to the exact slice count
    assert res.step_logs[2]["degraded"] == [1]
    assert res.step_logs[2]["attention"] == {"0": 1 / 3, "1": 0.0, "2": 1 / 3, "3": 1 / 3}
    _assert_bitwise(res.states[1], _replay(cfg, _from_logs(res)))


@pytest.mark.slow
def test_without_failure_a_mecefo_run_is_bitwise_the_plain_elastic_run():
    plain = run_failover(_cfg(method="elastic", steps=5))
    mecefo = run_failover(_cfg(method="mecefo", steps=5))
    assert plain.agree and mecefo.agree
    assert mecefo.final[0]["digest"] == plain.final[0]["digest"]
    assert all(not lg["attention_weights"] and set(lg["roles"].values()) == {"normal"} for lg in mecefo.step_logs)


class _Replay(Strategy):
    """One process computes, each step, every counted slice alone, degraded where the step degraded it, its attention
    part weighted by the step's attention weight, and sums them in slice order: the math the elastic run must have
    done. ``plans(step) -> (counted {slice: weight}, degraded {slice}, attention weights {slice: weight})``."""

    def __init__(self, comp: MeCeFO, plans, n_slices: int):
        super().__init__()
        self.comp, self.plans, self.n = comp, plans, n_slices

    def plan(self, trainer, step):
        self.counted, self.degraded, self.attention = self.plans(step)
        self.comp.step = step
        return StepPlan(step, [MicroBatch(t, self.n, w) for t, w in sorted(self.counted.items())])

    def forward_backward(self, trainer, plan):
        model = trainer.model
        params = [p for p in model.parameters() if p.requires_grad]
        names = set(mha_parameter_names(model))
        mask = torch.cat([torch.full((p.numel(),), n in names) for n, p in model.named_parameters() if p.requires_grad])
        total = None
        for mb in plan.micro:
            model.zero_grad(set_to_none=True)
            x, y = trainer.micro_batch(plan.step, mb)
            with self.comp.degraded_mode(mb.index in self.degraded):
                loss = trainer.compute_loss(x, y)
                (loss * mb.weight).backward()
            row = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params])
            w = self.attention.get(mb.index)
            if w is not None and w != mb.weight:
                row[mask] *= w / mb.weight
            if total is None:
                total = row.clone()
            else:
                total += row
        model.zero_grad(set_to_none=True)
        off = 0
        for p in params:
            p.grad = total[off:off + p.numel()].view_as(p).clone()
            off += p.numel()
        return loss.detach()


def _replay(cfg: FailoverRunConfig, plans) -> dict[str, torch.Tensor]:
    comp = MeCeFO(cfg.mecefo)
    trainer = Trainer(trainer_config(cfg), strategy=_Replay(comp, plans, cfg.workers * cfg.grad_accum), progress=False)
    comp.attach(trainer.model)
    for _ in range(cfg.steps):
        trainer.train_step()
    return trainer.state_dict_for_compare(optimizer=True)


def _from_logs(res):
    logs = {lg["step"]: lg for lg in res.step_logs}
    return lambda step: ({int(t): w for t, w in logs[step]["counted"].items()}, set(logs[step]["degraded"]),
                         {int(t): w for t, w in logs[step]["attention"].items()})


def _from_policy(policy: MeCeFOPolicy, replicas: int):
    def plans(step):
        sync = policy.plan(StepView(step, frozenset(range(replicas)), replicas, 1))
        degraded = {mb.index for mbs in sync.work.values() for mb in mbs if not mb.keep and NEIGHBOR in mb.tags}
        return sync.counted(), degraded, sync.group_weights.get(MHA_GROUP, {})

    return plans


def _assert_bitwise(got, want):
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k}: max |diff| {float((got[k] - want[k]).abs().max()):.3g}"


@pytest.mark.slow
def test_with_failures_the_run_is_the_planned_math_and_its_deviation_is_bounded_and_reported():
    # tau = 1: each degraded step refreshes V1, wherever it runs; the replay projects the low-rank gradient per
    # micro-batch, so the run does too here (bitwise); the deferred projection is the same sum up to rounding
    # (test_mecefo_approx)
    mc = MeCeFOConfig(rank=8, tau=1, monitor_every=1, defer_projection=False)
    timeline = FailureTimeline.of(Failure(1, 1, 3), Failure(3, 4, 6), Failure(0, 5, 6))
    cfg = _cfg(steps=7, mecefo=mc, timeline=timeline, return_state=True)
    res = run_failover(cfg)
    assert res.agree and [lg["neighbors"] for lg in res.step_logs] == [[], [2], [2], [], [0], [1], []]
    # step 5: workers 3 and 0 out, neighbors 0 -> (0 is out) 1 for both: 1 carries 3 slices, 2 is the only exact one
    assert res.step_logs[5]["work"] == {"0": 0, "1": 3, "2": 1, "3": 0} and res.step_logs[5]["attention_weights"] == [0.0, 1.0]
    got = res.states[0]
    _assert_bitwise(got, _replay(cfg, _from_policy(MeCeFOPolicy(mc, timeline), cfg.workers)))

    # against the fault-free run: the deviation (reported), and the gradient error on every degraded step (bounded)
    # (the fault-free elastic run is bitwise the one-process run of the same global batch)
    plain = Trainer(trainer_config(cfg), progress=False)
    init = plain.state_dict_for_compare(optimizer=False)
    for _ in range(cfg.steps):
        plain.train_step()
    free = plain.state_dict_for_compare(optimizer=False)
    dev = math.sqrt(sum(float((got[k] - free[k]).pow(2).sum()) for k in free))
    moved = math.sqrt(sum(float((free[k] - init[k]).pow(2).sum()) for k in free))
    errs = [lg["grad_rel_error"] for lg in res.step_logs if "grad_rel_error" in lg]
    print(f"\nMeCeFO vs fault-free after {cfg.steps} steps with {len(errs)} degraded: parameter deviation {dev:.3g} "
          f"(the fault-free run moved {moved:.3g}); gradient relative errors {[round(e, 3) for e in errs]}")
    assert len(errs) == 4 and all(0 < e < 0.6 for e in errs)  # Assumption 3: bounded (the paper reports < 0.6)
    assert 0 < dev < moved


@pytest.mark.slow
def test_spread_over_two_neighbors_with_a_real_kill_is_the_planned_math():
    # 4 workers x 2 micro-batches, spread auto: an out worker's 2 slices go to the next 2 workers up (one worker
    # stays nobody's neighbor, for the attention gradient). Worker 1 is SIGKILLed mid-step 1 (its slices finished
    # by 2 and 3 in that step), out until its rejoin; worker 3 is out (simulated) at step 5: 0 and 1 carry it.
    mc = MeCeFOConfig(rank=8, tau=1, monitor_every=1, defer_projection=False, spread="auto")
    cfg = _cfg(steps=7, grad_accum=2, mecefo=mc, timeline=FailureTimeline.of(Failure(1, 1, 3, real=True), Failure(3, 5, 6)),
               return_state=True)
    res = run_failover(cfg)
    assert not res.errors and res.agree and res.global_restarts == 0
    kill, out = res.step_logs[1], res.step_logs[2]
    assert kill["failed"] == [1] and kill["work"] == {"0": 2, "2": 3, "3": 3}
    assert kill["degraded"] == [2, 3]  # 1's two slices, one each on 2 and 3; their own were computed exactly
    assert kill["attention"]["2"] == kill["attention"]["3"] == 0.0 and kill["attention"]["0"] == 1 / 6
    assert out["neighbors"] == [2, 3] and out["work"] == {"0": 2, "2": 3, "3": 3}
    assert out["attention"] == {"0": 0.5, "1": 0.5, "2": 0.0, "3": 0.0, "4": 0.0, "5": 0.0, "6": 0.0, "7": 0.0}
    assert res.step_logs[5]["out"] == [3] and res.step_logs[5]["neighbors"] == [0, 1]
    _assert_bitwise(res.states[0], _replay(cfg, _from_logs(res)))


@pytest.mark.slow
def test_a_survivor_killed_while_it_waits_for_the_rejoin_does_not_block_the_returning_worker():
    # worker 1 is SIGKILLed at step 2 and returns at step 4; the survivors hold at step 4 until its new process
    # starts. Worker 2 is SIGKILLed from outside while it holds there: the new worker 1 must still start its step
    # and release the others (with a multiprocessing Event, its set() blocks for good on the dead waiter)
    steps = 6
    cfg = _cfg(method="elastic", steps=steps, timeline=FailureTimeline.of(Failure(1, 2, 4, real=True)),
               timeout_s=10.0, rejoin_wait_s=30.0)
    pids: dict[int, int] = {}
    shot: list[int] = []

    def kill_the_waiting_survivor(kind, r, info):
        if kind == "started":
            pids[r] = info["pid"]
        elif kind == "step" and r == 2 and info["step"] == 3 and not shot:
            time.sleep(0.3)  # inside its hold at step 4 by now (the new worker 1 takes longer to start)
            shot.append(pids[2])
            kill_pid(pids[2])

    res = run_failover(cfg, progress=kill_the_waiting_survivor)
    assert shot, "worker 2 was not killed at its hold"
    assert [(d["worker"], d["cause"]) for d in res.deaths] == [(1, "kill"), (2, "signal")]
    assert [lg["step"] for lg in res.step_logs] == list(range(steps))
    [rejoin] = res.rejoins
    assert rejoin["worker"] == 1 and rejoin["step"] == 4
    assert sorted(res.final) == [0, 1, 3] and res.agree and not res.errors


def test_bad_run_configs_are_refused():
    from trainguard.errors import TrainguardError

    with pytest.raises(TrainguardError, match="unknown method"):
        _cfg(method="magic").validate()
    with pytest.raises(TrainguardError, match="outside"):
        _cfg(timeline=FailureTimeline.of(Failure(7, 1, 2))).validate()
    with pytest.raises(TrainguardError, match="steps"):
        _cfg(steps=0).validate()
