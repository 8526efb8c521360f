"""``trainguard bench dmr``: No-DMR, Naive-Only and SpareTrain throughput side by side on one trainer
(``trainguard.sdc.dmr.bench``), with the pipeline's idle share set by an emulated slow link.
Registered by ``bench.py``. Relies on argparse, rich and torch's elastic launcher for pipelines."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from trainguard.cli.args import comma_items, finite_float
from trainguard.cli.output import add_json_flag, console, emit_json, err_console, table
from trainguard.errors import ConfigError
from trainguard.sdc.dmr.bench import CHOICES, FLOOR, SYSTEMS, merge, run_rank
from trainguard.sdc.dmr.config import CARRY_MODES, DMRConfig
from trainguard.train import TrainerConfig
from trainguard.train.launch import failed_workers, run_workers


def register_bench(subparsers) -> None:
    p = subparsers.add_parser("dmr", help="DMR throughput: No-DMR vs Naive-Only vs SpareTrain (and its phases)")
    p.add_argument("--model", default="llama-60m", help="model preset (default llama-60m)")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (processes; default 2)")
    p.add_argument("--idle-fraction", type=finite_float, default=0.0,
                   help="emulate a slower inter-stage link so No-DMR idles this share of its step (0: no emulation)")
    p.add_argument("--batch", type=int, default=8, help="sequences a step (default 8)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens a sequence (default 128)")
    p.add_argument("--microbatches", type=int, default=4,
                   help="pipeline micro-batches a step (default 4; 0: twice the stages). The engine's cost is per op, the ops' cost per "
                        "token: fewer tokens a micro-batch weigh the engine more (docs/dmr-measurements.md, tokens per micro-batch)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per round and system (default 2)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--system-warmup", type=int, default=16,
                   help="untimed steps of each system before the first round, at most (default 16): they stop after "
                        "two in a row that each add fewer than 2,000 page faults a rank (its heap has reached its peak; "
                        "the first round would otherwise pay for the growth)")
    p.add_argument("--switch-warmup", type=int, default=1,
                   help="untimed steps after each switch of system (default 1: a switch drops the engine's copies "
                        "of the state, which a run makes once)")
    p.add_argument("--hold-idle", action=argparse.BooleanOptionalAction, default=True,
                   help="with --idle-fraction: re-set the emulated link after each round from that round's No-DMR idle "
                        "share, so the timed rounds stay at the target as the host's speed drifts (default on)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated, from {', '.join(CHOICES)} (default: all but {FLOOR}). {FLOOR}: a bound, not "
                        "a DMR system: every op through a Python dispatch mode that checks nothing (what any verifier "
                        "built on one costs at least; gain_ceiling_python_mode in the output)")
    p.add_argument("--memory-budget-mb", type=finite_float, default=0.0,
                   help="memory the deferred checks may hold per rank ([sdc.dmr] memory_budget_mb; 0: its default)")
    p.add_argument("--carry-budget", choices=CARRY_MODES, default=DMRConfig().carry_budget,
                   help="naive backward ops carried past the update ([sdc.dmr] carry_budget): unbounded (default: all) "
                        "or windows (as many as the profiled windows have room for)")
    p.add_argument("--profile-steps", type=int, default=DMRConfig().profile_steps,
                   help="times the first SpareTrain step is profiled before the plan is made ([sdc.dmr] profile_steps; "
                        "default 1): the plan takes each op's and window's median time over them")
    p.add_argument("--host-memory", choices=("retain", "default"), default="retain",
                   help="retain (default): every system keeps freed CPU memory in the process instead of page-faulting "
                        "large buffers every step ([train] host_memory; what CUDA's caching allocator does); default: "
                        "glibc as is")
    p.add_argument("--gc", choices=("step", "python"), default="step",
                   help="[train] gc for every system: step (default: no automatic collection in the middle of a step) "
                        "or python")
    p.add_argument("--op-times", action="store_true",
                   help="also time every op the dispatch mode executes in the timed steps (SpareTrain's and Naive-Only's "
                        "primary executions, the floor's ops): thread CPU a step by op (op_cpu_s per rank and system, "
                        "ops_slower_than_naive). Two clock reads an op more in those systems: their throughput here is "
                        "not the headline's")
    add_json_flag(p)
    p.set_defaults(handler=run)


def _spec(args) -> dict:
    systems = comma_items(args.systems, "--systems")
    bad = [s for s in systems if s not in CHOICES]
    if bad or not systems:
        raise ConfigError(f"--systems: unknown {', '.join(bad) or '(none)'} (choose from {', '.join(CHOICES)})")
    if not 0 <= args.idle_fraction < 0.95:
        raise ConfigError(f"--idle-fraction must be in [0, 0.95), got {args.idle_fraction}")
    if args.pp < 1 or args.rounds < 1 or args.steps < 1 or args.warmup < 1:
        raise ConfigError("--pp, --rounds, --steps and --warmup must be >= 1")
    if args.switch_warmup < 0 or args.system_warmup < 0:
        raise ConfigError(f"--switch-warmup and --system-warmup must be >= 0, got {args.switch_warmup}, "
                          f"{args.system_warmup}")
    if args.profile_steps < 1:
        raise ConfigError(f"--profile-steps must be >= 1, got {args.profile_steps}")
    if not args.memory_budget_mb >= 0:
        raise ConfigError(f"--memory-budget-mb must be >= 0, got {args.memory_budget_mb}")
    overrides = ["--model.preset", args.model, "--data.seq_len", str(args.seq_len), "--data.batch_size", str(args.batch),
                 "--data.max_bytes", str(max(2_000_000, 64 * args.batch * (args.seq_len + 2))),
                 "--train.steps", "100000", "--train.eval_every", "0", "--train.activation_checkpoint", "full",
                 "--output.dir", "", "--output.progress", "false", "--output.metrics", "false",
                 "--train.host_memory", args.host_memory, "--train.gc", args.gc]
    if args.pp > 1:
        overrides += ["--distributed.pp", str(args.pp), "--distributed.microbatches", str(args.microbatches)]
    cfg = TrainerConfig.load(None, overrides)  # (a bad size is refused here in one line, not by each rank once launched)
    return {"overrides": overrides, "microbatches": cfg.distributed.step_microbatches(),
            "systems": systems, "idle_fraction": args.idle_fraction, "rounds": args.rounds,
            "steps": args.steps, "warmup": args.warmup, "switch_warmup": args.switch_warmup,
            "system_warmup": args.system_warmup,
            "memory_budget_mb": args.memory_budget_mb, "hold_idle": args.hold_idle, "carry_budget": args.carry_budget,
            "profile_steps": args.profile_steps, "op_times": args.op_times}


def tokens_per_microbatch(spec: dict, args) -> int:
    """The tokens each op of a pipeline stage works on (the whole batch's without a pipeline)."""
    return args.batch * args.seq_len // spec["microbatches"]


def run(args) -> int:
    spec = _spec(args)
    out = err_console if args.json else console
    out.print(f"bench dmr: {args.model}, {args.pp} stage(s), batch {args.batch} x {args.seq_len}"
              + (f" in {spec['microbatches']} micro-batches" if args.pp > 1 else "")
              + f" ({tokens_per_microbatch(spec, args)} tokens a micro-batch), "
              f"idle fraction {args.idle_fraction or 'as measured (no emulation)'}; systems {', '.join(spec['systems'])}")
    with tempfile.TemporaryDirectory(prefix="trainguard-bench-dmr-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        if args.pp == 1:
            ranks = [run_rank(spec)]
        else:
            proc = run_workers(args.pp, "trainguard.sdc.dmr.bench", tmp, str(spec_path))
            if proc.returncode != 0:
                raise failed_workers("bench dmr: a pipeline process failed", proc.stderr)
            ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(args.pp)]
    res = merge(ranks, spec["systems"])
    res.update(model=args.model, pp=args.pp, batch=args.batch, seq_len=args.seq_len,
               microbatches=spec["microbatches"], tokens_per_microbatch=tokens_per_microbatch(spec, args),
               idle_fraction_target=args.idle_fraction,
               host_memory=args.host_memory, gc=args.gc, carry_budget=args.carry_budget,
               profile_steps=args.profile_steps, op_times=args.op_times)
    rows = {k: v for k, v in res.items() if not isinstance(v, (dict, list))}
    out.print(table("bench dmr (side by side; " + ("emulated link" if res["idle_fraction_emulated"] else "loopback link")
                    + ")", rows))
    for r, diffs in enumerate(res.get("ops_slower_than_naive", [])):
        out.print(table(f"stage {r}: ops slower under SpareTrain than under Naive-Only (CPU a step)",
                        [(d["op"], f"{d['sparetrain_s'] * 1e3:.1f} ms", f"{d['naive_s'] * 1e3:.1f} ms",
                          f"{d['difference_s'] * 1e3:+.1f} ms", f"{d['sparetrain_calls']:g} / {d['naive_calls']:g}")
                         for d in diffs],
                        columns=("op", "SpareTrain", "Naive-Only", "difference", "calls")))
    if args.json:
        emit_json(res)
    return 0
