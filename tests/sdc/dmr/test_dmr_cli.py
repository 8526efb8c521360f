"""``trainguard plan dmr``: --json output, the written plan and figure, and one-line errors for bad input."""

import argparse
import importlib.util
import json

import pytest
from _dmr_profiles import fig7_profile, synthetic_profile

from trainguard.cli.main import main
from trainguard.sdc.dmr.plan import Plan, coverage_report


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("dmr") / "profile.json"
    synthetic_profile(stages=2, stage=1, microbatches=3, headroom=1.5).save(path)
    return path


def _run(capsys, *argv):
    try:
        rc = main(["plan", "dmr", *argv])
    except SystemExit as e:  # argparse's own errors (a flag's type) end the process: one line, code 2
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_json_plan_and_figure(tmp_path, capsys, profile_path):
    rc, out, err = _run(capsys, "--profile", str(profile_path), "--out", str(tmp_path / "plan.json"),
                        "--figure", str(tmp_path / "timeline.png"), "--json")
    assert rc == 0
    d = json.loads(out.strip().splitlines()[-1])
    s = d["summary"]
    assert s["coverage"] == 1.0 and d["phases"] == [1, 2, 3]
    assert s["checker_critical_s"] < d["baselines"]["naive-only"]["checker_critical_s"]
    assert d["baselines"]["no-dmr"]["coverage"] == 0
    assert s["peak_with_deferral_bytes"] <= s["memory_budget_bytes"]
    plan = Plan.load(d["plan"])
    from trainguard.sdc.dmr.planner import read_profile

    assert coverage_report(plan, read_profile(profile_path)).fraction == 1.0
    assert open(d["figure"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert "trainguard plan dmr" in err  # the table goes to stderr with --json


def test_phases_and_budget_flags(capsys, profile_path):
    crit, carried = [], []
    for phases in ("1", "1,2", "1,2,3"):
        rc, out, _ = _run(capsys, "--profile", str(profile_path), "--phases", phases, "--out", "", "--figure", "", "--json")
        assert rc == 0
        d = json.loads(out.strip().splitlines()[-1])
        assert d["plan"] is None and d["figure"] is None
        crit.append(d["summary"]["checker_critical_s"])
        carried.append((d["summary"]["carry_ops"] > 0, d["summary"]["carry_lists"]))
    assert crit[0] >= crit[1] >= crit[2] and crit[0] > crit[2]
    assert carried == [(False, False), (False, False), (True, True)]  # (carrying is Phase 3's deferral)
    rc, out, _ = _run(capsys, "--profile", str(profile_path), "--memory-budget", "0", "--out", "", "--figure", "", "--json")
    s = json.loads(out.strip().splitlines()[-1])["summary"]
    assert rc == 0 and s["memory_budget_bytes"] == 0 and s["checker_hidden_s"] == 0
    rc, out, _ = _run(capsys, "--profile", str(profile_path), "--memory-budget", "1GiB", "--out", "", "--figure", "", "--json")
    assert json.loads(out.strip().splitlines()[-1])["summary"]["memory_budget_bytes"] == 2**30


def test_pdmr_tail_flag(tmp_path, capsys):
    """Fig. 7's segment (B_c = 1): the paper's extra run of B costs B + B_c on the critical path; the default checks B
    where it ran (naive with Phase 1 alone) and repeats no communication."""
    path = tmp_path / "fig7.json"
    fig7_profile(comm=1.0).save(path)
    got = {}
    for tail in ("recompute", "defer"):
        rc, out, _ = _run(capsys, "--profile", str(path), "--phases", "1", "--pdmr-tail", tail, "--out", "",
                          "--figure", "", "--json")
        assert rc == 0
        got[tail] = json.loads(out.strip().splitlines()[-1])["summary"]
    assert got["recompute"]["pdmr_extra_runs_s"] == 2.0 and got["defer"]["pdmr_extra_runs_s"] == 0
    assert got["defer"]["checker_critical_s"] == got["recompute"]["checker_critical_s"] - 1.0  # B_c saved
    with pytest.raises(SystemExit) as bad:  # (argparse's choices: one line naming the flag, exit 2)
        main(["plan", "dmr", "--profile", str(path), "--pdmr-tail", "sometimes"])
    assert bad.value.code == 2 and "--pdmr-tail" in capsys.readouterr().err


def test_dp_windows_flag(tmp_path, capsys, profile_path):
    """The synthetic stage ends its iteration with a dp window (its gradient all-reduce over the replicas, 2 s):
    planned into with --dp-windows, within the share of it the planner fills, and left alone by default
    ([sdc.dmr] dp_windows = false, the paper's windows only)."""
    got = {}
    for flag in ("--dp-windows", "--no-dp-windows", None):
        rc, out, _ = _run(capsys, "--profile", str(profile_path), *([flag] if flag else []),
                          "--out", str(tmp_path / f"{flag}.json"), "--figure", "", "--json")
        assert rc == 0
        got[flag] = Plan.load(json.loads(out.strip().splitlines()[-1])["plan"])
    in_dp = [o for o in got["--dp-windows"].ops.values() if o.window == "dp"]
    assert in_dp and all(o.strategy == "d-inter" for o in in_dp)
    assert sum(o.time_s for o in in_dp) <= 0.8 * 2.0  # (window_fill's default share of the window)
    assert not any(o.window == "dp" for o in got["--no-dp-windows"].ops.values())
    assert got[None].ops == got["--no-dp-windows"].ops


def test_human_output(capsys, profile_path):
    rc, out, _ = _run(capsys, "--profile", str(profile_path), "--out", "", "--figure", "")
    assert rc == 0 and "coverage" in out and "100.0%" in out and "strategies" in out


@pytest.mark.parametrize("argv, msg", [
    (["--profile", "{missing}"], "profile not found"),
    (["--profile", "{malformed}"], "not valid JSON"),
    (["--profile", "{wrong_schema}"], "does not match the profile schema"),
    (["--profile", "{good}", "--phases", "2"], "--phases must be 1, 1,2 or 1,2,3"),
    (["--profile", "{good}", "--phases", "1,2,3,4"], "--phases must be"),
    (["--profile", "{good}", "--memory-budget", "lots"], "--memory-budget must be"),
    (["--profile", "{good}", "--window-fill", "0"], "--window-fill must be in (0, 1]"),
    (["--profile", "{good}", "--window-fill", "1.5"], "--window-fill must be in (0, 1]"),
    (["--profile", "{good}", "--window-fill", "nan"], "--window-fill: must be a finite number"),
    (["--profile", "{good}", "--model", "llama-tiny"], "either --profile or --model"),
    (["--model", "llama-tiny", "--dp", "0"], "--pp, --dp and --steps must be >= 1"),
    (["--model", "nope"], "unknown model preset 'nope'"),  # (refused before a profiling rank starts)
    ([], "pass --profile"),
    (["--profile", "{good}", "--figure", "{good}.gif"], "--figure must end in"),
    (["--profile", "{good}", "--out", "{good}/plan.json"], "cannot write"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, profile_path, argv, msg):
    (tmp_path / "malformed.json").write_text('{"ops": [')
    (tmp_path / "wrong.json").write_text(json.dumps({"ops": [{"id": "a"}]}))
    paths = {"missing": str(tmp_path / "nope.json"), "malformed": str(tmp_path / "malformed.json"),
             "wrong_schema": str(tmp_path / "wrong.json"), "good": str(profile_path)}
    rc, out, err = _run(capsys, "--out", "", "--figure", "", *[a.format(**paths) for a in argv])
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainguard: error:") and msg in lines[0]


def _first(items, key):
    return next(x for x in items if x.get(key))


# A profile that parses but says something impossible: each was planned from as it came (a "dynamic" of "yes" read
# as true, a gradient op of no forward op) or ended in a traceback (a meta that is a list).
@pytest.mark.parametrize("edit, msg", [
    (lambda d: d.__setitem__("meta", [1]), "meta must be a JSON object, got list"),
    (lambda d: d.__setitem__("blocks", [1, 2]), "blocks must be a list of strings"),
    (lambda d: d.__setitem__("rank", "zero"), "rank must be an integer, got 'zero'"),
    (lambda d: d.__setitem__("iteration_s", True), "iteration_s must be a number, got True"),
    (lambda d: d["ops"][0].__setitem__("dynamic", "yes"), "dynamic must be true or false, got 'yes'"),
    (lambda d: d["ops"][0].__setitem__("name", 5), "name must be a string, got 5"),
    (lambda d: d["ops"][0].__setitem__("in_bytes", 1e300), "in_bytes must be an integer"),
    (lambda d: _first(d["ops"], "grad_of").__setitem__("grad_of", "nope"), "grad_of names 'nope', which is no op"),
    (lambda d: _first(d["ops"], "recompute_of").__setitem__("recompute_of", "nope"), "recompute_of names 'nope'"),
    (lambda d: d["windows"][0].__setitem__("after_op", "nope"), "after_op names 'nope', which is no op"),
    (lambda d: d["windows"][0].__setitem__("id", 7), "window with an empty or non-string id: 7"),
    (lambda d: d["windows"][0].__setitem__("dynamic", 1), "dynamic must be true or false, got 1"),
    (lambda d: d.__setitem__("memory_curve", [[0.0, -5]]), "memory curve point [0.0, -5] is not (time, bytes)"),
    (lambda d: d.__setitem__("memory_curve", [[-1.0, 5]]), "memory curve point [-1.0, 5]"),
])
def test_an_impossible_profile_is_refused_in_one_line(tmp_path, capsys, profile_path, edit, msg):
    data = json.loads(profile_path.read_text())
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    rc, out, err = _run(capsys, "--profile", str(path), "--out", "", "--figure", "")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("trainguard: error:") and msg in lines[0], err


def test_the_synthetic_profiles_are_accepted(tmp_path, capsys):
    """The check refuses nothing the fixtures (built as the profiler records) hold: dense and MoE, each AC mode."""
    from trainguard.sdc.dmr.planner import validate_profile
    for moe in (False, True):
        for ac in ("full", "selective", "none"):
            validate_profile(synthetic_profile(stages=2, stage=0, microbatches=3, moe=moe, ac=ac))


@pytest.mark.skipif(importlib.util.find_spec("trainguard.sdc.dmr.profiler") is not None,
                    reason="the DMR profiler exists: --model profiles for real")
def test_model_without_the_profiler_is_refused(capsys):
    rc, out, err = _run(capsys, "--model", "llama-tiny", "--out", "", "--figure", "")
    assert rc == 2 and "pass --profile" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, msg", [(["--switch-warmup", "-1"], "--switch-warmup and --system-warmup must be >= 0"),
                                       (["--system-warmup", "-2"], "--switch-warmup and --system-warmup must be >= 0"),
                                       (["--idle-fraction", "0.99"], "--idle-fraction must be in"),
                                       (["--systems", "fast"], "--systems: unknown fast"),
                                       (["--profile-steps", "0"], "--profile-steps must be >= 1, got 0"),
                                       # sizes the trainer refuses: refused before any rank is launched
                                       (["--microbatches", "3"], "must be divisible by dp*grad_accum*microbatches (3)"),
                                       (["--microbatches", "1"], "must be >= distributed.pp (2)"),
                                       (["--seq-len", "0"], "data.seq_len")])
def test_bench_dmr_bad_input_is_one_line_exit_2(capsys, argv, msg):
    _one_line_exit_2(capsys, ["bench", "dmr", *argv], msg)


def _one_line_exit_2(capsys, argv, msg):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and msg in err


@pytest.mark.parametrize("argv, micro, tokens", [([], 4, 256), (["--microbatches", "2"], 2, 512),
                                                 (["--seq-len", "256"], 4, 512),
                                                 (["--microbatches", "0"], 4, 256),  # (0: the trainer's twice the stages)
                                                 (["--pp", "1", "--microbatches", "2"], 1, 1024)])  # (no pipeline)
def test_bench_dmr_reports_the_tokens_each_micro_batch_carries(argv, micro, tokens):
    from trainguard.cli.commands._bench_dmr import _spec, register_bench, tokens_per_microbatch
    sub = argparse.ArgumentParser().add_subparsers()
    register_bench(sub)
    args = sub.choices["dmr"].parse_args(argv)
    spec = _spec(args)
    assert spec["microbatches"] == micro and tokens_per_microbatch(spec, args) == tokens


def test_bench_dmr_passes_profile_steps_to_its_ranks():
    from trainguard.cli.commands._bench_dmr import _spec, register_bench
    sub = argparse.ArgumentParser().add_subparsers()
    register_bench(sub)
    assert _spec(sub.choices["dmr"].parse_args([]))["profile_steps"] == 1  # (the paper's single profile)
    assert _spec(sub.choices["dmr"].parse_args(["--profile-steps", "3"]))["profile_steps"] == 3


def test_bench_dmr_refuses_an_unknown_carry_budget_in_one_line(capsys):
    with pytest.raises(SystemExit) as exc:  # (argparse's own choice check)
        main(["bench", "dmr", "--carry-budget", "all"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and "invalid choice: 'all'" in err


# ---- trainguard campaign dmr ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_campaign_dmr_on_two_replicas_with_two_faults_a_trial_detects_and_ends_bitwise(capsys):
    # two processes (the elastic launcher), each trial two faults on their own (phase, step, rank, op)
    rc = main(["campaign", "dmr", "--model", "llama-tiny", "--dp", "2", "--faults", "2", "--trials", "3", "--seed", "5",
               "--steps", "2", "--json"])
    out = capsys.readouterr()
    assert rc == 0 and out.out.strip(), out.err[-3000:]
    res = json.loads(out.out.strip().splitlines()[-1])
    assert res["dp"] == 2 and res["faults_per_trial"] == 2
    assert res["trials"] == res["detected"] == res["rollback_bitwise_equal"] == 3
    assert res["silent"] == res["false_positives"] == res["unreached"] == 0
    assert res["faults_fired"] == 6 and sum(v["trials"] for v in res["by_phase"].values()) == 6
    for r in res["results"]:  # every draw its own, and each fired where it was drawn
        draws = [tuple(d.values()) for d in r["draws"]]
        assert len(set(draws)) == 2 and len(r["faults"]) == 2
        assert sorted(f["step"] for f in r["faults"]) == sorted(d["step"] for d in r["draws"])


@pytest.mark.parametrize("argv, msg", [(["--faults", "0"], "--faults must be in [1, 16], got 0"),
                                       (["--faults", "17"], "--faults must be in [1, 16], got 17"),
                                       (["--trials", "0"], "--trials and --steps must be >= 1")])
def test_campaign_dmr_bad_input_is_one_line_exit_2(capsys, argv, msg):
    _one_line_exit_2(capsys, ["campaign", "dmr", *argv], msg)


def test_campaign_dmr_refuses_an_unknown_model_before_it_prints_or_starts_anything(capsys):
    assert main(["campaign", "dmr", "--model", "nope", "--trials", "2"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.strip().splitlines()) == 1 and "unknown model preset 'nope'" in out.err


def test_campaign_dmr_refuses_three_replicas_in_one_line(capsys):
    with pytest.raises(SystemExit) as exc:  # (argparse's own choice check)
        main(["campaign", "dmr", "--dp", "3"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and "invalid choice: 3" in err
