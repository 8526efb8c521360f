"""Cluster planning: which fault-tolerance scheme, redundancy and checkpoint period to use, and how sure we are.

Relies on :mod:`trainguard.sim.theory` (closed forms), :mod:`trainguard.sim.timetotrain` (paired simulation
on shared failure trails), :mod:`trainguard.sim.stats` (Student-t intervals over trails) and
:mod:`trainguard.sim.plan_file` (the plan as TOML).

:func:`plan_cluster` evaluates CKPT-only, Rep+CKPT (r = 2..8) and SPARe+CKPT (every r whose Golomb ruler the
group count supports) by theory (paper eq. 1, 2, 5-7: exponential failures) and, unless ``simulate`` is
off, by simulation on ``seeds`` shared failure trails. The headline is the row with the smallest ranked
time among *all* rows shown, checkpoint-only included, with its 95% interval; the runner-up and the paired
difference to it say whether the choice is clear. Theory rows that fall outside the simulation's interval,
and a theory pick that the simulation finds slower, are reported. A sensitivity table re-plans with each
uncertain input moved (Weibull shape, renewal at restart, restart time, per-GPU MTBF, checkpoint time) on
the same trails, and names the input that moves the result most.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from trainguard.errors import TrainguardError
from trainguard.sim import theory
from trainguard.sim.plan_file import SparePlan
from trainguard.sim.stats import paired_diff_ci, paired_gain_ci
from trainguard.sim.timetotrain import ClusterParams, layout_for, run_jobs, spare_redundancies, summarize

DAY = 86400.0


@dataclass
class PlanOptions:
    seeds: int = 5                 # failure trails per (scheme, r)
    simulate: bool = True          # False: theory only (no intervals)
    sensitivity: bool = True
    rep_r_max: int = 8
    r_max: int | None = None       # SPARe redundancy cap (default: the longest ruler the group count allows)
    max_spare_simulated: int = 12  # simulate at most this many SPARe redundancies (a grid, refined at the best)
    workers: int = 1
    progress: bool = False


# ----------------------------------------------------------------------------- rows
def theory_row(scheme: str, n: int, r: int, p: ClusterParams) -> dict:
    tc, ta = p.stack_compute_s, p.allreduce_time_s(n, n)
    th = theory.scheme_theory(scheme, n, r, p.cluster_failure_mtbf_s(n), p.checkpoint_s, p.restart_s, tc, ta)
    th["time_to_train_days"] = th["normalized_time_to_train"] * p.base_time_s(n) / DAY
    return th


def _sim_fields(summary: dict) -> dict:
    return {"sim_time_to_train_days": summary["time_to_train_days"],
            "sim_time_to_train_days_ci": summary["time_to_train_days_ci"],
            "sim_per_seed_days": summary["per_seed_days"], "sim_availability": summary["availability"],
            "sim_mean_stacks_per_step": summary["mean_stacks_per_step"],
            "sim_global_restarts": summary["global_restarts"], "sim_finished": summary["finished"],
            "sim_progress": summary["progress"]}


def _grid(rs: list[int], k: int, around: list[int]) -> list[int]:
    if len(rs) <= k:
        return list(rs)
    idx = {round(i * (len(rs) - 1) / (k - 1)) for i in range(k)}
    pick = {rs[i] for i in idx}
    for r in around:
        pick |= {x for x in rs if abs(x - r) <= 1}
    return sorted(pick)


def _key(simulate: bool) -> str:
    return "sim_time_to_train_days" if simulate else "time_to_train_days"


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def evaluate(p: ClusterParams, n: int, jobs: list[tuple[str, int]], seeds: list[int], simulate: bool,
             workers: int = 1, on_job=None) -> list[dict]:
    """Theory (and simulation on the shared trails of ``seeds``) for every ``(scheme, r)`` of ``jobs``."""
    rows = [theory_row(s, n, r, p) for s, r in jobs]
    if simulate and jobs:
        sims = run_jobs(jobs, n, seeds, p, workers=workers, progress_cb=on_job)
        for row, runs in zip(rows, sims):
            row.update(_sim_fields(summarize(runs)))
    return rows


def _best(rows: list[dict], key: str, scheme: str | None = None) -> dict | None:
    c = [x for x in rows if (scheme is None or x["scheme"] == scheme) and _finite(x.get(key))]
    return min(c, key=lambda x: (x[key], x["redundancy"])) if c else None


def _gain(bs: dict | None, br: dict | None, simulate: bool) -> tuple[float, list[float]]:
    if not bs or not br:
        return math.nan, [math.nan, math.nan]
    if simulate:
        g = paired_gain_ci(bs["sim_per_seed_days"], br["sim_per_seed_days"])
        return g.mean, [g.lo, g.hi]
    return 1.0 - bs["time_to_train_days"] / br["time_to_train_days"], [math.nan, math.nan]


def _label(row: dict | None) -> str:
    if row is None:
        return "none"
    names = {"spare": "SPARe+CKPT", "replication": "Rep+CKPT", "checkpoint": "CKPT-only"}
    return names[row["scheme"]] + (f" r={row['redundancy']}" if row["scheme"] != "checkpoint" else "")


def recommend(rows: list[dict], simulate: bool) -> dict:
    """Headline, best per scheme, SPARe gain over Rep, runner-up and theory-vs-simulation findings."""
    key = _key(simulate)
    rec = _best(rows, key)
    best = {s: _best(rows, key, s) for s in ("spare", "replication", "checkpoint")}
    gain, gain_ci = _gain(best["spare"], best["replication"], simulate)
    out = {"recommended": rec, "best": best, "gain_vs_replication": gain, "gain_vs_replication_ci": gain_ci,
           "ranked_by": key}
    others = [x for x in rows if x is not rec and _finite(x.get(key))]
    runner = min(others, key=lambda x: x[key]) if others else None
    margin = None
    if rec and runner:
        if simulate:
            dci = paired_diff_ci(runner["sim_per_seed_days"], rec["sim_per_seed_days"])
            margin = {"runner_up": _label(runner), "runner_up_days": runner[key], "margin_days": dci.mean,
                      "margin_days_ci": [dci.lo, dci.hi], "clear": bool(_finite(dci.lo) and dci.lo > 0)}
        else:
            margin = {"runner_up": _label(runner), "runner_up_days": runner[key],
                      "margin_days": runner[key] - rec[key], "margin_days_ci": [math.nan, math.nan], "clear": None}
    out["runner_up"] = margin
    if simulate:
        out["theory_vs_simulation"] = theory_vs_simulation(rows)
    return out


def theory_vs_simulation(rows: list[dict]) -> dict:
    """Where theory (exponential failures, eq. 7) and the simulation disagree beyond the simulation's interval."""
    outside = []
    for x in rows:
        lo, hi = x.get("sim_time_to_train_days_ci", [math.nan, math.nan])
        th = x["time_to_train_days"]
        if _finite(lo) and _finite(hi) and not (lo <= th <= hi):
            outside.append({"scheme": x["scheme"], "redundancy": x["redundancy"], "theory_days": th,
                            "sim_days": x["sim_time_to_train_days"], "sim_ci": [lo, hi]})
        elif not _finite(x.get("sim_time_to_train_days")) and _finite(th):
            outside.append({"scheme": x["scheme"], "redundancy": x["redundancy"], "theory_days": th,
                            "sim_days": x.get("sim_time_to_train_days"), "sim_ci": [lo, hi]})
    t_pick = _best(rows, "time_to_train_days")
    s_pick = _best(rows, "sim_time_to_train_days")
    agree = t_pick is s_pick
    diff = None
    if t_pick and s_pick and not agree:
        d = paired_diff_ci(t_pick["sim_per_seed_days"], s_pick["sim_per_seed_days"])
        diff = {"mean": d.mean, "ci": [d.lo, d.hi]}
    significant = bool(diff and ((_finite(diff["ci"][0]) and diff["ci"][0] > 0) or diff["mean"] == math.inf))
    if agree:
        msg = f"theory and simulation pick the same plan ({_label(s_pick)})"
    else:
        msg = (f"theory picks {_label(t_pick)} ({t_pick['time_to_train_days']:.3g} days by eq. 7) but the simulation "
               f"ranks {_label(s_pick)} first; on the same trails the theory's pick is "
               + (f"{diff['mean']:+.3g} days [{diff['ci'][0]:+.3g}, {diff['ci'][1]:+.3g}] slower"
                  if diff and _finite(diff["mean"]) else "not finished") +
               ("" if significant else " (not significant at 95%)"))
    return {"agree": agree, "theory_pick": _label(t_pick), "simulation_pick": _label(s_pick),
            "theory_pick_slower_by_days": diff, "significant": significant, "rows_outside_interval": outside,
            "message": msg}


