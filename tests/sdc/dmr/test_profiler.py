"""The DMR profiler records a real iteration in the schema the planners read, and `plan dmr --model` plans it."""

import json

import pytest

from trainguard.cli.main import main
from trainguard.sdc.dmr.planner import PlannerConfig, plan_static
from trainguard.sdc.dmr.profiler import profile_run


def test_profile_of_a_real_iteration_has_every_phase_and_links():
    prof = profile_run("llama-tiny", pp=1, batch=2, seq_len=32)
    phases = {o.phase for o in prof.ops}
    assert {"forward", "recompute", "backward"} <= phases  # (the update stage is never deferred: not planned)
    ids = {o.id for o in prof.ops}
    assert len(ids) == len(prof.ops)
    rec = [o for o in prof.ops if o.phase == "recompute"]
    assert rec and all(o.recompute_of in ids for o in rec)  # each recompute op names its forward twin
    bw = [o for o in prof.ops if o.kind in ("B", "W")]
    assert bw and sum(o.grad_of is not None for o in bw) > 0.9 * len(bw)  # gradient ops name what they differentiate
    assert any(o.kind == "W" for o in bw) and any(o.seg_last for o in prof.ops)
    assert {o.block for o in prof.ops if o.block} == {"layers.0", "layers.1"}
    plan = plan_static(prof, PlannerConfig())
    assert plan.summary["coverage"] == 1.0 and plan.summary["pdmr_segments"] > 0
    # what a fingerprint costs, measured for the planner: a fixed part and one per byte, both real times
    call, per_byte = prof.meta["fingerprint_call_s"], prof.meta["fingerprint_s_per_byte"]
    assert 0 < call < 0.05 and 0 < per_byte < 1e-6


def test_plan_dmr_profiles_a_model(capsys):
    rc = main(["plan", "dmr", "--model", "llama-tiny", "--pp", "1", "--steps", "1", "--out", "", "--figure", "", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["summary"]["coverage"] == 1.0


def test_plan_dmr_profiles_a_pipeline_with_replicas_and_plans_into_its_dp_window_on_request(tmp_path, capsys):
    """``--pp 2 --dp 2``: four processes; rank 0's profile has the stage's gradient all-reduce as a dp window, and
    ``--dp-windows`` plans checks into it (by default none go there). The mesh is profiled once: ``--save-profile``
    keeps the profile, and the second plan is made from that file."""
    from trainguard.sdc.dmr.plan import Plan
    from trainguard.sdc.dmr.planner import read_profile

    saved = tmp_path / "profiles" / "mesh.json"  # (its folder does not exist yet: made on save)
    planned = {}
    for flag, source in (("--dp-windows", ["--model", "llama-tiny", "--pp", "2", "--dp", "2", "--steps", "1",
                                           "--save-profile", str(saved)]),
                         ("--no-dp-windows", ["--profile", str(saved)])):
        out = tmp_path / f"{flag}.json"
        rc = main(["plan", "dmr", *source, flag, "--out", str(out), "--figure", "", "--json"])
        assert rc == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["summary"]["coverage"] == 1.0
        plan = Plan.load(out)
        assert "dp:0" in {w.id for w in plan.windows}
        planned[flag] = [k for k, o in plan.ops.items() if o.window == "dp:0"]
    assert "dp:0" in {w.id for w in read_profile(saved).windows}
    assert planned["--dp-windows"] and not planned["--no-dp-windows"]


@pytest.mark.parametrize("argv, message", [
    (["--profile", "{p}", "--save-profile", "{d}/x.json"], "--save-profile needs --model"),
    (["--model", "llama-tiny", "--save-profile", "{d}"], "--save-profile names a folder, not a file"),
])
def test_plan_dmr_save_profile_is_refused_in_one_line_before_any_profiling(tmp_path, capsys, argv, message):
    from _dmr_profiles import synthetic_profile

    p = tmp_path / "p.json"
    synthetic_profile().save(p)
    rc = main(["plan", "dmr", *(a.format(p=p, d=tmp_path) for a in argv), "--out", "", "--figure", ""])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and message in err and len(err.splitlines()) == 1, err
