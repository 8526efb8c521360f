"""Fixtures of the CLI tests."""

import pytest


@pytest.fixture
def no_training(monkeypatch):
    from trainguard.train.trainer import Trainer

    def run(self, *a, **k):
        raise AssertionError("bad input was accepted and training started")

    monkeypatch.setattr(Trainer, "run", run)
