"""``trainguard`` entry point. Subcommands live in ``trainguard.cli.commands.<name>`` and are discovered
at start-up, so adding a command never touches this file.

Every command handler returns an int exit code. A ``TrainguardError`` (bad config, CLI value, corpus,
checkpoint) is printed as one line on stderr with exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from trainguard import __version__
from trainguard.errors import TrainguardError


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors and exit code 2 (argparse's own convention, kept)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"trainguard: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="trainguard",
        description="Keep LLM training correct and moving when hardware fails.",
    )
    parser.add_argument("--version", action="version", version=f"trainguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    import trainguard.cli.commands as commands

    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):  # sub-command modules, registered by their parent command
            continue
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2 if args.command is None else 0
    try:
        return int(args.handler(args) or 0)
    except TrainguardError as err:
        sys.stderr.write(f"trainguard: error: {err}\n")
        return err.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("trainguard: interrupted\n")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
