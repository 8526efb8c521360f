"""One live run per checkpoint folder.

A run's processes can outlive the process that launched them: killed outright (SIGKILL, the OOM killer), the
launcher cannot stop its workers, and they finish their step and save a checkpoint after it is gone (see
``launch.py``). A scheduler that restarts the run at once then has two generations in one folder: each one's
save deletes the other's half-written checkpoint as debris of a dead process, both commit and prune, the new one
may resume from a checkpoint older than the one the old one is about to write, and on a GPU the new one competes
for the memory the old one still holds. Two different runs pointed at one folder (``start_over`` deleting the
checkpoints of a run still writing them) are the same race by mistake.

So the folder is locked while a run uses it. The main rank holds ``.lock`` exclusively; the other ranks hold
``.lock.ranks`` shared (a launch's ranks may stop in any order). A new run's main rank takes ``.lock``, then waits
until ``.lock.ranks`` is free too (every rank of the previous run has exited), then lets its own ranks take it.
It waits up to ``checkpoint.lock_wait_s``, saying once who holds the folder; past that the run stops with a
one-line :class:`~trainguard.errors.CheckpointError` and nothing in the folder is touched. Locks are
``flock(2)`` locks, released by the kernel however the process ends, so a crashed run never leaves the folder
locked. Within one process the folder is taken once (a later trainer of the same process shares it). Where the
file system has no ``flock`` (some network mounts), the run says so and goes on unprotected.

Relies on the standard library (``fcntl``, ``os``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path

from trainguard.errors import CheckpointError

LOCK = ".lock"
RANKS_LOCK = ".lock.ranks"
_POLL_S = 0.1
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS}

# folder (real path) -> [open lock files, holders]: what this process holds, and how many trainers share it
_held: dict[str, list] = {}


def _key(directory: Path) -> str:
    return os.path.realpath(directory)


def _who(directory: Path) -> str:
    """The processes named in the folder's lock files that are still alive (on this host), for the message."""
    names = []
    for name in (LOCK, RANKS_LOCK):
        try:
            lines = (directory / name).read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            pid, _, rest = line.partition(" ")
            host, _, rest = rest.partition(" ")
            if not pid.isdigit():
                continue
            if host == socket.gethostname():
                try:
                    os.kill(int(pid), 0)
                except ProcessLookupError:
                    continue
                except PermissionError:
                    pass
                # a pid the kernel gave to another process since: not the holder (stamps without t= are older)
                stamped, now = rest.split(" ", 1)[0], _start_ticks(int(pid))
                if stamped.startswith("t=") and now is not None and stamped != f"t={now}":
                    continue
            names.append(f"pid {pid}" + ("" if host == socket.gethostname() else f" on {host}"))
    return ", ".join(dict.fromkeys(names)) or "a process that did not say who it is"


def _take(fd: int, directory: Path, deadline: float, wait_s: float, note: Callable[[str], None],
          told: list[bool], what: str = "checkpoint.dir") -> bool:
    """flock ``fd`` exclusively by ``deadline`` (``time.monotonic``; False: the file system cannot lock)."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError as err:
            if err.errno in _UNSUPPORTED:
                return False
            raise
        if time.monotonic() >= deadline:
            raise CheckpointError(
                f"{what} {directory} is in use by another run, or by this run's processes still stopping "
                f"({_who(directory)}){f' after waiting {wait_s:g} s' if wait_s else ''}: stop it first, or choose another "
                f"{what} (checkpoint.lock_wait_s waits longer)")
        if not told[0]:
            note(f"{what} {directory} is in use ({_who(directory)}: another run, or this run's processes still "
                 f"stopping); waiting up to {wait_s:g} s for it to be free")
            told[0] = True
        time.sleep(_POLL_S)


def _take_all(fds: list[int], directory: Path, wait_s: float, note: Callable[[str], None],
              what: str = "checkpoint.dir") -> bool:
    """:func:`_take` each of ``fds`` within one ``wait_s``; says once the folder is free if it had to wait.
    ``what``: the setting that named the folder, for the messages."""
    told, deadline = [False], time.monotonic() + wait_s
    for fd in fds:
        if not _take(fd, directory, deadline, wait_s, note, told, what):
            return False
    if told[0]:
        note(f"{what} {directory} is free: this run goes on")
    return True


def _start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc/PID/stat``'s field 22), or None where that
    cannot be read: a pid and its start time name one process, a pid alone may be reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])  # (after the command's name, which may hold spaces)
    except (OSError, ValueError, IndexError):
        return None


def _stamp(fd: int, truncate: bool) -> None:
    """Write this process into a lock file (for the message a waiting run prints): pid, host, start time, argv."""
    ticks = _start_ticks(os.getpid())
    line = f"{os.getpid()} {socket.gethostname()}{f' t={ticks}' if ticks is not None else ''} " \
           f"{' '.join(sys.argv)[:300]}\n".encode()
    if truncate:
        os.ftruncate(fd, 0)
        os.pwrite(fd, line, 0)
    else:
        os.write(fd, line)


def _open(path: Path, append: bool = False, what: str = "checkpoint.dir") -> int:
    try:
        # (O_NONBLOCK: a FIFO left in the lock file's place must not hang the open; it is refused below)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | (os.O_APPEND if append else 0), 0o644)
    except OSError as err:  # (another user's lock file, a read-only mount, a folder of that name)
        raise CheckpointError(f"{what} {path.parent}: cannot open its lock file {path.name} "
                              f"({err.strerror or err})") from None
    _refuse_unless_regular(fd, path, what)
    return fd


def _refuse_unless_regular(fd: int, path: Path, what: str = "checkpoint.dir") -> None:
    """A FIFO, socket or device in a lock file's place: flock may take it, but no stamp can be written to it.
    Refused in one line (``fd`` closed), and left where it is for whoever put it there."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{what} {path.parent}: its lock file {path.name} is not a regular file: "
                              "remove it (a run makes its own)")


