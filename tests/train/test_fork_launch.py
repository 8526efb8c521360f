"""The fork server the two-process trainer tests launch through: a failing rank stops the others (which would
otherwise wait in a collective forever), a hung run is killed at its timeout, and every rank sees torchrun's
environment and a working process group."""

import os
from pathlib import Path

import pytest
from _fork_launch import ForkLauncher

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import os, sys, time
import torch.distributed as dist
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
with open(f"env{rank}.txt", "w") as f:
    f.write(" ".join([os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"], *sys.argv[1:]]))
dist.barrier()
if sys.argv[1] == "fail" and rank == 1:
    print("rank 1 gives up", file=sys.stderr)
    sys.exit(3)
if sys.argv[1] in ("fail", "hang"):
    time.sleep(600)  # (as a rank waiting for a peer that has died would: gloo may not notice)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def launcher():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("LOCAL_RANK", None)
    lau = ForkLauncher(env)
    yield lau
    lau.close()


def _script(tmp_path: Path) -> Path:
    p = tmp_path / "job.py"
    p.write_text(SCRIPT)
    return p


def test_ranks_get_torchrun_s_environment_and_a_process_group(tmp_path, launcher):
    rcs, _ = launcher.run(_script(tmp_path), ["ok", "x"], 2, tmp_path, tmp_path, timeout=120)
    assert rcs == [0, 0]
    assert [(tmp_path / f"env{r}.txt").read_text() for r in (0, 1)] == ["0 2 ok x", "1 2 ok x"]


def test_a_failing_rank_stops_the_other_and_its_output_is_kept(tmp_path, launcher):
    rcs, logs = launcher.run(_script(tmp_path), ["fail"], 2, tmp_path, tmp_path, timeout=120)
    assert rcs == [-9, 3]  # rank 0 was still waiting: killed, not left to hang
    assert "rank 1 gives up" in logs[1].read_text()
    rcs, _ = launcher.run(_script(tmp_path), ["ok"], 2, tmp_path, tmp_path, timeout=120)
    assert rcs == [0, 0]  # the server goes on serving


def test_a_hung_run_is_killed_at_its_timeout_and_the_server_goes_on(tmp_path, launcher):
    with pytest.raises(TimeoutError):
        launcher.run(_script(tmp_path), ["hang"], 2, tmp_path, tmp_path, timeout=5)
    rcs, logs = launcher.run(_script(tmp_path), ["ok"], 2, tmp_path, tmp_path, timeout=120)
    assert rcs == [0, 0], [p.read_text() for p in logs]


def test_an_exception_is_exit_1_with_its_traceback_in_the_rank_s_log(tmp_path, launcher):
    p = tmp_path / "boom.py"
    p.write_text("import sys\nraise ValueError('boom ' + sys.argv[1])\n")
    rcs, logs = launcher.run(p, ["now"], 1, tmp_path, tmp_path, timeout=60)
    assert rcs == [1] and "ValueError: boom now" in logs[0].read_text()
