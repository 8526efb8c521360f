"""The update stage's checks (part of :class:`~trainguard.sdc.dmr.engine.DMREngine`): in-place ops over lists of
tensors verified in cache-sized pieces, and the fused optimizer's check held into the next iteration's windows, from
a verified copy of the state that the passing checker keeps up to date. Relies on torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trainguard.sdc.dmr import ops as dops
from trainguard.sdc.dmr.engine.common import _FUSED_OPTIMIZERS, _primary


@dataclass
class _HeldUpdate:
    """A fused optimizer update run once on the main thread, its check held until the next iteration's windows:
    the call's arguments (the lists it writes point at the live state, ``grads`` at the gradients it read,
    kept alive here) and the names of the lists it writes."""

    op_id: str
    func: Any
    bound: dict[str, Any]
    written: list[str]
    step: int


class UpdateStageChecks:
    """The engine's update stage (a part of DMREngine: it reads and writes the engine's state)."""

    def _verified_optimizer(self, op_id: str, phase: str, func, args, kwargs) -> Any:
        """An in-place op over lists of tensors (the fused AdamW, clipping's ``_foreach_mul_``, the pipeline's
        gradient averaging ``_foreach_div_``) verified in cache-sized pieces, at once: every list argument is cut
        into flat slices of the same elements and each piece
        runs as its own call (these ops are elementwise, so each element's result is bitwise the same).
        Each piece is copied, run, checked and, on a mismatch, repaired while it is still in cache: the
        copies cost no memory bandwidth to speak of and no copy of the whole optimizer state is made. Outside the
        update stage (``phase`` other than ``optimizer``) a mismatch is reported and the iteration retried instead."""
        repair = phase == "optimizer"
        schema = func._schema.arguments
        names = [a.name for a in schema]
        bound = {n: (args[i] if i < len(args) else kwargs.get(n)) for i, n in enumerate(names)}
        lists = [n for n in names if isinstance(bound.get(n), (list, tuple)) and len(bound[n])]
        if self._can_hold(func, bound, lists):
            return self._held_optimizer(op_id, func, bound, lists)
        sliced = [n for n in lists if all(isinstance(t, torch.Tensor) and t.dim() > 0 and t.is_contiguous()
                                          and t.numel() == bound[lists[0]][i].numel() for i, t in enumerate(bound[n]))]
        params = bound[lists[0]]
        if dops.info(func).name in _FUSED_OPTIMIZERS:  # updated here, not held: copies of its state are stale now
            for n in lists:
                for t in bound[n]:
                    self._pre.pop(id(t), None)
        # a multiple of 1024 elements: every piece starts on a vector boundary, so the kernel's vectorised loop
        # and scalar tail handle the same elements as in one call (an FMA and a mul+add round differently)
        chunk = max(1024, int(self.cfg.optimizer_chunk_mb * 2**20 / 4) // 1024 * 1024)
        # the fused kernel writes the gradients only to unscale them (grad_scale): otherwise they are inputs
        read_only = ("grads",) if bound.get("grad_scale") is None and bound.get("found_inf") is None else ()
        pieces: list[tuple[int, int, int]] = []  # (tensor index, first element, end)
        for i, p in enumerate(params):
            n = p.numel() if (sliced and lists[0] in sliced) else 1
            pieces += [(i, lo, min(lo + chunk, n)) for lo in range(0, n, chunk)] if n > 1 else [(i, 0, n)]
        k = 0
        while k < len(pieces):
            group, size = [], 0
            while k < len(pieces) and (not group or size + pieces[k][2] - pieces[k][1] <= chunk):
                group.append(pieces[k])
                size += pieces[k][2] - pieces[k][1]
                k += 1
            part = dict(bound)
            for n in lists:
                if n in sliced:
                    part[n] = [bound[n][i].view(-1)[lo:hi] for i, lo, hi in group]
                else:  # (per-tensor scalars such as AdamW's step counters: one per piece, not cut)
                    part[n] = [bound[n][i] for i, _, _ in group]
            pos = tuple(part[a.name] for a in schema if not a.kwarg_only)
            kw = {a.name: part[a.name] for a in schema if a.kwarg_only and part.get(a.name) is not None}
            self._naive(f"{op_id}/{group[0][0]}.{group[0][1]}", phase, func, pos, kw, repair=repair,
                        read_only=read_only)
            self.counts["optimizer-chunks"] += 1
        return None

    # ---- the update stage's check held into the next iteration --------------------------------------------
    # The fused optimizer runs once, on the main thread; its checker runs in the next iteration's first
    # windows (or its drain), from a verified copy of the state before the update and the gradients it read.
    # When the two agree, the checker's result *is* the verified state before the next update, so no copy of
    # the optimizer state is made on the critical path. When they differ, a third execution from the same
    # copy decides; a wrong primary is written back before the next iteration's verdict, which is then a
    # retry (that iteration's forward read the wrong parameters). Before anything reads the state from
    # outside (a checkpoint, an evaluation, the end of the run) the held check is settled (:meth:`settle`).
    def _can_hold(self, func, bound, lists) -> bool:
        if not (self.deferrable and self.cfg.system == "sparetrain" and self.cfg.hold_update
                and self.cfg.fingerprints and self.cfg.compare == "bitwise" and self.calibration is None):
            return False
        if dops.info(func).name not in _FUSED_OPTIMIZERS or bound.get("grad_scale") is not None \
                or bound.get("found_inf") is not None or "grads" not in lists:
            return False
        state = [t for n in lists if n != "grads" for t in bound[n]]
        nbytes = 2 * dops.bytes_of(state)  # the copy and the checker's buffers
        return not self.budget_bytes or nbytes <= self.budget_bytes // 2

    def _held_optimizer(self, op_id: str, func, bound: dict[str, Any], lists: list[str]) -> None:
        written = [n for n in lists if n != "grads"]
        live = {n: list(bound[n]) for n in written}
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for n in written:
            small = all(t.numel() == 1 for t in live[n])
            for t in live[n]:
                kept = self._pre.get(id(t))
                if kept is None or kept[0] is not t:  # first update of this tensor: copied once
                    self._pre[id(t)] = kept = (t, torch.empty_like(t))
                    self.counts["optimizer-state-copied"] += 1
                    self._pre_start = self.step
                elif not small:
                    continue
                # (scalars the optimizer changes outside this op, its step counters, incremented by their own
                # verified op just before: the copy takes them as this call reads them)
                dst.append(kept[1])
                src.append(t.detach())
        self._copy_verified(dst, src)
        schema = func._schema.arguments
        _primary(func, tuple(bound[a.name] for a in schema if not a.kwarg_only),
                 {a.name: bound[a.name] for a in schema if a.kwarg_only and bound.get(a.name) is not None})
        keep = {n: (list(v) if isinstance(v, (list, tuple)) else v) for n, v in bound.items() if n not in written}
        # tensor hyper-parameters (lr may be a tensor the schedule changes) as this call read them; the checker and
        # the tie-breaker both read the copy, so it is verified like the state's
        hyper = [n for n, v in keep.items() if isinstance(v, torch.Tensor)]
        copies = [torch.empty_like(keep[n]) for n in hyper]
        self._copy_verified(copies, [keep[n] for n in hyper])
        keep.update(zip(hyper, copies))
        keep.update(live)
        self._held.append(_HeldUpdate(op_id, func, keep, written, self.step))
        self.counts["optimizer-held"] += 1
        return None

    def _copy_verified(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        """``dst[i].copy_(src[i])``, compared bitwise with its source afterwards. Copies of the state that the engine
        later writes back (the verified state before an update, which a rollback or a repair restores) are not
        checks but state: a fault in one would be written into the parameters and optimizer state while the
        engine reported it fixed. Copied once more where they differ; twice different, the device is suspect."""
        if not dst:
            return
        for _ in range(2):
            torch._foreach_copy_(dst, src)
            if dops.bitwise_equal(dst, src):
                return
            self.counts["copy-fault"] += 1
            self.totals["copy_faults"] += 1
        self._stop(f"two copies of the model state in step {self.step} differ from what they copied: this device "
                   "does not compute reliably")

    def _run_update(self, h: _HeldUpdate, state: dict[str, list[torch.Tensor]]) -> None:
        """Execute the held update on ``state`` (in place) with the inputs the primary read."""
        part = dict(h.bound)
        part.update(state)
        schema = h.func._schema.arguments
        h.func(*tuple(part[a.name] for a in schema if not a.kwarg_only),
               **{a.name: part[a.name] for a in schema if a.kwarg_only and part.get(a.name) is not None})

    def _check_held(self, before_step: int | None = None) -> None:
        """The checkers of the held updates (of steps before ``before_step``; None: all), and where one disagrees
        with its primary, the tie-breaker."""
        due = [h for h in self._held if before_step is None or h.step < before_step]
        self._held = [h for h in self._held if not (before_step is None or h.step < before_step)]
        t0 = time.perf_counter()
        for h in due:
            self._check_one(h)
        if due:
            self._held_s = time.perf_counter() - t0

    def _held_due(self) -> bool:
        return any(h.step < self.step for h in self._held)

    def _held_fits(self, more: Callable[[], bool]) -> bool:
        """Whether a window may start the previous update's held check now. On the thread executor, only while the
        window is open and its profiled end leaves room for what the last held check took: started late, it
        would outlast the window and the step would wait for it at the window's end (a copy of the optimizer
        state and a second update, the longest single check there is). Left here where a later window of the plan
        has that much free time: one of them checks it, else the drain. On a stream, as every check there, it is
        launched ahead of the wait."""
        if self._side is not None:
            return True
        if not more():
            return False
        # (where no later window has room either, here is better than the drain: the step waits only the overrun)
        return time.perf_counter() + self._held_s <= self._window_end or self._later_room < self._held_s

    def _check_one(self, h: _HeldUpdate) -> None:
        live = {n: h.bound[n] for n in h.written}
        # per live tensor (a call may cover a different subset of the parameters each step: those with gradients)
        pre = {n: [self._pre[id(t)][1] for t in live[n]] for n in h.written}
        chk = {n: [self._spare.get(id(t)) for t in live[n]] for n in h.written}
        for n in h.written:
            for i, (t, c) in enumerate(zip(live[n], chk[n])):
                if c is None:
                    chk[n][i] = self._spare[id(t)] = torch.empty_like(t)
            torch._foreach_copy_(chk[n], pre[n])
        self._run_update(h, chk)
        self.counts["optimizer-held-checked"] += 1
        if self._flags is not None:  # decided when the verdict reads the flag (nothing reads the copies before)
            differ = dops.stack([torch.ne(dops.int_view(c), dops.int_view(t)).any()
                                  for n in h.written for c, t in zip(chk[n], live[n])]).any()
            self._flag(differ, lambda: self._held_differs(h, live, pre, chk), lambda: self._held_agrees(h, live, pre, chk))
        elif all(dops.bitwise_equal(chk[n], live[n]) for n in h.written):
            self._held_agrees(h, live, pre, chk)
        else:
            self._held_differs(h, live, pre, chk)

    def _held_agrees(self, h: _HeldUpdate, live: dict, pre: dict, chk: dict) -> None:
        # the checker's result is the verified state before the next update: no copy of it is made
        for n in h.written:
            for t, c, p in zip(live[n], chk[n], pre[n]):
                self._pre[id(t)], self._spare[id(t)] = (t, c), p
                self._spare_step[id(t)] = h.step
        self._pre_start, self._spare_start = h.step + 1, h.step

    def _held_differs(self, h: _HeldUpdate, live: dict, pre: dict, chk: dict) -> None:
        # The tie-breaker runs on a verified copy of its own: ``pre`` stays the state at the start of step h.step,
        # which a rewind to that step restores (a check of it carried into the next iteration can still fail, on
        # this rank or another: two faults at once). Run in place on ``pre``, it left no copy of that state and the
        # rewind failed.
        tie = {n: [torch.empty_like(t) for t in pre[n]] for n in h.written}
        for k in range(self.cfg.tie_breakers):
            if k:  # (three results so far, all different: two faults, in the checker and a tie-breaker)
                self._tie_breaker_again()
            self._copy_verified([t for n in h.written for t in tie[n]], [t for n in h.written for t in pre[n]])
            self._run_update(h, tie)
            if all(dops.bitwise_equal(tie[n], chk[n]) for n in h.written):
                self._repair.append((tie, live))  # the primary was wrong: written back before the next verdict
                self.totals["repaired_optimizer"] += 1
                self._mismatch(h.op_id, dops.info(h.func).name, "optimizer", "optimizer-held",
                               f"the update of step {h.step} differs from two executions of it")
                break
            if all(dops.bitwise_equal(tie[n], live[n]) for n in h.written):
                self.counts["checker-fault"] += 1  # the checker was wrong: the primary and the tie-breaker agree
                break
        else:
            self._held_fatal = (f"{2 + self.cfg.tie_breakers} executions of {dops.info(h.func).name} in the update "
                                f"stage of step {h.step} all differ ({h.op_id}): this device does not compute reliably")
            self._pre_start, self._spare_start = h.step, None  # (``pre`` is still that; the run stops at the next verdict)
            return
        # the tie-breaker's result, which the live state equals once repaired, is the verified state before the next
        # update, and ``pre`` the one before this update, as when the checker agrees
        self._held_agrees(h, live, pre, tie)
