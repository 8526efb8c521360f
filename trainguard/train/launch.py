"""Multi-process launch for ``trainguard train``: when a run asks for more than one process
(``distributed.world_size()``) and we are not already under ``torchrun`` (no ``LOCAL_RANK``), re-run the
same command line in that many worker processes under torch's elastic agent (what ``torchrun --standalone`` runs) and return one exit code.

Errors are reported once, not once per rank: each worker writes its one-line error (or, for a bug, its
traceback) into a per-launch folder named by ``$TRAINGUARD_ERROR_DIR`` instead of printing it, the agent
runs quietly (no ``ChildFailedError`` block), and :func:`relaunch` returns the first error by time, with its
exit code (2 for bad input, 3, 4, 130 for Ctrl-C, 143 for SIGTERM). SIGTERM sent to this process is passed
on to the workers (they checkpoint at the next step boundary and exit 143); Ctrl-C reaches them directly.
A launching process killed outright (SIGKILL, the OOM killer) cannot pass anything on: on Linux each agent asks
the kernel for SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``), so it stops its workers then too.
Relies on the standard library (subprocess, signal, ctypes for ``prctl``) and torch's elastic launcher.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from trainguard.errors import StepAborted, SuspectedHardwareFault, Terminated, TrainguardError

ERROR_DIR_ENV = "TRAINGUARD_ERROR_DIR"
PARENT_ENV = "TRAINGUARD_LAUNCHED_BY"  # the launching process's pid, which an agent must not outlive
_PR_SET_PDEATHSIG = 1  # (linux/prctl.h)


def under_launcher() -> bool:
    return "LOCAL_RANK" in os.environ


def exit_rank(code: int) -> NoReturn:
    """End a rank process of a multi-process run now, without Python's finalization, once its work is written.

    torch's gloo process group destroys a collective's work object on its own worker thread once the collective
    completes, and the work holds the tensors it was given; releasing one that Python owns takes the GIL. If that
    happens while the interpreter finalizes (the main thread has already left ``main``), the thread is ended inside
    a C++ destructor and the process aborts ("terminate called without an active exception", exit 134): the
    launcher then reports a failed rank for a run that finished. Seen in about one two-process ``trainguard train``
    run in ten on this host (three in ten with DMR on), after the summary was printed. Everything a rank writes is
    closed before this is called (metrics, checkpoints, reports), so skipping finalization loses nothing; standard
    output, standard error and logging are flushed here. ``tests/train/test_exit_rank.py`` shows the abort on the
    pinned torch and fails once it no longer happens."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_holds_process_group = False


def note_process_group() -> None:
    """Record that this process made a process group outside any launcher (an elastic replica's torchft group):
    gloo's teardown can abort its finalization as it does a launched rank's, so it too ends with
    :func:`exit_rank` (see :func:`skip_finalization`)."""
    global _holds_process_group
    _holds_process_group = True


def skip_finalization() -> bool:
    """Whether ``python -m trainguard`` should leave through :func:`exit_rank`: a rank under a launcher, or a
    process that made a process group of its own (an elastic replica started by hand or by a script)."""
    return under_launcher() or _holds_process_group


def needs_launch(cfg) -> bool:
    return cfg.distributed.world_size() > 1 and not under_launcher()


def launch_command(nproc: int, cli_args: list[str]) -> list[str]:
    """The agent process: ``python -m trainguard.train.launch NPROC trainguard-args...``."""
    return [sys.executable, "-m", "trainguard.train.launch", str(nproc), *cli_args]


def _agent_env(env: dict[str, str]) -> dict[str, str]:
    return dict(env, **{PARENT_ENV: str(os.getpid())})


