"""A deferred check keeps its inputs until its window: by reference where an op of the attempt wrote their storage
(their version counters then catch an in-place change), as a copy where it did not (a pipeline's receive buffer is
overwritten by the next transfer outside the dispatcher, without a version bump). The engine knows the storages its
ops wrote, so a view or alias of an output (``detach`` and ``_unsafe_view`` included, whose outputs autograd does
not tie to their inputs) needs no entry of its own and may skip the dispatch mode."""

from __future__ import annotations

import time

import numpy as np
import torch

from trainguard.sdc.dmr import ops as dops
from trainguard.sdc.dmr.config import DMRConfig
from trainguard.sdc.dmr.engine import DMREngine


def _engine() -> DMREngine:
    eng = DMREngine(DMRConfig(enabled=True, checker_priority="normal"))
    eng.deferrable = True  # (no plan: each forward op is deferred into the next window)
    eng.needs_plan = lambda: False
    return eng


def test_an_output_and_every_alias_of_it_are_kept_by_reference_and_the_rest_is_copied():
    eng = _engine()
    w = torch.randn(32, 32)
    eng._param_storages.add(dops.storage_key(w))  # (a parameter: neither kept nor copied)
    outside = torch.randn(32, 32)  # made before the attempt, as a receive buffer is
    aten = torch.ops.aten

    def copies(x: torch.Tensor) -> int:
        before = eng.counts["input-cloned"]
        torch.mm(x, w)
        return eng.counts["input-cloned"] - before

    with eng.step_context(1):
        a = torch.mm(w, w)
        for x in (a, a.detach(), a.t(), a.view(-1).view(32, 32), aten._unsafe_view.default(a, [32, 32]),
                  aten.alias.default(a), a.detach().t()):
            assert copies(x) == 0
        for x in (outside, outside.detach(), outside.t(), aten.alias.default(outside)):
            assert copies(x) == 1
        queued = len(eng.queue)
        # the buffer written outside the dispatcher (as a transfer writes it) before the window: the checks read
        # their copies, so none differs
        outside.numpy()[:] += 1.0
        eng.window("pp", lambda: time.sleep(0.05))
    # (what the window did not reach, the end of the step's drain checked)
    assert queued == 12 and eng.counts["checked-in-pp"] + eng.counts["checked-in-drain"] == queued
    assert eng.totals["detected"] == 0 and eng.totals["stale"] == 0


def test_a_new_storage_at_a_freed_outputs_address_is_not_taken_for_it():
    eng = _engine()
    memory = np.zeros(64, dtype=np.float32)
    x = torch.from_numpy(memory)
    eng._mark_produced(x)
    y = torch.from_numpy(memory)  # another storage at the same address (as the allocator reuses a freed block)
    assert y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert eng._produced_here(x) and eng._produced_here(x[3:].detach())
    assert not eng._produced_here(y)
    del x
    assert not eng._produced_here(y)
    eng._mark_produced(y)
    assert eng._produced_here(y)


def test_the_copy_made_before_a_transfer_writes_a_kept_input_is_no_op_of_the_step():
    """A transfer writes its buffer outside the dispatcher: a queued check that keeps that buffer by reference gets
    its own copy first. The copy is the engine's work: a fault injector counts (and corrupts) only the step's ops."""
    import torch.distributed as dist

    from trainguard.faults.injector import Injector

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        eng = _engine()
        w = torch.randn(16, 16)
        eng._param_storages.add(dops.storage_key(w))
        injector = Injector([], seed=0)
        injector.count_ops = True
        with injector.step_context(0), eng.step_context(0):  # (the injector outermost, as the trainer orders them)
            a = torch.mm(w, w)
            torch.mm(a, w)  # deferred: keeps ``a`` by reference
            dist.all_reduce(a)  # writes ``a`` as a transfer does
            eng.window("pp", lambda: time.sleep(0.05))
        assert eng.counts["kept-input-copied"] == 1
        assert injector.op_counts == {(0, "forward"): 2}
        assert eng.totals["detected"] == 0 and eng.totals["stale"] == 0
    finally:
        dist.destroy_process_group()


