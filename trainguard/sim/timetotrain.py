"""Time-to-train simulation of SPARe+CKPT, Rep+CKPT and CKPT-only (SPARe paper, Sec. 5, App. E).

Relies on numpy, the real ReCtlr and :mod:`trainguard.sim.checkpoint_period`. The loop is a
discrete-event simulation: it jumps from event to event (step compute, all-reduce, failure detection,
controller + shrink, patch compute, checkpoint save, global restart); the clock is a pluggable backend so
the very same loop runs on SimGrid (:mod:`trainguard.sim.simgrid_model`).

Failure model. Every data-parallel group draws a Weibull time-to-failure (shape ``k``) when the job
(re)starts; a failed group stays down until the next global restart. The instantaneous failure rate is
therefore proportional to the number of active groups, and with ``k < 1`` failures come fastest right
after a (re)start (infant mortality; Schroeder & Gibson 2010 measured k = 0.7-0.8). The Weibull scale is
set so a group's *mean* time to failure is ``G * MTBF_gpu`` / ... i.e. ``MTBF_gpu / G`` with ``G`` GPUs per
group; the mean time between group failures of the whole cluster is ``m = MTBF_gpu / total_gpus``.

Scheme rules (failures are detected at the all-reduce; a failed all-reduce costs ``failed_allreduce_frac``
of one):

* CKPT-only: any failure -> global restart ``R`` and roll back to the last checkpoint.
* Rep+CKPT: ``N // r`` replica sets, each group computes ``N/b`` shards per step. Failure -> shrink; the
  step completes from the replicas. A set with all groups down -> global restart.
* SPARe+CKPT: each step computes the all-reduce stack ``s``. Failure -> controller + shrink; wipe-out ->
  global restart; otherwise the controller's patch stacks are computed and the all-reduce retried.

Checkpoints: period ``T*`` of eq. 1 from the theory system MTBF ``E[K](r) * m`` (``m`` for CKPT-only);
a save costs ``d``. Under SPARe/Rep every group holds the full model, so a save survives group failures;
under CKPT-only a failure during a save loses that save. Every event duration gets a multiplicative jitter
``N(1, jitter^2)`` (floored at 0.01).

Availability = time of the steps that end up committed (each from its start to its successful
all-reduce, so patch compute, controller and shrink of masked failures count as operational, as the
paper's ``T0 * s_bar`` useful time does) / wall-clock. Restarts, checkpoint saves and rolled-back steps
are downtime.

Default parameters (``ClusterParams``) and where they come from are in the dataclass comments; the CLI
prints them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from trainguard.errors import TrainguardError
from trainguard.failover.spare.controller import ReCtlr
from trainguard.failover.spare.placement import check_supported, make_placement
from trainguard.sim import theory
from trainguard.sim.checkpoint_period import optimal_period

DAY = 86400.0


@dataclass
class ClusterParams:
    """H100 cluster of the SPARe paper's Sec. 5.1 (numbers lost in extraction are re-derived; sources)."""

    # ~600k H100: the paper's "5-minute MTBF" extrapolation; 600k divides into N = 200/600/1000 groups of
    # 3000/1000/600 GPUs ("hundreds to a few thousands" per group, Sec. 2.1).
    total_gpus: int = 600_000
    # Llama 3 (Dubey et al. 2024, Sec. 3.3.4): 419 unexpected interruptions in 54 days on 16,384 GPUs ->
    # 54*24*16384/419 = 50,680 GPU-hours per failure; MTBF ~ 1/GPU count (Kokolis et al. 2025) gives
    # 5.07 min at 600k GPUs.
    gpu_mtbf_hours: float = 54 * 24 * 16384 / 419
    # Schroeder & Gibson 2010: Weibull shape 0.7-0.8 for time between failures.
    weibull_shape: float = 0.7
    # Global restart: "harsh restart-dominant regime" of the paper; re-initialising collectives scales
    # ~linearly with GPU count (Si et al. 2025; Jiang et al. 2024); 30 min at 600k GPUs.
    restart_s: float = 1800.0
    # Checkpoint save (async / in-memory, Gemini; Wang et al. 2023): 1 min.
    checkpoint_s: float = 60.0
    # One stack (one data shard per group) of compute: 10 s, 8640 steps -> 1 day of single-stack compute
    # (the paper's base time-to-train scale; all schemes share it). The step time sets how many failures
    # land in one step, hence how often SPARe pays a patch stack. Llama 3 405B (Dubey et al. 2024, Sec. 3.3):
    # 16M-token batches on 16,384 H100 at ~400 TFLOP/s each -> 6 * 405e9 * 16e6 / (16384 * 400e12) = 5.9 s
    # per step; 10 s is that order. (An earlier default of 60 s gave 2.27 stacks per step at N = 1000 where
    # the paper's Table 2 implies ~2.04, and 36-42% gains; see docs/spare.md.)
    stack_compute_s: float = 10.0
    base_steps: int = 8640
    # Ring all-reduce across the N groups, linear in N (paper Sec. 5.1): 2.2 ms per group, i.e. 0.44 s at
    # N=200 and 2.2 s at N=1000. Calibrated so the stack-count ratios of the paper's Table 2 hold
    # (all-reduce = 0.22 x stack compute at N = 1000).
    allreduce_per_group_s: float = 0.0022
    failed_allreduce_frac: float = 0.5   # paper: a failed all-reduce takes half a successful one
    shrink_s: float = 1.0                # communicator shrink (Bland et al. 2015: tens of ms; conservative)
    controller_s: float = 1.0            # ReCtlr, paper App. D "conservatively 1 s"
    jitter: float = 0.05                 # relative sd of the normal jitter on every event
    max_days: float = 60.0               # stop a run that has not finished by then (CKPT-only)

    def group_size(self, n: int) -> float:
        return self.total_gpus / n

    def cluster_failure_mtbf_s(self) -> float:
        """``m``: mean time between group failures of the whole cluster (all groups alive)."""
        return self.gpu_mtbf_hours * 3600.0 / self.total_gpus

    def allreduce_s(self, n: int) -> float:
        return self.allreduce_per_group_s * n

    def base_time_s(self, n: int) -> float:
        """Failure-free, single-stack time-to-train ``T0``."""
        return self.base_steps * (self.stack_compute_s + self.allreduce_s(n))

    def as_dict(self) -> dict:
        d = asdict(self)
        d["cluster_failure_mtbf_min"] = self.cluster_failure_mtbf_s() / 60.0
        return d


