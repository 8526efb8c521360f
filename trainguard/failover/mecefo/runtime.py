"""The multi-process runtime of MeCeFO and its baselines: one process per data-parallel worker, each running the
Trainer with the elastic strategy (torchft: per-step quorum, ``should_commit``, live healing) and the method's
gradient-sync policy (:mod:`trainguard.failover.mecefo.policy`), under one torchft lighthouse.

Failures come from a :class:`~trainguard.failover.mecefo.timeline.FailureTimeline`:

* **simulated** failures are read by the policy: the worker stays in the quorum and computes nothing for those
  steps; its slices are re-planned (MeCeFO: to its neighbor, degraded; Bamboo: counted from the successor's
  redundant copy; Oobleck: rebalanced; checkpoint-restart: a global restart);
* **real** failures are ``SIGKILL`` s: the worker dies in the middle of its step (after computing its
  gradients, before the all-reduce: :mod:`trainguard.faults.failstop`); the survivors' all-reduce fails, the
  quorum shrinks and they finish the same step (the policy's ``on_failure``). When the worker's recovery time is
  over, the launcher starts a new process for it; the survivors wait for it at that step, and it heals from a
  peer's ``Trainer.state_dict()`` (model, optimizer, schedule, RNG, MeCeFO's bases) and trains on.

Under checkpoint-restart every failure makes every worker stop (:class:`GlobalRestart`); the launcher restarts all
of them from the last DCP checkpoint (a fresh lighthouse; failures that already happened do not repeat).

Processes are started with ``forkserver`` (torch preloaded) like SPARe's runtime. Every committed step is reported
to the launcher (membership, failures, roles, compute time, MeCeFO's samples), and every finishing worker sends a
digest of its parameters and optimizer state (or the tensors themselves, ``return_state``), each process on a
pipe of its own; the first workers wait for each other, and survivors for a rejoin, at gates of pipes
(:mod:`trainguard.utils.reports`: a worker killed at any moment cannot silence or block the others). Relies on
torch, torchft (through the strategy) and ``torch.multiprocessing``.
"""

from __future__ import annotations

import hashlib
import io
import math
import queue as queue_mod
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from trainguard.errors import TrainguardError
from trainguard.failover.mecefo.approx import MeCeFO, MeCeFOConfig
from trainguard.failover.mecefo.policy import METHODS, GlobalRestart, make_policy
from trainguard.failover.mecefo.timeline import Failure, FailureTimeline
from trainguard.faults.failstop import FailStop, KillPoint, death_cause
from trainguard.train.checkpoint import CheckpointManager
from trainguard.utils.reports import GateWaiter, Reports, ReportSender, StartGate

RUN_METHODS = (*METHODS, "elastic")  # "elastic": the plain data-parallel policy (no failover technique)


@dataclass
class FailoverRunConfig:
    method: str = "mecefo"
    workers: int = 4
    steps: int = 10
    model: str = "llama-tiny"
    model_overrides: dict = field(default_factory=dict)
    seq_len: int = 32
    micro_batch: int = 2  # sequences per slice (one micro-batch)
    grad_accum: int = 1  # slices per worker
    lr: float = 1e-3
    seed: int = 0
    corpus: str = "stdlib"
    corpus_max_bytes: int = 1_000_000
    timeline: FailureTimeline = field(default_factory=FailureTimeline)
    mecefo: MeCeFOConfig = field(default_factory=MeCeFOConfig)
    checkpoint_every: int = 5  # checkpoint-restart: steps between DCP checkpoints
    run_dir: str = ""  # checkpoints (checkpoint-restart); a temporary directory when empty
    timeout_s: float = 20.0
    heartbeat_timeout_ms: int = 1500
    threads_per_worker: int = 1
    start_method: str = "forkserver"
    max_restarts: int = 20
    rejoin_wait_s: float = 180.0  # how long the survivors wait for a restarted worker at its rejoin step
    eval_batches: int = 0  # validation batches the lowest worker evaluates at the end (0: none)
    return_state: bool = False  # every finishing worker sends its parameters and optimizer state (tests)
    overrides: dict = field(default_factory=dict)  # further trainer settings, {"train.dtype": "bf16", ...}

    def validate(self) -> FailoverRunConfig:
        if self.method not in RUN_METHODS:
            raise TrainguardError(f"failover run: unknown method {self.method!r} (choose from {', '.join(RUN_METHODS)})")
        for name in ("workers", "steps", "seq_len", "micro_batch", "grad_accum", "checkpoint_every", "threads_per_worker"):
            if getattr(self, name) < 1:
                raise TrainguardError(f"failover run: {name} must be >= 1, got {getattr(self, name)}")
        if self.workers < 2 and self.timeline.failures:
            raise TrainguardError("failover run: failures need at least 2 workers")
        if self.start_method not in ("spawn", "forkserver"):
            raise TrainguardError(f"failover run: start_method must be spawn or forkserver, got {self.start_method!r}")
        for f in self.timeline.failures:
            if not 0 <= f.node < self.workers or not 0 <= f.step < self.steps or f.until <= f.step:
                raise TrainguardError(f"failover run: failure {f} is outside {self.workers} workers x {self.steps} steps")
        self.mecefo.validate()
        trainer_config(self)
        return self

    @property
    def tokens_per_step(self) -> int:
        return self.workers * self.grad_accum * self.micro_batch * self.seq_len


