"""Optimizer, learning-rate schedule and gradient clipping (TorchTitan / GaLore recipe).

AdamW with no weight decay on 1-D parameters (norm weights, biases), linear warmup then cosine decay to
``lr * min_lr_ratio``, and global-norm gradient clipping. Relies on ``torch.optim`` only.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices (and embeddings) decay, 1-D parameters (norms, biases) do not."""
    decay, no_decay = [], []
    seen: set[int] = set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _fused_ok(model: nn.Module) -> bool:
    """Fused AdamW runs on CPU and CUDA for floating-point params (one kernel for all params)."""
    params = list(model.parameters())
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


def build_optimizer(model: nn.Module, train_cfg, fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW from a ``TrainSection`` (lr, betas, weight_decay)."""
    fused = _fused_ok(model) if fused is None else fused
    return torch.optim.AdamW(
        param_groups(model, train_cfg.weight_decay),
        lr=train_cfg.lr,
        betas=(train_cfg.beta1, train_cfg.beta2),
        eps=1e-8,
        fused=fused,
    )


class WarmupCosine:
    """LR multiplier: linear warmup over ``warmup`` steps, cosine from 1 to ``min_ratio`` until ``total``.

    A callable object (not a lambda) so it pickles and ``LambdaLR.state_dict`` can carry it.
    """

    def __init__(self, total_steps: int, warmup_steps: int, min_ratio: float):
        self.total, self.warmup, self.min_ratio = int(total_steps), int(warmup_steps), float(min_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, train_cfg) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = int(round(train_cfg.warmup_ratio * train_cfg.steps))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(train_cfg.steps, warmup, train_cfg.min_lr_ratio))


def clip_gradients(params, max_norm: float) -> torch.Tensor:
    """Global L2 norm of the gradients (a 0-d tensor, no host sync); clipped in place when max_norm > 0."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.zeros(())
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    return torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)


def squared_norm(grads: list[torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
    """Sum of the squares of every element of ``grads`` (a 0-d float32 tensor, no host sync), for a global
    norm reduced over ranks. One ``_foreach_norm`` over the list (as ``torch.nn.utils.get_total_norm`` does)
    instead of a squared copy of each gradient: it reads each gradient once and allocates nothing of its size."""
    if not grads:
        return torch.zeros((), device=device)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    norms: list[torch.Tensor] = []
    for dtype, group in by_dtype.items():
        # (half precision accumulates in float32; float64 may not be narrowed by the op, so it is cast after)
        wide = torch.finfo(dtype).bits > 32
        norms += [n.float() for n in torch._foreach_norm(group, 2, dtype=None if wide else torch.float32)]
    return torch.stack(norms).square().sum()


def scale_gradients(grads: list[torch.Tensor], coef: torch.Tensor | float) -> None:
    """``g *= coef`` for every gradient, in one list op (clipping: as ``torch.nn.utils.clip_grads_with_norm_``)."""
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device) if isinstance(coef, torch.Tensor) else coef)
