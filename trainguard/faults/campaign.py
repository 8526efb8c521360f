"""Fault campaigns: K trials, one fault each, against a fault-free reference run.

Every trial is classified (the classes the fault-tolerance literature uses):

* ``corrected``: a protector reported the fault and fixed it (e.g. ABFT corrected a product in place);
* ``detected``: a protector reported it but could not fix it (the run must roll back / recompute);
* ``masked``: nothing reported and the final state is bitwise identical to the reference;
* ``silent``: nothing reported and the final state differs — silent data corruption
  (``nonfinite`` in the trial record says whether it went as far as NaN/INF).

A fault whose site was never reached is counted in ``unreached``, never silently dropped.
The default trial trains a small model for a few steps with ``trainguard.train.Trainer``.
Relies on torch and rich (progress bar on stderr).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from trainguard.faults.injector import Fault, Injector

OUTCOMES = ("corrected", "detected", "masked", "silent")


@dataclass
class TrialOutcome:
    final_state: dict[str, torch.Tensor]
    detected: int = 0
    corrected: int = 0
    final_loss: float = float("nan")
    records: list[dict[str, Any]] = field(default_factory=list)
    reached: bool = True


@dataclass
class TrialResult:
    trial: int
    outcome: str
    fault: dict[str, Any]
    records: list[dict[str, Any]]
    final_loss: float
    max_abs_diff: float
    nonfinite: bool


@dataclass
class CampaignSummary:
    trials: int = 0
    corrected: int = 0
    detected: int = 0
    masked: int = 0
    silent: int = 0
    unreached: int = 0
    results: list[TrialResult] = field(default_factory=list)

    def to_dict(self, with_results: bool = True) -> dict[str, Any]:
        d = asdict(self)
        if not with_results:
            d.pop("results")
        return d


def compare_states(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[bool, float, bool]:
    """(bitwise equal, max |difference| over finite entries, any non-finite) of two state dicts."""
    equal, worst, nonfinite = True, 0.0, False
    for k, ref in reference.items():
        v = state[k]
        if not torch.equal(v, ref):
            equal = False
            finite = torch.isfinite(v) & torch.isfinite(ref)
            nonfinite |= not bool(torch.isfinite(v).all())
            if finite.any():
                worst = max(worst, float((v[finite].double() - ref[finite].double()).abs().max()))
    return equal, worst, nonfinite


def classify(outcome: TrialOutcome, reference: dict[str, torch.Tensor]) -> tuple[str, float, bool]:
    equal, diff, nonfinite = compare_states(outcome.final_state, reference)
    if outcome.corrected:
        return "corrected", diff, nonfinite
    if outcome.detected:
        return "detected", diff, nonfinite
    return ("masked" if equal else "silent"), diff, nonfinite


def run_campaign(trial_fn: Callable[[Fault, int], TrialOutcome], faults: list[Fault], reference: dict[str, torch.Tensor],
                 progress: bool = True, description: str = "campaign") -> CampaignSummary:
    summary = CampaignSummary()
    from trainguard.utils import TaskBar

    bar = TaskBar(progress, description, len(faults))
    try:
        for i, fault in enumerate(faults):
            out = trial_fn(fault, i)
            summary.trials += 1
            if not out.reached:
                summary.unreached += 1
            outcome, diff, nonfinite = classify(out, reference)
            setattr(summary, outcome, getattr(summary, outcome) + 1)
            summary.results.append(TrialResult(i, outcome, _fault_dict(fault), out.records, out.final_loss, diff, nonfinite))
            bar.advance(f"silent {summary.silent}  masked {summary.masked}")
    finally:
        bar.stop()
    return summary


def _fault_dict(fault: Fault) -> dict[str, Any]:
    d = {"site": type(fault.site).__name__, **asdict(fault.site), **{f"model_{k}": v for k, v in asdict(fault.model).items()},
         "step": fault.step, "index": fault.index}
    return {k: (repr(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


# ---------------------------------------------------------------------------------------------------
# The default trial: a few training steps of a small model.

SMALL_RUN = ["--model.dim", "32", "--model.n_layers", "1", "--model.n_heads", "2", "--model.ffn_hidden", "64",
             "--data.seq_len", "32", "--data.batch_size", "4", "--data.max_bytes", "500000",
             "--train.eval_every", "0", "--output.dir", "", "--output.progress", "false", "--output.metrics", "false"]


class TrainingTrial:
    """Trains ``steps`` steps from the same seed each time; ``protector(trainer)`` (optional) returns an
    object whose ``total()`` gives ``{"detected": n, "corrected": n}`` after the run."""

    def __init__(self, overrides: list[str] | None = None, steps: int = 3, seed: int = 0,
                 protector: Callable[[Any], Any] | None = None):
        from trainguard.config import load_config

        self.cfg = load_config(None, [*SMALL_RUN, *(overrides or []), "--train.steps", str(steps)])
        self.steps, self.seed, self.protector = steps, seed, protector
        self._batches = None

    def _trainer(self):
        from trainguard.train import Trainer

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
