"""``trainguard plan``: what to configure at my scale.

``plan cluster --gpus G --gpus-per-group K --mtbf-per-gpu-hours H --restart-minutes R --checkpoint-minutes C``
ranks CKPT-only, Rep+CKPT and SPARe+CKPT at every redundancy by simulation on shared failure trails
(``--seeds``, default 5; ``--theory-only`` for the closed forms alone), headlines the fastest with its 95%
interval, reports where theory and simulation disagree, re-plans with each uncertain input moved (the
sensitivity table), and writes the chosen plan as TOML (``--plan-file``, default ``OUT/plan.toml``, read
with ``trainguard.sim.plan_file.read_plan``) plus figures into ``--out`` (default ``runs/plan-cluster``).
The library side is :mod:`trainguard.sim.planning`.

Extension hook: ``plan`` owns an argparse sub-parser group. Other modules add ``plan`` subcommands without
editing this file: at the end of :func:`register`, ``trainguard.cli.commands._plan_abft`` is imported if
it exists and its ``register_plan(plan_subparsers)`` is called (an ``ImportError`` skips it). The leading
underscore keeps the command auto-discovery of ``trainguard.cli.main`` from registering it as a
top-level command. :data:`PLAN_SUBPARSERS` also exposes the group after registration.
"""

from __future__ import annotations

import importlib
import math
import os
from pathlib import Path

from trainguard.cli.args import finite_float
from trainguard.cli.output import add_json_flag, console, emit_json, err_console, table
from trainguard.errors import TrainguardError

PLAN_SUBPARSERS = None
_EXTENSIONS = ("trainguard.cli.commands._plan_abft", "trainguard.cli.commands._plan_dmr")
# Default model when --model-params is not given: the SPARe paper's 20 TB of FP16 gradient over groups of
# 3000 GPUs, i.e. 6.67 GB of gradient per GPU (docs/spare.md).
PAPER_GRAD_BYTES_PER_GPU = 20e12 / 3000


def _check(name: str, v: float | None, lo: float = 0.0, strict: bool = True) -> None:
    if v is None or not math.isfinite(v) or (v <= lo if strict else v < lo):
        raise TrainguardError(f"--{name} must be {'>' if strict else '>='} {lo}, got {v}")


