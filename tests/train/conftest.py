"""Shared helpers for the training tests: tiny configs and one small corpus per test module."""

import pytest
import torch

from trainguard.config import load_config
from trainguard.data import PackedBatches

# One intra-op thread: the suite runs under `pytest -n 2` on 2 cores, and OpenMP threads competing for
# busy cores make each step up to 10x slower.
torch.set_num_threads(1)

BASE = [
    "--data.max_bytes", "1000000", "--data.seq_len", "32", "--data.batch_size", "8",
    "--train.steps", "10", "--train.eval_every", "0", "--train.log_every", "5",
    "--output.metrics", "false", "--output.progress", "false", "--output.dir", "",
]


def tiny_cfg(*overrides: str):
    """llama-tiny on 1 MB of stdlib, seq 32, batch 8; overrides as '--section.key', 'value' pairs."""
    return load_config(None, BASE + list(overrides))


@pytest.fixture(scope="module")
def batches():
    return PackedBatches.from_config(tiny_cfg().data)
