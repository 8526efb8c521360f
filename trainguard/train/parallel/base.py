"""The contract between the Trainer and a parallel strategy, and the plain-``torch.distributed`` helpers
strategies share.

A strategy owns everything that differs between single-process, DDP, pipeline and elastic training:
process groups, how the model is wrapped or split (:meth:`Strategy.setup`), which micro-batches this rank
computes in a step (:meth:`Strategy.plan`), forward/backward and gradient synchronisation
(:meth:`Strategy.forward_backward`), the global gradient norm, the reduction of guard verdicts and of the
logged loss across ranks, the commit vote, evaluation and who writes checkpoints. The Trainer runs the same
named stages for all of them (``trainguard.train.trainer``).

A step's global batch is ``n_slices`` equal slices; slice ``i`` of step ``s`` is
``PackedBatches.batch(s, rank=i, world_size=n_slices)``, a pure function of (seed, step, slice), so any
rank can compute any slice with no data movement (elastic plans rely on it). Relies on torch.distributed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from trainguard.errors import ConfigError
from trainguard.train.guards import Action, Verdict
from trainguard.train.optim import clip_gradients

if TYPE_CHECKING:
    from trainguard.train.trainer import Trainer


@dataclass(frozen=True)
class MicroBatch:
    """One slice of a step's global batch computed on this rank."""

    index: int  # slice id in [0, n_slices)
    n_slices: int  # the global batch is split into this many equal slices
    weight: float  # the slice's loss is multiplied by this before backward (the strategy's reduction does the rest)
    keep: bool = False  # keep this slice's gradient apart (an elastic plan's redundant copy)
    tags: frozenset[str] = frozenset()  # e.g. {"neighbor"}: computed in a degraded mode by a fail-stop policy


@dataclass
class StepPlan:
    step: int
    micro: list[MicroBatch]
    info: dict[str, Any] = field(default_factory=dict)  # strategy / policy notes for the step's log record


def dist_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment ((0, 1, 0) outside torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, 0
    return int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0"))


def init_default_group(backend: str, device: torch.device, expected_world: int) -> tuple[int, int, bool]:
    """Initialise the default process group from torchrun's environment (no-op outside torchrun).

    Returns (rank, world, created); ``created`` says whether we own the group (and destroy it)."""
    rank, world, _ = dist_env()
    if world == 1:
        return 0, 1, False
    if expected_world != world:
        raise ConfigError(f"launched with {world} processes but distributed.dp*pp = {expected_world}; they must match")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("distributed.backend 'nccl' needs CUDA; use gloo on CPU")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, rank=rank, world_size=world)
    return rank, world, True


