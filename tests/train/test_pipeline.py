"""A 2-stage 1F1B pipeline run matches the single-process run with the same global batch."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainguard.config import load_config
from trainguard.errors import ConfigError
from trainguard.models import build_model
from trainguard.train import Trainer
from trainguard.train.pipeline import split_model, stage_layers

OVERRIDES = ["--model.dim", "32", "--model.n_layers", "3", "--model.n_heads", "2", "--model.ffn_hidden", "64",
             "--data.seq_len", "16", "--data.batch_size", "8", "--data.max_bytes", "300000",
             "--train.steps", "3", "--train.lr", "1e-2", "--train.eval_every", "0", "--output.dir", "",
             "--output.progress", "false"]


def test_stage_split_is_balanced_and_complete():
    assert [stage_layers(5, 2, i) for i in range(2)] == [[0, 1, 2], [3, 4]]
    assert [i for s in range(3) for i in stage_layers(7, 3, s)] == list(range(7))
    with pytest.raises(ConfigError):
        stage_layers(2, 3, 0)
    m = split_model(build_model("llama-tiny"), 2, 1)
    assert m.tok_embeddings is None and m.output is not None and list(m.layers) == ["1"]


@pytest.mark.slow
def test_two_stage_pipeline_matches_single_process(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__).with_name("_pipeline_worker.py")), str(tmp_path), *OVERRIDES,
           "--distributed.pp", "2", "--distributed.microbatches", "4"]
    # A new session so a hung run is killed with its workers, not just the launcher.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("pipeline run hung (killed after 300 s)")
    assert proc.returncode == 0, err[-3000:]
    stages = [torch.load(tmp_path / f"stage{i}.pt") for i in range(2)]

    trainer = Trainer(load_config(None, OVERRIDES))
    trainer.run()
    reference = dict(trainer.model.named_parameters())
    names = set()
    for s in stages:
        for name, value in s["stage_state"].items():
            torch.testing.assert_close(value, reference[name].detach(), rtol=1e-4, atol=1e-5)
            names.add(name)
    assert names == set(reference)  # the stages together hold every parameter exactly once
    assert stages[0]["final_loss"] == stages[1]["final_loss"]  # the loss is broadcast from the last stage