# ----------------------------------------------------------------------------- the plan
def _jobs(n: int, p: ClusterParams, opts: PlanOptions) -> tuple[list[tuple[str, int]], list[int], dict]:
    spare_rs, skipped = spare_redundancies(n, p, opts.r_max)
    rep = [("replication", r) for r in range(2, min(opts.rep_r_max, n) + 1)]
    return [("checkpoint", 1)] + rep + [("spare", r) for r in spare_rs], spare_rs, skipped


def _sim_cap(rows: list[dict], p: ClusterParams, n: int) -> float:
    th = [x["time_to_train_days"] for x in rows if _finite(x["time_to_train_days"])]
    base = p.base_time_s(n) / DAY
    return min(p.max_days, max(4.0 * min(th) if th else p.max_days, 2.0 * base))


def _simulate_rows(p: ClusterParams, n: int, rows: list[dict], spare_rs: list[int], seeds: list[int],
                   opts: PlanOptions, bar) -> list[dict]:
    """Simulate CKPT-only, every Rep r and a grid of SPARe r (refined around the best) on the same trails."""
    th_best = _best(rows, "time_to_train_days", "spare")
    grid = _grid(spare_rs, opts.max_spare_simulated, [th_best["redundancy"]] if th_best else [])
    todo = [(x["scheme"], x["redundancy"]) for x in rows if x["scheme"] != "spare" or x["redundancy"] in grid]
    done: dict[tuple[str, int], dict] = {}

    def run(jobs):
        sims = run_jobs(jobs, n, seeds, p, workers=opts.workers, progress_cb=lambda s, r: bar.advance(f"{s} r={r}"))
        for job, runs in zip(jobs, sims):
            done[job] = summarize(runs)

    run(todo)
    sp = [done[j] for j in done if j[0] == "spare" and done[j]["finished"]]
    if sp and len(grid) < len(spare_rs):
        b = min(sp, key=lambda x: x["time_to_train_days"])["redundancy"]
        extra = [("spare", r) for r in spare_rs if abs(r - b) <= 2 and ("spare", r) not in done]
        if extra:
            run(extra)
    return [{**x, **_sim_fields(done[(x["scheme"], x["redundancy"])])} if (x["scheme"], x["redundancy"]) in done
            else x for x in rows]


