"""The engine's step guard: mismatches into retries of the iteration, through the trainer (attached by
:func:`~trainguard.sdc.dmr.engine.attach`). Relies on the trainer's guard protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainguard.train.guards import StepGuard, Verdict

if TYPE_CHECKING:
    from trainguard.sdc.dmr.engine.core import DMREngine


class DMRGuard(StepGuard):
    """Turns the engine's mismatches into a retry of the iteration (all ranks, through the trainer), and asks
    for the profiled first attempt to be re-executed with the plan made from it."""

    name = "dmr"
    inspects_update = False
    may_rewind = True  # checks carried past an update (carry_last)
    stops_after_update = True  # several ranks: a stop found in the update is kept until after it (engine._stop)

    def __init__(self, engine: DMREngine):
        self.engine = engine

    def on_step_start(self, ctx) -> None:
        self.engine.carry_ok = ctx.trainer.carry_allowed(ctx.step)

    def before_update(self, ctx) -> Verdict:
        eng = self.engine
        if eng._profiling:
            done = eng.finish_profile(ctx.trainer) is not None
            return Verdict.retry(site="profile", reason="profiled this attempt (unverified); re-executed " +
                                 ("with the plan" if done else "to profile it again (profile_steps)"), planned=True)
        eng._carry_sync_step = None  # (this verdict, reduced over every rank, judges the previous step's carried checks)
        eng.drain()
        eng._read_flags()  # (the stream executor: every comparison of the iteration, in one transfer)
        if eng._rewind:  # a check carried from the previous iteration differs: its update read wrong gradients
            # (the mismatch is this attempt's: a rewind verdict on any rank rewinds every rank, see guards.worst)
            m = next(m for m in eng.mismatches if m.strategy == "carried")
            return Verdict.retry(site=m.site(), reason=f"{m.phase} op {m.name} of step {eng._carried_step} (checked "
                                 f"after its update): {m.detail}", rewind=True)
        # a wrong update of the previous step, written back: this iteration read it, so retry (a stop kept since the
        # last look, several ranks: see engine._stop, is raised here first)
        eng._apply_repair()
        if eng.mismatches:
            m = eng.mismatches[0]
            return Verdict.retry(site=m.site(), reason=f"{m.phase} op {m.name} ({m.strategy}): {m.detail}")
        eng.update_stage = True  # clipping and the optimizer come next: repaired in place, not retried
        return Verdict.commit()

    def after_update(self, ctx) -> Verdict:
        self.engine.raise_if_stopped()  # (the trainer reduces the stop: every rank stops with this one)
        return Verdict.commit()

    def on_stop(self, ctx, verdict) -> None:
        # another rank stopped the run: what this one holds is not verified either (its update may have read that
        # rank's gradient norm), so reading it is refused here too
        if self.engine._failed is None:
            self.engine._failed = f"rank {verdict.rank} stopped the run: {verdict.reason}"

    def on_retry(self, ctx, verdict) -> None:
        # an update of this step that ran before the retry was rolled back with it (the trainer restored the state
        # before it, which is the engine's copy): its check is dropped, and so are the checks it carried
        eng = self.engine
        eng._held = [h for h in eng._held if h.step != ctx.step]
        if eng._carried_step == ctx.step:
            eng._carried, eng.carried_bytes = [], 0
            eng._carried_fifo.clear()

    def on_rewind(self, ctx, step: int) -> None:
        self.engine.restore_before_update(step)

    def on_error(self, ctx, err: Exception) -> Verdict | None:
        if self.engine._failed is not None:  # (the engine stopped the run itself: nothing to retry)
            return None
        self.engine._read_flags()
        if not self.engine.mismatches:
            return None
        m = self.engine.mismatches[0]
        return Verdict.retry(site=m.site(), reason=f"{m.phase} op {m.name} ({m.strategy}) differed, then the step "
                                                   f"failed: {type(err).__name__}")
