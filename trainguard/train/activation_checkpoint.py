"""Activation checkpointing policies: ``none``, ``full`` (every TransformerBlock) and ``selective``
(only the module kinds named in ``train.selective_ops``: ``attention``, ``ffn``, ``norm``).

Relies on ``torch.utils.checkpoint.checkpoint`` (non-reentrant). Wrapping replaces the module's
``forward`` on the instance (a bound method, so ``copy.deepcopy`` rebinds it to the copy), which keeps
parameter names unchanged: state dicts and checkpoints are the same with or without a policy.

**Checkpoint contexts compose.** Each root model has one :class:`CheckpointContexts` registry shared by
all its wrapped modules. ``add_checkpoint_context(model, factory)`` registers a factory returning
``(forward_ctx, recompute_ctx)`` (``torch.utils.checkpoint``'s ``context_fn`` contract: the first is
entered around the original forward, the second around the recompute in backward) and returns a
remover. Every registered pair is entered, in registration order, so the fault injector (which labels
recompute ops), DMR (which compares forward and recompute) and any other user coexist.
``set_checkpoint_early_stop(model, False)`` makes the recompute replay every op of the segment,
including its last one (Piggyback-DMR needs that); the default ``True`` is PyTorch's early stop.
Registrations survive switching the policy (``apply_activation_checkpointing`` again).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterable
from typing import Any

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


ContextFactory = Callable[[], tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]]
_REGISTRY = "_trainguard_ac_contexts"
_WRAPPED = "_trainguard_ac_registry"


class CheckpointContexts:
    """The checkpoint contexts and early-stop setting of one model (see the module docstring)."""

    def __init__(self) -> None:
        self.factories: list[ContextFactory] = []
        self.early_stop = True

    def add(self, factory: ContextFactory) -> Callable[[], None]:
        self.factories.append(factory)
        return lambda: self.factories.remove(factory) if factory in self.factories else None

    def context_fn(self) -> tuple[Any, Any]:
        """``torch.utils.checkpoint``'s ``context_fn``: every registered pair, entered together."""
        if not self.factories:
            return noop_context_fn()
        pairs = [f() for f in self.factories]
        return _Stack([p[0] for p in pairs]), _Stack([p[1] for p in pairs])


class _Stack(contextlib.ExitStack):
    """Enter several context managers in order (an ExitStack that knows them up front)."""

    def __init__(self, managers: list) -> None:
        super().__init__()
        self._managers = managers

    def __enter__(self):
        super().__enter__()
        for m in self._managers:
            self.enter_context(m)
        return self


def checkpoint_contexts(model: nn.Module) -> CheckpointContexts:
    """The model's registry (created on first use)."""
    reg = getattr(model, _REGISTRY, None)
    if reg is None:
        reg = CheckpointContexts()
        object.__setattr__(model, _REGISTRY, reg)
    return reg


def add_checkpoint_context(model: nn.Module, factory: ContextFactory) -> Callable[[], None]:
    """Register ``factory() -> (forward_ctx, recompute_ctx)`` for every checkpointed module of ``model``;
    returns a remover."""
    return checkpoint_contexts(model).add(factory)


def set_checkpoint_early_stop(model: nn.Module, early_stop: bool) -> None:
    """``False``: the recompute replays every op of each segment, including its last one."""
    checkpoint_contexts(model).early_stop = bool(early_stop)


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    original = type(self).forward.__get__(self)
    if not torch.is_grad_enabled():  # eval / no_grad: nothing to save, run as is
        return original(*args, **kwargs)
    reg: CheckpointContexts = getattr(self, _WRAPPED)
    return checkpoint(original, *args, use_reentrant=False, context_fn=reg.context_fn, early_stop=reg.early_stop,
                      **kwargs)


def wrap_module(module: nn.Module, registry: CheckpointContexts | None = None) -> nn.Module:
    """Make ``module``'s forward run under non-reentrant activation checkpointing (in place), with the
    contexts of ``registry`` (its own registry when None)."""
    object.__setattr__(module, _WRAPPED, registry if registry is not None else checkpoint_contexts(module))
    module.forward = types.MethodType(_checkpointed_forward, module)
    return module


def unwrap_module(module: nn.Module) -> nn.Module:
    if is_wrapped(module):
        del module.forward
        object.__delattr__(module, _WRAPPED)
    return module


def is_wrapped(module: nn.Module) -> bool:
    return "forward" in module.__dict__ and _WRAPPED in module.__dict__


def _blocks(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ConfigError("activation checkpointing needs a model with a `layers` ModuleDict of blocks")
    return list(layers.values())


def apply_activation_checkpointing(
    model: nn.Module,
    policy: str = "full",
    ops: Iterable[str] = ("attention",),
    context_fn: ContextFactory | None = None,
    early_stop: bool | None = None,
) -> list[nn.Module]:
    """Apply a policy in place; returns the wrapped modules (empty for ``none``).

    Re-applying first removes any previous wrapping, so policies can be switched on a live model; the
    model's checkpoint contexts stay registered. ``context_fn`` and ``early_stop`` are shorthands for
    :func:`add_checkpoint_context` and :func:`set_checkpoint_early_stop`.
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
    reg = checkpoint_contexts(model)
    if context_fn is not None:
        reg.add(context_fn)
    if early_stop is not None:
        reg.early_stop = bool(early_stop)
    for m in targets:
        wrap_module(m, reg)
    return targets


def remove_activation_checkpointing(model: nn.Module) -> None:
    for m in model.modules():
        unwrap_module(m)
