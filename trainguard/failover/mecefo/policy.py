"""Neighbor-do-both (MeCeFO) as a gradient-sync policy of the elastic data-parallel strategy, and the three
baselines on the same engine: Bamboo-style redundant computation, Oobleck-style rebalancing and
checkpoint-restart.

Every policy plans the same global batch: ``replicas * grad_accum`` slices, slice ``r * k + m`` being replica
``r``'s ``m``-th micro-batch, each weighted ``1 / n`` (the failure-free data-parallel weight). A worker is *out*
when it left the torchft quorum (killed) or is under a simulated failure (``down(step)``, from a
:class:`~trainguard.failover.mecefo.timeline.FailureTimeline`: it stays in the quorum and computes nothing).

* :class:`MeCeFOPolicy`: an out worker's slices go to its **neighbors** in the data-parallel ring: round-robin
  over the next ``spread`` workers that are up (:mod:`trainguard.failover.mecefo.ring`; ``spread=1`` is the
  paper's single neighbor, ``"auto"`` the fewest neighbors whose step is estimated no slower than a normal one,
  keeping one worker up that is nobody's neighbor). A neighbor computes them, and its own (``degrade_own``, as
  in the paper), tagged ``{"neighbor"}``: the MeCeFO component runs those degraded. The attention parameters' gradient
  (``param_groups``: ``"mha"``) is weighted ``1 / (exact slices)`` on the slices computed exactly and 0 on the
  degraded ones, so it is the mean over exactly the slices that computed it (the paper's groups that are
  neither failed nor neighbors); the other parameters keep ``1 / n``. If every worker that is up is a
  neighbor, the neighbors compute their own slices exactly (someone must). A worker killed mid-step: its
  counted slices go to its neighbors in the same step (degraded, spread the same way; exact if otherwise no
  counted slice would be exact), the attention weights are recounted.
* :class:`BambooPolicy`: every worker also computes its ring predecessor's counted slices and keeps them apart
  (``keep=True``, tag ``redundant``). An out worker's slices are computed (and counted) by its successor, which
  then keeps a redundant copy of its new predecessor's work. A worker killed mid-step: its successor's kept
  copies count. Exact.
* :class:`OobleckPolicy`: the ``n`` slices are split as evenly as possible, in order, over the workers that are
  up (the global batch is rebalanced over the survivors, not shrunk); a worker killed mid-step: its slices go
  to the least-loaded survivors. Exact.
* :class:`CheckpointRestartPolicy`: plain data parallel; any failure (a worker gone, a simulated failure
  starting) raises :class:`GlobalRestart`: the launcher restarts every worker from the last checkpoint.

Policies are deterministic functions of (view, timeline), as the strategy requires. Relies on the elastic
strategy's protocol only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from trainguard.errors import TrainguardError
from trainguard.failover.mecefo.approx import MHA_GROUP, NEIGHBOR, MeCeFOConfig, mha_parameter_names
from trainguard.failover.mecefo.ring import assign, resolve, ring_after, ring_next, ring_prev
from trainguard.failover.mecefo.timeline import FailureTimeline
from trainguard.train.parallel.base import MicroBatch
from trainguard.train.parallel.elastic import GradSyncPolicy, Recovery, StepView, SyncPlan

DEGRADED = frozenset({NEIGHBOR})
REDUNDANT = frozenset({"redundant"})


class _TimelinePolicy(GradSyncPolicy):
    def __init__(self, timeline: FailureTimeline | None = None):
        self.timeline = timeline or FailureTimeline()

    def workers(self, view: StepView) -> list[int]:
        up = sorted(view.live - self.timeline.down(view.step))
        if not up:
            raise TrainguardError(f"{self.name}: no worker is up at step {view.step} (live {sorted(view.live)}, "
                                  f"simulated failures {sorted(self.timeline.down(view.step))})")
        return up

    @staticmethod
    def own(r: int, view: StepView, tags: frozenset[str] = frozenset(), keep: bool = False) -> list[MicroBatch]:
        k = view.grad_accum
        n = view.replicas * k
        return [MicroBatch(r * k + m, n, 1.0 / n, keep=keep, tags=tags) for m in range(k)]


# --------------------------------------------------------------------------------------------------
# MeCeFO


class MeCeFOPolicy(_TimelinePolicy):
    """Neighbor-do-both (see the module docstring)."""

    name = "mecefo"

    def __init__(self, config: MeCeFOConfig | None = None, timeline: FailureTimeline | None = None):
        super().__init__(timeline)
        self.cfg = config or MeCeFOConfig()

    def param_groups(self, model: torch.nn.Module) -> dict[str, list[str]]:
        return {MHA_GROUP: mha_parameter_names(model)} if self.cfg.skip_mha else {}

    def too_slow(self, own: int) -> Callable[[int], bool]:
        """spread='auto': is a neighbor carrying ``extra`` micro-batches besides its ``own`` (all degraded, at
        ``degraded_cost`` each) estimated slower than a normal worker's ``own`` exact ones?"""
        return lambda extra: (own + extra) * self.cfg.degraded_cost > own + 1e-9

    def spread(self, shares: dict[int, int], workers: list[int], view: StepView) -> int:
        return resolve(self.cfg.spread, shares, workers, view.replicas, self.too_slow(view.grad_accum))

    def plan(self, view: StepView) -> SyncPlan:
        workers = self.workers(view)
        out = sorted(set(range(view.replicas)) - set(workers))
        k_mb = view.grad_accum
        shares = dict.fromkeys(out, k_mb)
        k = self.spread(shares, workers, view)
        placed = assign(shares, workers, view.replicas, k)  # host -> [(out worker, micro-batch)]
        hosts = set(placed)
        # the neighbor-do-both of the paper: a neighbor's own slices run degraded too, unless nobody would be left
        # to compute the attention gradient
        degrade_own = self.cfg.degrade_own and bool(set(workers) - hosts)
        work = {r: self.own(r, view, DEGRADED if (r in hosts and degrade_own) else frozenset()) for r in workers}
        n = view.replicas * k_mb
        for h, items in placed.items():
            work[h] += [MicroBatch(d * k_mb + m, n, 1.0 / n, tags=DEGRADED) for d, m in items]
        plan = SyncPlan(work, info={"out": out, "hosts": {str(d): ring_next(d, workers, view.replicas) for d in out},
                                    "neighbors": sorted(hosts), "spread": k,
                                    "spread_hosts": {str(d): ring_after(d, workers, view.replicas, min(k, k_mb))
                                                     for d in out}})
        self._weigh_attention(plan.work, plan)
        return plan

    def on_failure(self, view: StepView, failed: frozenset[int], plan: SyncPlan) -> Recovery:
        """A worker killed mid-step: its counted micro-batches (its own and any it carried) go round-robin to the
        ``spread`` workers after it, degraded; computed exactly instead if otherwise no counted slice would be
        exact (someone must compute the attention gradient)."""
        workers = self.workers(view)
        lost = {f: [mb for mb in plan.work.get(f, []) if not mb.keep] for f in sorted(failed)}
        lost = {f: mbs for f, mbs in lost.items() if mbs}
        shares = {f: len(mbs) for f, mbs in lost.items()}
        k = self.spread(shares, workers, view)
        placed = assign(shares, workers, view.replicas, k)
        staying = [mb for r in view.live if r not in failed for mb in plan.work.get(r, []) if not mb.keep]
        exact_left = any(NEIGHBOR not in mb.tags for mb in staying)
        tags = DEGRADED if (exact_left or not self.cfg.skip_mha) else frozenset()
        extra: dict[int, list[MicroBatch]] = {}
        for h, items in placed.items():
            extra[h] = [replace(lost[f][m], tags=tags) for f, m in items]
        after = {r: [mb for mb in plan.work.get(r, []) if not mb.keep] + extra.get(r, []) for r in view.live}
        hosts = {str(f): ring_next(f, workers, view.replicas) for f in lost}
        rec = Recovery(extra=extra, info={"hosts": hosts, "spread": k, "degraded": sorted(
            mb.index for mbs in after.values() for mb in mbs if NEIGHBOR in mb.tags)})
        weights = self._weigh_attention(after, None)
        if weights:
            rec.group_weights = {MHA_GROUP: weights}
            rec.info["attention_slices"] = sum(1 for w in weights.values() if w > 0)
        return rec

    def _weigh_attention(self, work: dict[int, list[MicroBatch]], plan: SyncPlan | None) -> dict[int, float]:
        """Attention weights: ``1 / (exact slices)`` on the exact ones, 0 on the degraded ones (none needed when
        nothing is degraded or skip-MHA is off)."""
        counted = [mb for mbs in work.values() for mb in mbs if not mb.keep]
        degraded = [mb.index for mb in counted if NEIGHBOR in mb.tags]
        exact = sorted(mb.index for mb in counted if NEIGHBOR not in mb.tags)
        if plan is not None:
            plan.info.update({"degraded_slices": len(degraded), "degraded": sorted(degraded),
                              "attention_slices": len(exact) if degraded else len(counted)})
        if not degraded or not self.cfg.skip_mha:
            return {}
        if not exact:
            raise TrainguardError("mecefo: every counted slice is degraded: no slice computes the attention gradient")
        weights = {t: 0.0 for t in degraded}
        weights.update({t: 1.0 / len(exact) for t in exact})
        if plan is not None:
            plan.group_weights = {MHA_GROUP: weights}
        return weights