class Strategy:
    """Single process; the base class of every strategy (override what differs)."""

    name = "single"

    def __init__(self) -> None:
        self.rank, self.world = 0, 1
        self.owns_group = False
        self.window_hooks: list[Callable[[str, Callable[[], Any]], Any]] = []

    def add_window_hook(self, hook: Callable[[str, Callable[[], Any]], Any]) -> Callable[[], None]:
        """``hook(kind, wait)`` is called for every wait on communication the strategy can expose (pipeline
        transfers: ``pp``; expert all-to-all: ``ep``; a pipeline stage's gradient all-reduce over its replicas:
        ``dp``; ``setup``: a pipeline stage's one-time handshake and shape
        inference, which runs ops of its own); it must call ``wait()`` and may work meanwhile."""
        self.window_hooks.append(hook)
        return lambda: self.window_hooks.remove(hook) if hook in self.window_hooks else None

    def run_window(self, kind: str, wait: Callable[[], Any]) -> Any:
        """Wait on communication through every window hook (nested, in registration order)."""
        call = wait
        for hook in reversed(self.window_hooks):
            call = (lambda h, inner: (lambda: h(kind, inner)))(hook, call)
        return call()

    # ---- set-up ---------------------------------------------------------------------------------
    def init(self, trainer: Trainer) -> None:
        """Process groups (before the model is built)."""

    def setup(self, trainer: Trainer) -> None:
        """Split ``trainer.model`` if this rank holds only part of it (before it moves to its device)."""

    def wrap(self, trainer: Trainer) -> None:
        """Wrap the model for the run (DDP, pipeline stage and schedule): on its device, after activation
        checkpointing, before the optimizer is built."""

    def fused_optimizer(self, trainer: Trainer) -> bool | None:
        """``fused`` for AdamW (None: fused where the parameters allow it)."""
        return None

    def count_params(self, trainer: Trainer) -> int:
        """Parameters of the whole model (every stage once)."""
        return sum(p.numel() for p in trainer.model.parameters())

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def forward_module(self, trainer: Trainer) -> torch.nn.Module:
        return trainer.model

    def check_batch(self, trainer: Trainer) -> None:
        parts = self.world * trainer.grad_accum
        if trainer.batches.batch_size % parts:
            raise ConfigError(f"data.batch_size ({trainer.batches.batch_size}) must be divisible by "
                              f"world*grad_accum ({parts})")

    # ---- one step ------------------------------------------------------------------------------
    def plan(self, trainer: Trainer, step: int) -> StepPlan:
        """This rank's slices: ``grad_accum`` consecutive ones, each weighted ``1/grad_accum``."""
        n = trainer.grad_accum
        w = 1.0 / n if n > 1 else 1.0
        return StepPlan(step, [MicroBatch(self.rank * n + m, self.world * n, w) for m in range(n)])

    def forward_backward(self, trainer: Trainer, plan: StepPlan) -> torch.Tensor:
        """Forward and backward of every planned micro-batch; gradients synchronised on return.
        Returns this rank's mean loss (a detached 0-d tensor)."""
        total = None
        last = len(plan.micro) - 1
        for i, mb in enumerate(plan.micro):
            x, y = trainer.micro_batch(plan.step, mb)
            with self.no_sync(trainer, i < last):
                loss = trainer.compute_loss(x, y)
                (loss * mb.weight if mb.weight != 1.0 else loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
        n = len(plan.micro)
        return total / n if n > 1 else total

    def no_sync(self, trainer: Trainer, skip: bool) -> contextlib.AbstractContextManager:
        """Skip gradient synchronisation for this micro-batch (all but the last of a step, under DDP)."""
        return contextlib.nullcontext()

    def grad_norm(self, trainer: Trainer, max_norm: float) -> torch.Tensor:
        """Global gradient norm over every rank's parameters; clipped in place when ``max_norm > 0``."""
        return clip_gradients(trainer.model.parameters(), max_norm)

    def global_loss(self, trainer: Trainer, loss: torch.Tensor) -> torch.Tensor:
        """The loss of the global batch, for logging (no collective in a single process)."""
        return loss

    def reduce_verdicts(self, trainer: Trainer, local: Verdict) -> list[Verdict]:
        """Every rank's non-commit verdict (empty when every rank commits). A collective on every rank."""
        return [] if local.ok else [local]

    def should_commit(self, trainer: Trainer) -> bool:
        """The commit vote before the optimizer update (torchft's should_commit on elastic runs)."""
        return True

    # ---- outside the step -----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, trainer: Trainer, n_batches: int) -> float:
        micro = max(1, trainer.batches.batch_size // (self.world * trainer.grad_accum))
        losses = []
        for x, y in trainer.batches.val_batches(n_batches):
            for xs, ys in zip(x.split(micro), y.split(micro)):
                losses.append(trainer.eval_loss(xs, ys))
        return float(torch.stack(losses).mean()) if losses else float("nan")

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on the main rank (None elsewhere): per-rank state for a checkpoint."""
        return [obj]

    def spans_default_group(self) -> bool:
        return self.world > 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() == self.world

    def broadcast_object(self, obj: Any) -> Any:
        """The main rank's ``obj`` on every rank (run-level decisions: which checkpoint a run resumes). A
        strategy whose ranks decide on their own returns ``obj`` unchanged (None on the other ranks)."""
        if not self.spans_default_group():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def any_rank(self, trainer: Trainer, flag: bool) -> bool:
        """Whether ``flag`` is true on some rank, on every rank (a SIGTERM seen by one rank stops them all
        after the same step). A collective on every rank when the default group spans the run."""
        if not self.spans_default_group():
            return bool(flag)
        t = torch.tensor([int(bool(flag))], dtype=torch.int64, device=trainer.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(int(t))

    def writes_checkpoints(self) -> bool:
        """Whether this rank takes part in a checkpoint save (all ranks of a DCP group do)."""
        return True

    def barrier(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.barrier()

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False


def gather_to_main(obj: Any, rank: int, world: int, group=None) -> list[Any] | None:
    out: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out


def reduce_verdicts_over(group, rank: int, world: int, local: Verdict, device: torch.device) -> list[Verdict]:
    """All-reduce (max) of the action, then, only when some rank does not commit, all-gather the verdicts."""
    code = torch.tensor([int(local.action)], dtype=torch.int64, device=device)
    dist.all_reduce(code, op=dist.ReduceOp.MAX, group=group)
    if int(code) == Action.COMMIT:
        return []
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, None if local.ok else local, group=group)
    return [v for v in gathered if v is not None]
