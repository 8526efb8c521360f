"""``trainguard train [CONFIG] [--section.key value ...] [--json]``: train from a TOML config.

Overrides use the config's dotted names (``--train.steps 50``, ``--model.dim=64``); ``--help`` lists every
key with its type, default and meaning, generated from the config classes. Multi-process runs
(``distributed.dp * distributed.pp > 1``) re-launch themselves under torch's elastic agent
(``trainguard.train.launch``); rank 0 prints the summary and errors are printed once.

Exit codes: 0 done (or nothing left to do), 2 bad input (config, corpus, checkpoint, folder), 3 suspected
hardware fault, 4 step aborted, 130 Ctrl-C, 143 preempted by SIGTERM (a checkpoint was saved at the step
boundary). Relies on argparse and rich.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import types

from trainguard.cli.output import console, emit_json, table

USAGE = """usage: trainguard train [CONFIG] [--section.key VALUE ...] [--json]

Train a model. CONFIG is a TOML file (see configs/) with sections [model] [data] [train] [checkpoint]
[distributed] [sdc] [output]; every key below can also be given on the command line as
--section.key VALUE or --section.key=VALUE, e.g.
  trainguard train configs/tiny.toml --train.steps 50 --data.max_bytes 2000000
  --json    print the run summary as one JSON object on the last line of stdout

