"""Cluster throughput of MeCeFO and its baselines, **computed** (not run) from per-step costs measured on this
machine and a failure timeline: a model, stated as such wherever its numbers appear.

Inputs:

* :class:`StepCosts` -- seconds of one worker's training step in each role, measured for real by
  :mod:`trainguard.failover.mecefo.bench`: a normal step (its own ``B`` sequences, exact), MeCeFO's neighbor step
  (its own and one out worker's, degraded), Bamboo's redundant step (its own plus its predecessor's copy) and
  covering step (its own, an out worker's and a redundant copy), Oobleck's rebalanced step (``ceil(N B / (N - m))``
  sequences). Loads that were not measured (a neighbor carrying two out workers, ...) are composed from the
  measured per-unit costs (``extrapolated`` counts them).
* :class:`ClusterAssumptions` -- ``N`` workers, the failure preset's events over a long modelled horizon (one
  failure of the job every 2 h / 1 h / 0.5 h, a random worker each), the worker's recovery time and the fixed
  costs the methods pay per event (detection, healing, reconfiguration, restart, checkpoint writes).

The model: data parallelism is synchronous, so a step takes as long as its slowest worker. Between events the
set of out workers is constant and each method's step time follows from it:

* MeCeFO: an out worker's share (``parts`` micro-batches) is spread round-robin over the next ``spread`` workers
  up in the ring (:mod:`trainguard.failover.mecefo.ring`, as the policy does; ``spread`` 1 = the paper's single
  neighbor, ``auto`` = the smallest spread whose most loaded neighbor is measured no slower than a normal step);
  each neighbor runs its own and the carried micro-batches degraded (own exact when every worker up is a
  neighbor); plus the SVD refresh amortised over ``tau`` steps.
* Bamboo: every worker computes its own share and a redundant copy of its predecessor's; an out worker's
  successor counts that copy and keeps a copy of its new predecessor's share.
* Oobleck: the global batch rebalanced over the survivors; ``reconfig_s`` per failure and per rejoin.
* checkpoint-restart: every failure loses the work since the last checkpoint and costs ``restart_s``; checkpoints
  every ``T* = d + sqrt(2 d (M + R) + d^2)`` (availability-optimal period; ``d`` = ``checkpoint_s``, ``M`` = MTBF,
  ``R`` = ``restart_s``), each ``d`` seconds long.

Elastic methods (MeCeFO, Bamboo, Oobleck) also pay ``detect_s`` per failure and ``heal_s`` per rejoin.
Communication is not modelled (``comm_s`` per step, default 0, is added to every method's step alike).
Relies on numpy (the failure schedules) and the standard library.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from trainguard.errors import TrainguardError
from trainguard.failover.mecefo.ring import assign, resolve
from trainguard.faults.schedules import PRESETS_MTBF_HOURS, FailureSchedule
from trainguard.utils.settings import setting

CLUSTER_METHODS = ("mecefo", "bamboo", "oobleck", "checkpoint_restart")


@dataclass
class StepCosts:
    """Seconds of one worker's step (forward, backward, optimizer), measured."""

    normal: float  # own share, exact
    neighbor: float  # own + one out worker's share, degraded
    bamboo: float  # own share + a redundant copy of the predecessor's
    bamboo_cover: float  # own + an out worker's share + a redundant copy
    optimizer: float  # the optimizer step alone (part of every step above)
    rebalanced: dict[int, float] = field(default_factory=dict)  # sequences per worker -> step (Oobleck)
    batch: int = 4  # sequences per worker per step
    svd_s: float = 0.0  # one refresh of every FFN weight's V1
    tau: int = 200
    degrade_own: bool = True
    parts: int = 1  # micro-batches one share is computed in (an out worker's share splits over up to this many)
    neighbor_extra: dict[int, float] = field(default_factory=dict)  # e -> own share + e of an out worker's parts, degraded
    spread: int | str = 1  # MeCeFO's spread (ring.resolve): 1 = the paper's single neighbor

    @property
    def exact_unit(self) -> float:
        """One share (``batch`` sequences) computed exactly, without the optimizer."""
        return max(self.normal - self.optimizer, 1e-12)

    @property
    def degraded_unit(self) -> float:
        return max((self.neighbor - self.optimizer) / 2.0, 1e-12)

    def step(self, exact: int, degraded: int) -> tuple[float, bool]:
        """A step computing ``exact`` shares exactly and ``degraded`` degraded: (seconds, measured?)."""
        return self.step_parts(exact * self.parts, degraded * self.parts)

    def step_parts(self, exact: int, degraded: int) -> tuple[float, bool]:
        """A step computing ``exact`` micro-batches (``parts`` per share) exactly and ``degraded`` degraded:
        (seconds, measured?); a load that was not measured is composed from the per-share costs."""
        p = self.parts
        measured = {(p, 0): self.normal, (0, 2 * p): self.neighbor, (2 * p, 0): self.bamboo,
                    (3 * p, 0): self.bamboo_cover}
        measured.update({(0, p + e): t for e, t in self.neighbor_extra.items()})
        if (exact, degraded) in measured:
            return measured[(exact, degraded)], True
        return self.optimizer + (exact * self.exact_unit + degraded * self.degraded_unit) / p, False

    def rebalanced_step(self, sequences: int) -> tuple[float, bool]:
        if sequences in self.rebalanced:
            return self.rebalanced[sequences], True
        if sequences == self.batch:
            return self.normal, True
        return self.optimizer + self.exact_unit * sequences / self.batch, False


