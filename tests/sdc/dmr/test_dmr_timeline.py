"""The DMR timeline figure: drawn for small and large plans, tiny ops merged into one bar."""

from _dmr_profiles import fig9_profile, synthetic_profile

from trainguard.report.dmr_timeline import _merge, draw_timeline
from trainguard.sdc.dmr.planner import no_dmr, plan_static

PNG = b"\x89PNG\r\n\x1a\n"


def test_draws_worked_example_and_large_plan(tmp_path):
    small = fig9_profile()
    assert draw_timeline(small, plan_static(small), tmp_path / "fig9.png").read_bytes()[:8] == PNG
    big = synthetic_profile(ac="none", blocks=6, microbatches=8, stages=4, stage=1, headroom=1.0)
    assert len(big.ops) > 1000
    assert draw_timeline(big, plan_static(big), tmp_path / "big.png", title="big").read_bytes()[:8] == PNG


def test_draws_the_no_dmr_baseline(tmp_path):
    small = fig9_profile()
    assert draw_timeline(small, no_dmr(small), tmp_path / "none.svg").read_text().startswith("<?xml")


def test_adjacent_tiny_bars_merge():
    bars = [(i * 0.001, 0.0009) for i in range(1000)] + [(5.0, 1.0)]
    merged = _merge(bars, gap=0.01)
    assert len(merged) == 2 and merged[1] == (5.0, 1.0)
    assert abs(merged[0][0]) < 1e-12 and abs(merged[0][1] - (0.999 + 0.0009)) < 1e-9
    assert len(_merge(bars, gap=0.0)) == 1001  # without a gap the 0.0001 spaces keep them apart


def test_ops_marked_for_carrying_past_the_update_have_their_own_colour(tmp_path):
    import matplotlib
    from _dmr_profiles import Builder

    from trainguard.sdc.dmr.planner import PlannerConfig

    q = Builder()
    q.op("F0", time=1.0, out_bytes=100)
    q.window("W1", "pp", 4.0)
    q.op("B1", phase="backward", kind="B", time=1.0, out_bytes=100)
    profile = q.profile(budget=10**9, base=0)
    label = "carried past a held update"
    for carry in ("windows", "unbounded"):
        plan = plan_static(profile, PlannerConfig(carry=carry))
        assert plan.ops["B1"].window == "carry"
        with matplotlib.rc_context({"svg.fonttype": "none"}):  # (text kept as text)
            assert label in draw_timeline(profile, plan, tmp_path / f"{carry}.svg").read_text()
    plan = plan_static(profile, PlannerConfig(window_fill=0.3, carry="windows"))  # 1.2 s of room: none left for B1
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        assert label not in draw_timeline(profile, plan, tmp_path / "none.svg").read_text()
