"""One live run per checkpoint folder (``trainguard.train.run_lock``): a second run, or a restart while the killed
run's processes are still stopping, waits for them and is told who holds the folder; past
``checkpoint.lock_wait_s`` it stops in one line and nothing in the folder is touched."""

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_cfg

from trainguard.errors import CheckpointError
from trainguard.train import Trainer, run_lock
from trainguard.train.checkpoint import CheckpointManager

HERE = os.path.dirname(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))


def _holder(body: str) -> subprocess.Popen:
    """A Python process running ``body`` (with tiny_cfg, Trainer and run_lock imported); it prints "ready" when it
    holds what it should."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {HERE!r})
        from conftest import tiny_cfg
        from trainguard.train import Trainer, run_lock
    """) + textwrap.dedent(body)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    line = proc.stdout.readline()
    assert line.strip() == "ready", proc.stderr.read()[-2000:]
    return proc


def _steps(ck: Path) -> list[int]:
    return [s for s, _ in CheckpointManager(ck).checkpoints()]


def test_a_second_run_is_refused_while_the_first_holds_the_folder_and_deletes_nothing(tmp_path, batches):
    ck = tmp_path / "ck"
    first = _holder(f"""
        t = Trainer(tiny_cfg("--checkpoint.dir", {str(ck)!r}))
        t.run(2)
        print("ready", flush=True)
        time.sleep(120)
    """)
    try:
        t0 = time.monotonic()
        with pytest.raises(CheckpointError, match=rf"checkpoint.dir .* is in use .*pid {first.pid}.* after waiting 0.5 s"):
            Trainer(tiny_cfg("--checkpoint.dir", str(ck), "--checkpoint.start_over", "true",
                             "--checkpoint.lock_wait_s", "0.5"), batches=batches)
        assert time.monotonic() - t0 >= 0.5
        assert _steps(ck) == [2]  # start_over would have deleted the running run's checkpoint
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # a process killed outright leaves nothing locked: the kernel released its lock
    t = Trainer(tiny_cfg("--checkpoint.dir", str(ck), "--checkpoint.resume", "true", "--checkpoint.lock_wait_s", "0"),
                batches=batches)
    assert t.step_idx == 2
    t.close()


def test_a_restart_waits_for_the_stopping_processes_and_resumes_from_what_they_saved(tmp_path, batches, capfd):
    """The killed launcher's workers finish their step and save after it is gone; a run restarted at once resumes
    from that checkpoint (step 3), not from the one before it (step 2), and ends bitwise equal to a run that was
    never stopped. Without the lock it resumes from step 2 while they are still writing."""
    ck = tmp_path / "ck"
    old = _holder(f"""
        t = Trainer(tiny_cfg("--checkpoint.dir", {str(ck)!r}, "--train.steps", "5"))
        t.run(2)
        print("ready", flush=True)
        time.sleep(1.5)               # (the step it is in when its launcher is killed, made long)
        t.train_step()
        t.save_checkpoint()           # what it saves while stopping
    """)
    resumed = Trainer(tiny_cfg("--checkpoint.dir", str(ck), "--train.steps", "5", "--checkpoint.resume", "true",
                               "--checkpoint.lock_wait_s", "120"), batches=batches)
    assert old.wait(timeout=60) == 0, old.stderr.read()[-2000:]
    err = capfd.readouterr().err
    assert f"is in use (pid {old.pid}" in err and "is free: this run goes on" in err, err[-2000:]
    assert resumed.step_idx == 3
    resumed.run()
    clean = Trainer(tiny_cfg("--train.steps", "5"), batches=batches)
    clean.run()
    a, b = resumed.state_dict_for_compare(), clean.state_dict_for_compare()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    resumed.close()


