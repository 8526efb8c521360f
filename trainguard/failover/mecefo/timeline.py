"""Failures of a run, per training step: which worker fails at which step, and when it is back.

A :class:`FailureTimeline` is built from a failure preset of :mod:`trainguard.faults.schedules` (``low`` / ``mid`` /
``high``: one failure of the job every 2 h / 1 h / 0.5 h of modelled time, each hitting a uniformly random worker):
the run's ``steps`` are spread over ``hours`` of modelled time, a failure at modelled time ``t`` takes its worker
out from step ``floor(t / step_time)``, and the worker is back ``recovery_min`` modelled minutes later. A
failure that hits a worker that is already down, or that would leave no worker up, is absorbed (counted, not
applied). Every failure is **simulated** (the gradient-sync policy treats the worker as gone for those steps:
it stays in the torchft quorum and computes nothing) unless marked **real**: then the launcher's worker is
``SIGKILL``\\ ed in the middle of that step and a new process rejoins (heals from a peer) when it is back.

The policies read :meth:`FailureTimeline.down` (simulated failures covering a step) and
:meth:`FailureTimeline.starting` (failures that begin at a step). Relies on numpy (through the schedules).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainguard.errors import TrainguardError
from trainguard.faults.schedules import PRESETS_MTBF_HOURS, FailureSchedule

PRESETS = ("none", *PRESETS_MTBF_HOURS)


@dataclass(frozen=True)
class Failure:
    """Worker ``node`` misses steps ``[step, until)``; ``real``: killed for real mid-step (else simulated)."""

    node: int
    step: int
    until: int
    real: bool = False

    def covers(self, step: int) -> bool:
        return self.step <= step < self.until


@dataclass
class FailureTimeline:
    failures: tuple[Failure, ...] = ()
    absorbed: int = 0  # failures of the schedule that hit a worker already down (or the last one up)
    step_s: float = 0.0  # modelled seconds per step (0: not built from a schedule)
    info: dict = field(default_factory=dict)

    def down(self, step: int) -> frozenset[int]:
        """Workers under a simulated failure at ``step``."""
        return frozenset(f.node for f in self.failures if not f.real and f.covers(step))

    def starting(self, step: int) -> list[Failure]:
        return [f for f in self.failures if f.step == step]

    def simulated(self) -> list[Failure]:
        return [f for f in self.failures if not f.real]

    def real(self) -> list[Failure]:
        return [f for f in self.failures if f.real]

    def without(self, gone: list[Failure] | tuple[Failure, ...]) -> FailureTimeline:
        """The same timeline less ``gone`` (failures that already happened, before a global restart)."""
        rest = tuple(f for f in self.failures if f not in set(gone))
        return FailureTimeline(rest, self.absorbed, self.step_s, dict(self.info))

    def degraded_steps(self, steps: int) -> int:
        """Steps with at least one worker out."""
        return sum(1 for s in range(steps) if any(f.covers(s) for f in self.failures))

    def summary(self, steps: int) -> dict:
        return {"failures": len(self.failures), "real": len(self.real()), "simulated": len(self.simulated()),
                "absorbed": self.absorbed, "steps_with_a_worker_out": self.degraded_steps(steps),
                "modelled_step_s": round(self.step_s, 3),
                "events": [{"node": f.node, "step": f.step, "until": f.until, "real": f.real} for f in self.failures],
                **self.info}

    @classmethod
    def from_preset(cls, preset: str, nodes: int, steps: int, hours: float, recovery_min: float, seed: int = 0,
                    real: int = 0) -> FailureTimeline:
        """The preset's failures over ``hours`` of modelled time mapped onto ``steps`` steps of ``nodes`` workers;
        the first ``real`` applied failures (that start at step >= 1) are real kills."""
        if preset not in PRESETS:
            raise TrainguardError(f"unknown failure preset {preset!r} (choose from {', '.join(PRESETS)})")
        if nodes < 2:
            raise TrainguardError(f"a failure timeline needs at least 2 workers, got {nodes}")
        if steps < 1 or not hours > 0 or not recovery_min > 0:
            raise TrainguardError(f"failure timeline: steps, hours and recovery_min must be > 0 "
                                  f"(got {steps}, {hours}, {recovery_min})")
        if real < 0:
            raise TrainguardError(f"failure timeline: real kills must be >= 0, got {real}")
        step_s = hours * 3600.0 / steps
        info = {"preset": preset, "hours": hours, "recovery_min": recovery_min, "seed": seed}
        if preset == "none":
            return cls((), 0, step_s, info)
        events = FailureSchedule.preset(preset, seed=seed).events(nodes, hours)
        back = max(1, math.ceil(recovery_min * 60.0 / step_s))
        out: list[Failure] = []
        absorbed = 0
        for t, node in events:
            step = int(t * 3600.0 / step_s)
            if step >= steps:
                continue
            down = {f.node for f in out if f.covers(step)}
            if node in down or len(down) + 1 >= nodes:
                absorbed += 1
                continue
            is_real = real > 0 and step >= 1 and sum(f.real for f in out) < real
            out.append(Failure(node, step, step + back, is_real))
        return cls(tuple(out), absorbed, step_s, info)

    @classmethod
    def of(cls, *failures: Failure) -> FailureTimeline:
        return cls(tuple(failures))


__all__ = ["PRESETS", "Failure", "FailureTimeline"]
