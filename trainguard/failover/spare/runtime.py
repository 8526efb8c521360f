"""SPARe runtime: the Trainer's elastic data-parallel strategy on torchft with SPARe's plan as its policy.

Relies on :mod:`trainguard.train.parallel.elastic` (``ElasticStrategy``: torchft quorum, membership, ordered
all-reduce, ``should_commit``), :class:`~trainguard.failover.spare.controller.ReCtlr`,
:mod:`trainguard.faults.failstop` (kills), ``torch.multiprocessing`` (one process per data-parallel group,
so a killed group is a real fail-stop: ``SIGKILL``, its sockets close, its heartbeats stop) and
:mod:`trainguard.utils.reports` (each group reports, and waits for the start, on pipes of its own: a
group killed at any moment cannot silence or block the others).

The global batch of a step is ``N`` slices, one per *shard type*; slice ``t`` of step ``i`` is a pure function
of ``(seed, i, t)``, so any group can compute any type it hosts. Group ``g`` hosts the ``r`` types of the
Golomb placement. :class:`SparePolicy` is SPARe's Alg. 1 as a gradient-sync policy:

* ``plan``: groups gone since the last step go to ``ReCtlr.on_failure`` (HK-Fixed / HK-Free / MCMF): new
  all-reduce stack ``s`` and stack orders, or a wipe-out (:class:`SpareWipeout`: every survivor stops and the
  launcher restarts all groups from the last checkpoint). Every alive group computes its first ``s``
  stacks; the copy of type ``t`` on the group the controller assigns ``t`` to is counted, the other copies
  are kept apart (``keep=True``).
* ``on_failure`` (a group died during the step): the controller runs on the new membership; a lost type
  whose redundant copy a survivor computed is counted from that copy; a type nobody computed gets **patch
  compute** on the host the controller names. The strategy finishes the same step.

Each counted slice carries weight ``1/N``, and the strategy sums the ``N`` slice gradients in slice order:
the gradient is the single-process trainer's, bitwise, whoever computed each slice. ``reference_run`` is
that single-process trainer with the same config (AdamW, schedule, clipping, activation checkpointing,
autocast).
"""

from __future__ import annotations

import io
import math
import pickle
import queue as queue_mod
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from trainguard.errors import TrainguardError
from trainguard.failover.spare.controller import ReCtlr
from trainguard.failover.spare.placement import check_supported, make_placement
from trainguard.faults.failstop import POINTS, ExternalKiller, FailStop, KillPoint, death_cause
from trainguard.train.checkpoint import CheckpointManager
from trainguard.train.parallel.base import MicroBatch
from trainguard.train.parallel.elastic import GradSyncPolicy, Recovery, StepView, SyncPlan
from trainguard.utils.reports import GateWaiter, Reports, ReportSender, StartGate

KILL_WHEN = POINTS  # start (before the step's quorum), plan, compute (before the all-reduce), forward_backward, update


class SpareWipeout(TrainguardError):
    """A shard type lost every host: the run must restart all groups from the last checkpoint."""

    def __init__(self, step: int, failed: list[int], types: list[int]):
        super().__init__(f"SPARe wipe-out at step {step}: groups {failed} failed and shard types {types} lost every host")
        self.step, self.failed, self.types = step, failed, types


