"""trainguard.train.garbage and ``[train] gc``: no automatic collection in the middle of a step, the young
generations collected after it, and the process's setting as it was outside a step."""

import gc
import weakref

import pytest

from tests.train.conftest import tiny_cfg
from trainguard.errors import ConfigError
from trainguard.train import Trainer
from trainguard.train.garbage import collect_after


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.fixture
def gc_enabled():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_collection_is_off_inside_and_a_cycle_made_inside_is_freed_on_the_way_out(gc_enabled):
    with collect_after():
        assert not gc.isenabled()
        ref = weakref.ref(_Node())
        for _ in range(3000):  # enough allocations to cross the young generation's threshold
            [_ for _ in ()]
        assert ref() is not None
    assert gc.isenabled()
    assert ref() is None


def test_nested_use_leaves_collection_to_the_outermost(gc_enabled):
    with collect_after():
        with collect_after():
            ref = weakref.ref(_Node())
        assert not gc.isenabled() and ref() is not None  # the inner exit neither collects nor re-enables
    assert gc.isenabled() and ref() is None


def test_disabled_policy_and_a_process_with_gc_off_are_left_alone(gc_enabled):
    with collect_after(enabled=False):
        assert gc.isenabled()
    gc.disable()
    with collect_after():
        ref = weakref.ref(_Node())
    assert not gc.isenabled() and ref() is not None  # the caller turned it off: not turned back on
    gc.enable()


@pytest.mark.parametrize("policy, inside", [("step", False), ("python", True)])
def test_trainer_steps_run_under_the_configured_policy(gc_enabled, batches, policy, inside):
    seen = []

    class Probe:
        def on_step_start(self, trainer, step):
            seen.append(gc.isenabled())

    trainer = Trainer(tiny_cfg("--train.steps", "2", "--train.gc", policy), batches=batches)
    trainer.callbacks.append(Probe())
    trainer.train_step()
    assert seen == [inside] and gc.isenabled()


def test_unknown_policy_is_a_config_error():
    with pytest.raises(ConfigError, match="gc"):
        tiny_cfg("--train.gc", "never")