def acquire_main(directory: str | Path, wait_s: float, note: Callable[[str], None], what: str = "checkpoint.dir",
                 with_ranks: bool = True) -> None:
    """The main rank's side: the folder for this run, once every process of its previous user has exited.
    One-line CheckpointError when that takes longer than ``wait_s`` seconds. ``what``: the setting that named the
    folder; ``with_ranks``: the other ranks hold the folder too (see the module docstring)."""
    directory = Path(directory)
    key = _key(directory)
    if key in _held:
        _held[key][1] += 1
        return
    directory.mkdir(parents=True, exist_ok=True)
    fds: list[int] = []
    try:
        fds.append(_open(directory / LOCK, what=what))
        if with_ranks:
            fds.append(_open(directory / RANKS_LOCK, what=what))
        ok = _take_all(fds, directory, wait_s, note, what)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    if not ok:
        for fd in fds:
            os.close(fd)
        note(f"warning: {what} {directory} cannot be locked on this file system: a second run using it "
             "at the same time would not be noticed")
        return
    _stamp(fds[0], truncate=True)
    if with_ranks:
        ranks = fds[1]
        os.ftruncate(ranks, 0)  # (every rank named there has exited)
        fcntl.flock(ranks, fcntl.LOCK_UN)  # the ranks of this run take it shared next
        os.close(ranks)
    _held[key] = [[fds[0]], 1]


def wait_until_free(directory: str | Path, wait_s: float, note: Callable[[str], None],
                    what: str = "checkpoint.dir") -> None:
    """Before a run builds anything: wait, as :func:`acquire_main` would, until no process holds the folder, and
    let it go again. A busy folder is then found in a second, not after every rank has built its model and read
    its data; the main rank still takes the folder itself later (another run may take it in between, and that
    wait is counted again). Lock files that are absent or cannot be opened are left to the main rank's own take;
    one that is not a regular file is refused here, in the take's words."""
    directory = Path(directory)
    if _key(directory) in _held:
        return
    fds = []
    try:
        for name in (LOCK, RANKS_LOCK):
            try:
                fd = os.open(directory / name, os.O_RDONLY | os.O_NONBLOCK)  # (a FIFO there: no hang)
            except OSError:
                continue
            _refuse_unless_regular(fd, directory / name, what)  # (before any rank is launched, as a busy folder is)
            fds.append(fd)
        _take_all(fds, directory, wait_s, note, what)  # (False, no flock here: the main rank's take says so)
    finally:
        for fd in fds:
            os.close(fd)  # (closing lets the lock go)


def acquire_rank(directory: str | Path) -> None:
    """A non-main rank's side, after the main rank holds the folder: hold ``.lock.ranks`` shared."""
    directory = Path(directory)
    key = _key(directory)
    if key in _held:
        _held[key][1] += 1
        return
    fd = _open(directory / RANKS_LOCK, append=True)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CheckpointError(f"checkpoint.dir {directory} is in use by another run ({_who(directory)})") from None
    except OSError as err:
        os.close(fd)
        if err.errno in _UNSUPPORTED:
            return
        raise
    _stamp(fd, truncate=False)
    _held[key] = [[fd], 1]


def acquire_output(directory: str | Path, wait_s: float, note: Callable[[str], None]) -> None:
    """The main rank's hold on ``output.dir`` while ``Trainer.run`` writes its metrics and summary there: ``.lock``
    alone (only the main rank writes an output folder). Without it, a second run in the same folder moved the first
    one's files aside while the first still wrote them, and the two summaries overwrote each other. Waits and
    refuses as for ``checkpoint.dir``; a folder this process already holds (``output.dir`` and ``checkpoint.dir``
    one folder) is shared. Released with :func:`release`."""
    acquire_main(directory, wait_s, note, what="output.dir", with_ranks=False)


def release(directory: str | Path) -> None:
    """One trainer of this process is done with the folder; the last one unlocks it."""
    key = _key(Path(directory))
    entry = _held.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] <= 0:
        del _held[key]
        for fd in entry[0]:
            try:
                os.close(fd)  # (closing the last descriptor releases the flock)
            except OSError:
                pass


def held(directory: str | Path) -> bool:
    """Whether this process holds ``directory``'s lock."""
    return _key(Path(directory)) in _held