class SparePolicy(GradSyncPolicy):
    """SPARe's stacked redundant shards with adaptive reordering, as a gradient-sync policy (module docstring)."""

    name = "spare"

    def __init__(self, groups: int, redundancy: int):
        self.placement = make_placement(groups, redundancy)
        self.ctl = ReCtlr(self.placement)

    def n_slices(self, replicas: int, grad_accum: int) -> int:
        return self.placement.n

    def _alive(self) -> set[int]:
        return {int(g) for g in np.flatnonzero(self.ctl.alive)}

    def plan(self, view: StepView) -> SyncPlan:
        n = self.placement.n
        if view.live == frozenset(range(n)) and len(self._alive()) < n:
            self.ctl.reset()  # every group is back (a global restart): the initial placement, s = 1
        gone = sorted(self._alive() - view.live)
        phase = ""
        if gone:  # failed between steps: reorder before anyone computes
            res = self.ctl.on_failure(gone)
            if res.wipeout:
                raise SpareWipeout(view.step, gone, list(res.wiped_types))
            phase = res.phase
        orders, s, assign = self.ctl.orders, self.ctl.stack, self.ctl.assign
        work = {g: [MicroBatch(int(t), n, 1.0 / n, keep=int(assign[t]) != g) for t in orders[g, :s].tolist()]
                for g in sorted(view.live) if self.ctl.alive[g]}
        return SyncPlan(work, info={"stack": int(s), "phase": phase, "failed_before": gone,
                                    "idle": sorted(view.live - set(work))})

    def on_failure(self, view: StepView, failed: frozenset[int], plan: SyncPlan) -> Recovery:
        res = self.ctl.on_failure(sorted(failed))
        if res.wipeout:
            raise SpareWipeout(view.step, sorted(failed), list(res.wiped_types))
        n = self.placement.n
        lost = sorted(mb.index for r in failed for mb in plan.work.get(r, []) if not mb.keep)
        count: dict[int, list[int]] = {}
        extra: dict[int, list[MicroBatch]] = {}
        load: dict[int, int] = {}
        for t in lost:
            holders = sorted(r for r in view.live if any(mb.index == t and mb.keep for mb in plan.work.get(r, [])))
            if holders:  # a survivor computed a redundant copy in its first s stacks: count it
                count.setdefault(holders[0], []).append(t)
                continue
            # nobody computed it: patch compute on the host the controller names (first failure of the step)
            # or, after a second one, on the least-loaded surviving host
            host = res.patches.get(t)
            if host is None or host not in view.live:
                host = min((int(h) for h in self.placement.hosts[t] if int(h) in view.live),
                           key=lambda h: (load.get(h, 0), h))
            load[host] = load.get(host, 0) + 1
            extra.setdefault(int(host), []).append(MicroBatch(t, n, 1.0 / n, tags=frozenset({"patch"})))
        patches = {mb.index: h for h, mbs in extra.items() for mb in mbs}
        return Recovery(extra=extra, count=count, info={"phase": res.phase, "patches": patches,
                                                        "recounted": sorted(t for ts in count.values() for t in ts)})

    def state_dict(self) -> dict[str, Any]:
        return {"controller": pickle.dumps(self.ctl)}  # orders, stack, alive and the assignment, exactly

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "controller" in state:
            self.ctl = pickle.loads(state["controller"])


# --------------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class Kill:
    """Kill group ``group`` at step ``step`` when it reaches ``when`` (a fail-stop point: ``start`` before the
    step's quorum, ``plan``, ``compute`` after computing its stacks and before the all-reduce,
    ``forward_backward``, ``update``)."""

    group: int
    step: int
    when: str = "compute"

    @classmethod
    def parse(cls, text: str) -> Kill:
        """``G@STEP`` or ``G@STEP:POINT``."""
        try:
            head, _, when = text.partition(":")
            g, s = head.split("@")
            kill = cls(int(g), int(s), when or "compute")
        except ValueError:
            raise TrainguardError(f"--kill expects GROUP@STEP[:{'|'.join(KILL_WHEN)}], got {text!r}") from None
        if kill.when not in KILL_WHEN:
            raise TrainguardError(f"--kill {text!r}: when must be one of {', '.join(KILL_WHEN)}")
        return kill


