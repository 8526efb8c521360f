"""``trainguard plot RUN_DIR [--out PNG] [--json]``: draw a training run (loss, validation loss, throughput,
fault events) from its output folder into a PNG (``trainguard.report.run_plot``). Relies on argparse and rich."""

from __future__ import annotations

from trainguard.cli.args import check_figure
from trainguard.cli.output import add_json_flag, console, emit_json, err_console, table


def register(subparsers) -> None:
    p = subparsers.add_parser("plot", help="draw a training run (loss, validation loss, throughput, fault events) into a PNG")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's output folder (output.dir: metrics.jsonl)")
    p.add_argument("--out", default=None, help="PNG to write (default RUN_DIR/run.png)")
    add_json_flag(p)
    p.set_defaults(handler=run)


def run(args) -> int:

    from trainguard.report.run_plot import describe_lines, plot_run

    if args.out is not None:
        check_figure(args.out, "--out")
    path, curves = plot_run(args.run_dir, args.out)
    counts = curves.counts()
    if curves.skipped_lines:  # (a line cut short by a crash is the usual one; drawn without it, but said)
        err_console.print(f"warning: metrics.jsonl: {len(curves.skipped_lines)} line"
                          f"{'s' if len(curves.skipped_lines) > 1 else ''} left out, not a record with an integer "
                          f"step ({describe_lines(curves.skipped_lines)})", markup=False, highlight=False, soft_wrap=True)
    result = {"path": str(path), "steps": len(curves.steps), "first_step": curves.steps[0], "last_step": curves.steps[-1],
              "evaluations": len(curves.val), "resumes": len(curves.resumes), "events": counts,
              "skipped_lines": curves.skipped_lines}
    out = err_console if args.json else console
    out.print(table(f"trainguard plot: {path}", {"steps": f"{curves.steps[0]}..{curves.steps[-1]}",
                                                 "evaluations": len(curves.val), "resumes": len(curves.resumes),
                                                 **counts}))
    if args.json:
        emit_json(result)
    return 0
