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