# --------------------------------------------------------------------------------------------------
# Baselines


class BambooPolicy(_TimelinePolicy):
    """Redundant computation: every worker also computes its ring predecessor's work, kept apart."""

    name = "bamboo"

    def plan(self, view: StepView) -> SyncPlan:
        workers = self.workers(view)
        out = sorted(set(range(view.replicas)) - set(workers))
        host = {d: ring_next(d, workers, view.replicas) for d in out}
        counted = {r: self.own(r, view) for r in workers}
        for d in out:
            counted[host[d]] += self.own(d, view)
        work = {r: list(mbs) for r, mbs in counted.items()}
        for r in workers:
            p = ring_prev(r, workers, view.replicas)
            if p != r:
                work[r] += [replace(mb, keep=True, tags=REDUNDANT) for mb in counted[p]]
        return SyncPlan(work, info={"out": out, "hosts": {str(d): h for d, h in host.items()}})

    def on_failure(self, view: StepView, failed: frozenset[int], plan: SyncPlan) -> Recovery:
        workers = self.workers(view)
        count: dict[int, list[int]] = {}
        extra: dict[int, list[MicroBatch]] = {}
        for f in sorted(failed):
            for mb in plan.work.get(f, []):
                if mb.keep:
                    continue
                holders = sorted(r for r in workers if any(c.index == mb.index and c.keep for c in plan.work.get(r, [])))
                if holders:
                    count.setdefault(holders[0], []).append(mb.index)
                else:  # its redundant copy died too: compute it now
                    extra.setdefault(ring_next(f, workers, view.replicas), []).append(replace(mb, tags=frozenset()))
        return Recovery(extra=extra, count=count, info={"recounted": sorted(t for ts in count.values() for t in ts)})


