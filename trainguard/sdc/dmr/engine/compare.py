"""Comparisons (part of :class:`~trainguard.sdc.dmr.engine.DMREngine`): two fingerprints or two results compared at
once, or (the stream executor) as flags left on the device and read together at the verdict; mismatches recorded.
Relies on torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainguard.sdc.dmr import ops as dops
from trainguard.sdc.dmr.engine.common import Mismatch, _checking, _Later


class Comparisons:
    """The engine's comparisons (a part of DMREngine: it reads and writes the engine's state)."""

    # ---- comparisons read at the verdict (the stream executor) -----------------------------------------
    # On a device, reading a comparison's result is a host synchronisation: the host would wait for each checker
    # instead of running ahead. With the stream executor, a comparison whose outcome only decides the verdict
    # leaves a flag on the device instead; the verdict reads them all in one transfer and acts on them in order.
    def _compare(self, name: str, expect: Any, got: Any, differs: Callable[[], None]) -> None:
        """``differs()`` when two fingerprints differ: at once, or when the verdict reads the flags."""
        if self._flags is None or self.calibration is not None:
            if not self._agree(name, expect, got):
                differs()
            return
        if isinstance(expect, _Later) or isinstance(got, _Later):
            expect, got = self._resolve(expect), self._resolve(got)
            if expect is None or got is None:
                return  # counted as stale (not checkable), never as a detection
        differ = expect.differs(got, self.rtol.get(name, 0.0))
        if isinstance(differ, torch.Tensor):
            self._flag(differ, differs)
        elif differ:
            differs()

    def _flag(self, differ: torch.Tensor, differs: Callable[[], None], agrees: Callable[[], None] | None = None) -> None:
        with self._lock:
            self._flags.append((differ, differs, agrees))

    def _read_flags(self) -> None:
        """Read the pending comparisons' flags (one device-to-host transfer) and act on each, in order."""
        if not self._flags:
            return
        flags, self._flags = self._flags, []
        values = dops.stack([f for f, _, _ in flags]).tolist()
        self.counts["flags-read"] += len(flags)
        failed: BaseException | None = None
        with _checking():  # (a held update's tie-breaker runs here: an engine execution, not an op of the step)
            for differ, (_, differs, agrees) in zip(values, flags):
                try:  # every flag is acted on (a held update's copies must follow its verdict) before one raises
                    if differ:
                        differs()
                    elif agrees is not None:
                        agrees()
                except Exception as err:
                    failed = failed or err
        if failed is not None:
            raise failed

    def _agree(self, name: str, expect: dops.Fingerprint, got: dops.Fingerprint) -> bool:
        if isinstance(expect, _Later) or isinstance(got, _Later):
            expect, got = self._resolve(expect), self._resolve(got)
            if expect is None or got is None:
                return True  # counted as stale (not checkable), never as a detection
        if self.calibration is not None:  # recording a determinism report: measure, never flag
            self.calibration[name] = max(self.calibration.get(name, 0.0), expect.gap(got))
            return True
        return expect.matches(got, self.rtol.get(name, 0.0))

    def _same(self, func, a, b) -> bool:
        if self.calibration is not None:
            name = dops.info(func).name
            self.calibration[name] = max(self.calibration.get(name, 0.0), dops.relative_gap(a, b))
            return True
        rtol = self.rtol.get(dops.info(func).name, 0.0)
        if rtol <= 0:
            return dops.checksums_equal(a, b) if self.cfg.fingerprints else dops.bitwise_equal(a, b)
        return dops.Fingerprint.of(a, floats=True).matches(dops.Fingerprint.of(b, floats=True), rtol)


    def _mismatch(self, op_id: str, name: str, phase: str, strategy: str, detail: str) -> None:
        with self._lock:
            self.mismatches.append(Mismatch(op_id, name, phase, strategy, detail))
            self.totals["detected"] += 1
