"""``trainguard bench mecefo``: MeCeFO against Bamboo, Oobleck and checkpoint-restart, measured where it can be and
modelled where it cannot, and always saying which.

1. **Per-step costs, measured** (one process, one thread, rounds interleaved, medians): one worker's step in each
   role on the real model and data: normal (its own ``batch`` sequences), MeCeFO's neighbor (its own and an out
   worker's share, degraded) with every subset of the three techniques (the paper's ablation), Bamboo's
   redundant step and covering step, Oobleck's rebalanced step; the SVD refresh; the saved activations of one
   micro-batch per configuration; and, in fresh processes, the peak resident memory of a normal, a neighbor and a
   naive neighbor step.
2. **Cluster throughput, modelled**: :func:`~trainguard.failover.mecefo.cluster.cluster_throughput` for ``workers``
   (the paper's 32) under each preset, from those costs and a failure timeline; plus the sensitivity to the
   recovery time.
3. **Quality, run for real**: ``run_workers`` processes (gloo, torchft) train the model to a fixed token budget:
   once without failures, and once per method under the chosen preset (simulated failures per step from the
   preset, ``real_kills`` of them real ``SIGKILL`` s); validation perplexity of each, and MeCeFO's gradient
   relative error on its sampled degraded steps.

Relies on torch, torch.multiprocessing and the modules of this package.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import torch

from trainguard.errors import TrainguardError
from trainguard.failover.mecefo.approx import ActivationMeter, MeCeFO, MeCeFOConfig
from trainguard.failover.mecefo.cluster import CLUSTER_METHODS, ClusterAssumptions, StepCosts, checkpoint_period, cluster_throughput
from trainguard.failover.mecefo.runtime import FailoverRunConfig, run_failover
from trainguard.failover.mecefo.timeline import PRESETS, FailureTimeline
from trainguard.faults.schedules import PRESETS_MTBF_HOURS
from trainguard.utils.progress import TaskBar
from trainguard.utils.settings import setting

# The paper's ablation: every subset of the three techniques.
ABLATION = {
    "naive": (False, False, False),
    "skip_mha": (True, False, False),
    "recompute_ffn": (False, True, False),
    "low_rank": (False, False, True),
    "skip_mha+recompute_ffn": (True, True, False),
    "skip_mha+low_rank": (True, False, True),
    "recompute_ffn+low_rank": (False, True, True),
    "all": (True, True, True),
}


@dataclass
class MeCeFOBenchConfig:
    model: str = setting("llama-60m", help="model preset")
    model_overrides: dict = setting(default_factory=dict, help="ModelConfig fields overriding the preset")
    workers: int = setting(32, help="data-parallel workers of the modelled cluster")
    failures: str = setting("high", help="failure preset of the 'failures' figures: none, low, mid, high")
    steps: int = setting(60, help="steps of each real training run (the token budget is steps x run_workers x "
                                  "run_micro_batch x seq_len)")
    run_workers: int = setting(4, help="worker processes of the real runs")
    seq_len: int = setting(256, help="tokens per sequence (GaLore's LLaMA recipe: 256)")
    batch: int = setting(4, help="sequences of one worker's step in the cost measurement")
    cost_micro_batch: int = setting(1, help="sequences of one micro-batch in the cost measurement: a worker's step "
                                            "is batch / cost_micro_batch micro-batches (gradient accumulation), and "
                                            "an out worker's share spreads over up to that many neighbors")
    run_micro_batch: int = setting(1, help="sequences of one micro-batch in the real runs")
    run_grad_accum: int = setting(1, help="micro-batches of one worker's step in the real runs (an out worker's "
                                          "micro-batches spread over up to this many neighbors)")
    rounds: int = setting(3, help="interleaved measurement rounds (medians)")
    lr: float = setting(3e-3, help="peak learning rate of the real runs (AdamW, warmup 10%, cosine to 10%)")
    eval_batches: int = setting(16, help="validation batches of the real runs' perplexity")
    quality_hours: float = setting(4.0, help="modelled hours the real runs' steps are spread over (failures land "
                                             "on steps from the preset)")
    real_kills: int = setting(1, help="how many of the real runs' failures are real SIGKILLs (the rest simulated)")
    monitor_every: int = setting(2, help="MeCeFO's real run measures the gradient error on degraded steps that "
                                         "are multiples of this")
    quality: bool = setting(True, help="run the real training runs (false: costs and the model only)")
    quality_methods: tuple[str, ...] = setting(CLUSTER_METHODS, help="methods with a real run under the preset "
                                                                     "(the others report no perplexity under failures)")
    memory: bool = setting(True, help="measure peak resident memory per role in fresh processes")
    threads: int = setting(1, help="torch threads of the cost measurement and of each worker")
    corpus_max_bytes: int = setting(4_000_000, help="corpus bytes read")
    seed: int = setting(0, help="seed of models, data and failure events")
    mecefo: MeCeFOConfig = field(default_factory=MeCeFOConfig)
    cluster: ClusterAssumptions = field(default_factory=ClusterAssumptions)

    def validate(self) -> MeCeFOBenchConfig:
        if self.failures not in PRESETS:
            raise TrainguardError(f"--failures must be one of {', '.join(PRESETS)}, got {self.failures!r}")
        for name in ("steps", "run_workers", "seq_len", "batch", "run_micro_batch", "run_grad_accum", "rounds",
                     "eval_batches", "threads", "cost_micro_batch"):
            if getattr(self, name) < 1:
                raise TrainguardError(f"bench mecefo: {name} must be >= 1, got {getattr(self, name)}")
        if self.batch % self.cost_micro_batch:
            raise TrainguardError(f"bench mecefo: batch ({self.batch}) must be a multiple of cost_micro_batch "
                                  f"({self.cost_micro_batch})")
        if self.run_workers < 2:
            raise TrainguardError(f"bench mecefo: run_workers must be >= 2, got {self.run_workers}")
        if self.real_kills < 0 or not self.quality_hours > 0:
            raise TrainguardError("bench mecefo: real_kills must be >= 0 and quality_hours > 0")
        bad = [m for m in self.quality_methods if m not in CLUSTER_METHODS]
        if bad:
            raise TrainguardError(f"bench mecefo: unknown method(s) {', '.join(bad)} (choose from {', '.join(CLUSTER_METHODS)})")
        self.mecefo.validate()
        self.cluster = replace(self.cluster, workers=self.workers, seed=self.seed).validate()
        from trainguard.models.config import model_config

        model_config(self.model, **self.model_overrides)
        return self

    @property
    def parts(self) -> int:
        """Micro-batches of one worker's step in the cost measurement."""
        return self.batch // self.cost_micro_batch

    @property
    def token_budget(self) -> int:
        return self.steps * self.run_workers * self.run_grad_accum * self.run_micro_batch * self.seq_len


