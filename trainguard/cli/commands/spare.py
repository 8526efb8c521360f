"""``trainguard spare``: SPARe Monte-Carlo, sweeps and time-to-train simulation.

Subcommands:

* ``montecarlo --groups N --redundancy R --trials T --seed S`` -- failure trails through the real ReCtlr;
  JSON keys ``mean_failures_to_wipeout``, ``theory_failures_to_wipeout`` (eq. 3), ``theory_failures_poisson``,
  ``mean_allreduce_stack``, ``theory_allreduce_stack_lower_bound`` (eq. 6), relative errors, ...
* ``sweep --groups N --trials T`` -- montecarlo for r = 2..max supported.
* ``simulate --groups N --scheme {spare,replication,checkpoint} --redundancy R --seed S`` -- time-to-train
  (``--backend simgrid`` puts the all-reduce and checkpoint traffic on a SimGrid 3.32 platform); JSON keys
  ``time_to_train_days``, ``availability``, ``mean_stacks_per_step``, ``global_restarts``.
* ``run --groups N --redundancy R --kill G@STEP ...`` -- real training with stacked shards on torchft
  (:mod:`trainguard.cli.commands._spare_run`).
* ``compare --groups N --seeds K`` -- all schemes over r on K shared failure trails, best r of each, paired
  gain of SPARe+CKPT over Rep+CKPT with its 95% interval beside the paper's Table 2; ``--out DIR`` figures.
* ``network --groups N [N ...] --gpus-per-group G`` -- all-reduce (and checkpoint) cost from the alpha-beta
  model, and with ``--simgrid`` on a fat-tree / rail-optimized platform with contention.

Every cluster parameter (``ClusterParams``) is a flag: ``--total-gpus``, ``--weibull-shape``, ``--renewal``,
``--hop-latency-s``, ``--shrink-s``, ``--controller-s``, ``--jitter``, ...
"""

from __future__ import annotations

import time
from dataclasses import fields

from trainguard.cli.args import finite_float, seed_int
from trainguard.cli.output import add_json_flag, console, emit_json, err_console, table
from trainguard.errors import TrainguardError

_HELP = {
    "total_gpus": "GPUs in the cluster (those that do not fill a group are reported unused)",
    "gpu_mtbf_hours": "per-GPU mean time between failures (Llama 3: 50680 h)",
    "failure_model": "weibull | exponential | trace",
    "weibull_shape": "Weibull shape (Schroeder & Gibson: 0.7-0.8)",
    "renewal": "restart: Weibull clocks restart at every global restart; failure: only at a GPU's own failure",
    "repair_s": "a failed group is usable again after this (a restart waits for it unless a hot spare is healthy)",
    "hot_spares": "spare groups a global restart may use",
    "gpus_per_domain": "failure domain (rack, leaf switch) size in GPUs",
    "domain_mtbf_hours": "mean time between failures of one domain (0: none)",
    "domain_aware": "spread a type's copies / a replica set over different domains",
    "trace_path": "failure trace CSV for --failure-model trace (time_s or time_h; optional gpu or group)",
    "model_params": "model parameters (gradient = params x grad-bytes-per-param, split over a group's GPUs)",
    "allreduce_algorithm": "ring | halving-doubling (alpha-beta costs, trainguard.sim.collective)",
    "hop_latency_s": "alpha: latency per message (s)",
    "gpu_bandwidth_gbps": "beta: goodput per GPU link (Gb/s)",
    "allreduce_s": "fixed all-reduce time in seconds (replaces the alpha-beta model)",
}


def _params(args):
    from trainguard.sim.timetotrain import ClusterParams

    kw = {}
    for name in ClusterParams.field_names():
        v = getattr(args, name, None)
        if v is not None:
            kw[name] = v
    p = ClusterParams(**kw)
    p.validate()
    return p