class OobleckPolicy(_TimelinePolicy):
    """Reconfiguration: the global batch's slices rebalanced over the workers that are up."""

    name = "oobleck"

    def plan(self, view: StepView) -> SyncPlan:
        workers = self.workers(view)
        n = view.replicas * view.grad_accum
        q, extra = divmod(n, len(workers))
        work, t = {}, 0
        for i, r in enumerate(workers):
            size = q + (1 if i < extra else 0)
            work[r] = [MicroBatch(s, n, 1.0 / n) for s in range(t, t + size)]
            t += size
        return SyncPlan(work, info={"out": sorted(set(range(view.replicas)) - set(workers)),
                                    "max_load": max(len(m) for m in work.values())})

    def on_failure(self, view: StepView, failed: frozenset[int], plan: SyncPlan) -> Recovery:
        workers = self.workers(view)
        load = {r: sum(1 for mb in plan.work.get(r, []) if not mb.keep) for r in workers}
        extra: dict[int, list[MicroBatch]] = {}
        for f in sorted(failed):
            for mb in plan.work.get(f, []):
                if mb.keep:
                    continue
                r = min(workers, key=lambda w: (load[w], w))
                load[r] += 1
                extra.setdefault(r, []).append(mb)
        return Recovery(extra=extra)


class GlobalRestart(TrainguardError):
    """A failure under checkpoint-restart: every worker stops; the launcher restarts all from the last checkpoint."""

    def __init__(self, step: int, failed: list[int], real: bool):
        super().__init__(f"checkpoint-restart: worker(s) {failed} failed at step {step}: restart every worker "
                         "from the last checkpoint")
        self.step, self.failed, self.real = step, failed, real


class CheckpointRestartPolicy(_TimelinePolicy):
    """Plain data parallel that answers every failure with a global restart."""

    name = "checkpoint_restart"

    def plan(self, view: StepView) -> SyncPlan:
        gone = sorted(set(range(view.replicas)) - set(view.live))
        if gone:
            raise GlobalRestart(view.step, gone, True)
        starting = sorted(f.node for f in self.timeline.starting(view.step) if not f.real)
        if starting:
            raise GlobalRestart(view.step, starting, False)
        return SyncPlan({r: self.own(r, view) for r in sorted(view.live)})

    def on_failure(self, view: StepView, failed: frozenset[int], plan: SyncPlan) -> Recovery:
        raise GlobalRestart(view.step, sorted(failed), True)


POLICIES: dict[str, Callable[..., GradSyncPolicy]] = {
    "mecefo": MeCeFOPolicy, "bamboo": BambooPolicy, "oobleck": OobleckPolicy,
    "checkpoint_restart": CheckpointRestartPolicy,
}
METHODS = tuple(POLICIES)


def make_policy(method: str, timeline: FailureTimeline | None = None, config: MeCeFOConfig | None = None) -> GradSyncPolicy:
    if method not in POLICIES:
        raise TrainguardError(f"unknown failover method {method!r} (choose from {', '.join(POLICIES)})")
    if method == "mecefo":
        return MeCeFOPolicy(config, timeline)
    return POLICIES[method](timeline)


def describe(plan: SyncPlan) -> dict[str, Any]:
    """A compact view of a plan: replica -> [(slice, tags, kept)]."""
    return {r: [(mb.index, sorted(mb.tags), mb.keep) for mb in mbs] for r, mbs in plan.work.items()}


__all__ = ["METHODS", "BambooPolicy", "CheckpointRestartPolicy", "GlobalRestart", "MeCeFOPolicy", "OobleckPolicy",
           "make_policy", "ring_next", "ring_prev"]
