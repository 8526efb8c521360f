"""Inject faults anywhere in a training step and record each one.

Sites:

* ``OpSite``: the output of an ATen op chosen by name pattern (``fnmatch`` on ``aten.mm.default`` style
  names), phase (``forward``, ``recompute``, ``backward``, ``optimizer`` or ``any``), occurrence number
  among the matching ops of that phase within the step, and element index (``None``: seeded random).
  One ``TorchDispatchMode`` active for the whole step sees every op, including those autograd runs in
  ``loss.backward()`` and those inside ``optimizer.step()`` (DESIGN.md, checked on torch 2.13 CPU).
* ``ModuleSite``: a module's output (forward hook), by module-name pattern and occurrence.
* ``ProductSite``: a named attention product (``q k v scores context output``, or a backward product of a
  protected kernel) of one layer or any, by occurrence; reached through the model's product hooks
  (:mod:`trainguard.models.products`), so it is the same site with or without ABFT installed.
* ``TensorSite``: a parameter (before the forward), a gradient or an optimizer-state tensor (after
  backward, before the optimizer step), by name pattern.

Phase tracking (why it is robust): ``backward`` is "inside an autograd graph task"
(``torch._C._current_graph_task_id() != -1``), which holds for every op the engine runs, whatever the
loss; ``recompute`` is set by the recompute context that ``checkpoint_context_fn()`` hands to
``torch.utils.checkpoint`` (non-reentrant checkpointing replays the forward inside backward);
``optimizer`` is the update stage: with a Trainer, from the end of its forward/backward (the trainer's
``on_stage`` callback) to the end of the optimizer step, so gradient clipping is in it, as the DMR engine counts
it; in a custom loop, the optimizer's step pre/post hooks (or ``with injector.phase("optimizer")``). Anything
else in the step is ``forward``.

Checker executions of a redundancy scheme (DMR runs every op twice) are not ops of the step: inside
``with checker_execution():`` the injector neither counts nor corrupts. ``attach`` puts the injector's
mode *outermost* among the trainer's step contexts, so a verifier's mode entered later sits inside it:
the verifier's primary execution passes through the injector (and may be corrupted, as real hardware
would corrupt it) before the verifier compares it with its checker execution. An ``OpSite(verifier=True)``
does the opposite: it counts and strikes only the verifier's own ops (its checker executions, copies,
fingerprints), phase "any" and recorded as phase ``verifier``, to test that a fault in the checker never
corrupts the state it guards. A verifier that runs checkers on another thread enters the modes around its own
on that thread (the DMR engine's window worker does) so the injector sees them there too.

For an in-place op (the fused AdamW update, ``add_``) the fault goes into one of the tensors it writes.

Use with a Trainer: ``injector.attach(trainer)``; in a custom loop: ``injector.attach_model(model,
optimizer)`` then ``with injector.step_context(step): ...`` around forward, backward and step.
Relies on torch (``TorchDispatchMode``, module and optimizer hooks).
"""

from __future__ import annotations

import contextlib
import fnmatch
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainguard.errors import TrainguardError
from trainguard.faults.bits import FaultModel, random_index
from trainguard.models.products import product_hooks
from trainguard.train.activation_checkpoint import add_checkpoint_context
from trainguard.utils.threadflag import ThreadFlag

PHASES = ("forward", "recompute", "backward", "optimizer", "any")


@dataclass
class OpSite:
    pattern: str = "aten.mm*"
    phase: str = "forward"
    occurrence: int = 0
    compute_only: bool = False  # count only ops that compute (not views, allocations or communication)
    # strike a verifier's own work instead of the step's ops: its second executions, copies and fingerprints
    # (inside ``checker_execution()``), on whatever thread it runs them. Hardware corrupts those as readily; a
    # verifier must then still end with a correct state. Such ops have no phase of their own: ``phase`` is "any"
    verifier: bool = False

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise TrainguardError(f"unknown phase {self.phase!r} (choose from {', '.join(PHASES)})")
        if self.occurrence < 0:
            raise TrainguardError(f"occurrence must be >= 0, got {self.occurrence}")
        if self.verifier and self.phase != "any":
            raise TrainguardError(f"a verifier op site counts the verifier's own ops, which have no phase: use phase "
                                  f"'any', not {self.phase!r}")


