"""Fault campaigns: K trials, one fault (or one set of faults) each, against a fault-free reference run.

Every trial's final state is compared with the reference, whatever happened in it, and classified (the
classes the fault-tolerance literature uses, and those of a protector that corrects, recomputes and
retries):

* ``masked``: nothing reported, and the final state equals the reference;
* ``corrected``: a protector corrected the fault in place and the final state equals the reference;
* ``recomputed``: a protector recomputed what it could not correct, and the final state equals the reference;
* ``step_retried``: a protector had the step re-executed from its start, and the final state equals the reference;
* ``detected``: a protector reported the fault and did not (or could not) repair it (a reported failure:
  the run must stop or roll back);
* ``silent``: nothing reported and the final state differs: silent data corruption (``nonfinite`` in the
  trial record says whether it went as far as NaN/INF);
* ``wrong_after_correction``: a protector reported the fault as repaired (corrected, recomputed or retried),
  yet the final state differs: silently wrong despite the protection.

"Equals" is bitwise unless the trial gives a tolerance (``TrialOutcome.tolerance``, a bound on the
largest absolute difference; a correction repairs a value up to roundoff, not bit for bit). A fault whose
site was never reached is counted in ``unreached``, never silently dropped. The default trial (a few
training steps of a small model) is ``trainguard.train.trial.TrainingTrial``; ABFT's attention campaigns
(``trainguard.sdc.abft.campaign``) run through here too. Relies on torch and rich (progress bar on stderr).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any, Callable, Sequence

import torch

from trainguard.faults.injector import Fault

OUTCOMES = ("masked", "corrected", "recomputed", "step_retried", "detected", "silent", "wrong_after_correction")
#: classes whose final state was checked and found right
GOOD = ("masked", "corrected", "recomputed", "step_retried")


@dataclass
class TrialOutcome:
    final_state: dict[str, torch.Tensor]
    detected: int = 0      # faults (or flags) the protector reported
    corrected: int = 0     # ... and corrected in place
    final_loss: float = float("nan")
    records: list[dict[str, Any]] = field(default_factory=list)
    reached: bool = True
    recomputed: int = 0    # ... recomputed
    retried: int = 0       # steps re-executed because of them
    failed: bool = False   # the protector gave up (reported failure: retries exhausted, correction off, ...)
    tolerance: float | None = None  # largest absolute difference that still "equals" the reference (None: bitwise)
    info: dict[str, Any] = field(default_factory=dict)  # anything the trial wants in its record


@dataclass
class TrialResult:
    trial: int
    outcome: str
    fault: dict[str, Any]
    records: list[dict[str, Any]]
    final_loss: float
    max_abs_diff: float
    nonfinite: bool
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class CampaignSummary:
    trials: int = 0
    corrected: int = 0
    detected: int = 0
    masked: int = 0
    silent: int = 0
    unreached: int = 0
    recomputed: int = 0
    step_retried: int = 0
    wrong_after_correction: int = 0
    results: list[TrialResult] = field(default_factory=list)

    def to_dict(self, with_results: bool = True) -> dict[str, Any]:
        d = asdict(self)
        if not with_results:
            d.pop("results")
        return d

    @property
    def wrong(self) -> int:
        """Trials whose final state is wrong without a reported failure: ``silent + wrong_after_correction``."""
        return self.silent + self.wrong_after_correction


def compare_states(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[bool, float, bool]:
    """(bitwise equal, max |difference| over finite entries, any non-finite where the reference is finite)
    of two state dicts."""
    equal, worst, nonfinite = True, 0.0, False
    for k, ref in reference.items():
        v = state[k]
        if not torch.equal(v, ref):
            equal = False
            finite = torch.isfinite(v) & torch.isfinite(ref)
            nonfinite |= bool((~torch.isfinite(v) & torch.isfinite(ref)).any())
            if finite.any():
                worst = max(worst, float((v[finite].double() - ref[finite].double()).abs().max()))
    return equal, worst, nonfinite


def classify(outcome: TrialOutcome, reference: dict[str, torch.Tensor]) -> tuple[str, float, bool]:
    """(class, max |difference|, non-finite) of one trial; see the module docstring. The final state is
    compared with the reference for every class."""
    equal, diff, nonfinite = compare_states(outcome.final_state, reference)
    right = equal if outcome.tolerance is None else (not nonfinite and diff <= outcome.tolerance)
    if outcome.failed:
        return "detected", diff, nonfinite
    if outcome.retried or outcome.recomputed or outcome.corrected:
        if not right:
            return "wrong_after_correction", diff, nonfinite
        cls = "step_retried" if outcome.retried else "recomputed" if outcome.recomputed else "corrected"
        return cls, diff, nonfinite
    if outcome.detected:
        return "detected", diff, nonfinite
    return ("masked" if right else "silent"), diff, nonfinite


def run_campaign(trial_fn: Callable[[Any, int], TrialOutcome], faults: Sequence[Fault | Sequence[Fault]],
                 reference: dict[str, torch.Tensor], progress: bool = True,
                 description: str = "campaign") -> CampaignSummary:
    """Run ``trial_fn(faults[i], i)`` for every entry of ``faults`` (a ``Fault``, or a list of faults that
    strike one trial together) and classify each trial against ``reference``."""
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
            summary.results.append(TrialResult(i, outcome, fault_dict(fault), out.records, out.final_loss, diff,
                                               nonfinite, out.info))
            bar.advance(f"silent {summary.silent}  wrong {summary.wrong_after_correction}  masked {summary.masked}")
    finally:
        bar.stop()
    return summary


def fault_dict(fault: Fault | Sequence[Fault]) -> dict[str, Any]:
    """A JSON-safe description of a fault (or of the faults of one trial: ``{"faults": [...]}``)."""
    if not isinstance(fault, Fault) and isinstance(fault, Sequence):
        return {"faults": [fault_dict(f) for f in fault]}
    site = asdict(fault.site) if is_dataclass(fault.site) else {"site": repr(fault.site)}
    d = {"site": type(fault.site).__name__, **site, **{f"model_{k}": v for k, v in asdict(fault.model).items()},
         "step": fault.step, "index": fault.index}
    return {k: (repr(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}