def test_an_input_written_in_place_before_its_check_runs_is_copied_for_the_check_first():
    """A deferred check keeps an input by reference, and an op writes that input in place before the check runs (in
    a pipeline with replicas: the check of the concatenation for the gradient all-reduce, left to the drain when its
    window closed first, and the reduced gradients copied back into the gradients it read). The check gets a copy
    first, so it still runs: nothing stale (the version bump used to leave it uncheckable), no false detection, and
    a fault in that op is still found."""
    from trainguard.faults import Fault, FaultModel, Injector, OpSite

    for flip in (False, True):
        eng = _engine()
        w = torch.randn(16, 16)
        eng._param_storages.add(dops.storage_key(w))
        faults = [Fault(OpSite("aten.mm*", "forward", 1, compute_only=True), FaultModel("bitflip", field="exponent"),
                        step=0)] if flip else []
        injector = Injector(faults, seed=1)
        with injector.step_context(0), eng.step_context(0):
            a = torch.mm(w, w)
            torch.mm(a, w)  # deferred: keeps ``a`` by reference
            a.copy_(w)  # written in place before the window
            eng.window("pp", lambda: time.sleep(0.05))
        assert len(injector.records) == int(flip)
        assert eng.counts["kept-input-copied"] == 1 and eng.totals["stale"] == 0
        assert eng.totals["detected"] == int(flip)


def test_an_input_changed_behind_the_engines_back_stays_stale_when_its_gradient_is_re_pointed():
    """A kept input whose version moved without the engine seeing the write (not checkable: the check reports it
    stale) stays stale when a gradient swap re-points the check to an alias of that storage with a version counter
    of its own. Re-pointing used to take the alias's version as the one to expect: the check then read the changed
    values and reported a mismatch in a clean step."""
    from torch.utils._python_dispatch import _disable_current_modes

    eng = _engine()
    w = torch.randn(16, 16)
    eng._param_storages.add(dops.storage_key(w))
    with eng.step_context(0):
        a = torch.mm(w, w)
        torch.mm(a, w)  # deferred: keeps ``a`` by reference
        with _disable_current_modes():
            a.add_(1.0)  # the engine does not see it: only the version counter moves
        eng._repoint(a)  # (as before a gradient takes another storage)
        eng.window("pp", lambda: time.sleep(0.05))
    # (stale twice: the kept input, and the fingerprint of the op that made it, taken later from the same tensor)
    assert eng.totals["stale"] == 2 and eng.totals["detected"] == 0


def test_writing_back_a_repaired_update_is_no_op_of_the_step():
    from trainguard.faults.injector import Injector

    eng = _engine()
    live, fix = {"param": [torch.zeros(4), torch.zeros(2)]}, {"param": [torch.ones(4), torch.full((2,), 2.0)]}
    eng._repair.append((fix, live))
    injector = Injector([], seed=0)
    injector.count_ops = True
    with injector.step_context(0):
        eng._apply_repair()
    assert all(torch.equal(a, b) for a, b in zip(live["param"], fix["param"]))
    assert injector.op_counts == {}


def test_putting_the_state_back_for_a_re_execution_is_no_op_of_the_step():
    from trainguard.faults.injector import Injector

    eng = _engine()
    live = [torch.zeros(4), torch.zeros(2, 3)]  # parameters and optimizer state as a wrong update left them
    verified = [torch.ones(4), torch.full((2, 3), 2.0)]  # their copies from the start of the step
    eng._pre = {("p", i): (t, c) for i, (t, c) in enumerate(zip(live, verified))}
    eng._pre_start = 3
    injector = Injector([], seed=0)
    injector.count_ops = True
    with injector.step_context(3):
        eng.restore_before_update(3)
    assert all(torch.equal(a, b) for a, b in zip(live, verified))
    assert injector.op_counts == {}
