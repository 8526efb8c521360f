"""Where a run goes: ``auto`` (CUDA when present, else CPU), ``cpu`` or ``cuda``. Relies on torch only.

The trainer (``train.device``) and the commands with a ``--device`` flag resolve names here, so that
asking for CUDA on a machine without one is the same one-line error everywhere.
"""

from __future__ import annotations

import torch

from trainguard.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")


def device_named(want: str, local_rank: int = 0, what: str = "--device") -> torch.device:
    """The device ``want`` names; with several GPUs, ``local_rank`` picks one. ``what`` names the setting
    in errors."""
    if want not in DEVICES:
        raise ConfigError(f"unknown {what} {want!r} (choose from {', '.join(DEVICES)})")
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{what} is 'cuda' but no CUDA device is available (use cpu or auto)")
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")
