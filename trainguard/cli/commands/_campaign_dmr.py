"""``trainguard campaign dmr``: bit flips into random compute ops of DMR-protected training, every trial
compared with the fault-free run (``trainguard.sdc.dmr.campaign``). Registered by ``campaign.py``.
Relies on argparse, rich and torch's elastic launcher for pipelines."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from trainguard.cli.args import seed_int
from trainguard.cli.output import add_json_flag, console, emit_json, err_console, table
from trainguard.config import load_config
from trainguard.errors import ConfigError
from trainguard.sdc.dmr.campaign import PHASES, VERIFIER, run_rank
from trainguard.train.launch import failed_workers, run_workers

KEYS = ("trials", "detected", "masked", "silent", "stopped", "unreached", "faults_fired", "false_positives",
        "rollback_bitwise_equal", "tie_breakers_again")


def register_campaign(subparsers) -> None:
    p = subparsers.add_parser("dmr", help="bit flips in random ops of every phase vs DMR (detect, roll back)")
    p.add_argument("--model", default="llama-tiny", help="model preset (llama-tiny, llama-moe-tiny, ...)")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--phase", default="any", choices=(*PHASES, "any", VERIFIER),
                   help="where the faults go: a phase of the step, any of the four, or the DMR engine's own work "
                        "(verifier: its checker executions, copies and fingerprints)")
    p.add_argument("--pp", type=int, default=1, choices=(1, 2), help="pipeline stages (2: two processes)")
    p.add_argument("--dp", type=int, default=1, choices=(1, 2),
                   help="data-parallel replicas (2: twice the processes; with --pp 2, a 2 x 2 mesh of four)")
    p.add_argument("--faults", type=int, default=1,
                   help="faults per trial (default 1): each drawn on its own (phase, step, rank, op), all in one run")
    p.add_argument("--steps", type=int, default=3, help="training steps per trial (default 3)")
    p.add_argument("--dim", type=int, default=64, help="model width for the trials (default 64: fast)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--executor", default="auto", choices=("auto", "thread", "stream"),
                   help="where deferred checkers run in a window ([sdc.dmr] executor; auto: stream on CUDA)")
    add_json_flag(p)
    p.set_defaults(handler=run)


def spec_from(args) -> dict:
    if args.trials < 1 or args.steps < 1 or args.dim < 8:
        raise ConfigError("--trials and --steps must be >= 1 and --dim >= 8")
    if not 1 <= args.faults <= 16:
        raise ConfigError(f"--faults must be in [1, 16], got {args.faults}")
    overrides = ["--model.preset", args.model, "--model.dim", str(args.dim), "--model.n_heads", "2",
                 "--model.ffn_hidden", str(2 * args.dim), "--model.n_layers", "2", "--data.seq_len", str(args.seq_len),
                 "--data.batch_size", str(args.batch * (2 if args.pp > 1 else 1) * args.dp), "--data.max_bytes", "400000",
                 "--train.steps", str(args.steps), "--train.eval_every", "0", "--train.activation_checkpoint", "full",
                 "--output.dir", "", "--output.progress", "false", "--output.metrics", "false"]
    if args.pp > 1:
        overrides += ["--distributed.pp", "2", "--distributed.microbatches", "2"]
    if args.dp > 1:
        overrides += ["--distributed.dp", str(args.dp)]
    load_config(None, overrides)  # a bad preset or size fails here, in one line, before anything is printed or started
    return {"overrides": overrides, "trials": args.trials, "seed": args.seed, "phase": args.phase, "steps": args.steps,
            "model": args.model, "progress": not args.json, "executor": args.executor, "faults": args.faults}


def run(args) -> int:
    spec = spec_from(args)
    out = err_console if args.json else console
    out.print(f"campaign dmr: {args.model} (dim {args.dim}), {args.trials} trials, phase {args.phase}, pp {args.pp}, "
              f"dp {args.dp}, {args.faults} fault(s) a trial")
    if args.pp * args.dp == 1:
        spec["progress"] = True
        res = run_rank(spec)
    else:
        with tempfile.TemporaryDirectory(prefix="trainguard-campaign-dmr-") as tmp:
            spec_path = Path(tmp) / "spec.json"
            spec_path.write_text(json.dumps(spec))
            proc = run_workers(args.pp * args.dp, "trainguard.sdc.dmr.campaign", tmp, str(spec_path))
            if proc.returncode != 0:
                raise failed_workers("campaign dmr: a rank's process failed", proc.stderr)
            res = json.loads((Path(tmp) / "campaign.json").read_text())
    res.update(model=args.model, pp=args.pp, dp=args.dp, phase=args.phase, seed=args.seed)
    out.print(table(f"campaign dmr: {args.model}, pp {args.pp}, dp {args.dp}", {k: res[k] for k in KEYS}))
    if args.json:
        emit_json(res)
    return 0