def trainer_config(cfg: FailoverRunConfig, worker: int | None = None, lighthouse: str = "", resume: bool = False):
    """The Trainer config of one worker (``worker`` set: elastic) or of one process computing every slice."""
    from trainguard.train.config import TrainerConfig

    n = cfg.workers * cfg.grad_accum
    settings: dict[str, Any] = {
        "model.preset": cfg.model, **{f"model.{k}": v for k, v in cfg.model_overrides.items()},
        "data.source": cfg.corpus, "data.max_bytes": cfg.corpus_max_bytes, "data.seq_len": cfg.seq_len,
        "data.batch_size": cfg.micro_batch * n, "data.seed": cfg.seed,
        "train.steps": cfg.steps, "train.lr": cfg.lr, "train.seed": cfg.seed, "train.eval_every": 0,
        "train.device": "cpu", "output.dir": "", "output.metrics": False, "output.progress": False,
        **cfg.overrides,
    }
    if worker is None:
        settings.update({"train.grad_accum": n, "distributed.strategy": "single", "distributed.dp": 1})
    else:
        ckpt = cfg.method == "checkpoint_restart" and cfg.run_dir
        settings.update({
            "train.grad_accum": cfg.grad_accum, "distributed.strategy": "elastic", "distributed.dp": cfg.workers,
            "distributed.elastic.replica_id": worker, "distributed.elastic.lighthouse": lighthouse,
            "distributed.elastic.timeout_s": cfg.timeout_s,
            "checkpoint.dir": str(Path(cfg.run_dir) / "checkpoints") if ckpt else "",
            "checkpoint.every": cfg.checkpoint_every if ckpt else 0, "checkpoint.resume": bool(resume and ckpt),
        })
    try:
        return TrainerConfig.load(None, settings)
    except TrainguardError as err:
        raise TrainguardError(f"failover run: {err}") from None


