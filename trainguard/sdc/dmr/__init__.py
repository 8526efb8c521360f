"""SpareTrain-style dual modular redundancy: every op of a training iteration executed twice and compared
(naive, piggyback on activation-checkpoint recompute, deferred into idle windows, AGC segments), planned
from a profile, with rollback and re-execution of the iteration on a mismatch."""

from trainguard.sdc.dmr.config import DMRConfig
from trainguard.sdc.dmr.dynamic import DynamicPlanner, Entry, best_fit
from trainguard.sdc.dmr.engine import DMREngine, DMRGuard, attach
from trainguard.sdc.dmr.plan import CoverageError, CoverageReport, Plan, coverage_report
from trainguard.sdc.dmr.planner import PlannerConfig, naive_only, no_dmr, plan_static, read_profile
from trainguard.sdc.dmr.profile import OpRecord, Profile, Window

__all__ = [
    "CoverageError",
    "CoverageReport",
    "DMRConfig",
    "DMREngine",
    "DMRGuard",
    "DynamicPlanner",
    "Entry",
    "OpRecord",
    "Plan",
    "PlannerConfig",
    "Profile",
    "Window",
    "attach",
    "best_fit",
    "coverage_report",
    "naive_only",
    "no_dmr",
    "plan_static",
    "read_profile",
]
