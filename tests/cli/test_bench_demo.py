"""Smoke tests of `trainguard bench train` and the demo's building blocks (tiny sizes; no timing asserts)."""

import json
import math

import torch

from trainguard.cli.main import main

torch.set_num_threads(1)


def test_bench_train_json(capsys):
    rc = main(["bench", "train", "--model", "llama-tiny", "--steps", "2", "--rounds", "2", "--warmup", "1",
               "--batch", "2", "--seq-len", "16", "--threads", "1", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["tokens_per_s"] > 0 and res["plain_pytorch_tokens_per_s"] > 0
    assert math.isclose(res["ratio_vs_plain_pytorch"], res["tokens_per_s"] / res["plain_pytorch_tokens_per_s"],
                        rel_tol=1e-2)


def test_bench_needs_a_subcommand(capsys):
    assert main(["bench"]) == 2


def test_demo_injection_ruins_an_unprotected_run():
    from trainguard.cli.commands.demo import run_demo

    res = run_demo(6, None, progress=False)
    assert res["injected_at_step"] == 3 and res["first_nan_step"] == 3 and res["steps_run"] == 4
    assert res["nonfinite_params"] == res["params"] and res["outcome"].startswith("ruined")
    clean = run_demo(6, None, inject=False, progress=False, batches=res["_batches"])
    assert clean["first_nan_step"] is None and clean["steps_run"] == 6 and clean["outcome"] == "healthy"


def test_demo_dmr_part_detects_rolls_back_and_ends_bitwise_equal():
    from trainguard.cli.commands.demo import run_dmr_demo

    res = run_dmr_demo(4, progress=False)
    assert res["injected_at_step"] is not None and res["detected"] >= 1 and res["steps_re_executed"] >= 1
    assert res["final_loss_dmr"] == res["final_loss_fault_free"] and res["parameters_bitwise_equal"]
