"""MeCeFO: neighbor-do-both failover for data-parallel training on the elastic (torchft) strategy.

* :mod:`.approx` -- the three approximations as per-module switches in the kernel slots (:class:`MeCeFO`,
  :class:`MeCeFOConfig`, :class:`LowRankLinear`)
* :mod:`.policy` -- the gradient-sync policies: :class:`MeCeFOPolicy` and the baselines (Bamboo, Oobleck,
  checkpoint-restart)
* :mod:`.timeline` -- failures per step from the failure presets (:class:`FailureTimeline`)
* :mod:`.runtime` -- the multi-process launcher (:func:`run_failover`)
* :mod:`.cluster` -- cluster throughput computed from measured step costs and a failure timeline
* :mod:`.bench` -- ``trainguard bench mecefo``
"""

from trainguard.failover.mecefo.approx import MHA_GROUP, NEIGHBOR, LowRankLinear, MeCeFO, MeCeFOConfig
from trainguard.failover.mecefo.policy import (
    METHODS,
    BambooPolicy,
    CheckpointRestartPolicy,
    GlobalRestart,
    MeCeFOPolicy,
    OobleckPolicy,
    make_policy,
)
from trainguard.failover.mecefo.timeline import Failure, FailureTimeline

__all__ = ["METHODS", "MHA_GROUP", "NEIGHBOR", "BambooPolicy", "CheckpointRestartPolicy", "Failure", "FailureTimeline",
           "GlobalRestart", "LowRankLinear", "MeCeFO", "MeCeFOConfig", "MeCeFOPolicy", "OobleckPolicy", "make_policy"]
