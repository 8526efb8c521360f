"""Python's cyclic garbage collector kept out of the middle of a training step (``[train] gc``).

A step allocates many short-lived Python objects: the autograd graph's wrappers, the pipeline schedule's
actions and, under a verifier such as DMR, several records per dispatched op. Python's automatic collector
then runs in the middle of a step, at whatever op crosses its threshold; a full collection scans every object
of the process (the model, torch's own modules) and took ~150 ms on ``llama-60m`` with DMR on, on the critical
path of the pipeline. With ``gc = "step"`` the automatic collector is off while a step runs, and after it the
young generations are collected (a few ms: only what the step left alive is scanned); older garbage is left to
Python's own collector between steps. The same policy as TorchTitan's ``GarbageCollection`` (automatic GC off,
explicit young collections), scoped to the step so that the process's setting is back as it was after each one.

Relies on the standard library's ``gc`` only.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collect_after(enabled: bool = True) -> Iterator[None]:
    """Automatic collection off inside, the young generations (0 and 1) collected on the way out. Nested uses
    (a step re-executed from inside one) are no-ops: only the outermost collects. ``enabled=False``: nothing."""
    if not enabled or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.collect(1)
        gc.enable()
