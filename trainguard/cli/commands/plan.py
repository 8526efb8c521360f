"""``trainguard plan``: what to configure at my scale.

``plan cluster --gpus G --gpus-per-group K --mtbf-per-gpu-hours H --restart-minutes R --checkpoint-minutes C``
recommends the SPARe redundancy ``r`` and checkpoint period, with expected availability and time-to-train
for SPARe+CKPT, Rep+CKPT and CKPT-only (theory: eq. 1, 2, 5-7 of the SPARe paper; ``--simulate`` adds the
Weibull discrete-event simulation), and writes figures (time-to-train, availability, stacks per step vs
r) into ``--out`` (default ``runs/plan-cluster``).

Extension hook: ``plan`` owns an argparse sub-parser group. Other modules add ``plan`` subcommands without
editing this file: at the end of :func:`register`, ``trainguard.cli.commands._plan_abft`` is imported if
it exists and its ``register_plan(plan_subparsers)`` is called (an ``ImportError`` skips it). The leading
underscore keeps the command auto-discovery of ``trainguard.cli.main`` from registering it as a
top-level command. :data:`PLAN_SUBPARSERS` also exposes the group after registration.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path

from trainguard.cli.output import add_json_flag, console, emit_json, table
from trainguard.errors import TrainguardError

PLAN_SUBPARSERS = None
_EXTENSIONS = ("trainguard.cli.commands._plan_abft", "trainguard.cli.commands._plan_dmr")


def _check(name: str, v: float, lo: float = 0.0, strict: bool = True) -> None:
    if v is None or not math.isfinite(v) or (v <= lo if strict else v < lo):
        raise TrainguardError(f"--{name} must be {'>' if strict else '>='} {lo}, got {v}")


def plan_cluster(gpus: int, gpus_per_group: int, mtbf_gpu_h: float, restart_min: float, ckpt_min: float,
                 stack_s: float | None = None, steps: int | None = None,
                 allreduce_per_group_s: float | None = None,
                 simulate: bool = False, seeds: int = 1, weibull_shape: float = 0.7) -> dict:
    """Theory (and optionally simulation) for every r; the recommendation is the theory's argmin."""
    from trainguard.failover.spare.placement import max_supported_redundancy
    from trainguard.sim import theory
    from trainguard.sim.timetotrain import ClusterParams, simulate_many

    dflt = ClusterParams()  # step-time defaults and their sources live there
    stack_s = dflt.stack_compute_s if stack_s is None else stack_s
    steps = dflt.base_steps if steps is None else steps
    allreduce_per_group_s = dflt.allreduce_per_group_s if allreduce_per_group_s is None else allreduce_per_group_s
    n = gpus // gpus_per_group
    if n < 2:
        raise TrainguardError(f"{gpus} GPUs in groups of {gpus_per_group} give {n} data-parallel group(s); need >= 2")
    p = ClusterParams(total_gpus=n * gpus_per_group, gpu_mtbf_hours=mtbf_gpu_h, weibull_shape=weibull_shape,
                      restart_s=restart_min * 60, checkpoint_s=ckpt_min * 60, stack_compute_s=stack_s,
                      base_steps=steps, allreduce_per_group_s=allreduce_per_group_s)
    m = p.cluster_failure_mtbf_s()
    ta = p.allreduce_s(n)
    T0 = p.base_time_s(n)
    r_max = max_supported_redundancy(n)
    rows = []
    for scheme, rs in (("checkpoint", [1]), ("replication", range(2, min(8, n) + 1)), ("spare", range(2, r_max + 1))):
        for r in rs:
            th = theory.scheme_theory(scheme, n, r, m, p.checkpoint_s, p.restart_s, stack_s, ta)
            th["time_to_train_days"] = th["normalized_time_to_train"] * T0 / 86400
            if simulate:
                sm = simulate_many(scheme, n, r, list(range(seeds)), p)
                th.update({f"sim_{k}": sm[k] for k in ("time_to_train_days", "availability", "mean_stacks_per_step",
                                                         "global_restarts", "finished")})
            rows.append(th)

    def best(scheme, key):
        c = [x for x in rows if x["scheme"] == scheme and math.isfinite(x.get(key, math.inf))]
        return min(c, key=lambda x: x[key]) if c else None

    key = "sim_time_to_train_days" if simulate else "time_to_train_days"
    rec = {s: best(s, key) for s in ("spare", "replication", "checkpoint")}
    bs, br = rec["spare"], rec["replication"]
    return {
        "groups": n, "gpus_per_group": gpus_per_group, "cluster_failure_mtbf_min": m / 60,
        "base_time_to_train_days": T0 / 86400,
        "recommended_redundancy": bs["redundancy"] if bs else None,
        "recommended_checkpoint_period_min": bs["checkpoint_period_s"] / 60 if bs else None,
        "expected_availability": (bs["sim_availability"] if simulate else bs["availability"]) if bs else None,
        "expected_time_to_train_days": bs[key] if bs else None,
        "thm43_redundancy": theory.optimal_redundancy_formula(n),
        "first_capacity_transition_redundancy": theory.optimal_redundancy_transition(n, r_max),
        "best": rec,
        "gain_vs_replication": (1 - bs[key] / br[key]) if bs and br else None,
        "rows": rows, "params": p.as_dict(), "ranked_by": key,
    }


