"""The engine drops its per-attempt tables when the attempt ends (``DMREngine._release_attempt``), so that the young
generation the trainer collects after every step (``[train] gc = "step"``) holds little more than what checks carried
into the next iteration keep. Object counts are deterministic: the test compares the engine with and without the
release on the same trainer and plan."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from tests.sdc.dmr._windowed import small_batches, trainer, windowed
from trainguard.sdc.dmr.engine.core import DMREngine


def _young_after_step(t) -> int:
    """Container objects created in one step and still alive after it (the trainer's own collection off)."""
    t.cfg.train.gc = "python"
    gc.collect()
    gc.disable()
    try:
        t.train_step()
        return len(gc.get_objects(0))
    finally:
        gc.enable()
        t.cfg.train.gc = "step"


@pytest.fixture(scope="module")
def engine_and_trainer():
    torch.manual_seed(0)
    t = trainer(small_batches())
    eng = windowed(t, "thread", transfer=lambda: (lambda: time.sleep(0.3)))
    for _ in range(4):  # (the profiled first step, the plan, and the held update's first copies)
        t.train_step()
    return eng, t


def test_after_a_step_the_engine_keeps_only_what_the_carried_checks_need(engine_and_trainer, monkeypatch):
    eng, t = engine_and_trainer
    released = _young_after_step(t)
    assert eng.counts["carried"] > 0  # (this trainer carries its last micro-batch's checks: they must survive)
    assert not eng._produced and not eng._seq_owner and not eng._const and not eng._grads
    carried = {id(d.held) for d in eng._carried}
    registered = {id(held) for v in eng._kept_by_storage.values() for held, _ in v}
    assert registered and registered <= carried  # (the carried checks' inputs, and nothing else, stay registered)
    assert all(not tape.replayed for tape in eng._tapes.values())

    monkeypatch.setattr(DMREngine, "_release_attempt", lambda self: None)
    kept = _young_after_step(t)
    # 6,546 against 14,316 objects when measured (torch 2.13, Python 3.11)
    assert released < 0.6 * kept, (released, kept)


def test_without_dmr_a_step_leaves_almost_nothing_for_the_collector(engine_and_trainer):
    eng, t = engine_and_trainer
    eng.set_system("none")
    try:
        t.train_step()
        assert _young_after_step(t) < 1000
    finally:
        eng.set_system("sparetrain")
        t.train_step()
