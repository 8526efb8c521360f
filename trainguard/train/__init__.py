"""Training: the Trainer (named step stages, step guards, parallel strategies), optimizer and schedule,
activation checkpointing with composable contexts, DCP checkpoints, step snapshots, metrics, and the
torchrun launcher used by ``trainguard train``."""

from trainguard.train.activation_checkpoint import (
    add_checkpoint_context,
    apply_activation_checkpointing,
    remove_activation_checkpointing,
    set_checkpoint_early_stop,
)
from trainguard.train.checkpoint import CheckpointManager, load_checkpoint, verify
from trainguard.train.config import TrainerConfig
from trainguard.train.guards import Action, StepContext, StepGuard, Verdict
from trainguard.train.metrics import MetricsLogger, peak_memory_mb
from trainguard.train.optim import WarmupCosine, build_optimizer, build_scheduler, clip_gradients, param_groups
from trainguard.train.parallel import MicroBatch, StepPlan, Strategy, build_strategy, dist_env
from trainguard.train.snapshot import StepSnapshot
from trainguard.train.trainer import RunSummary, StepResult, Trainer, run_training

__all__ = [
    "Action", "CheckpointManager", "MetricsLogger", "MicroBatch", "RunSummary", "StepContext", "StepGuard",
    "StepPlan", "StepResult", "StepSnapshot", "Strategy", "Trainer", "TrainerConfig", "Verdict", "WarmupCosine",
    "add_checkpoint_context", "apply_activation_checkpointing", "build_optimizer", "build_scheduler",
    "build_strategy", "clip_gradients", "dist_env", "load_checkpoint", "param_groups", "peak_memory_mb",
    "remove_activation_checkpointing", "run_training", "set_checkpoint_early_stop", "verify",
]
