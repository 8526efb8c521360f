"""Data parallel: `trainguard train` with distributed.dp=2 re-launches under torchrun (gloo, 2 CPU
processes); its result matches one process training on the same global batch."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import BASE, tiny_cfg

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
