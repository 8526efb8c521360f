"""The training loop: one ``Trainer`` for every parallel strategy, its step split into named stages.

::

    train_step()                                  one committed optimizer step
      for each attempt (a retry re-executes the step from its start):
        plan              strategy.plan             which slices of the global batch this rank computes
        forward_backward  strategy.forward_backward  loss and gradients (synchronised across replicas)
        guards            before_update            every StepGuard, verdicts reduced over all ranks
        commit vote       strategy.should_commit    torchft's should_commit on elastic runs
        update            clip + optimizer + scheduler
        guards            after_update             only guards with ``inspects_update``
      commit             step_idx += 1, callbacks' on_step_end, guards' on_commit
    run()                 train_step() until train.steps, then log (metrics.jsonl), evaluate, checkpoint

Parallelism is a strategy the Trainer is built with (:mod:`trainguard.train.parallel`): single process,
DDP, pipeline (+ DP on a 2-D mesh), elastic torchft. Techniques plug in through public seams only:
``add_guard`` (:mod:`trainguard.train.guards`), ``register_state`` (:mod:`trainguard.train.state`),
``step_contexts`` (context managers around each attempt: the fault injector), ``callbacks``
(``on_step_start(trainer, step)`` before every attempt, ``on_stage(trainer, stage, step)`` after the ``plan``,
``forward_backward`` and ``update`` stages, ``on_step_end(trainer, result)`` after the commit),
``metric_sources`` (counters merged into every metrics record), ``add_state_hook`` (settle verifications
still pending on the state before a checkpoint, an evaluation, ``state_dict``, a load or the end of ``run()``:
DMR's update check held into the next iteration), activation-checkpoint contexts
(:func:`trainguard.train.activation_checkpoint.add_checkpoint_context`) and the model's kernel slots and
product hooks (:mod:`trainguard.models`).

Python's automatic garbage collection is off while a step runs (``[train] gc``, :mod:`trainguard.train.garbage`).
With no guard registered the step takes no snapshot and runs no extra collective. With guards, a step
captures RNG and registered components at its start (cheap); parameters and optimizer state are copied
only when some guard ``inspects_update``. Batches are a pure function of (seed, step, slice), so a
retried, resumed or re-sharded step replays exactly the same tokens. Relies on torch (optim, amp
autocast, DCP through ``checkpoint.py``) and rich (progress bar, through ``trainguard.utils``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import torch

from trainguard.data import PackedBatches
from trainguard.errors import CheckpointError, ConfigError, StepAborted, SuspectedHardwareFault, TrainguardError
from trainguard.models import build_model, lm_loss
from trainguard.train import checkpoint as ckpt_mod
from trainguard.train import garbage, run_lock
from trainguard.train import snapshot as snap_mod
from trainguard.train.activation_checkpoint import apply_activation_checkpointing
from trainguard.train.checkpoint import CheckpointManager
from trainguard.train.config import SCHEDULE_KEYS, resume_differences
from trainguard.train.device import device_named
from trainguard.train.guards import Action, StepContext, StepGuard, Verdict, worst
from trainguard.train.host_memory import retain_freed_memory
from trainguard.train.metrics import MetricsLogger, peak_memory_mb
from trainguard.train.optim import WarmupCosine, build_optimizer, build_scheduler
from trainguard.train.parallel import Strategy, build_strategy, dist_env
from trainguard.train.parallel.base import MicroBatch
from trainguard.train.snapshot import StepSnapshot
from trainguard.train.state import Stateful, StateRegistry, StepStart, copy_state


@dataclass
class StepResult:
    """One committed optimizer step. ``loss`` / ``grad_norm`` read the device tensors lazily (one sync)."""

    step: int
    loss_t: torch.Tensor = field(repr=False)
    grad_norm_t: torch.Tensor | None = field(repr=False)
    lr: float
    tokens: int
    step_time_s: float
    micro_batches: int = 1
    attempts: int = 1  # 1 + the re-executions guards asked for
    retries: list[dict[str, Any]] = field(default_factory=list)  # the verdicts that caused them

    @property
    def planned_retries(self) -> int:
        """Re-executions a guard planned (DMR's profiled attempts), not caused by a failure."""
        return sum(1 for x in self.retries if x.get("planned"))

    @property
    def loss(self) -> float:
        return float(self.loss_t)

    @property
    def grad_norm(self) -> float:
        return float(self.grad_norm_t) if self.grad_norm_t is not None else float("nan")

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss)


