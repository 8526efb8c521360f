"""The static planner on synthetic iterations: phase ablations, complete single coverage, the memory budget,
windows, MoE, baselines, profile checks, and the plan's JSON round trip."""

import json
from bisect import bisect_right

import pytest
from _dmr_profiles import Builder, fig10_profile, synthetic_profile

from trainguard.config import load_config
from trainguard.errors import ConfigError, TrainguardError
from trainguard.sdc.dmr import best_fit
from trainguard.sdc.dmr.plan import CHECKED, CoverageError, Plan, coverage_report
from trainguard.sdc.dmr.planner import PlannerConfig, naive_only, no_dmr, parse_phases, plan_static, read_profile, retained_bytes
from trainguard.sdc.dmr.profile import Profile

PROFILES = {
    "dense": dict(blocks=2, microbatches=2),
    "dense-selective-ac": dict(ac="selective", blocks=2, microbatches=2),
    "pp2-stage0": dict(stages=2, stage=0, microbatches=4, headroom=1.5),
    "pp2-stage1": dict(stages=2, stage=1, microbatches=4, headroom=1.5),
    "pp4-no-ac": dict(ac="none", blocks=3, microbatches=6, stages=4, stage=1, headroom=1.0),
    "moe": dict(moe=True, blocks=2, microbatches=2),
    "moe-pp2": dict(moe=True, stages=2, stage=0, microbatches=3, headroom=2.0),
}


@pytest.fixture(scope="module", params=sorted(PROFILES))
def case(request):
    profile = synthetic_profile(**PROFILES[request.param])
    plans = {ph: plan_static(profile, PlannerConfig(phases=ph)) for ph in ((1,), (1, 2), (1, 2, 3))}
    return request.param, profile, plans


def test_each_added_phase_never_increases_critical_checker_time(case):
    name, profile, plans = case
    crit = [plans[ph].summary["checker_critical_s"] for ph in ((1,), (1, 2), (1, 2, 3))]
    assert crit[0] >= crit[1] >= crit[2], (name, crit)
    assert crit[0] <= naive_only(profile).summary["checker_critical_s"]


def test_every_op_has_exactly_one_strategy(case):
    name, profile, plans = case
    for plan in plans.values():
        report = coverage_report(plan, profile)
        assert report.fraction == 1.0 and report.covered == report.total
        ops = {o.id: o for o in profile.ops}
        assert set(plan.ops) == set(ops)
        for k, p in plan.ops.items():
            assert (p.strategy == "comm") == (ops[k].kind == "C")
            assert p.strategy in CHECKED + ("comm",)
        # a deferred op is listed in exactly its window, an AGC op in exactly its segment
        listed = [k for w in plan.windows for k in w.ops] + [k for a in plan.agc_segments for k in a.ops]
        assert len(listed) == len(set(listed))
        assert set(listed) == {k for k, p in plan.ops.items() if p.strategy in ("d-inter", "d-intra", "agc")}


def test_phases_do_what_they_say(case):
    name, profile, plans = case
    used = {ph: {p.strategy for p in plans[ph].ops.values()} for ph in plans}
    assert not used[(1,)] & {"agc", "d-inter", "d-intra", "dynamic"}
    assert not used[(1, 2)] & {"d-inter", "d-intra", "dynamic"}
    has_ac = any(o.ac_segment for o in profile.ops)
    assert ("p-dmr" in used[(1,)]) == has_ac
    if any(o.dynamic for o in profile.ops):
        assert "dynamic" in used[(1, 2, 3)]
    assert [s.ac_segment for s in plans[(1,)].pdmr_segments] == [s.ac_segment for s in plans[(1, 2, 3)].pdmr_segments]


