"""Pipeline-parallel training with ``torch.distributed.pipelining`` (``PipelineStage`` + ``Schedule1F1B``).

Each rank builds the full model from the same seed (identical initialisation everywhere, as a
single-process run would have), then keeps only its contiguous slice of blocks (TorchTitan's
"build then prune" split: parameter names stay those of the full model, so stage parameters can be
compared one to one with a single-process run). Stage 0 owns the embedding, the last stage the final
norm and the output head; ``LlamaModel.forward`` passes hidden states through missing pieces.

Gradient equivalence with one process: the schedule runs ``lm_loss`` per micro-batch (a mean over its
tokens) and, with ``scale_grads=True``, divides the accumulated gradients by the number of micro-batches;
equal-sized micro-batches make that the gradient of the global batch's mean loss. Gradient clipping uses
the global norm (squared stage norms all-reduced), the same coefficient as ``clip_grad_norm_``.

Runs under ``torchrun`` with WORLD_SIZE = pp (gloo on CPU, nccl on CUDA). Data parallel on top of
pipeline stages (dp > 1 with pp > 1) and pipeline checkpoints are refused with a clear error.
Relies on torch.distributed (pipelining, gloo/nccl) and trainguard.train.optim.
"""

from __future__ import annotations

import math
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from trainguard.errors import ConfigError
from trainguard.models import build_model, lm_loss


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


def _global_clip(model: nn.Module, max_norm: float) -> torch.Tensor:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
    dist.all_reduce(local)
    total = local.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return total


def run_pipeline(cfg, steps: int | None = None, return_state: bool = False) -> dict:
    """Train ``cfg`` with ``distributed.pp`` pipeline stages; returns a summary dict on every rank
    (with ``return_state``, also this stage's parameters under ``stage_state``)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from trainguard.data import PackedBatches
    from trainguard.train.optim import build_optimizer, build_scheduler

    pp = cfg.distributed.pp
    if cfg.distributed.dp > 1:
        raise ConfigError("data parallel on top of pipeline stages (dp > 1 with pp > 1) is not supported yet")
    if cfg.checkpoint.dir:
        raise ConfigError("checkpoints are not supported with pipeline parallelism yet (unset checkpoint.dir)")
    if cfg.train.grad_accum != 1:
        raise ConfigError("use distributed.microbatches, not train.grad_accum, with pipeline parallelism")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != pp:
        raise ConfigError(f"pipeline run needs WORLD_SIZE == distributed.pp ({pp}); got {world} (launch with torchrun)")
    n_micro = cfg.distributed.microbatches or 2 * pp
    use_cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    owns_pg = not dist.is_initialized()
    if owns_pg:
        backend = cfg.distributed.backend if cfg.distributed.backend != "auto" else ("nccl" if use_cuda else "gloo")
        if use_cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend)
    rank = dist.get_rank()
    try:
        torch.manual_seed(cfg.train.seed)
        model = split_model(build_model(cfg.model_config(), seed=cfg.train.seed), pp, rank).to(device)
        stage = PipelineStage(model, rank, pp, device)
        first, last = rank == 0, rank == pp - 1
        # loss_fn on every rank: the schedule decides from it whether a backward pass exists at all.
        schedule = Schedule1F1B(stage, n_micro, loss_fn=lm_loss, scale_grads=True)
        optimizer = build_optimizer(model, cfg.train, fused=False)
        scheduler = build_scheduler(optimizer, cfg.train)
        batches = PackedBatches.from_config(cfg.data)
        if batches.batch_size % n_micro:
            raise ConfigError(f"data.batch_size ({batches.batch_size}) must be divisible by microbatches ({n_micro})")
        n_steps = cfg.train.steps if steps is None else steps
        losses: list[float] = []
        t0 = time.perf_counter()
        for step in range(n_steps):
            optimizer.zero_grad(set_to_none=True)
            x, y = batches.batch(step)
            x, y = x.to(device), y.to(device)
            micro_losses: list[torch.Tensor] = []
            if first and last:
                raise ConfigError("pipeline parallelism needs distributed.pp >= 2")
            if first:
                schedule.step(x)
            elif last:
                schedule.step(target=y, losses=micro_losses)
            else:
                schedule.step()
            _global_clip(model, cfg.train.grad_clip)
            optimizer.step()
            scheduler.step()
            loss = torch.stack(micro_losses).float().mean().detach() if last else torch.zeros((), device=device)
            dist.broadcast(loss, src=pp - 1)  # every rank (rank 0 prints) sees the global-batch loss
            losses.append(float(loss))
        wall = time.perf_counter() - t0
        tokens = n_steps * batches.batch_size * batches.seq_len
        return {
            "steps_run": n_steps, "first_loss": losses[0] if losses else math.nan,
            "final_loss": losses[-1] if losses else math.nan, "wall_s": wall,
            "tokens": tokens, "tokens_per_s": tokens / wall if wall > 0 else 0.0, "world_size": pp,
            "pipeline_stages": pp, "microbatches": n_micro, "stage": rank,
            "stage_params": sum(p.numel() for p in model.parameters()), "model": cfg.model.preset,
        } | ({"stage_state": {n: p.detach().cpu().clone() for n, p in model.named_parameters()}} if return_state else {})
    finally:
        if owns_pg:
            dist.destroy_process_group()
