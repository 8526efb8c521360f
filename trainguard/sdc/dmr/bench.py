"""``trainguard bench dmr``: No-DMR, Naive-Only and SpareTrain (with its phase ablation) on one trainer,
side by side.

Every system runs on the same model, batches and pipeline, in alternating rounds (the order rotates each
round), after a warm-up (each system first runs untimed steps, at most ``system_warmup``, until two in a row
each add fewer than ``WARM_FAULTS`` page faults: its first steps grow the heap to its peak, page faults the first round would
otherwise be charged with); throughput is tokens over the median step time of each system. The first step
after each switch of system is not timed (``switch_warmup``): a switch drops the DMR engine's copies of
the state, which the held update then makes again, once a run in training, once a round here. Each
system's ``main_cpu_s`` is the main thread's CPU time per step (median): the engine's work on the
critical path, less noisy than wall time; ``main_sys_s``, ``main_minor_faults`` and ``main_involuntary_switches``
(medians per step too, Linux) are the kernel's share of it, the pages it touched first and how often another thread
took its core while it could run. Before each round every rank probes the host (``host_probe_by_round``, rank 0's in
the merged output): the CPU time of a fixed Python walk over objects scattered in memory and of a fixed matmul loop,
to tell a host that slows Python bookkeeping from one that slows kernels. No-DMR runs with
no dispatch mode at all (plain activation checkpointing with early stop); Naive-Only re-executes every op
at once; SpareTrain verifies the activation-checkpointed ops on their recompute (P-DMR) and defers the
others into pipeline transfer windows as planned from a profile of the run. Ablation: ``sparetrain-p1``
(phase 1: P-DMR, the rest naive), ``sparetrain-p12`` (+ AGC segments in pipeline windows) and
``sparetrain`` (phases 1-3: + per-op deferral into the remaining windows).

Loopback links are nearly free, unlike an inter-node link: ``idle_fraction > 0`` **emulates** a slower
link between pipeline stages (every transfer lands a fixed delay after it is issued), calibrated on the
No-DMR warm-up so the No-DMR step idles that fraction of its time, and re-set after every timed round from
that round's No-DMR steps (``hold_idle``, damped: the host's speed drifts over the minutes a run takes, and
with it the idle share a fixed delay gives); the idle share is measured again in the timed rounds and reported,
per round too. Peak memory per system is the heap in use (glibc's ``mallinfo2``, sampled every 0.5 ms) during one
more untimed step of that system after the rounds: the systems share one process, whose resident size only
grows (``peak_rss_bytes`` keeps it, per system as read after its rounds). Each rank writes its figures to
``OUT/rank{r}.json``; the CLI merges them. Beside the run's figures (medians over every timed step), the
overhead and the gain are given round by round (``by_round``: each from one round's medians, systems paired
within the round) with the worst round of each (``*_worst_round``): how far one run moves within itself.

The gain over Naive-Only is bounded by Naive-Only's own overhead: ``gain_ceiling_free_verifier`` is the gain a
verifier costing nothing would have. ``floor`` (only when asked for in ``systems``) is not a DMR system but a bound
measured side by side: every op passes through a Python dispatch mode that checks nothing
(:class:`~trainguard.sdc.dmr.engine.PassThroughMode`, views past Python, the recompute stopping early). Its
``floor_overhead_vs_no_dmr`` is what any verifier built on a Python ``TorchDispatchMode`` costs at least, and
``gain_ceiling_python_mode`` the most such a verifier could gain over Naive-Only in this run.

``op_times`` (``--op-times``) also times every op a dispatch mode executes in the timed steps: SpareTrain's and
Naive-Only's primary executions and the floor's ops (No-DMR has no mode). Per rank and system ``op_cpu_s`` gives each
op's thread CPU time and calls a step, keyed "<op> forward" or "<op> in backward" (a recompute runs in the backward),
and ``ops_slower_than_naive`` the ops where SpareTrain's executions cost more than Naive-Only's first ones, the same
ops: what holding tensors for the windows costs the ops themselves (``docs/dmr-measurements.md``, "A faster host").
The timing adds two clock reads an op to those systems, so their throughput in such a run is not the headline's.

Run inside each process by ``python -m trainguard.sdc.dmr.bench OUT CONFIG.json`` (torchrun for pipelines).
Relies on torch (distributed), the Trainer and the DMR engine.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainguard.sdc.dmr import ops as dops
from trainguard.sdc.dmr.config import DMRConfig
from trainguard.sdc.dmr.engine import PassThroughMode, attach
from trainguard.sdc.dmr.engine.common import time_ops
from trainguard.sdc.dmr.planner import plan_static
from trainguard.train import Trainer, TrainerConfig
from trainguard.train.host_memory import HeapPeak, rss_bytes
from trainguard.train.launch import exit_rank

SYSTEMS = ("none", "naive", "sparetrain-p1", "sparetrain-p12", "sparetrain")  # the default run
# Not a DMR system but a bound, run only when asked for (``--systems ...,floor``): every op through a Python dispatch
# mode that checks nothing (views past Python, the recompute stopping early, as SpareTrain's plan has it). What any
# verifier built on a Python TorchDispatchMode costs at least; its gain over Naive-Only bounds SpareTrain's
FLOOR = "floor"
CHOICES = SYSTEMS + (FLOOR,)
PHASES = {"sparetrain-p1": (1,), "sparetrain-p12": (1, 2), "sparetrain": (1, 2, 3)}
CALIBRATION_TOLERANCE = 0.005  # |measured - target| idle fraction at which the emulated link's calibration stops
# Between timed rounds the link is re-set from the round's No-DMR idle share (``hold_idle``). Half the correction a
# round (a geometric mean of the delay and the one the round asks for), so that one noisy round moves it little
HOLD_DAMPING = 0.5
# and by at most this factor either way: a round that read an idle share near 0 or 1 (a stalled peer, a host
# paused for seconds) would otherwise move the link by orders of magnitude on one reading
HOLD_MAX_FACTOR = 2.0
# A system's warm-up (``system_warmup``) stops after two steps in a row that each add fewer page faults than this a
# rank (8 MiB of 4 KiB pages): its heap has reached its peak. (A first fault costs about 15 us here: 110,000 of them, one
# SpareTrain step's growth at idle 0.3, were 1.7 s of system time.)
WARM_FAULTS = 2000


def _mean_over_ranks(x: float) -> float:
    if not (dist.is_available() and dist.is_initialized()):
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _rusage(who: str) -> Any:
    """``resource.getrusage(RUSAGE_<who>)`` (``SELF``, ``THREAD``), or None where the platform has none."""
    try:
        import resource

        return resource.getrusage(getattr(resource, f"RUSAGE_{who}"))
    except (ImportError, AttributeError, OSError):
        return None


def _page_faults() -> int:
    """The process's minor page faults so far (first touches of memory; 0 where the platform does not count them)."""
    r = _rusage("SELF")
    return r.ru_minflt if r is not None else 0


