"""The run configuration of the ``trainguard`` command: the trainer's sections plus those of the
techniques above it, loaded from TOML and ``--section.key value`` overrides and validated before any work.

``RunConfig`` is ``trainguard.train.config.TrainerConfig`` (``[model] [data] [train] [checkpoint]
[distributed] [output]``) plus ``[sdc]`` (``trainguard.sdc.runtime.SDCConfig``: ``[sdc.abft]`` is
``ABFTConfig``). Each section belongs to its component; this module only composes them, which is why it
sits above every layer but the CLI. Loading, type checks from real type hints and one-line errors:
:mod:`trainguard.utils.settings`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.sdc.runtime import SDCConfig
from trainguard.train.config import CheckpointConfig, DistributedConfig, OutputConfig, TrainConfig, TrainerConfig
from trainguard.utils.settings import describe, load_settings, override_pairs, set_path

# Kept for code that named the sections by their old names.
TrainSection, CheckpointSection, DistributedSection, OutputSection = (TrainConfig, CheckpointConfig,
                                                                      DistributedConfig, OutputConfig)


@dataclass
class RunConfig(TrainerConfig):
    sdc: SDCConfig = field(default_factory=SDCConfig)


def load_config(path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None) -> RunConfig:
    """A validated ``RunConfig`` from an optional TOML file and overrides (list of ``--a.b value`` or a dict)."""
    return load_settings(RunConfig, path, overrides)


def apply_override(cfg: RunConfig, dotted: str, value: Any) -> None:
    """Set ``section.key`` (text values are parsed by the field's type). Call ``cfg.validate()`` after."""
    set_path(cfg, dotted, value, from_text=isinstance(value, str))


def config_help() -> list[tuple[str, str, str, str]]:
    """(key, type, default, help) of every setting, for ``trainguard train --help``."""
    return describe(RunConfig)


__all__ = ["RunConfig", "apply_override", "config_help", "load_config", "override_pairs"]
