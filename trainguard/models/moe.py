"""Top-k routed mixture of SwiGLU experts with a Switch-style load-balancing loss.

Routing is data dependent (which tokens reach which expert changes every step): the DMR dynamic
planner and MoE fault campaigns rely on that. Expert parallelism plugs in through ``dispatcher``: when set
(``trainguard.train.parallel.expert``), it computes the experts' contribution for the routed tokens (sending
them to the ranks that hold their experts) instead of the local loop, and ``aux_reducer`` turns the local
load-balancing statistics into the global batch's. The loops over the experts run inside
:func:`routed_region`: how many ops they run depends on the routing (an expert no token reached runs none).
Relies on plain ``torch`` (index_add for dispatch).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from trainguard.utils.threadflag import ThreadFlag

_ROUTED = ThreadFlag()


def routed_region() -> contextlib.AbstractContextManager[None]:
    """Ops run inside are as many as the routing makes them (a loop over the experts that got tokens). A verifier
    that numbers the ops of a step (DMR's op ids, which its plan is keyed by) numbers these apart, so that the
    routing does not shift the ids of the ops after them."""
    return _ROUTED.set(True)


def in_routed_region() -> bool:
    return _ROUTED.active


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoEFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int):
        super().__init__()
        self.n_experts = n_experts
        self.top_k = top_k
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(n_experts))
        self.last_aux_loss: torch.Tensor | None = None
        self.last_tokens_per_expert: torch.Tensor | None = None
        self.dispatcher = None  # expert parallelism: fn(module, flat, weights, chosen) -> combined expert output
        self.aux_reducer = None  # expert parallelism: fn(counts, prob_sum, n_tokens) -> aux loss of the global batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.router(flat).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        counts = torch.bincount(chosen.flatten(), minlength=self.n_experts)
        self.last_tokens_per_expert = counts.detach()
        if self.dispatcher is not None:
            out = self.dispatcher(self, flat, weights, chosen)
        else:
            out = torch.zeros_like(flat)
            with routed_region():
                for e, expert in enumerate(self.experts):
                    token_idx, slot = torch.nonzero(chosen == e, as_tuple=True)
                    if token_idx.numel() == 0:
                        continue
                    y = expert(flat.index_select(0, token_idx)) * weights[token_idx, slot].unsqueeze(-1)
                    out = out.index_add(0, token_idx, y)
        # Switch Transformer load balance: E * sum_e (fraction routed to e) * (mean router prob of e).
        if self.aux_reducer is not None:
            self.last_aux_loss = self.aux_reducer(counts, probs.sum(0), chosen.shape[0])
        else:
            frac = counts.float() / max(1, chosen.numel())
            self.last_aux_loss = self.n_experts * (frac * probs.mean(0)).sum()
        return out.view(shape)
