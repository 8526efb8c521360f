"""``trainguard plan cluster``: honest headline, JSON contract, plan file, scale, one-line errors with exit 2."""

import json
import os

import pytest

from trainguard.cli.main import main
from trainguard.sim.plan_file import read_plan

EXAMPLE = ["plan", "cluster", "--gpus", "1024", "--gpus-per-group", "8", "--mtbf-per-gpu-hours", "50680",
           "--restart-minutes", "10", "--checkpoint-minutes", "2"]


def _json_last(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_issue_example_recommends_checkpoint_only_and_writes_the_plan(capsys, tmp_path):
    assert main(EXAMPLE + ["--seeds", "2", "--max-redundancy", "4", "--no-sensitivity", "--out", str(tmp_path),
                           "--json"]) == 0
    d = _json_last(capsys)
    assert d["recommended_scheme"] == "checkpoint" and d["recommended_redundancy"] == 1
    for key in ("expected_time_to_train_days", "expected_availability", "recommended_checkpoint_period_min",
                "gain_vs_replication", "rows", "params", "ranked_by", "thm43_redundancy"):
        assert key in d
    assert set(d["best"]) == {"spare", "replication", "checkpoint"}
    shown = [b[d["ranked_by"]] for b in d["best"].values() if b]
    assert d["expected_time_to_train_days"] == min(shown)
    lo, hi = d["expected_time_to_train_days_ci"]
    assert lo <= d["expected_time_to_train_days"] <= hi
    plan = read_plan(d["plan_file"])
    assert (plan.scheme, plan.groups, plan.gpus_per_group) == ("checkpoint", 128, 8)
    for f in d["figures"].values():
        assert os.path.getsize(f) > 1000


def test_human_output_headlines_the_fastest(capsys, tmp_path):
    assert main(EXAMPLE + ["--theory-only", "--max-redundancy", "3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "CKPT-only" in out and "1 stack per step" in out and "plan:" in out and "sensitivity" in out


def test_out_in_an_impossible_folder_is_a_one_line_error(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(EXAMPLE + ["--theory-only", "--out", str(blocker / "sub"), "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainguard: error:") and "--out" in err[0]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_out_in_a_read_only_folder_is_a_one_line_error(capsys, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert main(EXAMPLE + ["--theory-only", "--out", str(ro / "plan"), "--json"]) == 2
    finally:
        ro.chmod(0o700)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainguard: error:")


@pytest.mark.parametrize("extra", [["--simulate", "--seeds", "0"], ["--seeds", "-1"], ["--workers", "0"],
                                   ["--simulate", "--theory-only"],
                                   ["--stack-seconds", "5", "--gpu-tflops", "400"], ["--tokens", "1e9"],
                                   ["--failure-model", "trace"], ["--weibull-shape", "0"]])
def test_bad_options_are_one_line_errors(capsys, tmp_path, extra):
    assert main(EXAMPLE + extra + ["--out", str(tmp_path), "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainguard: error:")


@pytest.mark.parametrize("gpus,extra", [("65536", ["--no-sensitivity"]), ("200000", [])])
def test_theory_answers_at_scale(capsys, tmp_path, gpus, extra):
    # the issue's 65,536-GPU command ended with "mean time between failures must be > 0, got 0.0"
    assert main(["plan", "cluster", "--gpus", gpus, "--gpus-per-group", "8", "--mtbf-per-gpu-hours", "50680",
                 "--restart-minutes", "30", "--checkpoint-minutes", "1", "--theory-only", "--out", str(tmp_path),
                 "--json", *extra]) == 0
    d = _json_last(capsys)
    assert d["groups"] == int(gpus) // 8 and d["expected_time_to_train_days"] > 0
    assert max(r["redundancy"] for r in d["rows"] if r["scheme"] == "spare") == 28
    assert all(r["system_mtbf_s"] > 0 for r in d["rows"])
    if not extra:  # the sensitivity rows are part of the JSON contract
        assert d["sensitivity"][0]["input"] == "baseline" and len(d["sensitivity"]) > 5
        assert d["sensitivity_most_influential"]["on_time"] in {r["input"] for r in d["sensitivity"]}


def test_leftover_gpus_and_derived_step_time_are_reported(capsys, tmp_path):
    assert main(["plan", "cluster", "--gpus", "1030", "--gpus-per-group", "8", "--mtbf-per-gpu-hours", "50680",
                 "--restart-minutes", "10", "--checkpoint-minutes", "2", "--model-params", "7e10",
                 "--tokens-per-step", "4e6", "--gpu-tflops", "400", "--tokens", "4e10", "--theory-only",
                 "--no-sensitivity", "--out", str(tmp_path), "--json"]) == 0
    d = _json_last(capsys)
    assert d["unused_gpus"] == 6 and any("6 GPU(s)" in n for n in d["notes"])
    assert d["params"]["stack_compute_s"] == pytest.approx(6 * 7e10 * 4e6 / (1024 * 400e12))
    assert d["params"]["base_steps"] == 10_000


def test_trace_replay_and_failure_domains_run_end_to_end(capsys, tmp_path):
    trace = tmp_path / "failures.csv"
    trace.write_text("time_h,gpu\n" + "\n".join(f"{3 * i + 0.5},{(37 * i) % 1024}" for i in range(40)) + "\n")
    assert main(EXAMPLE + ["--failure-model", "trace", "--trace", str(trace), "--seeds", "2", "--max-redundancy", "3",
                           "--no-sensitivity", "--out", str(tmp_path / "a"), "--json"]) == 0
    d = _json_last(capsys)
    assert d["params"]["failure_model"] == "trace"
    assert d["cluster_failure_mtbf_min"] == pytest.approx((3 * 39 + 0.5) * 60 / 40)  # trace period / failures
    assert main(EXAMPLE + ["--gpus-per-domain", "64", "--domain-mtbf-hours", "500", "--seeds", "2",
                           "--max-redundancy", "4", "--no-sensitivity", "--out", str(tmp_path / "b"), "--json"]) == 0
    d = _json_last(capsys)
    assert d["params"]["gpus_per_domain"] == 64
    plan = read_plan(d["plan_file"])
    if plan.scheme != "checkpoint" and plan.redundancy > 1:
        assert sorted(plan.domain_slots) == list(range(128))
