"""Checkpoint-period planning: availability-optimal period (Saxena et al. 2024) and Young's period.

Relies on the standard library only.

Model (first order, exponential system failures): a period ``T`` is ``T - d`` of work then a save of ``d``;
system failures arrive with mean time ``M`` between them, each costs a global restart ``R`` plus on average
half a period of rework. The long-run availability (useful time / wall-clock) is

    A(T) = (T - d) / T  *  M / (M + R + T/2)                                   (SPARe eq. 2)

and ``dA/dT = 0`` gives ``T^2 - 2 d T - 2 d (M + R) = 0``, i.e.

    T* = d + sqrt(2 d (M + R) + d^2)                                           (SPARe eq. 1)

For ``d << R << M`` this is Young's ``sqrt(2 d M)``. All times share one unit (seconds in this package).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from trainguard.errors import TrainguardError


def _check(d: float, M: float, R: float) -> None:
    if not (d > 0 and math.isfinite(d)):
        raise TrainguardError(f"checkpoint save time must be > 0, got {d}")
    if not (M > 0):
        raise TrainguardError(f"mean time between failures must be > 0, got {M}")
    if R < 0:
        raise TrainguardError(f"restart time must be >= 0, got {R}")


def optimal_period(d: float, M: float, R: float) -> float:
    """Availability-optimal checkpoint period ``T* = d + sqrt(2 d (M + R) + d^2)`` (includes the save)."""
    _check(d, M, R)
    if math.isinf(M):
        return math.inf
    return d + math.sqrt(2.0 * d * (M + R) + d * d)


def young_period(d: float, M: float) -> float:
    """Young (1974): ``sqrt(2 d M)``."""
    return math.sqrt(2.0 * d * M)


def availability(T: float, d: float, M: float, R: float) -> float:
    """``A(T) = (T - d)/T * M / (M + R + T/2)``; 0 when ``T <= d``; 1 for ``M = inf`` and ``T = inf``."""
    _check(d, M, R)
    if math.isinf(M):
        return 1.0 if math.isinf(T) else (T - d) / T
    if T <= d:
        return 0.0
    return (T - d) / T * M / (M + R + T / 2.0)


def optimal_availability(d: float, M: float, R: float) -> float:
    return availability(optimal_period(d, M, R), d, M, R)


@dataclass
class CheckpointPlan:
    save_s: float
    mtbf_s: float
    restart_s: float
    period_s: float
    availability: float
    young_period_s: float
    availability_at_young: float

    def as_dict(self) -> dict:
        return asdict(self)


def plan_checkpoint(d: float, M: float, R: float) -> CheckpointPlan:
    """Period and availability for save time ``d``, system MTBF ``M`` and restart ``R`` (seconds)."""
    T = optimal_period(d, M, R)
    Ty = young_period(d, M)
    return CheckpointPlan(d, M, R, T, availability(T, d, M, R), Ty, availability(max(Ty, d * (1 + 1e-9)), d, M, R))