@dataclass
class RunSummary:
    """What ``run()`` did (``summary.json``; docs/outputs.md). Steps count optimizer steps done: ``start_step``
    and ``end_step`` are the steps completed before and after this run, as in checkpoint names."""

    steps_run: int = 0
    start_step: int = 0
    end_step: int = 0
    first_loss: float | None = None
    final_loss: float | None = None
    val_loss: float | None = None
    val_ppl: float | None = None
    tokens: int = 0
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    peak_mem_mb: float = 0.0
    first_nonfinite_step: int | None = None
    stopped_early: bool = False
    stop_reason: str | None = None  # "nonfinite loss", "preempted" (SIGTERM), "interrupted" (Ctrl-C)
    already_finished: bool = False  # resumed at or beyond train.steps: nothing was trained or written
    checkpoint: str | None = None
    resumed_from: str | None = None
    resume_changes: dict[str, Any] = field(default_factory=dict)  # key -> [saved, new]
    run_id: str = ""
    metrics_path: str | None = None
    device: str = "cpu"
    world_size: int = 1
    strategy: str = "single"
    model: str = ""
    params: int = 0
    retries: int = 0  # re-executions asked for because something failed (a detection, a derailed step)
    planned_retries: int = 0  # re-executions a guard planned (DMR's profiled attempts of the first step)
    suspected_hardware: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during ``Trainer.run``: carries the number of steps done when it came."""

    def __init__(self, step: int):
        super().__init__(f"interrupted at step {step}")
        self.step = step


def resolve_device(cfg, local_rank: int = 0) -> torch.device:
    return device_named(cfg.train.device, local_rank, "train.device")


class Trainer:
    """``Trainer(cfg, model=None, batches=None, strategy=None)``; ``cfg`` is a ``TrainerConfig`` (or the
    ``RunConfig`` that extends it). See the module docstring for the stages and seams."""

    def __init__(self, cfg, model: torch.nn.Module | None = None, batches: PackedBatches | None = None, *,
                 strategy: Strategy | None = None, progress: bool | None = None):
        self.cfg = cfg
        self.step_contexts: list[Callable[[int], contextlib.AbstractContextManager]] = []
        self.callbacks: list[object] = []
        # callables returning a flat dict of counters (ABFT detected/corrected, ...) merged into every
        # metrics record and into the run summary's ``extra``
        self.metric_sources: list[Callable[[], dict[str, Any]]] = []
        self.guards: list[StepGuard] = []
        # callables ``fn(event)`` run before the model and optimizer state is read ("read": checkpoint,
        # evaluation, state_dict, the end of run()) or replaced ("write": a load or a restore) from outside the
        # step loop: a technique that verifies an update later settles it here, and drops copies it keeps
        self.state_hooks: list[Callable[[str], None]] = []
        self.state = StateRegistry()
        self.step_idx = 0
        self.stop_on_nan = False  # stop run() at the first non-finite loss (the step's result is kept)
        self.show_progress = cfg.output.progress if progress is None else progress
        self.resumed_from: str | None = None
        self.resume_changes: dict[str, list[Any]] = {}  # key -> [saved, new] of the resumed checkpoint's config
        self.run_id = uuid.uuid4().hex[:12]  # written into every checkpoint; a resumed run takes the checkpoint's
        self.preempt_requested = False  # set by SIGTERM during run(): checkpoint at the next step boundary and stop
        # the last committed step's start (step, RNG/data/components, scheduler and optimizer scalars): what a
        # rewind verdict goes back to (a guard's check of that step ran after its update and failed)
        self._prev: tuple[int, StepStart, dict[str, Any]] | None = None
        self._redoing = False
        self._stop_error: SuspectedHardwareFault | None = None  # this rank's, while its SUSPECT verdict is reduced
        self._run_end: int | None = None  # the step run() stops at (None outside run())
        if cfg.checkpoint.resume and not cfg.checkpoint.dir:
            raise ConfigError("checkpoint.resume is true but checkpoint.dir is empty")

        self.strategy = strategy if strategy is not None else build_strategy(cfg)
        self.device = resolve_device(cfg, dist_env()[2])
        if cfg.train.host_memory == "retain" and self.device.type == "cpu":
            retain_freed_memory()  # (before the process group starts its threads: see host_memory's M_ARENA_MAX)
        self.strategy.init(self)
        if cfg.checkpoint.dir:  # before any work: not at the first save, after training (output.dir: in run())
            check_writable(Path(cfg.checkpoint.dir), "checkpoint.dir")
        if self.world == 1 and cfg.distributed.dp > 1 and self.strategy.name in ("single", "ddp") and self.is_main:
            sys.stderr.write(f"trainguard: note: distributed.dp={cfg.distributed.dp} but not launched under "
                             "torchrun; running one process on the same global batch\n")
        torch.manual_seed(cfg.train.seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed_all(cfg.train.seed)
        self.model = model if model is not None else build_model(cfg.model_config(), seed=cfg.train.seed)
        self.strategy.setup(self)  # may split the model into this rank's pipeline stage
        self.model.to(self.device)
        self.model.train()
        apply_activation_checkpointing(self.model, cfg.train.activation_checkpoint, cfg.train.selective_ops)
        self.strategy.wrap(self)  # DDP wrapping, pipeline stage and schedule (after activation checkpointing)
        self.batches = batches if batches is not None else PackedBatches.from_config(cfg.data)
        self.grad_accum = cfg.train.grad_accum
        self.strategy.check_batch(self)
        self.optimizer = build_optimizer(self.model, cfg.train, fused=self.strategy.fused_optimizer(self))
        # the configured hyper-parameters of each group: a resumed run applies these, not the saved ones
        self._group_hparams = [{k: g[k] for k in ("betas", "weight_decay", "eps") if k in g}
                               for g in self.optimizer.param_groups]
        self.scheduler = build_scheduler(self.optimizer, cfg.train)
        self.autocast_dtype = torch.bfloat16 if cfg.train.dtype == "bf16" else None
        self.tokens_per_step = self.batches.batch_size * self.batches.seq_len  # global
        self._unlock: weakref.finalize | None = None  # (checkpoint.dir's lock, held while this trainer lives)
        self._unlock_output: weakref.finalize | None = None  # (output.dir's, from its first run(): the same)
        self.ckpt = (CheckpointManager(cfg.checkpoint.dir, cfg.checkpoint.keep, run_id=self.run_id, note=self._note)
                     if cfg.checkpoint.dir else None)
        if self.ckpt is not None:
            try:
                self._open_checkpoint_dir()
            except BaseException:
                if self._unlock is not None:  # (no trainer: the folder is free again at once, not when collected)
                    self._unlock()
                raise

    # ---- properties and seams ------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.strategy.rank

    @property
    def world(self) -> int:
        return self.strategy.world

    @property
    def is_main(self) -> bool:
        return self.strategy.is_main

    @property
    def forward_module(self) -> torch.nn.Module:
        return self.strategy.forward_module(self)

    def _note(self, text: str) -> None:
        if self.is_main:
            sys.stderr.write(f"trainguard: note: {text}\n")

    def add_guard(self, guard: StepGuard) -> Callable[[], None]:
        """Register a step guard (on every rank); returns a remover."""
        self.guards.append(guard)
        return lambda: self.guards.remove(guard) if guard in self.guards else None

    def add_state_hook(self, fn: Callable[[str], None]) -> Callable[[], None]:
        """Run ``fn("read")`` / ``fn("write")`` before the state is read / replaced from outside the step loop
        (see ``state_hooks``); returns a remover."""
        self.state_hooks.append(fn)
        return lambda: self.state_hooks.remove(fn) if fn in self.state_hooks else None

    def settle(self, event: str = "read") -> None:
        """Complete every verification still pending on the current state (``state_hooks``)."""
        for fn in list(self.state_hooks):
            fn(event)

    def _settle_together(self) -> None:
        """:meth:`settle` where every rank settles at once (in :meth:`run`: before an evaluation, a checkpoint and
        at the end). A stop found while settling on one rank (a held check of the last update) is reduced like a
        guard's, so the others stop with it rather than wait for it in the evaluation's or the checkpoint's
        collective. A collective on every rank of a run whose guards or state hooks could stop it."""
        if self.world == 1 or not (self.guards and self.state_hooks) or not self.strategy.spans_default_group():
            self.settle()
            return
        local = Verdict.commit()
        try:
            self.settle()
        except SuspectedHardwareFault as err:
            local = self._suspect_verdict(err, "settle", "settle")
        verdicts = self.strategy.reduce_verdicts(self, local)
        if verdicts:
            self._stop_together(StepContext(self, self.step_idx, 0, stage="settle"), worst(verdicts))

    def register_state(self, name: str, component: Stateful) -> Callable[[], None]:
        """Register a stateful component: snapshotted for retries, saved in checkpoints, sent when healing.
        A component registered after a resume (a technique switched on once the trainer exists) gets its saved
        state at once."""
        remove = self.state.register(name, component)
        saved = getattr(self, "_resumed_components", {}).get(name)
        if saved is not None:
            component.load_state_dict(saved)
        return remove

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    # ---- one step --------------------------------------------------------------------------------
    def micro_batch(self, step: int, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of one planned slice, on the device."""
        x, y = self.batches.batch(step, mb.index, mb.n_slices)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def compute_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            logits = self.forward_module(x)
            loss = lm_loss(logits, y)
            aux = self.model.aux_loss() if hasattr(self.model, "aux_loss") else None
            if aux is not None:
                loss = loss + aux
        return loss

    def train_step(self) -> StepResult:
        """One committed optimizer step (every attempt a guard asks for included)."""
        with garbage.collect_after(self.cfg.train.gc == "step"):  # (no collection in the middle of the step)
            return self._train_step()

    def _train_step(self) -> StepResult:
        step = self.step_idx
        t0 = time.perf_counter()
        guarded = bool(self.guards)
        start = StepStart.capture(step, self.state) if guarded else None
        rewinds = any(g.may_rewind for g in self.guards)
        light = snap_mod.capture_counters(self.optimizer, self.scheduler) if rewinds else None
        inspects_update = any(g.inspects_update for g in self.guards)
        # (on several ranks a guard may report a stop it found during the update: every rank looks after it)
        looks_after = inspects_update or (self.world > 1 and any(g.stops_after_update for g in self.guards))
        retries: list[dict[str, Any]] = []
        previous: set[tuple[int, str]] = set()
        attempt = failed = 0  # attempts so far; re-executions asked for because something failed
        while True:
            ctx = StepContext(self, step, attempt)
            lr = self.optimizer.param_groups[0]["lr"]
            for cb in self.callbacks:
                fn = getattr(cb, "on_step_start", None)
                if fn is not None:
                    fn(self, step)
            for g in self.guards:
                g.on_step_start(ctx)
            update_snapshot: StepSnapshot | None = None
            grad_norm = None
            with contextlib.ExitStack() as stack:
                for make in self.step_contexts:
                    stack.enter_context(make(step))
                self.optimizer.zero_grad(set_to_none=True)
                plan = self.strategy.plan(self, step)
                if plan.step != step:  # elastic: this replica healed from a peer and goes on in the peer's step
                    step, lr = plan.step, self.optimizer.param_groups[0]["lr"]
                    ctx = StepContext(self, step, attempt)
                    start = StepStart.capture(step, self.state) if guarded else None
                    light = snap_mod.capture_counters(self.optimizer, self.scheduler) if rewinds else None
                self._stage("plan", step)
                try:
                    loss = self.strategy.forward_backward(self, plan)
                except Exception as err:  # a guard may know the cause (a detected fault that derailed the step)
                    verdicts, loss, committed = self._on_error(ctx, err), None, False
                    if not verdicts:
                        raise
                if loss is not None:  # (None: a guard explained an exception: retry below)
                    ctx.loss = loss
                    self._stage("forward_backward", step)
                    verdicts = self._guard("before_update", ctx) if guarded else []
                    committed = not verdicts and self.strategy.should_commit(self)
                if committed:
                    if inspects_update:
                        update_snapshot = snap_mod.capture(self.model, self.optimizer, self.scheduler, step)
                    grad_norm = self.strategy.grad_norm(self, self.cfg.train.grad_clip)
                    self.optimizer.step()
                    self.scheduler.step()
                    self._stage("update", step)
                    if looks_after:
                        verdicts = self._guard("after_update", ctx)
            if committed and not verdicts:
                break
            if not verdicts:  # the commit vote failed (a peer died): re-run the step with the new membership
                self._rollback(start, None)
                continue
            verdict = worst(verdicts)
            retries.append({"attempt": attempt, **verdict.to_dict()})
            if verdict.action == Action.SUSPECT:
                self._stop_together(ctx, verdict)
            if verdict.action == Action.ABORT:
                raise StepAborted(f"step {step}: {verdict.where()} asked to abort: {verdict.reason or 'no reason given'}")
            sites = {(v.rank, f"{v.guard}:{v.site}") for v in verdicts if v.action == Action.RETRY and not v.planned}
            repeated = sorted(sites & previous)
            if repeated:
                rank, site = repeated[0]
                raise SuspectedHardwareFault(
                    f"suspected persistent hardware fault: rank {rank}, {site} failed on {attempt + 1} consecutive "
                    f"executions of step {step} (re-executing on the same device will not help)")
            if sites:  # (re-executions every guard planned, DMR's profiled attempts, are not failures)
                if failed >= self.cfg.train.max_retries:
                    raise StepAborted(f"step {step}: still failing after {failed} re-executions "
                                      f"(train.max_retries); last: {verdict.where()}: {verdict.reason}")
                failed += 1
            previous = sites
            self._rollback(start, update_snapshot)
            for g in self.guards:
                g.on_retry(ctx, verdict)
            if verdict.rewind:  # the previous step's update read something wrong: it is re-executed first
                retries[-1]["rewound_to"] = step - 1
                self._redo_previous(ctx, step)
                start = StepStart.capture(step, self.state)
                light = snap_mod.capture_counters(self.optimizer, self.scheduler)
            attempt += 1
        self.step_idx = step + 1
        if rewinds:
            self._prev = (step, start, light)
        global_loss = self.strategy.global_loss(self, loss)
        result = StepResult(step, global_loss, grad_norm, lr, self.tokens_per_step, time.perf_counter() - t0,
                            len(plan.micro), attempt + 1, retries)
        done = StepContext(self, step, attempt, loss, "commit")
        for g in self.guards:
            g.on_commit(done)
        for cb in self.callbacks:
            fn = getattr(cb, "on_step_end", None)
            if fn is not None:
                fn(self, result)
        return result

    # ---- rewinding across a commit -----------------------------------------------------------------
    def carry_allowed(self, step: int) -> bool:
        """Whether a guard may leave checks of ``step`` to run after its update (in the next step): not when the
        state is read right after it (evaluation, checkpoint, preemption, the end of ``run()``), nor while a step
        is being re-executed for a rewind."""
        cfg = self.cfg
        nxt = step + 1
        return not (self._redoing or self.preempt_requested
                    or (self._run_end is not None and nxt >= self._run_end)
                    or (cfg.train.eval_every and nxt % cfg.train.eval_every == 0)
                    or (self.ckpt is not None and cfg.checkpoint.every and nxt % cfg.checkpoint.every == 0))

    def _redo_previous(self, ctx: StepContext, step: int) -> StepResult:
        """Back to the start of ``step - 1`` (guards restore parameters and optimizer tensors, the trainer the
        rest) and re-execute it, checked in full before its commit; the caller then re-executes ``step``."""
        if self._prev is None or self._prev[0] != step - 1:
            raise StepAborted(f"step {step}: a guard asked to rewind to step {step - 1}, whose start is not kept")
        k, start, light = self._prev
        self.optimizer.zero_grad(set_to_none=True)
        self._rewind_guards(ctx, k)
        snap_mod.restore_counters(light, self.optimizer, self.scheduler)
        start.restore(self.state)
        self.step_idx = k
        self._redoing = True
        try:
            return self.train_step()
        finally:
            self._redoing = False

    def _rewind_guards(self, ctx: StepContext, step: int) -> None:
        """Every guard's :meth:`StepGuard.on_rewind` to the start of ``step``. A guard that cannot put its part of
        the state back (its copy of that start is gone: DMR after two faults at once) raises ``StepAborted``. On
        several ranks that is reduced like a verdict, one more collective per rewind (every rank is here: the rewind
        was reduced), so that every rank stops with it rather than re-execute the step without it and wait for it
        in the step's first collective."""
        local = Verdict.commit()
        for g in self.guards:
            fn = getattr(g, "on_rewind", None)
            if fn is None:
                continue
            try:
                fn(ctx, step)
            except StepAborted as err:
                if self.world == 1:
                    raise
                self._stop_error = err
                local = replace(Verdict.abort("rewind", str(err)), guard=g.name, rank=self.rank)
                break
        if self.world > 1 and self.strategy.spans_default_group():
            verdicts = self.strategy.reduce_verdicts(self, local)
            if verdicts:
                self._stop_together(ctx, worst(verdicts))
        elif local.action != Action.COMMIT:  # (a strategy whose ranks decide on their own: this rank stops alone)
            err, self._stop_error = self._stop_error, None
            raise err

    def redo_last_step(self, reason: str) -> StepResult:
        """A guard found, after the fact (settling pending checks before the state is read), that the last
        committed step read something wrong: re-execute it from its start."""
        self._note(f"step {self.step_idx}: re-executed before the state is read ({reason})")
        return self._redo_previous(StepContext(self, self.step_idx, 0), self.step_idx)

    def _on_error(self, ctx: StepContext, err: Exception) -> list[Verdict]:
        """Guards' explanation of an exception in forward/backward: retry verdicts, or [] (re-raise). Single
        process only: on several ranks the others would wait in a collective for the failed one."""
        if self.world > 1:
            return []
        out = []
        for g in self.guards:
            v = g.on_error(ctx, err)
            if v is not None and not v.ok:
                out.append(replace(v, guard=v.guard or g.name, rank=self.rank))
        return out

    def _stage(self, stage: str, step: int) -> None:
        """Tell callbacks with ``on_stage(trainer, stage, step)`` that a stage finished (fail-stop injection
        kills a worker here: after ``plan``, ``forward_backward`` or ``update``)."""
        for cb in self.callbacks:
            fn = getattr(cb, "on_stage", None)
            if fn is not None:
                fn(self, stage, step)

    def _guard(self, stage: str, ctx: StepContext) -> list[Verdict]:
        """Every guard's look at ``stage``, reduced over all ranks: the non-commit verdicts of every rank. On
        several ranks a guard that stops the run (``SuspectedHardwareFault``) gives a ``SUSPECT`` verdict instead,
        so that the others, about to wait in this reduction, stop with it (:meth:`_stop_together`)."""
        ctx.stage = stage
        local: list[Verdict] = []
        for g in self.guards:
            if stage == "after_update" and not (g.inspects_update or g.stops_after_update):
                continue
            try:
                v = g.before_update(ctx) if stage == "before_update" else g.after_update(ctx)
            except SuspectedHardwareFault as err:
                if self.world == 1:
                    raise
                local = [self._suspect_verdict(err, stage, g.name)]
                break
            if stage == "after_update" and not g.inspects_update and v.action == Action.RETRY:
                raise TrainguardError(f"guard {g.name!r} asked for a retry after the update without inspects_update "
                                      "(the trainer kept no snapshot to roll the update back)")
            if not v.ok:
                local.append(replace(v, guard=v.guard or g.name, rank=self.rank))
        return self.strategy.reduce_verdicts(self, worst(local))

    def _suspect_verdict(self, err: SuspectedHardwareFault, site: str, guard: str) -> Verdict:
        """This rank's SUSPECT verdict for ``err``, kept to be raised by :meth:`_stop_together` once reduced."""
        self._stop_error = err
        return replace(Verdict.suspect(site, str(err)), guard=guard, rank=self.rank)

    def _stop_together(self, ctx: StepContext, verdict: Verdict) -> NoReturn:
        """Rank ``verdict.rank`` stopped the run (``SUSPECT``: as suspected persistent hardware; ``ABORT``: it could
        not rewind): every guard hears it (:meth:`StepGuard.on_stop`), then every rank raises, the failing one its
        own error, the others one of the same kind that names it."""
        for g in self.guards:
            g.on_stop(ctx, verdict)
        own, self._stop_error = self._stop_error, None
        if own is not None:
            raise own
        kind = SuspectedHardwareFault if verdict.action == Action.SUSPECT else StepAborted
        raise kind(f"rank {verdict.rank} stopped the run: {verdict.reason}")

    def _rollback(self, start: StepStart | None, update: StepSnapshot | None) -> None:
        """Back to the step's starting state (parameters and optimizer only if the update ran)."""
        if update is not None:
            snap_mod.restore(update, self.model, self.optimizer, self.scheduler)
        self.optimizer.zero_grad(set_to_none=True)
        if start is not None:
            start.restore(self.state)

    # ---- evaluation ------------------------------------------------------------------------------
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            return lm_loss(self.model(x.to(self.device)), y.to(self.device)).float()

    @torch.no_grad()
    def evaluate(self, n_batches: int | None = None) -> dict[str, float]:
        n = n_batches or self.cfg.train.eval_batches
        self.settle()
        was_training = self.model.training
        self.model.eval()
        try:
            val = self.strategy.evaluate(self, n)
        finally:
            self.model.train(was_training)
        return {"val_loss": val, "val_ppl": math.exp(min(val, 50.0)) if math.isfinite(val) else float("nan")}

    # ---- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a replica needs to continue this run (torchft heals a returning replica with it).
        Tensors are the live ones (no copy): serialise or copy before training on."""
        self.settle()
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "step": self.step_idx, "rng": snap_mod.rng_state(),
                "components": self.state.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (copied: the optimizer would otherwise share the source's tensors)."""
        self.settle("write")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(copy_state(state["optimizer"]))
        self.scheduler.load_state_dict(state["scheduler"])
        self.step_idx = int(state["step"])
        if "rng" in state:
            snap_mod.set_rng_state(_rng_for_this_host(state["rng"], self.device))
        self.state.load_state_dict(state.get("components", {}), strict=False)

    def snapshot(self) -> StepSnapshot:
        self.settle()
        return snap_mod.capture(self.model, self.optimizer, self.scheduler, self.step_idx,
                                extra={"components": self.state.snapshot()})

    def restore(self, snap: StepSnapshot) -> None:
        self.settle("write")
        snap_mod.restore(snap, self.model, self.optimizer, self.scheduler)
        self.state.load_state_dict(snap.extra.get("components", {}), strict=False)
        self.step_idx = snap.step

    def state_dict_for_compare(self, optimizer: bool = True) -> dict[str, torch.Tensor]:
        """Parameters (and optimizer state) of this rank as CPU copies, keyed by name."""
        self.settle()
        out = {f"param/{n}": p.detach().cpu().clone() for n, p in self.model.named_parameters()}
        if optimizer:
            names = {id(p): n for n, p in self.model.named_parameters()}
            for p, state in self.optimizer.state.items():
                for k, v in state.items():
                    if torch.is_tensor(v):
                        out[f"optim/{names.get(id(p), id(p))}/{k}"] = v.detach().cpu().clone()
        return out

    # ---- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self) -> Path | None:
        """Write a checkpoint of the current step (None on a rank that does not write them)."""
        if self.ckpt is None:
            raise ConfigError("checkpoint.dir is not set")
        self.settle()  # (on every rank: each settles its own state before the writer's collective)
        if not self.strategy.writes_checkpoints():
            return None
        rng = _plain_rng(snap_mod.rng_state())
        by_rank = self.strategy.gather_object(rng)  # every rank's RNG (a collective on every rank)
        state = {"step": self.step_idx, "rng": rng, "rng_by_rank": by_rank, "world": self.world,
                 "strategy": self.strategy.name, "components": self.state.state_dict()}
        model_cfg = json.loads(json.dumps(asdict(self.cfg.model_config()), default=str))
        extra = {"model_config": model_cfg, "data_fingerprint": self._data_fingerprint()}
        return self.ckpt.save(self.step_idx, self.model, self.optimizer, self.scheduler, self.cfg.to_dict(), state,
                              extra_manifest=extra)

    def _data_fingerprint(self) -> str | None:
        """The corpus's contents as a checkpoint records them (None for batches that cannot say)."""
        fingerprint = getattr(self.batches, "fingerprint", None)
        return fingerprint() if callable(fingerprint) else None

    def load_checkpoint(self, path: str | Path | None = None, manifest: dict | None = None) -> dict:
        """Load ``path`` (None: the latest in checkpoint.dir) and continue from its step with this trainer's
        config: the learning-rate schedule and the optimizer's hyper-parameters come from ``cfg`` (the
        schedule is rebuilt at the loaded step), everything else from the checkpoint."""
        self.settle("write")
        mgr = self.ckpt or CheckpointManager(Path(path).parent if path else ".", 1)
        if path is None:
            path = mgr.latest()
            if path is None:
                raise CheckpointError(f"no checkpoint in {mgr.dir}")
        manifest = ckpt_mod.load_checkpoint(path, self.model, self.optimizer, self.scheduler, manifest=manifest)
        state = manifest["trainer_state"]
        self.step_idx = int(state.get("step", manifest["step"]))
        by_rank = state.get("rng_by_rank") or []
        rng = by_rank[self.rank] if len(by_rank) == self.world else state.get("rng")
        if rng is not None:
            snap_mod.set_rng_state(_rng_for_this_host(rng, self.device))
        self._resumed_components = dict(state.get("components", {}))  # for components registered later too
        self.state.load_state_dict(self._resumed_components, strict=False)
        self._apply_configured_schedule()
        self.resumed_from = manifest["path"]
        if manifest.get("run_id"):
            self.run_id = manifest["run_id"]
            if self.ckpt is not None:
                self.ckpt.run_id = self.run_id
        return manifest

    def _apply_configured_schedule(self) -> None:
        """The optimizer's hyper-parameters and the LR schedule of ``cfg`` at ``step_idx`` (a resume applies
        the new config; with an unchanged config the values are bitwise those the saved run had)."""
        tc, sched = self.cfg.train, self.scheduler
        for group, hp in zip(self.optimizer.param_groups, self._group_hparams):
            group.update(hp)
            group["initial_lr"] = tc.lr
        warmup = int(round(tc.warmup_ratio * tc.steps))  # as build_scheduler computes it
        sched.lr_lambdas = [WarmupCosine(tc.steps, warmup, tc.min_lr_ratio) for _ in self.optimizer.param_groups]
        sched.base_lrs = [tc.lr for _ in self.optimizer.param_groups]
        sched.last_epoch = self.step_idx
        lrs = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        sched._last_lr = list(lrs)

    def _open_checkpoint_dir(self) -> None:
        """Decide, on the main rank, what this run does with ``checkpoint.dir`` (new run, start over, resume
        which checkpoint) and apply it on every rank. One-line CheckpointError when the folder holds another
        run's checkpoints, no intact one, or one whose config differs in the run's shape or data."""
        locking = self._locks_folders()
        plan = None
        if self.is_main:
            try:
                if locking:
                    run_lock.acquire_main(self.ckpt.dir, self.cfg.checkpoint.lock_wait_s, self._note)
                    self._unlock = weakref.finalize(self, run_lock.release, self.ckpt.dir)
                plan = self._plan_checkpoint_dir(apply=True)
            except CheckpointError as err:  # (every rank learns it: the others wait in the broadcast)
                plan = {"error": str(err)}
        plan = self.strategy.broadcast_object(plan)
        if locking and not self.is_main and not (plan or {}).get("error"):
            run_lock.acquire_rank(self.ckpt.dir)
            self._unlock = weakref.finalize(self, run_lock.release, self.ckpt.dir)
        if plan is None:  # a strategy whose ranks decide alone (elastic replicas): read-only, the writer decides
            plan = self._plan_checkpoint_dir(apply=False)
        if not self.strategy.spans_default_group() and self.world > 1:
            # replicas without a shared group still write as one run: a run id all of them derive alike
            self.run_id = _shared_run_id(self.cfg)
            self.ckpt.run_id = self.run_id
        if plan.get("error"):
            raise CheckpointError(plan["error"])
        for text in plan.get("notes", []):
            self._note(text)
        if plan.get("resume"):
            self.load_checkpoint(plan["resume"], manifest=plan["manifest"])
            self.resume_changes = {k: [a, b] for k, a, b in plan["changes"]}
            self._note(_resume_message(plan, self.step_idx, self.cfg.train.steps, self.run_id))

    def _plan_checkpoint_dir(self, apply: bool) -> dict[str, Any]:
        cc, mgr = self.cfg.checkpoint, self.ckpt
        notes: list[str] = []
        if apply:
            mgr.recover()
            for was, now in mgr.set_aside_strays():  # (never deleted: not ours to delete)
                notes.append(f"warning: {was} is not a checkpoint (no {ckpt_mod.MANIFEST}); moved to {now.name}")
        else:
            notes += [f"warning: {p} is not a checkpoint (no {ckpt_mod.MANIFEST}); ignored" for p in mgr.strays()]
        found = mgr.checkpoints()
        if not cc.resume:
            if not apply:
                return {}
            if found and not cc.start_over:
                runs = sorted({mgr.run_of(p) or "of an older version" for _, p in found})
                return {"error": f"checkpoint.dir {mgr.dir} holds checkpoints of another run (run {', '.join(runs)}; "
                                 f"steps {_steps([s for s, _ in found])}): continue it with --checkpoint.resume true, delete them with "
                                 f"--checkpoint.start_over true, or choose another checkpoint.dir"}
            if found and apply:
                runs = sorted({mgr.run_of(p) or "?" for _, p in found})
                for _, p in found:
                    gone = p.with_name(f".del-{p.name}")
                    os.rename(p, gone)
                    shutil.rmtree(gone, ignore_errors=True)
                notes.append(f"checkpoint.start_over: deleted {len(found)} checkpoint(s) of run {', '.join(runs)} "
                             f"(steps {_steps([s for s, _ in found])}) in {mgr.dir}")
            return {"notes": notes} if apply else {}
        step = cc.resume_step if cc.resume_step >= 0 else None
        path, manifest, bad = mgr.newest_intact(step)
        if path is None:
            if step is not None:
                why = f": {bad[0][1]}" if bad else f" (its checkpoints: steps {_steps([s for s, _ in found]) or 'none'})"
                return {"error": f"checkpoint.resume_step {step}: no intact checkpoint of that step in {mgr.dir}{why}"}
            if bad:
                return {"error": f"no intact checkpoint in {mgr.dir} to resume: {bad[0][1]}"
                                 + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")}
            notes.append(f"no checkpoint in {mgr.dir}; starting from step 0")
            return {"notes": notes}
        if not isinstance(manifest.get("config"), dict):
            return {"error": f"cannot resume {path}: its manifest records no config, so this run cannot be checked "
                             "against the one that saved it (load it with Trainer.load_checkpoint, or start a new run "
                             "in another checkpoint.dir)"}
        refused, changed = resume_differences(manifest.get("config"), manifest.get("model_config"), self.cfg,
                                              manifest.get("data_fingerprint"), self._data_fingerprint())
        if refused:
            return {"error": f"cannot resume {path}: it is another run's shape or data: "
                             f"{_changes(refused)} (keep the saved values, or start a new run in another checkpoint.dir)"}
        for p, why in bad:
            if apply:
                moved = mgr.set_aside(p, "corrupt")
                notes.append(f"warning: {why}; moved to {moved.name}; falling back to step {manifest['step']}")
            else:
                notes.append(f"warning: {why}; falling back to step {manifest['step']}")
        # set aside now (so that a resume after a kill, and the resume command printed at Ctrl-C, start where this
        # run went back to), unless the run is already finished and trains nothing: then nothing moves. (A save
        # after such a resume, from the Python API, sets them aside itself: CheckpointManager._supersede_later.)
        if apply and manifest["step"] < self.cfg.train.steps:
            later = mgr.supersede_later(manifest["step"], manifest.get("run_id"))
            if later:
                notes.append(f"resuming from step {manifest['step']}: this run's later checkpoints (steps "
                             f"{_steps(later)}) were renamed to *.superseded (not deleted)")
        return {"resume": str(path), "manifest": manifest, "changes": changed, "notes": notes}

    # ---- the loop --------------------------------------------------------------------------------
    def run(self, steps: int | None = None) -> RunSummary:
        """Run ``steps`` more optimizer steps (default: until ``train.steps``), with progress bar,
        metrics.jsonl, evaluation every ``train.eval_every`` steps and checkpoints.

        SIGTERM (preemption) is handled while it runs: the run finishes the current step, saves a checkpoint,
        writes the summary and returns with ``stop_reason = "preempted"``. Ctrl-C raises
        :class:`RunInterrupted` (the summary is written first). A resumed run that is already at
        ``train.steps`` trains nothing and writes nothing (``already_finished``)."""
        cfg = self.cfg
        start = self.step_idx
        n = steps if steps is not None else max(0, cfg.train.steps - start)
        end = start + n
        out_dir = Path(cfg.output.dir) if cfg.output.dir else None
        summary = RunSummary(start_step=start, end_step=start, device=str(self.device), world_size=self.world,
                             strategy=self.strategy.name, model=cfg.model.preset, params=self.strategy.count_params(self),
                             resumed_from=self.resumed_from, resume_changes=dict(self.resume_changes), run_id=self.run_id)
        if steps is None and self.resumed_from is not None and start >= cfg.train.steps:
            summary.already_finished = True
            summary.checkpoint = self.resumed_from
            self._note(f"run {self.run_id} is already finished: {self.resumed_from} is at step {start} and "
                       f"train.steps = {cfg.train.steps}; nothing to do (raise --train.steps to train further)")
            return summary
        if self.is_main:
            check_output_folders(cfg, checkpoints=False)
            if out_dir is not None:
                self._hold_output_dir(out_dir)
                self._claim_output_dir(out_dir, start)
        metrics_path = out_dir / "metrics.jsonl" if (out_dir and cfg.output.metrics and self.is_main) else None
        tb_dir = out_dir / "tb" if (out_dir and cfg.output.tensorboard and self.is_main) else None
        logger = MetricsLogger(metrics_path, total_steps=end, log_every=cfg.train.log_every,
                               progress=self.show_progress and self.is_main, device=self.device, start_step=start,
                               tensorboard_dir=tb_dir)
        summary.metrics_path = str(metrics_path) if metrics_path else None
        if self.resumed_from is not None and start > 0:
            logger.event(event="resume", step=start, path=self.resumed_from, run_id=self.run_id,
                         changed=summary.resume_changes)
        first_loss = last = None
        last_eval_step = last_ckpt_step = -1
        evaluation: dict[str, float] = {}
        t0 = time.perf_counter()

        def checkpoint() -> None:
            nonlocal last_ckpt_step
            logger.flush()  # every step up to the checkpoint is in metrics.jsonl before the checkpoint exists
            self._settle_together()
            saved = self.save_checkpoint()
            last_ckpt_step = self.step_idx
            if saved is not None:
                summary.checkpoint = str(saved)
                logger.event(event="checkpoint", step=self.step_idx, path=summary.checkpoint)

        previous_handler = self._catch_sigterm()
        self._run_end = end
        try:
            while self.step_idx < end:
                r = self.train_step()
                last = r
                if first_loss is None:
                    first_loss = r.loss_t
                planned = r.planned_retries
                summary.retries += r.attempts - 1 - planned
                summary.planned_retries += planned
                for retry in r.retries:
                    logger.event(event="retry", step=r.step + 1, **retry)
                logger.record(r.step + 1, r.loss_t, r.grad_norm_t, r.lr, r.tokens, r.step_time_s,
                              **({"attempts": r.attempts} if r.attempts > 1 else {}), **self.extra_metrics())
                if self.stop_on_nan and not r.finite:
                    summary.stopped_early, summary.stop_reason = True, "nonfinite loss"
                    break
                if cfg.train.eval_every and self.step_idx % cfg.train.eval_every == 0:
                    self._settle_together()
                    evaluation = self.evaluate()
                    last_eval_step = self.step_idx
                    logger.event(event="eval", step=self.step_idx, **evaluation)
                if self.ckpt is not None and cfg.checkpoint.every and self.step_idx % cfg.checkpoint.every == 0:
                    checkpoint()
                if self.step_idx < end and self._preempted():
                    summary.stopped_early, summary.stop_reason = True, "preempted"
                    if self.ckpt is not None and last_ckpt_step != self.step_idx:
                        checkpoint()
                    logger.event(event="preempted", step=self.step_idx, signal="SIGTERM")
                    break
            self._settle_together()  # the last update's pending verifications, before the run reports or returns
            if last is not None and not summary.stopped_early:
                if cfg.train.eval_every and last_eval_step != self.step_idx:
                    evaluation = self.evaluate()
                    logger.event(event="eval", step=self.step_idx, **evaluation)
                if self.ckpt is not None and last_ckpt_step != self.step_idx:
                    checkpoint()
        except SuspectedHardwareFault as err:
            summary.suspected_hardware = str(err)
            logger.event(event="suspected_hardware", step=self.step_idx + 1, message=str(err))
            raise
        except KeyboardInterrupt:
            summary.stopped_early, summary.stop_reason = True, "interrupted"
            raise RunInterrupted(self.step_idx) from None
        finally:
            self._run_end = None
            self._restore_sigterm(previous_handler)
            logger.close()
            self._finish_summary(summary, start, t0, first_loss, last, evaluation, logger, out_dir)
        return summary

    def _locks_folders(self) -> bool:
        """One live run per checkpoint and output folder (see run_lock), except for a strategy whose ranks decide
        alone (elastic replicas, which come and go in one folder by design)."""
        return self.world == 1 or self.strategy.spans_default_group()

    def _hold_output_dir(self, out_dir: Path) -> None:
        """One live run per output folder, as per checkpoint folder (``run_lock.acquire_output``), held while this
        trainer lives. Not for a strategy whose ranks decide alone (elastic replicas: the writer moves to the lowest
        live replica), as its checkpoint folder is not locked either."""
        if self._unlock_output is not None or not self._locks_folders():
            return
        run_lock.acquire_output(out_dir, self.cfg.checkpoint.lock_wait_s, self._note)
        self._unlock_output = weakref.finalize(self, run_lock.release, out_dir)

    def _claim_output_dir(self, out_dir: Path, start: int) -> None:
        """Move another run's files in ``output.dir`` (metrics.jsonl, summary.json, tb/) into
        ``<output.dir>/previous/<its run id>/``: a new run never overwrites them. A resumed run keeps its own
        (those whose summary names its run id, or a killed run's that wrote no summary) and appends."""
        names = [n for n in _RUN_OUTPUTS if os.path.lexists(out_dir / n)]
        if not names:
            return
        try:
            owner = json.loads((out_dir / "summary.json").read_text()).get("run_id") or None
        except (OSError, ValueError, AttributeError):
            owner = None
        if owner == self.run_id or (owner is None and start > 0):  # its own, or (no summary) most likely its own
            return
        label = owner if isinstance(owner, str) and owner.isalnum() else time.strftime("%Y%m%d-%H%M%S")
        target, n = out_dir / "previous" / label, 1
        while os.path.lexists(target):
            target, n = out_dir / "previous" / f"{label}-{n}", n + 1
        try:
            target.mkdir(parents=True)
            for name in names:
                os.rename(out_dir / name, target / name)
        except OSError as err:
            raise ConfigError(f"output.dir {out_dir} holds another run's files ({', '.join(names)}) that cannot be "
                              f"moved aside: {err.strerror or err}") from None
        self._note(f"output.dir {out_dir} held the files of {'run ' + owner if owner else 'an earlier run'} "
                   f"({', '.join(names)}); moved to {target}")

    # ---- preemption ------------------------------------------------------------------------------
    def _catch_sigterm(self) -> Any:
        """Turn SIGTERM into a request to stop at the next step boundary (main thread only)."""
        self.preempt_requested = False
        if threading.current_thread() is not threading.main_thread():
            return None

        def on_sigterm(signum, frame):
            self.preempt_requested = True

        return signal.signal(signal.SIGTERM, on_sigterm)

    def _restore_sigterm(self, previous: Any) -> None:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)

    def _preempted(self) -> bool:
        """Whether any rank got SIGTERM: every rank stops after the same step (one collective when world > 1)."""
        return self.strategy.any_rank(self, self.preempt_requested)

    def _finish_summary(self, summary: RunSummary, start: int, t0: float, first_loss, last, evaluation, logger,
                        out_dir: Path | None) -> None:
        summary.wall_s = time.perf_counter() - t0
        summary.end_step = self.step_idx
        summary.steps_run = self.step_idx - start
        summary.tokens = summary.steps_run * self.tokens_per_step
        summary.tokens_per_s = summary.tokens / summary.wall_s if summary.wall_s > 0 else 0.0
        if first_loss is not None:
            summary.first_loss = float(first_loss)
            summary.final_loss = last.loss
        summary.val_loss = evaluation.get("val_loss")
        summary.val_ppl = evaluation.get("val_ppl")
        summary.peak_mem_mb = peak_memory_mb(self.device)
        summary.first_nonfinite_step = logger.first_nonfinite_step
        summary.extra.update(self.extra_metrics())
        if out_dir and self.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            tmp = out_dir / f".summary.json.{os.getpid()}"
            tmp.write_text(json.dumps(_json_safe(summary.to_dict()), indent=1))
            os.replace(tmp, out_dir / "summary.json")

    def extra_metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for source in self.metric_sources:
            out.update(source())
        return out

    def close(self) -> None:
        """Tear down the process groups this trainer's strategy created, and let go of ``checkpoint.dir`` and
        ``output.dir``."""
        for unlock in (getattr(self, "_unlock", None), getattr(self, "_unlock_output", None)):
            if unlock is not None:
                unlock()
        self.strategy.close()


_RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "tb")  # what run() writes into output.dir


def _plain_rng(rng: dict[str, Any]) -> dict[str, Any]:
    """RNG states as tensors and plain values (a weights-only load reads them): NumPy's key array becomes a tensor."""
    rng = dict(rng)
    state = rng.get("numpy")
    if state is not None and not torch.is_tensor(state[1]):
        name, key, pos, has_gauss, cached = state
        rng["numpy"] = (str(name), torch.tensor(key.tolist(), dtype=torch.int64), int(pos), int(has_gauss), float(cached))
    return rng


def _rng_for_this_host(rng: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Saved RNG states ready for ``set_rng_state``: NumPy's key back to an array; CUDA states that do not
    fit this host (a CPU resume of a GPU run, fewer GPUs) dropped."""
    rng = dict(rng)
    state = rng.get("numpy")
    if state is not None and torch.is_tensor(state[1]):
        import numpy as np

        rng["numpy"] = (state[0], np.asarray(state[1].tolist(), dtype=np.uint32), *state[2:])
    if device.type != "cuda" or len(rng.get("cuda", [])) != torch.cuda.device_count():
        rng.pop("cuda", None)
    return rng


def check_output_folders(cfg, checkpoints: bool = True) -> None:
    """One-line ConfigError unless ``checkpoint.dir`` and ``output.dir`` can be created and written (and
    TensorBoard, when asked for, can be imported): checked before training, not at the first save."""
    if checkpoints and cfg.checkpoint.dir:
        check_writable(Path(cfg.checkpoint.dir), "checkpoint.dir")
    if cfg.output.dir:
        check_writable(Path(cfg.output.dir), "output.dir")
    if cfg.output.tensorboard:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError("output.tensorboard needs the tensorboard package (pip install tensorboard)") from None


def check_writable(path: Path, what: str) -> None:
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{what} {path} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{what} {path} cannot be created: {err.strerror or err}") from None
    probe = path / f".trainguard-write-test-{os.getpid()}"
    try:
        with open(probe, "wb") as fh:
            fh.write(b"ok")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"{what} {path} is not writable: {err.strerror or err}") from None


def _shared_run_id(cfg) -> str:
    """A run id every replica of one elastic run derives alike: from the sections that define the run."""
    import hashlib

    d = cfg.to_dict()
    ident = {k: d.get(k) for k in ("model", "data", "train")} | {"checkpoint.dir": cfg.checkpoint.dir}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 6 else f"{steps[0]}, ..., {steps[-1]} ({len(steps)} in all)"


def _changes(changes: list[tuple[str, Any, Any]]) -> str:
    return ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in changes)


def _resume_message(plan: dict[str, Any], step: int, total: int, run_id: str) -> str:
    changed = plan["changes"]
    if step >= total:  # (run() says that it is already finished; no schedule to speak of)
        return f"resuming run {run_id} from {plan['resume']} (step {step}; train.steps = {total})"
    text = f"resuming run {run_id} from {plan['resume']} (step {step} of {total})"
    if not changed:
        return text + "; config unchanged"
    text += f"; changed: {_changes(changed)}"
    if any(k in SCHEDULE_KEYS for k, _, _ in changed):
        text += f" (the learning-rate schedule is rebuilt from the new config at step {step})"
    return text


def _json_safe(d: Any) -> Any:
    if isinstance(d, float) and not math.isfinite(d):
        return str(d)
    if isinstance(d, dict):
        return {k: _json_safe(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_json_safe(v) for v in d]
    return d


def run_training(cfg, progress: bool | None = None, setup: Callable[[Trainer], None] | None = None) -> RunSummary:
    """Train from a config (the ``trainguard train`` entry point inside each process).

    ``setup(trainer)`` runs once before the loop: the CLI uses it to switch on protections from the
    ``[sdc]`` section (techniques live above this layer, so the trainer does not import them)."""
    trainer = Trainer(cfg, progress=progress)
    try:
        if setup is not None:
            setup(trainer)
        return trainer.run()
    finally:
        trainer.close()


__all__ = ["RunInterrupted", "RunSummary", "StepResult", "Trainer", "TrainguardError", "check_output_folders", "dist_env",
           "resolve_device", "run_training"]