@dataclass
class SpareRunConfig:
    groups: int = 4
    redundancy: int = 2
    steps: int = 8
    model: str = "llama-tiny"
    model_overrides: dict = field(default_factory=dict)
    seq_len: int = 32
    shard_batch: int = 2            # sequences per shard type (one micro-batch)
    lr: float = 1e-3
    seed: int = 0
    corpus: str = "stdlib"
    corpus_max_bytes: int = 1_000_000
    checkpoint_every: int = 2
    run_dir: str = ""               # checkpoints (run_dir/checkpoints, DCP); a temporary directory when empty
    kills: tuple[Kill, ...] = ()
    max_restarts: int = 3
    timeout_s: float = 20.0
    threads_per_group: int = 1
    overrides: dict = field(default_factory=dict)  # further trainer settings, {"train.dtype": "bf16", ...}
    start_method: str = "forkserver"  # torch.multiprocessing start method of the groups: forkserver (torch imported
    #                                   once, restarts take a fraction of a second) or spawn
    heartbeat_timeout_ms: int = 1500  # a silent group leaves the quorum after this long
    random_kills: int = 0           # SIGKILL this many training groups from the launcher at random moments, each
    #                                 once the run committed a step since the previous kill
    random_kill_seed: int = 0
    random_kill_gap_s: tuple[float, float] = (0.3, 1.5)  # uniform wait before each random kill

    def validate(self) -> SpareRunConfig:
        check_supported(self.groups, self.redundancy)
        for name in ("steps", "seq_len", "shard_batch", "checkpoint_every", "threads_per_group", "heartbeat_timeout_ms"):
            if getattr(self, name) < 1:
                raise TrainguardError(f"spare run: {name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise TrainguardError(f"spare run: lr must be > 0, got {self.lr}")
        if not self.timeout_s > 0:  # (each group's elastic timeout: refused here once, not by every group)
            raise TrainguardError(f"spare run: timeout_s must be > 0, got {self.timeout_s}")
        if self.max_restarts < 0:
            raise TrainguardError(f"spare run: max_restarts must be >= 0, got {self.max_restarts}")
        if self.random_kills < 0:
            raise TrainguardError(f"spare run: random_kills must be >= 0, got {self.random_kills}")
        lo, hi = self.random_kill_gap_s
        if not 0 <= lo <= hi:
            raise TrainguardError(f"spare run: random_kill_gap_s must be 0 <= low <= high, got {self.random_kill_gap_s}")
        if self.start_method not in ("spawn", "forkserver"):
            raise TrainguardError(f"spare run: start_method must be spawn or forkserver, got {self.start_method!r}")
        for k in self.kills:
            if not 0 <= k.group < self.groups:
                raise TrainguardError(f"spare run: kill of group {k.group}, but groups are 0..{self.groups - 1}")
            if not 0 <= k.step < self.steps:
                raise TrainguardError(f"spare run: kill at step {k.step}, but steps are 0..{self.steps - 1}")
        if len({(k.group, k.step) for k in self.kills}) != len(self.kills):
            raise TrainguardError("spare run: the same group is killed twice at one step")
        trainer_config(self)  # the trainer settings are valid
        return self


def trainer_config(cfg: SpareRunConfig, group: int | None = None, lighthouse: str = "", resume: bool = False):
    """The Trainer config of one group (``group`` set: elastic, one process per group) or of the
    single-process reference (``group=None``: the ``N`` slices as ``grad_accum`` micro-batches)."""
    from trainguard.train.config import TrainerConfig

    n = cfg.groups
    settings: dict[str, Any] = {
        "model.preset": cfg.model, **{f"model.{k}": v for k, v in cfg.model_overrides.items()},
        "data.source": cfg.corpus, "data.max_bytes": cfg.corpus_max_bytes, "data.seq_len": cfg.seq_len,
        "data.batch_size": cfg.shard_batch * n, "data.seed": cfg.seed,
        "train.steps": cfg.steps, "train.lr": cfg.lr, "train.seed": cfg.seed, "train.eval_every": 0,
        "train.device": "cpu", "output.dir": "", "output.metrics": False, "output.progress": False,
        **cfg.overrides,
    }
    if group is None:
        settings.update({"train.grad_accum": n, "distributed.strategy": "single", "distributed.dp": 1})
    else:
        settings.update({
            "train.grad_accum": 1, "distributed.strategy": "elastic", "distributed.dp": n,
            "distributed.elastic.replica_id": group, "distributed.elastic.lighthouse": lighthouse,
            "distributed.elastic.timeout_s": cfg.timeout_s,
            "checkpoint.dir": str(Path(cfg.run_dir) / "checkpoints") if cfg.run_dir else "",
            "checkpoint.every": cfg.checkpoint_every, "checkpoint.resume": bool(resume and cfg.run_dir),
        })
    try:
        return TrainerConfig.load(None, settings)
    except TrainguardError as err:
        raise TrainguardError(f"spare run: {err}") from None


def _batches(cfg: SpareRunConfig):
    """The run's batches (every group and the reference read the same corpus the same way)."""
    from trainguard.data.batches import PackedBatches

    return PackedBatches.from_config(trainer_config(cfg).data)


def reference_run(cfg: SpareRunConfig) -> dict[str, torch.Tensor]:
    """The fault-free run in one process: the same Trainer config, each step the ``N`` slices as micro-batches
    (same weights, same accumulation order, same thread count as a group)."""
    from trainguard.train.trainer import Trainer

    cfg.validate()
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads_per_group)
    try:
        trainer = Trainer(trainer_config(cfg), progress=False)
        try:
            for _ in range(cfg.steps):
                trainer.train_step()
            return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        finally:
            trainer.close()
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------------------
# One data-parallel group (runs in its own process)


