"""Activation checkpointing policies: ``none``, ``full`` (every TransformerBlock) and ``selective``
(only the module kinds named in ``train.selective_ops``: ``attention``, ``ffn``, ``norm``).

Relies on ``torch.utils.checkpoint.checkpoint`` (non-reentrant). Wrapping replaces the module's
``forward`` on the instance (a bound method, so ``copy.deepcopy`` rebinds it to the copy), which keeps
parameter names unchanged: state dicts and checkpoints are the same with or without a policy.

``context_fn`` is passed to ``checkpoint`` as is: it returns two context managers, one entered around the
original forward and one around the recompute (Piggyback-DMR passes two ``TorchDispatchMode``s there).
``early_stop=False`` makes the recompute replay every op of the segment, including its last one.
"""

from __future__ import annotations

import types
from typing import Callable, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from trainguard.errors import ConfigError

POLICIES = ("none", "full", "selective")
# Module kinds selective checkpointing understands, and how to find them in a TransformerBlock.
OP_KINDS = {
    "attention": ("attention",),
    "ffn": ("feed_forward",),
    "feed_forward": ("feed_forward",),
    "moe": ("feed_forward",),
    "norm": ("attention_norm", "ffn_norm"),
}


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    original = type(self).forward.__get__(self)
    if not torch.is_grad_enabled():  # eval / no_grad: nothing to save, run as is
        return original(*args, **kwargs)
    return checkpoint(
        original,
        *args,
        use_reentrant=False,
        context_fn=self._tg_ac_context_fn or noop_context_fn,
        early_stop=self._tg_ac_early_stop,
        **kwargs,
    )


def wrap_module(module: nn.Module, context_fn: Callable | None = None, early_stop: bool = True) -> nn.Module:
    """Make ``module``'s forward run under non-reentrant activation checkpointing (in place)."""
    module._tg_ac_context_fn = context_fn
    module._tg_ac_early_stop = early_stop
    module.forward = types.MethodType(_checkpointed_forward, module)
    return module


def unwrap_module(module: nn.Module) -> nn.Module:
    if "forward" in module.__dict__ and hasattr(module, "_tg_ac_early_stop"):
        del module.forward
        del module._tg_ac_context_fn, module._tg_ac_early_stop
    return module


def is_wrapped(module: nn.Module) -> bool:
    return "forward" in module.__dict__ and hasattr(module, "_tg_ac_early_stop")


def _blocks(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ConfigError("activation checkpointing needs a model with a `layers` ModuleDict of blocks")
    return list(layers.values())


def apply_activation_checkpointing(
    model: nn.Module,
    policy: str = "full",
    ops: Iterable[str] = ("attention",),
    context_fn: Callable | None = None,
    early_stop: bool = True,
) -> list[nn.Module]:
    """Apply a policy in place; returns the wrapped modules (empty for ``none``).

    Re-applying first removes any previous wrapping, so policies can be switched on a live model.
    """
    if policy not in POLICIES:
        raise ConfigError(f"train.activation_checkpoint must be one of {', '.join(POLICIES)}; got {policy!r}")
    remove_activation_checkpointing(model)
    if policy == "none":
        return []
    targets: list[nn.Module] = []
    if policy == "full":
        targets = _blocks(model)
    else:
        ops = list(ops)
        unknown = [o for o in ops if o not in OP_KINDS]
        if unknown or not ops:
            raise ConfigError(
                f"train.selective_ops: unknown module kind(s) {', '.join(unknown) or '(none given)'} "
                f"(choose from {', '.join(OP_KINDS)})"
            )
        for block in _blocks(model):
            for op in ops:
                for attr in OP_KINDS[op]:
                    sub = getattr(block, attr, None)
                    if sub is not None and all(sub is not t for t in targets):
                        targets.append(sub)
    for m in targets:
        wrap_module(m, context_fn, early_stop)
    return targets


def remove_activation_checkpointing(model: nn.Module) -> None:
    for m in model.modules():
        unwrap_module(m)
