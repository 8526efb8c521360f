"""Fail-stop injection kills for real: the process ends with SIGKILL at the chosen point, at a random time, or
from outside, and nothing of the step after the point runs."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainguard.errors import TrainguardError
from trainguard.faults.failstop import ExternalKiller, FailStop, KillPoint, death_cause, kill_pid, random_delay

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

TRAINER = textwrap.dedent("""
    import json, sys, torch
    from trainguard.config import load_config
    from trainguard.faults.failstop import FailStop, KillPoint
    from trainguard.train.trainer import Trainer
    torch.set_num_threads(1)
    out, step, point = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    cfg = load_config(None, ["--model.dim", "32", "--model.n_layers", "1", "--model.n_heads", "2",
                             "--model.ffn_hidden", "64", "--data.max_bytes", "200000", "--data.seq_len", "16",
                             "--data.batch_size", "2", "--train.steps", "6", "--train.eval_every", "0",
                             "--output.dir", "", "--output.metrics", "false", "--output.progress", "false"])
    t = Trainer(cfg, progress=False)
    log = open(out + "/log.jsonl", "a", buffering=1)
    class Log:
        def on_step_start(self, tr, s): log.write(json.dumps(["start", s]) + "\\n")
        def on_stage(self, tr, stage, s): log.write(json.dumps([stage, s]) + "\\n")
        def on_step_end(self, tr, r): log.write(json.dumps(["end", r.step]) + "\\n")
    t.callbacks.append(Log())
    t.callbacks.append(FailStop([KillPoint(step, point)], on_kill=lambda p: log.write(json.dumps(["kill", p.step]) + "\\n")))
    t.run()
    log.write(json.dumps(["finished", t.step_idx]) + "\\n")
""")


@pytest.mark.parametrize("point", ["start", "update"])
def test_failstop_sigkills_the_trainer_at_the_step_and_point(tmp_path, point):
    proc = subprocess.run([sys.executable, "-c", TRAINER, str(tmp_path), "3", point], env=ENV, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    events = [tuple(json.loads(line)) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [s for e, s in events if e == "end"] == [0, 1, 2]  # steps before 3 committed, step 3 never
    # the kill is the last thing that happened, right after the point it was set on
    assert events[-1] == ("kill", 3) and events[-2] == (point, 3)
    if point == "update":  # the callbacks after the point (its own on_stage logger ran first) saw nothing more
        assert ("end", 3) not in events


def test_kill_after_sigkills_this_process_from_a_timer(tmp_path):
    marker = tmp_path / "fired"
    code = textwrap.dedent(f"""
        import time
        from trainguard.faults.failstop import kill_after
        kill_after(0.2, on_kill=lambda: open({str(marker)!r}, "w").write("x"))
        time.sleep(30)
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, timeout=60)
    assert proc.returncode == -signal.SIGKILL and marker.read_text() == "x"


def test_external_killer_kills_every_target_from_outside_and_records_it():
    procs = {i: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for i in range(3)}
    try:
        alive = lambda: {i: p.pid for i, p in procs.items() if p.poll() is None}
        seen = []
        killer = ExternalKiller(alive, count=3, min_gap_s=0.0, max_gap_s=0.05, seed=1, on_kill=seen.append).start()
        for p in procs.values():
            assert p.wait(timeout=30) == -signal.SIGKILL
        killer.stop()
        assert sorted(k.target for k in killer.kills) == [0, 1, 2] and seen == killer.kills
        assert {k.pid for k in killer.kills} == {p.pid for p in procs.values()} and killer.done
        assert all(killer.killed(p.pid) for p in procs.values())
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()


def test_external_killer_waits_until_ready_and_stops_on_request():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        killer = ExternalKiller(lambda: {"a": proc.pid}, count=1, min_gap_s=0.0, max_gap_s=0.0,
                                ready=lambda: False).start()
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)  # not ready: nothing killed
        killer.stop()
        assert not killer.kills and proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_kill_pid_of_a_finished_process_says_so():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert kill_pid(proc.pid) is False


def test_failstop_fires_once_per_point_and_bad_points_are_refused():
    fired = []
    fs = FailStop([KillPoint(2, "plan"), KillPoint(4, "start")], on_kill=fired.append, kill=lambda: fired.append("dead"))
    fs.on_stage(None, "plan", 1)
    fs.on_stage(None, "update", 2)
    assert fired == []
    fs.on_stage(None, "plan", 2)
    fs.on_stage(None, "plan", 2)
    fs.on_step_start(None, 4)
    assert fired == [KillPoint(2, "plan"), "dead", KillPoint(4, "start"), "dead"]
    with pytest.raises(TrainguardError, match="fail-stop point"):
        KillPoint(1, "later")
    with pytest.raises(TrainguardError, match="step"):
        KillPoint(-1, "plan")


def test_random_delay_is_seeded_and_in_range():
    a = [random_delay(0.5, 2.0, seed=s) for s in range(50)]
    assert all(0.5 <= d <= 2.0 for d in a) and a == [random_delay(0.5, 2.0, seed=s) for s in range(50)]
    assert len(set(a)) > 40
    with pytest.raises(TrainguardError):
        random_delay(2.0, 1.0)


def test_death_causes_name_the_signal_or_the_exit_code():
    assert death_cause(-9) == ("signal", "SIGKILL from outside")
    assert death_cause(-15) == ("signal", "SIGTERM from outside")
    assert death_cause(1) == ("crash", "exit code 1")