@dataclass
class ModuleSite:
    pattern: str = "*"  # module name in model.named_modules(), fnmatch
    occurrence: int = 0


@dataclass
class ProductSite:
    product: str = "scores"  # product name, fnmatch (q k v scores context output, or backward names)
    layer: int | None = None  # None: any layer
    occurrence: int = 0  # among the matching products of the step

    def __post_init__(self) -> None:
        if self.occurrence < 0:
            raise TrainguardError(f"occurrence must be >= 0, got {self.occurrence}")


@dataclass
class TensorSite:
    target: str = "param"  # param | grad | optimizer-state
    pattern: str = "*"  # parameter name, fnmatch
    state_key: str = "exp_avg"  # optimizer-state entry (AdamW: exp_avg, exp_avg_sq)

    def __post_init__(self) -> None:
        if self.target not in ("param", "grad", "optimizer-state"):
            raise TrainguardError(f"unknown tensor site {self.target!r} (param, grad or optimizer-state)")


Site = OpSite | ModuleSite | ProductSite | TensorSite


@dataclass
class Fault:
    site: Site
    model: FaultModel = field(default_factory=FaultModel)
    step: int = 0  # the step in which to inject (each fault fires once)
    index: int | None = None  # flat element index; None: drawn from the injector's seeded generator
    persistent: bool = False  # a stuck unit: fires again on every re-execution of its step (same index)


@dataclass
class InjectionRecord:
    step: int
    site: str  # op | module | product | param | grad | optimizer-state
    target: str  # op name, module name or tensor name
    phase: str
    occurrence: int
    index: int
    dtype: str
    old: float
    new: float
    bit: int | None
    kind: str
    thread: str = "main"  # "main", or "worker": another thread of the process (a verifier's window worker)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("old", "new"):
            d[k] = repr(d[k]) if d[k] != d[k] or d[k] in (float("inf"), float("-inf")) else d[k]
        return d


_CHECKER = ThreadFlag()
_NOT_COMPUTE = ("aten.detach", "aten._unsafe_view", "aten.alias", "aten.lift_fresh", "aten.empty", "aten.new_empty",
                "aten.set_")  # (set_: a tensor takes another storage, no value is computed)


def is_compute_op(func) -> bool:
    """Ops that compute values (not views, allocations, communication or profiler markers)."""
    name = str(func)
    if getattr(func, "is_view", False) or name.startswith(_NOT_COMPUTE):
        return False
    return not name.startswith(("c10d", "_c10d_functional", "profiler", "_dtensor"))


_INJECTING = ThreadFlag()


def injecting() -> bool:
    """True while an injector writes a fault (its own reads and writes are not ops of the step: a verifier
    such as DMR must not record them as part of the computation it checks)."""
    return _INJECTING.active


def checker_execution(active: bool = True) -> contextlib.AbstractContextManager[None]:
    """Ops run inside are a verifier's own work (second executions, copies, fingerprints): the injector
    neither counts nor corrupts them. ``checker_execution(False)`` marks the primary execution inside."""
    return _CHECKER.set(active)


