"""SPARe runtime: real data-parallel training with stacked redundant shards on torchft.

Relies on :mod:`trainguard.failover.elastic` (torchft ``Manager`` quorum, reconfigurable gloo/nccl process
groups), :class:`~trainguard.failover.spare.controller.ReCtlr` and ``torch.multiprocessing`` (one process per
data-parallel group, so a killed group is a real fail-stop: ``SIGKILL``, its sockets close, its heartbeats
stop).

The global batch of a step is ``N`` shards, one per *shard type*; shard ``t`` of step ``i`` is a pure
function of ``(seed, i, t)`` (:class:`~trainguard.data.batches.PackedBatches`), so any group can compute any
type it hosts. Group ``g`` hosts the ``r`` types of the Golomb placement. Each step (SPARe paper, Alg. 1):

1. torchft quorum, then the membership of this step (``ElasticGroup.members``). Groups missing since the
   last step go to ``ReCtlr.on_failure``: new all-reduce stack ``s`` and orders (HK-Fixed / HK-Free / MCMF),
   or a wipe-out -> every survivor exits and the launcher does a **global restart** from the last checkpoint.
2. Every group computes its first ``s`` stacks in stack order. The type's gradient is *counted* by the group
   the controller assigns it to; a group keeps the gradients of its other top-``s`` types (redundant copies)
   apart, in case their assignee dies before the all-reduce.
3. All-reduce (sum) of the counted gradients; torchft's ``should_commit``. If a group died during the step
   the collective fails for everyone: the survivors run the controller on the new membership and finish the
   *same* step: a lost type whose redundant copy was computed by a survivor is counted from that copy, a
   type no survivor computed gets **patch compute** on the host the controller names. Then the all-reduce
   is retried on the shrunk quorum.
4. The summed gradient divided by ``N`` is the mean over all shards -- the fault-free data-parallel gradient,
   up to fp32 summation order -- and AdamW steps.

Every ``checkpoint_every`` steps the lowest live group writes a checkpoint (``torch.save`` to a temporary file
+ atomic rename; a good checkpoint is never overwritten in place).
"""

from __future__ import annotations

import io
import math
import os
import queue as queue_mod
import signal
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainguard.errors import TrainguardError
from trainguard.failover.spare.controller import ReCtlr
from trainguard.failover.spare.placement import check_supported, make_placement

KILL_WHEN = ("start", "compute")  # before the step's quorum / after computing its stacks, before the all-reduce