def _thread_usage() -> tuple[float, int, int]:
    """The calling thread's system CPU time, minor page faults and involuntary context switches so far (Linux's
    ``RUSAGE_THREAD``; zeros where the platform has none)."""
    r = _rusage("THREAD")
    return (r.ru_stime, r.ru_minflt, r.ru_nivcsw) if r is not None else (0.0, 0, 0)


class _Probe:
    __slots__ = ("next", "value")

    def __init__(self, value: int) -> None:
        self.value, self.next = value, None


_PROBE_OBJECTS = 1 << 18  # (about 25 MB of small objects: more than the caches hold)


def host_probe(seed: int = 0) -> dict[str, float]:
    """The calling thread's CPU time for two fixed pieces of work, to tell how the host's state moves each: Python
    walking small objects scattered over memory (the kind of work a Python verifier's bookkeeping is) and a float32
    matmul loop (kernels). A diagnostic of the host, never part of a system's figures. The collector is off while the
    probe's objects live (they are all freed before it is back on, so no later step collects them)."""
    import gc
    import itertools
    import random

    was_on = gc.isenabled()
    gc.disable()
    try:
        nodes = [_Probe(i) for i in range(_PROBE_OBJECTS)]
        order = list(range(_PROBE_OBJECTS))
        random.Random(seed).shuffle(order)
        for a, b in itertools.pairwise(order):
            nodes[a].next = nodes[b]
        c0 = time.thread_time()
        node, total = nodes[order[0]], 0
        while node is not None:
            total += node.value
            node = node.next
        python_s = time.thread_time() - c0
        del nodes, node
    finally:
        if was_on:
            gc.enable()
    a = torch.ones(256, 256)
    c0 = time.thread_time()
    for _ in range(256):
        a = torch.mm(a, a).mul_(1 / 256)
    return {"python_walk_s": python_s, "matmul_s": time.thread_time() - c0}


