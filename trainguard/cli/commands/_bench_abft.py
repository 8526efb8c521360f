"""``trainguard bench abft``: protected vs unprotected attention and training step, measured side by side
in one run, plus recovery by in-place correction vs checkpoint restore (trainguard.sdc.abft.campaign).
Registered by ``bench.py``."""

from __future__ import annotations

from trainguard.cli.output import add_json_flag, console, emit_json, err_console, table


def register_bench(subparsers) -> None:
    p = subparsers.add_parser("abft", help="ABFT overhead (attention, training step) and recovery cost")
    p.add_argument("--model", default="gpt2", choices=("gpt2", "bert", "gpt-neo", "roberta", "llama-tiny", "llama-60m"))
    p.add_argument("--size", default="small", choices=("tiny", "small", "base"),
                   help="HF model size: small/base = GPT-2-small / BERT-base shapes (default small)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per round and mode")
    p.add_argument("--no-backward", action="store_true", help="skip the backward-protection measurement")
    add_json_flag(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    from trainguard.errors import ConfigError
    from trainguard.sdc.abft.campaign import bench

    if min(args.batch, args.seq_len, args.rounds, args.steps) < 1:
        raise ConfigError("--batch, --seq-len, --rounds and --steps must be >= 1")
    r = bench(args.model, args.batch, args.seq_len, args.rounds, args.steps, args.size, not args.no_backward)
    keys = ("attention_overhead", "train_step_overhead", "attention_overhead_with_backward",
            "train_step_overhead_with_backward", "attention_overhead_ratio_of_medians",
            "train_step_overhead_ratio_of_medians", "correction_cost_vs_step", "checkpoint_restore_cost_vs_step",
            "recovery_speedup", "faults_corrected_in_recovery_runs", "recovery_faults_injected",
            "correction_cost_vs_step_from_step_medians", "threads")
    out = err_console if args.json else console
    out.print(table(f"trainguard bench abft: {args.model} ({args.size}), batch {args.batch} x {args.seq_len}",
                    {k: r[k] for k in keys if k in r}))
    if args.json:
        emit_json(r)
    return 0
