"""``trainguard study attention``: the fault-propagation study (patterns downstream of an INF / NaN /
near-INF in each attention product, and the probability of a non-trainable state), from injection
runs on an unprotected model (trainguard.sdc.abft.study). Relies on argparse and rich."""

from __future__ import annotations

from trainguard.cli.output import add_json_flag, console, emit_json, err_console, table


def register(subparsers) -> None:
    p = subparsers.add_parser("study", help="fault-propagation studies")
    sub = p.add_subparsers(dest="study", metavar="WHAT", parser_class=type(p))
    p.set_defaults(handler=lambda args: (p.print_help(), 2)[1])
    a = sub.add_parser("attention", help="how INF / NaN / near-INF in attention products propagate")
    a.add_argument("--model", default="llama-tiny", help="trainguard LLaMA preset (default llama-tiny)")
    a.add_argument("--trials", type=int, default=10, help="injections per (fault, product)")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--seq-len", type=int, default=32)
    add_json_flag(a)
    a.set_defaults(handler=run)


def run(args) -> int:
    from trainguard.sdc.abft.study import OBSERVED, run_study

    r = run_study(args.model, args.trials, args.seed, args.seq_len)
    out = err_console if args.json else console
    for fault, rows in r.table.items():
        out.print(table(f"{fault.upper()} injected into (rows) -> pattern observed in (columns); "
                        f"P(non-trainable) last", [(prod, *(row[o] for o in OBSERVED), f"{r.non_trainable[fault][prod]:.0%}")
                                                   for prod, row in rows.items()],
                        columns=("injected", *OBSERVED, "P(NaN)")))
    if args.json:
        emit_json(r.to_dict())
    return 0
