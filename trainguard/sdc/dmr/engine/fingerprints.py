"""Fingerprints taken later (part of :class:`~trainguard.sdc.dmr.engine.DMREngine`): an output's checksums are left to
the next window's worker (or the drain) while it fits half the memory budget, and taken at once before an op would
write into it; queued checks keeping such a tensor get a copy first. Relies on torch (version counters).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_map

from trainguard.sdc.dmr import ops as dops
from trainguard.sdc.dmr.engine.common import _Later, _record_on, _storage_key


class LaterFingerprints:
    """The engine's fingerprints taken later (a part of DMREngine: it reads and writes the engine's state)."""

    def _fp(self, value) -> dops.Fingerprint:
        return dops.Fingerprint.of(value, floats=self.cfg.compare == "tolerance")

    # ---- fingerprints taken later, in the windows -------------------------------------------------------
    def _lazy_ok(self) -> bool:
        """Fingerprints go to the windows' worker only where windows exist and the plan is being followed."""
        return self.deferrable and not self._profiling and self.calibration is None

    def _fp_later(self, value) -> dops.Fingerprint | _Later:
        """``value``'s fingerprint, or a :class:`_Later` one while the outputs it holds fit half the budget (the
        other half is the deferred checks'): the checksums then run on the worker thread in the next window."""
        if not self._lazy_ok():
            return self._fp(value)
        ts = [value] if type(value) is torch.Tensor else dops.tensors(value)
        lz = _Later(value, ts)
        if self.budget_bytes and self.later_bytes + lz.nbytes > self.budget_bytes // 2:
            return self._fp(value)
        with self._lock:
            self.counts["fingerprints-later"] += 1
            self.later_bytes += lz.nbytes
            self._later_fifo.append(lz)
            for t in ts:
                self._later_by_storage.setdefault(_storage_key(t), []).append(lz)
        return lz

    def _resolve(self, x: dops.Fingerprint | _Later) -> dops.Fingerprint | None:
        """The fingerprint (None: a tensor changed in place without passing the engine, so not checkable)."""
        if not isinstance(x, _Later):
            return x
        if x.fp is None and x.value is not None:
            ts = dops.tensors(x.value)
            if self._on_side is not None:
                _record_on(self._on_side, ts)
            if any(t._version != v for t, v in zip(ts, x.versions)):
                self.counts["stale"] += 1
                self.totals["stale"] += 1
            else:
                x.fp = self._fp(x.value)
            x.value = None  # the outputs are released
            with self._lock:
                self.later_bytes -= x.nbytes
        return x.fp

    def _settle_written(self, func, args, kwargs, every: bool = False) -> None:
        """Before an op writes into tensors whose fingerprints are still to be taken: take them now; and queued
        checks that keep one of those tensors as an input get a copy of it. ``every``: all its tensor arguments
        (communication: a receive writes its buffer when the transfer completes, outside the dispatcher and without
        a version bump). An in-place op bumps the version, which would leave such a check stale (not checkable);
        it is copied instead: a check left to a later window or the drain, after an op that writes its input (the
        gradient copied back from the replicas' all-reduce into the gradients it concatenated), still runs."""
        for t in (dops.call_tensors(args, kwargs) if every else dops.written_args(func, args, kwargs)):
            key = _storage_key(t)
            waiting = self._later_by_storage.pop(key, None)
            for lz in waiting or ():
                self._resolve(lz)
            self._copy_kept(key)

    def _copy_kept(self, key: int) -> None:
        """Queued checks that keep the storage ``key`` by reference get their own copy of what they keep of it."""
        for held, ref in self._kept_by_storage.pop(key, ()):
            kept = ref()
            if kept is None or held["args"] is None:  # (already checked)
                continue
            copy = kept.clone()
            held["args"] = tree_map(lambda v, kept=kept, copy=copy: copy if v is kept else v, held["args"])
            for i, v in enumerate(held["ins"]):
                if v is kept:
                    held["ins"][i], held["versions"][i] = copy, copy._version
            self.counts["kept-input-copied"] += 1

    def _settle(self, more: Callable[[], bool] = lambda: True) -> None:
        """Take the fingerprints still to be taken and run the P-DMR comparisons waiting for them, in order,
        while ``more()`` (a window still open) says so."""
        while self._later_fifo and more():
            self._settle_one(self._later_fifo.popleft(), self._pdmr_differs)
        if not self._later_fifo and not self._carried_fifo:
            self._later_by_storage.clear()

    def _pdmr_differs(self, op_id: str, name: str) -> None:
        self._mismatch(op_id, name, "forward", "p-dmr", "forward and recompute differ")

    def _settle_one(self, item: _Later | tuple, differs: Callable[[str, str], None]) -> None:
        """Take one queued fingerprint, or run one P-DMR comparison: ``differs(op id, name)`` when the two differ."""
        if isinstance(item, _Later):
            self._resolve(item)
            return
        op_id, name, expect, got = item
        e, g = self._resolve(expect), self._resolve(got)
        if e is not None and g is not None:
            self._compare(name, e, g, lambda: differs(op_id, name))
