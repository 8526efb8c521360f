"""Run by torchrun in the multi-process trainer tests: train one config and save this rank's result.

    python -m torch.distributed.run --nproc_per_node=N _dist_worker.py OUT MODE [--section.key value ...]

MODE is ``clean``, ``stock`` (pipeline: torch's Schedule1F1B instead of ours), ``windows`` (count the waits our
schedule exposes), ``stop:K`` (train K steps, then stop: the checkpoint at K is written), ``retry:R:K:before`` (rank
R asks for a retry of step K after a NaN was injected into one of its backward products: the guard acts before the
update) or ``retry:R:K:after`` (a NaN in rank R's gradient after the gradient sync, seen by a guard after the
update), or ``abft:L`` (ABFT on, one NaN in layer L's scores at step 1), or ``suspect:R:K:STAGE[:Q]`` (a guard on rank R,
or on each of the comma-separated ranks R, stops the run as suspected hardware at step K, raising from its look at
STAGE: before, after; settle: a state hook, when the state is read at step_idx K; Q: rank Q asks for a retry of step
K in the same look, as ``retry:Q:K:before``, ``-`` for none; V: rank V is SIGKILLed in its ``on_stop``, given as
``suspect:R:K:STAGE:Q:V``) or ``dmrstop:R:K:OP:N`` (DMR on, N faults in rank R's verifier executions
of OP at step K, each writing a value of its own: no two executions agree) or ``campaignstop`` (a DMR campaign of
two trials, the first of which stops on rank 1). Each rank writes
``OUT/rank{r}.pt``: parameters and optimizer state, per-step losses and attempts, the run summary and ABFT counters,
and (the stop modes) how the run stopped on that rank.
"""

import os
import signal
import sys

import torch

from tests.sdc.dmr._spy import spy_mismatches
from trainguard.config import load_config
from trainguard.errors import StepAborted, SuspectedHardwareFault
from trainguard.faults import Fault, FaultModel, Injector, ModuleSite, OpSite, ProductSite, TensorSite
from trainguard.sdc.runtime import attach_from_config
from trainguard.train import StepGuard, Trainer, Verdict

out, mode, *overrides = sys.argv[1:]
gone = None
if mode.startswith("dmrgone:"):  # dmrgone:G:R:K:PHASE:N: as dmrocc:R:K:PHASE:N, and when the rewind comes, rank G's
    # copy of the state it goes back to is gone (as after two faults at once: a wrong update and a carried check)
    _, gone, rest = mode.split(":", 2)
    gone, mode = int(gone), f"dmrocc:{rest}"
torch.set_num_threads(1)
cfg = load_config(None, overrides)
trainer = Trainer(cfg)
waits: list[str] = []
if mode == "stock":  # torch's own Schedule1F1B on the same stage (the reference for our windowed schedule)
    from torch.distributed.pipelining import Schedule1F1B

    s = trainer.strategy.schedule
    trainer.strategy.schedule = Schedule1F1B(s._stage, s._n_microbatches, loss_fn=s._loss_fn, scale_grads=False)
elif mode == "windows":
    trainer.strategy.add_window_hook(lambda kind, wait: waits.append(kind) or wait())
handles = attach_from_config(trainer)
steps: list[dict] = []


class Log:
    def on_step_end(self, t, r):
        steps.append({"step": r.step, "loss": r.loss, "attempts": r.attempts,
                      "retries": [(x.get("site"), bool(x.get("rewind"))) for x in r.retries]})


class RetryOnRank(StepGuard):
    """Registered on every rank; only rank R at step K, first attempt, sees its fault and asks to retry."""

    name = "retry-on-rank"

    def __init__(self, rank, step, after):
        self.rank, self.step, self.inspects_update = rank, step, after

    def _look(self, ctx, tensors):
        bad = ctx.trainer.rank == self.rank and any(not torch.isfinite(x).all() for x in tensors)
        return Verdict.retry(site="nan", reason="non-finite") if bad else Verdict.commit()

    def before_update(self, ctx):
        if self.inspects_update:
            return Verdict.commit()
        return self._look(ctx, [p.grad for p in ctx.trainer.model.parameters() if p.grad is not None])

    def after_update(self, ctx):
        return self._look(ctx, list(ctx.trainer.model.parameters()))


