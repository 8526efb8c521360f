"""Elastic data parallel on torchft: replicas may die and come back while the run goes on.

One replica group is one process (``distributed.strategy = "elastic"``, ``[distributed.elastic]``). Every
step of the Trainer becomes:

* ``plan``: a torchft quorum (:class:`~trainguard.train.parallel.torchft_group.ElasticGroup`). A replica that
  is behind (restarted, or it missed a commit) heals here: a live peer sends its ``Trainer.state_dict()``
  over torchft's checkpoint transport and this replica ``load_state_dict``\\ s it, then continues in the
  peer's step. Then the membership (one all-reduce) and the **gradient-sync policy**, which says which
  micro-batches each live replica computes, with what weight, and which it keeps apart (:class:`SyncPlan`).
* ``forward_backward``: this replica computes its micro-batches (each one alone: one gradient row per
  slice of the global batch), then one all-reduce through torchft. When a peer dies during the step the
  collective fails: re-form the quorum, ask the policy what the survivors must add (:class:`Recovery`:
  extra micro-batches, kept copies that now count, new weights) and finish **the same step**.
* ``should_commit``: torchft's. Guard verdicts and the logged loss go through the same quorum.

With ``ordered_reduction`` (the default) the all-reduce carries one row per slice and every replica sums
the counted rows in slice order: the result depends only on which slices were counted, not on who
computed them or on arrival order, so it is bitwise equal to a single-process run with the same
micro-batches (CPU). Checkpoints are written by the lowest live replica (DCP in single-process mode).

A policy is a :class:`GradSyncPolicy`; the default, :class:`DataParallelPolicy`, gives each live replica its
own ``grad_accum`` slices weighted ``1 / (live * grad_accum)`` (the mean over the live replicas' slices).
SPARe (stacked redundant shards) and MeCeFO (a neighbor computes a failed replica's slices, tagged
``{"neighbor"}``) are policies on the same engine. A plan may weight named parameter groups apart from the
rest (``GradSyncPolicy.param_groups``, ``SyncPlan.group_weights``: MeCeFO averages the attention gradients
over the slices that computed them). Techniques see each micro-batch through ``micro_contexts`` (entered
around its forward and backward) and each reduced gradient through ``after_reduce``. Relies on torch and
torchft.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from trainguard.errors import ConfigError, TrainguardError
from trainguard.train.guards import Action, Verdict
from trainguard.train.parallel.base import MicroBatch, StepPlan, Strategy
from trainguard.train.parallel.torchft_group import ElasticGroup, Membership

if TYPE_CHECKING:
    from trainguard.train.trainer import Trainer


# --------------------------------------------------------------------------------------------------
# The gradient-sync policy protocol


@dataclass(frozen=True)
class StepView:
    """What a policy knows about the step it plans (the same on every live replica)."""

    step: int
    live: frozenset[int]  # replica ids taking part in this step
    replicas: int  # configured replica count (ids are 0..replicas-1)
    grad_accum: int  # train.grad_accum
    failed: frozenset[int] = frozenset()  # in the last committed step, gone now
    joined: frozenset[int] = frozenset()  # in this step, not in the last committed one (restarted / healed in)


@dataclass
class SyncPlan:
    """Each live replica's micro-batches for one step, in compute order.

    ``MicroBatch.weight`` multiplies that slice's loss before backward; the global gradient is the sum over
    every counted micro-batch (``keep=False``) of all replicas. ``keep=True``: computed, but held back (a
    redundant copy a :class:`Recovery` may count later). ``tags`` mark a degraded mode (``{"neighbor"}``)."""

    work: dict[int, list[MicroBatch]]
    info: dict[str, Any] = field(default_factory=dict)  # policy notes for the step's record
    # parameter group (GradSyncPolicy.param_groups) -> slice -> the weight of that group's gradient in the slice,
    # in place of the micro-batch weight (MeCeFO averages attention gradients over fewer slices than the rest)
    group_weights: dict[str, dict[int, float]] = field(default_factory=dict)

    def counted(self) -> dict[int, float]:
        """slice -> weight of every counted micro-batch."""
        return {mb.index: mb.weight for mbs in self.work.values() for mb in mbs if not mb.keep}


@dataclass
class Recovery:
    """How the survivors finish a step in which replicas died after the plan."""

    extra: dict[int, list[MicroBatch]] = field(default_factory=dict)  # replica -> more micro-batches to compute now (counted)
    count: dict[int, list[int]] = field(default_factory=dict)  # replica -> slices of its kept copies that now count
    reweight: dict[int, float] = field(default_factory=dict)  # slice -> new weight of an already computed slice
    info: dict[str, Any] = field(default_factory=dict)
    group_weights: dict[str, dict[int, float]] = field(default_factory=dict)  # group -> slice -> new group weight


class GradSyncPolicy:
    """Base class (and protocol) of gradient-sync policies. Implementations must be deterministic: every live
    replica calls them with the same arguments and must reach the same answer.

    A policy with state (``state_dict`` returning a non-empty dict) gets it saved in checkpoints and sent to
    a healing replica; the strategy restores it when a step is re-executed."""

    name = "policy"

    def n_slices(self, replicas: int, grad_accum: int) -> int:
        """How many equal slices the global batch is cut into."""
        return replicas * grad_accum

    def plan(self, view: StepView) -> SyncPlan:
        raise NotImplementedError

    def on_failure(self, view: StepView, failed: frozenset[int], plan: SyncPlan) -> Recovery:
        """``failed`` died during the step; ``view.live`` are the survivors; ``plan`` is the step's work so far,
        the failed replicas' included (extra micro-batches of earlier recoveries appended, copies that now count
        with ``keep=False``; replicas that failed earlier in the step removed)."""
        raise NotImplementedError

    def param_groups(self, model: torch.nn.Module) -> dict[str, list[str]]:
        """Named groups of parameters (``model.named_parameters()`` names) whose gradients a plan may weight apart
        from the micro-batch weight (:attr:`SyncPlan.group_weights`). Default: none."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class DataParallelPolicy(GradSyncPolicy):
    """Each live replica computes its own ``grad_accum`` slices; weights ``1 / (live * grad_accum)`` make the sum
    over the live replicas the mean over their slices (torchft's default: the batch shrinks with the quorum).
    A replica dying mid-step: its slices are dropped and the survivors' are re-weighted."""

    name = "data-parallel"

    def plan(self, view: StepView) -> SyncPlan:
        k = view.grad_accum
        n = self.n_slices(view.replicas, k)
        w = 1.0 / (len(view.live) * k)
        return SyncPlan({r: [MicroBatch(r * k + m, n, w) for m in range(k)] for r in sorted(view.live)})

    def on_failure(self, view: StepView, failed: frozenset[int], plan: SyncPlan) -> Recovery:
        w = 1.0 / (len(view.live) * view.grad_accum)
        return Recovery(reweight={mb.index: w for r in sorted(view.live) for mb in plan.work.get(r, []) if not mb.keep})