@dataclass(frozen=True)
class Kill:
    """Kill group ``group`` at step ``step``: at its ``start`` or after its ``compute`` (mid-step)."""

    group: int
    step: int
    when: str = "compute"

    @classmethod
    def parse(cls, text: str) -> Kill:
        """``G@STEP`` or ``G@STEP:start|compute``."""
        try:
            head, _, when = text.partition(":")
            g, s = head.split("@")
            kill = cls(int(g), int(s), when or "compute")
        except ValueError:
            raise TrainguardError(f"--kill expects GROUP@STEP[:start|compute], got {text!r}") from None
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
    run_dir: str = ""               # checkpoints; a temporary directory when empty
    kills: tuple[Kill, ...] = ()
    max_restarts: int = 3
    timeout_s: float = 20.0
    threads_per_group: int = 1

    def validate(self) -> SpareRunConfig:
        check_supported(self.groups, self.redundancy)
        for name in ("steps", "seq_len", "shard_batch", "checkpoint_every", "threads_per_group"):
            if getattr(self, name) < 1:
                raise TrainguardError(f"spare run: {name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise TrainguardError(f"spare run: lr must be > 0, got {self.lr}")
        for k in self.kills:
            if not 0 <= k.group < self.groups:
                raise TrainguardError(f"spare run: kill of group {k.group}, but groups are 0..{self.groups - 1}")
            if not 0 <= k.step < self.steps:
                raise TrainguardError(f"spare run: kill at step {k.step}, but steps are 0..{self.steps - 1}")
        if len({(k.group, k.step) for k in self.kills}) != len(self.kills):
            raise TrainguardError("spare run: the same group is killed twice at one step")
        return self


# --------------------------------------------------------------------------------------------------
# The model, data and optimizer every group (and the reference) builds identically


def _build(cfg: SpareRunConfig):
    from trainguard.data.batches import PackedBatches
    from trainguard.data.corpus import load_corpus
    from trainguard.models import build_model

    model = build_model(cfg.model, seed=cfg.seed, **cfg.model_overrides)
    streams = load_corpus(cfg.corpus, 0.02, cfg.corpus_max_bytes or None)
    data = PackedBatches(streams, cfg.seq_len, cfg.shard_batch * cfg.groups, cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0, foreach=False)
    return model, data, opt


def _shard_grad(model, data, cfg: SpareRunConfig, step: int, t: int) -> tuple[torch.Tensor, float]:
    """Gradient (flat fp32) and loss of shard type ``t`` of step ``step``."""
    from trainguard.failover.elastic import flat_grads
    from trainguard.models import lm_loss

    x, y = data.batch(step, rank=t, world_size=cfg.groups)
    model.zero_grad(set_to_none=True)
    loss = lm_loss(model(x), y)
    loss.backward()
    return flat_grads(list(model.parameters())), float(loss.detach())


def _apply(model, opt, summed: torch.Tensor, n_types: int) -> None:
    from trainguard.failover.elastic import set_flat_grads

    set_flat_grads(list(model.parameters()), summed / n_types)
    opt.step()


def reference_run(cfg: SpareRunConfig) -> dict[str, torch.Tensor]:
    """The fault-free run in one process: each step the mean gradient of all ``N`` shards."""
    cfg.validate()
    model, data, opt = _build(cfg)
    for step in range(cfg.steps):
        total = None
        for t in range(cfg.groups):
            g, _ = _shard_grad(model, data, cfg, step, t)
            total = g if total is None else total + g
        _apply(model, opt, total, cfg.groups)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------------------------------
# Checkpoints (atomic; the previous good one stays until the new one is complete)


def _save_checkpoint(path: Path, step: int, model, opt, ctl: ReCtlr) -> None:
    payload = {"step": step, "model": model.state_dict(), "optim": opt.state_dict(),
               "spare": {"orders": ctl.orders, "stack": ctl.stack, "alive": ctl.alive.copy()}}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    os.close(fd)
    torch.save(payload, tmp)
    os.replace(tmp, path)


def _load_checkpoint(path: Path, model, opt) -> int:
    ck = torch.load(path, weights_only=False)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optim"])
    return int(ck["step"])


# --------------------------------------------------------------------------------------------------
# One data-parallel group (runs in its own process)


@dataclass
class _StepLog:
    step: int
    stack: int                 # all-reduce stack s of this step
    computed: int              # shards this group computed (s plus its patches)
    patches: int = 0           # patch-compute shards this group ran
    failed: tuple[int, ...] = ()
    phase: str = ""
    loss: float = float("nan")


def _group_main(g: int, cfg: SpareRunConfig, lighthouse: str, resume: str | None, barrier, queue) -> None:
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    from trainguard.failover.elastic import ElasticConfig, ElasticGroup, quiet_torchft_logs

    quiet_torchft_logs()
    torch.set_num_threads(cfg.threads_per_group)
    try:
        model, data, opt = _build(cfg)
        placement = make_placement(cfg.groups, cfg.redundancy)
        ctl = ReCtlr(placement)
        start = _load_checkpoint(Path(resume), model, opt) if resume else 0
        n = cfg.groups
        grp = ElasticGroup(g, n, ElasticConfig(lighthouse=lighthouse, timeout_s=cfg.timeout_s),
                           state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict(),
                                               "spare": {"orders": ctl.orders, "stack": ctl.stack,
                                                         "alive": ctl.alive.copy()}},
                           load_state_dict=lambda sd: _heal(sd, model, opt, ctl, placement))
        grp.manager.load_state_dict({"step": start, "batches_committed": 0})
        kills = {k.step: k.when for k in cfg.kills if k.group == g and k.step >= start}
        ckpt = Path(cfg.run_dir) / "checkpoint.pt"
        barrier.wait(timeout=300)  # every group is heartbeating before step 0 (a broken start fails loudly)

        def die(step: int, when: str) -> None:
            queue.put(("killed", g, {"step": step, "when": when}))
            time.sleep(0.2)  # let the queue's feeder thread flush before the fail-stop
            os.kill(os.getpid(), signal.SIGKILL)

        need_quorum = True
        while grp.step < cfg.steps:
            step = grp.step
            if kills.get(step) == "start":
                die(step, "start")
            if need_quorum:
                grp.begin_step()
                if grp.step != step:  # healed from a peer that committed a step we did not: go on in it
                    need_quorum = False
                    continue
            need_quorum = True
            live = grp.members()
            if not live:
                grp.commit()
                continue
            failed = sorted(int(h) for h in np.flatnonzero(ctl.alive) if h not in live)
            phase = ""
            if failed:
                res = ctl.on_failure(failed)
                phase = res.phase
                if res.wipeout:
                    queue.put(("wipeout", g, {"step": step, "failed": failed, "types": list(res.wiped_types)}))
                    grp.shutdown()
                    return
            orders, s = ctl.orders, ctl.stack
            counted_by = ctl.assign.copy()   # type -> the group whose copy is summed in this step
            alive = ctl.alive.copy()
            computed = {int(h): set(orders[h, :s].tolist()) for h in np.flatnonzero(alive)}
            # own = [sum of counted shard gradients..., sum of their losses]: one all-reduce gives both
            own = torch.zeros(sum(p.numel() for p in model.parameters()) + 1)
            spare_copies: dict[int, torch.Tensor] = {}
            for t in (orders[g, :s].tolist() if alive[g] else []):
                grad, loss = _shard_grad(model, data, cfg, step, t)
                item = torch.cat([grad, torch.tensor([loss])])
                if counted_by[t] == g:
                    own += item
                else:
                    spare_copies[t] = item  # redundant copy: counted only if its assignee dies in this step
            if kills.get(step) == "compute":
                die(step, "compute")
            log = _StepLog(step, s, len(computed.get(g, ())), failed=tuple(failed), phase=phase)
            healed = False
            while True:
                buf = own.clone()
                grp.allreduce_sum(buf)
                if grp.commit():
                    break
                # a peer died during this step: shrink, reorder, and finish the same step
                grp.begin_step()
                if grp.step != step:
                    healed = True
                    break
                live = grp.members()
                dead = sorted(int(h) for h in np.flatnonzero(alive) if live and h not in live)
                if not dead:
                    continue
                res = ctl.on_failure(dead)
                log.failed += tuple(dead)
                log.phase = res.phase
                if res.wipeout:
                    queue.put(("wipeout", g, {"step": step, "failed": dead, "types": list(res.wiped_types)}))
                    grp.shutdown()
                    return
                alive[dead] = False
                for h in dead:
                    computed.pop(h, None)
                load: dict[int, int] = {}
                for t in np.flatnonzero(np.isin(counted_by, dead)).tolist():
                    holders = [h for h in computed if t in computed[h]]
                    if holders:  # a survivor computed a redundant copy in its first s stacks: count it
                        counted_by[t] = min(holders)
                        if counted_by[t] == g:
                            own = own + spare_copies.pop(t)
                        continue
                    # nobody computed it: patch compute on the host the controller names (first failure of
                    # the step) or, after a second one, on the least-loaded surviving host
                    host = res.patches.get(t)
                    if host is None or not alive[host]:
                        host = min((int(h) for h in placement.hosts[t] if alive[h]), key=lambda h: (load.get(h, 0), h))
                    load[host] = load.get(host, 0) + 1
                    counted_by[t] = host
                    computed[host].add(t)
                    if host == g:
                        grad, loss = _shard_grad(model, data, cfg, step, t)
                        own += torch.cat([grad, torch.tensor([loss])])
                        log.patches += 1
                        log.computed += 1
            if healed:  # the retry quorum healed us into the next step: use that quorum
                need_quorum = False
                continue
            _apply(model, opt, buf[:-1], n)
            log.loss = float(buf[-1]) / n
            queue.put(("step", g, asdict(log)))
            done = grp.step
            if done % cfg.checkpoint_every == 0 or done == cfg.steps:
                if g == int(np.flatnonzero(ctl.alive)[0]):
                    _save_checkpoint(ckpt, done, model, opt, ctl)
        blob = io.BytesIO()  # by value: a tensor sent through the queue would live in this dying process
        torch.save(model.state_dict(), blob)
        queue.put(("done", g, {"state": blob.getvalue(), "stack": ctl.stack}))
        grp.shutdown()
    except Exception as e:  # report, then die like any failed group (the others carry on)
        queue.put(("error", g, {"message": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}))
        raise


