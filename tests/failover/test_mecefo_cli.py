"""``trainguard bench mecefo``: the JSON contract on a tiny model (step costs measured, throughput modelled, real
runs with failures and a real kill), the figure, and bad input (exit 2)."""

import json

import pytest

from trainguard.cli.main import main

METHODS = ("mecefo", "bamboo", "oobleck", "checkpoint_restart")
KEYS = ("tokens_per_s_no_failure", "tokens_per_s_failures", "throughput_drop", "val_ppl_no_failure", "val_ppl_failures")


@pytest.mark.slow
def test_bench_mecefo_json_contract_on_a_tiny_model(capsys, tmp_path):
    plot = tmp_path / "mecefo.png"
    code = main(["bench", "mecefo", "--tiny", "--workers", "32", "--failures", "high", "--steps", "6",
                 "--seq-len", "16", "--batch", "2", "--rounds", "1", "--eval-batches", "1", "--quality-hours", "3",
                 "--no-memory", "--horizon-h", "50", "--plot", str(plot), "--json"])
    assert code == 0
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert d["methods"] == list(METHODS) and d["throughput_modelled"] is True and "not a run" in d["throughput_note"]
    for m in METHODS:
        assert all(k in d[m] for k in KEYS), m
        assert d[m]["tokens_per_s_failures"] > 0 and d[m]["tokens_per_s_no_failure"] > 0
        assert d[m]["throughput_drop"] == pytest.approx(1 - d[m]["tokens_per_s_failures"] / d[m]["tokens_per_s_no_failure"])
        assert d[m]["val_ppl_no_failure"] == d["mecefo"]["val_ppl_no_failure"] > 1
    runs = d["quality"]["runs"]
    assert set(runs) == {"no_failure", *METHODS}
    # the baselines are exact: their runs with failures end where the failure-free run ends
    for m in ("bamboo", "oobleck", "checkpoint_restart"):
        assert d[m]["val_ppl_failures"] == d[m]["val_ppl_no_failure"], m
        assert runs[m]["agree"] and not runs[m]["errors"]
    assert runs["checkpoint_restart"]["global_restarts"] >= 1
    mec = runs["mecefo"]
    assert mec["timeline"]["real"] == 1 and [x["cause"] for x in mec["deaths"]] == ["kill"] and mec["agree"]
    assert mec["steps_degraded"] >= 1 and d["grad_rel_error_samples"] >= 1 and 0 < d["grad_rel_error_max"] < 1
    assert d["neighbor_step_time_ratio"] > 0 and d["neighbor_peak_memory_ratio"] is None  # --no-memory
    assert set(d["ablation"]) >= {"naive", "skip_mha", "recompute_ffn", "low_rank", "all"}
    assert d["ablation"]["all"]["activation_ratio"] < d["ablation"]["naive"]["activation_ratio"] == 1.0
    assert set(d["by_preset"]) == {"none", "low", "mid", "high"}
    assert set(d["throughput_drop_by_recovery_min"]) == {"1.0", "5.0", "10.0", "30.0"}
    assert d["quality"]["token_budget"] == 6 * 4 * 1 * 16
    # the default spreads an out worker's 2 micro-batches over its ring neighbors; the paper's single neighbor
    # (spread 1) is reported beside it, with the ablation's neighbor step
    sp = d["spread"]
    assert sp["config"] == "auto" and sp["parts"] == 2 and sp["neighbors_for_one_failure"] in (1, 2) and sp["degraded_cost"] > 0
    single = d["mecefo_single_neighbor"]
    assert all(k in single for k in ("tokens_per_s_no_failure", "tokens_per_s_failures", "throughput_drop",
                                     "throughput_drop_by_preset", "throughput_drop_by_recovery_min"))
    assert single["neighbor_step_time_ratio"] == pytest.approx(d["ablation"]["all"]["step_time_ratio"])
    assert single["tokens_per_s_no_failure"] == pytest.approx(d["mecefo"]["tokens_per_s_no_failure"])
    assert set(d["step_costs"]["neighbor_extra"]) == {"1", "2"}
    assert d["plot"] == str(plot) and plot.stat().st_size > 0


@pytest.mark.parametrize("argv,msg", [
    (["--techniques", "skip_mha,fast"], "--techniques"),
    (["--recovery-min", "0"], "--recovery-min"),
    (["--steps", "0"], "steps"),
    (["--plot", "x.txt"], "--plot"),
    (["--spread", "0"], "spread"),
    (["--batch", "4", "--cost-micro-batch", "3"], "cost_micro_batch"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, msg):
    assert main(["bench", "mecefo", "--tiny", *argv, "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0]
