"""Expert parallelism for MoE models as a Trainer strategy: each of ``distributed.ep`` processes holds
``n_experts / ep`` experts of every MoE layer and one slice of the global batch.

Every rank builds the full model from the same seed and keeps only its own experts (parameter names stay
those of the full model, so DCP checkpoints hold every expert exactly once). In an MoE layer each rank
routes its tokens, sends every (token, expert) pair to the rank holding that expert with an
``all_to_all_single`` (the split sizes exchanged first), runs its experts on what it received, and sends
the results back the same way; both transfers are autograd functions whose backward is the reverse
transfer. Every wait on a transfer goes through the strategy's window hooks (kind ``ep``: the expert
all-to-all windows DMR defers its checks into; their length depends on routing, so they are *dynamic*).

Gradients: dense (non-expert) parameters are averaged over ranks with one all-reduce; an expert's
gradient already sums every rank's tokens (the transfers' backward brings them home) and is divided by
the number of ranks. The load-balancing loss is computed from the global batch's routing statistics
(all-reduced counts and probabilities), with its gradient scaled so that the ranks' average is the
gradient of the global loss. So a run matches one process on the same global batch within float
tolerance. Relies on torch.distributed (gloo / nccl ``all_to_all_single``, ``all_reduce``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from trainguard.errors import ConfigError
from trainguard.models.moe import MoEFeedForward, routed_region
from trainguard.train.guards import Verdict
from trainguard.train.optim import scale_gradients, squared_norm
from trainguard.train.parallel.base import Strategy, gather_to_main, init_default_group, reduce_verdicts_over

if TYPE_CHECKING:
    from trainguard.train.trainer import Trainer


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with the given splits; backward sends the gradients back the reverse way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], strategy: ExpertParallelStrategy):
        ctx.splits, ctx.strategy = (out_splits, in_splits), strategy
        return strategy.exchange(x, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return ctx.strategy.exchange(grad.contiguous(), in_splits, out_splits), None, None, None


class ExpertParallelStrategy(Strategy):
    name = "expert"

    def __init__(self) -> None:
        super().__init__()
        self.experts_per_rank = 0

    def init(self, trainer: Trainer) -> None:
        d = trainer.cfg.distributed
        self.rank, self.world, self.owns_group = init_default_group(d.backend, trainer.device, d.ep)
        if self.world != d.ep:
            raise ConfigError(f"an expert-parallel run needs ep = {d.ep} processes under torchrun (got {self.world}); "
                              "`trainguard train` launches them itself")
        mc = trainer.cfg.model_config()
        if not mc.n_experts or mc.n_experts % max(1, self.world):
            raise ConfigError(f"expert parallelism needs a MoE model whose n_experts ({mc.n_experts}) is a multiple "
                              f"of distributed.ep ({self.world})")
        self.experts_per_rank = mc.n_experts // self.world

    def setup(self, trainer: Trainer) -> None:
        lo = self.rank * self.experts_per_rank
        for moe in (m for m in trainer.model.modules() if isinstance(m, MoEFeedForward)):
            for e in range(len(moe.experts)):
                if not lo <= e < lo + self.experts_per_rank:
                    moe.experts[e] = torch.nn.Identity()  # another rank's expert (names of ours unchanged)
            moe.dispatcher = self._dispatch
            moe.aux_reducer = self._global_aux

    def count_params(self, trainer: Trainer) -> int:
        return trainer.cfg.model_config().num_params()

    # ---- the MoE layer ---------------------------------------------------------------------------
    def exchange(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        work = dist.all_to_all_single(out, x, out_splits, in_splits, async_op=True)
        self.run_window("ep", work.wait)
        return out

    def _dispatch(self, moe: MoEFeedForward, flat: torch.Tensor, weights: torch.Tensor,
                  chosen: torch.Tensor) -> torch.Tensor:
        k, n = self.experts_per_rank, flat.shape[0]
        token_idx = torch.arange(n, device=flat.device).repeat_interleave(chosen.shape[1])
        expert_idx = chosen.reshape(-1)
        order = torch.argsort(expert_idx // k, stable=True)  # by destination rank, then as routed
        token_idx, expert_idx = token_idx[order], expert_idx[order]
        send = torch.bincount(expert_idx // k, minlength=self.world)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        send_l, recv_l = send.tolist(), recv.tolist()
        # the expert each received token is for (no gradient), then the tokens themselves (with gradient)
        their_expert = self.exchange(expert_idx.contiguous(), recv_l, send_l)
        got = _AllToAll.apply(flat.index_select(0, token_idx), recv_l, send_l, self)
        y = torch.zeros_like(got)
        lo = self.rank * k
        with routed_region():  # (as many ops as experts that got tokens)
            for e in range(lo, lo + k):
                rows = torch.nonzero(their_expert == e).flatten()
                if rows.numel():
                    y = y.index_add(0, rows, moe.experts[e](got.index_select(0, rows)))
        back = _AllToAll.apply(y, send_l, recv_l, self)
        slot_weight = weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(flat).index_add(0, token_idx, back * slot_weight)

    def _global_aux(self, counts: torch.Tensor, prob_sum: torch.Tensor, n_tokens: int) -> torch.Tensor:
        stats = torch.cat([counts.float(), prob_sum.detach().float(), torch.tensor([float(n_tokens)])])
        dist.all_reduce(stats)
        e = counts.numel()
        total_counts, total_probs, total_tokens = stats[:e], stats[e:2 * e], stats[-1]
        # value: the global statistics; gradient: through this rank's probabilities only
        probs = prob_sum + (total_probs - prob_sum.detach())
        aux = e * ((total_counts / total_counts.sum()) * probs / total_tokens).sum()
        # the ranks' gradients are averaged: scale this rank's share so the average is the global gradient
        return aux.detach() + self.world * (aux - aux.detach())

    # ---- the step --------------------------------------------------------------------------------
    def forward_backward(self, trainer: Trainer, plan) -> torch.Tensor:
        loss = super().forward_backward(trainer, plan)
        dense = [p for p in trainer.model.parameters() if p.grad is not None and not _is_expert(trainer, p)]
        if dense:
            flat = torch.cat([g.grad.reshape(-1) for g in dense])
            dist.all_reduce(flat)
            off = 0
            for p in dense:
                p.grad.copy_(flat[off:off + p.numel()].view_as(p.grad))
                off += p.numel()
        grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
        if grads:  # (one list op; DMR verifies it in cache-sized pieces)
            torch._foreach_div_(grads, self.world)
        return loss

    def grad_norm(self, trainer: Trainer, max_norm: float) -> torch.Tensor:
        dense: list[torch.Tensor] = []
        experts: list[torch.Tensor] = []
        for p in trainer.model.parameters():
            if p.grad is not None:
                (experts if _is_expert(trainer, p) else dense).append(p.grad)
        dense_sq, expert_sq = squared_norm(dense, trainer.device), squared_norm(experts, trainer.device)
        dist.all_reduce(expert_sq)  # each expert lives on one rank; dense gradients are equal everywhere
        total = (dense_sq + expert_sq).sqrt()
        if max_norm > 0:
            scale_gradients(dense + experts, torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total

    def global_loss(self, trainer: Trainer, loss: torch.Tensor) -> torch.Tensor:
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        return mean / self.world

    def reduce_verdicts(self, trainer: Trainer, local: Verdict) -> list[Verdict]:
        return reduce_verdicts_over(None, self.rank, self.world, local, trainer.device)

    def gather_object(self, obj: Any) -> list[Any] | None:
        return gather_to_main(obj, self.rank, self.world)

    @torch.no_grad()
    def evaluate(self, trainer: Trainer, n_batches: int) -> float:
        # every rank evaluates its slice of each validation batch (the experts need every rank), then average
        losses = []
        for x, y in trainer.batches.val_batches(n_batches):
            per = x.shape[0] // self.world
            xs, ys = x[self.rank * per:(self.rank + 1) * per], y[self.rank * per:(self.rank + 1) * per]
            losses.append(trainer.eval_loss(xs, ys))
        val = torch.stack(losses).mean() if losses else torch.zeros(())
        dist.all_reduce(val)
        return float(val) / self.world


def _is_expert(trainer: Trainer, p: torch.nn.Parameter) -> bool:
    ids = getattr(trainer, "_expert_param_ids", None)
    if ids is None:
        ids = trainer._expert_param_ids = {id(q) for m in trainer.model.modules() if isinstance(m, MoEFeedForward)
                                           for q in m.experts.parameters()}
    return id(p) in ids
