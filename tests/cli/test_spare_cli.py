"""``trainguard spare`` CLI: JSON last line, one-line errors with exit 2 (``plan cluster``: test_plan_cluster_cli.py)."""

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


def test_compare_json_paired_with_paper(capsys):
    assert main(["spare", "compare", "--groups", "16", "--seeds", "2", "--max-redundancy", "3", "--total-gpus", "128",
                 "--gpu-mtbf-hours", "32", "--base-steps", "60", "--restart-s", "600", "--checkpoint-s", "30",
                 "--model-params", "4e9", "--json"]) == 0
    d = _json_last(capsys)
    assert d["paper"] is None and len(d["gain_vs_replication_ci"]) == 2
    assert {row["scheme"] for row in d["rows"]} == {"spare", "replication", "checkpoint"}
    for row in d["rows"]:
        assert len(row["per_seed_days"]) == 2 and len(row["time_to_train_days_ci"]) == 2


def test_every_cluster_parameter_is_a_flag(capsys):
    assert main(["spare", "simulate", "--groups", "16", "--scheme", "spare", "--redundancy", "3", "--total-gpus", "128",
                 "--base-steps", "30", "--shrink-s", "2.5", "--controller-s", "0.25", "--jitter", "0",
                 "--hop-latency-s", "1e-5", "--gpu-bandwidth-gbps", "100", "--allreduce-algorithm", "halving-doubling",
                 "--renewal", "failure", "--no-domain-aware", "--json"]) == 0
    d = _json_last(capsys)
    pr = d["params"]
    assert (pr["shrink_s"], pr["controller_s"], pr["jitter"], pr["hop_latency_s"]) == (2.5, 0.25, 0.0, 1e-5)
    assert pr["allreduce_algorithm"] == "halving-doubling" and pr["renewal"] == "failure" and pr["domain_aware"] is False


def test_network_alpha_beta_json(capsys):
    assert main(["spare", "network", "--groups", "4", "64", "--gpus-per-group", "8", "--model-params", "4e9",
                 "--checkpoint-gb", "10", "--json"]) == 0
    d = _json_last(capsys)
    ring = [row["alpha_beta_allreduce_s"] for row in d["rows"]]
    assert ring[0] < ring[1] and d["alpha_beta_checkpoint_s"] > 0


@pytest.mark.parametrize("argv", [
    ["spare", "montecarlo", "--groups", "10", "--redundancy", "5", "--trials", "3", "--json"],
    ["spare", "simulate", "--groups", "16", "--scheme", "spare", "--redundancy", "13", "--json"],
    ["plan", "cluster", "--gpus", "100", "--gpus-per-group", "200", "--mtbf-per-gpu-hours", "10",
     "--restart-minutes", "1", "--checkpoint-minutes", "1", "--json"],
    ["spare", "compare", "--groups", "16", "--seeds", "0", "--json"],
    ["spare", "simulate", "--groups", "16", "--scheme", "spare", "--redundancy", "3", "--weibull-shape", "-1", "--json"],
    ["spare", "network", "--groups", "4", "--gpus-per-group", "0", "--json"],
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