def _heal(sd: dict, model, opt, ctl: ReCtlr, placement) -> None:
    """torchft live recovery: a group that missed a commit takes a healthy peer's state."""
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    sp = sd["spare"]
    fresh = ReCtlr.from_state(placement, sp["orders"], sp["stack"], sp["alive"])
    ctl.__dict__.update(fresh.__dict__)


# --------------------------------------------------------------------------------------------------
# Launcher


@dataclass
class SpareRunResult:
    state: dict[str, torch.Tensor]         # final parameters (from the lowest surviving group)
    steps: int
    killed: list[dict]                     # kills that happened: {"group", "step", "when"}
    global_restarts: int
    patch_computes: int
    mean_stacks_per_step: float            # mean all-reduce stack over committed steps
    final_loss: float
    survivors: list[int]
    step_logs: list[dict]
    wall_s: float
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "steps": self.steps, "killed_groups": len(self.killed), "kills": self.killed,
            "global_restarts": self.global_restarts, "patch_computes": self.patch_computes,
            "mean_stacks_per_step": self.mean_stacks_per_step, "final_loss": self.final_loss,
            "survivors": self.survivors, "wall_s": self.wall_s, "errors": self.errors,
        }


def run_spare(cfg: SpareRunConfig, progress=None) -> SpareRunResult:
    """Run ``cfg.groups`` processes under a fresh torchft lighthouse; restart globally on a wipe-out.

    ``progress(event, group, info)`` is called for every report (``step``, ``killed``, ``wipeout``, ...)."""
    import multiprocessing as mp

    from trainguard.failover.elastic import quiet_torchft_logs, start_lighthouse

    cfg.validate()
    quiet_torchft_logs()
    t0 = time.perf_counter()
    tmp = None
    if not cfg.run_dir:
        tmp = tempfile.TemporaryDirectory(prefix="trainguard-spare-")
        cfg = SpareRunConfig(**{**cfg.__dict__, "run_dir": tmp.name})
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    ckpt = Path(cfg.run_dir) / "checkpoint.pt"
    if ckpt.exists():
        raise TrainguardError(f"spare run: {cfg.run_dir} already holds a checkpoint; use an empty run directory")
    ctx = mp.get_context("spawn")
    killed: list[dict] = []
    restarts = 0
    errors: list[str] = []
    step_logs: dict[int, dict] = {}
    done: dict[int, dict] = {}
    pending = list(cfg.kills)
    resume: str | None = None
    try:
        while True:
            run_cfg = SpareRunConfig(**{**cfg.__dict__, "kills": tuple(pending)})
            lh = start_lighthouse()
            barrier, queue = ctx.Barrier(cfg.groups), ctx.Queue()
            procs = [ctx.Process(target=_group_main, args=(g, run_cfg, lh.address(), resume, barrier, queue),
                                 daemon=True) for g in range(cfg.groups)]
            for p in procs:
                p.start()
            wiped = None
            reported: set[int] = set()
            last_news = time.monotonic()
            # no report from any group for this long means the survivors are stuck: stop, do not hang
            patience = 3 * cfg.timeout_s + 60
            try:
                while len(reported) < cfg.groups:
                    try:
                        kind, g, info = queue.get(timeout=1.0)
                        last_news = time.monotonic()
                    except queue_mod.Empty:
                        if time.monotonic() - last_news > patience:
                            raise TrainguardError(f"spare run: no group reported for {patience:.0f} s "
                                                  f"(groups still running: {sorted(set(range(cfg.groups)) - reported)})") from None
                        for gi, p in enumerate(procs):  # a group that died without a word is a failure too
                            if gi not in reported and not p.is_alive():
                                reported.add(gi)
                                if p.exitcode not in (0, -signal.SIGKILL):
                                    errors.append(f"group {gi} exited with code {p.exitcode}")
                        continue
                    if progress is not None:
                        progress(kind, g, info)
                    if kind == "step":
                        agg = step_logs.setdefault(info["step"], {"step": info["step"], "stack": info["stack"],
                                                                  "patches": 0, "failed": [], "phase": "",
                                                                  "loss": info["loss"], "groups": 0})
                        agg["patches"] += info["patches"]
                        agg["failed"] = sorted(set(agg["failed"]) | set(info["failed"]))
                        agg["phase"] = agg["phase"] or info["phase"]
                        agg["groups"] += 1
                    elif kind == "killed":
                        killed.append({"group": g, **info})
                        pending = [k for k in pending if not (k.group == g and k.step == info["step"])]
                        reported.add(g)
                    elif kind == "wipeout":
                        wiped = info
                        reported.add(g)
                    elif kind == "done":
                        done[g] = info
                        reported.add(g)
                    elif kind == "error":
                        errors.append(f"group {g}: {info['message']}")
                        reported.add(g)
            finally:
                for p in procs:
                    p.join(timeout=10)
                    if p.is_alive():
                        p.kill()
                lh.shutdown()
            if wiped is None:
                break
            restarts += 1
            if restarts > cfg.max_restarts:
                raise TrainguardError(f"spare run: {restarts} global restarts, more than max_restarts={cfg.max_restarts}")
            resume = str(ckpt) if ckpt.exists() else None
            # steps after the checkpoint are re-run: forget their logs
            first = torch.load(ckpt, weights_only=False)["step"] if resume else 0
            step_logs = {k: v for k, v in step_logs.items() if k < first}
            done = {}
        if not done:
            raise TrainguardError("spare run: no group finished: " + ("; ".join(errors) or "all were killed"))
        first = min(done)
        logs = [step_logs[k] for k in sorted(step_logs)]
        patches = sum(lg["patches"] for lg in logs)
        return SpareRunResult(
            state=torch.load(io.BytesIO(done[first]["state"])), steps=cfg.steps, killed=killed, global_restarts=restarts,
            patch_computes=patches,
            mean_stacks_per_step=float(np.mean([lg["stack"] for lg in logs])) if logs else math.nan,
            final_loss=logs[-1]["loss"] if logs else math.nan, survivors=sorted(done), step_logs=logs,
            wall_s=time.perf_counter() - t0, errors=errors)
    finally:
        if tmp is not None:
            tmp.cleanup()