def _warm_up(engine, trainer, system: str, plans: dict | None, most: int) -> int:
    """Untimed steps of ``system`` until two in a row each add fewer than WARM_FAULTS page faults (the mean over
    ranks: every rank stops at the same step), at most ``most``; returns how many ran. (Two: the first step after a
    switch carries nothing past its update, so it grows the heap less than the ones after it.)"""
    _set_system(engine, trainer, system, plans)
    quiet = 0
    for n in range(1, most + 1):
        f0 = _page_faults()
        trainer.train_step()
        quiet = quiet + 1 if _mean_over_ranks(float(_page_faults() - f0)) < WARM_FAULTS else 0
        if quiet == 2:
            return n
    return most


class _Floor:
    """The ``floor`` system's step context (one per rank process): inactive until that system is set."""

    def __init__(self) -> None:
        self.on = False
        self.mode: PassThroughMode | None = None
        self.plain = True  # the model's parameters are plain tensors (views may skip Python modes)

    def attach(self, trainer, engine) -> None:
        self.plain = engine._plain_tensors  # (what the engine found of the same model: it sends views past then too)
        trainer.step_contexts.append(self.context)

    @contextlib.contextmanager
    def context(self, step: int):
        if not self.on:
            yield
            return
        self.mode = PassThroughMode()
        with self.mode, dops.views_past_python() if self.plain else contextlib.nullcontext():
            yield


_FLOOR = _Floor()


def _set_system(engine, trainer, system: str, plans: dict | None = None) -> None:
    _FLOOR.on = system == FLOOR
    engine.set_system("none" if system == FLOOR else "sparetrain" if system.startswith("sparetrain") else system)
    if plans and system in PHASES:
        engine.plan = plans[PHASES[system]]


def _timed_steps(trainer, n: int, engine=None, where: dict | None = None) -> tuple[list[float], float]:
    """Step wall times and the share of them spent waiting on pipeline transfers. With ``engine`` and
    ``where``: per step, where the checkers' time went (``overrun_s``: the step waited at the end of a window
    for its worker: the check under way, and what runs whole once started: the previous update's held check,
    the planned AGC replays; ``drain_s``: checkers left for the end of the iteration)."""
    sched = getattr(trainer.strategy, "schedule", None)
    w0 = getattr(sched, "wait_s", 0.0)
    times = []
    for _ in range(n):
        u0 = _thread_usage()  # (before the step's clocks start: not timed)
        t0, c0 = time.perf_counter(), time.thread_time()
        trainer.train_step()
        times.append(time.perf_counter() - t0)
        if where is not None:  # the main thread's own CPU time: what the engine adds to the critical path
            where.setdefault("main_cpu_s", []).append(time.thread_time() - c0)
            # and of it, the kernel's share (page faults, futexes), the pages it touched first, and how often another
            # thread took its core while it could run: where CPU time that moves between runs could come from
            for k, a, b in zip(("main_sys_s", "main_minor_faults", "main_involuntary_switches"), u0, _thread_usage()):
                where.setdefault(k, []).append(b - a)
        if engine is not None and where is not None:
            where.setdefault("overrun_s", []).append(sum(w[2] for w in engine.window_log))
            where.setdefault("drain_s", []).append(engine.drain_s)
    waited = getattr(sched, "wait_s", 0.0) - w0
    return times, waited / max(sum(times), 1e-9)


