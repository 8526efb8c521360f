"""``trainguard study attention``: the fault-propagation study (patterns downstream of an INF / NaN /
near-INF in each attention product, and the probability of a non-trainable state under a few AdamW
steps), from injection runs on an unprotected model (trainguard.sdc.abft.study), beside the ATTNChecker
paper's Tables 2 and 4. Relies on argparse and rich.
"""

from __future__ import annotations

from trainguard.cli.args import seed_int
from trainguard.cli.output import add_json_flag, console, emit_json, err_console, table


def register(subparsers) -> None:
    from trainguard.sdc.abft.campaign import DTYPES

    p = subparsers.add_parser("study", help="fault-propagation studies")
    sub = p.add_subparsers(dest="study", metavar="WHAT", parser_class=type(p))
    p.set_defaults(handler=lambda args: (p.print_help(), 2)[1])
    a = sub.add_parser("attention", help="how INF / NaN / near-INF in attention products propagate")
    a.add_argument("--model", default="llama-tiny",
                   help="HF gpt2, bert, gpt-neo, roberta, llama, mistral, qwen2 (built from config), or a "
                        "trainguard LLaMA preset (default llama-tiny)")
    a.add_argument("--size", default="tiny", choices=("tiny", "small", "base"),
                   help="HF model shape: tiny (2 layers x 64, default) or small/base (GPT-2-small / BERT-base "
                        "widths, whose larger activations let near-INF faults overflow as in the paper)")
    a.add_argument("--dtype", default="fp32", choices=DTYPES,
                   help="fp32 (default) or bf16 autocast, as trainguard campaign abft and train.dtype")
    a.add_argument("--trials", type=int, default=10, help="injections per (fault, product)")
    a.add_argument("--steps-after", type=int, default=3,
                   help="fault-free AdamW steps after the faulty one before judging trainability (default 3)")
    a.add_argument("--pretrain-steps", type=int, default=0,
                   help="AdamW steps on the default corpus before the study, so faults strike a trained model "
                        "(default 0: the randomly initialised one)")
    a.add_argument("--seed", type=seed_int, default=0)
    a.add_argument("--seq-len", type=int, default=32)
    a.add_argument("--batch", type=int, default=2)
    add_json_flag(a)
    a.set_defaults(handler=run)


def run(args) -> int:
    from trainguard.sdc.abft.study import OBSERVED, run_study

    r = run_study(args.model, args.trials, args.seed, args.seq_len, args.batch, size=args.size,
                  steps_after=args.steps_after, dtype=args.dtype, pretrain_steps=args.pretrain_steps)
    out = err_console if args.json else console
    trained = f", after {r.pretrain_steps} pre-training steps" if r.pretrain_steps else ", randomly initialised"
    out.print(f"{r.model} ({r.size}, {r.dtype}{trained}), {r.trials} trials per cell, {r.steps_after} AdamW steps after")
    for fault, rows in r.table.items():
        out.print(table(f"{fault.upper()} injected into (rows) -> pattern observed in (columns); "
                        f"P(non-trainable) measured / paper",
                        [(prod, *(row[o] for o in OBSERVED), f"{r.non_trainable[fault][prod]:.0%}",
                          "-" if r.paper_non_trainable[fault][prod] is None else f"{r.paper_non_trainable[fault][prod]:.1%}")
                         for prod, row in rows.items()],
                        columns=("injected", *OBSERVED, "P", "paper")))
        if fault == "near-inf":
            share = ", ".join(f"{p} {v:.0%}" for p, v in r.injected_nonfinite[fault].items())
            out.print(f"near-INF injections that were themselves INF / NaN (struck |x| in [1, 2)): {share}")
    out.print(f"Table 2 pattern shapes reproduced: {r.table2_agreement:.0%} of the paper's cells")
    for m in r.table2_mismatches:
        out.print(f"  differs: {m}")
    if args.json:
        emit_json(r.to_dict())
    return 0