def _add_cluster_args(sp) -> None:
    import argparse

    from trainguard.sim.timetotrain import ClusterParams

    g = sp.add_argument_group("cluster model (defaults: H100 cluster of the SPARe paper, see docs/spare.md)")
    for f in fields(ClusterParams):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        help_ = _HELP.get(f.name, "") + f" (default {default})"
        if isinstance(default, bool):
            g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif isinstance(default, int):
            g.add_argument(flag, dest=f.name, type=int, help=help_)
        elif isinstance(default, float) or f.name == "allreduce_s":
            g.add_argument(flag, dest=f.name, type=finite_float, help=help_)
        else:
            g.add_argument(flag, dest=f.name, type=str, help=help_)


def _add_platform_args(sp) -> None:
    g = sp.add_argument_group("SimGrid platform (trainguard.sim.simgrid_model)")
    g.add_argument("--topology", choices=("rail", "fat-tree"), default="rail")
    g.add_argument("--gpus-per-node", type=int, default=8)
    g.add_argument("--nodes-per-leaf", type=int, default=32, help="nodes per leaf switch (fat-tree) or rail pod")
    g.add_argument("--link-gbps", type=finite_float, default=None, help="GPU NIC bandwidth (default: --gpu-bandwidth-gbps)")
    g.add_argument("--link-latency-us", type=finite_float, default=None,
                   help="per link (default: half of --hop-latency-s: a same-leaf path has two links)")
    g.add_argument("--oversubscription", type=finite_float, default=1.0, help="leaf downlink / uplink capacity")
    g.add_argument("--storage-nodes", type=int, default=4)
    g.add_argument("--storage-gbps", type=finite_float, default=400.0)


def _platform(args, p):
    from trainguard.sim.simgrid_model import Platform

    plat = Platform(topology=args.topology, gpus_per_node=args.gpus_per_node, nodes_per_leaf=args.nodes_per_leaf,
                    link_gbps=args.link_gbps if args.link_gbps is not None else p.gpu_bandwidth_gbps,
                    link_latency_s=(args.link_latency_us * 1e-6 if args.link_latency_us is not None
                                    else p.hop_latency_s / 2),
                    oversubscription=args.oversubscription, storage_nodes=args.storage_nodes,
                    storage_gbps=args.storage_gbps)
    plat.validate()
    return plat


def _positive(name, v):
    if v is None or v < 1:
        raise TrainguardError(f"--{name} must be >= 1, got {v}")


def _optional(name, v, low: int = 1):
    """A flag whose absence means its default: when given, at least ``low`` (0 is no alias for the default)."""
    if v is not None and v < low:
        raise TrainguardError(f"--{name} must be >= {low}, got {v}")


def cmd_montecarlo(args) -> int:
    from trainguard.sim.montecarlo import run_montecarlo

    _positive("groups", args.groups)
    _positive("trials", args.trials)
    _optional("workers", args.workers)
    t = time.perf_counter()
    res = run_montecarlo(args.groups, args.redundancy, args.trials, args.seed, workers=args.workers).as_dict()
    res["elapsed_s"] = time.perf_counter() - t
    if not args.json:
        console.print(table(f"SPARe Monte-Carlo N={args.groups} r={args.redundancy}", res))
    else:
        emit_json(res)
    return 0