class StopOnRank(StepGuard):
    """Registered on every rank; rank R raises SuspectedHardwareFault from its look at step K (``stops_after_update``:
    the look after the update, as a guard that kept a stop found in the middle of it). Every rank records the
    ``on_stop`` calls it gets."""

    name = "stop-on-rank"

    def __init__(self, ranks, step, stage, kill=None):
        self.ranks, self.step, self.stage, self.heard, self.kill = ranks, step, stage, [], kill
        self.stops_after_update = stage == "after"

    def _look(self, ctx, stage):
        if ctx.trainer.rank in self.ranks and ctx.step == self.step and stage == self.stage:
            raise SuspectedHardwareFault(f"test: rank {ctx.trainer.rank} stops at step {self.step} ({stage} the update)")
        return Verdict.commit()

    def before_update(self, ctx):
        return self._look(ctx, "before")

    def after_update(self, ctx):
        return self._look(ctx, "after")

    def on_stop(self, ctx, verdict):
        if ctx.trainer.rank == self.kill:  # killed in the middle of the stop, its peers already told
            os.kill(os.getpid(), signal.SIGKILL)
        self.heard.append((ctx.step, verdict.rank, verdict.action.name, verdict.reason))


trainer.callbacks.append(Log())
halt: dict = {}  # how the run stopped (the stop modes)


def flip(site, step) -> Injector:
    """One bit flip in the exponent of an element that ``site`` writes at ``step`` (the DMR modes' fault)."""
    return Injector(Fault(site, FaultModel("bitflip", field="exponent"), step=int(step)), seed=1).attach(trainer)


n_steps = None
if mode.startswith("stop:"):
    n_steps = int(mode.split(":")[1])
elif mode.startswith("retry:"):
    _, rank, step, when = mode.split(":")
    rank, step = int(rank), int(step)
    trainer.add_guard(RetryOnRank(rank, step, when == "after"))
    if trainer.rank == rank:
        site = OpSite("aten.mm*", "backward", 0) if when == "before" else TensorSite("grad", "*")
        Injector(Fault(site, FaultModel("nan"), step=step, index=0)).attach(trainer)
elif mode.startswith("dmr:"):  # dmr:R:K:PHASE: a bit flip in rank R's PHASE ops at step K, DMR on
    _, rank, step, phase = mode.split(":")
    if trainer.rank == int(rank):
        site = OpSite("*", phase, 5, compute_only=True)
        injector = flip(site, step)
elif mode.startswith(("dmrocc:", "dmrloop:")):  # dmrocc:R:K:PHASE:N[:S]: a bit flip in rank R's N-th PHASE op at
    # step K, DMR on (S: run S steps only); dmrloop: the same, the steps run by train_step() (not run(): the last
    # one may carry checks, settled when the state is read at the end)
    _, rank, step, phase, occ, *stop = mode.split(":")
    n_steps = int(stop[0]) if stop else None
    if trainer.rank == int(rank):
        site = OpSite("*", phase, int(occ), compute_only=True)
        injector = flip(site, step)
elif mode.startswith("dmrsite:"):  # dmrsite:R:K:OP:PHASE:N: a bit flip in rank R's N-th op matching OP at step K
    _, rank, step, op, phase, occ = mode.split(":")
    if trainer.rank == int(rank):
        site = OpSite(op, phase, int(occ), compute_only=True)
        injector = flip(site, step)
elif mode.startswith("dmradam:"):  # dmradam:R:K: a bit flip in what rank R's fused AdamW writes at step K
    _, rank, step = mode.split(":")
    if trainer.rank == int(rank):
        site = OpSite("aten._fused_adamw_*", "optimizer", 0, compute_only=True)
        injector = flip(site, step)
elif mode.startswith("dmrmany:"):  # dmrmany:K:P0,P1,...: a bit flip in each rank r's phase Pr ops at step K, all
    # in the same step ("-": none on that rank), DMR on
    _, step, phases = mode.split(":")
    phase = phases.split(",")[trainer.rank]
    if phase != "-":
        site = OpSite("*", phase, 5 + trainer.rank, compute_only=True)
        injector = flip(site, step)
elif mode.startswith("dmrroute:"):  # dmrroute:R:K: rank R's first router output at step K pushed to 1e4 (routing)
    _, rank, step = mode.split(":")
    if trainer.rank == int(rank):
        site = ModuleSite("*router", 0)
        injector = Injector(Fault(site, FaultModel("value", value=1e4), step=int(step), index=1)).attach(trainer)
elif mode.startswith("dmragc:"):  # dmragc:R:K: a bit flip at step K in rank R's first backward op that the plan
    # (made in step 0) checks by an AGC segment's replay; run by train_step(), as dmrloop
    _, agc_rank, agc_step = mode.split(":")
elif mode.startswith("dmrwin:"):  # dmrwin:R:K:KIND: a bit flip at step K in rank R's first op that the plan
    # (made in step 0) defers into a window of KIND (pp, dp); run by train_step(), as dmrloop
    _, win_rank, win_step, win_kind = mode.split(":")
