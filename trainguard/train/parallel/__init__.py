"""Parallel strategies the Trainer is built with: single process, DDP, pipeline (+ DP on a 2-D mesh) and
elastic data parallel on torchft. ``build_strategy(cfg)`` picks one from ``[distributed]``."""

from __future__ import annotations

from trainguard.errors import ConfigError
from trainguard.train.parallel.base import MicroBatch, StepPlan, Strategy, dist_env, init_default_group
from trainguard.train.parallel.ddp import DDPStrategy


def build_strategy(cfg) -> Strategy:
    """The strategy ``cfg.distributed`` asks for (``strategy = auto``: from dp, pp, ep and the launcher).
    (Pipelining, expert parallelism and torchft are imported only by the runs that use them.)"""
    d = cfg.distributed
    name = d.resolved_strategy()
    if name == "single":
        return Strategy()
    if name == "ddp":
        return DDPStrategy() if dist_env()[1] > 1 else Strategy()
    if name == "pipeline":
        from trainguard.train.parallel.pipeline import PipelineStrategy

        return PipelineStrategy()
    if name == "expert":
        from trainguard.train.parallel.expert import ExpertParallelStrategy

        return ExpertParallelStrategy()
    if name == "elastic":
        from trainguard.train.parallel.elastic import ElasticStrategy

        return ElasticStrategy()
    raise ConfigError(f"unknown distributed.strategy {name!r}")


__all__ = ["DDPStrategy", "MicroBatch", "StepPlan", "Strategy", "build_strategy", "dist_env", "init_default_group"]
