"""Pipeline parallelism as a Trainer strategy: ``torch.distributed.pipelining`` (``PipelineStage`` +
``Schedule1F1B``), with data parallelism on top of the stages (a 2-D ``dp x pp`` device mesh).

Layout: ``world = dp * pp`` processes under torchrun; rank ``r`` is stage ``r % pp`` of replica ``r // pp``.
Every rank builds the full model from the same seed (identical initialisation everywhere, as a
single-process run would have), then keeps only its contiguous, balanced slice of blocks (TorchTitan's
"build then prune" split): parameter names stay those of the full model, so DCP checkpoints, resumes and
comparisons with a single-process run work name by name. Stage 0 owns the embedding, the last stage the
final norm and the output head; ``LlamaModel.forward`` passes hidden states through missing pieces.

One step on replica ``d``: its slice of the global batch is cut into ``train.grad_accum`` rounds; each round
is one ``Schedule1F1B`` step over ``distributed.microbatches`` micro-batches (1F1B with activation
checkpointing and bf16 autocast inside the stage module). Gradients accumulate unscaled over every
micro-batch of every round, are summed over the ``dp`` replicas of the stage and divided once by the
number of micro-batches in the global batch: the gradient of the global batch's mean loss, as in one
process (``lm_loss`` is a mean over each equal-sized micro-batch). MoE load-balancing losses are added per
micro-batch inside each stage (their gradient enters the stage's backward), so MoE models train the same
objective as in one process. Clipping uses the global norm over every stage. Guard verdicts are reduced
over all ranks, so every stage and replica retries together. Evaluation runs the schedule forward-only.

Relies on torch.distributed (pipelining, device mesh, gloo / nccl) and DCP through ``checkpoint.py``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage

from trainguard.errors import ConfigError
from trainguard.models import lm_loss
from trainguard.train.guards import Verdict
from trainguard.train.optim import scale_gradients, squared_norm
from trainguard.train.parallel.base import (
    MicroBatch,
    StepPlan,
    Strategy,
    gather_to_main,
    init_default_group,
    reduce_verdicts_over,
)
from trainguard.train.parallel.schedule import WindowedSchedule1F1B, land

if TYPE_CHECKING:
    from trainguard.train.trainer import Trainer


def stage_layers(n_layers: int, n_stages: int, stage_idx: int) -> list[int]:
    """Contiguous, balanced block indices of one stage (earlier stages take the remainder)."""
    if not 1 <= n_stages <= n_layers:
        raise ConfigError(f"pipeline stages ({n_stages}) must be between 1 and the model's layers ({n_layers})")
    base, extra = divmod(n_layers, n_stages)
    start = stage_idx * base + min(stage_idx, extra)
    return list(range(start, start + base + (1 if stage_idx < extra else 0)))


def split_model(model: nn.Module, n_stages: int, stage_idx: int) -> nn.Module:
    """Prune ``model`` in place to stage ``stage_idx`` of ``n_stages`` and return it."""
    keep = {str(i) for i in stage_layers(len(model.layers), n_stages, stage_idx)}
    for name in [n for n in model.layers if n not in keep]:
        del model.layers[name]
    if stage_idx != 0:
        model.tok_embeddings = None
    if stage_idx != n_stages - 1:
        model.norm = None
        model.output = None
    return model


class _AddAuxGrad(torch.autograd.Function):
    """Identity on ``h``; in backward, also sends gradient 1 into ``aux`` (the stage's MoE balance loss), so
    the loss the stage optimises is ``lm_loss + aux`` without the aux loss crossing stages."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones((), dtype=torch.float32, device=grad.device)


class _StageModule(nn.Module):
    """What the pipeline runs on a stage: the pruned model under the trainer's autocast, MoE aux loss attached."""

    def __init__(self, trainer: Trainer):
        super().__init__()
        self.model = trainer.model
        self._trainer = [trainer]  # a list: not registered as a submodule

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        trainer = self._trainer[0]
        with trainer.autocast():
            out = self.model(h)
        aux = self.model.aux_loss() if hasattr(self.model, "aux_loss") else None
        if aux is not None and torch.is_grad_enabled():
            out = _AddAuxGrad.apply(out, aux)
        return out


class PipelineStrategy(Strategy):
    name = "pipeline"

    def __init__(self) -> None:
        super().__init__()
        self.dp = self.pp = 1
        self.stage = self.replica = 0
        self.pp_group = self.dp_group = None
        self.schedule: WindowedSchedule1F1B | None = None
        self.n_micro = 0
        self.link_delay_s = 0.0
        self._losses: list[torch.Tensor] = []

    # ---- set-up ---------------------------------------------------------------------------------
    def init(self, trainer: Trainer) -> None:
        d = trainer.cfg.distributed
        self.dp, self.pp = d.dp, d.pp
        self.n_micro = d.pipeline_microbatches()
        self.link_delay_s = d.emulate_link_delay_ms / 1000.0
        if self.pp < 2:
            raise ConfigError("pipeline parallelism needs distributed.pp >= 2")
        self.rank, self.world, self.owns_group = init_default_group(d.backend, trainer.device, self.dp * self.pp)
        if self.world != self.dp * self.pp:
            raise ConfigError(f"a pipeline run needs dp*pp = {self.dp * self.pp} processes under torchrun "
                              f"(got {self.world}); `trainguard train` launches them itself")
        self.replica, self.stage = divmod(self.rank, self.pp)
        mesh = init_device_mesh(trainer.device.type, (self.dp, self.pp), mesh_dim_names=("dp", "pp"))
        self.pp_group, self.dp_group = mesh.get_group("pp"), mesh.get_group("dp")

    def setup(self, trainer: Trainer) -> None:
        split_model(trainer.model, self.pp, self.stage)

    def wrap(self, trainer: Trainer) -> None:
        # Static shapes: with them the schedule skips its metadata inference, which otherwise runs a real
        # forward and backward on the first step and after every evaluation (ops a fault injector or a DMR
        # checker would see as if they were training ops).
        cfg = trainer.cfg
        mc = cfg.model_config()
        mb = cfg.data.batch_size // (self.dp * cfg.train.grad_accum * self.n_micro)
        seq = cfg.data.seq_len
        # (hidden states stay fp32 under bf16 autocast: the residual adds promote; logits are bf16)
        hidden = torch.empty(mb, seq, mc.dim, dtype=torch.float32, device="meta", requires_grad=True)
        inputs = torch.empty(mb, seq, dtype=torch.int64, device="meta") if self.is_first else hidden
        out_dtype = torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32
        outputs = (torch.empty(mb, seq, mc.vocab_size, dtype=out_dtype, device="meta", requires_grad=True)
                   if self.is_last else hidden)
        stage = PipelineStage(_StageModule(trainer), self.stage, self.pp, trainer.device, input_args=inputs,
                              output_args=outputs, group=self.pp_group)
        # the loss function runs on the last stage only; every rank passes one so the schedule plans backward.
        # Every wait on a transfer goes through the strategy's window hooks (deferred DMR checks run there).
        self.schedule = WindowedSchedule1F1B(stage, self.n_micro, loss_fn=self._loss, scale_grads=False,
                                             on_wait=self.run_window,
                                             link_delay_s=self.link_delay_s)

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, target)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.pp - 1

    def check_batch(self, trainer: Trainer) -> None:
        parts = self.dp * trainer.grad_accum * self.n_micro
        if trainer.batches.batch_size % parts:
            raise ConfigError(f"data.batch_size ({trainer.batches.batch_size}) must be divisible by "
                              f"dp*grad_accum*microbatches ({parts})")

    def count_params(self, trainer: Trainer) -> int:
        n = torch.tensor([sum(p.numel() for p in trainer.model.parameters())], dtype=torch.int64)
        dist.all_reduce(n, group=self.pp_group)
        return int(n)

    # ---- one step ------------------------------------------------------------------------------
    def plan(self, trainer: Trainer, step: int) -> StepPlan:
        """Replica ``d``'s ``grad_accum`` rounds: slices ``d * accum + r`` of ``dp * accum``."""
        n = trainer.grad_accum
        return StepPlan(step, [MicroBatch(self.replica * n + r, self.dp * n, 1.0) for r in range(n)])

    def forward_backward(self, trainer: Trainer, plan: StepPlan) -> torch.Tensor:
        self._losses = []
        for mb in plan.micro:
            x, y = trainer.micro_batch(plan.step, mb) if (self.is_first or self.is_last) else (None, None)
            self._run_schedule(x, y, self._losses, train=True)
        grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
        total_micro = self.n_micro * len(plan.micro) * self.dp
        if self.dp > 1 and grads:  # sum over the replicas of this stage, in one flat buffer
            flat = torch.cat([g.reshape(-1) for g in grads])
            # (the wait is a window: nothing computes while the replicas exchange gradients, and DMR may check
            # the step's last ops meanwhile, ``[sdc.dmr] dp_windows``)
            issued = time.perf_counter()
            work = dist.all_reduce(flat, group=self.dp_group, async_op=True)
            self.run_window("dp", lambda: land([work], issued, self.link_delay_s))
            off = 0
            for g in grads:
                g.copy_(flat[off:off + g.numel()].view_as(g))
                off += g.numel()
        if grads:  # (one op over the list: cheaper than one per gradient, and DMR verifies it in cache-sized pieces)
            torch._foreach_div_(grads, total_micro)
        if self.is_last and self._losses:
            return torch.stack([v.detach().float() for v in self._losses]).mean()
        return torch.zeros((), device=trainer.device)

    def _run_schedule(self, x, y, losses: list, train: bool) -> None:
        """One schedule step (``train``) or forward-only pass; appends the last stage's micro-batch losses."""
        run = self.schedule.step if train else self.schedule.eval
        if self.is_first:
            run(x)
        elif self.is_last:
            step_losses: list[torch.Tensor] = []  # the schedule clears the list it is given
            run(target=y, losses=step_losses)
            losses.extend(step_losses)
        else:
            run()

    def grad_norm(self, trainer: Trainer, max_norm: float) -> torch.Tensor:
        grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
        local = squared_norm(grads, trainer.device)
        dist.all_reduce(local, group=self.pp_group)  # replicas hold equal gradients: the stages suffice
        total = local.sqrt()
        if max_norm > 0 and grads:
            scale_gradients(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total

    def global_loss(self, trainer: Trainer, loss: torch.Tensor) -> torch.Tensor:
        """The global batch's mean loss on every rank: mean over replicas, broadcast from the last stage."""
        out = loss.detach().clone().float()
        if self.is_last and self.dp > 1:
            dist.all_reduce(out, group=self.dp_group)
            out /= self.dp
        dist.broadcast(out, group=self.pp_group, group_src=self.pp - 1)
        return out

    def reduce_verdicts(self, trainer: Trainer, local: Verdict) -> list[Verdict]:
        return reduce_verdicts_over(None, self.rank, self.world, local, trainer.device)

    # ---- outside the step -----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, trainer: Trainer, n_batches: int) -> float:
        """Forward-only pipeline over the validation set, in pieces the size of one training round (the
        stages' buffers were shaped for it); every replica evaluates the same set."""
        piece = trainer.batches.batch_size // (self.dp * trainer.grad_accum)
        losses: list[torch.Tensor] = []
        for x, y in trainer.batches.val_batches(n_batches):
            for xs, ys in zip(x.split(piece), y.split(piece)):
                xs, ys = xs.to(trainer.device), ys.to(trainer.device)
                self._run_schedule(xs, ys, losses, train=False)
        val = torch.stack([v.float() for v in losses]).mean() if losses else torch.zeros((), device=trainer.device)
        dist.broadcast(val, group=self.pp_group, group_src=self.pp - 1)
        return float(val)

    def gather_object(self, obj: Any) -> list[Any] | None:
        return gather_to_main(obj, self.rank, self.world)
