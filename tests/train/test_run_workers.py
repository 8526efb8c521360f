"""``train.launch.run_workers``: SIGTERM sent to the command reaches its ranks (they stop, and the command raises
``Terminated``, exit code 143); a command killed outright (SIGKILL) leaves no rank running either."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from trainguard.errors import SuspectedHardwareFault, Terminated, TrainguardError
from trainguard.train.launch import PARENT_ENV, failed_workers, run_workers, worker_error


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # (a zombie not yet reaped by its parent counts as stopped)
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_sigterm_to_the_command_stops_its_ranks(tmp_path):
    ready = tmp_path / "ready"
    pids: list[int] = []

    def terminate_once_both_ranks_run():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all((tmp_path / f"pid{r}").exists() for r in range(2)):
            time.sleep(0.1)
        pids.extend(int((tmp_path / f"pid{r}").read_text()) for r in range(2) if (tmp_path / f"pid{r}").exists())
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=terminate_once_both_ranks_run, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(Terminated, match="SIGTERM") as err:
        run_workers(2, "tests.train._sleeping_worker", str(ready))
    assert err.value.exit_code == 143
    assert len(pids) == 2  # both ranks were running when the signal came
    assert time.monotonic() - t0 < 90  # (they sleep for 120 s)
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)
    assert signal.getsignal(signal.SIGTERM) is before  # the command's own handling is back


def test_ranks_stop_when_the_command_is_killed_outright(tmp_path):
    """SIGKILL cannot be passed on: the agent asks the kernel for SIGTERM when the command dies (die_with_parent)."""
    ready = tmp_path / "ready"
    code = f"from trainguard.train.launch import run_workers; run_workers(2, 'tests.train._sleeping_worker', {str(ready)!r})"
    command = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all((tmp_path / f"pid{r}").exists() for r in range(2)):
            time.sleep(0.1)
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
        command.kill()
        command.wait()
        deadline = time.monotonic() + 40  # (the agent gives its workers up to 30 s to stop)
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids)
    finally:
        command.kill()


def test_ctrl_c_sent_to_the_command_alone_stops_its_ranks_before_it_leaves(tmp_path):
    """A KeyboardInterrupt that reaches only the command (a notebook's interrupt, ``kill -INT`` to its pid; a
    terminal's Ctrl-C reaches every process of the group) used to leave the agent and its ranks running."""
    ready = tmp_path / "ready"
    code = (f"from trainguard.train.launch import run_workers\n"
            f"try:\n    run_workers(2, 'tests.train._sleeping_worker', {str(ready)!r})\n"
            f"except KeyboardInterrupt:\n    print('interrupted', flush=True)\n")
    command = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                               stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all((tmp_path / f"pid{r}").exists() for r in range(2)):
            time.sleep(0.1)
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
        os.kill(command.pid, signal.SIGINT)
        out, _ = command.communicate(timeout=60)
        assert "interrupted" in out  # it waited for the ranks to stop, then went on with the interrupt
        assert not any(_alive(p) for p in pids)  # (no grace here: stopped before the command went on)
    finally:
        command.kill()


def test_an_agent_whose_command_died_before_it_asked_exits_at_once():
    """(In a child process: the request changes the process that makes it.)"""
    code = "from trainguard.train.launch import die_with_parent; print(die_with_parent())"
    root = Path(__file__).resolve().parents[2]
    orphaned = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                              env=dict(os.environ, **{PARENT_ENV: str(os.getpid() + 1_000_000)}))
    assert orphaned.returncode == 143 and orphaned.stdout == ""
    watched = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                             env=dict(os.environ, **{PARENT_ENV: str(os.getpid())}))
    assert watched.returncode == 0 and watched.stdout.strip() == "True"


def test_a_failed_run_is_summed_up_by_the_workers_own_exception_line():
    stderr = "[rank1]: Traceback (most recent call last):\n[rank1]:   File \"x.py\", line 3\n" \
             "[rank1]: ValueError: bad spec\n\nE1127 torch.distributed.elastic: failed (exitcode: 1)\n"
    assert worker_error(stderr) == "ValueError: bad spec"
    assert worker_error("one\n\ntwo\nthree\nfour\n") == "two | three | four"  # (no exception line: the last three)
    # two ranks failed, then the agent's summary (as a campaign's rank failing printed it): the first rank's cause
    stderr = ("[rank1]: Traceback (most recent call last):\n[rank1]: RuntimeError: dmr: the state at the start of step 0 "
              "is no longer kept\n[rank0]: Traceback (most recent call last):\n[rank0]: RuntimeError: Connection closed "
              "by peer\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n=====\n")
    assert worker_error(stderr) == "RuntimeError: dmr: the state at the start of step 0 is no longer kept"


SIGNALLED = """[rank0]: Traceback (most recent call last):
[rank0]: RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:44452
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
trainguard.sdc.dmr.campaign FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-03_14:52:00
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 4321)
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-03_14:51:59
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -11 (pid: 1234)
  error_file: <N/A>
  traceback : Signal 11 (SIGSEGV) received by PID 1234
============================================================
"""


def test_a_rank_that_crashed_is_named_before_the_peer_that_lost_it_and_the_whole_output_is_kept(tmp_path, monkeypatch):
    """A rank killed by a signal prints no exception line; the line its peer prints (connection closed) is only the
    consequence. The summary names the crashed rank and its signal, and the whole output goes to a file."""
    assert worker_error(SIGNALLED) == ("rank 1 died of Signal 11 (SIGSEGV); the others: RuntimeError: "
                                       "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:44452")
    # a rank's own exception still comes first, ahead of a peer's lost connection printed before it
    own = "[rank0]: RuntimeError: Connection closed by peer\n[rank1]: ValueError: bad spec\n"
    assert worker_error(own) == "ValueError: bad spec"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    err = failed_workers("campaign dmr: a rank's process failed", SIGNALLED)
    assert type(err) is TrainguardError  # (a crash: no class of its own)
    message = str(err)
    assert message.startswith("campaign dmr: a rank's process failed: rank 1 died of Signal 11 (SIGSEGV)")
    path = Path(message.rsplit("every rank's output: ", 1)[1].rstrip(")"))
    assert path.parent == tmp_path and path.read_text() == SIGNALLED and "\n" not in message


def test_trainguards_own_exceptions_are_named_ahead_of_the_peer_that_lost_the_rank():
    """A rank that stopped on a suspected hardware fault (exit 3) while its peer waited in a collective: the cause,
    not the peer's lost connection printed before it (a campaign's failure once read only "Connection closed")."""
    stderr = ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"core.py\", line 714, in _naive\n"
              "[rank0]: trainguard.errors.SuspectedHardwareFault: three executions of aten.zeros.default in the update "
              "stage of step 0 all differ (optimizer:40): this device does not compute reliably\n"
              "[rank1]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:59582.\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\nFailures:\n  <NO_OTHER_FAILURES>\n")
    assert worker_error(stderr).startswith("trainguard.errors.SuspectedHardwareFault: three executions of aten.zeros")
    err = failed_workers("campaign dmr: a rank's process failed", stderr)  # exits 3 as the rank did, not 2
    assert isinstance(err, SuspectedHardwareFault) and "three executions" in str(err)
    assert worker_error("[rank1]: trainguard.errors.StepAborted: step 3: still failing\n") == (
        "trainguard.errors.StepAborted: step 3: still failing")
