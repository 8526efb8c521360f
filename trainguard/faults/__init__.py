"""Fault models and injection (SDC and fail-stop), campaigns and outcome classes.

    from trainguard.faults import Fault, FaultModel, Injector, OpSite
    injector = Injector(Fault(OpSite("aten.bmm*", phase="backward", occurrence=2), FaultModel("nan"), step=5))
    injector.attach(trainer)     # or attach_model(model, optimizer) + step_context(step) in a custom loop
    ...; injector.records        # what was corrupted, where, old and new values
"""

from trainguard.faults.bits import FaultModel, flip_bit, layout
from trainguard.faults.campaign import CampaignSummary, TrialOutcome, classify, run_campaign
from trainguard.faults.injector import (
    Fault,
    InjectionRecord,
    Injector,
    ModuleSite,
    OpSite,
    ProductSite,
    TensorSite,
    checker_execution,
    injecting,
)
from trainguard.faults.schedules import PRESETS_MTBF_HOURS, FailureSchedule, kill_due

__all__ = [
    "PRESETS_MTBF_HOURS",
    "CampaignSummary",
    "FailureSchedule",
    "Fault",
    "FaultModel",
    "InjectionRecord",
    "Injector",
    "ModuleSite",
    "OpSite",
    "ProductSite",
    "TensorSite",
    "TrialOutcome",
    "checker_execution",
    "classify",
    "flip_bit",
    "injecting",
    "kill_due",
    "layout",
    "run_campaign",
]