def _odds(f: float) -> float:
    return f / max(1 - f, 1e-9)


def _rescaled_delay(delay: float, idle: float, target: float, damping: float = 1.0) -> float:
    """The link delay that moves the measured idle share ``idle`` to ``target``: the idle odds scale about in
    proportion to the delay once it dominates the waits. ``damping`` < 1 takes that share of the correction
    (on a log scale)."""
    return delay * (_odds(target) / max(_odds(idle), 1e-9)) ** damping


def held_delay(delay: float, idle: float, target: float) -> float:
    """The link delay for the next timed round, given the last round's No-DMR idle share ``idle``: unchanged
    within the calibration's tolerance, else moved by half the correction :func:`_rescaled_delay` asks for, and
    by at most ``HOLD_MAX_FACTOR`` either way."""
    if abs(idle - target) <= CALIBRATION_TOLERANCE:
        return delay
    moved = _rescaled_delay(delay, idle, target, HOLD_DAMPING)
    return min(max(moved, delay / HOLD_MAX_FACTOR), delay * HOLD_MAX_FACTOR)


def _naive_by_phase(plan) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for o in plan.ops.values():
        if o.strategy == "naive":
            d = out.setdefault(o.phase, {"ops": 0, "time_s": 0.0})
            d["ops"] += 1
            d["time_s"] += o.time_s
    return out