def die_with_parent() -> bool:
    """In an agent started by this module: have the kernel send SIGTERM to this process when the process that
    launched it dies, however it dies (a SIGKILL cannot be passed on). If it is already gone (it died before this
    ran), exit 143 at once. False where this is not possible (not Linux, or not started by this module)."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return False
    if os.getppid() != int(parent):  # (orphaned before the request was made: nothing would signal it)
        raise SystemExit(143)
    return True


@dataclass
class LaunchResult:
    returncode: int
    message: str | None = None  # the one-line error of the first failing worker
    traceback: str | None = None  # or its traceback, when it failed with a bug
    rank: int | None = None
    step: int | None = None  # for an interrupted run: the steps done when Ctrl-C came (rank 0)


def relaunch(cfg, cli_args: list[str]) -> LaunchResult:
    """Run ``trainguard <cli_args>`` in ``distributed.world_size()`` processes; the workers inherit stdout/stderr."""
    nproc = cfg.distributed.world_size()
    env = dict(os.environ)
    # torchrun warns and forces 1 thread when unset; choose a fair share of the cores instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    with tempfile.TemporaryDirectory(prefix="trainguard-launch-") as errdir:
        env[ERROR_DIR_ENV] = errdir
        proc = subprocess.Popen(launch_command(nproc, cli_args), env=_agent_env(env))
        # Ctrl-C reaches every process of the terminal's group: the workers stop themselves and the agent
        # reports; this process only waits. SIGTERM sent to this process alone is passed on.
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        old_term = signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
        try:
            rc = proc.wait()
        finally:
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)
        return _result(rc, read_child_reports(Path(errdir)))


def run_workers(nproc: int, module: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` in ``nproc`` processes under torch's elastic agent (one thread each), their output
    captured: how the pipeline benchmarks, campaigns and profiles run their ranks. SIGTERM sent to this process is
    passed on to the agent, which stops its workers, and then raised as :class:`Terminated` (exit code 143):
    without that, a terminated command left its ranks running and its temporary folder behind. If this process is
    killed outright, the agent gets SIGTERM from the kernel (:func:`die_with_parent`) and stops them all the same
    (the caller's temporary folder then stays: nothing of this process runs any more to remove it). Any exception
    while it waits (a KeyboardInterrupt sent to this process alone) stops the agent and its ranks before it goes on."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("LOCAL_RANK", None)
    # (torch's agent, run by this module's entry point so that it stops when this process dies: die_with_parent)
    cmd = [sys.executable, "-m", "trainguard.train.launch", "--torchrun", "--standalone", f"--nproc_per_node={nproc}",
           "-m", module, *args]
    proc = subprocess.Popen(cmd, env=_agent_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    terminated: list[int] = []

    def pass_on(signum, frame) -> None:
        terminated.append(signum)
        proc.send_signal(signal.SIGTERM)

    on_main = threading.current_thread() is threading.main_thread()  # (signal handlers: the main thread only)
    old_term = signal.signal(signal.SIGTERM, pass_on) if on_main else None
    try:
        out, err = proc.communicate()
    except BaseException:
        # this process leaves early: a Ctrl-C sent to it alone (a notebook's interrupt, ``kill -INT``), or any
        # exception raised in its thread. The agent and its ranks must not run on without it
        _stop_agent(proc)
        raise
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, old_term)
    if terminated:
        raise Terminated(f"terminated (SIGTERM): the {nproc} processes of {module} were stopped")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _stop_agent(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to torch's agent, which stops its ranks and exits; SIGKILL if it has not within ``grace_s``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=grace_s)  # (reading its pipes: a full pipe must not keep it from exiting)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


_SIGNALLED = re.compile(r"rank\s*:\s*(\d+).*?traceback\s*:\s*(Signal \d+ \(\w+\))", re.S)
# an exception's last line: its (dotted) class name, then ":" or the end; trainguard's own exceptions included
# (SuspectedHardwareFault, StepAborted, Terminated), whose names end neither in Error nor in Exception
_EXCEPTION = re.compile(r"^\[?[\w.]*(Error|Exception|Fault|Aborted|Terminated|Interrupt|Exit)\b(:|$)")
_LOST_PEER = ("Connection closed by peer", "Connection reset by peer")


def worker_error(stderr: str) -> str:
    """One line for a failed :func:`run_workers` call: the first worker's own exception line (the agent's summary
    after it, ``ChildFailedError``, says nothing about the cause; another rank's error after it is most often that
    rank losing its peer), else the last three lines of the output. A rank that died of a signal (a crash: no
    exception line of its own) is named from the agent's summary, before the lost-peer errors of the others."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln.split("]: ")[-1] for ln in lines if _EXCEPTION.match(ln.split("]: ")[-1]) and "ChildFailedError" not in ln]
    own = [e for e in errors if not any(lost in e for lost in _LOST_PEER)]
    if own:
        return own[0]
    root = stderr.split("Root Cause", 1)[-1] if "Root Cause" in stderr else ""
    signalled = _SIGNALLED.search(root)
    if signalled:
        return f"rank {signalled.group(1)} died of {signalled.group(2)}" + (f"; the others: {errors[0]}" if errors else "")
    return errors[0] if errors else " | ".join(lines[-3:])