class RunningGroups:
    """The pids of the groups that are training right now, from ``run_spare``'s progress events (a group counts
    once it committed a step in its current process). ``RunningGroups(forward)`` passes every event on."""

    def __init__(self, forward: Callable[[str, int, dict], None] | None = None):
        self.forward = forward
        self._pids: dict[int, int] = {}
        self._running: dict[int, int] = {}
        self._lock = threading.Lock()
        self.steps_seen = 0  # committed steps reported, over all groups

    def __call__(self, kind: str, group: int, info: dict) -> None:
        with self._lock:
            if kind == "started":
                self._pids[group] = info["pid"]
                self._running.pop(group, None)
            elif kind == "step" and group in self._pids:
                self._running[group] = self._pids[group]
                self.steps_seen += 1
            elif kind in ("killed", "wipeout", "done", "error", "died"):
                self._pids.pop(group, None)
                self._running.pop(group, None)
        if self.forward is not None:
            self.forward(kind, group, info)

    def pids(self) -> dict[int, int]:
        with self._lock:
            return dict(self._running)


class _Reporter:
    """Sends every committed step's record to the launcher."""

    def __init__(self, group: int, reports: ReportSender):
        self.group, self.reports = group, reports

    def on_step_end(self, trainer, result) -> None:
        rec = trainer.strategy.record
        pol = rec["policy"]
        failures = [e for e in rec["events"] if e["event"] == "failure"]
        patches = sum(1 for e in failures for h in e.get("patches", {}).values() if h == self.group)
        phase = next((e["phase"] for e in reversed(failures) if e.get("phase")), "") or pol.get("phase", "")
        self.reports.put(("step", self.group, {
            "step": rec["step"], "stack": pol.get("stack", 0), "computed": rec["work"].get(self.group, 0),
            "patches": patches, "failed": rec["failed"], "phase": phase, "loss": result.loss,
            "recovery_s": [round(e["recovery_s"], 3) for e in failures]}))


