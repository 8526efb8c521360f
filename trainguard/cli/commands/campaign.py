"""``trainguard campaign <technique>``: fault campaigns against a protection technique.

``campaign abft``: faults in the attention products (GEMM outputs, non-GEMM steps, backward products) of
a protected model's training step, with ABFT's step guard in the loop; every trial compared with the
fault-free step and classified (trainguard.sdc.abft.campaign, through trainguard.faults.run_campaign).
Relies on argparse and rich.
"""

from __future__ import annotations

from trainguard.cli.args import seed_int
from trainguard.cli.output import add_json_flag, console, emit_json, err_console, table

KEYS = ("trials", "detected", "corrected", "recomputed", "step_retried", "reported_failure", "masked", "silent",
        "wrong_after_correction", "uncorrectable", "unreached", "false_positives", "max_abs_error_after_correction",
        "tolerance")


def register(subparsers) -> None:
    from trainguard.sdc.abft.campaign import FAULTS, MODELS, sites

    p = subparsers.add_parser("campaign", help="fault campaigns against a protection technique")
    sub = p.add_subparsers(dest="campaign", metavar="TECHNIQUE", parser_class=type(p))
    p.set_defaults(handler=lambda args: (p.print_help(), 2)[1])
    a = sub.add_parser("abft", help="INF / NaN / near-INF / bit flips / multi-error / non-GEMM faults in attention vs ABFT")
    a.add_argument("--model", default="llama-tiny", choices=MODELS,
                   help="llama-tiny (trainguard's LLaMA) or an HF architecture built from config")
    a.add_argument("--fault", default="nan", choices=FAULTS,
                   help="one INF / NaN / near-INF / random bit flip; multi: several errors in one product "
                        "(two in a column, two in a row, 2x2 block, L-shape); nongemm: scaled / masked scores "
                        "or softmax output")
    a.add_argument("--site", default="any", choices=sites(), help="product to strike (default any)")
    a.add_argument("--trials", type=int, default=20)
    a.add_argument("--seed", type=seed_int, default=0)
    a.add_argument("--seq-len", type=int, default=32)
    a.add_argument("--batch", type=int, default=2)
    a.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    a.add_argument("--size", default="tiny", choices=("tiny", "small", "base"),
                   help="HF model shape: tiny (2 layers x 64, default) or small/base (GPT-2-small / BERT-base widths)")
    a.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: CUDA when present, else CPU (default)")
    a.add_argument("--backward", action="store_true",
                   help="also verify the backward-pass attention GEMMs (and strike backward products)")
    a.add_argument("--max-retries", type=int, default=3, help="step re-executions per trial (default 3)")
    add_json_flag(a)
    a.set_defaults(handler=run_abft)
    from trainguard.cli.commands._campaign_dmr import register_campaign

    register_campaign(sub)


def run_abft(args) -> int:
    from trainguard.sdc.abft.campaign import run_campaign

    r = run_campaign(args.model, args.fault, args.site, args.trials, args.seed, args.seq_len, args.batch,
                     args.dtype, progress=True, backward=args.backward, size=args.size,
                     device=args.device, max_retries=args.max_retries)
    d = r.to_dict()
    out = err_console if args.json else console
    out.print(table(f"trainguard campaign abft: {args.model} ({args.size}) on {d['device']}, {args.fault} @ {args.site}, "
                    f"{args.dtype}{' +bwd' if args.backward else ''}",
                    {k: d[k] for k in KEYS}))
    classes = ("corrected", "recomputed", "step_retried", "reported_failure", "masked", "silent", "wrong_after_correction")
    for title, key in (("per product", "by_product"), ("per fault kind / pattern", "by_kind")):
        out.print(table(title, [(p, v["trials"], *(v.get(c, 0) for c in classes)) for p, v in sorted(d[key].items())],
                        columns=("", "trials", "corr", "recomp", "retried", "failure", "masked", "silent", "wrong")))
    if args.json:
        emit_json(d)
    return 0