def failed_workers(what: str, stderr: str) -> TrainguardError:
    """The error to raise for a failed :func:`run_workers` call (``what``: the command and what failed): one line,
    naming a file that keeps every rank's whole output (the temporary folder the ranks ran in is removed, and their
    output is all there is to tell a crash's cause). A rank's suspected hardware fault or aborted step keeps its
    class, so the command exits with that code (3, 4) and not as for bad input."""
    fd, path = tempfile.mkstemp(prefix="trainguard-ranks-", suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write(stderr)
    cause = worker_error(stderr)
    kind = next((k for k in (SuspectedHardwareFault, StepAborted) if cause.startswith(f"trainguard.errors.{k.__name__}:")),
                TrainguardError)
    return kind(f"{what}: {cause} (every rank's output: {path})")


def _result(rc: int, reports: list[dict]) -> LaunchResult:
    if rc < 0:
        rc = 128 - rc
    errors = [r for r in reports if r.get("kind") in ("error", "traceback")]
    if errors:
        first = min(errors, key=lambda r: r.get("time", 0.0))
        code = int(first.get("exit_code", 1))
        if first["kind"] == "traceback":
            return LaunchResult(code, traceback=first.get("text"), rank=first.get("rank"))
        return LaunchResult(code, message=first.get("text"), rank=first.get("rank"))
    interrupts = [r for r in reports if r.get("kind") == "interrupt"]
    if interrupts:
        main = min(interrupts, key=lambda r: r.get("rank", 0))
        return LaunchResult(130, rank=main.get("rank"), step=main.get("step"))
    return LaunchResult(rc)


def read_child_reports(folder: Path) -> list[dict]:
    out = []
    for f in sorted(folder.glob("rank*.json")):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    return out


def report_from_child(kind: str, text: str = "", exit_code: int = 1, step: int | None = None) -> bool:
    """In a worker started by :func:`relaunch`: record this rank's error instead of printing it (the launching
    process prints the first one). Returns False outside such a worker (the caller prints)."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder or not under_launcher():
        return False
    rank = int(os.environ.get("RANK", "0"))
    record = {"kind": kind, "text": text, "exit_code": exit_code, "rank": rank, "time": time.time(), "step": step}
    path = Path(folder) / f"rank{rank}.json"
    try:
        if path.exists():  # keep the first report of this rank
            return True
        tmp = path.with_suffix(".part")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError:
        return False
    return True


def _agent_main(argv: list[str]) -> int:
    """The elastic agent (``torchrun --standalone``) without its per-failure error block: returns the
    exit code of the first worker that failed, or 128 + signal when the agent itself was signalled."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    nproc, cli = int(argv[0]), argv[1:]
    args = get_args_parser().parse_args(["--standalone", f"--nproc_per_node={nproc}", "-m", "trainguard", *cli])
    try:
        run(args)
    except ChildFailedError as err:
        _, failure = err.get_first_failure()
        code = failure.exitcode
        return 128 - code if code < 0 else (code or 1)
    except SignalException as err:
        return 128 + int(err.sigval)
    except KeyboardInterrupt:
        return 130
    except Exception:  # the agent itself failed (rendezvous, ports): say so once
        sys.stderr.write(traceback.format_exc())
        return 1
    return 0


def _torchrun(argv: list[str]) -> None:
    """``python -m torch.distributed.run ARGV``, exactly as that command runs it."""
    import runpy

    sys.argv = ["torch.distributed.run", *argv]
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    die_with_parent()
    if sys.argv[1:2] == ["--torchrun"]:
        _torchrun(sys.argv[2:])
    else:
        raise SystemExit(_agent_main(sys.argv[1:]))