@dataclass
class ClusterAssumptions:
    workers: int = setting(32, help="data-parallel workers of the modelled cluster (the paper's 32)")
    recovery_min: float = setting(10.0, help="a failed worker is back (restarted or replaced) this many minutes later")
    detect_s: float = setting(1.5, help="elastic methods: failure detection and a new quorum, per failure "
                                        "(the lighthouse's heartbeat timeout here)")
    heal_s: float = setting(10.0, help="elastic methods: a returning worker receives the state from a peer, per rejoin")
    reconfig_s: float = setting(30.0, help="Oobleck: re-instantiating the pipelines, per failure and per rejoin")
    restart_s: float = setting(300.0, help="checkpoint-restart: one global restart (reschedule, re-initialise, load)")
    checkpoint_s: float = setting(30.0, help="checkpoint-restart: writing one checkpoint")
    comm_s: float = setting(0.0, help="communication per step, added to every method alike (0: not modelled)")
    horizon_h: float = setting(1000.0, help="modelled hours the throughput is averaged over")
    seed: int = setting(0, help="seed of the failure events")

    def validate(self) -> ClusterAssumptions:
        if self.workers < 2:
            raise TrainguardError(f"cluster model: workers must be >= 2, got {self.workers}")
        for name in ("recovery_min", "horizon_h"):
            if not getattr(self, name) > 0:
                raise TrainguardError(f"cluster model: {name} must be > 0, got {getattr(self, name)}")
        for name in ("detect_s", "heal_s", "reconfig_s", "restart_s", "checkpoint_s", "comm_s"):
            if getattr(self, name) < 0:
                raise TrainguardError(f"cluster model: {name} must be >= 0, got {getattr(self, name)}")
        return self


def _ring_next(dead: int, up: list[int], n: int) -> int:
    return min(up, key=lambda r: ((r - dead) % n, r))


def _ring_prev(r: int, up: list[int], n: int) -> int:
    others = [w for w in up if w != r]
    return max(others, key=lambda w: ((w - r) % n, w)) if others else r