def _writable_dir(path: str, what: str = "--out") -> Path:
    """Create ``path`` and prove it is writable now, before any work (one-line error otherwise)."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".trainguard-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise TrainguardError(f"{what} {path}: cannot write there ({err.strerror or err})") from None
    return out


def cluster_params(args):
    """``ClusterParams`` from the ``plan cluster`` flags (derived step time / steps / model size)."""
    from trainguard.sim.timetotrain import ClusterParams

    _check("gpus", args.gpus)
    _check("gpus-per-group", args.gpus_per_group)
    if args.gpus_per_group > args.gpus:
        raise TrainguardError(f"--gpus-per-group {args.gpus_per_group} exceeds --gpus {args.gpus}")
    if args.gpus // args.gpus_per_group < 2:
        raise TrainguardError(f"{args.gpus} GPUs in groups of {args.gpus_per_group} give "
                              f"{args.gpus // args.gpus_per_group} data-parallel group(s); need >= 2")
    _check("mtbf-per-gpu-hours", args.mtbf_per_gpu_hours)
    _check("restart-minutes", args.restart_minutes, strict=False)
    _check("checkpoint-minutes", args.checkpoint_minutes)
    _check("grad-bytes-per-param", args.grad_bytes_per_param)
    n = args.gpus // args.gpus_per_group
    used = n * args.gpus_per_group
    notes = []
    derive = [args.tokens_per_step, args.gpu_tflops]
    if any(v is not None for v in derive) and args.stack_seconds is not None:
        raise TrainguardError("give either --stack-seconds or --tokens-per-step with --gpu-tflops (and --model-params), "
                              "not both")
    model = args.model_params
    if model is not None:
        _check("model-params", model)
    if args.stack_seconds is not None:
        _check("stack-seconds", args.stack_seconds)
        stack_s = args.stack_seconds
    elif any(v is not None for v in derive):
        if None in derive or model is None:
            raise TrainguardError("a derived step time needs --model-params, --tokens-per-step and --gpu-tflops")
        _check("tokens-per-step", args.tokens_per_step)
        _check("gpu-tflops", args.gpu_tflops)
        stack_s = 6.0 * model * args.tokens_per_step / (used * args.gpu_tflops * 1e12)
        notes.append(f"step compute {stack_s:.3g} s = 6 x {model:.3g} params x {args.tokens_per_step:.3g} tokens / "
                     f"({used} GPUs x {args.gpu_tflops:.3g} TFLOP/s)")
    else:
        stack_s = None
    steps = args.steps
    if args.tokens is not None:
        if args.steps is not None:
            raise TrainguardError("give either --steps or --tokens (with --tokens-per-step), not both")
        if args.tokens_per_step is None:
            raise TrainguardError("--tokens needs --tokens-per-step")
        _check("tokens", args.tokens)
        steps = max(1, math.ceil(args.tokens / args.tokens_per_step))
    if steps is not None and steps < 1:
        raise TrainguardError(f"--steps must be >= 1, got {steps}")
    if model is None:
        model = PAPER_GRAD_BYTES_PER_GPU * args.gpus_per_group / args.grad_bytes_per_param
        notes.append(f"no --model-params: assumed {model:.3g} parameters, the SPARe paper's 6.67 GB of gradient per GPU")
    kw = dict(total_gpus=args.gpus, gpu_mtbf_hours=args.mtbf_per_gpu_hours, restart_s=args.restart_minutes * 60,
              checkpoint_s=args.checkpoint_minutes * 60, model_params=model,
              grad_bytes_per_param=args.grad_bytes_per_param, allreduce_algorithm=args.allreduce_algorithm,
              hop_latency_s=args.hop_latency_us * 1e-6, gpu_bandwidth_gbps=args.gpu_bandwidth_gbps,
              allreduce_s=args.allreduce_seconds, failure_model=args.failure_model, weibull_shape=args.weibull_shape,
              renewal=args.renewal, repair_s=args.repair_minutes * 60, hot_spares=args.hot_spares,
              gpus_per_domain=args.gpus_per_domain, domain_mtbf_hours=args.domain_mtbf_hours,
              domain_aware=not args.no_domain_aware, trace_path=args.trace, shrink_s=args.shrink_seconds,
              controller_s=args.controller_seconds, jitter=args.jitter,
              failed_allreduce_frac=args.failed_allreduce_frac, max_days=args.max_days)
    if stack_s is not None:
        kw["stack_compute_s"] = stack_s
    if steps is not None:
        kw["base_steps"] = int(steps)
    p = ClusterParams(**kw)
    p.validate()
    return p, n, notes


def _fmt_days(v, ci=None) -> str:
    if v is None or not isinstance(v, (int, float)):
        return "-"
    if not math.isfinite(v):
        return "not finished"
    s = f"{v:.3f}"
    if ci and all(isinstance(x, (int, float)) and math.isfinite(x) for x in ci):
        s += f" [{ci[0]:.3f}, {ci[1]:.3f}]"
    return s


def _figures(res: dict, out: Path) -> dict:
    from trainguard.report.figures import line_plot

    rs = sorted({x["redundancy"] for x in res["rows"] if x["scheme"] != "checkpoint"})
    ck = res["best"]["checkpoint"]
    sim = res["ranked_by"].startswith("sim_")

    def col(scheme, k):
        d = {x["redundancy"]: x.get(k) for x in res["rows"] if x["scheme"] == scheme}
        return [d.get(r) for r in rs]

    figs = {}
    for key, label in (("time_to_train_days", "time-to-train [days]"), ("availability", "availability"),
                       ("stacks_per_step", "stacks per step")):
        series = {"SPARe+CKPT (theory)": col("spare", key), "Rep+CKPT (theory)": col("replication", key)}
        bands = {}
        if sim:
            skey = {"stacks_per_step": "sim_mean_stacks_per_step"}.get(key, f"sim_{key}")
            series["SPARe+CKPT (sim)"] = col("spare", skey)
            series["Rep+CKPT (sim)"] = col("replication", skey)
            if key == "time_to_train_days":
                bands = {"SPARe+CKPT (sim)": col("spare", "sim_time_to_train_days_ci"),
                         "Rep+CKPT (sim)": col("replication", "sim_time_to_train_days_ci")}
        hk = res["ranked_by"] if key == "time_to_train_days" else ("sim_availability" if sim else "availability")
        hl = ck.get(hk) if ck and key != "stacks_per_step" and isinstance(ck.get(hk), float) and math.isfinite(ck[hk]) else None
        figs[key] = str(line_plot(out / f"{key}_vs_r.png", rs, series, xlabel="redundancy r", ylabel=label,
                                  title=f"N = {res['groups']} groups of {res['gpus_per_group']} GPUs"
                                        + (" (grey: CKPT-only)" if hl else ""), hline=hl, bands=bands))
    return figs


def cmd_cluster(args) -> int:
    from trainguard.sim.plan_file import SparePlan, write_plan
    from trainguard.sim.planning import PlanOptions, plan_cluster

    if args.simulate and args.theory_only:
        raise TrainguardError("--simulate and --theory-only contradict each other (simulation is the default)")
    simulate = not args.theory_only
    if simulate and args.seeds < 1:
        raise TrainguardError(f"--seeds must be >= 1 when simulating (or use --theory-only), got {args.seeds}")
    if args.workers < 1:
        raise TrainguardError(f"--workers must be >= 1, got {args.workers}")
    if args.max_redundancy is not None:
        _check("max-redundancy", args.max_redundancy, 2, strict=False)
    p, n, notes = cluster_params(args)
    out = _writable_dir(args.out)
    plan_path = Path(args.plan_file) if args.plan_file else out / "plan.toml"
    if args.plan_file:
        _writable_dir(str(plan_path.parent), "--plan-file")
    opts = PlanOptions(seeds=args.seeds, simulate=simulate, sensitivity=not args.no_sensitivity,
                       r_max=args.max_redundancy, workers=args.workers, progress=err_console.is_terminal)
    res = plan_cluster(p, n, opts)
    res["notes"] = notes + res["notes"]
    res["figures"] = _figures(res, out)
    res["plan_file"] = str(write_plan(plan_path, SparePlan(**res["plan"])))
    if args.json:
        emit_json(res)
        return 0
    head = res["recommended"] + ": " + _fmt_days(res["expected_time_to_train_days"], res["expected_time_to_train_days_ci"])
    summary = {"recommended": head + " days", "ranked by": "simulation, " + f"{len(res['seeds'])} shared failure trails"
               if simulate else "theory (eq. 7, exponential failures; no interval)",
               "groups x GPUs": f"{res['groups']} x {res['gpus_per_group']} (+{res['unused_gpus']} unused)",
               "cluster MTBF [min]": res["cluster_failure_mtbf_min"], "step compute [s]": res["stack_compute_s"],
               "all-reduce [s]": res["allreduce_s"], "failure-free single-stack days": res["base_time_to_train_days"],
               "checkpoint period [min]": res["recommended_checkpoint_period_min"],
               "availability": res["expected_availability"]}
    ru = res["runner_up"]
    if ru:
        summary["runner-up"] = f"{ru['runner_up']}: +{_fmt_days(ru['margin_days'], ru['margin_days_ci'])} days" + \
            ("" if ru["clear"] is not False else " (not significant at 95%)")
    g, gci = res["gain_vs_replication"], res["gain_vs_replication_ci"]
    if isinstance(g, float) and math.isfinite(g):
        summary["SPARe vs Rep (best r each)"] = f"{100 * g:.1f}%" + (
            f" [{100 * gci[0]:.1f}, {100 * gci[1]:.1f}]" if math.isfinite(gci[0]) else "")
    console.print(table("cluster plan", summary))
    k = res["ranked_by"]
    rows = []
    for s, b in res["best"].items():
        if b:
            rows.append((s, b["redundancy"], b["checkpoint_period_s"] / 60, _fmt_days(b["time_to_train_days"]),
                         _fmt_days(b.get("sim_time_to_train_days"), b.get("sim_time_to_train_days_ci")),
                         b.get("sim_mean_stacks_per_step", b["stacks_per_step"])))
    console.print(table(f"best per scheme (ranked by {k})", rows,
                        columns=("scheme", "r", "ckpt period [min]", "theory days", "simulated days [95% CI]",
                                 "stacks/step")))
    if res["theory_vs_simulation"]:
        console.print(f"theory vs simulation: {res['theory_vs_simulation']['message']}")
    if res["sensitivity"]:
        srows = [(r["input"], "-" if r["value"] is None else r["value"], r["recommended"],
                  _fmt_days(r["time_to_train_days"], r["time_to_train_days_ci"]),
                  "-" if not math.isfinite(r["spare_gain_vs_replication"]) else f"{100 * r['spare_gain_vs_replication']:.1f}%",
                  "yes" if r["scheme_changes"] else ("r only" if r["plan_changes"] else ""))
                 for r in res["sensitivity"]]
        console.print(table("sensitivity (same trails)", srows,
                            columns=("input", "value", "recommended", "days [95% CI]", "SPARe vs Rep", "changes")))
        mi = res["sensitivity_most_influential"]
        console.print(f"moves the headline most: {mi['on_time']}; moves the SPARe gain most: {mi['on_gain']}")
    console.print(res["failure_free"]["statement"])
    for note in res["notes"]:
        console.print(f"note: {note}")
    console.print(f"plan: {res['plan_file']}")
    console.print(f"figures: {', '.join(res['figures'].values())}")
    return 0


def register(subparsers) -> None:
    global PLAN_SUBPARSERS
    parser = subparsers.add_parser("plan", help="recommend fault-tolerance settings for a cluster")
    sub = parser.add_subparsers(dest="plan_command", metavar="SUBCOMMAND", parser_class=type(parser))
    parser.set_defaults(handler=lambda a: (parser.print_help(), 2)[1])
    c = sub.add_parser("cluster", help="fastest fault-tolerance scheme, redundancy, checkpoint period (with intervals)")
    c.add_argument("--gpus", type=int, required=True)
    c.add_argument("--gpus-per-group", type=int, required=True, help="GPUs per data-parallel group (model replica)")
    c.add_argument("--mtbf-per-gpu-hours", type=finite_float, required=True,
                   help="per-GPU MTBF (Llama 3: 54*24*16384/419 = 50680 h)")
    c.add_argument("--restart-minutes", type=finite_float, required=True, help="global restart cost")
    c.add_argument("--checkpoint-minutes", type=finite_float, required=True, help="checkpoint save time")
    w = c.add_argument_group("workload (step time = stack compute + all-reduce)")
    w.add_argument("--stack-seconds", type=finite_float, default=None,
                   help="compute time of one stack (one shard per group); default 10 s, see docs/spare.md")
    w.add_argument("--steps", type=int, default=None, help="training steps; default 8640 (1 day of 10 s stacks)")
    w.add_argument("--model-params", type=finite_float, default=None,
                   help="model parameters (sets the gradient size; default: 6.67 GB of gradient per GPU)")
    w.add_argument("--tokens-per-step", type=finite_float, default=None, help="tokens per step (global batch)")
    w.add_argument("--tokens", type=finite_float, default=None, help="training tokens (steps = tokens / tokens-per-step)")
    w.add_argument("--gpu-tflops", type=finite_float, default=None,
                   help="achieved TFLOP/s per GPU; with --model-params and --tokens-per-step gives the step compute")
    nw = c.add_argument_group("network (alpha-beta all-reduce, trainguard.sim.collective)")
    nw.add_argument("--allreduce-algorithm", choices=("ring", "halving-doubling"), default="ring")
    nw.add_argument("--hop-latency-us", type=finite_float, default=5.0, help="alpha: latency per message (us)")
    nw.add_argument("--gpu-bandwidth-gbps", type=finite_float, default=200.0, help="beta: goodput per GPU link (Gb/s)")
    nw.add_argument("--grad-bytes-per-param", type=finite_float, default=2.0)
    nw.add_argument("--allreduce-seconds", type=finite_float, default=None, help="fixed all-reduce time (replaces alpha-beta)")
    f = c.add_argument_group("failures (trainguard.sim.failures)")
    f.add_argument("--failure-model", choices=("weibull", "exponential", "trace"), default="weibull")
    f.add_argument("--weibull-shape", type=finite_float, default=0.7)
    f.add_argument("--renewal", choices=("restart", "failure"), default="restart",
                   help="Weibull clocks restart at every global restart (default) or only at a GPU's own failure")
    f.add_argument("--trace", default=None, help="failure trace CSV (time_s or time_h; optional gpu or group)")
    f.add_argument("--repair-minutes", type=finite_float, default=0.0, help="a failed group is usable again after this")
    f.add_argument("--hot-spares", type=int, default=0, help="spare groups a restart can use")
    f.add_argument("--gpus-per-domain", type=int, default=0, help="failure domain (rack/switch) size in GPUs")
    f.add_argument("--domain-mtbf-hours", type=finite_float, default=0.0, help="mean time between failures of one domain")
    f.add_argument("--no-domain-aware", action="store_true", help="do not spread copies over failure domains")
    t = c.add_argument_group("event costs")
    t.add_argument("--shrink-seconds", type=finite_float, default=1.0)
    t.add_argument("--controller-seconds", type=finite_float, default=1.0)
    t.add_argument("--failed-allreduce-frac", type=finite_float, default=0.5)
    t.add_argument("--jitter", type=finite_float, default=0.05, help="relative sd of the normal jitter on every event")
    t.add_argument("--max-days", type=finite_float, default=60.0, help="give up on a simulated run after this")
    c.add_argument("--seeds", type=int, default=5, help="shared failure trails (paired simulation)")
    c.add_argument("--theory-only", action="store_true", help="closed forms only (no simulation, no intervals)")
    c.add_argument("--simulate", action="store_true", help="(default) simulate; kept for compatibility")
    c.add_argument("--no-sensitivity", action="store_true", help="skip the sensitivity table")
    c.add_argument("--max-redundancy", type=int, default=None, help="cap SPARe's r (default: longest usable ruler)")
    c.add_argument("--workers", type=int, default=1, help="simulation processes")
    c.add_argument("--out", default="runs/plan-cluster", help="folder for the figures and plan.toml")
    c.add_argument("--plan-file", default=None, help="where to write the plan (default OUT/plan.toml)")
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
