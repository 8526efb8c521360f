"""``trainguard spare``: SPARe Monte-Carlo, sweeps and time-to-train simulation.

Subcommands:

* ``montecarlo --groups N --redundancy R --trials T --seed S`` -- failure trails through the real ReCtlr;
  JSON keys ``mean_failures_to_wipeout``, ``theory_failures_to_wipeout`` (eq. 3), ``theory_failures_poisson``,
  ``mean_allreduce_stack``, ``theory_allreduce_stack_lower_bound`` (eq. 6), relative errors, ...
* ``sweep --groups N --trials T`` -- montecarlo for r = 2..max supported.
* ``simulate --groups N --scheme {spare,replication,checkpoint} --redundancy R --seed S`` -- time-to-train
  (``--backend simgrid`` runs the same model on SimGrid 3.32); JSON keys ``time_to_train_days``,
  ``availability``, ``mean_stacks_per_step``, ``global_restarts``.
* ``run --groups N --redundancy R --kill G@STEP ...`` -- real training with stacked shards on torchft
  (:mod:`trainguard.cli.commands._spare_run`).
* ``compare --groups N --seeds K`` -- all schemes over r, best r of each, gain of SPARe+CKPT over Rep+CKPT
  (the paper's Table 2); ``--out DIR`` writes figures.
"""

from __future__ import annotations

import time
from dataclasses import fields

from trainguard.cli.output import add_json_flag, console, emit_json, err_console, table
from trainguard.errors import TrainguardError


def _params(args):
    from trainguard.sim.timetotrain import ClusterParams

    kw = {}
    for f in fields(ClusterParams):
        v = getattr(args, f.name, None)
        if v is not None:
            kw[f.name] = v
    p = ClusterParams(**kw)
    if p.total_gpus < 1 or p.gpu_mtbf_hours <= 0 or p.restart_s < 0 or p.checkpoint_s <= 0 or p.stack_compute_s <= 0:
        raise TrainguardError("cluster parameters must be positive (gpus, MTBF, checkpoint, stack time)")
    return p


def _add_cluster_args(sp) -> None:
    g = sp.add_argument_group("cluster model (defaults: H100 cluster of the SPARe paper, see docs/spare.md)")
    g.add_argument("--total-gpus", dest="total_gpus", type=int)
    g.add_argument("--gpu-mtbf-hours", dest="gpu_mtbf_hours", type=float)
    g.add_argument("--weibull-shape", dest="weibull_shape", type=float)
    g.add_argument("--restart-s", dest="restart_s", type=float)
    g.add_argument("--checkpoint-s", dest="checkpoint_s", type=float)
    g.add_argument("--stack-compute-s", dest="stack_compute_s", type=float)
    g.add_argument("--base-steps", dest="base_steps", type=int)
    g.add_argument("--jitter", dest="jitter", type=float)


def _positive(name, v):
    if v is None or v < 1:
        raise TrainguardError(f"--{name} must be >= 1, got {v}")


def cmd_montecarlo(args) -> int:
    from trainguard.sim.montecarlo import run_montecarlo

    _positive("groups", args.groups)
    _positive("trials", args.trials)
    t = time.perf_counter()
    res = run_montecarlo(args.groups, args.redundancy, args.trials, args.seed, workers=args.workers).as_dict()
    res["elapsed_s"] = time.perf_counter() - t
    if not args.json:
        console.print(table(f"SPARe Monte-Carlo N={args.groups} r={args.redundancy}", res))
    else:
        emit_json(res)
    return 0


def cmd_sweep(args) -> int:
    from trainguard.failover.spare.placement import max_supported_redundancy
    from trainguard.sim.montecarlo import run_montecarlo

    _positive("groups", args.groups)
    _positive("trials", args.trials)
    r_max = args.max_redundancy or max_supported_redundancy(args.groups)
    if r_max < 2:
        raise TrainguardError(f"N={args.groups} supports no redundancy >= 2")
    t = time.perf_counter()
    rows = []
    for r in range(2, r_max + 1):
        rows.append(run_montecarlo(args.groups, r, args.trials, args.seed, workers=args.workers).as_dict())
    elapsed = time.perf_counter() - t
    keys = ("redundancy", "mean_failures_to_wipeout", "theory_failures_to_wipeout", "theory_failures_poisson",
            "rel_error_vs_theory", "rel_error_vs_poisson", "mean_allreduce_stack", "theory_allreduce_stack_lower_bound",
            "mean_stacks_with_patch", "theory_overhead")
    if not args.json:
        console.print(table(f"SPARe Monte-Carlo sweep N={args.groups}, {args.trials} trials ({elapsed:.1f} s)",
                            [tuple(row[k] for k in keys) for row in rows], columns=keys))
    else:
        import numpy as np

        emit_json({"groups": args.groups, "trials": args.trials, "seed": args.seed, "elapsed_s": elapsed,
                   "mape_failures_vs_theory": float(np.mean([abs(x["rel_error_vs_theory"]) for x in rows])),
                   "mape_failures_vs_poisson": float(np.mean([abs(x["rel_error_vs_poisson"]) for x in rows])),
                   "max_abs_error_allreduce_stack": float(max(abs(x["abs_error_allreduce_stack"]) for x in rows)),
                   "rows": rows})
    return 0