class _StepModel:
    """Step time of each method for a set of out workers (memoised)."""

    def __init__(self, costs: StepCosts, n: int, comm_s: float):
        self.c, self.n, self.comm = costs, n, comm_s
        self.extrapolated: set[str] = set()
        self._memo: dict[tuple[str, frozenset[int]], float] = {}

    def __call__(self, method: str, out: frozenset[int]) -> float:
        key = (method, out)
        if key not in self._memo:
            self._memo[key] = getattr(self, "_" + method)(out) + self.comm
        return self._memo[key]

    def _note(self, what: str, measured: bool) -> None:
        if not measured:
            self.extrapolated.add(what)

    def _loads(self, out: frozenset[int]) -> tuple[list[int], dict[int, int]]:
        up = [r for r in range(self.n) if r not in out]
        load = dict.fromkeys(up, 0)
        for d in out:
            load[_ring_next(d, up, self.n)] += 1
        return up, load

    def _mecefo(self, out: frozenset[int]) -> float:
        """The out workers' micro-batches spread as the policy spreads them (ring.assign); the slowest neighbor."""
        if not out:
            return self.c.normal
        up = [r for r in range(self.n) if r not in out]
        p = self.c.parts
        shares = dict.fromkeys(out, p)
        placed = assign(shares, up, self.n, 1)
        own_degraded = self.c.degrade_own and len(placed) < len(up)

        def host_step(extra: int, degraded_own: bool) -> tuple[float, bool]:
            return self.c.step_parts(0, p + extra) if degraded_own else self.c.step_parts(p, extra)

        k = resolve(self.c.spread, shares, up, self.n, lambda e: host_step(e, own_degraded)[0] > self.c.normal + 1e-12)
        placed = assign(shares, up, self.n, k)
        own_degraded = self.c.degrade_own and len(placed) < len(up)
        worst = self.c.normal
        for items in placed.values():
            t, ok = host_step(len(items), own_degraded)
            self._note(f"mecefo neighbor carrying {len(items)}/{p} of a share" + ("" if own_degraded else ", own exact"), ok)
            worst = max(worst, t)
        return worst + self.c.svd_s / self.c.tau

    def _bamboo(self, out: frozenset[int]) -> float:
        up, load = self._loads(out)
        worst = 0.0
        for r in up:
            p = _ring_prev(r, up, self.n)
            units = (1 + load[r]) + ((1 + load[p]) if p != r else 0)
            t, ok = self.c.step(units, 0)
            self._note(f"bamboo {units} shares", ok)
            worst = max(worst, t)
        return worst

    def _oobleck(self, out: frozenset[int]) -> float:
        seqs = math.ceil(self.n * self.c.batch / (self.n - len(out)))
        t, ok = self.c.rebalanced_step(seqs)
        self._note(f"oobleck {seqs} sequences", ok)
        return t


def _down_intervals(events: list[tuple[float, int]], n: int, recovery_s: float) -> tuple[list[tuple[float, float, int]], int]:
    """(start, end, worker) of every applied failure (seconds); failures of a worker already out, or of the last
    one up, are absorbed."""
    out: list[tuple[float, float, int]] = []
    active: list[tuple[float, int]] = []  # (end, worker) of the failures in progress
    absorbed = 0
    for t_h, w in sorted(events):
        t = t_h * 3600.0
        active = [(e, x) for e, x in active if e > t]
        if any(x == w for _, x in active) or len(active) + 1 >= n:
            absorbed += 1
            continue
        out.append((t, t + recovery_s, w))
        active.append((t + recovery_s, w))
    return out, absorbed


def _elastic_tokens(method: str, model: _StepModel, intervals, horizon_s: float, a: ClusterAssumptions) -> tuple[float, float]:
    """(steps completed, seconds with a worker out) over the horizon: a sweep over failure and rejoin events."""
    fixed_fail = a.detect_s + (a.reconfig_s if method == "oobleck" else 0.0)
    fixed_back = a.heal_s + (a.reconfig_s if method == "oobleck" else 0.0)
    marks: list[tuple[float, int, int]] = []  # (time, +1 out / -1 back, worker)
    for s, e, w in intervals:
        marks.append((s, 1, w))
        if e < horizon_s:
            marks.append((e, -1, w))
    marks.sort()
    out: set[int] = set()
    steps = degraded = carry = 0.0
    t = 0.0
    i = 0
    while t < horizon_s:
        while i < len(marks) and marks[i][0] <= t:
            _, kind, w = marks[i]
            if kind > 0:
                out.add(w)
                carry += fixed_fail
            else:
                out.discard(w)
                carry += fixed_back
            i += 1
        nxt = marks[i][0] if i < len(marks) else horizon_s
        length = min(nxt, horizon_s) - t
        used = min(carry, length)
        carry -= used
        steps += (length - used) / model(method, frozenset(out))
        if out:
            degraded += length
        t = min(nxt, horizon_s)
    return steps, degraded