elif mode.startswith("suspect:"):
    _, ranks, step, stage, *extra = mode.split(":")
    ranks = {int(r) for r in ranks.split(",")}
    retry = [q for q in extra[:1] if q != "-"]
    stopper = StopOnRank(ranks, int(step), stage, kill=int(extra[1]) if len(extra) > 1 else None)
    trainer.add_guard(stopper)
    if retry:  # rank Q's NaN in a backward product, seen before the update of the same step
        trainer.add_guard(RetryOnRank(int(retry[0]), int(step), False))
        if trainer.rank == int(retry[0]):
            Injector(Fault(OpSite("aten.mm*", "backward", 0), FaultModel("nan"), step=int(step), index=0)).attach(trainer)
    if stage == "settle":  # rank R's pending checks fail when the state is read at step_idx K (an evaluation)

        def pending_check_fails(event, step=int(step)):
            if trainer.rank in ranks and trainer.step_idx == step and event == "read":
                raise SuspectedHardwareFault(f"test: rank {trainer.rank} stops at step {step} (settle the update)")

        trainer.add_state_hook(pending_check_fails)
elif mode.startswith("dmrstop:"):
    _, rank, step, op, n = mode.split(":")
    if trainer.rank == int(rank):
        faults = [Fault(OpSite(op, "any", k, verifier=True), FaultModel("value", value=(-3.0) ** k * 1e6), step=int(step))
                  for k in range(int(n))]
        injector = Injector(faults, seed=3).attach(trainer)
elif mode.startswith("abft:"):
    layer = int(mode.split(":")[1])
    # (row 1, column 1) of the first head's scores: kept by the causal mask
    fault = Fault(ProductSite("scores", layer=layer), FaultModel("nan"), step=1, index=cfg.data.seq_len + 1)
    injector = Injector(fault).attach(trainer)
agc: dict = {}
ids: dict = {}
if gone == trainer.rank:
    real_restore = handles["dmr"].restore_before_update

    def copy_gone(step, eng=handles["dmr"]):
        eng._pre_start = eng._spare_start = None
        return real_restore(step)

    handles["dmr"].restore_before_update = copy_gone
if mode.startswith("dmrmany:"):  # every mismatch any check reports: (step, op id, strategy, detail)
    real_mismatch = handles["dmr"]._mismatch

    def seen_mismatch(op_id, name, phase, strategy, detail, eng=handles["dmr"]):
        agc.setdefault("mismatches", []).append((eng.step, op_id, strategy, detail))
        real_mismatch(op_id, name, phase, strategy, detail)

    handles["dmr"]._mismatch = seen_mismatch
if mode.startswith("dmragc:"):
    trainer.train_step()  # step 0: profiled, planned, re-executed under the plan
    eng = handles["dmr"]
    segments = eng.plan.agc_segments
    agc.update(segments=len(segments), mismatches=spy_mismatches(eng))  # (with the strategy that found each)
    ops = [o for a in segments for o in a.bw_ops if o.startswith("backward:")]
    if trainer.rank == int(agc_rank) and ops:
        agc["op"] = op = ops[0]
        name = next(o.name for o in eng.profile.ops if o.id == op)
        same = [o.id for o in eng.profile.ops if o.phase == "backward" and o.name == name]  # (as the injector counts)
        site = OpSite(name, "backward", same.index(op), compute_only=True)
        injector = flip(site, agc_step)
    for _ in range(1, cfg.train.steps):
        trainer.train_step()
    trainer.settle()
    summary = None
elif mode.startswith("dmrwin:"):
    trainer.train_step()  # step 0: profiled, planned, re-executed under the plan
    eng = handles["dmr"]
    planned = {i: o.window for i, o in eng.plan.ops.items() if o.window and o.strategy.startswith("d-")}
    agc.update(windows=sorted({w for w in planned.values()}), mismatches=spy_mismatches(eng))
    ops = [i for i, w in planned.items() if w.startswith(win_kind + ":")]
    if trainer.rank == int(win_rank) and ops:
        # The fault is aimed by the engine's own op id (an injector counts ops by name, and which op its count
        # lands on can differ from the profile's order): one exponent bit of the op's output, flipped right after
        # its primary execution, outside the dispatcher (no version bump), as a faulty unit would leave it.
        import numpy as np
        from torch.utils._python_dispatch import _disable_current_modes

        op = min(ops, key=lambda i: next(o.start_s for o in eng.profile.ops if o.id == i))
        rec = next(o for o in eng.profile.ops if o.id == op)
        agc["op"] = (op, rec.name, rec.phase, planned[op])
        injector = type("Flips", (), {"records": []})()
        real_defer = eng._defer

        def defer(op_id, *args, **kwargs):
            out = real_defer(op_id, *args, **kwargs)
            if op_id == op and eng.step == int(win_step) and not injector.records:
                with _disable_current_modes():
                    t = out if isinstance(out, torch.Tensor) else next(x for x in out if isinstance(x, torch.Tensor))
                    bits = t.detach().numpy().view(np.int32)  # (float32: the same memory, read as words)
                    bits[(0,) * bits.ndim] ^= 1 << 29
                injector.records.append((eng.step, op_id))
            return out

        eng._defer = defer
    for _ in range(1, cfg.train.steps):
        trainer.train_step()
    trainer.settle()
    if "injector" in globals():
        agc["fired"] = list(injector.records)
    summary = None