def cmd_simulate(args) -> int:
    from trainguard.sim.timetotrain import simulate

    _positive("groups", args.groups)
    p = _params(args)
    if not args.json:
        console.print(table("cluster parameters", p.as_dict()))
    t = time.perf_counter()
    if args.backend == "simgrid":
        from trainguard.sim.simgrid_model import run_in_subprocess, simgrid_available

        ok, why = simgrid_available()
        if not ok:
            raise TrainguardError(why)
        res = run_in_subprocess(args.scheme, args.groups, args.redundancy, args.seed, p, timeout=3600)
    else:
        res = simulate(args.scheme, args.groups, args.redundancy, args.seed, p).as_dict()
    res["elapsed_s"] = time.perf_counter() - t
    res["backend"] = args.backend
    res["params"] = p.as_dict()
    if not args.json:
        th = res.pop("theory")
        res.pop("params")
        console.print(table(f"time-to-train {args.scheme} N={args.groups} r={res['redundancy']}", res))
        console.print(table("theory (eq. 1, 2, 7)", th))
    else:
        emit_json(res)
    return 0


def cmd_compare(args) -> int:
    from trainguard.sim.timetotrain import compare

    _positive("groups", args.groups)
    _positive("seeds", args.seeds)
    p = _params(args)
    t = time.perf_counter()
    res = compare(args.groups, list(range(args.seed, args.seed + args.seeds)), p, args.max_redundancy,
                  progress_cb=(lambda s, r: err_console.print(f"  {s} r={r} done", highlight=False)) if not args.json else None)
    res["elapsed_s"] = time.perf_counter() - t
    res["params"] = p.as_dict()
    if args.out:
        from trainguard.report.figures import line_plot

        rs = sorted({x["redundancy"] for x in res["rows"] if x["scheme"] != "checkpoint"})
        def col(s, k):
            d = {x["redundancy"]: x[k] for x in res["rows"] if x["scheme"] == s}
            return [d.get(r) for r in rs]
        figs = {}
        for key, label in (("time_to_train_days", "time-to-train [days]"), ("availability", "availability"),
                           ("mean_stacks_per_step", "stacks per step")):
            figs[key] = str(line_plot(f"{args.out}/compare_N{args.groups}_{key}.png", rs,
                                      {"SPARe+CKPT": col("spare", key), "Rep+CKPT": col("replication", key)},
                                      xlabel="redundancy r", ylabel=label, title=f"N = {args.groups}"))
        res["figures"] = figs
    if not args.json:
        rows = [(x["scheme"], x["redundancy"], x["time_to_train_days"], x["availability"], x["mean_stacks_per_step"],
                 x["global_restarts"]) for x in res["rows"]]
        console.print(table(f"time-to-train N={args.groups} ({res['elapsed_s']:.1f} s)", rows,
                            columns=("scheme", "r", "days", "availability", "stacks/step", "restarts")))
        bs, br = res["best_spare"], res["best_replication"]
        console.print(f"best SPARe+CKPT r={bs['redundancy'] if bs else None}, best Rep+CKPT r={br['redundancy'] if br else None}, "
                      f"gain {100 * res['gain_vs_replication']:.1f}%")
    else:
        emit_json(res)
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("spare", help="SPARe: Monte-Carlo, theory, time-to-train simulation and the torchft runtime")
    sub = parser.add_subparsers(dest="spare_command", metavar="SUBCOMMAND", parser_class=type(parser))
    parser.set_defaults(handler=lambda a: (parser.print_help(), 2)[1])

    mc = sub.add_parser("montecarlo", help="failure trails through the real controller vs Thm 4.1/4.2")
    mc.add_argument("--groups", type=int, required=True)
    mc.add_argument("--redundancy", type=int, required=True)
    mc.add_argument("--trials", type=int, default=200)
    mc.add_argument("--seed", type=int, default=0)
    mc.add_argument("--workers", type=int, default=None, help="processes (default: CPU count, at most 8)")
    add_json_flag(mc)
    mc.set_defaults(handler=cmd_montecarlo)

    sw = sub.add_parser("sweep", help="montecarlo for every supported redundancy")
    sw.add_argument("--groups", type=int, required=True)
    sw.add_argument("--trials", type=int, default=200)
    sw.add_argument("--seed", type=int, default=0)
    sw.add_argument("--max-redundancy", type=int, default=None)
    sw.add_argument("--workers", type=int, default=None)
    add_json_flag(sw)
    sw.set_defaults(handler=cmd_sweep)

    si = sub.add_parser("simulate", help="time-to-train of one scheme (fast loop or SimGrid)")
    si.add_argument("--groups", type=int, required=True)
    si.add_argument("--scheme", choices=("spare", "replication", "checkpoint"), required=True)
    si.add_argument("--redundancy", type=int, default=1)
    si.add_argument("--seed", type=int, default=0)
    si.add_argument("--backend", choices=("fast", "simgrid"), default="fast")
    _add_cluster_args(si)
    add_json_flag(si)
    si.set_defaults(handler=cmd_simulate)

    co = sub.add_parser("compare", help="SPARe+CKPT vs Rep+CKPT vs CKPT-only over r (paper Table 2)")
    co.add_argument("--groups", type=int, required=True)
    co.add_argument("--seeds", type=int, default=3, help="event trails per (scheme, r) (paper: 3)")
    co.add_argument("--seed", type=int, default=0, help="first seed")
    co.add_argument("--max-redundancy", type=int, default=None)
    co.add_argument("--out", default=None, help="folder for figures")
    _add_cluster_args(co)
    add_json_flag(co)
    co.set_defaults(handler=cmd_compare)

    from trainguard.cli.commands._spare_run import add_run_parser

    add_run_parser(sub)