SCHEMES = ("spare", "replication", "checkpoint")


@dataclass
class SimResult:
    scheme: str
    groups: int
    redundancy: int
    seed: int
    finished: bool
    progress: float
    time_to_train_days: float
    normalized_time_to_train: float
    availability: float
    mean_stacks_per_step: float
    global_restarts: int
    masked_failures: int
    failures: int
    checkpoints: int
    checkpoint_period_s: float
    steps_executed: int
    theory: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


class FastClock:
    """Backend of the fast loop: durations add up."""

    def __init__(self):
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def compute(self, seconds: float, n_alive: int) -> None:
        self.t += seconds

    def allreduce(self, seconds: float, n_alive: int) -> None:
        self.t += seconds

    def sleep(self, seconds: float, what: str = "") -> None:
        self.t += seconds


def scheme_mean_failures(scheme: str, n: int, r: int) -> float:
    if scheme == "spare":
        return theory.mean_failures_poisson(n, r) if r > 1 else 1.0
    if scheme == "replication":
        return theory.mean_failures_replication(n, r)
    return 1.0


def checkpoint_period_for(scheme: str, n: int, r: int, p: ClusterParams) -> float:
    M = scheme_mean_failures(scheme, n, r) * p.cluster_failure_mtbf_s()
    return optimal_period(p.checkpoint_s, M, p.restart_s)


