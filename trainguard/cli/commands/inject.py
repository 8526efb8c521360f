"""``trainguard inject``: a fault campaign on a small training run (K trials, one fault each).

Each trial trains ``--steps`` steps of a small model from the same seed, injects one fault at a random
step and element of the chosen site, and is classified against the fault-free reference run
(corrected / detected / masked / silent; see trainguard.faults.campaign). Relies on argparse and rich.
"""

from __future__ import annotations

from trainguard.cli.args import seed_int
from trainguard.cli.output import add_json_flag, console, emit_json, err_console, table

SITES = ("op", "module", "param", "grad", "optimizer-state")
DEFAULT_PATTERN = {"op": "aten.mm*", "module": "layers.0.attention.wq", "param": "*", "grad": "*",
                   "optimizer-state": "*"}


def register(subparsers) -> None:
    p = subparsers.add_parser("inject", help="fault-injection campaign on a small training run")
    p.add_argument("--model", default="llama-tiny", help="model preset (shrunk to a small run; default llama-tiny)")
    p.add_argument("--fault", default="bitflip", choices=("bitflip", "inf", "-inf", "nan", "near-inf", "value"))
    p.add_argument("--field", default="any", choices=("any", "sign", "exponent", "mantissa"),
                   help="bit field for --fault bitflip (default any)")
    p.add_argument("--value", type=float, default=0.0, help="value written by --fault value (default 0.0)")
    p.add_argument("--site", default="op", choices=SITES)
    p.add_argument("--pattern", default=None, help="op / module / parameter name pattern (fnmatch)")
    p.add_argument("--phase", default="forward", choices=("forward", "recompute", "backward", "optimizer", "any"),
                   help="phase of an op site (recompute switches activation checkpointing on)")
    p.add_argument("--occurrence", type=int, default=0, help="which matching op of the phase (default 0)")
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--steps", type=int, default=3, help="training steps per trial (default 3)")
    p.add_argument("--seed", type=seed_int, default=0)
    add_json_flag(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    import torch

    from trainguard.errors import TrainguardError
    from trainguard.faults import Fault, FaultModel, ModuleSite, OpSite, TensorSite, run_campaign
    from trainguard.faults.trial import TrainingTrial

    if args.trials < 1 or args.steps < 1:
        raise TrainguardError(f"--trials and --steps must be >= 1, got {args.trials} and {args.steps}")
    pattern = args.pattern or DEFAULT_PATTERN[args.site]
    if args.site == "op":
        site = OpSite(pattern, args.phase, args.occurrence)
    elif args.site == "module":
        site = ModuleSite(pattern, args.occurrence)
    else:
        site = TensorSite(args.site, pattern)
    model = FaultModel(args.fault, field=args.field, value=args.value)
    extra = ["--model.preset", args.model]
    if args.site == "op" and args.phase == "recompute":
        extra += ["--train.activation_checkpoint", "full"]
    trial = TrainingTrial(extra, steps=args.steps, seed=args.seed)
    reference = trial.reference()
    g = torch.Generator().manual_seed(args.seed)
    faults = [Fault(site, model, step=int(torch.randint(args.steps, (1,), generator=g))) for _ in range(args.trials)]
    summary = run_campaign(trial, faults, reference, progress=True, description=f"inject {args.fault} @ {args.site}")
    counts = summary.to_dict(with_results=False)
    out = err_console if args.json else console
    out.print(table(f"trainguard inject: {args.fault} at {args.site} {pattern!r} ({args.phase})", counts))
    if summary.unreached:
        out.print(f"[yellow]{summary.unreached} trial(s) never reached their site (counted, classified as masked)[/yellow]")
    if args.json:
        emit_json({**counts, "fault": args.fault, "site": args.site, "pattern": pattern, "phase": args.phase,
                   "records": [r.records for r in summary.results]})
    return 0