def _memory_with_deferral(profile, plan):
    """Independent of the planner: the profile's curve (flat at its peak for MoE) plus each deferred op's
    bytes from its start to its window's end and each AGC segment's bytes from its first op to its window's end."""
    moe = any(o.dynamic for o in profile.ops)
    pts = sorted(profile.memory_curve)
    peak = max([profile.peak_bytes] + [b for _, b in pts])
    ends = {w.id: w.start_s + w.duration_s for w in profile.windows}
    intervals = [(p.start_s, ends[p.window], p.retained_bytes) for p in plan.ops.values()
                 if p.strategy in ("d-inter", "d-intra")]
    intervals += [(a.retained_from_s, ends[a.window], a.memory_bytes) for a in plan.agc_segments]
    times = sorted({t for t, _ in pts} | {s for s, _, _ in intervals} | {0.0})

    def base(t):
        return peak if moe else pts[max(bisect_right([x for x, _ in pts], t) - 1, 0)][1]

    return max(base(t) + sum(b for s, e, b in intervals if s <= t < e) for t in times)


@pytest.mark.parametrize("headroom", [0.02, 0.2, 1.0, 3.0])
@pytest.mark.parametrize("kw", [dict(stages=2, stage=1, microbatches=4), dict(moe=True, stages=2, stage=0, microbatches=3),
                                dict(ac="none", blocks=3, microbatches=4, stages=3, stage=1)])
def test_deferral_never_exceeds_the_memory_budget(kw, headroom):
    profile = synthetic_profile(headroom=headroom, **kw)
    plan = plan_static(profile)
    peak = _memory_with_deferral(profile, plan)
    assert peak <= plan.memory_budget_bytes
    assert plan.summary["peak_with_deferral_bytes"] == peak
    for p in plan.ops.values():
        if p.strategy in ("d-inter", "d-intra"):
            assert p.retained_bytes == retained_bytes(profile.op(next(k for k, q in plan.ops.items() if q is p)))


def test_a_tighter_budget_defers_less_and_zero_defers_nothing():
    profile = synthetic_profile(ac="none", blocks=3, microbatches=4, stages=3, stage=1, headroom=3.0)
    hidden = []
    for budget in (profile.peak_bytes * 4, profile.peak_bytes * 1.2, 0):
        plan = plan_static(profile, PlannerConfig(memory_budget_bytes=int(budget)))
        hidden.append(plan.summary["checker_hidden_s"])
        assert coverage_report(plan, profile).fraction == 1.0
    assert hidden[0] >= hidden[1] >= hidden[2] == 0
    assert hidden[0] > hidden[1]


def test_windows_are_never_overfilled_and_follow_their_ops(case):
    name, profile, plans = case
    plan = plans[(1, 2, 3)]
    ops = {o.id: o for o in profile.ops}
    pos = {o.id: i for i, o in enumerate(profile.ops)}
    for w in plan.windows:
        assert w.used_s <= w.duration_s * (1 + 1e-9)
        assert w.ops_s == pytest.approx(sum(ops[k].time_s for k in w.ops))
        if w.dynamic:
            assert not w.ops and not w.agc  # the dynamic planner's
        for k in w.ops:  # a checker runs after its op, in a window that opens after it
            assert pos[k] < pos[w.after_op] + 1 and ops[k].start_s + ops[k].time_s <= w.start_s + 1e-9
            assert (plan.ops[k].strategy == "d-intra") == (w.kind in ("tp", "ep"))
    for a in plan.agc_segments:
        assert plan.window(a.window).kind == "pp"
        assert all(not ops[k].dynamic for k in a.ops + a.forward_ops + a.bw_ops)
        assert a.gain_s > 0 and a.memory_bytes <= a.headroom_bytes and a.occupancy_s <= a.slack_s + 1e-12


def test_moe_dynamic_ops_go_to_the_dynamic_planner_only_with_phase_3():
    profile = synthetic_profile(moe=True, blocks=2, microbatches=2, ac="none")
    dyn = [o.id for o in profile.ops if o.dynamic]
    assert dyn
    p12 = plan_static(profile, PlannerConfig(phases=(1, 2)))
    p123 = plan_static(profile, PlannerConfig(phases=(1, 2, 3)))
    assert {p12.ops[k].strategy for k in dyn} == {"naive"}
    assert {p123.ops[k].strategy for k in dyn} == {"dynamic"}
    assert p123.summary["checker_dynamic_s"] == pytest.approx(sum(profile.op(k).time_s for k in dyn))
    # headroom from the profiled maximum: the planned curve never dips below the peak
    assert min(b for _, b in p123.memory_curve) >= profile.peak_bytes
    assert 0 <= p123.summary["dynamic_budget_bytes"] <= p123.memory_budget_bytes - profile.peak_bytes


