"""Step guards: verify a training step before it is committed, and ask for it to be re-executed.

A :class:`StepGuard` sees every step twice: after forward/backward, **before** the optimizer update
(gradients are ready, parameters untouched) and **after** the update (new parameters, not yet
committed). Each look returns a :class:`Verdict`: commit, retry or abort. The trainer reduces the verdicts
of every guard on every rank (all data-parallel replicas and all pipeline stages) to the worst one, so
all ranks retry together and no collective is left waiting.

A retry restores the step's starting state on every rank and runs the step again (``Trainer.train_step``):
RNG, data position and gradients always; parameters, optimizer and scheduler only when the update had
already run (guards that set ``inspects_update = False`` never cost a copy of the optimizer state); and
every component registered with ``Trainer.register_state``. Retries are bounded
(``train.max_retries``). A retry asked for at the same site (rank and guard site) on consecutive attempts of
one step is reported as suspected persistent hardware (:class:`~trainguard.errors.SuspectedHardwareFault`,
exit code 3): re-executing on the same device will not help.

A guard may also stop the run itself, as suspected persistent hardware: by raising
:class:`~trainguard.errors.SuspectedHardwareFault` from a look (a stop found in the middle of the update, where
the other ranks may be in a collective, is kept until the guard's next look: ``stops_after_update``). On one
process the error propagates. On several ranks a raise on one rank would leave
the others waiting in the next collective for it, so the trainer turns it into a ``SUSPECT`` verdict, reduces it
like any other, and every rank stops at the same point: the failing rank with its own error, the others with
one that names it (every guard's :meth:`StepGuard.on_stop` is called first).

Writing a guard::

    class FiniteLoss(StepGuard):
        name = "finite-loss"
        inspects_update = False                 # only looks before the update: no snapshot of the optimizer

        def before_update(self, ctx):
            if not torch.isfinite(ctx.loss).all():
                return Verdict.retry(site="loss", reason="non-finite loss")
            return Verdict.commit()

    trainer.add_guard(FiniteLoss())

Relies on torch only (the reduction is done by the trainer's parallel strategy).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trainguard.train.trainer import Trainer


class Action(enum.IntEnum):
    """Ordered by severity: the reduction across guards and ranks keeps the largest."""

    COMMIT = 0
    RETRY = 1
    ABORT = 2
    SUSPECT = 3  # a rank stopped the run as suspected persistent hardware: every rank stops with it


@dataclass(frozen=True)
class Verdict:
    action: Action = Action.COMMIT
    site: str = ""  # where the problem was seen ("abft:layer3/context", "dmr:aten.mm#12", "loss")
    reason: str = ""
    guard: str = ""  # filled in by the trainer
    rank: int = 0  # filled in by the trainer
    rewind: bool = False  # retry from the start of the previous (committed) step: see StepGuard.on_rewind
    # a re-execution the guard planned, not a fault (DMR's profiled attempts): it counts neither against
    # train.max_retries nor as a failure of its site on consecutive attempts
    planned: bool = False

    @classmethod
    def commit(cls) -> Verdict:
        return _COMMIT

    @classmethod
    def retry(cls, site: str, reason: str = "", rewind: bool = False, planned: bool = False) -> Verdict:
        return cls(Action.RETRY, site, reason, rewind=rewind, planned=planned)

    @classmethod
    def abort(cls, site: str, reason: str = "") -> Verdict:
        return cls(Action.ABORT, site, reason)

    @classmethod
    def suspect(cls, site: str, reason: str) -> Verdict:
        """This rank stopped the run as suspected persistent hardware (``reason``: the error's message)."""
        return cls(Action.SUSPECT, site, reason)

    @property
    def ok(self) -> bool:
        return self.action == Action.COMMIT

    def where(self) -> str:
        """``rank R, GUARD at SITE`` for reports."""
        return f"rank {self.rank}, {self.guard or 'guard'} at {self.site or '?'}"

    def to_dict(self) -> dict[str, Any]:
        out = {"action": self.action.name.lower(), "site": self.site, "reason": self.reason, "guard": self.guard,
               "rank": self.rank}
        if self.rewind:
            out["rewind"] = True
        if self.planned:
            out["planned"] = True
        return out

    def to_json(self, limit: int) -> bytes:
        """:meth:`to_dict` as ASCII JSON of at most ``limit`` bytes, for fixed-width rows between ranks. Where it
        does not fit, the reason (then the site) is shortened, never the action or its flags: a cut row would
        lose a stop's severity at its peers."""
        d = self.to_dict()
        blob = json.dumps(d).encode()
        for key in ("reason", "site"):
            over = len(blob) - limit
            if over <= 0:
                return blob
            # each character cut saves at least one byte (more where JSON escapes it): one cut is enough
            text = d[key][: max(0, len(d[key]) - over - 3)]
            d[key] = text + "..." if text else ""
            blob = json.dumps(d).encode()
        if len(blob) > limit:
            raise ValueError(f"a verdict does not fit in {limit} bytes even without its reason and site")
        return blob

    @classmethod
    def from_dict(cls, d: dict[str, Any], rank: int) -> Verdict:
        """The verdict :meth:`to_dict` wrote, as rank ``rank``'s (verdicts sent between ranks as JSON)."""
        return cls(Action[d["action"].upper()], d["site"], d["reason"], d["guard"], rank, bool(d.get("rewind")),
                   bool(d.get("planned")))


_COMMIT = Verdict()


@dataclass
class StepContext:
    """What a guard sees of the step being verified."""

    trainer: Trainer
    step: int
    attempt: int  # 0: first execution; 1, 2, ...: re-executions after a retry verdict
    loss: torch.Tensor | None = None  # this rank's mean loss over its micro-batches (None on stages without one)
    stage: str = "before_update"  # before_update | after_update
    extra: dict[str, Any] = field(default_factory=dict)


class StepGuard:
    """Base class (and protocol) of step guards; override what you need. Every method is optional.

    ``inspects_update``: whether :meth:`after_update` looks at anything. When no registered guard does, a
    retry never needs to roll the optimizer back, so the trainer does not snapshot parameters and
    optimizer state at all.

    ``stops_after_update``: on several ranks, :meth:`after_update` is called (and reduced over every rank: one
    small collective a step) even without ``inspects_update``, but may only commit or stop the run: a guard that
    defers a stop found in the middle of the update (where the other ranks are in a collective) reports it there.
    It keeps no snapshot, so it cannot ask for a retry from there.
    """

    name: str = "guard"
    inspects_update: bool = False
    may_rewind: bool = False  # asks for rewinds (Verdict.rewind): the trainer then records each step's start
    stops_after_update: bool = False

    def on_step_start(self, ctx: StepContext) -> None:
        """Called before every attempt of a step (reset per-attempt counters here)."""

    def before_update(self, ctx: StepContext) -> Verdict:
        return Verdict.commit()

    def after_update(self, ctx: StepContext) -> Verdict:
        return Verdict.commit()

    def on_error(self, ctx: StepContext, err: Exception) -> Verdict | None:
        """An exception escaped forward/backward: return a retry verdict if this guard knows it was caused by
        a fault it detected (e.g. a corrupted routing decision made the recompute's shapes differ); None
        lets the exception propagate. Single-process runs only."""
        return None

    def on_retry(self, ctx: StepContext, verdict: Verdict) -> None:
        """Called on every rank after the step's state was restored, before the re-execution."""

    def on_rewind(self, ctx: StepContext, step: int) -> None:
        """A retry verdict with ``rewind`` (a check of step ``step``, the previous one, ran after its update and
        failed): put parameters and the optimizer's tensor state back to the start of ``step`` (the trainer keeps
        no copy of them; a guard that asks for a rewind must). The trainer restores the rest (RNG, data position,
        scheduler, the optimizer's hyper-parameters and scalar counters, registered components) and re-executes
        ``step``, then the current one. A guard that cannot (its copy is gone) raises ``StepAborted``: on several
        ranks every rank then stops with it (``on_stop`` with an ``ABORT`` verdict)."""

    def on_commit(self, ctx: StepContext) -> None:
        """Called once the step is committed."""

    def on_stop(self, ctx: StepContext, verdict: Verdict) -> None:
        """Called on every rank when rank ``verdict.rank`` stopped the run as suspected persistent hardware
        (``Action.SUSPECT``) or could not rewind (``Action.ABORT``), before the trainer raises: mark what this rank
        holds as not to be trusted."""


def worst(verdicts: list[Verdict]) -> Verdict:
    """The most severe verdict (the first one among equals; a failure before a planned re-execution, a rewind
    before a retry of this step alone). A rewind among retries must win: a retry of this step alone would leave the
    previous step's update, which a check found wrong, in place (and the guard that asked for the rewind waiting
    for it)."""
    out = _COMMIT
    for v in verdicts:
        if (v.action, not v.planned, v.rewind) > (out.action, not out.planned, out.rewind):
            out = v
    return out