def _written_tensor(func, args, kwargs, generator: torch.Generator) -> torch.Tensor | None:
    """One floating-point tensor an in-place op writes (drawn with ``generator`` when it writes several)."""
    written: list[torch.Tensor] = []
    fused_adam = str(func).startswith(("aten._fused_adam", "aten._fused_sgd"))
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        if fused_adam and a.name == "grads" and kwargs.get("grad_scale") is None:
            continue  # the fused optimizers write the gradients only to unscale them (grad_scale)
        value = kwargs.get(a.name, args[i] if i < len(args) else None)
        items = value if isinstance(value, (list, tuple)) else [value]
        written += [t for t in items if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    if not written:
        return None
    if generator is None:  # (only asking whether there is one)
        return written[0]
    return written[int(torch.randint(len(written), (1,), generator=generator))]


def _returned(out: Any) -> list[torch.Tensor]:
    """The floating-point tensors an op returns as a list or tuple: an out-of-place list op's (``_foreach_norm``,
    ``_foreach_mul``...), fused attention's (output, log-sum-exp), a backward kernel's gradients (input, weight,
    bias; None where not asked for). One of them, drawn, is the op's result to corrupt."""
    if not isinstance(out, (list, tuple)):
        return []
    return [t for t in out if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]


def _drawn(out: list[torch.Tensor], generator: torch.Generator) -> torch.Tensor:
    return out[int(torch.randint(len(out), (1,), generator=generator))]


# injectors inside their step context: the DMR engine sends view ops past every Python dispatch mode while it
# verifies an attempt (sdc.dmr.ops.views_past_python), except the ops an active injector's op sites count
_ACTIVE: list[Injector] = []


def patterns_counting_views() -> list[str]:
    """The op patterns of active injectors' op sites that count views too (``compute_only`` off)."""
    return [f.site.pattern for inj in _ACTIVE for f in inj.faults if isinstance(f.site, OpSite)
            and not f.site.compute_only]


class _OpMode(TorchDispatchMode):
    def __init__(self, injector: Injector):
        super().__init__()
        self.injector = injector

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.injector._on_op(func, out, args, kwargs)
        return out


def _examples(names: list[str], most: int = 3) -> str:
    """A few of the names a pattern could have matched, for a one-line error."""
    if not names:
        return "the model has none"
    return "names look like " + ", ".join(repr(n) for n in names[:most]) + (", ..." if len(names) > most else "")


class Injector:
    """Holds faults, fires each once at its site, and records what it did (``records``)."""

    def __init__(self, faults: list[Fault] | Fault, seed: int = 0):
        # a tuple: what attach() wires (module hooks, product hooks, whether the verifier's ops are looked at) is
        # decided from the faults given here, so a fault added later would silently never fire
        self.faults: tuple[Fault, ...] = (faults,) if isinstance(faults, Fault) else tuple(faults)
        self.generator = torch.Generator().manual_seed(seed)
        self.records: list[InjectionRecord] = []
        self.fired: set[int] = set()
        self.step: int | None = None
        self._optimizer_phase = False
        self._update_stage = False  # a Trainer's update stage (clipping, optimizer): see on_stage
        self._recompute_depth = 0
        self._counts: dict[tuple[int, str], int] = {}
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._handles: list[Callable[[], Any]] = []  # removers
        self._injecting = False  # our own writes are not ops of the step
        self.count_ops = False  # count compute ops per (step, phase) in op_counts (campaigns size their sites)
        self.op_counts: dict[tuple[int, str], int] = {}
        self._fired_attempt: set[int] = set()
        self._stuck: dict[int, int] = {}
        # a verifier's own ops pass the injector only where a site strikes them or they are counted (op_counts'
        # phase "verifier"); otherwise they return at once, as before there were such sites
        self.count_verifier = False
        self._verifier_sites = any(isinstance(f.site, OpSite) and f.site.verifier for f in self.faults)

    # ---- wiring -------------------------------------------------------------------------------------
    def attach(self, trainer) -> Injector:
        self.attach_model(trainer.model, trainer.optimizer)
        trainer.step_contexts.insert(0, self.step_context)  # outermost: faults happen below any verifier
        trainer.callbacks.append(self)  # (on_stage: where the update stage starts)
        self._handles.append(lambda: trainer.callbacks.remove(self) if self in trainer.callbacks else None)
        return self

    def on_stage(self, trainer, stage: str, step: int) -> None:
        """The Trainer's stage callback: what follows its forward/backward (clipping, then the optimizer step) is
        the ``optimizer`` phase; a retried attempt starts over in ``step_context``."""
        if stage == "forward_backward":
            self._update_stage = True
        elif stage == "update":
            self._update_stage = False

    def attach_model(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Injector:
        self._model, self._optimizer = model, optimizer
        names = dict(model.named_modules())
        # Modules under activation checkpointing: label their recompute's ops (composes with other users).
        self._handles.append(add_checkpoint_context(model, self.checkpoint_context_fn()))
        for i, f in enumerate(self.faults):
            if isinstance(f.site, ModuleSite):
                matched = [n for n in names if n and fnmatch.fnmatchcase(n, f.site.pattern)]
                if not matched:
                    raise TrainguardError(f"no module matches {f.site.pattern!r} ({_examples([n for n in names if n])})")
                for n in matched:
                    self._handles.append(names[n].register_forward_hook(self._module_hook(i, n)).remove)
            if isinstance(f.site, TensorSite):
                if f.site.target != "param" and optimizer is None:
                    raise TrainguardError(f"a {f.site.target} site needs the optimizer (attach_model(model, optimizer))")
                # (a typo in the pattern would otherwise leave every trial unreached, counted as masked)
                params = [n for n, _ in model.named_parameters()]
                if not any(fnmatch.fnmatchcase(n, f.site.pattern) for n in params):
                    raise TrainguardError(f"no parameter matches {f.site.pattern!r} ({_examples(params)})")
        if any(isinstance(f.site, ProductSite) for f in self.faults):
            self._handles.append(product_hooks(model).add(self._on_product))
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._pre_step).remove)
            self._handles.append(optimizer.register_step_post_hook(self._post_step).remove)
        return self

    def detach(self) -> None:
        for remove in self._handles:
            remove()
        self._handles.clear()

    @contextlib.contextmanager
    def step_context(self, step: int) -> Iterator[None]:
        """Active around forward + backward + optimizer step of ``step``."""
        self.step, self._counts, self._fired_attempt = step, {}, set()
        self._update_stage = False
        self._fire_tensor_sites("param")
        _ACTIVE.append(self)
        try:
            with _OpMode(self):
                yield
        finally:
            _ACTIVE.remove(self)
            self._update_stage = False
        self.step = None

    def checkpoint_context_fn(self):
        """For ``torch.utils.checkpoint(..., context_fn=...)``: labels the recompute's ops ``recompute``."""
        return lambda: (contextlib.nullcontext(), self._recompute())

    @contextlib.contextmanager
    def _recompute(self) -> Iterator[None]:
        self._recompute_depth += 1
        try:
            yield
        finally:
            self._recompute_depth -= 1

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Explicit phase for custom loops (``optimizer`` only; the others are detected)."""
        if name != "optimizer":
            yield
            return
        self._optimizer_phase = True
        try:
            yield
        finally:
            self._optimizer_phase = False

    # ---- phase ----------------------------------------------------------------------------------------
    def current_phase(self) -> str:
        if self._optimizer_phase or self._update_stage:
            return "optimizer"
        if self._recompute_depth:
            return "recompute"
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        return "forward"

    def _pre_step(self, optimizer, args, kwargs) -> None:
        self._fire_tensor_sites("grad")
        self._fire_tensor_sites("optimizer-state")
        self._optimizer_phase = True

    def _post_step(self, optimizer, args, kwargs) -> None:
        self._optimizer_phase = False

    # ---- firing ---------------------------------------------------------------------------------------
    def _due(self, i: int, f: Fault) -> bool:
        if self.step is None or f.step != self.step:
            return False
        return i not in (self._fired_attempt if f.persistent else self.fired)

    def _corrupt(self, i: int, f: Fault, tensor: torch.Tensor, site: str, target: str, phase: str, occ: int) -> None:
        index = f.index if f.index is not None else self._stuck.get(i)
        if index is None or index >= tensor.numel():
            index = random_index(tensor, self.generator)
        self._injecting = _INJECTING.active = True
        try:
            old, new, bit = f.model.apply(tensor, index, self.generator)
        finally:
            self._injecting = _INJECTING.active = False
        self.fired.add(i)
        self._fired_attempt.add(i)
        if f.persistent:  # the same element every time, as a stuck unit would
            self._stuck[i] = index
        thread = "main" if threading.current_thread() is threading.main_thread() else "worker"
        self.records.append(InjectionRecord(self.step, site, target, phase, occ, index, str(tensor.dtype).replace("torch.", ""),
                                            old, new, bit, f.model.kind, thread))

    def _on_op(self, func, out, args=(), kwargs=None) -> None:
        if self.step is None or self._injecting:
            return
        verifier = _CHECKER.active
        if verifier and not (self._verifier_sites or self.count_verifier):
            return
        if isinstance(out, torch.Tensor):
            if not out.is_floating_point():
                return
        elif out is None or isinstance(out, (list, tuple)):
            if not _returned(out) and _written_tensor(func, args, kwargs or {}, None) is None:
                return  # nothing floating-point it writes or returns
        else:
            return
        name = str(func)  # e.g. "aten.mm.default"
        compute = is_compute_op(func)
        phase = None
        if verifier:  # (its own thread may be a worker's: the step's phase does not apply)
            phase = "verifier"
        if (self.count_verifier if verifier else self.count_ops) and compute:
            phase = phase or self.current_phase()
            self.op_counts[(self.step, phase)] = self.op_counts.get((self.step, phase), 0) + 1
        for i, f in enumerate(self.faults):
            if not isinstance(f.site, OpSite) or f.site.verifier != verifier or not self._due(i, f) or \
                    (f.site.compute_only and not compute):
                continue
            if not fnmatch.fnmatchcase(name, f.site.pattern):
                continue
            phase = phase or self.current_phase()
            if f.site.phase not in ("any", phase):
                continue
            key = (i, phase if f.site.phase != "any" else "any")
            occ = self._counts.get(key, 0)
            self._counts[key] = occ + 1
            if occ != f.site.occurrence:
                continue
            if isinstance(out, torch.Tensor):
                target = out
            elif returned := _returned(out):
                target = _drawn(returned, self.generator)
            else:
                target = _written_tensor(func, args, kwargs or {}, self.generator)
            if target is not None and target.is_floating_point() and target.numel():
                self._corrupt(i, f, target, "op", name, phase, occ)

    def _on_product(self, layer: int, name: str, tensor: torch.Tensor) -> None:
        if self.step is None or not tensor.is_floating_point() or not tensor.numel():
            return
        for i, f in enumerate(self.faults):
            site = f.site
            if not isinstance(site, ProductSite) or not self._due(i, f) or not fnmatch.fnmatchcase(name, site.product):
                continue
            if site.layer is not None and site.layer != layer:
                continue
            key = (i, "product")
            occ = self._counts.get(key, 0)
            self._counts[key] = occ + 1
            if occ == site.occurrence:
                self._corrupt(i, f, tensor, "product", f"layers.{layer}.{name}", self.current_phase(), occ)

    def _module_hook(self, i: int, name: str):
        def hook(module, inputs, output):
            f = self.faults[i]
            if not self._due(i, f) or not isinstance(output, torch.Tensor):
                return None
            key = (i, "module")
            occ = self._counts.get(key, 0)
            self._counts[key] = occ + 1
            if occ == f.site.occurrence:
                with torch.no_grad():
                    self._corrupt(i, f, output, "module", name, self.current_phase(), occ)
            return None

        return hook

    def _fire_tensor_sites(self, target: str) -> None:
        if self._model is None:
            return
        for i, f in enumerate(self.faults):
            if not isinstance(f.site, TensorSite) or f.site.target != target or not self._due(i, f):
                continue
            for pname, p in self._model.named_parameters():
                if not fnmatch.fnmatchcase(pname, f.site.pattern):
                    continue
                if target == "param":
                    tensor = p
                elif target == "grad":
                    tensor = p.grad
                else:
                    tensor = self._optimizer.state.get(p, {}).get(f.site.state_key) if self._optimizer else None
                if tensor is None or not torch.is_tensor(tensor) or not tensor.is_floating_point():
                    continue
                with torch.no_grad():
                    self._corrupt(i, f, tensor, target, pname if target != "optimizer-state" else f"{pname}.{f.site.state_key}",
                                  "optimizer" if target != "param" else "forward", 0)
                break

    def unfired(self) -> list[Fault]:
        """Faults whose site was never reached (a campaign reports these, never drops them silently)."""
        return [f for i, f in enumerate(self.faults) if i not in self.fired]