def cmd_sweep(args) -> int:
    from trainguard.failover.spare.placement import supported_redundancies
    from trainguard.sim.montecarlo import run_montecarlo

    _positive("groups", args.groups)
    _positive("trials", args.trials)
    _optional("workers", args.workers)
    _optional("max-redundancy", args.max_redundancy, 2)
    rs = supported_redundancies(args.groups, args.max_redundancy or 28)
    if not rs:
        raise TrainguardError(f"N={args.groups} supports no redundancy >= 2")
    t = time.perf_counter()
    rows = []
    for r in rs:
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
    _optional("max-steps", args.max_steps)
    if args.scheme == "checkpoint" and args.redundancy != 1:  # (checkpoint-only has no redundancy to set)
        raise TrainguardError(f"--redundancy applies to spare and replication only, got {args.redundancy} "
                              "with --scheme checkpoint")
    p = _params(args)
    if not args.json:
        console.print(table("cluster parameters", p.as_dict()))
    t = time.perf_counter()
    if args.backend == "simgrid":
        from trainguard.sim.simgrid_model import simulate_in_subprocess

        plat = _platform(args, p)
        res = simulate_in_subprocess(args.scheme, args.groups, args.redundancy, args.seed, p, plat,
                                     max_steps=args.max_steps, timeout=3600)
        fast = simulate(args.scheme, args.groups, args.redundancy, args.seed, p, max_steps=args.max_steps,
                        batch=False).as_dict()
        res["fast_loop_time_to_train_days"] = fast["time_to_train_days"]
        res["platform"] = vars(plat)
    else:
        res = simulate(args.scheme, args.groups, args.redundancy, args.seed, p, max_steps=args.max_steps).as_dict()
    res["elapsed_s"] = time.perf_counter() - t
    res["backend"] = args.backend
    res["params"] = p.as_dict()
    if not args.json:
        th = res.pop("theory")
        res.pop("params")
        res.pop("platform", None)
        console.print(table(f"time-to-train {args.scheme} N={args.groups} r={res['redundancy']}", res))
        console.print(table("theory (eq. 1, 2, 7)", th))
    else:
        emit_json(res)
    return 0


# Table 2 of the SPARe paper (arXiv 2603.00357): best Rep+CKPT and SPARe+CKPT time-to-train and the gain.
PAPER_TABLE2 = {
    200: {"replication_days": 6.07, "spare_days": 2.92, "spare_redundancy": 9, "gain": 0.519},
    600: {"replication_days": 4.27, "spare_days": 2.49, "spare_redundancy": 8, "gain": 0.417},
    1000: {"replication_days": 3.88, "spare_days": 2.34, "spare_redundancy": 9, "gain": 0.396},
}


def _pct(x) -> str:
    return "-" if not isinstance(x, float) or x != x else f"{100 * x:.1f}%"


def cmd_compare(args) -> int:
    from trainguard.sim.timetotrain import compare

    _positive("groups", args.groups)
    _positive("seeds", args.seeds)
    _positive("workers", args.workers)
    _optional("max-redundancy", args.max_redundancy, 2)
    p = _params(args)
    if args.out:
        from trainguard.cli.commands.plan import _writable_dir

        _writable_dir(args.out)
    t = time.perf_counter()
    from trainguard.utils import TaskBar

    bar = TaskBar(err_console.is_terminal, f"compare N={args.groups}", 1)
    try:
        res = compare(args.groups, list(range(args.seed, args.seed + args.seeds)), p, args.max_redundancy,
                      progress_cb=lambda s, r: bar.advance(f"{s} r={r}"), workers=args.workers)
    finally:
        bar.stop()
    res["elapsed_s"] = time.perf_counter() - t
    res["params"] = p.as_dict()
    res["paper"] = PAPER_TABLE2.get(args.groups)
    if args.out:
        from trainguard.report.figures import line_plot

        rs = sorted({x["redundancy"] for x in res["rows"] if x["scheme"] != "checkpoint"})

        def col(s, k):
            d = {x["redundancy"]: x[k] for x in res["rows"] if x["scheme"] == s}
            return [d.get(r) for r in rs]
        figs = {}
        for key, label in (("time_to_train_days", "time-to-train [days]"), ("availability", "availability"),
                           ("mean_stacks_per_step", "stacks per step")):
            bands = ({"SPARe+CKPT": col("spare", "time_to_train_days_ci"),
                      "Rep+CKPT": col("replication", "time_to_train_days_ci")} if key == "time_to_train_days" else None)
            figs[key] = str(line_plot(f"{args.out}/compare_N{args.groups}_{key}.png", rs,
                                      {"SPARe+CKPT": col("spare", key), "Rep+CKPT": col("replication", key)},
                                      xlabel="redundancy r", ylabel=label, title=f"N = {args.groups}", bands=bands))
        res["figures"] = figs
    if not args.json:
        rows = [(x["scheme"], x["redundancy"], x["time_to_train_days"],
                 "-" if x["time_to_train_days_ci"][0] != x["time_to_train_days_ci"][0] else
                 f"[{x['time_to_train_days_ci'][0]:.3f}, {x['time_to_train_days_ci'][1]:.3f}]",
                 x["availability"], x["mean_stacks_per_step"], x["global_restarts"]) for x in res["rows"]]
        console.print(table(f"time-to-train N={args.groups}, {args.seeds} shared trails ({res['elapsed_s']:.1f} s)", rows,
                            columns=("scheme", "r", "days", "95% CI", "availability", "stacks/step", "restarts")))
        bs, br = res["best_spare"], res["best_replication"]
        lo, hi = res["gain_vs_replication_ci"]
        console.print(f"best SPARe+CKPT r={bs['redundancy'] if bs else None}, best Rep+CKPT r={br['redundancy'] if br else None}, "
                      f"paired gain {_pct(res['gain_vs_replication'])} [{_pct(lo)}, {_pct(hi)}]"
                      + (f" (paper: {_pct(res['paper']['gain'])})" if res["paper"] else ""))
    else:
        emit_json(res)
    return 0