def test_strict_improvement_when_every_phase_has_room():
    profile = synthetic_profile(ac="selective", blocks=3, microbatches=4, stages=3, stage=1, headroom=3.0)
    crit = [plan_static(profile, PlannerConfig(phases=ph)).summary["checker_critical_s"] for ph in ((1,), (1, 2), (1, 2, 3))]
    assert crit[0] > crit[1] > crit[2]


def test_baselines():
    profile = synthetic_profile(blocks=2, microbatches=2)
    naive = naive_only(profile)
    assert {p.strategy for p in naive.ops.values()} == {"naive", "comm"}
    assert naive.summary["checker_critical_s"] == pytest.approx(sum(o.time_s for o in profile.ops if o.kind != "C"))
    assert coverage_report(naive, profile).fraction == 1.0
    none = no_dmr(profile)
    assert none.summary["coverage"] == 0 and none.summary["checker_critical_s"] == 0
    with pytest.raises(CoverageError, match="no checking strategy"):
        coverage_report(none, profile)
    assert coverage_report(none, profile, require_full=False).fraction == 0


def test_coverage_report_fails_loudly():
    profile = fig10_profile()
    good = plan_static(profile)
    assert [(r.op, r.strategy, r.window) for r in coverage_report(good, profile).rows][:2] == [
        ("A", "d-intra", "W2"), ("B", "d-intra", "W1")]

    def tampered(fn):
        plan = Plan.from_json(json.loads(json.dumps(good.to_json())))
        fn(plan)
        return plan

    def none(p):
        p.ops["C"].strategy = "none"

    def two(p):
        p.window("W1").ops.append("C")  # C is naive and now also deferred

    def twice(p):
        p.window("W2").ops.append("B")  # B deferred into two windows

    def unlisted(p):
        p.ops["E"].strategy, p.ops["E"].window = "d-intra", "W1"  # claims a window that does not list it

    def wrong_kind(p):
        p.ops["B"].strategy = "d-inter"
        p.window("W1").kind = "tp"

    for fn, msg in ((none, "no checking strategy"), (two, "two strategies"), (twice, "two strategies"),
                    (unlisted, "two strategies"), (wrong_kind, "two strategies")):
        with pytest.raises(CoverageError, match=msg):
            coverage_report(tampered(fn), profile)
    missing = tampered(lambda p: p.ops.pop("F"))
    with pytest.raises(CoverageError, match="have no strategy"):
        coverage_report(missing, profile)


