"""Data parallel under ``torchrun``: ``DistributedDataParallel`` over ``dp`` processes (gloo on CPU, nccl on
CUDA).

Each rank computes its own ``grad_accum`` slices of the global batch; DDP averages gradients over ranks
in the last micro-batch's backward (the others run under ``no_sync``), so the gradient equals the
single-process gradient of the global batch. Guard verdicts and the logged loss are reduced over the
default group. Relies on torch.distributed and ``torch.nn.parallel.DistributedDataParallel``.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainguard.train.guards import Verdict
from trainguard.train.parallel.base import Strategy, gather_to_main, init_default_group, reduce_verdicts_over

if TYPE_CHECKING:
    from trainguard.train.trainer import Trainer


class DDPStrategy(Strategy):
    name = "ddp"

    def __init__(self) -> None:
        super().__init__()
        self.ddp: DistributedDataParallel | None = None

    def init(self, trainer: Trainer) -> None:
        cfg = trainer.cfg
        self.rank, self.world, self.owns_group = init_default_group(cfg.distributed.backend, trainer.device,
                                                                    cfg.distributed.dp * cfg.distributed.pp)

    def wrap(self, trainer: Trainer) -> None:
        if self.world == 1:
            return
        self.ddp = DistributedDataParallel(
            trainer.model,
            device_ids=[trainer.device.index] if trainer.device.type == "cuda" else None,
            broadcast_buffers=False,
            find_unused_parameters=bool(getattr(trainer.model.cfg, "n_experts", 0)),  # unrouted experts: no grad
        )

    def forward_module(self, trainer: Trainer) -> torch.nn.Module:
        return self.ddp if self.ddp is not None else trainer.model

    def no_sync(self, trainer: Trainer, skip: bool) -> contextlib.AbstractContextManager:
        return self.ddp.no_sync() if (self.ddp is not None and skip) else contextlib.nullcontext()

    def global_loss(self, trainer: Trainer, loss: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return loss
        mean = loss.clone()
        dist.all_reduce(mean)
        return mean / self.world

    def gather_object(self, obj: Any) -> list[Any] | None:
        return gather_to_main(obj, self.rank, self.world) if self.world > 1 else [obj]

    def reduce_verdicts(self, trainer: Trainer, local: Verdict) -> list[Verdict]:
        if self.world == 1:
            return super().reduce_verdicts(trainer, local)
        return reduce_verdicts_over(None, self.rank, self.world, local, trainer.device)
