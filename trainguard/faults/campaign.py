"""Fault campaigns: K trials, one fault each, against a fault-free reference run.

Every trial is classified (the classes the fault-tolerance literature uses):

* ``corrected``: a protector reported the fault and fixed it (e.g. ABFT corrected a product in place);
* ``detected``: a protector reported it but could not fix it (the run must roll back / recompute);
* ``masked``: nothing reported and the final state is bitwise identical to the reference;
* ``silent``: nothing reported and the final state differs — silent data corruption
  (``nonfinite`` in the trial record says whether it went as far as NaN/INF).

A fault whose site was never reached is counted in ``unreached``, never silently dropped.
The default trial (a few training steps of a small model) is ``trainguard.train.trial.TrainingTrial``.
Relies on torch and rich (progress bar on stderr).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from trainguard.faults.injector import Fault

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