def cmd_network(args) -> int:
    from trainguard.sim.collective import allreduce_time, checkpoint_time

    p = _params(args)
    groups = sorted(set(args.groups_list))
    for n in groups:
        _positive("groups", n)
    G = args.gpus_per_group
    _positive("gpus-per-group", G)
    if not args.checkpoint_gb >= 0:
        raise TrainguardError(f"--checkpoint-gb must be >= 0 (0: no checkpoint), got {args.checkpoint_gb}")
    bpg = p.model_params * p.grad_bytes_per_param / G
    net = p.network()
    ckpt_bytes = args.checkpoint_gb * 1e9
    plat = _platform(args, p)
    rows = [{"groups": n, "alpha_beta_allreduce_s": allreduce_time(n, bpg, net)} for n in groups]
    res = {"gpus_per_group": G, "bytes_per_gpu": bpg, "algorithm": p.allreduce_algorithm,
           "alpha_beta_checkpoint_s": checkpoint_time(ckpt_bytes, G, net) if ckpt_bytes > 0 else None,
           "rows": rows, "network": net.as_dict(), "platform": vars(plat)}
    if args.simgrid:
        from trainguard.sim.simgrid_model import measure_in_subprocess

        if max(groups) * G > args.max_simgrid_gpus:
            raise TrainguardError(f"SimGrid is run for up to {args.max_simgrid_gpus} GPUs here "
                                  f"({max(groups)} groups x {G} GPUs asked); raise --max-simgrid-gpus")
        m = measure_in_subprocess(groups, G, bpg, p.allreduce_algorithm, plat, ckpt_bytes, timeout=3600)
        for row in rows:
            row["simgrid_allreduce_s"] = m["allreduce_s"][str(row["groups"])]
            row["simgrid_path_latency_s"] = m["path_latency_s"][str(row["groups"])]
            row["simgrid_over_alpha_beta"] = row["simgrid_allreduce_s"] / row["alpha_beta_allreduce_s"] \
                if row["alpha_beta_allreduce_s"] > 0 else None
        res["simgrid_checkpoint_s"] = m.get("checkpoint_s")
        res["simgrid_transfers"] = m["transfers"]
    if args.json:
        emit_json(res)
        return 0
    cols = ["groups", "alpha_beta_allreduce_s"] + (["simgrid_allreduce_s", "simgrid_over_alpha_beta"] if args.simgrid else [])
    console.print(table(f"all-reduce of {bpg / 1e9:.3g} GB per GPU ({p.allreduce_algorithm}, {G} GPUs per group)",
                        [tuple(r.get(c) for c in cols) for r in rows], columns=tuple(cols)))
    if ckpt_bytes > 0:
        console.print(f"checkpoint of {args.checkpoint_gb:g} GB from one group: alpha-beta "
                      f"{res['alpha_beta_checkpoint_s']:.4g} s" +
                      (f", SimGrid {res['simgrid_checkpoint_s']:.4g} s" if args.simgrid else ""))
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("spare", help="SPARe: Monte-Carlo, theory, time-to-train simulation and the torchft runtime")
    sub = parser.add_subparsers(dest="spare_command", metavar="SUBCOMMAND", parser_class=type(parser))
    parser.set_defaults(handler=lambda a: (parser.print_help(), 2)[1])

    mc = sub.add_parser("montecarlo", help="failure trails through the real controller vs Thm 4.1/4.2")
    mc.add_argument("--groups", type=int, required=True)
    mc.add_argument("--redundancy", type=int, required=True)
    mc.add_argument("--trials", type=int, default=200)
    mc.add_argument("--seed", type=seed_int, default=0)
    mc.add_argument("--workers", type=int, default=None, help="processes (default: CPU count, at most 8)")
    add_json_flag(mc)
    mc.set_defaults(handler=cmd_montecarlo)

    sw = sub.add_parser("sweep", help="montecarlo for every supported redundancy")
    sw.add_argument("--groups", type=int, required=True)
    sw.add_argument("--trials", type=int, default=200)
    sw.add_argument("--seed", type=seed_int, default=0)
    sw.add_argument("--max-redundancy", type=int, default=None)
    sw.add_argument("--workers", type=int, default=None)
    add_json_flag(sw)
    sw.set_defaults(handler=cmd_sweep)

    si = sub.add_parser("simulate", help="time-to-train of one scheme (fast loop or SimGrid)")
    si.add_argument("--groups", type=int, required=True)
    si.add_argument("--scheme", choices=("spare", "replication", "checkpoint"), required=True)
    si.add_argument("--redundancy", type=int, default=1)
    si.add_argument("--seed", type=seed_int, default=0)
    si.add_argument("--backend", choices=("fast", "simgrid"), default="fast",
                    help="simgrid: all-reduce and checkpoint traffic on a platform (small clusters)")
    si.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (SimGrid validation)")
    _add_cluster_args(si)
    _add_platform_args(si)
    add_json_flag(si)
    si.set_defaults(handler=cmd_simulate)

    co = sub.add_parser("compare", help="SPARe+CKPT vs Rep+CKPT vs CKPT-only over r (paper Table 2)")
    co.add_argument("--groups", type=int, required=True)
    co.add_argument("--seeds", type=int, default=3, help="event trails per (scheme, r) (paper: 3)")
    co.add_argument("--seed", type=seed_int, default=0, help="first seed")
    co.add_argument("--max-redundancy", type=int, default=None)
    co.add_argument("--out", default=None, help="folder for figures")
    co.add_argument("--workers", type=int, default=1, help="simulation processes")
    _add_cluster_args(co)
    add_json_flag(co)
    co.set_defaults(handler=cmd_compare)

    ne = sub.add_parser("network", help="all-reduce and checkpoint cost: alpha-beta model vs a SimGrid platform")
    ne.add_argument("--groups", dest="groups_list", type=int, nargs="+", required=True)
    ne.add_argument("--gpus-per-group", type=int, required=True)
    ne.add_argument("--checkpoint-gb", type=finite_float, default=0.0, help="checkpoint size written by one group")
    ne.add_argument("--simgrid", action="store_true", help="also run the traffic on SimGrid")
    ne.add_argument("--max-simgrid-gpus", type=int, default=4096)
    _add_cluster_args(ne)
    _add_platform_args(ne)
    add_json_flag(ne)
    ne.set_defaults(handler=cmd_network)

    from trainguard.cli.commands._spare_run import add_run_parser

    add_run_parser(sub)
