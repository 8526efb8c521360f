"""Time-to-train simulation of SPARe+CKPT, Rep+CKPT and CKPT-only (SPARe paper, Sec. 5, App. E).

Relies on numpy, the real ReCtlr, :mod:`trainguard.sim.failures` (failure trails),
:mod:`trainguard.sim.collective` (alpha-beta all-reduce) and :mod:`trainguard.sim.checkpoint_period`.
The loop is a discrete-event simulation: it jumps from event to event (step compute, all-reduce, failure
detection, controller + shrink, patch compute, checkpoint save, global restart). The clock is a pluggable
backend: :class:`FastClock` adds durations (and lets the loop advance a whole failure-free stretch of steps
at once with numpy); :mod:`trainguard.sim.simgrid_model` realises the all-reduce and checkpoint traffic on a
SimGrid platform instead.

Failures come from a :class:`~trainguard.sim.failures.FailureTrail` built from the seed alone, so every
scheme and redundancy run with one seed meets the same failures (a paired comparison). A failed group stays
down until the next global restart; a restart waits for repairs (``repair_s``) unless a hot spare is healthy.

Scheme rules (failures are detected at the all-reduce; a failed all-reduce costs ``failed_allreduce_frac``
of one, and lasts at least until the failure):

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
paper's ``T0 * s_bar`` useful time does) / wall-clock. Restarts, checkpoint saves, waiting for repairs and
rolled-back steps are downtime.

Default parameters (``ClusterParams``) and where they come from are in the dataclass comments; the CLI
prints them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from trainguard.errors import TrainguardError
from trainguard.failover.spare.controller import ReCtlr
from trainguard.failover.spare.placement import (
    check_supported,
    contiguous_layout,
    domain_layout,
    make_placement,
    replication_layout,
    supported_redundancies,
)
from trainguard.sim import theory
from trainguard.sim.checkpoint_period import optimal_period
from trainguard.sim.collective import NetworkParams, allreduce_time
from trainguard.sim.failures import FailureSpec, FailureTrail, Trace, load_trace

DAY = 86400.0
LLAMA3_GPU_MTBF_HOURS = 54 * 24 * 16384 / 419


@dataclass
class ClusterParams:
    """H100 cluster of the SPARe paper's Sec. 5.1 (numbers lost in extraction are re-derived; sources)."""

    # ~600k H100: the paper's "5-minute MTBF" extrapolation; 600k divides into N = 200/600/1000 groups of
    # 3000/1000/600 GPUs ("hundreds to a few thousands" per group, Sec. 2.1). GPUs that do not fill a whole
    # group are reported as unused.
    total_gpus: int = 600_000
    # Llama 3 (Dubey et al. 2024, Sec. 3.3.4): 419 unexpected interruptions in 54 days on 16,384 GPUs ->
    # 54*24*16384/419 = 50,680 GPU-hours per failure; MTBF ~ 1/GPU count (Kokolis et al. 2025) gives
    # 5.07 min at 600k GPUs.
    gpu_mtbf_hours: float = LLAMA3_GPU_MTBF_HOURS
    # failure model (trainguard.sim.failures): weibull | exponential | trace
    failure_model: str = "weibull"
    # Schroeder & Gibson 2010: Weibull shape 0.7-0.8 for time between failures.
    weibull_shape: float = 0.7
    # restart: every GPU's Weibull clock restarts at each global restart (infant mortality after every
    # restart; the paper does not say); failure: a GPU's clock renews only at its own failure.
    renewal: str = "restart"
    repair_s: float = 0.0            # a failed group's GPUs are usable again after this
    hot_spares: int = 0              # spare groups a restart may use instead of groups still in repair
    gpus_per_domain: int = 0         # failure domain (rack, leaf switch) size in GPUs; 0 = none
    domain_mtbf_hours: float = 0.0   # mean time between failures of one domain; 0 = no domain failures
    domain_aware: bool = True        # place a type's copies (a replica set) in different domains
    trace_path: str | None = None    # CSV of failure times for failure_model = trace
    # Global restart: "harsh restart-dominant regime" of the paper; re-initialising collectives scales
    # ~linearly with GPU count (Si et al. 2025; Jiang et al. 2024); 30 min at 600k GPUs.
    restart_s: float = 1800.0
    # Checkpoint save (async / in-memory, Gemini; Wang et al. 2023): 1 min.
    checkpoint_s: float = 60.0
    # One stack (one data shard per group) of compute: 10 s, 8640 steps -> 1 day of single-stack compute
    # (the paper's base time-to-train scale; all schemes share it). The step time sets how many failures
    # land in one step, hence how often SPARe pays a patch stack. Llama 3 405B (Dubey et al. 2024, Sec. 3.3):
    # 16M-token batches on 16,384 H100 at ~400 TFLOP/s each -> 6 * 405e9 * 16e6 / (16384 * 400e12) = 5.9 s
    # per step; 10 s is that order.
    stack_compute_s: float = 10.0
    base_steps: int = 8640
    # Gradient all-reduce (trainguard.sim.collective): the paper's model of 20 TB in FP16 (10T parameters,
    # 2 bytes per gradient element), each group's GPUs holding 1/G of it; ring all-reduce; 5 us per message;
    # 200 Gb/s of goodput per GPU (the paper's figure was lost; it calls its own "conservative"). At 600k GPUs
    # this gives 0.53 / 1.60 / 2.67 s for N = 200 / 600 / 1000: linear in N as the paper says, because the
    # per-GPU share grows with N.
    model_params: float = 10e12
    grad_bytes_per_param: float = 2.0
    allreduce_algorithm: str = "ring"
    hop_latency_s: float = 5e-6
    gpu_bandwidth_gbps: float = 200.0
    allreduce_s: float | None = None     # fixed all-reduce time (replaces the alpha-beta model)
    failed_allreduce_frac: float = 0.5   # paper: a failed all-reduce takes half a successful one
    shrink_s: float = 1.0                # communicator shrink (Bland et al. 2015: tens of ms; conservative)
    controller_s: float = 1.0            # ReCtlr, paper App. D "conservatively 1 s"
    jitter: float = 0.05                 # relative sd of the normal jitter on every event
    max_days: float = 60.0               # stop a run that has not finished by then (CKPT-only)

    # -------------------------------------------------------------- derived
    def validate(self) -> None:
        bad = []
        for name in ("gpu_mtbf_hours", "checkpoint_s", "stack_compute_s", "max_days", "model_params",
                     "grad_bytes_per_param"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                bad.append(f"{name} must be > 0 (got {v})")
        for name in ("restart_s", "shrink_s", "controller_s", "jitter", "repair_s", "failed_allreduce_frac"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                bad.append(f"{name} must be >= 0 (got {v})")
        if self.total_gpus < 1 or self.base_steps < 1 or self.hot_spares < 0:
            bad.append("total_gpus and base_steps must be >= 1, hot_spares >= 0")
        if not self.failed_allreduce_frac <= 1:  # (>= 0 above): a share of one successful all-reduce
            bad.append(f"failed_allreduce_frac must be in [0, 1] (got {self.failed_allreduce_frac})")
        if self.allreduce_s is not None and not (self.allreduce_s >= 0 and math.isfinite(self.allreduce_s)):
            bad.append(f"allreduce_s must be >= 0 (got {self.allreduce_s})")
        if bad:
            raise TrainguardError("; ".join(bad))
        self.failure_spec().validate()
        self.network().validate()

    def gpus_per_group(self, n: int) -> int:
        g = self.total_gpus // n
        if g < 1:
            raise TrainguardError(f"{self.total_gpus} GPUs cannot form {n} groups")
        return g

    def unused_gpus(self, n: int) -> int:
        return self.total_gpus - n * self.gpus_per_group(n)

    def failure_spec(self) -> FailureSpec:
        return FailureSpec(model=self.failure_model, weibull_shape=self.weibull_shape, renewal=self.renewal,
                           gpu_mtbf_hours=self.gpu_mtbf_hours, repair_s=self.repair_s,
                           gpus_per_domain=self.gpus_per_domain, domain_mtbf_hours=self.domain_mtbf_hours,
                           trace_path=self.trace_path)

    def network(self) -> NetworkParams:
        return NetworkParams(self.allreduce_algorithm, self.hop_latency_s, self.gpu_bandwidth_gbps)

    def cluster_failure_mtbf_s(self, n: int | None = None, trace: Trace | None = None) -> float:
        """``m``: mean time between group failures of the whole cluster (all ``N`` groups alive)."""
        gpus = self.total_gpus if n is None else n * self.gpus_per_group(n)
        if self.failure_model == "trace":
            tr = trace or load_trace(self.trace_path)
            hits = tr.times_s.size  # without ids every event hits a group
            if tr.gpu is not None:
                hits = int((tr.gpu < gpus).sum())
            elif tr.group is not None and n is not None:
                hits = int((tr.group < n).sum())
            rate = hits / tr.period_s
        else:
            rate = gpus / (self.gpu_mtbf_hours * 3600.0)
        if self.gpus_per_domain > 0 and self.domain_mtbf_hours > 0:
            rate += (gpus / self.gpus_per_domain) / (self.domain_mtbf_hours * 3600.0)
        return 1.0 / rate if rate > 0 else math.inf

    def allreduce_time_s(self, n_alive: int, n: int) -> float:
        """All-reduce over ``n_alive`` of the ``N = n`` groups (fixed ``allreduce_s`` or alpha-beta)."""
        if self.allreduce_s is not None:
            return float(self.allreduce_s)
        per_gpu = self.model_params * self.grad_bytes_per_param / self.gpus_per_group(n)
        return allreduce_time(n_alive, per_gpu, self.network())

    def base_time_s(self, n: int) -> float:
        """Failure-free, single-stack time-to-train ``T0``."""
        return self.base_steps * (self.stack_compute_s + self.allreduce_time_s(n, n))

    def as_dict(self) -> dict:
        d = asdict(self)
        d["cluster_failure_mtbf_min"] = self.cluster_failure_mtbf_s() / 60.0
        return d

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


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
    allreduce_s: float
    repair_wait_s: float
    unused_gpus: int
    theory: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


class FastClock:
    """Backend of the fast loop: durations add up. ``batchable``: the loop may advance many steps at once."""

    batchable = True

    def __init__(self):
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def compute(self, seconds: float, units=None) -> None:
        self.t += seconds

    def allreduce(self, seconds: float, factor: float, deadline: float, failed_frac: float, units=None) -> bool:
        """All-reduce of nominal ``seconds`` (already jittered by ``factor``); a failure at ``deadline``
        before it ends makes it fail: the clock then stands at ``max(start + failed_frac * seconds, deadline)``."""
        if deadline < self.t + seconds:
            self.t += failed_frac * seconds
            if self.t < deadline:
                self.t = deadline
            return False
        self.t += seconds
        return True

    def checkpoint(self, seconds: float, factor: float = 1.0, units=None) -> None:
        self.t += seconds

    def sleep(self, seconds: float, what: str = "") -> None:
        self.t += seconds


class _Jitter:
    """Multiplicative jitter factors from one stream, buffered so a stretch of steps can be peeked."""

    def __init__(self, sigma: float, seed: int):
        self.sigma = sigma
        self.rng = np.random.default_rng([seed, 2])
        self.buf = np.empty(0)
        self.i = 0

    def _ensure(self, k: int) -> None:
        if self.i + k > self.buf.size:
            new = np.maximum(0.01, 1.0 + self.sigma * self.rng.standard_normal(max(k, 4096)))
            self.buf = np.concatenate([self.buf[self.i:], new])
            self.i = 0

    def take(self) -> float:
        if self.sigma <= 0:
            return 1.0
        self._ensure(1)
        v = float(self.buf[self.i])
        self.i += 1
        return v

    def peek(self, k: int) -> np.ndarray:
        if self.sigma <= 0:
            return np.ones(k)
        self._ensure(k)
        return self.buf[self.i:self.i + k]

    def consume(self, k: int) -> None:
        if self.sigma > 0:
            self.i += k


def scheme_mean_failures(scheme: str, n: int, r: int) -> float:
    if scheme == "spare":
        return theory.mean_failures_poisson(n, r) if r > 1 else 1.0
    if scheme == "replication":
        return theory.mean_failures_replication(n, r)
    return 1.0


def checkpoint_period_for(scheme: str, n: int, r: int, p: ClusterParams, trace: Trace | None = None) -> float:
    M = scheme_mean_failures(scheme, n, r) * p.cluster_failure_mtbf_s(n, trace)
    return optimal_period(p.checkpoint_s, M, p.restart_s)


def layout_for(scheme: str, n: int, r: int, p: ClusterParams):
    """Logical group -> physical slot: contiguous, or spread over failure domains (``domain_aware``, when
    domains fail: ``gpus_per_domain`` and ``domain_mtbf_hours`` set)."""
    G = p.gpus_per_group(n)
    if p.gpus_per_domain > 0 and p.domain_mtbf_hours > 0 and p.gpus_per_domain >= G:
        m = p.gpus_per_domain // G
        if p.domain_aware and r > 1 and m > 1:
            if scheme == "spare":
                return domain_layout(n, r, m)
            if scheme == "replication":
                return replication_layout(n, r, m)
        return contiguous_layout(n, m)
    return contiguous_layout(n, 1)


def simulate(scheme: str, n: int, r: int = 1, seed: int = 0, params: ClusterParams | None = None,
             clock=None, max_steps: int | None = None, batch: bool = True, trace: Trace | None = None) -> SimResult:
    """Simulate one training run to completion (or ``params.max_days``) on the failure trail of ``seed``.

    ``batch=True`` (fast clock only) advances each failure-free stretch of steps with numpy; it takes the
    same jitter draws in the same order as the step-by-step loop, so both give the same result."""
    p = params or ClusterParams()
    p.validate()
    if scheme not in SCHEMES:
        raise TrainguardError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if scheme == "checkpoint":
        r = 1
    if scheme == "spare":
        check_supported(n, r)
    elif scheme == "replication" and not 1 <= r <= n:
        raise TrainguardError(f"replication degree must be in 1..N, got {r}")
    if p.failure_model == "trace" and trace is None:
        trace = load_trace(p.trace_path)
    clock = clock or FastClock()
    batch = batch and getattr(clock, "batchable", False)
    G = p.gpus_per_group(n)
    S = int(p.hot_spares)
    U = n + S
    layout = layout_for(scheme, n, r, p)
    unit_of = layout.slot_of.astype(np.int64).copy()        # logical group -> physical unit
    group_of = np.full(U, -1, dtype=np.int64)
    group_of[unit_of] = np.arange(n)
    trail = FailureTrail(p.failure_spec(), U, G, seed, trace)
    jit = _Jitter(p.jitter, seed)
    steps = max_steps or p.base_steps
    tc = p.stack_compute_s
    ta_cache: dict[int, float] = {}

    def ta(k: int) -> float:
        if k not in ta_cache:
            ta_cache[k] = p.allreduce_time_s(k, n)
        return ta_cache[k]

    period = checkpoint_period_for(scheme, n, r, p, trace)
    t_cap = p.max_days * DAY
    d = p.checkpoint_s
    frac = p.failed_allreduce_frac

    ctl = ReCtlr(make_placement(n, r)) if scheme == "spare" and r > 1 else None
    if scheme == "replication":
        sizes = np.asarray(theory.replica_set_sizes(n, r))
        set_of = np.repeat(np.arange(len(sizes)), sizes)
        rep_stacks = theory.replication_stacks(n, r)
        dead_in_set = np.zeros(len(sizes), dtype=np.int64)
    alive = np.ones(n, dtype=bool)
    broken_until = np.zeros(U)
    st = {"n_alive": n, "done": 0, "committed": 0, "useful": 0.0, "pending": 0.0, "since": 0.0,
          "restarts": 0, "masked": 0, "failures": 0, "ckpts": 0, "executed": 0, "stack_sum": 0.0, "wait": 0.0}

    def in_use() -> np.ndarray:
        m = np.zeros(U, dtype=bool)
        m[unit_of] = True
        return m

    def relevant(units: np.ndarray) -> bool:
        g = group_of[units]
        g = g[g >= 0]
        return bool(g.size) and bool(alive[g].any())

    def next_fail() -> float:
        """Time of the next failure that hits a running group. Past events on idle or dead units only mark
        repairs and are consumed; future ones are looked at without consuming them (a restart may bring
        their group back before they happen). Beyond the run's time cap nothing matters."""
        now = clock.now()
        while True:
            t, units = trail.peek_event()
            if t > now or relevant(units):
                break
            trail.pop()
            np.maximum.at(broken_until, units, t + p.repair_s)
        return trail.next_matching(relevant, t_cap)

    def pop_failures(until: float) -> list[int]:
        out: list[int] = []
        while trail.peek() <= until:
            t, units = trail.pop()
            np.maximum.at(broken_until, units, t + p.repair_s)
            for g in group_of[units].tolist():
                if g >= 0 and alive[g]:
                    alive[g] = False
                    out.append(g)
        return out

    def drain(until: float) -> None:
        while trail.peek() <= until:
            t, units = trail.pop()
            np.maximum.at(broken_until, units, t + p.repair_s)

    def start_epoch() -> None:
        alive[:] = True
        st["n_alive"] = n
        if ctl is not None:
            ctl.reset()
        if scheme == "replication":
            dead_in_set[:] = 0
        trail.start_epoch(clock.now(), in_use())

    def global_restart() -> None:
        alive[:] = False
        trail.job_down()
        clock.sleep(p.restart_s * jit.take(), "restart")
        st["restarts"] += 1
        st["done"] = st["committed"]
        st["pending"] = 0.0
        st["since"] = 0.0
        for _ in range(10_000):  # a restart needs N healthy units: wait for repairs unless spares cover
            drain(clock.now())
            now = clock.now()
            sick = np.flatnonzero(broken_until[unit_of] > now)
            if sick.size == 0:
                break
            idle = np.flatnonzero(group_of < 0)
            healthy_idle = idle[broken_until[idle] <= now]
            for k, u in zip(sick.tolist(), healthy_idle.tolist()):  # swap in healthy spares
                old = unit_of[k]
                group_of[old], group_of[u], unit_of[k] = -1, k, u
            sick = np.flatnonzero(broken_until[unit_of] > now)
            if sick.size == 0:
                break
            cand = np.sort(np.concatenate([broken_until[unit_of[sick]], broken_until[group_of < 0]]))
            wait = float(cand[sick.size - 1]) - now
            clock.sleep(wait, "wait-repair")
            st["wait"] += wait
        start_epoch()

    def checkpoint_if_due() -> bool:
        """After a committed step: save when the period is due. Returns False if a restart happened."""
        if not (st["done"] < steps and st["since"] >= period - d):
            return True
        f_d = jit.take()
        clock.checkpoint(d * f_d, f_d)
        if scheme == "checkpoint" and next_fail() < clock.now():
            st["failures"] += len(pop_failures(clock.now()))
            global_restart()
            return False
        st["ckpts"] += 1
        st["committed"] = st["done"]
        st["useful"] += st["pending"]
        st["pending"] = 0.0
        st["since"] = 0.0
        return True

    def stacks_now() -> float:
        if scheme == "spare":
            return float(ctl.stack) if ctl is not None else 1.0
        if scheme == "replication":
            return float(rep_stacks)
        return 1.0

    def failure_free_stretch() -> int:
        """Advance every step that completes before the next failure (fast clock). Returns steps done."""
        nf = next_fail()
        now = clock.now()
        stacks = stacks_now()
        a_nom = ta(st["n_alive"])
        step_nom = stacks * tc + a_nom
        horizon = min(nf, t_cap) - now
        est = 4096 if not math.isfinite(horizon) else int(min(4096.0, max(0.0, horizon / step_nom * 1.3 + 2)))
        k_max = min(steps - st["done"], est)
        if k_max <= 0:
            return 0
        z = jit.peek(2 * k_max)
        vals = np.empty(2 * k_max + 1)
        vals[0] = now
        vals[1::2] = stacks * tc * z[0::2]
        vals[2::2] = a_nom * z[1::2]
        cs = np.cumsum(vals)
        ends = cs[2::2]
        starts = np.concatenate([[now], ends[:-1]])
        f = int(np.searchsorted(ends, nf, side="right"))        # steps whose all-reduce ends before the failure
        c_cap = int(np.searchsorted(starts, t_cap, side="left"))  # steps that start before the cap
        durs = ends - starts
        since = np.cumsum(np.concatenate([[st["since"]], durs]))[1:]
        due = (since >= period - d) & (st["done"] + np.arange(1, k_max + 1) < steps)
        q = int(np.argmax(due)) + 1 if due.any() else k_max
        k = min(f, c_cap, q, k_max)
        if k <= 0:
            return 0
        pend = np.cumsum(np.concatenate([[st["pending"]], durs[:k]]))
        clock.t = float(ends[k - 1])
        jit.consume(2 * k)
        st["executed"] += k
        for _ in range(k):
            st["stack_sum"] += stacks
        st["done"] += k
        st["pending"] = float(pend[k])
        st["since"] = float(since[k - 1])
        checkpoint_if_due()
        return k

    start_epoch()
    while st["done"] < steps and clock.now() < t_cap:
        if batch and failure_free_stretch() > 0:
            continue
        t0 = clock.now()
        stacks = stacks_now()
        clock.compute(stacks * tc * jit.take(), unit_of[alive])
        st["executed"] += 1
        step_stacks = stacks
        restarted = False
        while True:  # all-reduce attempts of this step
            f_a = jit.take()
            a = ta(st["n_alive"]) * f_a
            nf = next_fail()
            if clock.allreduce(a, f_a, nf, frac, unit_of[alive]):
                break
            failed = pop_failures(clock.now())
            st["failures"] += len(failed)
            st["n_alive"] -= len(failed)
            if scheme == "checkpoint" or (scheme == "spare" and ctl is None):
                global_restart()
                restarted = True
                break
            if scheme == "replication":
                np.add.at(dead_in_set, set_of[failed], 1)
                clock.sleep(p.shrink_s * jit.take(), "shrink")
                hit = set_of[failed]
                if (dead_in_set[hit] >= sizes[hit]).any():
                    global_restart()
                    restarted = True
                    break
                st["masked"] += len(failed)
                continue
            clock.sleep((p.controller_s + p.shrink_s) * jit.take(), "controller+shrink")
            res = ctl.on_failure(failed, with_orders=False)
            if res.wipeout:
                global_restart()
                restarted = True
                break
            st["masked"] += len(failed)
            if res.patch_stacks:
                clock.compute(res.patch_stacks * tc * jit.take(), unit_of[alive])
                step_stacks += res.patch_stacks
        st["stack_sum"] += step_stacks
        if restarted:
            continue
        st["done"] += 1
        st["pending"] += clock.now() - t0  # the committed step incl. in-step masking (patch, controller, shrink)
        st["since"] += clock.now() - t0
        checkpoint_if_due()
    finished = st["done"] >= steps
    useful = st["useful"] + st["pending"]
    total = clock.now()
    T0 = p.base_time_s(n)
    th = theory.scheme_theory(scheme, n, r, p.cluster_failure_mtbf_s(n, trace), p.checkpoint_s, p.restart_s, tc, ta(n))
    return SimResult(
        scheme=scheme, groups=n, redundancy=r, seed=seed, finished=finished, progress=st["done"] / steps,
        time_to_train_days=total / DAY if finished else math.inf,
        normalized_time_to_train=total / (T0 * steps / p.base_steps) if finished else math.inf,
        availability=useful / total if total > 0 else 0.0,
        mean_stacks_per_step=st["stack_sum"] / max(st["executed"], 1), global_restarts=st["restarts"],
        masked_failures=st["masked"], failures=st["failures"], checkpoints=st["ckpts"], checkpoint_period_s=period,
        steps_executed=st["executed"], allreduce_s=ta(n), repair_wait_s=st["wait"], unused_gpus=p.unused_gpus(n),
        theory=th,
    )


# ----------------------------------------------------------------------------- many trails, paired
def _one(job: tuple) -> dict:
    scheme, n, r, seed, p = job
    return simulate(scheme, n, r, seed, p).as_dict()


def run_jobs(jobs: list[tuple[str, int]], n: int, seeds: list[int], params: ClusterParams,
             workers: int = 1, progress_cb=None) -> list[list[dict]]:
    """Every ``(scheme, r)`` of ``jobs`` on the trail of every seed; ``out[j][i]`` = job ``j``, seed ``i``.
    Results do not depend on ``workers``."""
    flat = [(s, n, r, seed, params) for s, r in jobs for seed in seeds]
    if workers > 1 and len(flat) > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=workers) as ex:
            res = []
            for i, x in enumerate(ex.map(_one, flat, chunksize=1)):
                res.append(x)
                if progress_cb and (i + 1) % len(seeds) == 0:
                    progress_cb(*jobs[i // len(seeds)])
    else:
        res = []
        for i, job in enumerate(flat):
            res.append(_one(job))
            if progress_cb and (i + 1) % len(seeds) == 0:
                progress_cb(*jobs[i // len(seeds)])
    k = len(seeds)
    return [res[j * k:(j + 1) * k] for j in range(len(jobs))]


def summarize(runs: list[dict]) -> dict:
    """Mean and 95% interval over trails of one ``(scheme, r)``; per-seed times kept for pairing."""
    from trainguard.sim.stats import mean_ci

    times = [x["time_to_train_days"] for x in runs]
    ci = mean_ci(times)
    first = runs[0]
    return {
        "scheme": first["scheme"], "groups": first["groups"], "redundancy": first["redundancy"],
        "seeds": [x["seed"] for x in runs], "finished": all(x["finished"] for x in runs),
        "time_to_train_days": ci.mean, "time_to_train_days_ci": [ci.lo, ci.hi], "per_seed_days": times,
        "normalized_time_to_train": float(np.mean([x["normalized_time_to_train"] for x in runs])),
        "availability": float(np.mean([x["availability"] for x in runs])),
        "mean_stacks_per_step": float(np.mean([x["mean_stacks_per_step"] for x in runs])),
        "global_restarts": float(np.mean([x["global_restarts"] for x in runs])),
        "failures": float(np.mean([x["failures"] for x in runs])),
        "progress": float(np.mean([x["progress"] for x in runs])),
        "checkpoint_period_s": first["checkpoint_period_s"], "allreduce_s": first["allreduce_s"],
        "repair_wait_s": float(np.mean([x["repair_wait_s"] for x in runs])), "theory": first["theory"],
    }


def simulate_many(scheme: str, n: int, r: int, seeds: list[int], params: ClusterParams | None = None) -> dict:
    """Mean over event trails (the paper used three) with a 95% interval."""
    p = params or ClusterParams()
    return summarize(run_jobs([(scheme, r)], n, list(seeds), p)[0])


def spare_redundancies(n: int, p: ClusterParams, r_max: int | None = None) -> tuple[list[int], dict[int, str]]:
    """SPARe redundancies to try at ``N`` (every ruler the group count allows) and the ones skipped, with why."""
    rs = supported_redundancies(n, r_max or 28)
    skipped: dict[int, str] = {}
    if p.gpus_per_domain > 0 and p.domain_mtbf_hours > 0 and p.domain_aware:
        keep = []
        for r in rs:
            try:
                layout_for("spare", n, r, p)
                keep.append(r)
            except TrainguardError as err:
                skipped[r] = str(err)
        rs = keep
    return rs, skipped


def compare(n: int, seeds: list[int], params: ClusterParams | None = None, r_max: int | None = None,
            rep_r_max: int = 8, progress_cb=None, workers: int = 1) -> dict:
    """SPARe+CKPT and Rep+CKPT over ``r``, CKPT-only once, all on the same trails (paired); best ``r`` of
    each by the mean over trails and the paired gain of SPARe+CKPT over Rep+CKPT with its 95% interval."""
    from trainguard.sim.stats import paired_gain_ci

    p = params or ClusterParams()
    p.validate()
    spare_rs, skipped = spare_redundancies(n, p, r_max)
    jobs = [("checkpoint", 1)] + [("replication", r) for r in range(2, min(rep_r_max, n) + 1)] + \
           [("spare", r) for r in spare_rs]
    per = run_jobs(jobs, n, list(seeds), p, workers=workers, progress_cb=progress_cb)
    rows = [summarize(x) for x in per]

    def best(scheme):
        cand = [x for x in rows if x["scheme"] == scheme and x["finished"]]
        return min(cand, key=lambda x: x["time_to_train_days"]) if cand else None

    bs, br = best("spare"), best("replication")
    gain = paired_gain_ci(bs["per_seed_days"], br["per_seed_days"]) if bs and br else None
    return {"groups": n, "seeds": list(seeds), "rows": rows, "best_spare": bs, "best_replication": br,
            "checkpoint_only": rows[0], "gain_vs_replication": gain.mean if gain else math.nan,
            "gain_vs_replication_ci": [gain.lo, gain.hi] if gain else [math.nan, math.nan],
            "skipped_redundancies": skipped, "unused_gpus": p.unused_gpus(n)}
