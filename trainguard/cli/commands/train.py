"""``trainguard train [CONFIG] [--section.key value ...] [--json]``: train from a TOML config.

Overrides use the config's dotted names (``--train.steps 50``, ``--model.dim=64``). Multi-process runs
(``distributed.dp * distributed.pp > 1``) re-launch themselves under torchrun
(``trainguard.train.launch``); rank 0 prints the summary. Relies on argparse and rich.
"""

from __future__ import annotations

import argparse
import sys
import types

from trainguard.cli.output import console, emit_json, table

HELP = """usage: trainguard train [CONFIG] [--section.key VALUE ...] [--json]

Train a model. CONFIG is a TOML file (see configs/); every config field can be overridden on the
command line as --section.key VALUE or --section.key=VALUE, e.g.
  trainguard train configs/tiny.toml --train.steps 50 --data.max_bytes 2000000
Sections: model, data, train, checkpoint, distributed, sdc, output.
  --json    print the run summary as one JSON object on the last line of stdout
"""


def _parse_known_args(self, args=None, namespace=None):
    """Config path, ``--json`` and free-form ``--section.key value`` overrides (argparse cannot express
    arbitrary dotted options, so this parser takes its arguments as they come)."""
    ns = namespace if namespace is not None else argparse.Namespace()
    items = list(sys.argv[1:] if args is None else args)
    if "-h" in items or "--help" in items:
        sys.stdout.write(HELP)
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


def run(args) -> int:
    from trainguard.config import load_config
    from trainguard.train.launch import needs_launch, relaunch

    cfg = load_config(args.config, args.overrides)
    if needs_launch(cfg):
        from trainguard.data import resolve_files

        resolve_files(cfg.data.source)  # a missing corpus is one line here, not one traceback per rank

        return relaunch(cfg, cli_args(args))

    from trainguard.sdc.runtime import attach_from_config
    from trainguard.train.trainer import dist_env, run_training

    rank = dist_env()[0]
    summary = run_training(cfg, setup=attach_from_config)
    if rank != 0:
        return 0
    d = summary.to_dict() if hasattr(summary, "to_dict") else dict(summary)
    d["config"] = args.config
    rows = {k: v for k, v in d.items() if k not in ("extra", "config") and v is not None}
    (console if not args.json else _stderr_console()).print(table("trainguard train: summary", rows))
    if args.json:
        emit_json(d)
    return 0


def _stderr_console():
    from trainguard.cli.output import err_console

    return err_console
