"""``trainguard bench abft``: protected vs unprotected attention and training step, measured side by side
in one run, plus recovery by in-place correction vs checkpoint restore (trainguard.sdc.abft.campaign).
Registered by ``bench.py``."""

from __future__ import annotations

from trainguard.cli.output import add_json_flag, console, emit_json, err_console, table


def register_bench(subparsers) -> None:
    p = subparsers.add_parser("abft", help="ABFT overhead (attention, training step) and recovery cost")
    p.add_argument("--model", default="gpt2", choices=("gpt2", "bert", "gpt-neo", "roberta", "llama", "mistral", "qwen2",
                                                       "llama-tiny", "llama-60m"))
    p.add_argument("--size", default="small", choices=("tiny", "small", "base"),
                   help="HF model size: small/base = GPT-2-small / BERT-base shapes (default small)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per round and mode")
    p.add_argument("--host-memory", default="retain", choices=("retain", "default"),
                   help="retain: keep freed CPU memory in the process for both modes (no page faults on every "
                        "large buffer each step; see trainguard.train.host_memory); default: glibc as is")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: CUDA when present, else CPU (default)")
    p.add_argument("--no-backward", action="store_true", help="skip the backward-protection measurement")
    p.add_argument("--checkpoint-interval", type=int, default=100,
                   help="steps between checkpoints for the checkpoint/restore comparison: a fault loses "
                        "(N + 1) / 2 steps on average (default 100, as configs/tiny.toml)")
    p.add_argument("--plot", default=None, help="write the net time saved against the fault rate to this PNG")
    add_json_flag(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    from trainguard.errors import ConfigError
    from trainguard.sdc.abft.bench import bench

    if min(args.batch, args.seq_len, args.rounds, args.steps) < 1:
        raise ConfigError("--batch, --seq-len, --rounds and --steps must be >= 1")
    if args.checkpoint_interval < 1:
        raise ConfigError(f"--checkpoint-interval must be >= 1, got {args.checkpoint_interval}")
    if args.plot:  # refused now, not after the benchmark
        from pathlib import Path

        from trainguard.cli.args import check_figure
        from trainguard.cli.commands.plan import _writable_dir

        check_figure(args.plot, "--plot")
        _writable_dir(str(Path(args.plot).parent), "--plot")
    r = bench(args.model, args.batch, args.seq_len, args.rounds, args.steps, args.size, not args.no_backward,
              progress=True, host_memory=args.host_memory, device=args.device,
              checkpoint_interval=args.checkpoint_interval)
    title = (f"trainguard bench abft: {args.model} ({args.size}) on {r['device']}, batch {args.batch} x {args.seq_len}, "
             f"host memory {r['host_memory']}")
    overheads = []
    for key in ("attention_overhead", "train_step_overhead", "attention_overhead_with_backward",
                "train_step_overhead_with_backward"):
        if key in r:
            lo, hi = r[key + "_ci95"]
            label = key.replace("_overhead", "").replace("train_step", "step").replace("_with_backward", " +bwd")
            overheads.append((label, f"{r[key]:+.2%}", f"{lo:+.1%}..{hi:+.1%}", f"{r[key + '_ratio_of_medians']:+.2%}"))
    rows = {k: r[k] for k in ("detection_cost_per_step", "correction_cost_vs_step", "checkpoint_interval",
                              "lost_steps_per_fault", "checkpoint_load_s", "checkpoint_restore_cost_vs_step",
                              "abft_cost_per_fault_vs_step", "recovery_speedup", "recovery_speedup_correction_only",
                              "recovery_speedup_interval_1", "break_even_faults_per_step", "break_even_steps_per_fault",
                              "faults_corrected_in_recovery_runs", "recovery_faults_injected",
                              "correction_cost_vs_step_from_step_medians", "step_pairs", "threads")}
    out = err_console if args.json else console
    out.print(table(title, overheads, columns=("overhead", "paired median", "95% CI", "ratio of medians")))
    out.print(table(f"recovery vs checkpoint/restore (checkpoint every {r['checkpoint_interval']} steps)", rows))
    if args.plot:
        import math

        from trainguard.report.figures import line_plot

        curve = r["net_time_saved"]
        path = line_plot(args.plot, [math.log10(f) for f in curve["faults_per_step"]],
                         {"ABFT vs checkpoint/restore": [100 * v for v in curve["fraction_of_step"]]},
                         xlabel="log10(faults per step)", ylabel="net time saved (% of a step)", markers=False,
                         title=f"{args.model}: checkpoint every {r['checkpoint_interval']} steps", hline=0.0)
        r["plot"] = str(path)
        out.print(f"plot: {path}")
    if args.json:
        emit_json(r)
    return 0
