"""Switch SDC protections on for a Trainer from the run config's ``[sdc]`` section.

``attach_from_config(trainer)`` is what ``trainguard train`` calls (via ``run_training(setup=...)``):
with ``[sdc.dmr] enabled = true`` it verifies every op by dual modular redundancy (``trainguard.sdc.dmr``);
with ``[sdc.abft] enabled = true`` (or ``[sdc] abft = true``) it protects the model's attention with ABFT (``trainguard.sdc.abft``),
registers the handle as a step callback (so the check frequencies are applied by step), adds an
:class:`~trainguard.sdc.abft.guard.ABFTGuard` as a step guard (a fault the checks cannot settle in place
makes the trainer re-execute the step from its start) and exposes the per-section counters as metrics
(``abft_AS_detected``, ...). Lives in the sdc layer because the trainer
sits below it and must not import techniques.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from trainguard.sdc.abft import ABFTConfig, protect
from trainguard.sdc.abft.guard import attach_guard
from trainguard.sdc.dmr.config import DMRConfig
from trainguard.sdc.dmr.engine import attach as attach_dmr


@dataclass
class SDCConfig:
    """The ``[sdc]`` section: one sub-section per detector (``[sdc.abft]``)."""

    abft: ABFTConfig = field(default_factory=ABFTConfig)
    dmr: DMRConfig = field(default_factory=DMRConfig)
    # the flat keys of earlier versions ([sdc] abft = true is the section's `enabled` switch)
    settings_aliases: ClassVar[dict[str, str]] = {"abft_backward": "abft.backward", "abft_frequencies": "abft.frequencies"}


def attach_from_config(trainer) -> dict[str, Any]:
    """Apply ``trainer.cfg.sdc``; returns the handles it created (``{"abft": handle}`` or ``{}``)."""
    sdc = trainer.cfg.sdc
    handles: dict[str, Any] = {}
    if sdc.abft.enabled:
        handle = protect(trainer.model, sdc.abft)
        trainer.callbacks.append(handle)
        attach_guard(trainer, handle)  # escalations -> the step is retried (before DMR's guard: cheaper verdict first)
        trainer.metric_sources.append(lambda: abft_metrics(handle))
        handles["abft"] = handle
    if sdc.dmr.enabled:  # after ABFT: DMR verifies the protected kernel's ops too
        handles["dmr"] = attach_dmr(trainer, sdc.dmr)
    return handles


def abft_metrics(handle) -> dict[str, int]:
    return {f"abft_{section}_{kind}": n for section, counts in handle.counters.items() for kind, n in counts.items()}