# --------------------------------------------------------------------------------------------------
# 1. Per-step costs


class _Harness:
    """One worker's steps in each role on the real model, optimizer and data (one process)."""

    def __init__(self, cfg: MeCeFOBenchConfig, shares: int = 3, max_sequences: int | None = None):
        from trainguard.data.batches import PackedBatches
        from trainguard.data.corpus import load_corpus
        from trainguard.models import build_model, lm_loss
        from trainguard.models.config import model_config
        from trainguard.train.config import TrainConfig
        from trainguard.train.optim import build_optimizer

        self.cfg = cfg
        mc = model_config(cfg.model, **{"max_seq_len": max(cfg.seq_len, 16), **cfg.model_overrides})
        self.model = build_model(mc, seed=cfg.seed)
        self.model.train()
        self.optimizer = build_optimizer(self.model, TrainConfig(lr=1e-4), fused=None)
        self.comp = MeCeFO(cfg.mecefo).attach(self.model)
        self.loss_fn = lm_loss
        n = max(shares * cfg.batch, max_sequences or 0)
        streams = load_corpus("stdlib", 0.02, cfg.corpus_max_bytes)
        self.batches = PackedBatches(streams, cfg.seq_len, n, cfg.seed)
        self.x, self.y = self.batches.batch(0)
        self.params = [p for p in self.model.parameters() if p.requires_grad]

    def micro_batches(self, i: int, count: int | None = None, sequences: int | None = None):
        """Share ``i``'s micro-batches (``cost_micro_batch`` sequences each; the first ``count`` of them), or, with
        ``sequences``, a share of that many sequences (rebalanced), as (x, y) pairs."""
        mb = self.cfg.cost_micro_batch
        if sequences is not None:
            return [(self.x[lo:min(lo + mb, sequences)], self.y[lo:min(lo + mb, sequences)])
                    for lo in range(0, sequences, mb)]
        base = i * self.cfg.batch
        parts = self.cfg.batch // mb if count is None else count
        return [(self.x[base + j * mb:base + (j + 1) * mb], self.y[base + j * mb:base + (j + 1) * mb])
                for j in range(parts)]

    def micro(self, x, y, degraded: bool, techniques: MeCeFOConfig | None = None, more: bool = False) -> None:
        if techniques is not None:
            self.comp.cfg = techniques
        with self.comp.degraded_mode(degraded, more=more):
            self.loss_fn(self.model(x), y).backward()

    def step(self, spec: list[tuple], techniques: MeCeFOConfig | None = None,
             sequences: int | None = None) -> tuple[float, float]:
        """One step: ``spec`` = [(mode, share[, micro-batches])] with mode exact | degraded | kept (a redundant
        copy kept apart), each share computed as its micro-batches (the first ``micro-batches`` of them when
        given); returns its (CPU seconds of this process, wall seconds)."""
        c0, t0 = time.process_time(), time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        kept = None
        todo = [(item[0], xy) for item in spec
                for xy in self.micro_batches(item[1], item[2] if len(item) > 2 else None, sequences)]
        last_degraded = max((j for j, (mode, _) in enumerate(todo) if mode == "degraded"), default=-1)
        for j, (mode, (x, y)) in enumerate(todo):
            if mode == "kept":  # a redundant copy: computed, then held apart from the counted gradient
                self.micro(x, y, degraded=False)
                kept = [p.grad for p in self.params]
                self.optimizer.zero_grad(set_to_none=True)
            else:
                self.micro(x, y, degraded=(mode == "degraded"), techniques=techniques, more=j < last_degraded)
        self.optimizer.step()
        out = time.process_time() - c0, time.perf_counter() - t0
        del kept
        return out

    def optimizer_step(self) -> float:
        for p in self.params:
            p.grad = torch.zeros_like(p)
        c0 = time.process_time()
        self.optimizer.step()
        return time.process_time() - c0

    def activation_peak(self, degraded: bool, techniques: MeCeFOConfig | None = None) -> int:
        """Bytes saved for backward by one micro-batch."""
        self.optimizer.zero_grad(set_to_none=True)
        x, y = self.micro_batches(0)[0]
        if techniques is not None:
            self.comp.cfg = techniques
        if degraded and not self.comp.bases:
            self.comp.refresh_bases(0)
        with self.comp.degraded_mode(degraded), ActivationMeter(self.model, list(self.comp.bases.values())) as meter:
            loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.optimizer.zero_grad(set_to_none=True)
        return meter.peak


