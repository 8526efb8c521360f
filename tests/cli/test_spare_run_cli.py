"""``trainguard spare run``: ``--verify TOL`` decides the exit code, deaths are in the JSON, bad input exits 2."""

import json

import pytest
import torch

from trainguard.cli.main import main
from trainguard.failover.spare import runtime
from trainguard.failover.spare.runtime import SpareRunResult


def _json_last(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _fake(monkeypatch, diff: float):
    """run_spare and reference_run without processes: the run ends ``diff`` away from the reference."""
    state = {"w": torch.zeros(4)}
    res = SpareRunResult(state=state, steps=2, killed=[], global_restarts=0, patch_computes=0, mean_stacks_per_step=1.0,
                         final_loss=5.0, survivors=[0, 1, 2, 3], step_logs=[], wall_s=0.1,
                         deaths=[{"group": 1, "step": 1, "cause": "signal", "detail": "SIGKILL from outside",
                                  "restart": 0, "pid": 1}])
    monkeypatch.setattr(runtime, "run_spare", lambda cfg, progress=None: res)
    monkeypatch.setattr(runtime, "reference_run", lambda cfg: {"w": torch.full((4,), diff)})


@pytest.mark.parametrize("argv,diff,code", [
    (["--verify", "1e-3"], 2e-3, 1),
    (["--verify", "1e-3"], 5e-4, 0),
    (["--verify"], 1e-9, 1),  # no tolerance given: bitwise
    (["--verify"], 0.0, 0),
])
def test_verify_exits_non_zero_above_the_tolerance(monkeypatch, capsys, argv, diff, code):
    _fake(monkeypatch, diff)
    assert main(["spare", "run", "--groups", "4", "--steps", "2", "--tiny", *argv, "--json"]) == code
    captured = capsys.readouterr()
    d = json.loads(captured.out.strip().splitlines()[-1])
    assert d["max_param_diff_vs_fault_free"] == pytest.approx(diff) and d["verified"] == (code == 0)
    assert d["deaths"][0]["cause"] == "signal"
    err = captured.err.strip().splitlines()
    assert (len(err) == 1 and err[0].startswith("trainguard: verification failed")) if code else not err


def test_human_output_lists_the_deaths(monkeypatch, capsys):
    _fake(monkeypatch, 0.0)
    assert main(["spare", "run", "--groups", "4", "--steps", "2", "--tiny", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "deaths" in out and "SIGKILL from outside" in out


@pytest.mark.parametrize("argv", [
    ["--set", "train.dtype"],
    ["--set", "train.dtype=fp64"],
    ["--kill", "1@2:later"],
    ["--verify", "-1"],
    ["--random-kills", "-2"],
])
def test_bad_input_exit_2_one_line(capsys, argv):
    assert main(["spare", "run", "--groups", "4", "--tiny", *argv, "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainguard: error:")


@pytest.mark.slow
def test_spare_run_with_a_mid_step_kill_is_bitwise_equal_to_the_fault_free_run(capsys, tmp_path):
    argv = ["spare", "run", "--groups", "4", "--redundancy", "2", "--steps", "4", "--tiny", "--seq-len", "16",
            "--kill", "1@1:plan", "--set", "train.grad_clip=0.5", "--run-dir", str(tmp_path), "--verify", "--json"]
    assert main(argv) == 0
    d = _json_last(capsys)
    assert d["max_param_diff_vs_fault_free"] == 0.0 and d["verified"] and d["survivors"] == [0, 2, 3]
    assert d["deaths"] == [{"group": 1, "step": 1, "cause": "kill", "detail": "--kill 1@1:plan", "restart": 0,
                            "pid": d["deaths"][0]["pid"]}]
    assert d["patch_computes"] == 1 and [lg["failed"] for lg in d["step_logs"]] == [[], [1], [], []]
    assert any(p.name.startswith("step_") for p in (tmp_path / "checkpoints").iterdir())


@pytest.mark.slow
def test_spare_run_random_kills_from_outside_are_reported_and_verified(capsys):
    argv = ["spare", "run", "--groups", "4", "--redundancy", "2", "--steps", "60", "--tiny", "--seq-len", "16",
            "--random-kills", "2", "--kill-seed", "1", "--timeout", "5", "--max-restarts", "6", "--verify", "--json"]
    assert main(argv) == 0
    d = _json_last(capsys)
    assert d["verified"] and d["max_param_diff_vs_fault_free"] == 0.0
    assert len(d["deaths"]) == 2 and all(x["detail"] == "SIGKILL from outside" for x in d["deaths"])