def _group_main(g: int, cfg: SpareRunConfig, lighthouse: str, resume: bool, gate: GateWaiter, reports: ReportSender,
                batches=None) -> None:
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    from trainguard.train.parallel.elastic import ElasticStrategy
    from trainguard.train.parallel.torchft_group import quiet_torchft_logs
    from trainguard.train.trainer import Trainer

    quiet_torchft_logs()
    torch.set_num_threads(cfg.threads_per_group)
    trainer = None
    try:
        trainer = Trainer(trainer_config(cfg, g, lighthouse, resume), batches=batches,
                          strategy=ElasticStrategy(SparePolicy(cfg.groups, cfg.redundancy)), progress=False)
        trainer.callbacks.append(_Reporter(g, reports))

        def report_kill(p: KillPoint) -> None:
            reports.put(("killed", g, {"step": p.step, "when": p.point}))  # sent before put returns: no flush to wait for

        kills = [KillPoint(k.step, k.when) for k in cfg.kills if k.group == g and k.step >= trainer.step_idx]
        if kills:
            trainer.callbacks.append(FailStop(kills, on_kill=report_kill))
        reports.put(("ready", g, {}))  # every group is heartbeating before step 0: the launcher opens the gate
        gate.wait(timeout=300)           # when every group is ready or gone
        trainer.run()
        blob = io.BytesIO()  # by value: a tensor sent through the pipe would live in this dying process
        torch.save(trainer.model.state_dict(), blob)
        reports.put(("done", g, {"state": blob.getvalue(), "stack": trainer.strategy.policy.ctl.stack}))
    except SpareWipeout as w:
        reports.put(("wipeout", g, {"step": w.step, "failed": w.failed, "types": w.types}))
    except Exception as e:  # report, then die like any failed group (the others carry on)
        reports.put(("error", g, {"message": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}))
        raise
    finally:
        if trainer is not None:
            trainer.close()


# --------------------------------------------------------------------------------------------------
# Launcher


@dataclass
class SpareRunResult:
    state: dict[str, torch.Tensor]         # final parameters (from the lowest surviving group)
    steps: int
    killed: list[dict]                     # --kill kills that happened: {"group", "step", "when"}
    global_restarts: int
    patch_computes: int
    mean_stacks_per_step: float            # mean all-reduce stack over committed steps
    final_loss: float
    survivors: list[int]
    step_logs: list[dict]
    wall_s: float
    errors: list[str] = field(default_factory=list)
    # every group that died: {"group", "step" (the first it did not commit), "cause" (kill: --kill, signal: from
    # outside, crash: an exception or an exit code), "detail", "restart" (which launch), "pid"}
    deaths: list[dict] = field(default_factory=list)
    survivors_agree: bool = True           # every surviving group ended with bitwise the same parameters

    def summary(self) -> dict[str, Any]:
        return {
            "steps": self.steps, "killed_groups": len(self.killed), "kills": self.killed, "deaths": self.deaths,
            "global_restarts": self.global_restarts, "patch_computes": self.patch_computes,
            "mean_stacks_per_step": self.mean_stacks_per_step, "final_loss": self.final_loss,
            "survivors": self.survivors, "survivors_agree": self.survivors_agree, "wall_s": self.wall_s,
            "errors": self.errors,
        }


def _holds_checkpoint(run_dir: Path) -> bool:
    return (run_dir / "checkpoint.pt").exists() or CheckpointManager(run_dir / "checkpoints").latest() is not None