def cmd_cluster(args) -> int:
    _check("gpus", args.gpus)
    _check("gpus-per-group", args.gpus_per_group)
    _check("mtbf-per-gpu-hours", args.mtbf_per_gpu_hours)
    _check("restart-minutes", args.restart_minutes, strict=False)
    _check("checkpoint-minutes", args.checkpoint_minutes)
    if args.stack_seconds is not None:
        _check("stack-seconds", args.stack_seconds)
    if args.steps is not None:
        _check("steps", args.steps)
    if args.gpus_per_group > args.gpus:
        raise TrainguardError(f"--gpus-per-group {args.gpus_per_group} exceeds --gpus {args.gpus}")
    res = plan_cluster(args.gpus, args.gpus_per_group, args.mtbf_per_gpu_hours, args.restart_minutes,
                       args.checkpoint_minutes, args.stack_seconds, args.steps, simulate=args.simulate,
                       seeds=args.seeds, weibull_shape=args.weibull_shape)
    from trainguard.report.figures import line_plot

    out = Path(args.out)
    rs = sorted({x["redundancy"] for x in res["rows"] if x["scheme"] != "checkpoint"})
    ck = res["best"]["checkpoint"]

    def col(scheme, k):
        d = {x["redundancy"]: x.get(k) for x in res["rows"] if x["scheme"] == scheme}
        return [d.get(r) for r in rs]

    figs = {}
    sim = args.simulate
    for key, label in (("time_to_train_days", "time-to-train [days]"), ("availability", "availability"),
                       ("stacks_per_step", "stacks per step")):
        series = {"SPARe+CKPT (theory)": col("spare", key), "Rep+CKPT (theory)": col("replication", key)}
        if sim:
            skey = {"stacks_per_step": "sim_mean_stacks_per_step"}.get(key, f"sim_{key}")
            series["SPARe+CKPT (sim)"] = col("spare", skey)
            series["Rep+CKPT (sim)"] = col("replication", skey)
        hl = ck.get(key) if ck and key != "stacks_per_step" and math.isfinite(ck.get(key, math.inf)) else None
        figs[key] = str(line_plot(out / f"{key}_vs_r.png", rs, series, xlabel="redundancy r", ylabel=label,
                                  title=f"N = {res['groups']} groups of {res['gpus_per_group']} GPUs"
                                        + (" (grey: CKPT-only)" if hl else ""), hline=hl))
    res["figures"] = figs
    if args.json:
        emit_json(res)
        return 0
    summary = {k: res[k] for k in ("groups", "cluster_failure_mtbf_min", "base_time_to_train_days",
                                   "recommended_redundancy", "recommended_checkpoint_period_min",
                                   "expected_availability", "expected_time_to_train_days", "thm43_redundancy",
                                   "first_capacity_transition_redundancy", "gain_vs_replication")}
    console.print(table("SPARe cluster plan", summary))
    k = res["ranked_by"]
    console.print(table("best per scheme", [(s, b["redundancy"], b["checkpoint_period_s"] / 60, b["availability"], b[k])
                                            for s, b in res["best"].items() if b],
                        columns=("scheme", "r", "ckpt period [min]", "availability (theory)", k)))
    console.print(f"figures: {', '.join(figs.values())}")
    return 0


def register(subparsers) -> None:
    global PLAN_SUBPARSERS
    parser = subparsers.add_parser("plan", help="recommend fault-tolerance settings for a cluster")
    sub = parser.add_subparsers(dest="plan_command", metavar="SUBCOMMAND", parser_class=type(parser))
    parser.set_defaults(handler=lambda a: (parser.print_help(), 2)[1])
    c = sub.add_parser("cluster", help="SPARe redundancy, checkpoint period, availability, time-to-train")
    c.add_argument("--gpus", type=int, required=True)
    c.add_argument("--gpus-per-group", type=int, required=True, help="GPUs per data-parallel group (model replica)")
    c.add_argument("--mtbf-per-gpu-hours", type=float, required=True,
                   help="per-GPU MTBF (Llama 3: 54*24*16384/419 = 50680 h)")
    c.add_argument("--restart-minutes", type=float, required=True, help="global restart cost")
    c.add_argument("--checkpoint-minutes", type=float, required=True, help="checkpoint save time")
    c.add_argument("--stack-seconds", type=float, default=None,
                   help="compute time of one stack (one shard per group); default 10 s, see docs/spare.md")
    c.add_argument("--steps", type=int, default=None,
                   help="training steps (failure-free time = steps x step time); default 8640 (1 day of 10 s stacks)")
    c.add_argument("--weibull-shape", type=float, default=0.7, help="for --simulate")
    c.add_argument("--simulate", action="store_true", help="add the discrete-event simulation (slower)")
    c.add_argument("--seeds", type=int, default=1, help="event trails per (scheme, r) with --simulate")
    c.add_argument("--out", default="runs/plan-cluster", help="folder for the figures")
    add_json_flag(c)
    c.set_defaults(handler=cmd_cluster)
    PLAN_SUBPARSERS = sub
    for name in _EXTENSIONS:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        hook = getattr(mod, "register_plan", None)
        if hook is not None:
            hook(sub)
