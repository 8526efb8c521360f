"""Checks carried past the update into the next iteration (part of :class:`~trainguard.sdc.dmr.engine.DMREngine`):
the backward ops no window follows before the update, checked with the parameters as the primary read them (the
held copy); a mismatch puts the state back to the start of that iteration and re-executes both. Also the engine's
settling of held checks before the state is read from outside the step loop. Relies on torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainguard.errors import StepAborted, SuspectedHardwareFault
from trainguard.sdc.dmr.engine.common import _checking, _storage_key
from trainguard.sdc.dmr.plan import CARRY


class CarriedChecks:
    """The engine's carried checks (a part of DMREngine: it reads and writes the engine's state)."""

    # ---- checks carried past the update into the next iteration (``carry_last``) ---------------------------
    # The plan leaves naive the backward ops that no window follows before the update (on the first pipeline
    # stage: the last micro-batch's backward). With the update held (above), the verified state before the update
    # is kept anyway, so those checks can wait for the next iteration's first window: they run with the
    # parameters as the primary read them (the held copy), and a mismatch means the update read wrong gradients:
    # the trainer puts the state back to the start of that iteration (parameters and optimizer from the held
    # copy, the rest from its own record) and re-executes both iterations. A step after which the trainer
    # reads the state (evaluation, checkpoint, the end of the run) carries nothing.
    def _carrying(self) -> bool:
        return (self._carry_sync() and self.cfg.hold_update and self.cfg.fingerprints
                and self.cfg.compare == "bitwise" and self._hold_expected())

    def _carry_sync(self) -> bool:
        """Whether this step may carry checks on some rank (no per-rank quantity enters it: every rank agrees)."""
        return self.carry_ok and self.cfg.carry_last and self._lazy_ok() and self.cfg.system == "sparetrain"

    def _hold_expected(self) -> bool:
        """Whether this iteration's update will be held (``_can_hold``), judged before it runs (once a step: every
        backward op asks)."""
        if self._hold_memo[0] != self.step:
            self._hold_memo = (self.step, self._judge_hold())
        return self._hold_memo[1]

    def _judge_hold(self) -> bool:
        opt = getattr(self._trainer, "optimizer", None)
        if opt is None or not all(g.get("fused") for g in opt.param_groups) or \
                type(opt).__name__ not in ("Adam", "AdamW"):
            return False
        n = sum(p.numel() * p.element_size() for g in opt.param_groups for p in g["params"])
        return not self.budget_bytes or 2 * 3 * n <= self.budget_bytes // 2

    def _carried_due(self) -> bool:
        return bool(self._carried or self._carried_fifo) and self._carried_step < self.step

    def _before_update(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as it was before the held update: a parameter, or a view of one (a transposed weight), taken from
        the held copy of it; anything else as it is."""
        kept = self._pre_by_storage.get(_storage_key(t))  # (no storage: its id, never a key here)
        if kept is None:
            return t
        p, c = kept
        if t is p:
            return c
        return c.as_strided(t.size(), t.stride(), t.storage_offset() - p.storage_offset() + c.storage_offset())

    def _check_carried(self, every: bool = False, more: Callable[[], bool] = lambda: True) -> bool:
        """Run the carried checks that are due (``every``: also this iteration's) while ``more()`` (a window still
        open) says so; True if one differed."""
        if not (self._carried or self._carried_fifo) or not (every or self._carried_due()):
            return self._rewind
        while self._carried_fifo and more() and not self._rewind:  # fingerprints first: they hold outputs alive
            self._settle_one(self._carried_fifo.popleft(), self._carried_differs)
        if self._rewind or self._carried_fifo:
            return self._rewind
        self._pre_by_storage = {p.untyped_storage().data_ptr(): (p, c) for p, c in self._pre.values()}
        done = 0
        try:
            while done < len(self._carried) and more() and not self._rewind:
                self._check(self._carried[done], CARRY)
                done += 1
        finally:
            self._pre_by_storage = {}
            del self._carried[:done]
        if not self._carried:
            self.carried_bytes = 0
        return self._rewind

    def _carried_differs(self, op_id: str, name: str) -> None:
        self._mismatch(op_id, name, "forward", "carried", "forward and recompute differ (compared after the update)")
        self._rewind = True

    def restore_before_update(self, step: int) -> None:
        """Parameters and optimizer state (but its scalar step counters, which the trainer restores) back to their
        verified copies from the start of iteration ``step``: the held copy, or, when the held check of that
        update already passed on this rank, the buffer its previous copy moved to. What was pending is dropped."""
        keys = list(self._pre)
        if self._pre_start == step:
            src = [self._pre[k][1] for k in keys]
        elif self._spare_start == step:
            # only the tensors that update wrote (an expert no token reached has no gradient and is not in it: its
            # copy before the update is ``_pre``, its ``_spare`` is older)
            keys = [k for k in keys if self._spare_step.get(k) == step]
            src = [self._spare[k] for k in keys]
            for k in keys:  # the copy from the start of ``step`` is the verified state before its update again
                t, c = self._pre[k]
                self._pre[k], self._spare[k] = (t, self._spare[k]), c
                self._spare_step.pop(k, None)
            self._pre_start, self._spare_start = step, None
        else:
            self._failed = (f"dmr: the state at the start of step {step} is no longer kept (two faults at once: a "
                            "wrong update and a carried check that differs); restart from the last checkpoint")
            raise StepAborted(self._failed)
        with torch.no_grad(), _checking():  # (the engine's own work: no op of the step)
            self._copy_verified([self._pre[k][0] for k in keys], src)
        self._drop_pending()

    def _drop_pending(self) -> None:
        """Forget the checks pending on the current state (it is being replaced)."""
        self._held, self._repair, self._carried = [], [], []
        self._carried_fifo.clear()
        self.carried_bytes, self._rewind = 0, False
        self.mismatches = []

    def _apply_repair(self) -> None:
        self.raise_if_stopped()
        fixes, self._repair = self._repair, []
        with torch.no_grad(), _checking():  # (the engine's own work: no op of the step)
            for fix, live in fixes:
                self._copy_verified([t for n in live for t in live[n]], [t for n in live for t in fix[n]])
        self.raise_if_stopped()  # (several ranks: a write-back that would not copy is kept by _stop)

    def _state_event(self, event: str) -> None:
        """The trainer's state hook: settle before a read; before a write (a load, a restore) also drop the copies
        of the state (the next update copies it again). After the engine stopped the run (``_suspect``) the state
        is not verified: a read is refused (a checkpoint of it would be trusted), a write (loading a checkpoint, a
        snapshot) replaces it, and what was pending on the old state is dropped."""
        if self._failed is not None:
            if event != "write":
                raise SuspectedHardwareFault(f"dmr: the model state is not verified since the run stopped ({self._failed})"
                                             "; load a checkpoint or a state to go on")
            self._drop_pending()
            self._failed, self._held_fatal, self._carry_sync_step = None, None, None
        self.settle()
        if event == "write":
            self._pre.clear()
            self._spare.clear()
            self._spare_step.clear()
            self._pre_start = self._spare_start = None

    def settle(self) -> None:
        """Check the held updates now, on this thread, and write back a repair: before anything reads the state
        from outside the training loop (a checkpoint, an evaluation, a comparison, the end of the run)."""
        if self._failed is not None:  # (nothing is verified on a state the engine gave up on: detach still may)
            return
        sync = self._carry_sync_step is not None and self._world > 1
        if not self._held and not self._repair and self._held_fatal is None and not self._carried and \
                not self._carried_fifo and not sync:
            return
        with _checking():
            self._check_carried(every=True)
            self._read_flags()
            rewound = self._rewind
        if sync:  # a re-execution is collective: every rank learns whether some rank's carried check failed
            rewound = self._trainer.strategy.any_rank(self._trainer, rewound)
        self._carry_sync_step = None
        if not rewound:
            with _checking():
                self._check_held()
                self._read_flags()
                self._apply_repair()
        if rewound:  # the last update read wrong gradients: re-executed (through the trainer) before anything reads
            self._trainer.redo_last_step("dmr: a check carried past the last update differs")
            self.settle()  # (the re-executed step carries nothing: its held update is checked here)
        # (repaired before anything of a later step ran: a detection, nothing to re-execute)
        self.mismatches = [m for m in self.mismatches if m.strategy != "optimizer-held"]