def run_spare(cfg: SpareRunConfig, progress: Callable[[str, int, dict], None] | None = None) -> SpareRunResult:
    """Run ``cfg.groups`` processes under a fresh torchft lighthouse; restart globally on a wipe-out.

    ``progress(event, group, info)`` is called for every report: ``started`` (``pid``), ``ready`` (up, waiting at
    the start gate for the others), ``step``, ``killed``, ``wipeout``, ``died`` (a death nobody announced: an
    outside signal or a crash), ``error``, ``done``."""
    import torch.multiprocessing as mp

    from trainguard.train.parallel.torchft_group import quiet_torchft_logs, start_lighthouse

    cfg.validate()
    quiet_torchft_logs()
    t0 = time.perf_counter()
    tmp = None
    if not cfg.run_dir:
        tmp = tempfile.TemporaryDirectory(prefix="trainguard-spare-")
        cfg = SpareRunConfig(**{**cfg.__dict__, "run_dir": tmp.name})
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if _holds_checkpoint(run_dir):
        raise TrainguardError(f"spare run: {cfg.run_dir} already holds a checkpoint; use an empty run directory")
    ctx = mp.get_context(cfg.start_method)
    if cfg.start_method == "forkserver":  # the server imports torch once; each group then starts in a fraction of a second
        ctx.set_forkserver_preload(["torch", "torch._dynamo", "torchft", "trainguard.train.trainer",
                                    "trainguard.failover.spare.runtime"])
    batches = _batches(cfg)  # the corpus is read once, here, and shared with every group
    running = RunningGroups(progress)
    emit = running
    killer = None
    if cfg.random_kills:  # each at a random moment once the run committed a step since the previous kill
        lo, hi = cfg.random_kill_gap_s
        mark = [-1]
        killer = ExternalKiller(running.pids, cfg.random_kills, lo, hi, cfg.random_kill_seed,
                                ready=lambda: running.steps_seen > mark[0],
                                on_kill=lambda k: mark.__setitem__(0, running.steps_seen)).start()
    killed: list[dict] = []
    deaths: list[dict] = []
    restarts = 0
    errors: list[str] = []
    step_logs: dict[int, dict] = {}
    done: dict[int, dict] = {}
    pending = list(cfg.kills)
    resume = False
    start_step = 0
    try:
        while True:
            run_cfg = SpareRunConfig(**{**cfg.__dict__, "kills": tuple(pending)})
            lh = start_lighthouse(heartbeat_timeout_ms=cfg.heartbeat_timeout_ms)
            # pipes per group, not a shared queue and a Barrier: a group killed at any moment must not take a
            # lock the others (or the launcher) then wait on for good
            gate, reports = StartGate(ctx), Reports(ctx)
            senders, waiters = [reports.sender() for _ in range(cfg.groups)], [gate.waiter() for _ in range(cfg.groups)]
            procs = [ctx.Process(target=_group_main, args=(g, run_cfg, lh.address(), resume, waiters[g], senders[g],
                                                           batches), daemon=True) for g in range(cfg.groups)]
            for g, p in enumerate(procs):
                p.start()
                reports.started(senders[g])
                gate.started(waiters[g])
                emit("started", g, {"pid": p.pid})
            ready: set[int] = set()
            wiped = None
            finished: dict[int, str] = {}  # group -> how its process ended (done, wipeout, killed, error, died)
            last_step = {g: start_step - 1 for g in range(cfg.groups)}
            dead_since: dict[int, float] = {}
            last_news = time.monotonic()
            patience = 3 * cfg.timeout_s + 60  # no report for this long: the survivors are stuck, stop
            try:
                while len(finished) < cfg.groups:
                    if not gate.opened and ready | set(finished) == set(range(cfg.groups)):
                        gate.open()
                    try:
                        kind, g, info = reports.get(timeout=0.5)
                        last_news = time.monotonic()
                    except queue_mod.Empty:
                        if time.monotonic() - last_news > patience:
                            raise TrainguardError(f"spare run: no group reported for {patience:.0f} s (groups still "
                                                  f"running: {sorted(set(range(cfg.groups)) - set(finished))})") from None
                        for gi, p in enumerate(procs):  # a death nobody announced: an outside signal or a crash
                            if gi in finished or p.is_alive():
                                continue
                            if time.monotonic() - dead_since.setdefault(gi, time.monotonic()) > 1.0:  # its last words are in
                                finished[gi] = "died"
                                cause, detail = death_cause(p.exitcode)
                                death = {"group": gi, "step": last_step[gi] + 1, "cause": cause, "detail": detail,
                                         "restart": restarts, "pid": p.pid}
                                deaths.append(death)
                                emit("died", gi, death)
                        continue
                    emit(kind, g, info)
                    if kind == "ready":
                        ready.add(g)
                    if kind == "step":
                        last_step[g] = info["step"]
                        agg = step_logs.setdefault(info["step"], {"step": info["step"], "stack": info["stack"],
                                                                  "patches": 0, "failed": [], "phase": "",
                                                                  "loss": info["loss"], "groups": 0, "recovery_s": []})
                        agg["patches"] += info["patches"]
                        agg["failed"] = sorted(set(agg["failed"]) | set(info["failed"]))
                        agg["phase"] = agg["phase"] or info["phase"]
                        agg["recovery_s"] = agg["recovery_s"] or info["recovery_s"]
                        agg["groups"] += 1
                    elif kind == "killed":
                        killed.append({"group": g, **info})
                        deaths.append({"group": g, "step": info["step"], "cause": "kill",
                                       "detail": f"--kill {g}@{info['step']}:{info['when']}", "restart": restarts,
                                       "pid": procs[g].pid})
                        pending = [k for k in pending if not (k.group == g and k.step == info["step"])]
                        finished[g] = "killed"
                    elif kind == "wipeout":
                        wiped = info
                        finished[g] = "wipeout"
                    elif kind == "done":
                        done[g] = info
                        finished[g] = "done"
                    elif kind == "error":
                        errors.append(f"group {g}: {info['message']}")
                        deaths.append({"group": g, "step": last_step[g] + 1, "cause": "crash",
                                       "detail": info["message"], "restart": restarts, "pid": procs[g].pid})
                        finished[g] = "error"
            finally:
                for p in procs:
                    p.join(timeout=10)
                    if p.is_alive():
                        p.kill()
                        p.join(timeout=5)
                gate.open()
                reports.close()
                lh.shutdown()
            if wiped is None and done:
                break
            crashed = [d for d in deaths if d["restart"] == restarts and d["cause"] == "crash"]
            if wiped is None and len(crashed) == cfg.groups:  # a crash loop, not a failure to ride out
                raise TrainguardError("spare run: every group crashed: " + "; ".join(errors or [d["detail"] for d in crashed]))
            if wiped is None:  # every group died without a wipe-out report: restart them all as well
                wiped = {"step": max(last_step.values()) + 1, "failed": sorted(finished), "types": []}
            restarts += 1
            if restarts > cfg.max_restarts:
                raise TrainguardError(f"spare run: {restarts} global restarts, more than max_restarts={cfg.max_restarts}")
            found = CheckpointManager(run_dir / "checkpoints").checkpoints()
            resume = bool(found)
            start_step = found[-1][0] if found else 0
            step_logs = {k: v for k, v in step_logs.items() if k < start_step}  # steps after the checkpoint are re-run
            done = {}
        first = min(done)
        states = {g: torch.load(io.BytesIO(d["state"])) for g, d in done.items()}
        agree = all(all(torch.equal(states[g][k], states[first][k]) for k in states[first]) for g in states)
        logs = [step_logs[k] for k in sorted(step_logs)]
        patches = sum(lg["patches"] for lg in logs)
        return SpareRunResult(
            state=states[first], steps=cfg.steps, killed=killed, global_restarts=restarts, patch_computes=patches,
            mean_stacks_per_step=float(np.mean([lg["stack"] for lg in logs])) if logs else math.nan,
            final_loss=logs[-1]["loss"] if logs else math.nan, survivors=sorted(done), step_logs=logs,
            wall_s=time.perf_counter() - t0, errors=errors, deaths=deaths, survivors_agree=agree)
    finally:
        if killer is not None:
            killer.stop()
        if tmp is not None:
            tmp.cleanup()


def max_param_diff(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two parameter sets (inf if their keys or shapes differ)."""
    if state.keys() != ref.keys() or any(state[k].shape != ref[k].shape for k in ref):
        return math.inf
    return max((float((state[k].float() - ref[k].float()).abs().max()) for k in ref), default=0.0)


__all__ = ["KILL_WHEN", "Kill", "SparePolicy", "SpareRunConfig", "SpareRunResult", "SpareWipeout", "max_param_diff",
           "reference_run", "run_spare", "trainer_config"]