def simulate(scheme: str, n: int, r: int = 1, seed: int = 0, params: ClusterParams | None = None,
             clock=None, max_steps: int | None = None) -> SimResult:
    """Simulate one training run to completion (or ``params.max_days``)."""
    p = params or ClusterParams()
    if scheme not in SCHEMES:
        raise TrainguardError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if scheme == "checkpoint":
        r = 1
    if scheme == "spare":
        check_supported(n, r)
    elif scheme == "replication" and not 1 <= r <= n:
        raise TrainguardError(f"replication degree must be in 1..N, got {r}")
    if p.weibull_shape <= 0 or p.jitter < 0:
        raise TrainguardError("weibull_shape must be > 0 and jitter >= 0")
    clock = clock or FastClock()
    rng = np.random.default_rng(seed)
    steps = max_steps or p.base_steps
    tc, ta = p.stack_compute_s, p.allreduce_s(n)
    group_mean = p.cluster_failure_mtbf_s() * n  # mean time to failure of one group
    scale = group_mean / math.gamma(1.0 + 1.0 / p.weibull_shape)
    period = checkpoint_period_for(scheme, n, r, p)
    t_cap = p.max_days * DAY
    sig = p.jitter

    def jit() -> float:
        return max(0.01, 1.0 + sig * rng.standard_normal()) if sig > 0 else 1.0

    ctl = ReCtlr(make_placement(n, r)) if scheme == "spare" and r > 1 else None
    if scheme == "replication":
        sizes = theory.replica_set_sizes(n, r)
        set_of = np.repeat(np.arange(len(sizes)), sizes)
        rep_stacks = theory.replication_stacks(n, r)
    # state
    fail_t = np.empty(n)
    order: list[int] = []
    ptr = 0
    dead_in_set = None
    n_alive = n

    def start_cluster():
        nonlocal fail_t, order, ptr, dead_in_set, n_alive
        fail_t = clock.now() + scale * rng.weibull(p.weibull_shape, n)
        order = np.argsort(fail_t, kind="stable").tolist()
        ptr = 0
        n_alive = n
        if ctl is not None:
            ctl.reset()
        if scheme == "replication":
            dead_in_set = np.zeros(len(sizes), dtype=np.int64)

    def next_fail() -> float:
        return fail_t[order[ptr]] if ptr < n else math.inf

    def pop_failures(until: float) -> list[int]:
        nonlocal ptr
        out = []
        while ptr < n and fail_t[order[ptr]] <= until:
            out.append(order[ptr])
            ptr += 1
        return out

    start_cluster()
    done = committed = 0
    useful = pending = 0.0
    since_ckpt = 0.0
    restarts = masked = failures = ckpts = executed = 0
    stack_sum = 0.0

    def global_restart():
        nonlocal done, pending, since_ckpt, restarts
        clock.sleep(p.restart_s * jit(), "restart")
        restarts += 1
        done = committed
        pending = 0.0
        since_ckpt = 0.0
        start_cluster()

    while done < steps and clock.now() < t_cap:
        t0 = clock.now()
        if scheme == "spare":
            stacks = ctl.stack if ctl is not None else 1
        elif scheme == "replication":
            stacks = rep_stacks
        else:
            stacks = 1
        c = stacks * tc * jit()
        clock.compute(c, n_alive)
        executed += 1
        step_stacks = float(stacks)
        restarted = False
        while True:  # all-reduce attempts of this step
            a = ta * jit()
            if next_fail() < clock.now() + a:
                # the all-reduce fails; failures up to the detection instant are seen together
                clock.allreduce(p.failed_allreduce_frac * a, n_alive)
                if clock.now() < next_fail():
                    clock.sleep(next_fail() - clock.now(), "wait-detect")
                failed = pop_failures(clock.now())
                failures += len(failed)
                n_alive -= len(failed)
                if scheme == "checkpoint" or (scheme == "spare" and ctl is None):
                    global_restart()
                    restarted = True
                    break
                if scheme == "replication":
                    np.add.at(dead_in_set, set_of[failed], 1)
                    clock.sleep(p.shrink_s * jit(), "shrink")
                    if (dead_in_set[set_of[failed]] >= np.asarray(sizes)[set_of[failed]]).any():
                        global_restart()
                        restarted = True
                        break
                    masked += len(failed)
                    continue
                clock.sleep((p.controller_s + p.shrink_s) * jit(), "controller+shrink")
                res = ctl.on_failure(failed, with_orders=False)
                if res.wipeout:
                    global_restart()
                    restarted = True
                    break
                masked += len(failed)
                if res.patch_stacks:
                    clock.compute(res.patch_stacks * tc * jit(), n_alive)
                    step_stacks += res.patch_stacks
                continue
            clock.allreduce(a, n_alive)
            break
        stack_sum += step_stacks
        if restarted:
            continue
        done += 1
        pending += clock.now() - t0  # the committed step incl. in-step masking (patch, controller, shrink)
        since_ckpt += clock.now() - t0
        if done < steps and since_ckpt >= period - p.checkpoint_s:
            clock.sleep(p.checkpoint_s * jit(), "checkpoint")
            if scheme == "checkpoint" and next_fail() < clock.now():
                failures += len(pop_failures(clock.now()))
                global_restart()
                continue
            ckpts += 1
            committed = done
            useful += pending
            pending = 0.0
            since_ckpt = 0.0
    finished = done >= steps
    useful += pending
    total = clock.now()
    T0 = p.base_time_s(n)
    th = theory.scheme_theory(scheme, n, r, p.cluster_failure_mtbf_s(), p.checkpoint_s, p.restart_s, tc, ta)
    return SimResult(
        scheme=scheme, groups=n, redundancy=r, seed=seed, finished=finished, progress=done / steps,
        time_to_train_days=total / DAY if finished else math.inf,
        normalized_time_to_train=total / (T0 * steps / p.base_steps) if finished else math.inf,
        availability=useful / total if total > 0 else 0.0,
        mean_stacks_per_step=stack_sum / max(executed, 1), global_restarts=restarts, masked_failures=masked,
        failures=failures, checkpoints=ckpts, checkpoint_period_s=period, steps_executed=executed, theory=th,
    )


