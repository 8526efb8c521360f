"""``trainguard plan dmr``: the SpareTrain DMR plan of one rank's training iteration.

``plan dmr --profile PROFILE.json [--phases 1|1,2|1,2,3] [--memory-budget BYTES] [--pdmr-tail defer|recompute]
[--window-fill F] [--[no-]dp-windows] [--out PLAN.json] [--figure FIG.png] [--json]`` reads a DMR profile
(trainguard.sdc.dmr.profile), plans it (trainguard.sdc.dmr.planner), prints the summary next to the No-DMR and
Naive-Only baselines, writes the plan JSON and the timeline figure (trainguard.report.dmr_timeline).
``--model M [--pp 2] [--dp 1] [--steps N]`` profiles a model first with
``trainguard.sdc.dmr.profiler.profile_run`` where that exists (rank 0's iteration); ``--save-profile P.json``
keeps that profile, so other plans of it (``--profile P.json``) need no second profiling run.
Registered by ``plan.py``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import re

from trainguard.cli.args import check_figure, check_output_file, finite_float
from trainguard.cli.output import add_json_flag, console, emit_json, err_console, table
from trainguard.errors import ConfigError, TrainguardError
from trainguard.sdc.dmr.config import CARRY_MODES, DMRConfig

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"500MB"``, ``"1e9"`` or ``"123456"`` -> bytes (ConfigError otherwise)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text or "")
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"--memory-budget must be bytes, optionally with a unit (e.g. 80GiB, 500MB); got {text!r}")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value < 0:
        raise ConfigError(f"--memory-budget must be >= 0, got {text!r}")
    if not math.isfinite(value):
        raise ConfigError(f"--memory-budget must be a finite number of bytes, got {text!r}")
    return int(value)


def register_plan(subparsers) -> None:
    p = subparsers.add_parser("dmr", help="SpareTrain DMR plan (P-DMR, AGC segments, deferred checks) from a profile")
    p.add_argument("--profile", help="DMR profile JSON of one rank's iteration (written by the DMR profiler)")
    p.add_argument("--model", help="profile this model first (needs trainguard.sdc.dmr.profiler)")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages for --model")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas for --model (with --pp 2: a mesh of "
                   "pp x dp processes, whose stages' gradient all-reduce is a dp window)")
    p.add_argument("--steps", type=int, default=3, help="profiled iterations for --model")
    p.add_argument("--save-profile", default="", help="with --model: write the measured profile here, to plan it "
                   "again with --profile without profiling again ('' to skip, the default)")
    p.add_argument("--phases", default="1,2,3", help="planner phases: 1, 1,2 or 1,2,3 (default)")
    p.add_argument("--memory-budget", default=None, help="device memory budget (default: the profile's), e.g. 80GiB")
    p.add_argument("--pdmr-tail", choices=("defer", "recompute"), default="defer",
                   help="the ops of a P-DMR segment the recompute does not replay: defer (default: left to Phases "
                        "2-3, checked where they ran) or recompute (the paper's extra run on the critical path)")
    p.add_argument("--window-fill", type=finite_float, default=DMRConfig().window_fill,
                   help="share of each communication window to fill with checks (default %(default)s, as [sdc.dmr] "
                        "window_fill; 1: all of it, the paper's)")
    p.add_argument("--carry", choices=CARRY_MODES, default=DMRConfig().carry_budget,
                   help="naive backward ops the engine may carry past the update into the next iteration's windows: "
                        "unbounded (default, as [sdc.dmr] carry_budget: all) or windows (as many as the profiled "
                        "windows have room for); with --phases 1,2,3 only (carrying is deferral)")
    p.add_argument("--dp-windows", action=argparse.BooleanOptionalAction, default=DMRConfig().dp_windows,
                   help="defer checks into data-parallel windows too (a pipeline stage's gradient all-reduce over its "
                        "replicas), as [sdc.dmr] dp_windows (default: off, the paper's pp, tp and ep windows only)")
    p.add_argument("--out", default="runs/plan-dmr/plan.json", help="plan JSON to write ('' to skip)")
    p.add_argument("--figure", default="runs/plan-dmr/timeline.png", help="timeline figure to write ('' to skip)")
    add_json_flag(p)
    p.set_defaults(handler=run)


def _profile(args):
    from trainguard.sdc.dmr.planner import read_profile

    if args.profile and args.model:
        raise ConfigError("pass either --profile or --model, not both")
    if args.profile:
        return read_profile(args.profile), args.profile
    if not args.model:
        raise ConfigError("pass --profile PROFILE.json (or --model M to profile a model first)")
    name = "trainguard.sdc.dmr.profiler"
    fn = getattr(importlib.import_module(name), "profile_run", None) if importlib.util.find_spec(name) else None
    if fn is None:
        raise TrainguardError("--model needs the DMR profiler (trainguard.sdc.dmr.profiler.profile_run), which this "
                              "build lacks: pass --profile PROFILE.json")
    if args.pp < 1 or args.dp < 1 or args.steps < 1:
        raise ConfigError(f"--pp, --dp and --steps must be >= 1, got {args.pp}, {args.dp}, {args.steps}")
    from trainguard.models import model_config

    model_config(args.model)  # an unknown preset: one line here, not a failed rank's report
    return fn(model=args.model, pp=args.pp, steps=args.steps, dp=args.dp), f"model {args.model}"


def run(args) -> int:
    from trainguard.sdc.dmr.planner import PlannerConfig, naive_only, no_dmr, parse_phases, plan_static

    try:
        phases = parse_phases(args.phases)
    except ConfigError:
        raise ConfigError(f"--phases must be 1, 1,2 or 1,2,3; got {args.phases!r}") from None
    budget = parse_bytes(args.memory_budget) if args.memory_budget is not None else None
    if not 0 < args.window_fill <= 1:
        raise ConfigError(f"--window-fill must be in (0, 1], got {args.window_fill}")
    if args.figure:
        check_figure(args.figure, "--figure")
    if args.save_profile:
        if not args.model:
            raise ConfigError("--save-profile needs --model (a profile given with --profile is already a file)")
        check_output_file(args.save_profile, "--save-profile")
    profile, source = _profile(args)
    if args.save_profile:
        try:
            profile.save(args.save_profile)
        except OSError as err:
            raise TrainguardError(f"cannot write {args.save_profile}: {err.strerror or err}") from None
    plan = plan_static(profile, PlannerConfig(phases=phases, memory_budget_bytes=budget, pdmr_tail=args.pdmr_tail,
                                              window_fill=args.window_fill, carry=args.carry,
                                              use_dp_windows=args.dp_windows))
    base = {"no-dmr": no_dmr(profile).summary, "naive-only": naive_only(profile).summary}
    fig = out = None
    try:
        out = plan.save(args.out) if args.out else None
        if args.figure:
            from trainguard.report.dmr_timeline import draw_timeline

            fig = draw_timeline(profile, plan, args.figure)
    except OSError as err:
        raise TrainguardError(f"cannot write {err.filename or 'output'}: {err.strerror or err}") from None
    s = plan.summary
    show = err_console if args.json else console
    rows = {"source": source, "phases": ",".join(map(str, plan.phases)), "ops (non-communication)": s["ops"],
            "coverage": f"{s['coverage']:.1%}",
            "checker time on the critical path (s)": s["checker_critical_s"],
            "  of which naive (s)": s["naive_s"], "  of which P-DMR extra runs (s)": s["pdmr_extra_runs_s"],
            "  of which dynamic, upper bound (s)": s["checker_dynamic_s"],
            "checker time hidden in windows (s)": s["checker_hidden_s"],
            "Naive-Only checker time (s)": base["naive-only"]["checker_critical_s"],
            "iteration (s)": s["iteration_s"],
            "critical-path overhead vs iteration": s["critical_overhead"],
            "P-DMR segments (exceptions)": f"{s['pdmr_segments']} ({s['pdmr_exceptions']})",
            "AGC segments": s["agc_segments"],
            "windows used / all": f"{s['windows_used']} / {s['windows']}",
            "carried past the update, at most: ops (op time s)": f"{s['carry_ops']} ({s['carry_s']:.3f})",
            "  room for them in the next iteration's windows (s)": s["carry_budget_s"],
            "  list ops over every gradient carried too": "yes" if s["carry_lists"] else "no",
            "memory budget (bytes)": s["memory_budget_bytes"], "peak (bytes)": s["peak_bytes"],
            "peak with deferral (bytes)": s["peak_with_deferral_bytes"]}
    show.print(table("trainguard plan dmr", rows))
    show.print(table("strategies", [(k, int(v["ops"]), v["time_s"]) for k, v in s["by_strategy"].items()],
                     columns=("strategy", "ops", "op time (s)")))
    written = [str(x) for x in (out, fig) if x]
    if written:
        show.print(f"wrote {', '.join(written)}")
    if args.json:
        emit_json({"source": source, "phases": list(plan.phases), "plan": str(out) if out else None,
                   "figure": str(fig) if fig else None, "summary": s,
                   "baselines": {k: {"checker_critical_s": v["checker_critical_s"], "coverage": v["coverage"]}
                                 for k, v in base.items()}})
    return 0
