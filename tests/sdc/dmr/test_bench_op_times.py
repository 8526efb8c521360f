"""``bench dmr --op-times``: every op the dispatch mode executes in the timed steps, timed by op (thread CPU) for
SpareTrain's and Naive-Only's primary executions and the floor's ops, and nothing timed without the flag."""

from __future__ import annotations

import json

import torch

from tests.sdc.dmr.test_engine import SMALL
from trainguard.cli.main import main
from trainguard.sdc.dmr import bench
from trainguard.sdc.dmr.engine import PassThroughMode, common
from trainguard.sdc.dmr.engine.common import _primary, time_ops

MM = torch.ops.aten.mm.default


def test_ops_are_tallied_by_op_and_by_forward_or_backward_only_while_a_table_is_set():
    table: dict = {}
    x, w = torch.randn(16, 16, requires_grad=True), torch.randn(16, 16)
    time_ops(table)
    try:
        _primary(MM, (w, w), {})
        with PassThroughMode():
            (x @ w).sum().backward()
    finally:
        time_ops(None)
    assert table["aten.mm.default forward"][1] == 2  # (the primary and the mode's forward product)
    assert table["aten.mm.default in backward"][1] == 1  # (x's gradient; w needs none)
    assert all(cpu >= 0 for cpu, _ in table.values())
    n = {k: v[1] for k, v in table.items()}
    _primary(MM, (w, w), {})
    with PassThroughMode():
        x @ w
    assert {k: v[1] for k, v in table.items()} == n and common.OP_TIMES is None  # (off: nothing more counted)


def test_the_bench_reports_each_systems_ops_and_where_sparetrain_spends_more_than_naive_only(capsys):
    systems = ["none", "floor", "naive", "sparetrain"]
    spec = {"overrides": SMALL + ["--train.activation_checkpoint", "full"], "systems": systems,
            "rounds": 2, "steps": 1, "warmup": 1, "system_warmup": 0, "op_times": True}
    res = bench.run_rank(spec)
    assert common.OP_TIMES is None  # (left off after the timed steps)
    assert "op_cpu_s" not in res["systems"]["none"]  # (No-DMR runs no mode: nothing to time)
    for s in ("floor", "naive", "sparetrain"):
        ops = res["systems"][s]["op_cpu_s"]
        assert ops["aten.mm.default forward"]["calls"] > 0 and ops["aten.mm.default in backward"]["calls"] > 0
        assert res["systems"][s]["op_cpu_s_total"] == sum(v["cpu_s"] for v in ops.values())
        assert res["systems"][s]["op_cpu_s_total"] <= res["systems"][s]["main_cpu_s"] + 0.01
    out = bench.merge([res], systems)
    diffs = out["ops_slower_than_naive"][0]
    assert diffs and [d["difference_s"] for d in diffs] == sorted((d["difference_s"] for d in diffs), reverse=True)
    top = diffs[0]
    assert top["difference_s"] == top["sparetrain_s"] - top["naive_s"]
    # without the flag nothing is timed
    plain = bench.run_rank({**spec, "op_times": False, "rounds": 1, "systems": ["none", "sparetrain"]})
    assert "op_cpu_s" not in plain["systems"]["sparetrain"]
    assert "op_cpu_s_total" not in bench.merge([plain], ["none", "sparetrain"])


def test_the_command_takes_the_flag_and_prints_the_table(capsys):
    rc = main(["bench", "dmr", "--model", "llama-tiny", "--pp", "1", "--rounds", "1", "--steps", "1", "--warmup", "1",
               "--system-warmup", "0", "--systems", "none,naive,sparetrain", "--op-times", "--json"])
    cap = capsys.readouterr()
    assert rc == 0
    res = json.loads(cap.out.strip().splitlines()[-1])
    assert res["op_times"] is True and res["ops_slower_than_naive"][0]
    assert "ops slower under SpareTrain than under Naive-Only" in cap.err
