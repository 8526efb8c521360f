"""A rank leaves with ``launch.exit_rank``: torch's gloo process group destroys a collective's work on its own
thread, and one that releases a Python-owned tensor while the interpreter finalizes aborts the process
("terminate called without an active exception"). The script below makes that happen on any host: its all-reduce
has a peer (a second process) that joins only after the script has dropped its references, so gloo's thread holds
the last one, and the main thread then keeps the GIL (a switch interval no thread waits out, no blocking call)
while the collective completes, so that thread can take the GIL only once Python finalizes. The control shows the
abort on the pinned torch (once it no longer aborts, torch no longer needs the workaround) and exit_rank shows
none. Two earlier controls raced the collective against the script instead, with one rank: a world of one
completes at once, and on CI's fast host it completed before the script dropped its tensor, so nothing aborted
(0 in 5); here, a 10 ms sleep before that ``del`` (a host that much faster) made the one-rank control exit 0
in 5 runs of 5, and this one abort in 5 of 5."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEER = """
import datetime, os, sys, torch, torch.distributed as dist
store = dist.FileStore(sys.argv[1], 2)
dist.init_process_group("gloo", store=store, rank=1, world_size=2)
store.set_timeout(datetime.timedelta(seconds=60))  # (gives up if rank 0 fails before "go": no process left behind)
store.wait(["go"])
dist.all_reduce(torch.ones(1000))  # completes rank 0's collective
os._exit(0)  # (this rank's own teardown is not what the test shows)
"""
SCRIPT = """
import subprocess, sys, time
import torch
import torch.distributed as dist
from trainguard.train.launch import exit_rank

how, path, peer = sys.argv[1:4]
subprocess.Popen([sys.executable, "-c", peer, path])
store = dist.FileStore(path, 2)
dist.init_process_group("gloo", store=store, rank=0, world_size=2)
print("results written")
x = torch.ones(1000)
work = dist.all_reduce(x, async_op=True)
del work, x  # gloo's thread now holds the last reference: its collective cannot complete before the peer joins
sys.setswitchinterval(1e6)  # from here the main thread keeps the GIL until it blocks (and nothing below blocks)
store.set("go", "1")
start = time.perf_counter()
while time.perf_counter() - start < 1.0:  # the collective completes meanwhile; gloo's thread waits for the GIL
    pass
if how == "exit_rank":
    exit_rank(0)
"""


def _run(how: str, store: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, how, str(store), PEER], capture_output=True, text=True,
                          timeout=120, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})


def test_a_rank_that_leaves_with_exit_rank_does_not_abort_in_gloos_teardown_and_keeps_its_output(tmp_path):
    left = _run("exit_rank", tmp_path / "left")
    assert left.returncode == 0, left.stderr[-2000:]
    assert left.stdout.strip() == "results written"  # (flushed before leaving)
    # the control: the same script finalizing as usual aborts (20 runs in 20 did, beside three busy processes)
    control = _run("finalize", tmp_path / "control")
    assert control.returncode != 0 and "terminate called" in control.stderr, (
        "the pinned torch no longer aborts here: exit_rank's workaround may go", control.returncode, control.stderr[-500:])
    # (whether the control's buffered stdout was flushed before its abort is a race, CI once saw it lost; and no
    # marker can be written after the busy loop without releasing the GIL, which lets gloo's thread finish first)


MAIN = """
import atexit, runpy, sys
atexit.register(lambda: print("finalized", flush=True))  # runs in Python's finalization, never after os._exit
if sys.argv[1] == "group":  # an elastic replica's torchft group, made outside any launcher
    from trainguard.train.config import ElasticConfig
    from trainguard.train.parallel.torchft_group import ElasticGroup, start_lighthouse
    lh = start_lighthouse()
    ElasticGroup(0, 1, ElasticConfig(lighthouse=lh.address())).shutdown()
    lh.shutdown()
sys.argv = ["trainguard", "plot", "/nonexistent/run"]  # a command that returns through main (exit 2, one line)
runpy.run_module("trainguard", run_name="__main__")
"""


def test_python_m_trainguard_skips_finalization_in_a_process_that_made_a_process_group_and_only_there():
    """An elastic replica started by hand (no launcher) holds torchft's gloo group: CI saw one finish its run and
    then abort (-6) in finalization, so ``python -m trainguard`` leaves it through exit_rank, with main's exit
    code; any other process finalizes as usual."""
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    runs = {how: subprocess.run([sys.executable, "-c", MAIN, how], capture_output=True, text=True, timeout=120,
                                cwd=ROOT, env=env) for how in ("group", "plain")}
    for how, run in runs.items():
        assert run.returncode == 2 and "run folder not found" in run.stderr, (how, run.returncode, run.stderr[-1000:])
    assert "finalized" not in runs["group"].stdout
    assert "finalized" in runs["plain"].stdout
    # the console script is the same entry point as python -m trainguard
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["trainguard"] == "trainguard.cli.main:entry"
    assert (ROOT / "trainguard" / "__main__.py").read_text().split() == ["from", "trainguard.cli.main", "import",
                                                                         "entry", "entry()"]


BUG = """
import atexit, runpy, sys
atexit.register(lambda: print("finalized", flush=True))
if sys.argv[1] == "group":
    from trainguard.train.config import ElasticConfig
    from trainguard.train.parallel.torchft_group import ElasticGroup, start_lighthouse
    lh = start_lighthouse()
    ElasticGroup(0, 1, ElasticConfig(lighthouse=lh.address())).shutdown()
    lh.shutdown()
import trainguard.cli.main as cli
def broken(argv=None):
    raise {error}
cli.main = broken  # a bug in a command, past main's own handlers
runpy.run_module("trainguard", run_name="__main__")
"""


def test_a_bug_in_an_elastic_replica_still_exits_with_its_traceback_and_code_without_finalization():
    """An exception main does not handle, or a ``sys.exit`` from a command, in a process that must skip
    finalization: the traceback (or message) and the code Python would give, and still no finalization (an abort
    there would replace exit 1 by -6); elsewhere Python's own handling, finalization included."""
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    for error, code, shown in (("ZeroDivisionError('a bug')", 1, "ZeroDivisionError: a bug"),
                               ("SystemExit(5)", 5, None), ("SystemExit('gave up')", 1, "gave up")):
        for how in ("group", "plain"):
            run = subprocess.run([sys.executable, "-c", BUG.format(error=error), how], capture_output=True, text=True,
                                 timeout=120, cwd=ROOT, env=env)
            assert run.returncode == code, (error, how, run.returncode, run.stderr[-1000:])
            if shown:
                assert shown in run.stderr, (error, how, run.stderr[-1000:])
            assert ("finalized" in run.stdout) == (how == "plain"), (error, how, run.stdout)
