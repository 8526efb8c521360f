"""ABFT as a step guard: what the checks could not settle makes the trainer re-execute the step.

Relies on :mod:`trainguard.train.guards` (the ``StepGuard`` protocol) and an :class:`ABFTHandle`.

Every flagged product ends as one of: corrected and verified, recomputed and verified, a false alarm
(roundoff confirmed by a bitwise-identical recomputation), or *escalated* (inputs already non-finite, a
recomputation that still fails its checks, a corrupted softmax). An escalation cannot be repaired inside
the attention: :class:`ABFTGuard` turns it into ``Verdict.retry(site="abft:layer{L}/{product}")`` before
the optimizer update, so the trainer restores the step's starting state and runs the step again (a fault
that comes back at the same site on the next attempt is reported by the trainer as suspected persistent
hardware). The guard never looks after the update (``inspects_update = False``), so the trainer keeps no
copy of the optimizer state for it.

    guard = ABFTGuard(handle)          # or: remove = attach_guard(trainer, handle)
    trainer.add_guard(guard)
"""

from __future__ import annotations

from typing import Callable

from trainguard.errors import TrainguardError
from trainguard.sdc.abft.protect import ABFTHandle
from trainguard.train.guards import StepContext, StepGuard, Verdict


class ABFTGuard(StepGuard):
    """Retry verdict for an attempt whose ABFT checks escalated (see the module docstring)."""

    name = "abft"
    inspects_update = False

    def __init__(self, handle: ABFTHandle):
        self.handle = handle

    def on_step_start(self, ctx: StepContext) -> None:
        self.handle.set_step(ctx.step)  # the detection schedule follows the step (retries see the same one)
        self.handle.begin_attempt()

    def before_update(self, ctx: StepContext) -> Verdict:
        esc = self.handle.escalations
        if not esc:
            return Verdict.commit()
        first = esc[0]
        more = f" (+{len(esc) - 1} more)" if len(esc) > 1 else ""
        return Verdict.retry(site=f"abft:layer{first['layer']}/{first['product']}",
                             reason=f"{first['reason']}{more}")

    def on_retry(self, ctx: StepContext, verdict: Verdict) -> None:
        self.handle.retries += 1


def attach_guard(trainer, handle: ABFTHandle) -> Callable[[], None]:
    """Register an :class:`ABFTGuard` for ``handle`` with ``trainer`` (``Trainer.add_guard``); returns the
    function that removes it."""
    add = getattr(trainer, "add_guard", None)
    if add is None:
        raise TrainguardError(f"{type(trainer).__name__} has no add_guard(): ABFT escalations need a trainer "
                              "with step guards")
    return add(ABFTGuard(handle))