SENSITIVITY_INPUTS = ("weibull_shape", "renewal", "restart_s", "gpu_mtbf_hours", "checkpoint_s")


def _variants(p: ClusterParams) -> list[tuple[str, object, ClusterParams]]:
    out = []
    if p.failure_model == "weibull":
        for v in (0.5, 0.7, 1.0):
            if abs(v - p.weibull_shape) > 1e-12:
                out.append(("weibull_shape", v, replace(p, weibull_shape=v)))
        other = "failure" if p.renewal == "restart" else "restart"
        out.append(("renewal", other, replace(p, renewal=other)))
    for name in ("restart_s", "gpu_mtbf_hours", "checkpoint_s"):
        if name == "gpu_mtbf_hours" and p.failure_model == "trace":
            continue
        base = getattr(p, name)
        for f in (0.5, 2.0):
            if base * f > 0 or name == "restart_s":
                out.append((name, base * f, replace(p, **{name: base * f})))
    return out


def sensitivity(p: ClusterParams, n: int, base: dict, spare_rs: list[int], seeds: list[int], simulate: bool,
                opts: PlanOptions, bar) -> dict:
    """Re-plan with each uncertain input moved, on the same trails, near the baseline's best ``r``."""
    key = _key(simulate)
    b_rec, b_best = base["recommended"], base["best"]
    rows = [{"input": "baseline", "value": None, **_sens_row(base, key)}]
    for name, value, p2 in _variants(p):
        jobs = [("checkpoint", 1)]
        rep_r = {b_best["replication"]["redundancy"]} if b_best.get("replication") else {2, 3}
        th_rep = _best([theory_row("replication", n, r, p2) for r in range(2, min(opts.rep_r_max, n) + 1)],
                       "time_to_train_days")
        th_sp = _best([theory_row("spare", n, r, p2) for r in spare_rs], "time_to_train_days")
        for r in list(rep_r):
            rep_r |= {r - 1, r + 1}
        if th_rep:
            rep_r.add(th_rep["redundancy"])
        jobs += [("replication", r) for r in sorted(rep_r) if 2 <= r <= min(opts.rep_r_max, n)]
        sp_r = set()
        if b_best.get("spare"):
            sp_r |= {r for r in spare_rs if abs(r - b_best["spare"]["redundancy"]) <= 2}
        if th_sp:
            sp_r.add(th_sp["redundancy"])
        jobs += [("spare", r) for r in sorted(sp_r)]
        if simulate:
            p2 = replace(p2, max_days=_sim_cap([theory_row(s, n, r, p2) for s, r in jobs], p2, n))
        ev = evaluate(p2, n, jobs, seeds, simulate, opts.workers,
                      on_job=(lambda s, r, nm=name: bar.advance(f"{nm}: {s} r={r}")) if simulate else None)
        res = recommend(ev, simulate)
        row = {"input": name, "value": value, **_sens_row(res, key)}
        rec = res["recommended"]
        row["scheme_changes"] = bool(rec and b_rec and rec["scheme"] != b_rec["scheme"])
        row["plan_changes"] = bool(rec and b_rec and (rec["scheme"], rec["redundancy"]) != (b_rec["scheme"], b_rec["redundancy"]))
        rows.append(row)
    rows[0]["scheme_changes"] = rows[0]["plan_changes"] = False
    spread = {}
    for name in SENSITIVITY_INPUTS:
        vals = [r for r in rows if r["input"] in (name, "baseline")]
        if len(vals) < 2:
            continue
        t = [r["time_to_train_days"] for r in vals if _finite(r["time_to_train_days"])]
        g = [r["spare_gain_vs_replication"] for r in vals if _finite(r["spare_gain_vs_replication"])]
        spread[name] = {"time_spread_days": (max(t) - min(t)) if t else math.nan,
                        "gain_spread": (max(g) - min(g)) if g else math.nan,
                        "changes_scheme": any(r["scheme_changes"] for r in vals)}
    by_time = max(spread, key=lambda k: spread[k]["time_spread_days"] if _finite(spread[k]["time_spread_days"]) else -1,
                  default=None)
    by_gain = max(spread, key=lambda k: spread[k]["gain_spread"] if _finite(spread[k]["gain_spread"]) else -1,
                  default=None)
    return {"rows": rows, "spread": spread, "most_influential_on_time": by_time, "most_influential_on_gain": by_gain}


