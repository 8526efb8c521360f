"""Fail-stop failure schedules: exponential or Weibull inter-arrival times for a given MTBF.

Presets follow MeCeFO's evaluation: ``low`` / ``mid`` / ``high`` = one failure per 2 h / 1 h / 0.5 h of
modelled time. The Weibull scale is chosen so that the mean inter-arrival time equals the MTBF
(scale = MTBF / Gamma(1 + 1/shape)); shape < 1 gives the bursty failures seen in large clusters.
Schedules feed a simulated cluster (``trainguard.sim``) and real runs that kill worker processes
(``kill_due``, through :mod:`trainguard.faults.failstop`). Relies on numpy (seeded ``Generator``) and the
standard library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from trainguard.errors import TrainguardError
from trainguard.faults.failstop import kill_pid

PRESETS_MTBF_HOURS = {"low": 2.0, "mid": 1.0, "high": 0.5}


@dataclass
class FailureSchedule:
    kind: str = "exponential"  # exponential | weibull
    mtbf_hours: float = 1.0  # mean time between failures of the whole job
    shape: float = 0.7  # Weibull shape (ignored for exponential)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("exponential", "weibull"):
            raise TrainguardError(f"failure schedule kind must be exponential or weibull, got {self.kind!r}")
        if not self.mtbf_hours > 0:
            raise TrainguardError(f"MTBF must be > 0 hours, got {self.mtbf_hours}")
        if self.kind == "weibull" and not self.shape > 0:
            raise TrainguardError(f"Weibull shape must be > 0, got {self.shape}")

    @classmethod
    def preset(cls, name: str, kind: str = "exponential", seed: int = 0, shape: float = 0.7) -> FailureSchedule:
        if name not in PRESETS_MTBF_HOURS:
            raise TrainguardError(f"unknown failure preset {name!r} (choose from {', '.join(PRESETS_MTBF_HOURS)})")
        return cls(kind, PRESETS_MTBF_HOURS[name], shape, seed)

    def intervals(self, n: int) -> np.ndarray:
        """``n`` inter-arrival times in hours."""
        rng = np.random.default_rng(self.seed)
        if self.kind == "exponential":
            return rng.exponential(self.mtbf_hours, n)
        scale = self.mtbf_hours / math.gamma(1.0 + 1.0 / self.shape)
        return scale * rng.weibull(self.shape, n)

    def times(self, horizon_hours: float) -> np.ndarray:
        """Failure times (hours) in [0, horizon)."""
        out: list[float] = []
        chunk = max(16, int(2 * horizon_hours / self.mtbf_hours) + 16)
        t, k = 0.0, 0
        while True:
            for dt in FailureSchedule(self.kind, self.mtbf_hours, self.shape, self.seed + k).intervals(chunk):
                t += float(dt)
                if t >= horizon_hours:
                    return np.asarray(out)
                out.append(t)
            k += 1_000_003

    def events(self, n_nodes: int, horizon_hours: float) -> list[tuple[float, int]]:
        """(time_h, node) pairs: each failure hits a uniformly random node."""
        times = self.times(horizon_hours)
        nodes = np.random.default_rng(self.seed + 7).integers(0, n_nodes, len(times))
        return [(float(t), int(n)) for t, n in zip(times, nodes)]

    def to_steps(self, n_nodes: int, horizon_hours: float, step_time_s: float) -> dict[int, list[int]]:
        """Failures mapped to training steps: {step: [node, ...]} with ``step = floor(t / step_time)``."""
        out: dict[int, list[int]] = {}
        for t, node in self.events(n_nodes, horizon_hours):
            out.setdefault(int(t * 3600.0 / step_time_s), []).append(node)
        return out


def kill_due(step: int, schedule_steps: dict[int, list[int]], pids_by_node: dict[int, int]) -> list[int]:
    """SIGKILL the worker processes scheduled to fail at ``step``; returns the nodes killed."""
    killed = []
    for node in schedule_steps.get(step, []):
        pid = pids_by_node.get(node)
        if pid is not None and kill_pid(pid):
            killed.append(node)
    return killed
