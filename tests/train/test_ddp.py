"""Data parallel: `trainguard train` with distributed.dp=2 re-launches under torchrun (gloo, 2 CPU
processes); its result matches one process training on the same global batch. With DMR on, every op of each
replica is checked and a fault on either replica (or both) re-executes the step on both, bitwise."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import BASE, tiny_cfg
from test_pipeline import assert_bitwise, run_dist

from trainguard.train import Trainer
from trainguard.train.checkpoint import CheckpointManager, load_checkpoint

pytestmark = pytest.mark.slow


def test_two_process_dp_matches_single_process(tmp_path, batches):
    steps = 3
    ck = tmp_path / "ck"
    args = BASE + ["--train.steps", str(steps), "--distributed.dp", "2", "--checkpoint.dir", str(ck), "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, "-m", "trainguard", "train", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["world_size"] == 2 and summary["steps_run"] == steps

    single = Trainer(tiny_cfg("--train.steps", str(steps)), batches=batches)
    losses = [single.train_step().loss for _ in range(steps)]
    assert abs(summary["final_loss"] - losses[-1]) < 1e-4
    assert abs(summary["first_loss"] - losses[0]) < 1e-5

    dp = Trainer(tiny_cfg("--train.steps", str(steps)), batches=batches)
    manifest = load_checkpoint(CheckpointManager(ck).latest(), dp.model, dp.optimizer, dp.scheduler)
    assert manifest["step"] == steps and manifest["trainer_state"]["world"] == 2
    a, b = dp.state_dict_for_compare(), single.state_dict_for_compare()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=2e-5, msg=k)


# DMR with data parallel: each replica verifies its own ops (no pipeline window: P-DMR in the recompute, the rest at
# once), and a mismatch on any replica re-executes the step on both, so the replicas stay bitwise equal to a clean run
DP_DMR = ["--distributed.dp", "2", "--train.activation_checkpoint", "full"]
MOE = ["--model.preset", "llama-moe-tiny", "--model.dim", "32", "--model.n_layers", "2", "--model.ffn_hidden", "32"]
ON = ["--sdc.dmr.enabled", "true", "--sdc.dmr.coverage", "true"]


@pytest.fixture(scope="module")
def clean_dp(tmp_path_factory):
    return run_dist(tmp_path_factory.mktemp("dp"), "clean", 2, "clean", *DP_DMR)


@pytest.fixture(scope="module")
def clean_dp_moe(tmp_path_factory):
    return run_dist(tmp_path_factory.mktemp("dpmoe"), "clean", 2, "clean", *DP_DMR, *MOE, "--sdc.abft.enabled", "true")


@pytest.mark.parametrize("mode, attempts", [
    ("dmr:1:2:forward", [1, 1, 2, 1]),  # one replica's fault: both replicas re-execute step 2
    ("dmr:0:2:backward", [1, 1, 2, 1]),
    ("dmr:1:1:optimizer", [1, 1, 1, 1]),  # repaired in the update stage (a third execution), no re-execution
])
def test_dmr_with_two_replicas_covers_every_op_and_re_executes_both_bitwise(tmp_path, clean_dp, mode, attempts):
    got = run_dist(tmp_path, "dmr", 2, mode, *DP_DMR, *ON)
    rank = int(mode.split(":")[1])
    assert got[rank]["fired"] and got[rank]["dmr"]["detected"] >= 1 and not got[1 - rank]["dmr"].get("detected")
    assert [[s["attempts"] for s in r["steps"]] for r in got] == [attempts, attempts]
    assert all(r["dmr_coverage"] == 1.0 for r in got)
    assert_bitwise(got, clean_dp)


def test_dmr_moe_with_abft_and_two_replicas_faulty_at_once_end_bitwise(tmp_path, clean_dp_moe):
    # a recompute fault on one replica and a backward fault on the other, in the same step
    got = run_dist(tmp_path, "dmr", 2, "dmrmany:2:recompute,backward", *DP_DMR, *MOE, "--sdc.abft.enabled", "true", *ON)
    assert all(r["fired"] and r["dmr"]["detected"] >= 1 for r in got)
    assert [[s["attempts"] for s in r["steps"]] for r in got] == [[1, 1, 2, 1]] * 2
    assert all(r["dmr_coverage"] == 1.0 for r in got)
    assert all(r["abft"]["false_alarms"] == 0 for r in got)
    assert_bitwise(got, clean_dp_moe)