def _cpu(fn: Callable[[], Any]) -> float:
    c0 = time.process_time()
    fn()
    return time.process_time() - c0


def _techniques(base: MeCeFOConfig, flags: tuple[bool, bool, bool]) -> MeCeFOConfig:
    return replace(base, skip_mha=flags[0], recompute_ffn=flags[1], low_rank=flags[2])


def rebalanced_loads(workers: int, batch: int, max_out: int = 3) -> list[int]:
    """Sequences per survivor when ``m = 1..max_out`` of ``workers`` are out and the global batch is rebalanced."""
    return sorted({math.ceil(workers * batch / (workers - m)) for m in range(1, max_out + 1) if workers - m > 0} - {batch})


def measure_costs(cfg: MeCeFOBenchConfig, progress: bool = False) -> dict[str, Any]:
    """Per-step costs of every role, measured in this process (see the module docstring)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        loads = rebalanced_loads(cfg.workers, cfg.batch)
        h = _Harness(cfg, shares=3, max_sequences=max(loads, default=0))
        base = cfg.mecefo
        roles: dict[str, Callable[[], tuple[float, float]]] = {
            "normal": lambda: h.step([("exact", 0)]),
            "bamboo": lambda: h.step([("kept", 2), ("exact", 0)]),
            "bamboo_cover": lambda: h.step([("kept", 2), ("exact", 0), ("exact", 1)]),
        }
        for name, flags in ABLATION.items():
            roles[f"neighbor[{name}]"] = (lambda t: lambda: h.step([("degraded", 0), ("degraded", 1)], t))(
                _techniques(base, flags))
        for name in ("low_rank", "all"):  # the low-rank gradient's V1^T product once per micro-batch, side by side
            t = replace(_techniques(base, ABLATION[name]), defer_projection=False)
            roles[f"neighbor[{name}, projection per micro-batch]"] = (
                lambda t_: lambda: h.step([("degraded", 0), ("degraded", 1)], t_))(t)
        for e in range(1, cfg.parts):  # a neighbor carrying e of an out worker's micro-batches (spread)
            roles[f"neighbor+{e}/{cfg.parts}"] = (lambda e_: lambda: h.step([("degraded", 0), ("degraded", 1, e_)],
                                                                              base))(e)
        for s in loads:
            roles[f"rebalanced[{s}]"] = (lambda s_: lambda: h.step([("exact", 0)], sequences=s_))(s)
        svd: list[float] = []
        bar = TaskBar(progress, "bench mecefo: step costs", len(roles) * (cfg.rounds + 1) + 2)
        try:
            svd.append(_cpu(lambda: h.comp.refresh_bases(0)))
            bar.advance("svd")
            for fn in roles.values():  # warm-up
                fn()
                bar.advance("warm-up")
            times: dict[str, list[float]] = {k: [] for k in roles}
            walls: dict[str, list[float]] = {k: [] for k in roles}
            names = list(roles)
            for r in range(cfg.rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                if r % 2:
                    order.reverse()
                for k in order:
                    cpu, wall = roles[k]()
                    times[k].append(cpu)
                    walls[k].append(wall)
                    bar.advance(k)
            opt = statistics.median(h.optimizer_step() for _ in range(3))
            svd.append(_cpu(lambda: h.comp.refresh_bases(0)))
            bar.advance("svd")
        finally:
            bar.stop()
        med = {k: statistics.median(v) for k, v in times.items()}
        act_normal = h.activation_peak(False)
        acts = {name: h.activation_peak(True, _techniques(base, flags)) for name, flags in ABLATION.items()}
        h.comp.cfg = base
        chosen = base.techniques() if base.techniques() in ABLATION else "all"
        normal = med["normal"]
        ablation = {name: {"step_s": med[f"neighbor[{name}]"], "step_time_ratio": med[f"neighbor[{name}]"] / normal,
                           "activation_mb_per_micro_batch": acts[name] / 2**20,
                           "activation_ratio": acts[name] / act_normal if act_normal else math.nan}
                    for name in ABLATION}
        deferral = {name: {"step_time_ratio_deferred": med[f"neighbor[{name}]"] / normal,
                           "step_time_ratio_per_micro_batch": med[f"neighbor[{name}, projection per micro-batch]"] / normal}
                    for name in ("low_rank", "all")}
        return {
            "deferral": deferral,
            "measured": True, "clock": "CPU seconds of the measuring process (one torch thread), medians over rounds: "
                                       "other processes on a shared machine do not inflate them as they do wall time",
            "threads": cfg.threads, "rounds": cfg.rounds, "batch": cfg.batch, "seq_len": cfg.seq_len,
            "step_s": {k: round(v, 5) for k, v in med.items()},
            "step_s_rounds": {k: [round(x, 5) for x in v] for k, v in times.items()},
            "wall_s_median": {k: round(statistics.median(v), 5) for k, v in walls.items()},
            "optimizer_s": opt, "svd_refresh_s": min(svd), "tau": base.tau, "rank": base.rank,
            "activation_mb_per_micro_batch_normal": act_normal / 2**20, "ablation": ablation, "techniques": chosen,
            "neighbor_step_time_ratio": med[f"neighbor[{chosen}]"] / normal,
            "neighbor_activation_ratio": acts[chosen] / act_normal if act_normal else math.nan,
            "redundant_step_time_ratio": med["bamboo"] / normal,
            "rebalanced": {int(s): med[f"rebalanced[{s}]"] for s in loads},
            "parts": cfg.parts, "cost_micro_batch": cfg.cost_micro_batch,
            # own share + e of an out worker's parts, degraded (e = parts is the single neighbor's step)
            "neighbor_extra": {e: med[f"neighbor+{e}/{cfg.parts}"] for e in range(1, cfg.parts)}
            | {cfg.parts: med[f"neighbor[{chosen}]"]},
        }
    finally:
        torch.set_num_threads(threads)


def step_costs(costs: dict[str, Any], cfg: MeCeFOBenchConfig, spread: int | str | None = None) -> StepCosts:
    s = costs["step_s"]
    return StepCosts(normal=s["normal"], neighbor=s[f"neighbor[{costs['techniques']}]"], bamboo=s["bamboo"],
                     bamboo_cover=s["bamboo_cover"], optimizer=costs["optimizer_s"],
                     rebalanced={int(k): v for k, v in costs["rebalanced"].items()}, batch=cfg.batch,
                     svd_s=costs["svd_refresh_s"], tau=cfg.mecefo.tau, degrade_own=cfg.mecefo.degrade_own,
                     parts=cfg.parts, neighbor_extra={int(e): v for e, v in costs["neighbor_extra"].items()},
                     spread=cfg.mecefo.spread if spread is None else spread)


def degraded_cost(costs: dict[str, Any]) -> float:
    """A degraded micro-batch's compute time relative to an exact one, from the measured steps (the single
    neighbor's two degraded shares against a normal worker's one exact share, optimizer step left out)."""
    s, opt = costs["step_s"], costs["optimizer_s"]
    return max((s[f"neighbor[{costs['techniques']}]"] - opt) / 2.0, 1e-12) / max(s["normal"] - opt, 1e-12)


def spread_for_one_failure(sc: StepCosts, workers: int) -> tuple[int, float, bool]:
    """(spread, its most loaded neighbor's step time ratio to a normal step, measured?) with one worker out of
    ``workers``, as the cluster model resolves it (the default policy's neighbor)."""
    from trainguard.failover.mecefo.ring import assign, resolve

    up, p = list(range(1, workers)), sc.parts
    own_degraded = sc.degrade_own and workers > 2

    def host(e: int) -> tuple[float, bool]:
        return sc.step_parts(0, p + e) if own_degraded else sc.step_parts(p, e)

    k = resolve(sc.spread, {0: p}, up, workers, lambda e: host(e)[0] > sc.normal + 1e-12)
    extra = max(len(v) for v in assign({0: p}, up, workers, k).values())
    t, ok = host(extra)
    return k, t / sc.normal, ok


def _rss_probe(cfg: MeCeFOBenchConfig, role: str, out) -> None:
    import resource

    torch.set_num_threads(cfg.threads)
    h = _Harness(cfg, shares=2)
    if role != "normal":
        h.comp.refresh_bases(0)
    spec = {"normal": [("exact", 0)], "neighbor": [("degraded", 0), ("degraded", 1)],
            "naive": [("exact", 0), ("exact", 1)]}[role]
    techniques = cfg.mecefo if role == "neighbor" else None
    h.step([("exact", 0)])  # optimizer state allocated in every role
    base = _rss_mb()
    for _ in range(2):
        h.step(spec, techniques)
    out.put((role, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, base))


def _rss_mb() -> float:
    with contextlib.suppress(OSError):
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return math.nan


def measure_peak_memory(cfg: MeCeFOBenchConfig, progress: bool = False) -> dict[str, Any]:
    """Peak resident memory (MB) of a process running normal, neighbor and naive-neighbor steps (a fresh process
    each, so the peaks do not mix)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out: dict[str, Any] = {"measured": True, "what": "peak resident set size of a fresh process: model, AdamW "
                                                    "state, gradients and two steps of the role"}
    bar = TaskBar(progress, "bench mecefo: peak memory", 3)
    try:
        for role in ("normal", "neighbor", "naive"):
            q = ctx.Queue()
            p = ctx.Process(target=_rss_probe, args=(cfg, role, q), daemon=True)
            p.start()
            try:
                _, peak, base = q.get(timeout=900)
            finally:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
            out[role] = {"peak_rss_mb": peak, "rss_before_steps_mb": base}
            bar.advance(role)
    finally:
        bar.stop()
    out["neighbor_peak_memory_ratio"] = out["neighbor"]["peak_rss_mb"] / out["normal"]["peak_rss_mb"]
    out["naive_peak_memory_ratio"] = out["naive"]["peak_rss_mb"] / out["normal"]["peak_rss_mb"]
    return out


# --------------------------------------------------------------------------------------------------
# 3. Quality: real runs


def _run_config(cfg: MeCeFOBenchConfig, method: str, preset: str, mecefo: MeCeFOConfig | None = None) -> FailoverRunConfig:
    timeline = FailureTimeline.from_preset(preset, cfg.run_workers, cfg.steps, cfg.quality_hours,
                                           cfg.cluster.recovery_min, cfg.seed, real=cfg.real_kills)
    every = 1
    if method == "checkpoint_restart" and preset != "none":  # the availability-optimal period, in steps
        period = checkpoint_period(cfg.cluster.checkpoint_s, PRESETS_MTBF_HOURS[preset] * 3600.0, cfg.cluster.restart_s)
        every = max(1, round(period / timeline.step_s))
    return FailoverRunConfig(
        method=method, workers=cfg.run_workers, steps=cfg.steps, model=cfg.model,
        model_overrides={"max_seq_len": max(cfg.seq_len, 16), **cfg.model_overrides}, seq_len=cfg.seq_len,
        micro_batch=cfg.run_micro_batch, grad_accum=cfg.run_grad_accum, lr=cfg.lr, seed=cfg.seed,
        corpus_max_bytes=cfg.corpus_max_bytes, timeline=timeline,
        mecefo=replace(mecefo or cfg.mecefo, monitor_every=cfg.monitor_every), checkpoint_every=every,
        threads_per_worker=cfg.threads, eval_batches=cfg.eval_batches, timeout_s=60.0)


def quality_runs(cfg: MeCeFOBenchConfig, progress: bool = False,
                 note: Callable[[str], None] | None = None, mecefo: MeCeFOConfig | None = None) -> dict[str, Any]:
    """The failure-free run and one run per method under ``cfg.failures``; ``note(text)`` after each."""
    jobs = [("no_failure", "mecefo", "none")]
    if cfg.failures != "none":
        jobs += [(m, m, cfg.failures) for m in CLUSTER_METHODS if m in cfg.quality_methods]
    bar = TaskBar(progress, "bench mecefo: training runs", len(jobs) * cfg.steps)
    runs: dict[str, Any] = {}
    try:
        for label, method, preset in jobs:
            rc = _run_config(cfg, method, preset, mecefo)

            def tick(kind, r, info, _label=label):
                if kind == "step" and r == min(info["live"]):
                    bar.advance(f"{_label} step {info['step']}")

            res = run_failover(rc, progress=tick)
            runs[label] = _run_summary(res, rc)
            if note is not None:
                r = runs[label]
                note(f"run {label}: val ppl {r['val_ppl']:.4g}, {r['steps_with_a_worker_out']} steps with a worker out, "
                     f"{len(r['deaths'])} kill(s), {r['global_restarts']} global restart(s), {r['wall_s']:.0f} s")
    finally:
        bar.stop()
    return runs


def _run_summary(res, rc: FailoverRunConfig) -> dict[str, Any]:
    roles: dict[str, list[float]] = {}
    for lg in res.step_logs:
        for w, role in lg.get("roles", {}).items():
            roles.setdefault(role, []).append(lg["compute_s"].get(w, math.nan))
    errs = [lg["grad_rel_error"] for lg in res.step_logs if "grad_rel_error" in lg]
    out = res.summary()
    out.update({"checkpoint_every": rc.checkpoint_every if rc.method == "checkpoint_restart" else None,
                "grad_rel_errors": errs, "losses": [lg["loss"] for lg in res.step_logs],
                "survivors_agree": res.agree})
    if roles.get("neighbor") and roles.get("normal"):
        out["neighbor_compute_time_ratio_in_run"] = statistics.median(roles["neighbor"]) / statistics.median(roles["normal"])
    peaks = [s for s in res.samples if s.get("act_peak_mb_neighbor")]
    if peaks:
        out["activation_peak_mb_neighbor"] = max(s["act_peak_mb_neighbor"] for s in peaks)
        normal = [s["act_peak_mb_exact"] for s in res.samples if s.get("act_peak_mb_exact")]
        if normal:
            out["activation_peak_mb_normal"] = max(normal)
    return out


# --------------------------------------------------------------------------------------------------
# Everything


def bench(cfg: MeCeFOBenchConfig, progress: bool = False, note: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Everything (module docstring); ``note(text)`` reports each phase's outcome as it ends (long runs)."""
    cfg.validate()
    note = note or (lambda text: None)
    t0 = time.perf_counter()
    costs = measure_costs(cfg, progress)
    note("step costs (CPU s): " + ", ".join(f"{k} {v:.3g}" for k, v in costs["step_s"].items()))
    memory = measure_peak_memory(cfg, progress) if cfg.memory else None
    if memory:
        note(f"peak memory ratio neighbor/normal {memory['neighbor_peak_memory_ratio']:.3f}")
    sc = step_costs(costs, cfg)
    single = step_costs(costs, cfg, spread=1)  # the paper's single neighbor, for comparison
    tokens_share = cfg.batch * cfg.seq_len
    by_preset = {p: cluster_throughput(sc, p, cfg.cluster, tokens_share) for p in ("none", *PRESETS_MTBF_HOURS)}
    single_by_preset = {p: cluster_throughput(single, p, cfg.cluster, tokens_share)
                        for p in ("none", *PRESETS_MTBF_HOURS)}
    sensitivity, single_sensitivity = {}, {}
    if cfg.failures != "none":
        for rec in (1.0, 5.0, 10.0, 30.0):
            r = cluster_throughput(sc, cfg.failures, replace(cfg.cluster, recovery_min=rec), tokens_share)
            sensitivity[str(rec)] = {m: r[m]["throughput_drop"] for m in CLUSTER_METHODS}
            r = cluster_throughput(single, cfg.failures, replace(cfg.cluster, recovery_min=rec), tokens_share)
            single_sensitivity[str(rec)] = r["mecefo"]["throughput_drop"]
    k1, ratio, ratio_measured = spread_for_one_failure(sc, cfg.workers)
    dcost = degraded_cost(costs)
    note(f"spread {cfg.mecefo.spread!s} -> {k1} neighbors for one failure: neighbor step {ratio:.3f} x normal "
         f"({'measured' if ratio_measured else 'extrapolated'}); degraded micro-batch {dcost:.3f} x exact")
    run_mecefo = replace(cfg.mecefo, degraded_cost=dcost)
    runs = quality_runs(cfg, progress, note, run_mecefo) if cfg.quality else {}
    chosen = by_preset[cfg.failures]
    out: dict[str, Any] = {
        "model": cfg.model, "workers": cfg.workers, "failures": cfg.failures, "steps": cfg.steps,
        "methods": list(CLUSTER_METHODS),
        "throughput_modelled": True,
        "throughput_note": (f"tokens/s of a {cfg.workers}-worker cluster computed from per-step costs measured on "
                            f"this machine ({cfg.threads} thread(s), {cfg.batch} x {cfg.seq_len} tokens per worker "
                            f"step) and a modelled failure timeline ({cfg.cluster.horizon_h:g} h, recovery "
                            f"{cfg.cluster.recovery_min:g} min); not a run of {cfg.workers} workers"),
    }
    no_fail_ppl = runs.get("no_failure", {}).get("val_ppl")
    for m in CLUSTER_METHODS:
        row = {k: chosen[m][k] for k in ("tokens_per_s_no_failure", "tokens_per_s_failures", "throughput_drop")}
        run = runs.get(m) if cfg.failures != "none" else runs.get("no_failure")
        row["val_ppl_no_failure"] = no_fail_ppl
        row["val_ppl_failures"] = run.get("val_ppl") if run else None
        if run and no_fail_ppl:
            row["val_ppl_increase"] = row["val_ppl_failures"] / no_fail_ppl - 1.0 if row["val_ppl_failures"] else None
        out[m] = row
    errs = [e for r in runs.values() for e in r.get("grad_rel_errors", [])]
    out["grad_rel_error_max"] = max(errs) if errs else None
    out["grad_rel_error_samples"] = len(errs)
    out["neighbor_step_time_ratio"] = ratio
    out["spread"] = {"config": cfg.mecefo.spread, "neighbors_for_one_failure": k1, "parts": cfg.parts,
                     "neighbor_step_time_ratio_measured": ratio_measured, "degraded_cost": dcost,
                     "note": (f"an out worker's share is {cfg.parts} micro-batch(es) of {cfg.cost_micro_batch} "
                              f"sequence(s); spread over {k1} ring neighbor(s) with one worker out. "
                              + ("The real runs have one micro-batch per worker step, so they cannot spread (every "
                                 "spread is the single neighbor there)" if cfg.run_grad_accum == 1 else
                                 f"The real runs have {cfg.run_grad_accum} micro-batches per worker step "
                                 f"({cfg.run_workers} workers: auto spreads over at most {cfg.run_workers - 2})"))}
    sp = single_by_preset[cfg.failures]["mecefo"]
    out["mecefo_single_neighbor"] = {
        "what": "the paper's MeCeFO: the single next neighbor computes both shares (spread = 1); modelled like the rest",
        "tokens_per_s_no_failure": sp["tokens_per_s_no_failure"], "tokens_per_s_failures": sp["tokens_per_s_failures"],
        "throughput_drop": sp["throughput_drop"], "neighbor_step_time_ratio": costs["neighbor_step_time_ratio"],
        "throughput_drop_by_preset": {p: r["mecefo"]["throughput_drop"] for p, r in single_by_preset.items()},
        "throughput_drop_by_recovery_min": single_sensitivity,
        "extrapolated": single_by_preset[cfg.failures]["extrapolated"],
    }
    out["neighbor_peak_memory_ratio"] = memory["neighbor_peak_memory_ratio"] if memory else None
    out["neighbor_activation_ratio"] = costs["neighbor_activation_ratio"]
    out["ablation"] = costs["ablation"]
    out["ablation_projection"] = costs["deferral"]
    out["step_costs"] = {k: costs[k] for k in ("clock", "step_s", "optimizer_s", "svd_refresh_s", "tau", "rank",
                                               "threads", "rounds", "batch", "seq_len", "rebalanced", "step_s_rounds",
                                               "wall_s_median",
                                               "redundant_step_time_ratio", "activation_mb_per_micro_batch_normal",
                                               "techniques", "parts", "cost_micro_batch", "neighbor_extra")}
    out["peak_memory"] = memory
    out["by_preset"] = {p: {m: {k: v for k, v in r[m].items()} for m in CLUSTER_METHODS} | {
        "failures": r["failures"], "extrapolated": r["extrapolated"]} for p, r in by_preset.items()}
    out["throughput_drop_by_recovery_min"] = sensitivity
    out["cluster_assumptions"] = asdict(cfg.cluster)
    out["quality"] = {"token_budget": cfg.token_budget, "run_workers": cfg.run_workers, "steps": cfg.steps,
                      "tokens_per_step": cfg.run_workers * cfg.run_grad_accum * cfg.run_micro_batch * cfg.seq_len,
                      "grad_accum": cfg.run_grad_accum, "lr": cfg.lr,
                      "quality_hours": cfg.quality_hours, "no_failure_run": "one run with MeCeFO installed and no "
                      "failure: the failure-free run of every method (their failure-free steps compute the same "
                      "slices with the same weights)", "runs": runs}
    out["mecefo_config"] = asdict(run_mecefo)
    out["wall_s"] = time.perf_counter() - t0
    return out


__all__ = ["ABLATION", "MeCeFOBenchConfig", "bench", "degraded_cost", "measure_costs", "measure_peak_memory",
           "quality_runs", "rebalanced_loads", "spread_for_one_failure", "step_costs"]
