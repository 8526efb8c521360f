"""Switch SDC protections on for a Trainer from the run config's ``[sdc]`` section.

``attach_from_config(trainer)`` is what ``trainguard train`` calls (via ``run_training(setup=...)``):
with ``[sdc] abft = true`` it protects the model's attention with ABFT (``trainguard.sdc.abft``),
registers the handle as a step callback (so ``abft_frequencies`` are applied by step) and exposes the
per-section counters as metrics (``abft_AS_detected``, ...). Lives in the sdc layer because the trainer
sits below it and must not import techniques.
"""

from __future__ import annotations

from typing import Any


def attach_from_config(trainer) -> dict[str, Any]:
    """Apply ``trainer.cfg.sdc``; returns the handles it created (``{"abft": handle}`` or ``{}``)."""
    sdc = trainer.cfg.sdc
    handles: dict[str, Any] = {}
    if sdc.abft:
        from trainguard.sdc.abft import ABFTConfig, protect

        handle = protect(trainer.model, ABFTConfig(frequencies=tuple(sdc.abft_frequencies), backward=sdc.abft_backward))
        trainer.callbacks.append(handle)
        trainer.metric_sources.append(lambda: abft_metrics(handle))
        handles["abft"] = handle
    return handles


def abft_metrics(handle) -> dict[str, int]:
    return {f"abft_{section}_{kind}": n for section, counts in handle.counters.items() for kind, n in counts.items()}
