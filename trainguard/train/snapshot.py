"""In-memory step snapshots for rollback-and-re-execute.

A ``StepSnapshot`` holds copies of everything a training step reads or changes: parameters, buffers,
optimizer state and hyper-parameters, scheduler state, the data cursor (next step index) and the RNG
states (torch CPU, CUDA if present, Python ``random``, NumPy). Restoring it and re-running the step gives
bitwise the state of a run that never faulted. Restores copy in place, so tensors the optimizer or a
verifier holds stay valid. Relies on torch only.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class StepSnapshot:
    step: int
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    optim_state: dict[int, dict[str, Any]]  # keyed by position of the param in the optimizer's groups
    optim_groups: list[dict[str, Any]]  # hyper-parameters of each group (lr, betas, ...)
    scheduler: dict[str, Any] | None
    rng: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)

    def nbytes(self) -> int:
        tensors = list(self.params.values()) + list(self.buffers.values())
        tensors += [v for s in self.optim_state.values() for v in s.values() if torch.is_tensor(v)]
        return sum(t.numel() * t.element_size() for t in tensors)


def _clone(v: Any) -> Any:
    return v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def _optim_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def capture(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler=None, step: int = 0,
            extra: dict[str, Any] | None = None) -> StepSnapshot:
    with torch.no_grad():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        optim_state = {}
        for i, p in enumerate(_optim_params(optimizer)):
            if p in optimizer.state:
                optim_state[i] = {k: _clone(v) for k, v in optimizer.state[p].items()}
    groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    sched = copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None
    return StepSnapshot(step, params, buffers, optim_state, groups, sched, rng_state(), dict(extra or {}))


def restore(snap: StepSnapshot, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler=None) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(snap.params[n])
            p.grad = None
        for n, b in model.named_buffers():
            if n in snap.buffers:
                b.copy_(snap.buffers[n])
        params = _optim_params(optimizer)
        for i, p in enumerate(params):
            saved = snap.optim_state.get(i)
            if saved is None:
                optimizer.state.pop(p, None)
                continue
            live = optimizer.state.get(p)
            if live is not None and live.keys() == saved.keys() and all(
                torch.is_tensor(live[k]) == torch.is_tensor(saved[k])
                and (not torch.is_tensor(live[k]) or live[k].shape == saved[k].shape) for k in saved
            ):
                for k, v in saved.items():
                    if torch.is_tensor(v):
                        live[k].copy_(v)
                    else:
                        live[k] = copy.deepcopy(v)
            else:
                optimizer.state[p] = {k: _clone(v) for k, v in saved.items()}
    for g, saved in zip(optimizer.param_groups, snap.optim_groups):
        for k, v in saved.items():
            g[k] = copy.deepcopy(v)
    if scheduler is not None and snap.scheduler is not None:
        scheduler.load_state_dict(copy.deepcopy(snap.scheduler))
    set_rng_state(snap.rng)


def capture_counters(optimizer: torch.optim.Optimizer, scheduler=None) -> dict[str, Any]:
    """What a rewind restores besides the parameters and the optimizer's tensor state (which the guard that asks
    for it keeps): the scheduler, the optimizer's hyper-parameters, its scalar state (step counters) and which
    parameters have state at all. Small: taken at every step's start when some guard may rewind."""
    scalars = {(gi, pi, k): v.detach().clone() for gi, g in enumerate(optimizer.param_groups)
               for pi, p in enumerate(g["params"]) for k, v in optimizer.state.get(p, {}).items()
               if torch.is_tensor(v) and v.numel() <= 1}
    has_state = {(gi, pi) for gi, g in enumerate(optimizer.param_groups) for pi, p in enumerate(g["params"])
                 if optimizer.state.get(p)}
    groups = [{k: _clone(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    sched = _clone(scheduler.state_dict()) if scheduler is not None else None
    return {"scalars": scalars, "has_state": has_state, "groups": groups, "scheduler": sched}


def restore_counters(saved: dict[str, Any], optimizer: torch.optim.Optimizer, scheduler=None) -> None:
    for gi, (g, hyper) in enumerate(zip(optimizer.param_groups, saved["groups"])):
        g.update({k: _clone(v) for k, v in hyper.items()})
        for pi, p in enumerate(g["params"]):
            if (gi, pi) not in saved["has_state"]:
                optimizer.state.pop(p, None)  # created by the update being undone
    with torch.no_grad():
        for (gi, pi, k), v in saved["scalars"].items():
            optimizer.state[optimizer.param_groups[gi]["params"][pi]][k].copy_(v)
    if saved["scheduler"] is not None:
        scheduler.load_state_dict(_clone(saved["scheduler"]))
