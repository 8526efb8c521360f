"""Campaigns classify trials correctly on cases whose outcome is known."""

from trainguard.faults import Fault, FaultModel, OpSite, TensorSite, run_campaign
from trainguard.faults.trial import TrainingTrial


class Reporter:
    """A stand-in protector: reports every step as 'detected' (no correction)."""

    def __init__(self, trainer):
        self.n = 0
        trainer.callbacks.append(self)

    def on_step_end(self, trainer, result):
        self.n += 1

    def total(self):
        return {"detected": self.n, "corrected": 0}


def test_classes_of_known_cases():
    trial = TrainingTrial(steps=2)
    reference = trial.reference()
    faults = [
        Fault(TensorSite("param", "layers.0.attention.wq.weight"), FaultModel("nan"), step=0),  # poisons everything
        Fault(OpSite("aten.zeros_like*", "optimizer", 0), FaultModel("value", value=0.0), step=0),  # writes 0 over 0
        Fault(OpSite("aten.mm*", "forward", 0), FaultModel("nan"), step=5),  # step never reached
    ]
    s = run_campaign(trial, faults, reference, progress=False)
    assert [r.outcome for r in s.results] == ["silent", "masked", "masked"]
    assert s.results[0].nonfinite and s.unreached == 1 and s.trials == 3
    assert s.silent == 1 and s.masked == 2


def test_detected_when_a_protector_reports():
    trial = TrainingTrial(steps=1)
    reference = trial.reference()
    s = run_campaign(TrainingTrial(steps=1, protector=Reporter), [Fault(TensorSite("param", "norm.weight"), FaultModel("inf"))],
                     reference, progress=False)
    assert s.detected == 1 and s.results[0].outcome == "detected"


def test_every_class_is_checked_against_the_reference():
    import torch

    from trainguard.faults import TrialOutcome, classify

    ref = {"w": torch.zeros(4)}
    close = {"w": torch.full((4,), 1e-6)}
    off = {"w": torch.tensor([0.0, 0.5, 0.0, 0.0])}
    nan = {"w": torch.tensor([0.0, float("nan"), 0.0, 0.0])}

    def cls(state, **kw):
        return classify(TrialOutcome(state, tolerance=1e-4, **kw), ref)[0]

    assert cls(close) == "masked" and cls(off) == "silent" and cls(nan) == "silent"
    assert cls(close, detected=1, corrected=1) == "corrected"
    assert cls(close, detected=1, recomputed=1) == "recomputed"
    assert cls(close, detected=2, corrected=1, retried=1) == "step_retried"
    for kw in ({"corrected": 1}, {"recomputed": 1}, {"retried": 1}):
        assert cls(off, detected=1, **kw) == "wrong_after_correction"
        assert cls(nan, detected=1, **kw) == "wrong_after_correction"
    assert cls(off, detected=1) == "detected" and cls(off, detected=1, retried=3, failed=True) == "detected"
    assert classify(TrialOutcome(close), ref)[0] == "silent"  # no tolerance given: bitwise


def test_a_trial_may_strike_several_faults_at_once():
    import torch

    from trainguard.faults import ProductSite, TrialOutcome

    ref = {"w": torch.zeros(2)}
    pair = [Fault(ProductSite("context", 0), FaultModel("nan"), index=i) for i in (3, 9)]
    s = run_campaign(lambda f, i: TrialOutcome(dict(ref)), [pair], ref, progress=False)
    assert s.masked == 1 and [f["index"] for f in s.results[0].fault["faults"]] == [3, 9]
