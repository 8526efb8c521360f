"""Product hooks: one place where fault injection, studies and checkers reach a model's named products.

A *product* is the output of one GEMM of attention, named ``q k v scores context output`` in the forward
and, where a protected kernel verifies the backward pass, the names of
``trainguard.sdc.abft.attention.BACKWARD_PRODUCTS``. Every attention implementation that trainguard runs
(the plain LLaMA attention, ABFT's protected kernels for LLaMA and for HF models) calls
:meth:`ProductHooks.fire` on each product right after its GEMM, so the fault injector's ``ProductSite``
reaches the same product whether or not a protection is installed.

A hook is ``fn(layer, name, tensor) -> Tensor | None``; it runs under ``torch.no_grad`` and a returned
tensor is copied into the product *in place*: the autograd graph stays the GEMM's, as it would for a real
hardware fault. Relies on torch only.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from trainguard.errors import TrainguardError

ProductHook = Callable[[int, str, torch.Tensor], "torch.Tensor | None"]
_ATTR = "_trainguard_product_hooks"


class ProductHooks:
    """The hooks of one model (shared by all its attention modules)."""

    def __init__(self) -> None:
        self._hooks: dict[object, ProductHook] = {}

    def __bool__(self) -> bool:
        return bool(self._hooks)

    def add(self, fn: ProductHook) -> Callable[[], None]:
        """Register ``fn``; returns a function that removes it."""
        key = object()
        self._hooks[key] = fn
        return lambda: self._hooks.pop(key, None)

    def fire(self, layer: int, name: str, t: torch.Tensor) -> torch.Tensor:
        """Run every hook on ``t`` (in place); returns ``t``."""
        if not self._hooks:
            return t
        with torch.no_grad():
            # a product that is a column block of a fused GEMM is a strided view: hooks see a contiguous
            # copy (as if it were its own GEMM's output), written back afterwards
            view = t if t.is_contiguous() else t.contiguous()
            for fn in list(self._hooks.values()):
                r = fn(layer, name, view)
                if r is not None and r is not view:
                    if r.shape != view.shape:
                        raise TrainguardError(f"product hook returned shape {tuple(r.shape)} for {name} "
                                              f"of shape {tuple(t.shape)}")
                    view.copy_(r)
            if view is not t:
                t.copy_(view)
        return t


def product_hooks(model: nn.Module) -> ProductHooks:
    """The model's product-hook registry (created on first use)."""
    hooks = getattr(model, _ATTR, None)
    if hooks is None:
        hooks = ProductHooks()
        object.__setattr__(model, _ATTR, hooks)  # not a submodule / parameter: plain attribute
    return hooks
