"""One storage for the q / k / v projection weights, so that the fused QKV GEMM reads them without a copy.

Relies on ``torch`` only. The protected kernel computes ``X [W^Q; W^K; W^V]^T`` as ONE GEMM (one fused check).
Stacking three separate ``nn.Linear`` weights costs a copy of all three on every forward (7 MB per layer at
BERT-base). :func:`share_storage` (called by ``protect``) gives the weights one contiguous storage, back to
back, the way FSDP's flat parameters do: each ``Parameter`` keeps its identity (optimizers, hooks and
``state_dict`` keys are untouched); only its ``.data`` now points into the shared buffer. The stacked weight
is then a view (:func:`stacked_rows`), and its gradient is split back into the three weights without a
copy either. ``unprotect`` leaves the weights where they are: values, ``Parameter`` objects and the
original forwards are unchanged (a plain ``nn.Linear`` reads a row block of the buffer like any contiguous
weight), and protecting the model again then costs nothing. DCP and ``torch.save`` checkpoints of a model
whose weights share the buffer have the same contents and size as before.

Nothing depends on the layout staying as set: :func:`stacked_rows` checks it on every call (data pointers,
strides, dtype, device) and stacks by copying when anything moved a weight (``model.to(...)``, ``.half()``,
loading tensors into ``.data``), so the result is always the stacked weight, only its cost changes.
"""

from __future__ import annotations

import torch
from torch import nn


def _back_to_back(ws: tuple[torch.Tensor, ...]) -> bool:
    """Whether ``ws`` (2-D, equal widths) lie one after another, row-major, in one storage."""
    w0 = ws[0]
    if not w0.is_contiguous():
        return False
    nxt = w0.data_ptr() + w0.numel() * w0.element_size()
    storage = w0.untyped_storage().data_ptr()
    for w in ws[1:]:
        if (not w.is_contiguous() or w.dtype != w0.dtype or w.device != w0.device or w.shape[1:] != w0.shape[1:]
                or w.data_ptr() != nxt or w.untyped_storage().data_ptr() != storage):
            return False
        nxt += w.numel() * w.element_size()
    return True


class _StackedView(torch.autograd.Function):
    """``[w_0; w_1; ...]`` as a view of the storage the weights share; backward splits the gradient."""

    @staticmethod
    def forward(ctx, *ws):
        ctx.rows = [w.shape[0] for w in ws]
        w0 = ws[0].detach()
        return w0.as_strided((sum(ctx.rows), *w0.shape[1:]), w0.stride())

    @staticmethod
    def backward(ctx, g):
        return tuple(g.split(ctx.rows))


def stacked_rows(ws: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``torch.cat(ws)`` (differentiable), as a view when the weights share a storage back to back."""
    if len(ws) > 1 and all(w.dim() == 2 for w in ws) and _back_to_back(ws):
        return _StackedView.apply(*ws)
    return torch.cat(ws)


def share_storage(linears: list[nn.Linear]) -> bool:
    """Move the weights of ``linears`` into one contiguous buffer, in order (see the module docstring).
    Returns False (and changes nothing) when they cannot share one: different dtypes, devices or widths,
    or tensors that are not plain dense ones."""
    ws = [lin.weight for lin in linears]
    w0 = ws[0]
    if any(w.dtype != w0.dtype or w.device != w0.device or w.dim() != 2 or w.shape[1] != w0.shape[1]
           or w.layout != torch.strided or type(w.data) is not torch.Tensor for w in ws):
        return False
    if _back_to_back(tuple(w.data for w in ws)):
        return True
    with torch.no_grad():
        flat = torch.cat([w.data for w in ws])
    lo = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight.data = flat[lo:lo + n]
        lo += n
    return True