# --------------------------------------------------------------------------------------------------
# The strategy


class _Abandon(Exception):
    """The step cannot be finished in this quorum: re-execute it from its start."""


class ElasticStrategy(Strategy):
    """Elastic data parallel on torchft with a :class:`GradSyncPolicy` (see the module docstring)."""

    name = "elastic"

    def __init__(self, policy: GradSyncPolicy | None = None) -> None:
        super().__init__()
        self.policy = policy if policy is not None else DataParallelPolicy()
        self.group: ElasticGroup | None = None
        self.replica_id, self.replicas = 0, 1
        self.last_live: frozenset[int] = frozenset()  # replicas of the last committed step
        self.record: dict[str, Any] = {}  # the last committed step: membership, failures, counted slices, policy notes
        self._started = False
        self._pending_heal: dict | None = None  # a peer's Trainer.state_dict() received in a quorum
        self._prepared: Membership | None = None  # a quorum already formed for the next plan
        self._start: dict[str, Any] | None = None  # {"step", "live", "policy"} at the start of the current step
        self._attempts = 0
        self._attempt_step: int | None = None  # the step the attempts are counted for
        self._abandoned = False
        self._view: StepView | None = None
        self._sync: SyncPlan | None = None
        self._events: list[dict[str, Any]] = []
        self._global_loss: torch.Tensor | None = None
        # per micro-batch: context managers entered around its forward and backward (``make(trainer, mb)``)
        self.micro_contexts: list[Callable[[Trainer, MicroBatch], contextlib.AbstractContextManager]] = []
        # after the gradient all-reduce of a step: ``hook(trainer, view, plan)`` (may run collectives on
        # ``self.group``; a failed one must be tolerated: the commit vote then fails and the step is re-executed)
        self.after_reduce: list[Callable[[Trainer, StepView, SyncPlan], None]] = []
        self._group_ranges: dict[str, list[tuple[int, int]]] | None = None  # group -> (offset, numel) in a row
        self._row_groups: dict[int, dict[str, float]] = {}  # slice -> group -> weight its row's group part carries

    # ---- set-up ---------------------------------------------------------------------------------
    def init(self, trainer: Trainer) -> None:
        d = trainer.cfg.distributed
        self.cfg = d.elastic
        self.replicas, self.replica_id = d.elastic_replicas(), d.elastic.replica_id
        self.rank, self.world = self.replica_id, self.replicas
        self.group = ElasticGroup(self.replica_id, self.replicas, self.cfg, state_dict=trainer.state_dict,
                                  load_state_dict=self._receive_state, device=trainer.device)

    def wrap(self, trainer: Trainer) -> None:
        # before the checkpoint load in Trainer.__init__: a resumed run restores the membership and the policy
        trainer.register_state("elastic", self)

    def check_batch(self, trainer: Trainer) -> None:
        n = self.policy.n_slices(self.replicas, trainer.grad_accum)
        if trainer.batches.batch_size % n:
            raise ConfigError(f"data.batch_size ({trainer.batches.batch_size}) must be divisible by the {n} slices "
                              f"of the elastic policy {self.policy.name!r}")

    @property
    def is_main(self) -> bool:
        """The lowest live replica (it writes checkpoints, metrics and the summary)."""
        return self.replica_id == (min(self.last_live) if self.last_live else 0)

    def writes_checkpoints(self) -> bool:
        return self.is_main

    # ---- state: the membership and the policy, as of the start of the current step ----------------
    def state_dict(self) -> dict[str, Any]:
        if self._start is not None:
            return {"live": sorted(self._start["live"]), "policy": copy.deepcopy(self._start["policy"])}
        return {"live": sorted(self.last_live), "policy": copy.deepcopy(self.policy.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_live = frozenset(int(r) for r in state.get("live", ()))
        self.policy.load_state_dict(copy.deepcopy(state.get("policy", {})))
        self._start = None

    def _receive_state(self, state: dict) -> None:
        # torchft calls this inside start_quorum; it is applied in plan(), once the trainer may move on
        self._pending_heal = state

    # ---- quorum ---------------------------------------------------------------------------------
    def _quorum(self, mid_step: bool, digest: int = 0) -> Membership | None:
        """Form a quorum; None when it failed (the caller forms another). A heal is left pending."""
        self.group.quorum()
        if self.group.errored:
            self.group.abort()
            return None
        return self.group.members(mid_step=mid_step and self._pending_heal is None, digest=digest)

    def _retries_left(self, what: str, step: int) -> None:
        self._attempts += 1
        if self._attempts > self.cfg.max_step_retries + 1:
            raise TrainguardError(f"elastic: {what} failed {self._attempts - 1} times at step {step} "
                                  f"(distributed.elastic.max_step_retries = {self.cfg.max_step_retries}; "
                                  f"last live replicas: {sorted(self.last_live)}, min_replicas = {self.cfg.min_replicas})")

    # ---- one step ------------------------------------------------------------------------------
    def plan(self, trainer: Trainer, step: int) -> StepPlan:
        self._events = []
        self._abandoned = False
        self._global_loss = None
        self._apply_heal(trainer)  # a heal received while the previous attempt was abandoned
        if not self._started or self.group.step != trainer.step_idx:
            self.group.set_step(trainer.step_idx)  # a resumed run, or a step re-executed after the commit vote
            self._started = True
        if self._attempt_step == trainer.step_idx:
            self._retries_left("the step", trainer.step_idx)
        else:
            self._attempt_step, self._attempts = trainer.step_idx, 0
        if self._start is not None and self._start["step"] == trainer.step_idx:
            self.load_state_dict(self._start_copy())  # re-executing the step: from its starting state
        while True:
            m, self._prepared = self._prepared, None
            if m is None:
                m = self._quorum(mid_step=False)
            self._apply_heal(trainer)
            if self.group.step != trainer.step_idx:
                raise TrainguardError(f"elastic: torchft is at step {self.group.step} but the trainer at "
                                      f"{trainer.step_idx} (replica {self.replica_id})")
            if m is not None and not m.mid_step:
                break
            # a failed quorum, or peers re-forming a step we did not plan (they start it over): form another
            self._retries_left("the quorum", trainer.step_idx)
        step = trainer.step_idx
        if self._start is None or self._start["step"] != step:
            self._start = {"step": step, "live": self.last_live, "policy": copy.deepcopy(self.policy.state_dict())}
        prev = self.last_live
        self._view = StepView(step, m.live, self.replicas, trainer.grad_accum,
                              failed=prev - m.live if prev else frozenset(),
                              joined=m.live - prev if prev else frozenset())
        self._sync = self.policy.plan(self._view)
        self._sync.work = {r: list(mbs) for r, mbs in self._sync.work.items()}
        self._sync.group_weights = {g: dict(ws) for g, ws in self._sync.group_weights.items()}
        self._row_groups = {}
        micro = list(self._sync.work.get(self.replica_id, []))
        return StepPlan(step, micro, info={"live": sorted(m.live), **self._sync.info})

    def _apply_heal(self, trainer: Trainer) -> None:
        """Continue from the peer state torchft delivered in a quorum (this replica was behind)."""
        if self._pending_heal is None:
            return
        state, self._pending_heal = self._pending_heal, None
        trainer.load_state_dict(state)  # also this strategy's membership and policy state (a registered component)
        self._events.append({"event": "healed", "to_step": trainer.step_idx})

    @property
    def sync_plan(self) -> SyncPlan | None:
        """The current step's plan as it stands (a recovery's extra micro-batches included): for techniques that
        need to know what else this replica computes in the step."""
        return self._sync

    def _start_copy(self) -> dict[str, Any]:
        return {"live": sorted(self._start["live"]), "policy": copy.deepcopy(self._start["policy"])}

    def forward_backward(self, trainer: Trainer, plan: StepPlan) -> torch.Tensor:
        params = [p for p in trainer.model.parameters() if p.requires_grad]
        rows: dict[int, torch.Tensor] = {}  # slice -> [grad..., has-grad per parameter..., loss, 1] (counted)
        kept: dict[int, torch.Tensor] = {}  # slice -> the same, held back
        losses: list[torch.Tensor] = []
        for mb in plan.micro:
            self._compute(trainer, plan.step, mb, params, rows, kept, losses)
        _notify(trainer, "compute", plan.step)  # local gradients ready, before the all-reduce (fail-stop point)
        try:
            buf = self._reduce(trainer, plan, params, rows, kept, losses)
        except _Abandon:
            self._abandoned = True
            trainer.model.zero_grad(set_to_none=True)
            return _mean(losses)
        self._apply(trainer, params, buf)
        for hook in self.after_reduce:
            hook(trainer, self._view, self._sync)
        return _mean(losses)

    def _compute(self, trainer, step, mb, params, rows, kept, losses) -> None:
        """One micro-batch alone: its gradient row (weighted like the single-process trainer's backward)."""
        with contextlib.ExitStack() as stack:
            for make in self.micro_contexts:
                stack.enter_context(make(trainer, mb))
            trainer.model.zero_grad(set_to_none=True)
            x, y = trainer.micro_batch(step, mb)
            loss = trainer.compute_loss(x, y)
            (loss * mb.weight if mb.weight != 1.0 else loss).backward()
            loss = loss.detach().float()
            grads = [p.grad for p in params]
            row = torch.cat([
                *((g if g is not None else torch.zeros_like(p)).reshape(-1).float() for g, p in zip(grads, params)),
                torch.tensor([0.0 if g is None else 1.0 for g in grads], device=loss.device),
                loss.reshape(1), torch.ones(1, device=loss.device),
            ])
        self._row_groups.pop(mb.index, None)  # a fresh row carries the micro-batch weight in every group
        if self._sync.group_weights:
            self._weigh_groups(trainer, row, mb.index, mb.weight)
        (kept if mb.keep else rows)[mb.index] = row
        losses.append(loss)

    # ---- per-parameter-group weights (SyncPlan.group_weights) -------------------------------------
    def _ranges(self, trainer: Trainer) -> dict[str, list[tuple[int, int]]]:
        """group -> the (offset, numel) of its parameters in a gradient row (computed once)."""
        if self._group_ranges is None:
            groups = self.policy.param_groups(trainer.model)
            where, off = {}, 0
            for name, p in trainer.model.named_parameters():
                if p.requires_grad:
                    where[name] = (off, p.numel())
                    off += p.numel()
            unknown = sorted(n for names in groups.values() for n in names if n not in where)
            if unknown:
                raise TrainguardError(f"elastic: policy {self.policy.name!r} names parameters the model does not "
                                      f"train: {', '.join(unknown[:5])}")
            self._group_ranges = {g: [where[n] for n in names] for g, names in groups.items()}
        return self._group_ranges

    def _weigh_groups(self, trainer: Trainer, row: torch.Tensor, t: int, weight: float) -> None:
        """Make each group's part of slice ``t``'s row carry its planned weight (``weight``: the slice's micro-batch
        weight, which the row carries where no group weight was applied, and groups the plan does not weight apart
        keep)."""
        have = self._row_groups.setdefault(t, {})
        for g, ranges in self._ranges(trainer).items():
            now = have.get(g, weight)
            want = self._sync.group_weights.get(g, {}).get(t, weight)
            if want != now:
                if now == 0.0:
                    raise TrainguardError(f"elastic: policy {self.policy.name!r} gave group {g!r} of slice {t} the "
                                          f"weight {want} after weight 0 (its gradient was never kept)")
                for off, k in ranges:
                    row[off:off + k] *= want / now
            have[g] = want

    def _reduce(self, trainer, plan, params, rows, kept, losses) -> torch.Tensor:
        """All-reduce the counted rows; on a peer failure re-form the quorum, recover, and try again."""
        sync, view, step = self._sync, self._view, plan.step
        n = plan.micro[0].n_slices if plan.micro else self.policy.n_slices(self.replicas, trainer.grad_accum)
        width = sum(p.numel() for p in params) + len(params) + 2
        while True:
            buf = self._assemble(rows, n, width, trainer.device)
            if self.group.allreduce_sum(buf):
                return buf
            t0 = time.perf_counter()
            self._retries_left("the gradient all-reduce", step)
            m = self._quorum(mid_step=True, digest=_digest(view.live))
            if self._pending_heal is not None:  # a peer committed this step without us: heal, go on in its step
                self._prepared = m
                raise _Abandon
            if m is None:
                continue
            # a replica joined while we re-form the step, or the members disagree on who already failed (a
            # collective that failed for some and not for others): everyone starts the step over
            if m.fresh or len(set(m.digests.values())) > 1:
                raise _Abandon
            failed = view.live - m.live
            if not failed:  # the collective failed but nobody left: try it again
                continue
            view = self._view = replace(view, live=m.live)
            rec = self.policy.on_failure(view, frozenset(failed), sync)
            for r in failed:  # whatever the dead computed never arrives
                sync.work.pop(r, None)
            self._events.append({"event": "failure", "failed": sorted(failed), "recovery_s": time.perf_counter() - t0,
                                 **rec.info})
            for g, ws in rec.group_weights.items():
                sync.group_weights.setdefault(g, {}).update(ws)
            for r, slices in rec.count.items():
                for t in slices:
                    sync.work[r] = [replace(mb, keep=False) if mb.index == t else mb for mb in sync.work.get(r, [])]
                    if r == self.replica_id:
                        rows[t] = kept.pop(t)
            for r, mbs in rec.extra.items():
                mbs = [replace(mb, keep=False) for mb in mbs]
                sync.work.setdefault(r, []).extend(mbs)
                for mb in mbs:
                    if r == self.replica_id:
                        self._compute(trainer, step, mb, params, rows, kept, losses)
            old = sync.counted()
            for t, w in rec.reweight.items():
                for r in sync.work:
                    sync.work[r] = [replace(mb, weight=w) if mb.index == t and not mb.keep else mb for mb in sync.work[r]]
                if t in rows and old.get(t, w) != w:
                    rows[t][: width - len(params) - 2] *= w / old[t]
                    for g in self._row_groups.get(t, {}):
                        self._row_groups[t][g] *= w / old[t]
            if sync.group_weights:  # every row's group parts to the weights the plan gives them now
                mine = {mb.index: mb.weight for mb in sync.work.get(self.replica_id, [])}
                for t, row in [*rows.items(), *kept.items()]:
                    self._weigh_groups(trainer, row, t, mine.get(t, 1.0))

    def _assemble(self, rows: dict[int, torch.Tensor], n: int, width: int, device) -> torch.Tensor:
        if self.cfg.ordered_reduction:
            buf = torch.zeros(n, width, device=device)
            for t, row in rows.items():
                buf[t] = row
            return buf
        buf = torch.zeros(width, device=device)
        for t in sorted(rows):
            buf += rows[t]
        return buf

    def _apply(self, trainer: Trainer, params: list[torch.nn.Parameter], buf: torch.Tensor) -> None:
        """The global gradient into ``p.grad``; the global loss for :meth:`global_loss`."""
        n_grad = buf.shape[-1] - len(params) - 2
        if self.cfg.ordered_reduction:
            counted = torch.nonzero(buf[:, -1] > 0.5).flatten().tolist()
            if bool((buf[:, -1] > 1.5).any()):
                raise TrainguardError(f"elastic: policy {self.policy.name!r} counted a slice twice at step "
                                      f"{self._view.step} (slices {torch.nonzero(buf[:, -1] > 1.5).flatten().tolist()})")
            if not counted:
                raise TrainguardError(f"elastic: no slice was counted at step {self._view.step}")
            total = buf[counted[0]].clone()  # slice order: the single-process trainer's accumulation order
            for t in counted[1:]:
                total += buf[t]
        else:
            total = buf
        trainer.model.zero_grad(set_to_none=True)
        has_grad = total[n_grad:n_grad + len(params)].tolist()
        off = 0
        for i, p in enumerate(params):
            k = p.numel()
            if has_grad[i] > 0:  # a parameter no counted micro-batch reached keeps grad None (as in one process)
                p.grad = total[off:off + k].view_as(p).to(p.dtype).clone()
            off += k
        self._global_loss = total[-2] / total[-1]

    def global_loss(self, trainer: Trainer, loss: torch.Tensor) -> torch.Tensor:
        """Mean loss over every counted slice (carried by the gradient all-reduce: no extra collective)."""
        return self._global_loss if self._global_loss is not None else loss

    def reduce_verdicts(self, trainer: Trainer, local: Verdict) -> list[Verdict]:
        """MAX of the actions through the quorum, then (only when some replica does not commit) every replica's
        verdict as JSON bytes in its own row of a summed buffer. A failed collective counts as commit: the
        commit vote then fails and the step is re-executed."""
        if self._abandoned:
            return []
        code = torch.tensor([float(int(local.action))], dtype=torch.float64, device=trainer.device)
        if not self.group.allreduce_max(code) or int(code) == Action.COMMIT:
            return []
        width = 1024
        rows = torch.zeros(self.replicas, width, dtype=torch.int32, device=trainer.device)
        if not local.ok:
            blob = local.to_json(width)  # a long reason is shortened; the action is never cut
            rows[self.replica_id, : len(blob)] = torch.tensor(list(blob), dtype=torch.int32)
        if not self.group.allreduce_sum(rows):
            return []
        out = []
        for r, row in enumerate(rows.cpu().tolist()):
            blob = bytes(b for b in row if b)
            if not blob:
                continue
            try:
                out.append(Verdict.from_dict(json.loads(blob.decode()), r))
            except (ValueError, KeyError):
                out.append(Verdict(Action.RETRY, "?", "verdict truncated", "", r))
        return out

    def should_commit(self, trainer: Trainer) -> bool:
        if self._abandoned:
            return False
        if not self.group.commit():
            return False
        view, sync = self._view, self._sync
        failed = sorted(set(view.failed) | {r for e in self._events if e["event"] == "failure" for r in e["failed"]})
        self.record = {"step": view.step, "live": sorted(view.live), "failed": failed, "joined": sorted(view.joined),
                       "counted": sync.counted(), "work": {r: len(m) for r, m in sync.work.items()},
                       "events": list(self._events), "policy": dict(sync.info),
                       "group_weights": {g: dict(ws) for g, ws in sync.group_weights.items()}}
        self.last_live = view.live
        self._start = None
        self._attempt_step, self._attempts = None, 0
        return True

    def close(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None


def _notify(trainer: Trainer, stage: str, step: int) -> None:
    """Tell the trainer's callbacks (``on_stage``) about a stage inside the strategy's forward/backward."""
    for cb in trainer.callbacks:
        fn = getattr(cb, "on_stage", None)
        if fn is not None:
            fn(trainer, stage, step)


def _digest(live: frozenset[int]) -> int:
    """A replica's view of who is still in the step, as an integer below 2**52 (the same on every process)."""
    return hash(tuple(sorted(live))) % (1 << 52)


def _mean(losses: list[torch.Tensor]) -> torch.Tensor:
    if not losses:
        return torch.zeros(())
    total = losses[0]
    for x in losses[1:]:
        total = total + x
    return total / len(losses)


__all__ = ["DataParallelPolicy", "ElasticStrategy", "GradSyncPolicy", "Recovery", "StepView", "SyncPlan"]