def _sens_row(res: dict, key: str) -> dict:
    rec = res["recommended"]
    ci = rec.get("sim_time_to_train_days_ci", [math.nan, math.nan]) if rec else [math.nan, math.nan]
    return {"recommended": _label(rec), "recommended_scheme": rec["scheme"] if rec else None,
            "recommended_redundancy": rec["redundancy"] if rec else None,
            "time_to_train_days": rec[key] if rec else math.nan, "time_to_train_days_ci": ci,
            "spare_gain_vs_replication": res["gain_vs_replication"],
            "spare_gain_vs_replication_ci": res["gain_vs_replication_ci"],
            "best_spare_redundancy": res["best"]["spare"]["redundancy"] if res["best"].get("spare") else None,
            "best_replication_redundancy": res["best"]["replication"]["redundancy"] if res["best"].get("replication") else None}


def make_plan(rec: dict, n: int, p: ClusterParams, seeds: list[int], simulate: bool) -> SparePlan:
    """The chosen row as a :class:`SparePlan` (step time, checkpoint interval in seconds and in steps)."""
    tc, ta = p.stack_compute_s, p.allreduce_time_s(n, n)
    stacks = rec.get("sim_mean_stacks_per_step", rec["stacks_per_step"]) if simulate else rec["stacks_per_step"]
    step = stacks * tc + ta
    T = rec["checkpoint_period_s"]
    ci = rec.get("sim_time_to_train_days_ci", [math.nan, math.nan])
    slots: list[int] = []
    if p.gpus_per_domain > 0 and p.domain_aware and rec["scheme"] != "checkpoint":
        slots = [int(x) for x in layout_for(rec["scheme"], n, rec["redundancy"], p).slot_of]
        if slots == list(range(n)):
            slots = []
    key = _key(simulate)
    return SparePlan(
        scheme=rec["scheme"], groups=n, redundancy=rec["redundancy"], gpus_per_group=p.gpus_per_group(n),
        checkpoint_every_steps=max(1, round((T - p.checkpoint_s) / step)) if math.isfinite(T) else 2**62,
        checkpoint_interval_s=T if math.isfinite(T) else 1e300, checkpoint_save_s=p.checkpoint_s,
        step_time_s=step, stack_compute_s=tc, allreduce_s=ta, steps=p.base_steps,
        expected_time_to_train_days=rec[key], expected_time_to_train_days_lo=ci[0],
        expected_time_to_train_days_hi=ci[1],
        expected_availability=rec.get("sim_availability", rec["availability"]) if simulate else rec["availability"],
        mean_stacks_per_step=stacks, ranked_by="simulation" if simulate else "theory",
        seeds=list(seeds) if simulate else [], domain_slots=slots,
        inputs={k: v for k, v in asdict(p).items() if v is not None},  # TOML has no null
    )


