"""The default fault-campaign trial: a few training steps of a small model with the Trainer.

``TrainingTrial(overrides, steps)`` builds the same small run each time from the same seed; called with a
``Fault`` it attaches an ``Injector``, trains, and returns a ``TrialOutcome`` for
``trainguard.faults.run_campaign``. Relies on the Trainer and the fault injector.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from trainguard.faults.campaign import TrialOutcome
from trainguard.faults.injector import Fault, Injector
from trainguard.train.config import TrainerConfig
from trainguard.train.trainer import Trainer

SMALL_RUN = ["--model.dim", "32", "--model.n_layers", "1", "--model.n_heads", "2", "--model.ffn_hidden", "64",
             "--data.seq_len", "32", "--data.batch_size", "4", "--data.max_bytes", "500000",
             "--train.eval_every", "0", "--output.dir", "", "--output.progress", "false", "--output.metrics", "false"]


class TrainingTrial:
    """Trains ``steps`` steps from the same seed each time; ``protector(trainer)`` (optional) returns an
    object whose ``total()`` gives ``{"detected": n, "corrected": n}`` after the run."""

    def __init__(self, overrides: list[str] | None = None, steps: int = 3, seed: int = 0,
                 protector: Callable[[Any], Any] | None = None):
        self.cfg = TrainerConfig.load(None, [*SMALL_RUN, *(overrides or []), "--train.steps", str(steps)])
        self.steps, self.seed, self.protector = steps, seed, protector
        self._batches = None

    def _trainer(self) -> Trainer:
        trainer = Trainer(self.cfg, batches=self._batches)
        self._batches = trainer.batches  # read the corpus once
        return trainer

    def reference(self) -> dict[str, torch.Tensor]:
        trainer = self._trainer()
        handle = self.protector(trainer) if self.protector else None
        for _ in range(self.steps):
            trainer.train_step()
        if handle is not None and any(handle.total().get(k, 0) for k in ("detected", "corrected")):
            raise RuntimeError("the protector flagged the fault-free reference run (false positive)")
        return trainer.state_dict_for_compare()

    def __call__(self, fault: Fault, trial: int) -> TrialOutcome:
        trainer = self._trainer()
        handle = self.protector(trainer) if self.protector else None
        injector = Injector(fault, seed=self.seed * 100_003 + trial).attach(trainer)
        loss = float("nan")
        for _ in range(self.steps):
            loss = trainer.train_step().loss
        injector.detach()
        counts = handle.total() if handle is not None else {}
        return TrialOutcome(trainer.state_dict_for_compare(), int(counts.get("detected", 0)),
                            int(counts.get("corrected", 0)), loss, [r.to_dict() for r in injector.records],
                            reached=not injector.unfired())
