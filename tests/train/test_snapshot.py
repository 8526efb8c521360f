"""In-memory snapshots: roll back a faulted step, re-execute it, end bitwise equal to a clean run."""

import contextlib
import random

import torch
from conftest import tiny_cfg

from trainguard.train import Trainer


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_rollback_and_reexecute_is_bitwise_equal(batches):
    clean = Trainer(tiny_cfg("--train.steps", "6"), batches=batches)
    for _ in range(5):
        clean.train_step()

    t = Trainer(tiny_cfg("--train.steps", "6"), batches=batches)
    t.train_step()
    t.train_step()
    fault_at = t.step_idx

    @contextlib.contextmanager
    def corrupt(step):  # a silent corruption of one weight during the step
        yield
        if step == fault_at:
            with torch.no_grad():
                t.model.layers["1"].feed_forward.w2.weight.view(-1)[7] += 1000.0

    t.step_contexts.append(corrupt)
    snap = t.snapshot()
    random.random(), torch.rand(3)  # RNG drawn between snapshot and restore
    w = t.model.layers["1"].feed_forward.w2.weight
    before = float(w.detach().view(-1)[7])
    t.train_step()
    # the fault struck this step (an AdamW update alone moves a weight by about lr): what restore() undoes below
    assert abs(float(w.detach().view(-1)[7]) - before) > 500.0
    t.restore(snap)
    assert t.step_idx == fault_at
    t.step_contexts.clear()
    for _ in range(3):
        t.train_step()
    assert t.step_idx == clean.step_idx
    assert _equal(t.state_dict_for_compare(), clean.state_dict_for_compare())
    assert t.scheduler.state_dict()["last_epoch"] == clean.scheduler.state_dict()["last_epoch"]
    assert t.optimizer.param_groups[0]["lr"] == clean.optimizer.param_groups[0]["lr"]


def test_snapshot_restores_rng_and_cursor(batches):
    t = Trainer(tiny_cfg(), batches=batches)
    t.train_step()
    snap = t.snapshot()
    a = (torch.rand(4), random.random())
    t.train_step()
    t.restore(snap)
    b = (torch.rand(4), random.random())
    assert torch.equal(a[0], b[0]) and a[1] == b[1] and t.step_idx == 1
    assert snap.nbytes() > 0


def test_restore_before_first_step_clears_optimizer_state(batches):
    t = Trainer(tiny_cfg(), batches=batches)
    snap = t.snapshot()
    before = t.state_dict_for_compare()
    t.train_step()
    t.restore(snap)
    assert not any(t.optimizer.state.values()) or all(not s for s in t.optimizer.state.values())
    assert _equal(t.state_dict_for_compare(), before)
