"""Training: the Trainer loop, optimizer and schedule, activation checkpointing, DCP checkpoints,
in-memory step snapshots, metrics, and the torchrun launcher used by ``trainguard train``."""

from trainguard.train.activation_checkpoint import (
    add_checkpoint_context,
    apply_activation_checkpointing,
    remove_activation_checkpointing,
    set_checkpoint_early_stop,
)
from trainguard.train.checkpoint import CheckpointManager, load_checkpoint, verify
from trainguard.train.metrics import MetricsLogger, peak_memory_mb
from trainguard.train.optim import WarmupCosine, build_optimizer, build_scheduler, clip_gradients, param_groups
from trainguard.train.snapshot import StepSnapshot
from trainguard.train.trainer import RunSummary, StepResult, Trainer, dist_env, run_pipeline, run_training

__all__ = [
    "CheckpointManager",
    "MetricsLogger",
    "RunSummary",
    "StepResult",
    "StepSnapshot",
    "Trainer",
    "WarmupCosine",
    "add_checkpoint_context",
    "apply_activation_checkpointing",
    "build_optimizer",
    "build_scheduler",
    "clip_gradients",
    "dist_env",
    "load_checkpoint",
    "param_groups",
    "peak_memory_mb",
    "remove_activation_checkpointing",
    "run_pipeline",
    "run_training",
    "set_checkpoint_early_stop",
    "verify",
]
