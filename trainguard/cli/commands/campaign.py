"""``trainguard campaign <technique>``: fault campaigns against a protection technique.

``campaign abft``: one fault per trial in an attention product of a protected model's training step
(trainguard.sdc.abft.campaign). Relies on argparse and rich.
"""

from __future__ import annotations

from trainguard.cli.output import add_json_flag, console, emit_json, err_console, table

KEYS = ("trials", "detected", "corrected", "uncorrectable", "silent", "masked", "false_positives",
        "max_abs_error_after_correction", "tolerance")


def register(subparsers) -> None:
    p = subparsers.add_parser("campaign", help="fault campaigns against a protection technique")
    sub = p.add_subparsers(dest="campaign", metavar="TECHNIQUE", parser_class=type(p))
    p.set_defaults(handler=lambda args: (p.print_help(), 2)[1])
    a = sub.add_parser("abft", help="INF / NaN / near-INF / bit flips in attention products vs ABFT")
    a.add_argument("--model", default="llama-tiny", choices=("llama-tiny", "gpt2", "bert", "gpt-neo", "roberta"))
    a.add_argument("--fault", default="nan", choices=("inf", "nan", "near-inf", "bitflip"))
    a.add_argument("--site", default="any", choices=("q", "k", "v", "scores", "context", "output", "any"))
    a.add_argument("--trials", type=int, default=20)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--seq-len", type=int, default=32)
    a.add_argument("--batch", type=int, default=2)
    a.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    a.add_argument("--size", default="tiny", choices=("tiny", "small", "base"),
                   help="HF model shape: tiny (2 layers x 64, default) or small/base (GPT-2-small / BERT-base)")
    a.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: CUDA when present, else CPU (default)")
    a.add_argument("--backward", action="store_true", help="also verify the backward-pass attention GEMMs")
    add_json_flag(a)
    a.set_defaults(handler=run_abft)
    from trainguard.cli.commands._campaign_dmr import register_campaign

    register_campaign(sub)


def run_abft(args) -> int:
    from trainguard.sdc.abft.campaign import run_campaign

    r = run_campaign(args.model, args.fault, args.site, args.trials, args.seed, args.seq_len, args.batch,
                     args.dtype, progress=True, backward=args.backward, size=args.size,
                     device=args.device)
    d = r.to_dict()
    out = err_console if args.json else console
    out.print(table(f"trainguard campaign abft: {args.model} ({args.size}) on {d['device']}, {args.fault} @ {args.site}, "
                    f"{args.dtype}",
                    {k: d[k] for k in KEYS}))
    out.print(table("per product", [(p, v["trials"], v["detected"], v["corrected"]) for p, v in sorted(d["by_product"].items())],
                    columns=("product", "trials", "detected", "corrected")))
    if args.json:
        emit_json(d)
    return 0
