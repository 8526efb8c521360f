"""``trainguard plan abft``: ABFT check frequencies (f_AS, f_CL, f_O) for an error rate and a target
coverage (ATTNChecker Algorithm 1, trainguard.sdc.abft.frequency). Registered by ``plan.py``."""

from __future__ import annotations

from trainguard.cli.output import add_json_flag, console, emit_json, err_console, table

MODELS = {  # attention shape (hidden, heads, layers) and vulnerability profile
    "gpt2": ((768, 12, 12), "gpt2"), "bert": ((768, 12, 12), "bert"), "gpt-neo": ((768, 12, 12), "gpt-neo"),
    "roberta": ((768, 12, 12), "roberta"), "llama-tiny": ((128, 4, 2), "llama"), "llama-60m": ((512, 8, 8), "llama"),
    "llama-130m": ((768, 12, 12), "llama"), "llama-1b": ((2048, 32, 24), "llama"), "llama-7b": ((4096, 32, 32), "llama"),
}


def register_plan(subparsers) -> None:
    p = subparsers.add_parser("abft", help="ABFT check frequencies for an error rate and a target coverage")
    p.add_argument("--error-rate", type=float, required=True,
                   help="errors (INF, NaN or near-INF each) per flop, e.g. 2e-24")
    p.add_argument("--target-coverage", type=float, default=1 - 1e-11,
                   help="probability that a step's attention has no unhandled harmful error (default 1-1e-11)")
    p.add_argument("--model", default="bert", choices=sorted(MODELS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    add_json_flag(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    from trainguard.errors import ConfigError
    from trainguard.sdc.abft.frequency import AttentionShape, optimize_frequencies

    if args.batch < 1 or args.seq_len < 1:
        raise ConfigError(f"--batch and --seq-len must be >= 1, got {args.batch}, {args.seq_len}")
    (hidden, heads, layers), profile = MODELS[args.model]
    shape = AttentionShape(args.batch, args.seq_len, hidden, heads, layers)
    plan = optimize_frequencies(args.error_rate, args.target_coverage, shape, profile)
    out = err_console if args.json else console
    rows = {"f_AS": plan.frequencies["AS"], "f_CL": plan.frequencies["CL"], "f_O": plan.frequencies["O"],
            "failure prob. / step, unprotected": 1 - plan.coverage_unprotected,
            "failure prob. / step, planned": 1 - plan.coverage, "failure prob. / step, target": 1 - plan.target,
            "checksum work vs attention GEMMs (planned)": plan.overhead_fraction,
            "checksum work vs attention GEMMs (f = 1)": plan.overhead_fraction_full,
            "target met": plan.met}
    out.print(table(f"trainguard plan abft: {args.model}, error rate {args.error_rate:g}/flop", rows))
    if not plan.met:
        out.print("[yellow]even checking every section on every step cannot reach the target: two errors in one "
                  "section are beyond one-error correction[/yellow]")
    if args.json:
        emit_json({"model": args.model, "error_rate": args.error_rate, "target_coverage": args.target_coverage,
                   "f_AS": plan.frequencies["AS"], "f_CL": plan.frequencies["CL"], "f_O": plan.frequencies["O"],
                   "coverage": plan.coverage, "coverage_unprotected": plan.coverage_unprotected,
                   "overhead_fraction": plan.overhead_fraction, "overhead_fraction_full": plan.overhead_fraction_full,
                   "fce": plan.fce, "order": plan.order, "target_met": plan.met})
    return 0
