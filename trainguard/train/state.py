"""Stateful components registered with the Trainer, and what a step retry restores.

A technique that keeps state across steps (a detector's per-step schedule, a low-rank basis refreshed
every few steps, ...) registers it: ``trainer.register_state("mecefo", obj)`` with ``obj.state_dict()`` /
``obj.load_state_dict(sd)``. The trainer then

* snapshots it at the start of every guarded step and restores it when a guard asks for a retry;
* saves it in checkpoints and loads it on resume;
* includes it in ``Trainer.state_dict()`` (the state a healing elastic replica receives).

:class:`StepStart` is the cheap part of a retry snapshot: RNG states and registered components, captured
at the start of a step. Parameters and optimizer state are only copied (by
:func:`trainguard.train.snapshot.capture`) when a guard inspects the update. Relies on torch only.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from trainguard.errors import TrainguardError
from trainguard.train.snapshot import rng_state, set_rng_state


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def copy_state(value: Any) -> Any:
    """A deep copy of a state dict (tensors cloned)."""
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: copy_state(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(copy_state(v) for v in value)
    return copy.deepcopy(value)


class StateRegistry:
    """Named stateful components, in registration order."""

    def __init__(self) -> None:
        self._items: dict[str, Stateful] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def names(self) -> list[str]:
        return list(self._items)

    def register(self, name: str, component: Stateful) -> Callable[[], None]:
        if not isinstance(component, Stateful):
            raise TrainguardError(f"state component {name!r} needs state_dict() and load_state_dict()")
        if name in self._items:
            raise TrainguardError(f"a state component named {name!r} is already registered")
        self._items[name] = component
        return lambda: self._items.pop(name, None)

    def state_dict(self) -> dict[str, Any]:
        return {name: c.state_dict() for name, c in self._items.items()}

    def snapshot(self) -> dict[str, Any]:
        """A copy that later changes to the components do not reach."""
        return {name: copy_state(c.state_dict()) for name, c in self._items.items()}

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> list[str]:
        """Load what ``state`` holds; returns the registered names it did not hold (an error when strict)."""
        missing = [n for n in self._items if n not in state]
        if strict and missing:
            raise TrainguardError(f"saved state lacks the registered component(s) {', '.join(missing)}")
        for name, c in self._items.items():
            if name in state:
                c.load_state_dict(copy_state(state[name]))
        return missing


@dataclass
class StepStart:
    """RNG and registered components at the start of a step (what every retry restores)."""

    step: int
    rng: dict[str, Any]
    components: dict[str, Any]

    @classmethod
    def capture(cls, step: int, registry: StateRegistry) -> StepStart:
        return cls(step, rng_state(), registry.snapshot())

    def restore(self, registry: StateRegistry) -> None:
        set_rng_state(self.rng)
        registry.load_state_dict(self.components, strict=False)