def plan_cluster(p: ClusterParams, n: int, opts: PlanOptions | None = None) -> dict:
    """Plan a cluster of ``n`` groups (``p.total_gpus`` GPUs, see the module docstring)."""
    from trainguard.utils import TaskBar

    opts = opts or PlanOptions()
    p.validate()
    if n < 2:
        raise TrainguardError(f"{p.total_gpus} GPUs give {n} data-parallel group(s); planning needs >= 2")
    if opts.simulate and opts.seeds < 1:
        raise TrainguardError(f"--seeds must be >= 1 to simulate, got {opts.seeds}")
    seeds = list(range(opts.seeds)) if opts.simulate else []
    jobs, spare_rs, skipped = _jobs(n, p, opts)
    rows = evaluate(p, n, jobs, [], False)
    notes = []
    cap = None
    bar = TaskBar(opts.progress, "plan cluster", 1)
    try:
        if opts.simulate:
            cap = _sim_cap(rows, p, n)
            p_sim = replace(p, max_days=cap)
            n_sp = len(_grid(spare_rs, opts.max_spare_simulated, []))
            n_var = len(_variants(p)) if opts.sensitivity else 0
            if bar.bar is not None:
                bar.bar.update(bar.task, total=(len(jobs) - len(spare_rs) + n_sp + 4) * (1 + n_var))
            rows = _simulate_rows(p_sim, n, rows, spare_rs, seeds, opts, bar)
            if cap < p.max_days:
                notes.append(f"simulated runs stop at {cap:.3g} days (4x the best theory time): a row shown as inf "
                             "did not finish by then")
        base = recommend(rows, opts.simulate)
        sens = None
        if opts.sensitivity:
            sens = sensitivity(p, n, base, spare_rs, seeds, opts.simulate, opts, bar)
            if not opts.simulate:
                notes.append("theory-only sensitivity: the theory assumes exponential failures, so Weibull shape "
                             "and renewal rows equal the baseline")
    finally:
        bar.stop()
    rec, best = base["recommended"], base["best"]
    key = base["ranked_by"]
    if rec is None:
        raise TrainguardError("no scheme finishes the training within the simulated horizon; raise --max-days or "
                              "check the inputs (MTBF, restart, checkpoint time)")
    tc, ta = p.stack_compute_s, p.allreduce_time_s(n, n)
    steps = p.base_steps
    rep_b = best.get("replication")
    failure_free = {
        "checkpoint_days": steps * (tc + ta) / DAY,
        "spare_days": steps * (tc + ta) / DAY,
        "replication_days": steps * (rep_b["stacks_per_step"] * tc + ta) / DAY if rep_b else None,
        "spare_stacks_no_failure": 1,
        "spare_stacks_after_first_failure": 2,
        "spare_mean_stacks_simulated": best["spare"].get("sim_mean_stacks_per_step") if best.get("spare") else None,
        "statement": ("With no failure since the last restart SPARe computes 1 stack per step, the same as plain data "
                      "parallelism (0% extra compute; it only keeps r data shards per group ready). After the first "
                      "masked failure it computes ceil(N/(N-k)) >= 2 stacks per step until the next global restart; "
                      f"Rep+CKPT always computes N/b = {rep_b['stacks_per_step']:.3g} stacks." if rep_b else
                      "With no failure SPARe computes 1 stack per step (plain data parallelism)."),
    }
    unused = p.unused_gpus(n)
    if unused:
        notes.append(f"{unused} GPU(s) do not fill a group of {p.gpus_per_group(n)} and are left out of the plan")
    for r, why in skipped.items():
        notes.append(f"SPARe r={r} skipped: {why}")
    tvs = base.get("theory_vs_simulation")
    if tvs and not tvs["agree"]:
        notes.append(tvs["message"])
    plan = make_plan(rec, n, p, seeds, opts.simulate)
    r_max = max(spare_rs) if spare_rs else 1
    return {
        "groups": n, "gpus_per_group": p.gpus_per_group(n), "unused_gpus": unused,
        "cluster_failure_mtbf_min": p.cluster_failure_mtbf_s(n) / 60, "base_time_to_train_days": p.base_time_s(n) / DAY,
        "recommended_scheme": rec["scheme"], "recommended": _label(rec),
        "recommended_redundancy": rec["redundancy"],
        "recommended_checkpoint_period_min": rec["checkpoint_period_s"] / 60,
        "expected_availability": rec.get("sim_availability") if opts.simulate else rec["availability"],
        "expected_time_to_train_days": rec[key],
        "expected_time_to_train_days_ci": rec.get("sim_time_to_train_days_ci", [math.nan, math.nan]),
        "runner_up": base["runner_up"], "thm43_redundancy": theory.optimal_redundancy_formula(n),
        "first_capacity_transition_redundancy": theory.optimal_redundancy_transition(n, r_max),
        "best": best, "gain_vs_replication": base["gain_vs_replication"],
        "gain_vs_replication_ci": base["gain_vs_replication_ci"], "theory_vs_simulation": tvs,
        "sensitivity": sens["rows"] if sens else [], "sensitivity_spread": sens["spread"] if sens else {},
        "sensitivity_most_influential": ({"on_time": sens["most_influential_on_time"],
                                          "on_gain": sens["most_influential_on_gain"]} if sens else None),
        "failure_free": failure_free, "simulation_cap_days": cap, "seeds": seeds, "skipped_redundancies": skipped,
        "notes": notes, "rows": rows, "params": p.as_dict(), "ranked_by": key, "plan": asdict(plan),
        "allreduce_s": ta, "stack_compute_s": tc,
    }
