"""``train.launch.run_workers``: SIGTERM sent to the command reaches its ranks (they stop, and the command raises
``Terminated``, exit code 143)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from trainguard.errors import Terminated
from trainguard.train.launch import run_workers


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