def checkpoint_period(checkpoint_s: float, mtbf_s: float, restart_s: float) -> float:
    """Availability-optimal checkpoint period (Saxena et al. 2024): ``d + sqrt(2 d (M + R) + d^2)``."""
    d = checkpoint_s
    return d + math.sqrt(2.0 * d * (mtbf_s + restart_s) + d * d) if d > 0 else math.inf


def _checkpoint_restart_compute(events_s: list[float], horizon_s: float, period: float, a: ClusterAssumptions) -> tuple[float, int]:
    """(seconds of committed compute, failures that hit) with checkpoints every ``period`` of compute."""
    d = a.checkpoint_s
    t = committed = pending = 0.0
    hits = 0

    def advance(until: float) -> None:
        nonlocal t, committed, pending
        while t < until:
            need = period - pending
            if math.isinf(need):
                pending += until - t
                t = until
                return
            if until - t >= need + d:  # compute to the next checkpoint and write it
                t += need + d
                committed += period
                pending = 0.0
            else:  # the segment ends before the checkpoint completes
                pending += min(until - t, need)
                t = until
                return

    for tf in events_s:
        if tf >= horizon_s:
            break
        if tf < t:  # during a restart: absorbed
            continue
        advance(tf)
        pending = 0.0  # the work since the last checkpoint is lost
        hits += 1
        t = tf + a.restart_s
    if t < horizon_s:
        advance(horizon_s)
    return committed + pending, hits


def cluster_throughput(costs: StepCosts, preset: str, assumptions: ClusterAssumptions | None = None,
                       tokens_per_worker_step: int = 1) -> dict:
    """Modelled tokens/s of every method without failures and under ``preset`` (``none``/``low``/``mid``/``high``).
    ``tokens_per_worker_step``: tokens in one worker's share of a step (``batch * seq_len``)."""
    a = (assumptions or ClusterAssumptions()).validate()
    n = a.workers
    horizon = a.horizon_h * 3600.0
    recovery = a.recovery_min * 60.0
    global_tokens = n * tokens_per_worker_step
    model = _StepModel(costs, n, a.comm_s)
    if preset == "none":
        events: list[tuple[float, int]] = []
    elif preset in PRESETS_MTBF_HOURS:
        events = FailureSchedule.preset(preset, seed=a.seed).events(n, a.horizon_h)
    else:
        raise TrainguardError(f"unknown failure preset {preset!r} (choose from none, {', '.join(PRESETS_MTBF_HOURS)})")
    intervals, absorbed = _down_intervals(events, n, recovery)
    out: dict = {"preset": preset, "failures": len(events), "modelled": True}
    for method in ("mecefo", "bamboo", "oobleck"):
        base = model(method, frozenset())
        steps, degraded_s = _elastic_tokens(method, model, intervals, horizon, a)
        no_fail, fail = global_tokens / base, steps * global_tokens / horizon
        out[method] = {"tokens_per_s_no_failure": no_fail, "tokens_per_s_failures": fail,
                       "throughput_drop": 1.0 - fail / no_fail, "failures_applied": len(intervals),
                       "failures_absorbed": absorbed, "time_with_a_worker_out": degraded_s / horizon,
                       "step_s_no_failure": base}
    mtbf_s = PRESETS_MTBF_HOURS.get(preset, math.inf) * 3600.0
    period = checkpoint_period(a.checkpoint_s, mtbf_s, a.restart_s) if preset != "none" else math.inf
    base = costs.normal + a.comm_s
    useful_fraction = period / (period + a.checkpoint_s) if math.isfinite(period) else 1.0
    no_fail = global_tokens / base * useful_fraction
    compute_s, hits = _checkpoint_restart_compute([t * 3600.0 for t, _ in events], horizon, period, a)
    fail = compute_s / base * global_tokens / horizon
    out["checkpoint_restart"] = {"tokens_per_s_no_failure": no_fail, "tokens_per_s_failures": fail,
                                 "throughput_drop": 1.0 - fail / no_fail, "failures_applied": hits,
                                 "checkpoint_period_s": period, "step_s_no_failure": base}
    out["extrapolated"] = sorted(model.extrapolated)
    out["assumptions"] = asdict(a)
    return out


__all__ = ["CLUSTER_METHODS", "ClusterAssumptions", "StepCosts", "checkpoint_period", "cluster_throughput"]