def test_plan_json_round_trip(tmp_path):
    profile = synthetic_profile(stages=2, stage=0, microbatches=3, headroom=1.5)
    plan = plan_static(profile)
    path = plan.save(tmp_path / "sub" / "plan.json")
    back = Plan.load(path)
    assert json.loads(json.dumps(back.to_json())) == json.loads(json.dumps(plan.to_json()))
    assert back.agc_segments == plan.agc_segments and back.windows == plan.windows and back.ops == plan.ops
    assert back.memory_curve == plan.memory_curve and back.summary == plan.summary
    assert coverage_report(back, profile).fraction == 1.0
    (tmp_path / "bad.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(TrainguardError, match="not a DMR plan"):
        Plan.load(tmp_path / "bad.json")
    with pytest.raises(TrainguardError, match="plan not found"):
        Plan.load(tmp_path / "nope.json")


def test_profile_checks(tmp_path):
    good = synthetic_profile(blocks=1, microbatches=1)
    path = tmp_path / "p.json"
    good.save(path)
    assert len(read_profile(path).ops) == len(good.ops)
    for mutate, msg in ((lambda d: d["ops"].append(dict(d["ops"][0])), "duplicate op id"),
                        (lambda d: d["ops"][0].update(kind="Z"), "unknown kind"),
                        (lambda d: d["ops"][0].update(time_s=-1), "time_s must be"),
                        (lambda d: d["windows"][0].update(kind="nvlink"), "unknown kind"),
                        (lambda d: d["ops"][0].update(colour="red"), "does not match the profile schema"),
                        (lambda d: d.update(ops=[]), "no ops")):
        d = good.to_json()
        mutate(d)
        path.write_text(json.dumps(d))
        with pytest.raises(TrainguardError, match=msg):
            read_profile(path)
    with pytest.raises(ConfigError, match="memory budget"):
        plan_static(good, PlannerConfig(memory_budget_bytes=-5))


def test_parse_phases():
    assert parse_phases("1") == (1,) and parse_phases("1,2") == (1, 2) and parse_phases([1, 2, 3]) == (1, 2, 3)
    for bad in ("2", "1,3", "1,2,3,4", "x", ""):
        with pytest.raises(ConfigError):
            parse_phases(bad)


def test_profiles_without_windows_or_blocks_plan_to_naive_and_pdmr():
    q = Builder()
    q.op("a", ac_segment="s", seg_index=0)
    q.op("b", ac_segment="s", seg_index=1, seg_last=True)
    q.op("c", phase="optimizer", kind="O")
    plan = plan_static(q.profile(budget=0, base=0))
    assert [p.strategy for p in plan.ops.values()] == ["p-dmr", "p-dmr", "naive"]


@pytest.mark.parametrize("times, cap, best", [([2, 3], 3, 3), ([2, 3, 4], 5, 5), ([0.1] * 8 + [0.35], 0.8, 0.8),
                                              ([0.1] * 7 + [0.35], 0.8, 0.75), ([3.0, 2.9], 2.95, 2.9),
                                              ([1e-9, 5, 6], 5.5, 5 + 1e-9), ([], 1, 0)])
def test_best_fit(times, cap, best):
    picked = best_fit(times, cap)
    total = sum(times[i] for i in picked)
    assert total <= cap * (1 + 1e-12)
    assert total == pytest.approx(best, abs=cap / 2048)
    assert best_fit([0.0, 5.0], 1.0) == [0]


def _two_windows(**meta) -> Profile:
    """Forward ops F0 (1 s) and F1 (2 s), a 4 s pp window W1, backward op B0 (1 s), a 10 s pp window W2; every
    op writes 100 bytes; no AC segment (every op is Phase 3's); memory is no constraint."""
    q = Builder()
    q.op("F0", time=1.0, out_bytes=100)
    q.op("F1", time=2.0, out_bytes=100)
    q.window("W1", "pp", 4.0)
    q.op("B0", phase="backward", kind="B", time=1.0, out_bytes=100)
    q.window("W2", "pp", 10.0)
    return q.profile(budget=10**9, base=0, meta=meta)


def test_a_window_check_is_charged_with_the_fingerprints_it_needs():
    # at op times alone, both forward checks fit the first window
    plain = plan_static(_two_windows(), PlannerConfig(keep_outputs=False))
    assert plain.window("W1").ops == ["F0", "F1"] and plain.window("W1").settle_s == 0
    # a fingerprint costs 0.5 s + 1 ms a byte = 0.6 s here; a check costs its op, the fingerprint of its checker's
    # output and that of the primary's (F0 2.2 s, F1 3.2 s, B0 2.2 s): only F1 fits W1's 4 s
    plan = plan_static(_two_windows(fingerprint_call_s=0.5, fingerprint_s_per_byte=1e-3),
                       PlannerConfig(keep_outputs=False))
    w1, w2 = plan.window("W1"), plan.window("W2")
    assert w1.ops == ["F1"] and w1.ops_s == pytest.approx(3.2) and w1.settle_s == 0  # (no P-DMR op)
    assert sorted(w2.ops) == ["B0", "F0"] and w2.ops_s == pytest.approx(4.4)
    assert coverage_report(plan, _two_windows()).fraction == 1.0
    # outputs kept whole (no fingerprint of the primary): a check compares its output once (F0 1.6 s, F1 2.6 s)
    kept = plan_static(_two_windows(fingerprint_call_s=0.5, fingerprint_s_per_byte=1e-3), PlannerConfig(keep_outputs=True))
    assert kept.window("W1").ops == ["F1"] and kept.window("W1").used_s == pytest.approx(2.6)


def test_p_dmr_outputs_are_fingerprinted_in_the_next_window():
    profile = synthetic_profile(stages=2, stage=1, microbatches=4, headroom=1.5)
    profile.meta = {"fingerprint_call_s": 1e-3, "fingerprint_s_per_byte": 1e-9}
    plan = plan_static(profile, PlannerConfig(keep_outputs=False))
    pos = {o.id: i for i, o in enumerate(profile.ops)}
    fp = {o.id: 1e-3 + 1e-9 * o.out_bytes if o.out_bytes else 0.0 for o in profile.ops}
    prev, charged = -1, 0
    at = {w.id: pos.get(w.after_op, -1) for w in plan.windows}  # (a stage's first wait opens before any op)
    for w in sorted(plan.windows, key=lambda w: (at[w.id], w.start_s)):
        # the P-DMR ops (forward and recompute) between the previous window and this one
        here = [k for k, p in plan.ops.items() if p.strategy == "p-dmr" and prev < pos[k] <= at[w.id]]
        assert w.settle_s == pytest.approx(sum(fp[k] for k in here))
        assert w.used_s <= w.duration_s * (1 + 1e-9)
        prev, charged = at[w.id], charged + len(here)
    assert charged > 0
    assert all(w.settle_s == 0 for w in plan_static(profile, PlannerConfig(keep_outputs=True)).windows)


def test_window_fill_leaves_that_share_of_each_window_free():
    full = plan_static(_two_windows(), PlannerConfig(window_fill=1.0))
    assert full.window("W1").used_s == pytest.approx(3.0)
    half = plan_static(_two_windows(), PlannerConfig(window_fill=0.5))
    w1, w2 = half.window("W1"), half.window("W2")
    assert w1.used_s <= 0.5 * w1.duration_s + 1e-9 and w1.ops == ["F1"]  # the best fit of 2 s
    assert sorted(w2.ops) == ["B0", "F0"] and w2.used_s <= 0.5 * w2.duration_s + 1e-9
    # the AGC slack shrinks with it: no segment occupies more than its share of the filled part of a window
    profile = synthetic_profile(stages=2, stage=1, microbatches=4, headroom=1.5)
    for fill in (1.0, 0.6, 0.3):
        plan = plan_static(profile, PlannerConfig(window_fill=fill))
        for w in plan.windows:
            assert w.used_s <= fill * w.duration_s * (1 + 1e-9) + 1e-12
        assert coverage_report(plan, profile).fraction == 1.0
    for bad in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ConfigError, match="window_fill must be in"):
            plan_static(profile, PlannerConfig(window_fill=bad))
        with pytest.raises(ConfigError, match="sdc.dmr.window_fill must be (in|a finite number)"):  # the trainer's config, as parsed
            load_config(None, ["--sdc.dmr.window_fill", str(bad)])