def simulate_many(scheme: str, n: int, r: int, seeds: list[int], params: ClusterParams | None = None) -> dict:
    """Mean over event trails (the paper used three)."""
    rs = [simulate(scheme, n, r, s, params) for s in seeds]
    fin = [x for x in rs if x.finished]
    mean = (lambda key: float(np.mean([getattr(x, key) for x in fin])) if fin else math.inf)
    return {
        "scheme": scheme, "groups": n, "redundancy": r, "seeds": list(seeds), "finished": len(fin) == len(rs),
        "time_to_train_days": mean("time_to_train_days"), "normalized_time_to_train": mean("normalized_time_to_train"),
        "availability": float(np.mean([x.availability for x in rs])),
        "mean_stacks_per_step": float(np.mean([x.mean_stacks_per_step for x in rs])),
        "global_restarts": float(np.mean([x.global_restarts for x in rs])),
        "progress": float(np.mean([x.progress for x in rs])),
        "checkpoint_period_s": rs[0].checkpoint_period_s, "theory": rs[0].theory,
    }


def compare(n: int, seeds: list[int], params: ClusterParams | None = None, r_max: int | None = None,
            rep_r_max: int = 8, progress_cb=None) -> dict:
    """SPARe+CKPT and Rep+CKPT over ``r``, CKPT-only once; best ``r`` of each and the SPARe gain."""
    from trainguard.failover.spare.placement import max_supported_redundancy

    p = params or ClusterParams()
    r_max = r_max or max_supported_redundancy(n)
    rows = []
    jobs = [("checkpoint", 1)] + [("replication", r) for r in range(2, rep_r_max + 1)] + \
           [("spare", r) for r in range(2, r_max + 1)]
    for scheme, r in jobs:
        rows.append(simulate_many(scheme, n, r, seeds, p))
        if progress_cb:
            progress_cb(scheme, r)

    def best(scheme):
        cand = [x for x in rows if x["scheme"] == scheme and x["finished"]]
        return min(cand, key=lambda x: x["time_to_train_days"]) if cand else None

    bs, br = best("spare"), best("replication")
    gain = (1.0 - bs["time_to_train_days"] / br["time_to_train_days"]) if bs and br else math.nan
    return {"groups": n, "seeds": list(seeds), "rows": rows, "best_spare": bs, "best_replication": br,
            "checkpoint_only": rows[0], "gain_vs_replication": gain}
