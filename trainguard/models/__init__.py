"""Models: trainguard's LLaMA-style decoder (dense and MoE) and HF ``transformers`` adapters."""

from __future__ import annotations

import torch

from trainguard.models.config import PRESETS, ModelConfig, model_config, preset_names
from trainguard.models.llama import Attention, LlamaModel, lm_loss
from trainguard.models.moe import MoEFeedForward


def build_model(preset: str | ModelConfig = "llama-tiny", seed: int | None = 0, **overrides) -> LlamaModel:
    """Build a model from a preset name (or a ModelConfig) with any field overridden.

    With ``seed`` set, initialisation is deterministic and does not disturb the global RNG.
    """
    cfg = preset.replace(**overrides) if isinstance(preset, ModelConfig) else model_config(preset, **overrides)
    if seed is None:
        return LlamaModel(cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaModel(cfg)


__all__ = [
    "PRESETS",
    "Attention",
    "LlamaModel",
    "MoEFeedForward",
    "ModelConfig",
    "build_model",
    "lm_loss",
    "model_config",
    "preset_names",
]
