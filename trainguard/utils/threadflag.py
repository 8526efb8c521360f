"""A per-thread on/off flag with a context manager that sets it for a block (and puts back what it was).

Used where code must know whether the current thread is inside some region without passing it down: the fault
injector (a verifier's own executions, an injection being written), the DMR engine (its checker threads) and the
MoE layer (the loops whose number of ops depends on the routing). Relies on the standard library only."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class ThreadFlag(threading.local):
    """Off in every thread until set. The hot paths read ``flag.active`` directly (an attribute read)."""

    active = False

    @contextlib.contextmanager
    def set(self, active: bool = True) -> Iterator[None]:
        before = self.active
        self.active = active
        try:
            yield
        finally:
            self.active = before