def run_rank(spec: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(spec.get("threads", 1))
    cfg = TrainerConfig.load(None, spec["overrides"])
    trainer = Trainer(cfg, progress=False)
    engine = attach(trainer, DMRConfig(enabled=True, system="none", memory_budget_mb=spec.get("memory_budget_mb", 0.0),
                                       carry_budget=spec.get("carry_budget", DMRConfig.carry_budget),
                                       profile_steps=spec.get("profile_steps", DMRConfig.profile_steps)).validate())
    systems = spec.get("systems", list(SYSTEMS))
    if FLOOR in systems:
        _FLOOR.attach(trainer, engine)
    # warm-up (and calibration of the emulated link) on No-DMR
    _set_system(engine, trainer, "none")
    sched = getattr(trainer.strategy, "schedule", None)
    target = float(spec.get("idle_fraction", 0.0))
    times, idle = _timed_steps(trainer, spec.get("warmup", 2))
    delay, calibrated = 0.0, None
    if target > 0 and sched is not None:
        waits = max(1, sched.waits // max(1, trainer.step_idx))
        # scale the delay by the ratio of the idle odds, target over measured, until the measured idle is within
        # CALIBRATION_TOLERANCE of the target (a few points less idle time moves SpareTrain's overhead by points)
        for _ in range(spec.get("calibration_rounds", 6)):
            t_step = _mean_over_ranks(statistics.median(times))
            idle = _mean_over_ranks(idle)  # (the same on every rank: every rank takes the same branch)
            if delay > 0:
                calibrated = idle
                if abs(idle - target) <= CALIBRATION_TOLERANCE:
                    break
            if delay == 0:
                delay = max(0.0, (target * t_step - idle * t_step) / (waits * (1 - target)))
            else:
                delay = _rescaled_delay(delay, idle, target)
            delay = _mean_over_ranks(delay)
            sched.link_delay_s = delay
            times, idle = _timed_steps(trainer, 3)
        else:
            calibrated = _mean_over_ranks(idle)
    # profile one step (``profile_steps`` times, each attempt then re-executed; the plan takes the median times) and
    # plan it once per phase set
    _set_system(engine, trainer, "sparetrain")
    profiled_attempts = trainer.train_step().planned_retries
    plans = {p: plan_static(engine.profile, engine.planner_config(p)) for p in PHASES.values()} \
        if engine.profile is not None else None
    per: dict[str, dict[str, list]] = {s: {"times": [], "idle": [], "rss": [], "where": {}, "by_round": []}
                                       for s in systems}
    rounds, steps = spec.get("rounds", 3), spec.get("steps", 3)
    # every system's first steps grow the heap to its peak, page faults that retained host memory then keeps (110,000
    # a SpareTrain step at idle 0.3, 1.7 s of system time a rank, over its first five steps), which the first round
    # would be charged with: each runs untimed until its heap stops growing, as a training run has those steps
    # behind it after its first iterations (a SpareTrain system's heap grew over about five steps after a switch)
    warmed = {s: _warm_up(engine, trainer, s, plans, spec.get("system_warmup", 0)) for s in systems}
    # the host's speed drifts over a run of minutes, and with it the idle share a fixed delay gives: held at the
    # target by re-setting the link after each round from that round's No-DMR steps (every system of the next round
    # runs on the same link, so the comparison stays side by side)
    hold = bool(spec.get("hold_idle", True)) and delay > 0 and "none" in systems
    by_round: list[dict[str, float]] = []
    probes: list[dict[str, float]] = []
    for r in range(rounds):
        probes.append(host_probe(r))  # (each round's host, as the systems of that round met it)
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for s in order:
            _set_system(engine, trainer, s, plans)
            for _ in range(spec.get("switch_warmup", 1)):
                # untimed: a switch drops the engine's copies of the state (the held update copies it again at
                # its first step, which a training run does once, not once per round)
                trainer.train_step()
            ops = {} if spec.get("op_times") else None
            time_ops(ops)  # (--op-times: every op the mode executes in the timed steps, by op)
            try:
                t, idle = _timed_steps(trainer, steps, engine, per[s]["where"])
            finally:
                time_ops(None)
            for k, (cpu, calls) in (ops or {}).items():
                acc = per[s].setdefault("op_times", {}).setdefault(k, [0.0, 0])
                acc[0] += cpu / (rounds * steps)
                acc[1] += calls / (rounds * steps)
            if s == FLOOR and _FLOOR.mode is not None:
                per[s]["mode_ops"] = _FLOOR.mode.ops  # (the last timed step's)
            per[s]["times"] += t
            per[s]["by_round"].append(statistics.median(t))
            per[s]["idle"].append(idle)
            per[s]["rss"].append(rss_bytes())
        if delay > 0 and "none" in systems:
            idle_r = _mean_over_ranks(per["none"]["idle"][-1])
            by_round.append({"link_delay_ms": delay * 1000, "no_dmr_idle_fraction": idle_r})
            if hold and r < rounds - 1:
                delay = sched.link_delay_s = _mean_over_ranks(held_delay(delay, idle_r, target))
    # peak memory per system: the process's resident size cannot tell the systems apart (they share the process,
    # and retained host memory keeps it at the highest so far), so each system runs one more untimed step (after
    # one that settles the switch) with the heap in use sampled
    heap: dict[str, int | None] = {}
    for s in systems:
        _set_system(engine, trainer, s, plans)
        trainer.train_step()
        with HeapPeak() as hp:
            trainer.train_step()
        heap[s] = hp.peak
    # coverage of one more SpareTrain step, with the per-op report on
    _set_system(engine, trainer, "sparetrain", plans)
    engine.cfg.coverage = True
    trainer.train_step()
    coverage = engine.coverage_report()
    tokens = trainer.tokens_per_step
    out = {
        "rank": trainer.rank, "strategy": trainer.strategy.name, "link_delay_ms": delay * 1000, "warm_up_steps": warmed,
        "idle_fraction_calibrated": calibrated, "hold_idle": hold, "rounds": by_round, "host_probe_by_round": probes,
        "profiled_attempts": profiled_attempts,
        "emulated_link": delay > 0, "tokens_per_step": tokens,
        "systems": {s: {"tokens_per_s": tokens / statistics.median(v["times"]), "step_s": statistics.median(v["times"]),
                        "idle_fraction": statistics.median(v["idle"]), "peak_rss_bytes": max(v["rss"]),
                        "peak_heap_bytes": heap[s], "step_s_by_round": v["by_round"],
                        **({"ops_through_mode": v["mode_ops"]} if "mode_ops" in v else {}),
                        **(_op_report(v["op_times"]) if "op_times" in v else {}),
                        **{(k if k.startswith("main_") else f"checker_{k}"): statistics.median(x)
                           for k, x in v["where"].items()}}
                    for s, v in per.items()},
        "coverage": coverage["coverage"], "compute_ops": coverage["compute_ops"], "by_strategy": coverage["by_strategy"],
        "detected": engine.totals["detected"] - 0,
        "plan_summary": {str(k): v.summary for k, v in (plans or {}).items()},
        # what the full plan still checks naively (on the critical path), by phase: ops and profiled time
        "plan_naive_by_phase": _naive_by_phase(plans[PHASES["sparetrain"]]) if plans else {},
    }
    trainer.close()
    return out


def _op_report(times: dict[str, list]) -> dict[str, Any]:
    """``--op-times``' figures of one system on one rank, a step: each op's thread CPU time and calls, the most
    costly first, and their total."""
    order = sorted(times.items(), key=lambda kv: -kv[1][0])
    return {"op_cpu_s": {k: {"cpu_s": cpu, "calls": calls} for k, (cpu, calls) in order},
            "op_cpu_s_total": sum(cpu for cpu, _ in times.values())}


def op_differences(rank: dict[str, Any], slow: str = "sparetrain", fast: str = "naive", top: int = 10) -> list[dict]:
    """Where one rank's ``slow`` system spends more CPU in its ops than ``fast`` does in the same ops (``--op-times``):
    the ``top`` ops by the difference a step, each with both systems' time and calls."""
    a, b = (rank["systems"].get(x, {}).get("op_cpu_s", {}) for x in (slow, fast))
    zero = {"cpu_s": 0.0, "calls": 0}
    rows = []
    for k in set(a) | set(b):
        x, y = a.get(k, zero), b.get(k, zero)
        rows.append({"op": k, f"{slow}_s": x["cpu_s"], f"{fast}_s": y["cpu_s"], f"{slow}_calls": x["calls"],
                     f"{fast}_calls": y["calls"], "difference_s": x["cpu_s"] - y["cpu_s"]})
    return sorted(rows, key=lambda r: -r["difference_s"])[:top]


def merge(ranks: list[dict[str, Any]], systems: list[str]) -> dict[str, Any]:
    """One result for the run: throughput from rank 0 (every stage takes the same step time), idle and
    memory over ranks (mean idle, max memory), coverage the minimum over ranks."""
    r0 = ranks[0]["systems"]
    heap_known = all(r["systems"][s].get("peak_heap_bytes") is not None for r in ranks for s in systems)
    key = "peak_heap_bytes" if heap_known else "peak_rss_bytes"
    tps = {s: r0[s]["tokens_per_s"] for s in systems}
    out: dict[str, Any] = {
        "no_dmr_tokens_per_s": tps.get("none"), "naive_tokens_per_s": tps.get("naive"),
        "sparetrain_tokens_per_s": tps.get("sparetrain"),
        "idle_fraction_measured": statistics.mean(r["systems"]["none"]["idle_fraction"] for r in ranks)
        if "none" in systems else None,
        "idle_fraction_emulated": ranks[0]["emulated_link"], "link_delay_ms": ranks[0]["link_delay_ms"],
        "idle_fraction_calibrated": ranks[0].get("idle_fraction_calibrated"),
        "idle_held": ranks[0].get("hold_idle", False),
        # per timed round, on rank 0 before the round: the host's speed at Python bookkeeping and at kernels
        "host_probe_by_round": ranks[0].get("host_probe_by_round", []),
        # per timed round: the link's delay and the No-DMR steps' idle share (mean over ranks)
        "idle_by_round": ranks[0].get("rounds", []),
        # untimed steps each system ran before the first round, until its heap stopped growing (every rank alike)
        "warm_up_steps": ranks[0].get("warm_up_steps", {}),
        # attempts of the first SpareTrain step that were profiled before the plan was made (``profile_steps``)
        "profiled_attempts": ranks[0].get("profiled_attempts"),
        "coverage": min(r["coverage"] for r in ranks), "detected_in_clean_runs": sum(r["detected"] for r in ranks),
        "peak_memory_bytes": {s: max(r["systems"][s][key] for r in ranks) for s in systems},
        "memory_measure": "heap in use during one untimed step (glibc mallinfo2, sampled)" if key == "peak_heap_bytes"
        else "resident size of the process (shared by every system)",
        "ablation": {s: {"tokens_per_s": tps[s],
                         "overhead_vs_no_dmr": (tps["none"] / tps[s] - 1) if "none" in tps else None}
                     for s in systems if s.startswith("sparetrain")},
        "per_rank": ranks,
    }
    if "none" in tps and "sparetrain" in tps:
        out["overhead_vs_no_dmr"] = tps["none"] / tps["sparetrain"] - 1
    if "naive" in tps and "sparetrain" in tps:
        out["gain_vs_naive"] = tps["sparetrain"] / tps["naive"] - 1
    if "naive" in tps and "none" in tps:
        # the gain of a verifier that cost nothing at all: no SpareTrain can reach more (the target's ceiling)
        out["gain_ceiling_free_verifier"] = tps["none"] / tps["naive"] - 1
    if FLOOR in tps:
        out["floor_tokens_per_s"] = tps[FLOOR]
        if "none" in tps:
            out["floor_overhead_vs_no_dmr"] = tps["none"] / tps[FLOOR] - 1
        if "naive" in tps:  # the most any engine built on a Python dispatch mode can gain over Naive-Only here
            out["gain_ceiling_python_mode"] = tps[FLOOR] / tps["naive"] - 1
    if any("op_cpu_s_total" in v for v in r0.values()):  # (--op-times)
        out["op_cpu_s_total"] = {s: [r["systems"][s].get("op_cpu_s_total") for r in ranks] for s in systems}
        if "naive" in systems and "sparetrain" in systems:
            out["ops_slower_than_naive"] = [op_differences(r) for r in ranks]
    out.update(paired_by_round(r0))
    return out


def paired_by_round(r0: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The headline ratios (and the floor's, where it ran) round by round, each from the median steps of one round
    (the systems of a round ran back to back on the same link, so slow drift of the host cancels in the pair), and
    the worst round of each: how far one run's figures move, seen within the run."""
    rounds = {s: v.get("step_s_by_round") or [] for s, v in r0.items()}
    out: dict[str, Any] = {}
    for key, slow, fast, worst in (("overhead_vs_no_dmr", "sparetrain", "none", max),
                                   ("gain_vs_naive", "naive", "sparetrain", min),
                                   ("floor_overhead_vs_no_dmr", FLOOR, "none", max),
                                   ("gain_ceiling_python_mode", "naive", FLOOR, min)):
        a, b = rounds.get(slow, []), rounds.get(fast, [])
        if a and len(a) == len(b):
            pairs = [x / y - 1 for x, y in zip(a, b)]
            out.setdefault("by_round", {})[key] = pairs
            out[f"{key}_worst_round"] = worst(pairs)
    return out


def main(argv: list[str]) -> int:
    out_dir, spec_path = argv
    spec = json.loads(Path(spec_path).read_text())
    res = run_rank(spec)
    Path(out_dir, f"rank{res['rank']}.json").write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    exit_rank(main(sys.argv[1:]))  # (a rank: leave without torch's gloo teardown, see exit_rank)
