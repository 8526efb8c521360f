"""The DMR execution engine: one ``TorchDispatchMode`` sees every op of an iteration and has each verified
by exactly one strategy, as the plan says.

Attach with :func:`attach` (or ``[sdc.dmr] enabled = true``). The engine then

* enters its dispatch mode around every attempt of a step (a Trainer step context, *inside* the fault
  injector's, so a fault corrupts the primary execution before it is compared; the engine's own copies,
  fingerprints and second executions are invisible to the injector);
* knows, for each op, its phase (``forward``, ``recompute`` inside an activation-checkpoint recompute,
  ``backward`` inside an autograd graph task, ``optimizer`` once the step's guards passed: clipping, the
  optimizer and the schedule), its leaf module, transformer block and micro-batch, and for backward ops
  the forward op they differentiate (autograd sequence numbers);
* **profiles** the first attempt of the run (record only, PyTorch's default early-stopping recompute), plans
  the rest with :func:`~trainguard.sdc.dmr.planner.plan_static` (phases 1-3) and asks the trainer to
  re-execute that attempt with the plan (a retry from the step's start: nothing ran unverified);
* verifies each compute op (views, collectives and allocations are never re-executed, see ``ops.py``) by
  the strategy the plan gives it:

  - **naive**: re-executed at once on the same inputs (mutated inputs cloned first), outputs compared;
  - **p-dmr**: ops of activation-checkpointed segments: the forward records a fingerprint per op; the
    recompute in backward (early stop off, so every op including the segment's last is replayed) is the
    checker execution, compared op by op; a different op sequence is a detection, not a crash;
  - **d-inter / d-intra / agc**: deferred: inputs retained (parameters are not copied), the output's
    fingerprint kept, the checker runs in its planned idle window (:meth:`DMREngine.window`: a pipeline
    transfer, an expert all-to-all) on a worker thread while the main thread waits on the communication;
    AGC segments' ops are deferred into their segment's window op by op (see docs/dmr.md);
  - **dynamic** (MoE expert ops, whose number changes with routing): the run-time
    :class:`~trainguard.sdc.dmr.dynamic.DynamicPlanner` queue: best fit at static windows, one by one at
    dynamic windows until they close, forced when memory nears the budget;
  - the **update stage** (clipping, fused AdamW in chunks, schedule): a mismatch is repaired by a third
    execution (the update cannot be rolled back without a copy of the optimizer state); with windows
    (``sparetrain`` on pipeline / expert parallel, ``hold_update``) the fused optimizer runs once and its check
    is held into the next iteration's windows, from a verified copy of the state that the passing checker
    itself keeps up to date (see ``_held_optimizer``); the trainer's state hook settles it before the state is
    read or replaced from outside the step loop;
  - where windows exist, fingerprints that need not be taken at once (P-DMR's forward and recompute, deferred
    ops' primaries) are taken by the window's worker (:class:`_Later`), on the main thread only before an op
    writes into the output or hands it to a collective;

* reports mismatches to its :class:`DMRGuard`: the trainer rolls the iteration back on all ranks and
  re-executes it; the same op failing again on the re-execution is reported as suspected persistent
  hardware (exit 3).

Relies on torch (``TorchDispatchMode``, autograd sequence numbers, module and optimizer hooks, threads) and on
torch 2.13's private ``_should_skip_dynamo`` hook and ``_push_mode`` / ``_pop_mode`` /
``_get_current_dispatch_mode_stack`` (the window worker's modes): ``tests/sdc/dmr/test_torch_private.py`` fails
if they move.

The engine is one class in parts, one module each: ``core.py`` (:class:`DMREngine`: wiring, where an op is, the
strategy, execution, fingerprints taken later, comparisons, profiling, the coverage report; :func:`attach`), ``update.py`` (the update
stage and the held update), ``carry.py`` (checks carried past the update), ``deferred.py`` (deferred checks, gradient
swaps), ``windows.py`` (windows, the worker, the drain), ``modes.py`` (the dispatch modes), ``guard.py``
(:class:`DMRGuard`) and ``common.py`` (the records and helpers they share).
"""

from trainguard.sdc.dmr.engine.common import Deferred, Mismatch, _alias, _checking, _entered, _primary
from trainguard.sdc.dmr.engine.core import DMREngine, attach
from trainguard.sdc.dmr.engine.guard import DMRGuard
from trainguard.sdc.dmr.engine.modes import PassThroughMode, _DMRMode

__all__ = [
           "DMREngine",
           "DMRGuard",
           "Deferred",
           "Mismatch",
           "PassThroughMode",
           "_DMRMode",
           "_alias",
           "_checking",
           "_entered",
           "_primary",
           "attach",
]