Resume a run: the same command with --checkpoint.resume true (see the README, "Resuming a run").
Exit codes: 0 done, 2 bad input, 3 suspected hardware fault, 4 step aborted, 130 Ctrl-C,
143 preempted by SIGTERM (checkpoint saved at the next step boundary).
"""


def help_text() -> str:
    """USAGE plus every config key with its type, default and meaning (from the config classes)."""
    from trainguard.config import config_help

    lines = [USAGE]
    section = None
    for key, typ, default, text in config_help():
        head = key.rsplit(".", 1)[0]
        if head != section:
            section = head
            lines.append(f"[{head}]")
        lines.append(f"  --{key}  {typ}  (default: {default})")
        if text:
            lines.append(f"      {text}")
    return "\n".join(lines) + "\n"


def _parse_known_args(self, args=None, namespace=None):
    """Config path, ``--json`` and free-form ``--section.key value`` overrides (argparse cannot express
    arbitrary dotted options, so this parser takes its arguments as they come)."""
    ns = namespace if namespace is not None else argparse.Namespace()
    items = list(sys.argv[1:] if args is None else args)
    if "-h" in items or "--help" in items:
        sys.stdout.write(help_text())
        raise SystemExit(0)
    ns.json = "--json" in items
    items = [a for a in items if a != "--json"]
    ns.config = items.pop(0) if items and not items[0].startswith("-") else None
    ns.overrides = items
    ns.handler = run
    return ns, []


def register(subparsers) -> None:
    parser = subparsers.add_parser("train", help="train a model from a TOML config (+ --section.key overrides)",
                                   add_help=False)
    parser.parse_known_args = types.MethodType(_parse_known_args, parser)
    parser.set_defaults(handler=run)


def cli_args(args) -> list[str]:
    return ["train", *([args.config] if args.config else []), *args.overrides, *(["--json"] if args.json else [])]


_RESUME_KEYS = ("checkpoint.resume", "checkpoint.resume_step", "checkpoint.start_over")


def resume_command(args) -> str:
    """This command line with ``--checkpoint.resume true`` (and no other resume / start-over choice)."""
    items, kept, i = list(args.overrides), [], 0
    while i < len(items):
        item = items[i]
        key = item[2:].split("=", 1)[0] if item.startswith("--") else None
        if key in _RESUME_KEYS:
            i += 1 if "=" in item else 2
            continue
        kept.append(item)
        i += 1
    argv = ["trainguard", "train", *([args.config] if args.config else []), *kept, "--checkpoint.resume", "true"]
    return shlex.join(argv)


def where_to_resume(cfg, args) -> str:
    """The newest intact checkpoint and the command that resumes from it (for Ctrl-C and SIGTERM)."""
    if not cfg.checkpoint.dir:
        return "no checkpoint.dir was set, so the run cannot be resumed"
    from trainguard.errors import CheckpointError
    from trainguard.train.checkpoint import CheckpointManager

    try:
        path, manifest, _ = CheckpointManager(cfg.checkpoint.dir).newest_intact()
    except CheckpointError as err:  # (a newer version's checkpoint there: said, not raised over the interrupt)
        return f"the checkpoints in {cfg.checkpoint.dir} cannot be read: {err}"
    if path is None:
        return f"no checkpoint in {cfg.checkpoint.dir} yet (the next run starts from step 0)"
    return f"newest intact checkpoint: step {manifest['step']} ({path}); resume with: {resume_command(args)}"


def run(args) -> int:
    from trainguard.config import load_config
    from trainguard.train.launch import needs_launch, relaunch, report_from_child
    from trainguard.train.trainer import check_output_folders
    from trainguard.utils.settings import repeated_keys

    cfg = load_config(args.config, args.overrides)
    check_output_folders(cfg)  # an unwritable folder is found now, not at the first save after training
    _wait_for_the_checkpoint_folder(cfg)
    if needs_launch(cfg):
        from trainguard.data import resolve_files

        resolve_files(cfg.data.source)  # a missing corpus is one line here, not one per rank
        res = relaunch(cfg, cli_args(args))
        if res.message:
            sys.stderr.write(f"trainguard: error: {res.message}\n")
        elif res.traceback:
            sys.stderr.write(res.traceback)
        elif res.returncode == 130:
            sys.stderr.write(_interrupted(cfg, args, res.step))
        return res.returncode

    from trainguard.sdc.runtime import attach_from_config
    from trainguard.train.trainer import dist_env, run_training

    rank = dist_env()[0]
    try:
        def setup(trainer) -> None:
            if trainer.is_main:  # (said once the run is sure to start: bad input stays one line of error)
                for line in repeated_keys(args.overrides):
                    sys.stderr.write(f"trainguard: note: {line}\n")
            attach_from_config(trainer)

        summary = run_training(cfg, setup=setup)
    except KeyboardInterrupt as err:
        step = getattr(err, "step", None)
        if not report_from_child("interrupt", "", 130, step) and rank == 0:
            sys.stderr.write(_interrupted(cfg, args, step))
        return 130
    preempted = summary.stop_reason == "preempted"
    if rank != 0:
        return 143 if preempted else 0
    d = summary.to_dict() if hasattr(summary, "to_dict") else dict(summary)
    d["config"] = args.config
    rows = {k: v for k, v in d.items() if k not in ("extra", "config", "resume_changes") and v is not None}
    (console if not args.json else _stderr_console()).print(table("trainguard train: summary", rows))
    if preempted:
        sys.stderr.write(f"trainguard: preempted (SIGTERM) after step {summary.end_step}; "
                         f"{where_to_resume(cfg, args)}\n")
    if args.json:
        emit_json(d)
    return 143 if preempted else 0


def _wait_for_the_checkpoint_folder(cfg) -> None:
    """A checkpoint or output folder in use by another run is found before the model is built and the data read
    (the trainer's main rank takes the folders' locks later, as ever). Not for a rank of a launch (its launcher looked)
    nor for elastic replicas, which share one folder by design and lock nothing."""
    from trainguard.train.launch import under_launcher

    if under_launcher() or cfg.distributed.strategy == "elastic":
        return
    from trainguard.train import run_lock

    for what, folder in (("checkpoint.dir", cfg.checkpoint.dir), ("output.dir", cfg.output.dir)):
        if folder:  # (the output folder too: Trainer.run holds it as the checkpoint folder is held)
            run_lock.wait_until_free(folder, cfg.checkpoint.lock_wait_s,
                                     lambda text: sys.stderr.write(f"trainguard: note: {text}\n"), what)


def _interrupted(cfg, args, step) -> str:
    where = f"at step {step}" if step is not None else "before training started"
    return f"trainguard: interrupted {where}; {where_to_resume(cfg, args)}\n"


def _stderr_console():
    from trainguard.cli.output import err_console

    return err_console
