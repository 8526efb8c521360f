"""``bench dmr``'s ``floor`` system: every op through a Python dispatch mode that checks nothing, the bound on what
any verifier built on one costs. It must really send the step's ops through the mode, change nothing the step
computes, and be reported beside the systems it bounds."""

from __future__ import annotations

import pytest
import torch

from tests.sdc.dmr.test_engine import SMALL
from trainguard.cli.main import main
from trainguard.sdc.dmr import bench
from trainguard.sdc.dmr.config import DMRConfig
from trainguard.sdc.dmr.engine import PassThroughMode, attach
from trainguard.train import Trainer, TrainerConfig


def test_the_pass_through_mode_sees_the_ops_and_changes_no_value():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with PassThroughMode() as mode:
        got = torch.relu(a @ b).sum()
    assert mode.ops >= 3 and torch.equal(got, torch.relu(a @ b).sum())


def test_a_floor_step_goes_through_the_mode_and_trains_bitwise_as_without_it():
    cfg = TrainerConfig.load(None, SMALL + ["--train.activation_checkpoint", "full"])
    ref, t = Trainer(cfg), Trainer(cfg)
    floor = bench._Floor()
    floor.attach(t, attach(t, DMRConfig(enabled=True, system="none")))
    floor.on = True
    for _ in range(2):
        ref.train_step()
        t.train_step()
        assert floor.mode is not None and floor.mode.ops > 100  # (the forward, recompute, backward and update)
    a, b = ref.state_dict_for_compare(), t.state_dict_for_compare()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    floor.on = False
    floor.mode = None
    t.train_step()
    assert floor.mode is None  # (off: the step ran without the mode)


def test_the_bench_reports_the_floor_beside_the_systems_it_bounds():
    systems = ["none", "floor", "naive", "sparetrain"]
    res = bench.run_rank({"overrides": SMALL + ["--train.activation_checkpoint", "full"], "systems": systems,
                          "rounds": 2, "steps": 1, "warmup": 1, "system_warmup": 0})
    assert res["systems"]["floor"]["ops_through_mode"] > 100
    assert all("ops_through_mode" not in res["systems"][s] for s in systems if s != "floor")
    out = bench.merge([res], systems)
    tps = {s: res["systems"][s]["tokens_per_s"] for s in systems}
    assert out["floor_tokens_per_s"] == tps["floor"]
    assert out["floor_overhead_vs_no_dmr"] == pytest.approx(tps["none"] / tps["floor"] - 1)
    assert out["gain_ceiling_python_mode"] == pytest.approx(tps["floor"] / tps["naive"] - 1)
    assert out["gain_ceiling_free_verifier"] == pytest.approx(tps["none"] / tps["naive"] - 1)
    assert len(out["by_round"]["gain_ceiling_python_mode"]) == 2
    assert out["detected_in_clean_runs"] == 0 and out["coverage"] == 1.0
    assert len(res["host_probe_by_round"]) == 2 and out["host_probe_by_round"] == res["host_probe_by_round"]
    for s in systems:  # the main thread's own usage, beside its CPU time (Linux)
        v = res["systems"][s]
        assert 0 <= v["main_sys_s"] <= v["main_cpu_s"] + 0.01
        assert v["main_minor_faults"] >= 0 and v["main_involuntary_switches"] >= 0


def test_the_floor_is_not_run_unless_asked_for_and_a_system_named_twice_is_refused(capsys):
    assert bench.FLOOR not in bench.SYSTEMS and bench.FLOOR in bench.CHOICES
    assert main(["bench", "dmr", "--systems", "none,floor,none"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "names none twice" in err[0]