elif mode.startswith("dmrids:"):  # dmrids:N: step 0 profiled and planned, then N steps: their op ids against the plan's
    trainer.train_step()
    eng = handles["dmr"]
    profiled = {o.id: o.name for o in eng.profile.ops}
    eng.cfg.coverage = True
    for _ in range(int(mode.split(":")[1])):
        trainer.train_step()
        run = [(i, n) for i, n, phase, _, _ in eng.coverage if i != "-" and phase not in ("setup", "optimizer")]
        ids.setdefault("steps", []).append({"static": sum(":dyn:" not in i and i in profiled for i, _ in run),
                           "shifted": [(i, n) for i, n in run if ":dyn:" not in i and profiled.get(i, n) != n],
                           "dynamic": sum(":dyn:" in i for i, _ in run)})
    ids["profiled_dynamic"] = sum(":dyn:" in i for i in profiled)
    trainer.settle()
    summary = None
elif mode.startswith("dmrloop:"):
    for _ in range(n_steps or cfg.train.steps):
        trainer.train_step()
    trainer.settle()  # on every rank, as a checkpoint or an evaluation would
    summary = None
elif mode == "campaignstop":  # a two-trial DMR campaign whose first trial stops as suspected hardware on rank 1
    from trainguard.sdc.dmr import campaign

    real_run, trials = campaign._run, []

    def first_trial_stops(cfg_, steps_, faults, seed, **kw):
        if kw.get("may_stop"):  # (a trial, not a reference run)
            if not trials:  # the first: the faults of dmrstop:1:1:aten._foreach_mul_*:4 instead of the drawn ones
                faults = {1: [Fault(OpSite("aten._foreach_mul_*", "any", k, verifier=True),
                                    FaultModel("value", value=(-3.0) ** k * 1e6), step=1) for k in range(4)]}
            trials.append(seed)
        return real_run(cfg_, steps_, faults, seed, **kw)

    campaign._run = first_trial_stops
    halt["campaign"] = campaign.run_rank({"overrides": overrides, "trials": 2, "seed": 5, "phase": "backward",
                                          "steps": 2, "model": cfg.model.preset})
    summary = None
elif mode.startswith(("suspect:", "dmrstop:")) or gone is not None:  # every rank must stop, none left waiting
    try:
        trainer.run(n_steps)
    except (SuspectedHardwareFault, StepAborted) as err:
        halt["message"], halt["step"], halt["kind"] = str(err), trainer.step_idx, type(err).__name__
    try:  # (a stopped run's state is not verified: reading it is refused)
        trainer.state_dict_for_compare()
    except SuspectedHardwareFault as err:
        halt["refused"] = str(err)
    halt["heard"] = stopper.heard if "stopper" in globals() else None
    halt["fired"] = len(injector.records) if "injector" in globals() else 0
    summary = None
else:
    summary = trainer.run(n_steps)
trainer.close()
abft = handles["abft"].total() if "abft" in handles else {}
fired = bool(mode.startswith(("abft:", "dmr:", "dmrmany:", "dmrocc:", "dmrloop:", "dmrsite:", "dmradam:", "dmrroute:",
                              "dmragc:", "dmrwin:"))
             and "injector" in globals()
             and injector.records)
dmr = handles.get("dmr")
sched = getattr(trainer.strategy, "schedule", None)
torch.save({"state": {} if halt.get("message") else trainer.state_dict_for_compare(), "steps": steps, "stop": halt,
            "summary": summary.to_dict() if summary else {},
            "abft": abft,
            "fired": fired, "rank": trainer.rank, "waits": waits,
            "dmr": dict(dmr.totals) if dmr else {}, "dmr_coverage": dmr.coverage_report()["coverage"] if dmr else None,
            "dmr_counts": dict(dmr.counts) if dmr else {}, "wait_s": getattr(sched, "wait_s", 0.0), "agc": agc,
            "ids": ids},
           f"{out}/rank{trainer.rank}.pt")