def state_digest(trainer) -> str:
    """SHA-256 of every parameter and optimizer tensor (names and bytes, in name order)."""
    h = hashlib.sha256()
    for name, t in sorted(trainer.state_dict_for_compare(optimizer=True).items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _finish_info(trainer) -> dict[str, Any]:
    opt = trainer.optimizer.state_dict()["state"]
    return {"digest": state_digest(trainer), "step": trainer.step_idx, "torchft_step": trainer.strategy.group.step,
            "adam_steps": sorted({int(s["step"]) for s in opt.values()}),
            "scheduler_steps": int(trainer.scheduler.last_epoch)}


# --------------------------------------------------------------------------------------------------
# One worker (its own process)


class _Reporter:
    """Sends every committed step's record to the launcher."""

    def __init__(self, worker: int, reports: ReportSender, comp: MeCeFO | None):
        self.worker, self.reports, self.comp = worker, reports, comp

    def on_step_end(self, trainer, result) -> None:
        rec = trainer.strategy.record
        info = {"step": rec["step"], "live": rec["live"], "failed": rec["failed"], "joined": rec["joined"],
                "policy": rec["policy"], "work": rec["work"].get(self.worker, 0), "loss": result.loss,
                "events": [{k: v for k, v in e.items() if k in ("event", "failed", "recovery_s", "to_step", "degraded")}
                           for e in rec["events"]],
                "counted": {str(t): w for t, w in rec["counted"].items()},
                "attention": {str(t): w for t, w in rec["group_weights"].get("mha", {}).items()},
                "attention_weights": sorted({round(w, 12) for w in rec["group_weights"].get("mha", {}).values()})}
        failures = [e for e in rec["events"] if e["event"] == "failure" and "degraded" in e]
        info["degraded"] = failures[-1]["degraded"] if failures else rec["policy"].get("degraded", [])
        if self.comp is not None:
            info["mecefo"] = dict(self.comp.last)
        self.reports.put(("step", self.worker, info))


class _HoldForRejoin:
    """Survivors wait at a killed worker's rejoin step until its new process is up (so it rejoins there)."""

    def __init__(self, worker: int, failures: list[Failure], gates: dict[tuple[int, int], GateWaiter], steps: int,
                 wait_s: float):
        self.gates, self.wait_s = gates, wait_s
        self.at = {f.until: (f.node, f.step) for f in failures if f.real and f.node != worker and f.until < steps}

    def on_step_start(self, trainer, step: int) -> None:
        key = self.at.get(step)
        if key is not None and key in self.gates:
            self.gates[key].wait(timeout=self.wait_s)


class _Release:
    """A restarted worker: tells the launcher it starts its first step (its first quorum), and the launcher lets
    the waiting survivors go on."""

    def __init__(self, worker: int, replacing: tuple[int, int], reports: ReportSender):
        self.worker, self.replacing, self.reports = worker, replacing, reports
        self.sent = False

    def on_step_start(self, trainer, step: int) -> None:
        if not self.sent:
            self.sent = True
            self.reports.put(("rejoining", self.worker, {"replacing": list(self.replacing), "step": step}))


def _worker_main(r: int, cfg: FailoverRunConfig, lighthouse: str, resume: bool, pending: tuple[Failure, ...],
                 gate: GateWaiter | None, reports: ReportSender, batches, rejoin_gates: dict[tuple[int, int], GateWaiter],
                 replacing: tuple[int, int] | None) -> None:
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    from trainguard.train.parallel.elastic import DataParallelPolicy, ElasticStrategy
    from trainguard.train.parallel.torchft_group import quiet_torchft_logs
    from trainguard.train.trainer import Trainer

    quiet_torchft_logs()
    torch.set_num_threads(cfg.threads_per_worker)
    timeline = FailureTimeline(pending, cfg.timeline.absorbed, cfg.timeline.step_s)
    trainer = None
    try:
        policy = DataParallelPolicy() if cfg.method == "elastic" else make_policy(cfg.method, timeline, cfg.mecefo)
        trainer = Trainer(trainer_config(cfg, r, lighthouse, resume), batches=batches,
                          strategy=ElasticStrategy(policy), progress=False)
        comp = MeCeFO(cfg.mecefo).install(trainer) if cfg.method == "mecefo" else None
        trainer.callbacks.append(_Reporter(r, reports, comp))
        trainer.callbacks.append(_HoldForRejoin(r, list(pending), rejoin_gates, cfg.steps, cfg.rejoin_wait_s))

        def report_kill(p: KillPoint) -> None:
            reports.put(("killed", r, {"step": p.step, "when": p.point}))  # sent before put returns

        after = replacing[1] if replacing is not None else -1  # a new process: only the failures after its rejoin
        kills = [KillPoint(f.step, "compute") for f in pending if f.real and f.node == r and f.step > after
                 and f.step >= trainer.step_idx]
        if kills:
            trainer.callbacks.append(FailStop(kills, on_kill=report_kill))
        if replacing is not None:  # about to ask for its first quorum: the survivors may form the rejoin quorum
            trainer.callbacks.insert(0, _Release(r, replacing, reports))
        elif gate is not None:  # every worker is heartbeating before step 0: the launcher opens the gate when
            reports.put(("ready", r, {}))  # every first-launch worker is ready or gone
            gate.wait(timeout=300)
        trainer.run()
        out = _finish_info(trainer)
        if cfg.eval_batches and trainer.strategy.is_main:
            out.update(trainer.evaluate(cfg.eval_batches))
        if cfg.return_state:
            blob = io.BytesIO()  # by value: a tensor sent through the pipe would live in this dying process
            torch.save(trainer.state_dict_for_compare(optimizer=True), blob)
            out["state"] = blob.getvalue()
        if comp is not None:
            out["samples"] = comp.samples
            out["svd_refreshes"] = comp.svd_refreshes
        reports.put(("done", r, out))
    except GlobalRestart as g:
        reports.put(("restart", r, {"step": g.step, "failed": g.failed, "real": g.real}))
    except Exception as e:  # report, then die like any failed worker (the others carry on)
        reports.put(("error", r, {"message": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}))
        raise
    finally:
        if trainer is not None:
            trainer.close()


# --------------------------------------------------------------------------------------------------
# Launcher


@dataclass
class FailoverRunResult:
    method: str
    steps: int
    workers: int
    step_logs: list[dict]  # per committed step: membership, failures, roles and compute time per worker, loss, ...
    deaths: list[dict]  # {"worker", "step", "cause" (kill | signal | crash), "detail", "pid"}
    rejoins: list[dict]  # {"worker", "step" (healed into), "pid"}
    global_restarts: int
    final: dict[int, dict]  # worker -> {"digest", "step", "torchft_step", "adam_steps", "scheduler_steps"}
    agree: bool  # every finishing worker holds bitwise the same parameters and optimizer state
    val_loss: float | None
    val_ppl: float | None
    samples: list[dict]  # MeCeFO's monitored steps (gradient error, compute time, activation memory per role)
    wall_s: float
    tokens: int
    errors: list[str] = field(default_factory=list)
    states: dict[int, dict] = field(default_factory=dict)  # with return_state: worker -> parameters + optimizer
    timeline: dict = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        degraded = [lg for lg in self.step_logs if lg.get("neighbors")]
        out = [lg for lg in self.step_logs if lg.get("out") or lg.get("failed")]
        return {"method": self.method, "steps": self.steps, "workers": self.workers, "tokens": self.tokens,
                "deaths": self.deaths, "rejoins": self.rejoins, "global_restarts": self.global_restarts,
                "agree": self.agree, "val_loss": self.val_loss, "val_ppl": self.val_ppl,
                "steps_degraded": len(degraded), "steps_with_a_worker_out": len(out),
                "final_loss": self.step_logs[-1]["loss"] if self.step_logs else math.nan, "wall_s": self.wall_s,
                "errors": self.errors, "timeline": self.timeline}


def _batches(cfg: FailoverRunConfig):
    from trainguard.data.batches import PackedBatches

    return PackedBatches.from_config(trainer_config(cfg).data)


class _Launch:
    """One launch of every worker under one lighthouse (a global restart is a new launch): starts processes,
    follows their reports, starts a killed worker's new process when its recovery time is over."""

    def __init__(self, cfg: FailoverRunConfig, ctx, batches, pending: tuple[Failure, ...], resume: bool, restarts: int,
                 emit: Callable[[str, int, dict], None]):
        from trainguard.train.parallel.torchft_group import start_lighthouse

        self.cfg, self.ctx, self.batches, self.resume, self.restarts, self.emit = cfg, ctx, batches, resume, restarts, emit
        self.pending = pending
        self.lighthouse = start_lighthouse(heartbeat_timeout_ms=cfg.heartbeat_timeout_ms)
        self.reports = Reports(ctx)  # a pipe per process: a worker killed mid-report must not silence the others
        self.gate = StartGate(ctx)  # not a Barrier: a worker killed while waiting must not hang the launcher
        self.first: set[tuple[int, int]] = set()  # the first processes of this launch (they wait at the gate)
        self.ready: set[tuple[int, int]] = set()
        # per real failure: survivors wait at its rejoin step until the new process starts (pipes, not an Event)
        self.rejoin_gates = {(f.node, f.step): StartGate(ctx) for f in pending if f.real}
        self.procs: dict[tuple[int, int], Any] = {}  # (worker, pid) -> process
        self.live_pid: dict[int, int] = {}
        self.ended: dict[tuple[int, int], str] = {}  # (worker, pid) -> how that process ended
        self.killed_at: dict[int, Failure] = {}  # worker -> its real failure, waiting for its rejoin
        self.top_step = -1
        self.restart_req: dict | None = None

    def start(self, r: int, replacing: tuple[int, int] | None = None) -> None:
        sender = self.reports.sender()
        waiter = None if replacing else self.gate.waiter()
        rejoin = {key: gate.waiter() for key, gate in self.rejoin_gates.items()}
        p = self.ctx.Process(target=_worker_main, daemon=True, args=(
            r, self.cfg, self.lighthouse.address(), self.resume and replacing is None, self.pending,
            waiter, sender, self.batches, rejoin, replacing))
        p.start()
        self.reports.started(sender)
        for key, w in rejoin.items():
            self.rejoin_gates[key].started(w)
        if waiter is not None:
            self.gate.started(waiter)
            self.first.add((r, p.pid))
        self.procs[(r, p.pid)] = p
        self.live_pid[r] = p.pid
        self.emit("started", r, {"pid": p.pid, "replacing": replacing})

    def open_gate_when_due(self) -> None:
        if not self.gate.opened and all(k in self.ready or k in self.ended for k in self.first):
            self.gate.open()

    def running(self) -> bool:
        return any(k not in self.ended for k in self.procs)

    def rejoin_due(self) -> None:
        """A killed worker whose recovery time is over: start its new process."""
        for r, f in list(self.killed_at.items()):
            if self.top_step >= f.until - 1:
                del self.killed_at[r]
                self.start(r, (f.node, f.step))

    def unannounced_deaths(self, dead_since: dict, deaths: list[dict]) -> None:
        """A process gone without a report: an outside signal or a crash."""
        for key, p in self.procs.items():
            if key in self.ended or p.is_alive():
                continue
            if time.monotonic() - dead_since.setdefault(key, time.monotonic()) > 1.0:  # its last words are in
                self.ended[key] = "died"
                cause, detail = death_cause(p.exitcode)
                death = {"worker": key[0], "step": self.top_step + 1, "cause": cause, "detail": detail, "pid": key[1],
                         "restart": self.restarts}
                deaths.append(death)
                self.emit("died", key[0], death)

    def close(self) -> None:
        for p in self.procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.gate.open()
        for gate in self.rejoin_gates.values():
            gate.open()
        self.reports.close()
        self.lighthouse.shutdown()


def _log_step(step_logs: dict[int, dict], r: int, info: dict) -> None:
    agg = step_logs.setdefault(info["step"], {
        "step": info["step"], "live": info["live"], "failed": info["failed"], "joined": info["joined"],
        "loss": info["loss"], "out": info["policy"].get("out", []), "neighbors": info["policy"].get("neighbors", []),
        "attention_weights": info["attention_weights"], "roles": {}, "compute_s": {}, "work": {},
        "events": info["events"], "counted": info["counted"], "attention": info["attention"],
        "degraded": info["degraded"]})
    agg["work"][str(r)] = info["work"]
    if info["events"] and not agg["events"]:
        agg["events"] = info["events"]
    m = info.get("mecefo")
    if m:
        agg["roles"][str(r)] = m.get("role")
        agg["compute_s"][str(r)] = round(m.get("compute_s", 0.0), 4)
        for k in ("grad_rel_error", "grad_rel_error_mha", "grad_rel_error_other"):
            if k in m:
                agg[k] = m[k]


def run_failover(cfg: FailoverRunConfig, progress: Callable[[str, int, dict], None] | None = None) -> FailoverRunResult:
    """Run ``cfg.workers`` processes under a fresh torchft lighthouse with ``cfg.method``'s policy and the failures of
    ``cfg.timeline``. ``progress(event, worker, info)`` sees every report: ``started``, ``ready``, ``rejoining``,
    ``step``, ``killed``, ``died``, ``restart``, ``relaunch``, ``error``, ``done``."""
    import torch.multiprocessing as mp

    from trainguard.train.parallel.torchft_group import quiet_torchft_logs

    cfg.validate()
    quiet_torchft_logs()
    emit = progress or (lambda *a: None)
    t0 = time.perf_counter()
    tmp = None
    if not cfg.run_dir:
        tmp = tempfile.TemporaryDirectory(prefix="trainguard-mecefo-")
        cfg = replace(cfg, run_dir=tmp.name)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if CheckpointManager(run_dir / "checkpoints").latest() is not None:
        raise TrainguardError(f"failover run: {cfg.run_dir} already holds a checkpoint; use an empty run directory")
    ctx = mp.get_context(cfg.start_method)
    if cfg.start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torchft", "trainguard.train.trainer", "trainguard.failover.mecefo.runtime"])
    batches = _batches(cfg)
    deaths: list[dict] = []
    rejoins: list[dict] = []
    errors: list[str] = []
    step_logs: dict[int, dict] = {}
    final: dict[int, dict] = {}
    samples: list[dict] = []
    restarts = 0
    pending = tuple(cfg.timeline.failures)
    resume = False
    patience = 3 * cfg.timeout_s + cfg.rejoin_wait_s + 60
    try:
        while True:
            run = _Launch(cfg, ctx, batches, pending, resume, restarts, emit)
            dead_since: dict = {}
            last_news = time.monotonic()
            try:
                for r in range(cfg.workers):
                    run.start(r)
                while run.running():
                    run.open_gate_when_due()
                    if cfg.method != "checkpoint_restart":
                        run.rejoin_due()
                    try:
                        kind, r, info = run.reports.get(timeout=0.2)
                        last_news = time.monotonic()
                    except queue_mod.Empty:
                        if time.monotonic() - last_news > patience:
                            raise TrainguardError(f"failover run: no worker reported for {patience:.0f} s") from None
                        run.unannounced_deaths(dead_since, deaths)
                        continue
                    key = (r, run.live_pid.get(r))
                    emit(kind, r, info)
                    if kind == "ready":
                        run.ready.add(key)
                    elif kind == "rejoining" and tuple(info["replacing"]) in run.rejoin_gates:
                        run.rejoin_gates[tuple(info["replacing"])].open()
                    if kind == "step":
                        run.top_step = max(run.top_step, info["step"])
                        _log_step(step_logs, r, info)
                        if any(e["event"] == "healed" for e in info["events"]):
                            rejoins.append({"worker": r, "step": info["step"], "pid": key[1]})
                    elif kind == "killed":
                        f = next((f for f in run.pending if f.real and f.node == r and f.step == info["step"]), None)
                        deaths.append({"worker": r, "step": info["step"], "cause": "kill",
                                       "detail": f"real failure at step {info['step']} ({info['when']})",
                                       "pid": key[1], "restart": restarts})
                        run.ended[key] = "killed"
                        if f is not None:
                            pending = tuple(x for x in pending if x != f)
                            if f.until < cfg.steps:
                                run.killed_at[r] = f
                    elif kind == "restart":
                        run.ended[key] = "restart"
                        run.restart_req = run.restart_req or info
                        fired = [f for f in pending if not f.real and f.step == info["step"] and f.node in info["failed"]]
                        pending = tuple(x for x in pending if x not in fired)
                    elif kind == "done":
                        run.ended[key] = "done"
                        samples.extend(info.pop("samples", []))
                        final[r] = info
                    elif kind == "error":
                        errors.append(f"worker {r}: {info['message']}")
                        deaths.append({"worker": r, "step": run.top_step + 1, "cause": "crash", "detail": info["message"],
                                       "pid": key[1], "restart": restarts})
                        run.ended[key] = "error"
            finally:
                run.close()
            if run.restart_req is None or final:
                break
            restarts += 1
            if restarts > cfg.max_restarts:
                raise TrainguardError(f"failover run: {restarts} global restarts, more than max_restarts={cfg.max_restarts}")
            found = CheckpointManager(run_dir / "checkpoints").checkpoints()
            resume = bool(found)
            start_step = found[-1][0] if found else 0
            step_logs = {k: v for k, v in step_logs.items() if k < start_step}  # steps after the checkpoint re-run
            emit("relaunch", -1, {"from_step": start_step, "restarts": restarts})
        if not final:
            raise TrainguardError("failover run: no worker finished: " + "; ".join(errors or ["see deaths"]))
        agree = len({f["digest"] for f in final.values()}) == 1
        states = {}
        if cfg.return_state:
            states = {r: torch.load(io.BytesIO(f.pop("state"))) for r, f in final.items()}
        val = next((f for f in final.values() if "val_loss" in f), {})
        logs = [step_logs[k] for k in sorted(step_logs)]
        return FailoverRunResult(
            method=cfg.method, steps=cfg.steps, workers=cfg.workers, step_logs=logs, deaths=deaths, rejoins=rejoins,
            global_restarts=restarts, final={r: {k: v for k, v in f.items() if k not in ("val_loss", "val_ppl")}
                                             for r, f in final.items()},
            agree=agree, val_loss=val.get("val_loss"), val_ppl=val.get("val_ppl"), samples=samples,
            wall_s=time.perf_counter() - t0, tokens=cfg.steps * cfg.tokens_per_step, errors=errors, states=states,
            timeline=cfg.timeline.summary(cfg.steps))
    finally:
        if tmp is not None:
            tmp.cleanup()


__all__ = ["RUN_METHODS", "FailoverRunConfig", "FailoverRunResult", "run_failover", "state_digest", "trainer_config"]
