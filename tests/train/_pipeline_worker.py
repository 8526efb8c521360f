"""Run by torchrun in tests/train/test_pipeline.py: train 2 pipeline stages, save each stage's params."""

import sys

import torch

from trainguard.config import load_config
from trainguard.train.pipeline import run_pipeline

out, *overrides = sys.argv[1:]
torch.set_num_threads(1)
cfg = load_config(None, overrides)
summary = run_pipeline(cfg, return_state=True)
torch.save(summary, f"{out}/stage{summary['stage']}.pt")