def test_fingerprint_costs_in_a_profile_are_checked(tmp_path):
    path = tmp_path / "p.json"
    for bad in (-1.0, float("nan"), "fast", True):
        d = _two_windows().to_json()
        d["meta"] = {"fingerprint_s_per_byte": bad}
        path.write_text(json.dumps(d))
        with pytest.raises(TrainguardError, match="meta.fingerprint_s_per_byte must be a finite number"):
            read_profile(path)


def _no_window_after_backward() -> Profile:
    """F0 (1 s), a 4 s pp window, then backward ops B1-B4 (3, 2, 1, 0.5 s) with no window after them, and the
    update (0.5 s)."""
    q = Builder()
    q.op("F0", time=1.0, out_bytes=100)
    q.window("W1", "pp", 4.0)
    for k, t in (("B1", 3.0), ("B2", 2.0), ("B3", 1.0), ("B4", 0.5)):
        q.op(k, phase="backward", kind="B", time=t, out_bytes=100)
    q.op("O", phase="optimizer", kind="O", time=0.5, out_bytes=100)
    return q.profile(budget=10**9, base=0)


@pytest.mark.parametrize("phases", [(1,), (1, 2)])
@pytest.mark.parametrize("carry", ["unbounded", "windows"])
def test_the_ablation_without_phase_3_carries_nothing_past_the_update(phases, carry):
    """Carrying defers checks into the next iteration's windows: Phase 3's work. Phase 1 (and 1+2) check the naive
    backward ops at once, whatever ``carry`` says; the full plan carries them (room for all: 4 s of window)."""
    profile = _no_window_after_backward()
    plan = plan_static(profile, PlannerConfig(phases=phases, window_fill=1.0, carry=carry))
    assert not [k for k, o in plan.ops.items() if o.window == "carry"]
    assert plan.carry_budget_s == 0 and not plan.carry_lists and plan.summary["carry_ops"] == 0
    assert not any(plan.may_carry(plan.ops[k]) for k in ("B1", "B2", "B3", "B4"))
    assert coverage_report(plan, profile).fraction == 1.0
    full = plan_static(profile, PlannerConfig(phases=(1, 2, 3), window_fill=1.0, carry=carry))
    assert [k for k, o in full.ops.items() if o.window == "carry"]  # (what the ablation takes away)


