"""``trainguard`` entry point. Subcommands live in ``trainguard.cli.commands.<name>`` and are discovered
at start-up, so adding a command never touches this file.

Every command handler returns an int exit code. A ``TrainguardError`` (bad config, CLI value, corpus,
checkpoint) is printed as one line on stderr with its exit code (2 for bad input; 3 suspected hardware
fault, 4 step aborted, 143 terminated while worker processes ran), never a traceback; Ctrl-C exits 130.
In a worker of a multi-process run started by ``trainguard train`` (``trainguard.train.launch``) errors are
handed to the launching process, which prints the first one once.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import re
import signal
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
        text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        if not _worker_report("error", text, err.exit_code):
            sys.stderr.write(f"trainguard: error: {text}\n")
        return err.exit_code
    except OSError as err:  # the machine, not a bug: a full disk, a folder that vanished, a permission
        where = f": {err.filename}" if err.filename else ""
        text = f"{err.strerror or err}{where}"
        if not _worker_report("error", text, 2):
            sys.stderr.write(f"trainguard: error: {text}\n")
        return 2
    except KeyboardInterrupt as err:
        if not _worker_report("interrupt", "", 130, getattr(err, "step", None)):
            sys.stderr.write("trainguard: interrupted\n")
        return 130
    except Exception as err:
        text = _out_of_memory(err) if isinstance(err, RuntimeError) else None
        if text is not None:
            if not _worker_report("error", text, 1):
                sys.stderr.write(f"trainguard: error: {text}\n")
            return 1
        import traceback

        if _worker_report("traceback", traceback.format_exc(), 1):
            return 1
        raise


def _out_of_memory(err: RuntimeError) -> str | None:
    """One line for an allocation the machine cannot satisfy (a batch or a model too large for it), else None."""
    text = str(err)
    if type(err).__name__ != "OutOfMemoryError" and "can't allocate memory" not in text and "out of memory" not in text:
        return None
    m = re.search(r"tried to allocate (\d+(?:\.\d+)?) ?(bytes|KiB|MiB|GiB)", text)
    size = ""
    if m:
        scale = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[m.group(2)]
        size = f" (an allocation of {float(m.group(1)) * scale / 2**30:.1f} GiB failed)"
    return (f"out of memory{size}: the run does not fit this machine; lower data.batch_size, data.seq_len or the "
            "model's size, or raise train.grad_accum")


def _worker_report(kind: str, text: str, exit_code: int, step: int | None = None) -> bool:
    """Under ``trainguard train``'s own launcher: hand the error to the launching process (printed once)."""
    if "TRAINGUARD_ERROR_DIR" not in os.environ:
        return False
    from trainguard.train.launch import report_from_child

    return report_from_child(kind, text, exit_code, step)


def entry() -> None:
    """The ``trainguard`` console script and ``python -m trainguard``: run :func:`main` and exit with its code, a
    rank of a multi-process run or an elastic replica without Python's finalization (``launch.exit_rank``)."""
    from trainguard.train.launch import exit_rank, skip_finalization

    _force_on_second_interrupt()
    try:
        code = main()
    except BaseException as err:  # (re-raised unless the process must skip finalization)
        if not skip_finalization():
            raise
        # a bug (or sys.exit) in a rank or an elastic replica: its traceback and a failing exit code, and still no
        # finalization, or gloo's teardown could turn exit 1 into an abort (-6) and hide the traceback's cause
        code = _exit_code_of(err)
    if skip_finalization():  # gloo's teardown can abort a finished process there
        exit_rank(code)
    if code == 130:
        # interrupted, and every clean-up of the command is done: no finalization, where Python has put the default
        # SIGINT action back and a second Ctrl-C would kill the process by the signal instead of exit 130
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    raise SystemExit(code)


def _force_on_second_interrupt() -> None:
    """The first Ctrl-C stops the command cleanly (a ``KeyboardInterrupt``: the run writes its summary and says how
    to resume); a second one while it is stopping exits at once with 130. Without this, a second Ctrl-C landing in
    the clean-up (or in an ``atexit`` handler) printed a traceback or killed the process by the signal. Only the
    command line does this: a program using the library keeps Python's handler."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:  # (ignored by the caller: stay ignored)
        return
    interrupts = 0

    def on_sigint(signum, frame):
        nonlocal interrupts
        interrupts += 1
        if interrupts > 1:
            os.write(2, b"trainguard: interrupted again; exiting now\n")
            os._exit(130)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)


def _exit_code_of(err: BaseException) -> int:
    """The exit code for ``err`` left uncaught, printing what Python would print: a ``SystemExit``'s own code (or
    1 with its message), 1 for an exception, 130 for an interrupt (as :func:`main` returns for one)."""
    if isinstance(err, SystemExit):
        if err.code is None or isinstance(err.code, int):
            return err.code or 0
        sys.stderr.write(f"{err.code}\n")
        return 1
    import traceback

    traceback.print_exception(err)
    return 130 if isinstance(err, KeyboardInterrupt) else 1


if __name__ == "__main__":
    entry()
