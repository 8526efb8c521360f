"""Determinism reports: how far two clean executions of each op drift apart on this device, and the
per-op tolerances the ``tolerance`` comparison mode derives from them.

On CPU every op is bitwise reproducible and the report is all zeros (bitwise comparison everywhere). On
CUDA, kernels with atomics (``index_add``, embedding backward, some reductions) can differ in low bits
between runs: :func:`record` runs a few clean steps with the engine measuring instead of flagging, and
:func:`load_tolerances` turns the largest relative gap of each op name into its tolerance
(``safety`` x gap; ops that never drifted stay bitwise). An op whose executions disagree in shape or in
integer outputs cannot be verified by DMR at all: the report says so and loading it is refused.
Relies on the standard library and the DMR engine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from trainguard.errors import ConfigError

FORMAT = "trainguard-dmr-determinism-1"


def record(trainer, engine, steps: int = 2) -> dict[str, Any]:
    """Run ``steps`` clean steps of ``trainer`` with ``engine`` (naive DMR, float fingerprints) measuring the
    gap between every op's two executions. The steps are committed (they are ordinary training steps)."""
    system, compare = engine.cfg.system, engine.cfg.compare
    engine.set_system("naive")
    engine.cfg.compare = "tolerance"
    engine.calibration = {}
    try:
        for _ in range(steps):
            trainer.train_step()
        gaps = dict(sorted(engine.calibration.items()))
    finally:
        engine.calibration = None
        engine.cfg.compare = compare
        engine.set_system(system)
    return {"format": FORMAT, "device": str(trainer.device), "steps": steps,
            "ops": {k: (v if math.isfinite(v) else "inf") for k, v in gaps.items()},
            "nondeterministic_ops": sorted(k for k, v in gaps.items() if v > 0)}


def save(report: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=1))


def load_tolerances(path: str | Path, safety: float) -> dict[str, float]:
    """Per-op relative tolerances from a report (ops with gap 0 are not listed: they stay bitwise)."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"sdc.dmr.determinism_report: cannot read {path}: {err}") from None
    if not isinstance(report, dict) or report.get("format") != FORMAT:
        raise ConfigError(f"sdc.dmr.determinism_report: {path} is not a determinism report ({FORMAT})")
    unverifiable = [k for k, v in report.get("ops", {}).items() if v == "inf"]
    if unverifiable:
        raise ConfigError(f"sdc.dmr.determinism_report: ops whose two executions differ in shape or integer "
                          f"outputs cannot be verified by DMR: {', '.join(unverifiable[:5])}")
    return {k: safety * float(v) for k, v in report.get("ops", {}).items() if float(v) > 0}