def test_a_run_waits_for_every_rank_of_the_previous_one_not_only_its_main_process(tmp_path, batches):
    """The previous launch's main rank has exited, one of its other ranks has not (ranks stop in any order)."""
    ck = tmp_path / "ck"
    rank = _holder(f"""
        import os
        os.makedirs({str(ck)!r}, exist_ok=True)
        run_lock.acquire_rank({str(ck)!r})
        print("ready", flush=True)
        time.sleep(1.5)
    """)
    t = Trainer(tiny_cfg("--checkpoint.dir", str(ck), "--checkpoint.lock_wait_s", "60"), batches=batches)
    assert rank.poll() is not None  # (constructed only once that rank had gone)
    t.close()


def test_trainers_of_one_process_share_the_folder_and_close_lets_it_go(tmp_path, batches):
    ck = tmp_path / "ck"
    first = Trainer(tiny_cfg("--checkpoint.dir", str(ck)), batches=batches)
    first.run(2)
    second = Trainer(tiny_cfg("--checkpoint.dir", str(ck), "--checkpoint.resume", "true",
                              "--checkpoint.lock_wait_s", "0"), batches=batches)
    assert second.step_idx == 2
    probe = [sys.executable, "-c", f"from trainguard.train import run_lock; run_lock.acquire_main({str(ck)!r}, 0, print)"]
    busy = subprocess.run(probe, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert busy.returncode != 0 and "is in use" in busy.stderr, busy.stderr[-2000:]
    first.close()
    assert run_lock.held(ck)  # (the second trainer still uses it)
    second.close()
    assert not run_lock.held(ck)
    free = subprocess.run(probe, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert free.returncode == 0, free.stderr[-2000:]


def test_a_trainer_that_fails_to_open_the_folder_lets_it_go_at_once(tmp_path, batches):
    ck = tmp_path / "ck"
    first = Trainer(tiny_cfg("--checkpoint.dir", str(ck)), batches=batches)
    first.run(1)
    first.close()
    with pytest.raises(CheckpointError, match="holds checkpoints of another run"):
        Trainer(tiny_cfg("--checkpoint.dir", str(ck)), batches=batches)
    assert not run_lock.held(ck)


def test_a_file_system_without_locks_is_named_and_the_run_goes_on(tmp_path, batches, monkeypatch, capfd):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "flock", no_locks)
    t = Trainer(tiny_cfg("--checkpoint.dir", str(tmp_path / "ck")), batches=batches)
    t.run(1)
    assert "cannot be locked on this file system" in capfd.readouterr().err
    t.close()


# ``trainguard train`` with ``where``: "launch" records whether the launcher started any rank; "ranks" skips the CLI's
# look before the launch, so the ranks meet the busy folder themselves (another run took it in between)
_TRAIN = textwrap.dedent("""
    import sys
    import trainguard.train.launch as launch
    import trainguard.train.run_lock as run_lock
    from trainguard.cli.main import main

    where = sys.argv[1]
    if where == "ranks":
        run_lock.wait_until_free = lambda *a, **k: None
    real = launch.relaunch

    def relaunch(*a, **k):
        sys.stderr.write("test: ranks launched\\n")
        return real(*a, **k)

    launch.relaunch = relaunch
    sys.exit(main(sys.argv[2:]))
""")


@pytest.mark.parametrize("where", ["launch", "ranks"])
def test_a_pipeline_run_in_a_folder_in_use_stops_on_every_rank_in_one_line(tmp_path, where):
    """Found before any rank starts (the CLI looks first, so a busy folder costs no model build), or, where
    another run took the folder after that look, by the main rank, which stops every rank in one line."""
    ck = tmp_path / "ck"
    holder = _holder(f"""
        run_lock.acquire_main({str(ck)!r}, 0, print)
        print("ready", flush=True)
        time.sleep(120)
    """)
    try:
        argv = [sys.executable, "-c", _TRAIN, where, "train", "--distributed.pp", "2", "--model.n_layers", "2",
                "--data.max_bytes", "200000", "--data.seq_len", "32", "--train.steps", "2", "--train.eval_every", "0",
                "--output.dir", "", "--output.progress", "false", "--checkpoint.dir", str(ck),
                "--checkpoint.lock_wait_s", "1"]
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=180,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    errors = [line for line in proc.stderr.splitlines() if line.startswith("trainguard: error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and f"is in use by another run, or by this run's processes still stopping (pid {holder.pid})" \
        in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert ("test: ranks launched" in proc.stderr) == (where == "ranks"), proc.stderr[-3000:]
    assert not _steps(ck)


def test_a_lock_file_that_cannot_be_opened_is_one_line(tmp_path, batches, monkeypatch):
    real = os.open

    def refused(path, flags, *args, **kwargs):  # (os.open itself: only the folder's lock file is refused)
        if str(path).endswith(f"/{run_lock.LOCK}"):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(run_lock.os, "open", refused)
    with pytest.raises(CheckpointError, match=r"cannot open its lock file \.lock \(Permission denied\)"):
        Trainer(tiny_cfg("--checkpoint.dir", str(tmp_path / "ck")), batches=batches)


def test_the_holder_named_is_the_process_that_stamped_the_lock_not_a_later_one_with_its_pid(tmp_path):
    """A stamp names its process by pid and start time: a process the kernel gave a dead holder's pid is not named
    (pids are reused), while the stamping process still is, and so is a stamp of the older form (no start time)."""
    host, me = run_lock.socket.gethostname(), os.getpid()
    ticks = run_lock._start_ticks(me)
    assert ticks is not None and ticks == run_lock._start_ticks(me)  # (read from /proc: stable for a process)
    fd = os.open(tmp_path / run_lock.LOCK, os.O_RDWR | os.O_CREAT)
    run_lock._stamp(fd, truncate=True)
    os.close(fd)
    assert f" t={ticks} " in (tmp_path / run_lock.LOCK).read_text()
    assert run_lock._who(tmp_path) == f"pid {me}"
    for stamp, named in ((f"{me} {host} t={ticks + 1} trainguard train\n", False),  # same pid, another process
                         (f"{me} {host} trainguard train\n", True)):  # no start time: the pid is all there is
        (tmp_path / run_lock.LOCK).write_text(stamp)
        assert (run_lock._who(tmp_path) == f"pid {me}") is named


def test_the_look_before_a_launch_waits_for_the_holder_takes_nothing_and_never_hangs(tmp_path, capfd):
    """``wait_until_free`` (the CLI's look before it builds a run): it waits while a process holds the folder, says
    who, goes on once that process is gone, and holds nothing afterwards; a lock file it cannot lock (a FIFO
    someone left there) neither hangs it nor is taken for a free folder: the look and the main rank's take refuse it."""
    ck = tmp_path / "ck"
    holder = _holder(f"""
        run_lock.acquire_main({str(ck)!r}, 0, print)
        print("ready", flush=True)
        time.sleep(1.0)
    """)
    t0 = time.monotonic()
    run_lock.wait_until_free(ck, 60, lambda text: print(text, file=sys.stderr))
    waited = time.monotonic() - t0
    holder.wait(timeout=60)
    err = capfd.readouterr().err
    assert f"is in use (pid {holder.pid}" in err and "is free: this run goes on" in err, err
    assert 0.3 < waited < 30
    assert str(ck.resolve()) not in run_lock._held  # nothing taken: the main rank takes the folder itself
    run_lock.acquire_main(ck, 0, print)  # (at once: the look let it go)
    run_lock.release(ck)
    with pytest.raises(CheckpointError, match="is in use"):  # the look is not fooled into calling a held folder free
        other = _holder(f"""
            run_lock.acquire_main({str(ck)!r}, 0, print)
            print("ready", flush=True)
            time.sleep(60)
        """)
        try:
            run_lock.wait_until_free(ck, 0.2, print)
        finally:
            other.kill()
            other.wait()
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / run_lock.LOCK)
    done = []

    def look():
        try:
            run_lock.wait_until_free(fifo, 0.2, print)
            done.append("free")
        except CheckpointError as err:
            done.append(str(err))

    worker = threading.Thread(target=look, daemon=True)
    worker.start()
    worker.join(timeout=20)
    assert done, "the look hung on a FIFO lock file"
    assert "its lock file .lock is not a regular file: remove it" in done[0]  # refused before a launch, in one line
    # the main rank's own take then refuses the FIFO in one line (it used to take the flock and then fail to write
    # its stamp with a bare "Invalid argument"), and leaves it where it is
    with pytest.raises(CheckpointError, match=r"its lock file \.lock is not a regular file: remove it"):
        run_lock.acquire_main(fifo, 0, print)
    assert (fifo / run_lock.LOCK).is_fifo() and str(fifo.resolve()) not in run_lock._held


def test_a_rank_lock_file_that_is_not_a_regular_file_is_one_line_on_every_side(tmp_path):
    """A FIFO as ``.lock.ranks``: the look, the main rank's take and a rank's take each refuse it in one line (none
    hangs on it); nothing is taken."""
    ck = tmp_path / "ck"
    ck.mkdir()
    os.mkfifo(ck / run_lock.RANKS_LOCK)
    for take in (lambda: run_lock.wait_until_free(ck, 0, print), lambda: run_lock.acquire_main(ck, 0, print),
                 lambda: run_lock.acquire_rank(ck)):
        with pytest.raises(CheckpointError, match=r"its lock file \.lock\.ranks is not a regular file"):
            take()
        assert str(ck.resolve()) not in run_lock._held
    assert (ck / run_lock.RANKS_LOCK).is_fifo()


def test_a_second_run_in_an_output_folder_in_use_is_refused_and_moves_none_of_its_files(tmp_path, batches, capfd):
    """``output.dir`` is held as ``checkpoint.dir`` is. Without the hold, a second run in the folder moved the first
    one's files into ``previous/`` while the first still wrote them, and their summaries overwrote each other."""
    out = tmp_path / "out"
    first = _holder(f"""
        t = Trainer(tiny_cfg("--output.dir", {str(out)!r}, "--output.metrics", "true"))
        t.run(2)
        print("ready", flush=True)
        time.sleep(120)
    """)
    try:
        before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
        assert {"metrics.jsonl", "summary.json"} <= set(before)
        second = Trainer(tiny_cfg("--output.dir", str(out), "--output.metrics", "true", "--checkpoint.lock_wait_s",
                                  "0.3"), batches=batches)
        with pytest.raises(CheckpointError, match=rf"output.dir .* is in use .*pid {first.pid}.* after waiting 0.3 s: "
                                                  r"stop it first, or choose another output.dir"):
            second.run(1)
        assert second.step_idx == 0  # refused before any step
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before and \
            not (out / "previous").exists()  # nothing moved aside, nothing written
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    second.run(1)  # the kernel let the killed run's hold go: the folder is this run's, the old files moved aside
    second.close()
    assert [p.name for p in (out / "previous").iterdir()] and json.loads((out / "summary.json").read_text())["steps_run"] == 1
    assert str(out.resolve()) not in run_lock._held  # close() lets it go


def test_one_folder_as_output_and_checkpoint_folder_is_held_once_and_let_go_by_close(tmp_path, batches):
    both = tmp_path / "run"
    t = Trainer(tiny_cfg("--output.dir", str(both), "--checkpoint.dir", str(both), "--output.metrics", "true"),
                batches=batches)
    t.run(2)
    assert run_lock._held[str(both.resolve())][1] == 2  # (one lock, two holds)
    t.close()
    assert str(both.resolve()) not in run_lock._held
    assert _steps(both) == [2] and (both / "summary.json").is_file()
