"""plan_cluster: the headline is the fastest row shown, with its interval; theory/simulation disagreement is
reported; the sensitivity table re-plans on the same trails; the plan round-trips through TOML."""

import math

import pytest

from trainguard.errors import ConfigError, TrainguardError
from trainguard.sim.plan_file import SparePlan, dumps_plan, read_plan, write_plan
from trainguard.sim.planning import PlanOptions, plan_cluster
from trainguard.sim.timetotrain import ClusterParams

# the issue's example: 1024 GPUs in groups of 8, Llama 3 MTBF, 10 min restart, 2 min checkpoint
EXAMPLE = dict(total_gpus=1024, gpu_mtbf_hours=50680.0, restart_s=600.0, checkpoint_s=120.0, model_params=2.67e10)


def _shown_times(res):
    key = res["ranked_by"]
    return [row[key] for row in res["rows"] if isinstance(row.get(key), float) and math.isfinite(row[key])]


def _assert_headline_is_fastest(res):
    key = res["ranked_by"]
    times = _shown_times(res)
    assert res["expected_time_to_train_days"] == min(times)
    for b in res["best"].values():
        if b is not None:
            assert res["expected_time_to_train_days"] <= b[key]
    rec = res["recommended_scheme"]
    assert res["best"][rec][key] == res["expected_time_to_train_days"]


def test_issue_example_recommends_checkpoint_only():
    res = plan_cluster(ClusterParams(**EXAMPLE), 128, PlanOptions(seeds=2, sensitivity=False, r_max=4))
    assert res["recommended_scheme"] == "checkpoint" and res["recommended_redundancy"] == 1
    lo, hi = res["expected_time_to_train_days_ci"]
    assert lo <= res["expected_time_to_train_days"] <= hi
    _assert_headline_is_fastest(res)
    assert res["failure_free"]["spare_stacks_no_failure"] == 1 and "1 stack per step" in res["failure_free"]["statement"]


@pytest.mark.parametrize("kw,n", [
    (dict(total_gpus=1024, gpu_mtbf_hours=50680.0, restart_s=600.0, checkpoint_s=120.0, model_params=2.67e10), 128),
    (dict(total_gpus=16 * 8, gpu_mtbf_hours=32.0, restart_s=600.0, checkpoint_s=30.0, base_steps=120, model_params=4e9), 16),
    (dict(total_gpus=64 * 4, gpu_mtbf_hours=400.0, restart_s=1800.0, checkpoint_s=60.0, base_steps=300, model_params=4e9,
          weibull_shape=0.5), 64),
])
@pytest.mark.parametrize("simulate", [False, True])
def test_a_slower_scheme_is_never_the_headline(kw, n, simulate):
    res = plan_cluster(ClusterParams(**kw), n, PlanOptions(seeds=2, simulate=simulate, sensitivity=False, r_max=5))
    _assert_headline_is_fastest(res)
    assert res["ranked_by"] == ("sim_time_to_train_days" if simulate else "time_to_train_days")


def test_theory_and_simulation_disagreement_is_reported():
    # Weibull 0.5 after every restart: the exponential theory still picks CKPT-only, the simulation does not
    p = ClusterParams(**EXAMPLE, weibull_shape=0.5)
    res = plan_cluster(p, 128, PlanOptions(seeds=3, sensitivity=False, r_max=4))
    tvs = res["theory_vs_simulation"]
    assert res["recommended_scheme"] != "checkpoint"
    assert not tvs["agree"] and tvs["theory_pick"] == "CKPT-only"
    slower = tvs["theory_pick_slower_by_days"]
    assert tvs["significant"] and (slower["mean"] == math.inf or slower["ci"][0] > 0)
    assert any(row["scheme"] == "checkpoint" for row in tvs["rows_outside_interval"])
    assert tvs["message"] in res["notes"]


def test_sensitivity_table_shows_when_the_recommendation_changes():
    res = plan_cluster(ClusterParams(**EXAMPLE), 128, PlanOptions(seeds=2, r_max=4))
    rows = res["sensitivity"]
    assert rows[0]["input"] == "baseline" and rows[0]["recommended_scheme"] == res["recommended_scheme"]
    assert {r["input"] for r in rows[1:]} == {"weibull_shape", "renewal", "restart_s", "gpu_mtbf_hours", "checkpoint_s"}
    shape_05 = next(r for r in rows if r["input"] == "weibull_shape" and r["value"] == 0.5)
    assert shape_05["scheme_changes"] and shape_05["recommended_scheme"] != "checkpoint"
    mi = res["sensitivity_most_influential"]
    spread = res["sensitivity_spread"]
    assert spread[mi["on_time"]]["time_spread_days"] == max(v["time_spread_days"] for v in spread.values())


def test_plan_round_trips_and_bad_plan_files_are_refused(tmp_path):
    res = plan_cluster(ClusterParams(**EXAMPLE), 128, PlanOptions(seeds=2, sensitivity=False, r_max=3))
    plan = SparePlan(**res["plan"])
    path = write_plan(tmp_path / "sub" / "plan.toml", plan)
    back = read_plan(path)
    assert back == plan
    assert back.groups == 128 and back.gpus_per_group == 8 and back.inputs["restart_s"] == 600.0
    assert back.checkpoint_every_steps == max(1, round((back.checkpoint_interval_s - back.checkpoint_save_s)
                                                       / back.step_time_s))
    text = dumps_plan(plan)
    for bad, msg in [(text.replace("scheme = ", "sceme = ", 1), "unknown key"),
                     (text.replace('scheme = "checkpoint"', 'scheme = "raid"'), "scheme"),
                     (text.replace("groups = 128", 'groups = "many"'), "wrong type"),
                     ("\n".join(x for x in text.splitlines() if not x.startswith("step_time_s")), "missing key"),
                     ("scheme = [", "not valid TOML")]:
        (tmp_path / "bad.toml").write_text(bad)
        with pytest.raises(ConfigError, match=msg):
            read_plan(tmp_path / "bad.toml")
    with pytest.raises(ConfigError, match="cannot read"):
        read_plan(tmp_path / "none.toml")


def test_plan_cluster_input_errors():
    with pytest.raises(TrainguardError, match="seeds"):
        plan_cluster(ClusterParams(**EXAMPLE), 128, PlanOptions(seeds=0))
    with pytest.raises(TrainguardError, match=">= 2"):
        plan_cluster(ClusterParams(total_gpus=8), 1, PlanOptions(simulate=False))