def test_the_plan_carries_past_the_update_every_naive_backward_op_or_what_the_windows_have_room_for():
    profile = _no_window_after_backward()
    # the default (unbounded): every naive backward op (what the windows do not hold is checked in the next
    # iteration's drain); the room is still reported
    every = plan_static(profile, PlannerConfig(window_fill=1.0))
    assert every.window("W1").ops == ["F0"]  # (the backward ops have no window after them: naive)
    assert sorted(k for k, o in every.ops.items() if o.window == "carry") == ["B1", "B2", "B3", "B4"]
    assert every.carry_budget_s == pytest.approx(2.5) and every.summary["carry_s"] == pytest.approx(6.5)
    # windows: room 4 - 1 (F0's check) - 0.5 (the held update's check) = 2.5 s; the largest that fit first: B2, B4
    plan = plan_static(profile, PlannerConfig(window_fill=1.0, carry="windows"))
    assert plan.carry_budget_s == pytest.approx(2.5)
    carried = sorted(k for k, o in plan.ops.items() if o.window == "carry")
    assert carried == ["B2", "B4"] and all(plan.ops[k].strategy == "naive" for k in carried)
    assert [plan.may_carry(plan.ops[k]) for k in ("B1", "B2", "B3", "B4")] == [False, True, False, True]
    assert plan.summary["carry_ops"] == 2 and plan.summary["carry_s"] == pytest.approx(2.5)
    assert coverage_report(plan, profile).fraction == 1.0
    # a window filled to 80%: 3.2 - 1 - 0.5 = 1.7 s, so B2 no longer fits: B3 (1 s) and B4
    assert sorted(k for k, o in plan_static(profile, PlannerConfig(window_fill=0.8, carry="windows")).ops.items()
                  if o.window == "carry") == ["B3", "B4"]
    # the budget survives the plan file; a plan from before it (no carry_budget_s) may carry every naive op
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again.carry_budget_s == pytest.approx(2.5) and not again.may_carry(again.ops["B1"])
    old = plan.to_json()
    del old["carry_budget_s"]
    assert Plan.from_json(old).may_carry(plan.ops["B1"])
    assert every.carry_lists and not plan.carry_lists and again.carry_lists is False
    del old["carry_lists"]
    assert Plan.from_json(old).carry_lists  # (a plan from before it: the list ops were carried)
    with pytest.raises(ConfigError, match="carry must be unbounded or windows, got 'some'"):
        plan_static(profile, PlannerConfig(carry="some"))
    with pytest.raises(ConfigError, match="carry_budget"):
        load_config(None, ["--sdc.dmr.carry_budget", "some"])
