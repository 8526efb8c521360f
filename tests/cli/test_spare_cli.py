"""``trainguard spare`` and ``trainguard plan cluster`` CLI: JSON last line, one-line errors with exit 2."""

import json
import subprocess
import sys

import pytest

from trainguard.cli.main import main


def _json_last(capsys):
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


def test_montecarlo_json(capsys):
    assert main(["spare", "montecarlo", "--groups", "31", "--redundancy", "3", "--trials", "12", "--seed", "1",
                 "--workers", "1", "--json"]) == 0
    d = _json_last(capsys)
    for k in ("mean_failures_to_wipeout", "theory_failures_to_wipeout", "mean_allreduce_stack",
              "theory_allreduce_stack_lower_bound", "rel_error_vs_theory"):
        assert k in d
    assert d["groups"] == 31 and d["trials"] == 12


def test_sweep_json(capsys):
    assert main(["spare", "sweep", "--groups", "31", "--trials", "6", "--max-redundancy", "3", "--workers", "1",
                 "--json"]) == 0
    d = _json_last(capsys)
    assert [row["redundancy"] for row in d["rows"]] == [2, 3]


@pytest.mark.parametrize("scheme,r", [("spare", 3), ("replication", 2), ("checkpoint", 1)])
def test_simulate_json(capsys, scheme, r):
    assert main(["spare", "simulate", "--groups", "16", "--scheme", scheme, "--redundancy", str(r), "--seed", "2",
                 "--total-gpus", "128", "--gpu-mtbf-hours", "32", "--base-steps", "60", "--restart-s", "600",
                 "--checkpoint-s", "30", "--stack-compute-s", "10", "--json"]) == 0
    d = _json_last(capsys)
    for k in ("time_to_train_days", "availability", "mean_stacks_per_step", "global_restarts"):
        assert k in d
    assert d["params"]["total_gpus"] == 128


def test_plan_cluster(capsys, tmp_path):
    assert main(["plan", "cluster", "--gpus", "600000", "--gpus-per-group", "3000", "--mtbf-per-gpu-hours", "50680",
                 "--restart-minutes", "30", "--checkpoint-minutes", "1", "--out", str(tmp_path), "--json"]) == 0
    d = _json_last(capsys)
    assert d["groups"] == 200 and 2 <= d["recommended_redundancy"] <= 12
    assert d["recommended_checkpoint_period_min"] > 1 and 0 < d["expected_availability"] < 1
    for f in d["figures"].values():
        assert (tmp_path / f.split("/")[-1]).stat().st_size > 1000


@pytest.mark.parametrize("argv", [
    ["spare", "montecarlo", "--groups", "10", "--redundancy", "5", "--trials", "3", "--json"],
    ["spare", "simulate", "--groups", "16", "--scheme", "spare", "--redundancy", "13", "--json"],
    ["plan", "cluster", "--gpus", "100", "--gpus-per-group", "200", "--mtbf-per-gpu-hours", "10",
     "--restart-minutes", "1", "--checkpoint-minutes", "1", "--json"],
    ["spare", "run", "--groups", "4", "--kill", "9@2", "--json"],
    ["spare", "run", "--groups", "4", "--kill", "1@two", "--json"],
    ["spare", "run", "--groups", "4", "--redundancy", "3", "--json"],
])
def test_bad_input_exit_2_one_line(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainguard: error:")


def test_subprocess_bad_choice_exit_2():
    proc = subprocess.run([sys.executable, "-m", "trainguard", "spare", "simulate", "--groups", "16", "--scheme",
                           "raid"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_spare_run_json_kills_a_group_and_matches_the_fault_free_run(capsys):
    argv = ["spare", "run", "--groups", "4", "--redundancy", "2", "--steps", "4", "--tiny", "--seq-len", "16",
            "--kill", "2@1", "--verify", "--json"]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert d["killed_groups"] == 1 and d["global_restarts"] == 0 and d["survivors"] == [0, 1, 3]
    assert d["patch_computes"] == 1 and [lg["stack"] for lg in d["step_logs"]] == [1, 1, 2, 2]
    assert d["max_param_diff_vs_fault_free"] < 1e-5
